"""Real fMRI: dpneuro's maps against nilearn's CanICA, and the privacy-utility frontier on pseudo-consortia.

Data: region time series of 33 people (OpenNeuro ds000140, heat-pain task runs 3
and 7, 122 regions of the MIST/BASC atlas, TR 2 s; pip package
``connattractor``, read by ``benchmarks/_real_data.py``). Every subject is
prepared as a site prepares it (``dpneuro.data.load.preprocess``: each region z-scored
within the run); capePCA then scales every time point to unit norm.

1. Agreement with CanICA. The 33 people split over 4 sites (9, 8, 8, 8), 20
   components, no noise (plan none), against nilearn's CanICA on the series
   painted into the atlas on the 6 mm MNI grid as 4-D images (the tool users
   know). dpneuro twice: on the same images (every voxel a feature, as CanICA
   reads them; the exact PCA, streamed at this D), and on the 122 regions as
   features, painted. Mean matched |r| over the atlas voxels. The two differ
   because over voxels a region weighs as much as it has voxels (18-121).
2. Frontier. Pseudo-consortia of 4 sites x {50, 100, 250, 500} subjects: each
   pseudo-subject is one of the 33 people, drawn with replacement, and a random
   150-volume window of one of its two runs (so two draws of one person are
   rarely the same data). For each size the non-private maps of the same
   method (plan none) are the reference; for each total eps (headline: against
   the aggregator and its colluders, every stage, delta 1e-5; the budget
   planner splits it) and way a subject enters the PCA (its second moment,
   with or without a subject bound, or its own principal subspace; temporal
   ICA also with the cumulant unmixing instead of capeDJICA's rounds), 3 noise
   seeds: mean matched |r| of the private maps with the reference, median and
   worst.
3. For the default run only: more sizes (150 to 1000 subjects per site) at eps
   1, 2 and 4, the consortium a budget needs for maps at 0.8; and unequal
   sites (30/60/90/120 subjects) against equal ones of the same total (75 each).

What it does not show: bootstrapped subjects repeat 33 people, so the
non-private reference is more stable than a real consortium of that size; the
eps a real consortium of M people per site needs is what the frontier shows at M.

    python benchmarks/real_frontier.py            # full: ~15 min on 2 cores
    python benchmarks/real_frontier.py --quick    # smoke run (writes *_quick.*)

Writes benchmarks/results/real_frontier.{csv,json} and real_frontier.png.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import base_config, figure, mean_r, run_maps, write_results  # noqa: E402

from dpneuro.config import ConfigError, RunConfig  # noqa: E402
from dpneuro.privacy.rmt import components_above_edge  # noqa: E402
from dpneuro.run.planner import SiteShape, plan_for_target  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SUBJECTS = (50, 100, 250, 500)
#: more sizes for the default run only, at the low budgets: the consortium a budget needs for maps at 0.8
SWEEP, SWEEP_EPSILONS = (150, 350, 750, 1000), (1.0, 2.0, 4.0)
#: unequal sites against equal ones of the same total (the default run): CAPE's weights n_s / N
UNEQUAL, EQUAL = (30, 60, 90, 120), (75, 75, 75, 75)
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0)
DEFAULT_BOUND = RunConfig.__dataclass_fields__["pca_subject_bound"].default
#: ablation of the spatial ICA: one FastICA run from one public start instead of the product's stable ICA
SINGLE = "single FastICA"
#: (ICA model, the PCA's subject contribution, subject bound[, temporal unmixing]) measured at every size and budget
RUNS = (("spatial", "moment", 1.0), ("spatial", "moment", DEFAULT_BOUND), ("spatial", "subspace", DEFAULT_BOUND),
        ("spatial", "subspace", DEFAULT_BOUND, SINGLE), ("temporal", "moment", 1.0), ("temporal", "moment", DEFAULT_BOUND), ("temporal", "subspace", DEFAULT_BOUND),
        ("temporal", "subspace", DEFAULT_BOUND, "cumulant"))


def _model(run) -> tuple[str, str, str]:
    """(ICA model, contribution, temporal unmixing) of a RUNS entry."""
    return run[0], run[1], run[3] if len(run) > 3 else "capedjica"


def _label(ica: str, unmixing: str) -> str:
    return ica if unmixing == "capedjica" else f"{ica}, {unmixing}"


def _settings(ica: str, unmixing: str) -> tuple[dict, dict | None]:
    """(config fields, spatial_ica options) of a RUNS entry's ICA."""
    if unmixing == SINGLE:
        return {}, {"n_init": 1}
    return {"ica_unmixing": unmixing}, None
TEMPORAL_MAX_SUBJECTS = 250
N_SITES, N_COMPONENTS, WINDOW = 4, 20, 150


#: the product's defaults: spatial ICA on subject subspaces
DEFAULT_RUN = ("spatial", "subspace", DEFAULT_BOUND)


def site_label(sizes) -> str:
    """``equal`` or the subjects of each site (``30/60/90/120``)."""
    return "equal" if len(set(sizes)) == 1 else "/".join(str(m) for m in sizes)


def private_rows(tmp: Path, X_sites, lengths, run, epsilons, seeds, D: int, reference=None) -> list[dict]:
    """Rows of one consortium and RUNS entry: per total eps the private maps against the same method's
    non-private maps (median and worst over ``seeds``); with ``reference`` (the real people's maps) first a row
    comparing the non-private maps with it."""
    (ica, con, um), bound = _model(run), run[2]
    fields, spatial = _settings(ica, um)
    kw = dict(ica=ica, pca_contribution=con, pca_subject_bound=bound, parcels=0, **fields)
    n_sites = len(X_sites)
    ref = run_maps(base_config(tmp, n_sites, plan="none", seed=0, **kw), X_sites, lengths, spatial_options=spatial)
    sizes = [len(ln) for ln in lengths]
    row0 = {"subjects": sum(sizes) // n_sites, "sites": site_label(sizes), "ica": _label(ica, um),
            "contribution": con, "bound": bound}
    rows = []
    if reference is not None:
        rows.append({**row0, "epsilon": "none", "r_median": mean_r(ref, reference), "r_min": "", "pca_epsilon": "",
                     "above_edge": "", "seeds": 1, "reference": "real 33"})
        print(rows[-1], flush=True)
    cfg0 = base_config(tmp, n_sites, **kw)
    for eps in epsilons:
        try:
            plan = plan_for_target(cfg0, [SiteShape(s.name, tuple(ln)) for s, ln in zip(cfg0.sites, lengths)], D, eps)
        except ConfigError as exc:  # e.g. 40 ICA rounds cannot share a total eps of 1
            rows.append({**row0, "epsilon": eps, "r_median": "", "r_min": "", "pca_epsilon": "", "above_edge": "",
                         "seeds": 0, "reference": f"refused by the planner: {exc}"})
            print(rows[-1], flush=True)
            continue
        cfg, sigma = plan.config, plan.noise().get("covariance")
        r, above = [], []
        for s in seeds:
            maps, red = run_maps(replace(cfg, seed=s), X_sites, lengths, spatial_options=spatial, with_release=True)
            r.append(mean_r(maps, ref))
            # released eigenvalues above the noise's edge (dpneuro.privacy.rmt); a variance release's are not the covariance's
            if sigma is not None and not cfg.pca_variances:
                above.append(components_above_edge(red.eigenvalues, sigma, D))
        rows.append({**row0, "epsilon": eps, "r_median": statistics.median(r), "r_min": min(r),
                     "pca_epsilon": round(cfg.pca_epsilon, 3), "above_edge": statistics.median(above) if above else "",
                     "seeds": len(seeds), "reference": "non-private, same data"})
        print(rows[-1], flush=True)
    return rows


def real_subjects():
    """Per person the two runs, each region z-scored within its run (float32, regions x volumes)."""
    from _real_data import load_real_regions

    from dpneuro.data.load import preprocess

    d = load_real_regions(runs=(3, 7))
    runs = []
    for X in d["series"]:
        half = X.shape[1] // 2
        runs.append([preprocess(X[:, :half]), preprocess(X[:, half:])])
    return d, runs


def split_real(runs, n_sites: int):
    """The real people over ``n_sites`` sites (both runs of a person at one site)."""
    groups = np.array_split(np.arange(len(runs)), n_sites)
    X_sites = [np.hstack([np.hstack(runs[i]) for i in g]).astype(np.float32) for g in groups]
    lengths = [[sum(r.shape[1] for r in runs[i]) for i in g] for g in groups]
    return X_sites, lengths


def pseudo_windows(runs, subjects: int, n_sites: int, window: int, seed: int) -> list[list[np.ndarray]]:
    """Per site, per pseudo-subject, a random ``window`` of one person's run (regions x volumes, as read)."""
    rng = np.random.default_rng(seed)
    sites = []
    for _ in range(n_sites):
        blocks = []
        for _ in range(subjects):
            run = runs[int(rng.integers(len(runs)))][int(rng.integers(2))]
            a = int(rng.integers(run.shape[1] - window + 1))
            blocks.append(run[:, a:a + window])
        sites.append(blocks)
    return sites


def pseudo_consortium(runs, subjects: int, n_sites: int, window: int, seed: int):
    from dpneuro.data.load import preprocess

    sites = pseudo_windows(runs, subjects, n_sites, window, seed)
    return [np.hstack([preprocess(b) for b in blocks]) for blocks in sites], [[window] * subjects for _ in sites]


def atlas_on_grid(atlas, space: str = "mni6mm"):
    """Region label of every voxel of the analysis grid (0: outside), nearest-neighbour resampled; its affine."""
    from nilearn.image import resample_img

    from dpneuro.data.images import load_space

    mask, affine = load_space(space)
    img = resample_img(atlas, target_affine=affine, target_shape=mask.shape, interpolation="nearest",
                       force_resample=True, copy_header=True)
    labels = np.asarray(img.dataobj).astype(np.int64) * mask
    return labels, affine


def canica_maps(runs, labels, affine, n_components: int, seed: int = 0):
    """nilearn's CanICA on every person's runs painted into the atlas (4-D images): voxels x components."""
    import nibabel as nib
    from nilearn.decomposition import CanICA

    inside = labels > 0
    idx = labels[inside] - 1
    imgs = []
    for person in runs:
        X = np.hstack(person)  # regions x volumes
        vol = np.zeros(labels.shape + (X.shape[1],), np.float32)
        vol[inside] = X[idx]
        imgs.append(nib.Nifti1Image(vol, affine))
    mask_img = nib.Nifti1Image(inside.astype(np.uint8), affine)
    ica = CanICA(n_components=n_components, mask=mask_img, smoothing_fwhm=None, standardize="zscore_sample",
                 random_state=seed, n_jobs=1, verbose=0)
    ica.fit(imgs)
    comp = np.asarray(ica.components_img_.dataobj)  # x, y, z, k
    return comp[inside], inside, idx


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small pseudo-consortium, two budgets, one seed, no CanICA")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--subjects", type=lambda v: tuple(int(x) for x in v.split(",")), default=SUBJECTS,
                    help="subjects per site, comma-separated (default: %(default)s); the draws do not depend on it")
    ap.add_argument("--no-extra", action="store_true", help="only the grid: no size sweep, no unequal sites")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    d, runs = real_subjects()
    if args.quick:
        subjects_grid, epsilons, seeds = (12,), (4.0, 16.0), [0]
        runs_grid = (("spatial", "moment", 1.0), DEFAULT_RUN, ("spatial", "subspace", DEFAULT_BOUND, SINGLE))
        sweep, sweep_eps, unequal, equal = (16,), (4.0,), (6, 10, 14, 18), (12, 12, 12, 12)
    else:
        subjects_grid, epsilons, seeds, runs_grid = args.subjects, EPSILONS, list(range(args.seeds)), RUNS
        sweep, sweep_eps, unequal, equal = ((), (), (), ()) if args.no_extra else (SWEEP, SWEEP_EPSILONS, UNEQUAL,
                                                                                    EQUAL)
    rows, agreement = [], {}
    with tempfile.TemporaryDirectory(prefix="dpneuro-real-") as tmp:
        tmp = Path(tmp)
        D = runs[0][0].shape[0]
        # 1. the real people, no noise, against CanICA
        X_real, len_real = split_real(runs, N_SITES)
        labels, affine = atlas_on_grid(d["atlas"])
        models = sorted({_model(r) for r in runs_grid})
        ref_maps = {(ica, con, um): run_maps(base_config(tmp, N_SITES, ica=ica, pca_contribution=con, plan="none",
                                                         parcels=0, seed=0, **_settings(ica, um)[0]), X_real, len_real,
                                             spatial_options=_settings(ica, um)[1])
                    for ica, con, um in models}
        if not args.quick:
            tc = time.perf_counter()
            can, inside, idx = canica_maps(runs, labels, affine, N_COMPONENTS)
            agreement["canica_seconds"] = time.perf_counter() - tc
            for (ica, con, um), M in ref_maps.items():
                if um == SINGLE:
                    continue  # an ablation of the frontier only
                same = run_maps(base_config(tmp, N_SITES, ica=ica, pca_contribution=con, plan="none",
                                            ica_unmixing=um, reduction="none", parcels=0, seed=0),
                                [X[idx] for X in X_real], len_real)
                agreement[f"{_label(ica, um)} ({con}) on the same images vs CanICA"] = mean_r(same, can)
                agreement[f"{_label(ica, um)} ({con}) on the regions vs CanICA"] = mean_r(M[idx], can)
            print(agreement, flush=True)
        # 2. pseudo-consortia (draws 501-1000 of a site from a second stream: sizes up to 500 keep their draws)
        X_all, len_all = pseudo_consortium(runs, max(SUBJECTS), N_SITES, WINDOW, seed=1)
        if max(sweep, default=0) > max(SUBJECTS):
            X_more, len_more = pseudo_consortium(runs, max(sweep) - max(SUBJECTS), N_SITES, WINDOW, seed=2)
            X_all = [np.hstack([a, b]) for a, b in zip(X_all, X_more)]
            len_all = [a + b for a, b in zip(len_all, len_more)]

        def consortium(sizes):
            return ([X[:, :m * WINDOW] for X, m in zip(X_all, sizes)], [ln[:m] for ln, m in zip(len_all, sizes)])

        for subjects in subjects_grid:
            X_sites, lengths = consortium([subjects] * N_SITES)
            seen = set()
            for run in runs_grid:
                (ica, con, um) = _model(run)
                if ica == "temporal" and subjects > TEMPORAL_MAX_SUBJECTS:
                    continue  # 40 private rounds over every time point: the largest sizes take too long
                new = private_rows(tmp, X_sites, lengths, run, epsilons, seeds, D,
                                   reference=None if (ica, con, um) in seen else ref_maps[ica, con, um])
                seen.add((ica, con, um))
                rows += new
        for sizes, eps_grid in [*(([m] * N_SITES, sweep_eps) for m in sweep), (unequal, epsilons),
                                (equal, epsilons)]:
            if sizes and not (sizes is equal and sizes[0] in subjects_grid):  # already in the grid
                X_sites, lengths = consortium(sizes)
                rows += private_rows(tmp, X_sites, lengths, DEFAULT_RUN, eps_grid, seeds, D)
    keys = ["subjects", "sites", "ica", "contribution", "bound", "epsilon", "r_median", "r_min", "pca_epsilon", "above_edge",
            "seeds", "reference"]
    meta = {"data": d["source"], "people": len(runs), "regions": D, "window": WINDOW, "n_sites": N_SITES,
            "n_components": N_COMPONENTS, "subjects_per_site": list(subjects_grid), "epsilons": list(epsilons),
            "sweep": list(sweep), "sweep_epsilons": list(sweep_eps), "unequal": list(unequal), "equal": list(equal),
            "runs": [list(r) for r in runs_grid], "seeds": len(seeds), "delta": 1e-5, "agreement": agreement,
            "runtime_s": time.perf_counter() - t0}
    write_results("real_frontier" + ("_quick" if args.quick else ""), rows, meta, keys=keys, digits=4)
    if not args.quick:
        grid = [r for r in rows if r["sites"] == "equal" and r["subjects"] in subjects_grid]
        figure(grid, subjects_grid, RESULTS / "real_frontier.png", series=("ica", "contribution", "bound"),
               value="r_median", ylabel="mean |r| with the non-private maps", hline=0.7)
    return 0


if __name__ == "__main__":
    sys.exit(main())
