"""Real fMRI: which features give the maps users know, privately: coordinate parcels, atlases, smoothing.

Data: the region time series of 33 people of ``real_frontier.py`` (OpenNeuro
ds000140, 122 MIST regions, TR 2 s), pseudo-consortia of 4 sites x {50, 100,
250} subjects (each a random 150-volume window of one person's run), the
series painted into the MIST atlas on the 6 mm MNI grid (7,037 voxels) as a
site's voxel data. Features are linear in the voxels, so each feature type is
a (features x 122) matrix applied to the region series:

- ``coordinate parcels``: k-means of the voxel coordinates (the product's
  data-independent parcels, averaged), 100 and 400;
- ``MIST 122 atlas``: the atlas's regions (orthonormal weighting); the data
  are painted from it, so this is a label atlas's best case;
- ``Power 264 spheres``: nilearn's bundled coordinate atlas (5 mm spheres,
  offline): a public functional atlas that is not the one the data came from;
- any of them after 6 mm smoothing of the voxel data (as CanICA smooths).

Reference: nilearn's CanICA with its defaults (6 mm smoothing, 10 starts) on
the 33 people's painted images, unthresholded (what the maps users know are
before display thresholding; ``canica_agreement.py`` has the thresholded
view). Per feature type, size and total eps (headline, against the aggregator
and its colluders, delta 1e-5, the planner splitting it; the product's
defaults otherwise: spatial ICA, subject subspaces): the private maps rendered
to voxels through the features, mean matched |r| with CanICA's, and with the
same features' non-private maps (eps "none"); median and worst of 3 seeds.

The same on the realistic generator (``--synthetic``: ``network_model``, 20
networks on the 6 mm grid, 4 sites x {50, 100}, 150 volumes), against the
true maps. Its public atlases come from an independent cohort of the same
population (40 other subjects of the same model, never the truth), as a
consortium would use an atlas built on other people: a label atlas of 100
regions (nilearn's ``Parcellations``, Ward clustering) and a probabilistic
atlas of 64 maps (nilearn's ``DictLearning``, as DiFuMo was built).

What it does not show: the painting makes the data constant on MIST regions,
which flatters the MIST row and makes voxels no richer than it; real voxel
data also carry within-region structure that no atlas keeps.

    python benchmarks/feature_frontier.py            # full: ~20 min on 2 cores
    python benchmarks/feature_frontier.py --synthetic        # the generator: ~20 min
    python benchmarks/feature_frontier.py [--synthetic] --quick    # smoke runs (write *_quick.*)

Writes benchmarks/results/feature_frontier[_synthetic].{csv,json}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from canica_agreement import canica, write_consortium  # noqa: E402
from frontier import base_config, mean_r, planned, run_maps, write_results  # noqa: E402
from real_frontier import atlas_on_grid, pseudo_windows, real_subjects  # noqa: E402

from dpneuro.config import ConfigError  # noqa: E402

SUBJECTS = (50, 100, 250)
EPSILONS = (1.0, 2.0, 4.0, 8.0)
N_SITES, N_COMPONENTS, WINDOW, SMOOTHING = 4, 20, 150, 6.0
#: (row name, features, smoothed)
FEATURES = (("100 coordinate parcels", "parcels100", False), ("400 coordinate parcels", "parcels400", False),
            ("MIST 122 atlas", "mist", False), ("MIST 122 atlas, smoothed 6 mm", "mist", True),
            ("Power 264 spheres", "power_2011", False), ("Power 264 spheres, smoothed 6 mm", "power_2011", True),
            ("100 coordinate parcels, smoothed 6 mm", "parcels100", True),
            ("Schaefer 200 atlas (shipped)", "schaefer_2018:200", False),
            ("Schaefer 200 + 25 parcels of the rest", "schaefer_2018:200+25", False),
            ("Schaefer 200 + 50 parcels of the rest", "schaefer_2018:200+50", False),
            ("Schaefer 200 + 100 parcels of the rest", "schaefer_2018:200+100", False),
            ("Schaefer 200 + 50 parcels of the rest, smoothed 6 mm", "schaefer_2018:200+50", True),
            ("Schaefer 200 merged to 100 + 25 parcels of the rest", "schaefer_2018:200/2+25", False))
QUICK_FEATURES = ("100 coordinate parcels", "MIST 122 atlas")


def reducer(key: str, labels, affine, mist_img):
    """A feature type's reducer (``reduce``/``expand`` over the atlas's voxels), built as the product builds it."""
    from dpneuro.data.parcellation import Parcellation, atlas_labels, coordinate_parcels

    inside = labels > 0
    if key.startswith("parcels"):
        return Parcellation(coordinate_parcels(inside, int(key[len("parcels"):]), seed=0))
    if key == "mist":
        return Parcellation(atlas_labels(mist_img, inside, affine)[0], weighting="orthonormal")
    from dpneuro.data.atlases import atlas_image
    from dpneuro.data.parcellation import fill_uncovered

    atlas, _, fill = key.partition("+")
    atlas, _, merge = atlas.partition("/")
    found, values = atlas_labels(atlas_image(atlas, inside, affine), inside, affine)
    if merge:
        found = merged(found, values, inside, affine, int(merge))
    return Parcellation(fill_uncovered(found, inside, int(fill or 0)), weighting="orthonormal")


def merged(labels, values, inside, affine, factor: int) -> np.ndarray:
    """Schaefer's parcels merged ``factor`` to one within each network and hemisphere, by k-means of their
    centroids (data-independent)."""
    from nibabel.affines import apply_affine
    from scipy.cluster.vq import kmeans2

    from dpneuro.data.atlases import shipped_networks

    nets = shipped_networks()
    xyz = apply_affine(affine, np.argwhere(inside))
    cent = np.array([xyz[labels == i].mean(axis=0) for i in range(len(values))])
    out, nxt = np.full(len(values), -1), 0
    for key in sorted({(nets[v][2], nets[v][1]) for v in values}):
        members = np.array([i for i, v in enumerate(values) if (nets[v][2], nets[v][1]) == key])
        k = max(1, round(len(members) / factor))
        rng = np.random.default_rng(0)
        _, lab = kmeans2(cent[members], cent[members][rng.choice(len(members), k, replace=False)], minit="matrix",
                         iter=50, seed=0)
        _, lab = np.unique(lab, return_inverse=True)
        out[members] = nxt + lab
        nxt += int(lab.max()) + 1
    return np.where(labels >= 0, out[np.maximum(labels, 0)], -1)


def painting(labels, affine, smoothed: bool) -> np.ndarray:
    """Voxels x regions: each region's indicator on the grid, optionally smoothed (smoothing is linear per volume)."""
    import nibabel as nib
    from nilearn.image import smooth_img

    inside = labels > 0
    n_regions = int(labels.max())
    P = np.zeros((int(inside.sum()), n_regions), np.float32)
    P[np.arange(len(P)), labels[inside] - 1] = 1.0
    if not smoothed:
        return P
    vol = np.zeros(labels.shape + (n_regions,), np.float32)
    vol[inside] = P
    return np.asarray(smooth_img(nib.Nifti1Image(vol, affine), SMOOTHING).dataobj, dtype=np.float32)[inside]


def features_of(sites, A: np.ndarray):
    """Site feature matrices: each subject's voxels z-scored within the window (painted: its regions z-scored), then
    reduced by ``A`` as the product reduces cleaned voxels (an atlas's weighting survives: no z-scoring after)."""
    from dpneuro.data.load import preprocess

    X_sites = [np.hstack([A @ preprocess(b) for b in blocks]).astype(np.float32) for blocks in sites]
    return X_sites, [[WINDOW] * len(blocks) for blocks in sites]


SYNTH_SUBJECTS, COHORT, TR = (50, 100), 40, 2.0
#: (row name, features) on the generator; "voxels" only without noise (a D x D release of 8,735 voxels is refused)
SYNTH_FEATURES = (("100 coordinate parcels", "parcels100"), ("Ward 100 atlas (independent cohort)", "ward"),
                  ("Schaefer 200 atlas (shipped)", "schaefer_2018:200"),
                  ("Schaefer 200 + 50 parcels of the rest", "schaefer_2018:200+50"),
                  ("Schaefer 200 + 100 parcels of the rest", "schaefer_2018:200+100"),
                  ("probabilistic 64 atlas (independent cohort)", "dictlearning"), ("voxels", "voxels"))


def cohort_atlases(model, mask, affine, n_subjects: int, quick: bool):
    """Public atlases from an independent cohort of the model's population (subjects (50, m), not in any site)."""
    import nibabel as nib
    from nilearn.decomposition import DictLearning
    from nilearn.regions import Parcellations
    from sklearn.exceptions import ConvergenceWarning

    from dpneuro.data.load import preprocess
    from dpneuro.data.parcellation import MapsBasis, Parcellation, atlas_basis, atlas_labels

    mask_img = nib.Nifti1Image(mask.astype(np.uint8), affine)
    imgs = []
    for m in range(n_subjects):
        vol = np.zeros(mask.shape + (150,), np.float32)
        vol[mask] = preprocess(model.subject(50, m, 150, TR)[0])
        imgs.append(nib.Nifti1Image(vol, affine))
    ward = Parcellations("ward", n_parcels=100, mask=mask_img, smoothing_fwhm=None, standardize=False).fit(imgs)
    with warnings.catch_warnings():  # scikit-learn's lasso steps stop at their iteration cap, thousands of times
        warnings.simplefilter("ignore", ConvergenceWarning)
        dl = DictLearning(n_components=32 if quick else 64, mask=mask_img, smoothing_fwhm=None, random_state=0,
                          n_epochs=1, standardize="zscore_sample").fit(imgs)
    return {"ward": Parcellation(atlas_labels(ward.labels_img_, mask, affine)[0], weighting="orthonormal"),
            "dictlearning": MapsBasis(atlas_basis(dl.components_img_, mask, affine))}


def synthetic(args, t0: float) -> int:
    from frontier import consortium

    from dpneuro.data.images import load_space
    from dpneuro.data.parcellation import Parcellation, coordinate_parcels
    from dpneuro.datasets.synth import network_model

    subjects_grid, epsilons, seeds, features, cohort = (SYNTH_SUBJECTS, EPSILONS, list(range(args.seeds)),
                                                        chosen(SYNTH_FEATURES, args.only), COHORT)
    if args.quick:
        subjects_grid, epsilons, seeds, cohort = (12,), (4.0, 16.0), [0], 8
    mask, affine = load_space("mni6mm")
    model = network_model("mni6mm", N_COMPONENTS, random_state=0)
    truth = model.A.astype(np.float64)
    tc = time.perf_counter()
    red = {"parcels100": Parcellation(coordinate_parcels(mask, 100, seed=0)),
           **{key: reducer(key, mask.astype(np.int64), affine, None) for _, key in features if "schaefer" in key},
           **cohort_atlases(model, mask, affine, cohort, args.quick)}
    print(f"atlases from {cohort} independent subjects: {time.perf_counter() - tc:.0f} s", flush=True)
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-features-") as tmp:
        tmp = Path(tmp)
        for M in subjects_grid:
            data = consortium(model, {**red, "voxels": _Identity()}, M, N_SITES, WINDOW)
            for name, key in features:
                X_sites, lengths = data[key]
                rd = red.get(key, _Identity())
                cfg0 = base_config(tmp, N_SITES, parcels=X_sites[0].shape[0], seed=0)
                ref = run_maps(replace(cfg0, plan="none", reduction="none" if key == "voxels" else cfg0.reduction),
                               X_sites, lengths)
                base = {"features": name, "n_features": X_sites[0].shape[0], "subjects": M}
                ceiling = mean_r(rd.expand(rd.reduce(truth)), truth) if key != "voxels" else 1.0
                rows.append({**base, "epsilon": "none", "vs truth": mean_r(rd.expand(ref), truth),
                             "vs truth worst": "", "vs non-private": 1.0, "ceiling": ceiling})
                print(rows[-1], flush=True)
                for eps in epsilons if key != "voxels" else ():
                    vt, vn = [], []
                    for seed in seeds:
                        cfg = planned(replace(cfg0, seed=seed), lengths, eps, dim=X_sites[0].shape[0])
                        maps = run_maps(cfg, X_sites, lengths)
                        vt.append(mean_r(rd.expand(maps), truth))
                        vn.append(mean_r(maps, ref))
                    rows.append({**base, "epsilon": eps, "vs truth": statistics.median(vt), "vs truth worst": min(vt),
                                 "vs non-private": statistics.median(vn), "ceiling": ceiling})
                    print(rows[-1], flush=True)
    meta = {"data": "dpneuro.datasets.synth.network_model('mni6mm', 20, seed=0)", "cohort_subjects": cohort,
            "n_sites": N_SITES, "window": WINDOW, "subjects": list(subjects_grid), "epsilons": list(epsilons),
            "seeds": seeds}
    return _write(rows, meta, "feature_frontier_synthetic", args.quick, t0, args.only)


class _Identity:
    """Voxels as features."""

    def reduce(self, X):
        return X

    def expand(self, X):
        return X


def chosen(features: tuple, only: list[str] | None) -> tuple:
    """The rows ``--only`` names (all without it)."""
    if not only:
        return features
    out = tuple(f for f in features if f[0] in only)
    if missing := set(only) - {f[0] for f in out}:
        raise SystemExit(f"--only: no row named {sorted(missing)}; rows: {[f[0] for f in features]}")
    return out


def _write(rows: list[dict], meta: dict, stem: str, quick: bool, t0: float, only: list[str] | None = None) -> int:
    """Save the table; with ``--only`` the rows run replace their namesakes in the saved full table."""
    import csv
    import json

    stem += "_quick" if quick else ""
    meta = {**meta, "runtime_s": time.perf_counter() - t0}
    saved = Path(__file__).resolve().parent / "results" / stem
    if only and saved.with_suffix(".csv").exists():
        with open(saved.with_suffix(".csv"), newline="") as f:
            kept = [r for r in csv.DictReader(f) if r["features"] not in only]
        rows = kept + rows
        old = json.loads(saved.with_suffix(".json").read_text())
        meta = {**old, "rerun": {**old.get("rerun", {}), ", ".join(only): round(meta["runtime_s"])}}
    write_results(stem, rows, meta)
    return 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 subjects per site, two budgets, one seed, 2 features")
    ap.add_argument("--synthetic", action="store_true", help="the realistic generator with independent-cohort atlases")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--only", action="append", metavar="ROW",
                    help="run only this row (repeatable) and replace it in the saved table")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    if args.synthetic:
        return synthetic(args, t0)
    d, runs = real_subjects()
    subjects_grid, epsilons, seeds, features, n_init = (SUBJECTS, EPSILONS, list(range(args.seeds)),
                                                        chosen(FEATURES, args.only), 10)
    if args.quick:
        subjects_grid, epsilons, seeds, n_init = (12,), (4.0, 16.0), [0], 1
        features = tuple(f for f in FEATURES if f[0] in QUICK_FEATURES)
    labels, affine = atlas_on_grid(d["atlas"])
    red = {key: reducer(key, labels, affine, d["atlas"]) for key in sorted({f[1] for f in features})}
    paint = {s: painting(labels, affine, s) for s in sorted({f[2] for f in features})}
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-features-") as tmp:
        tmp = Path(tmp)
        sites_files, mask = write_consortium(tmp / "data", runs, labels, affine, N_SITES)
        tc = time.perf_counter()
        can, _ = canica([f for fs in sites_files.values() for f in fs], mask, N_COMPONENTS, None, n_init)
        print(f"CanICA: {time.perf_counter() - tc:.0f} s", flush=True)
        windows = {M: pseudo_windows(runs, M, N_SITES, WINDOW, seed=1) for M in subjects_grid}
        for name, key, smoothed in features:
            rd = red[key]
            A = rd.reduce(paint[smoothed])  # features x regions
            for M in subjects_grid:
                X_sites, lengths = features_of(windows[M], A)
                cfg0 = base_config(tmp, N_SITES, parcels=A.shape[0], seed=0)
                ref = run_maps(replace(cfg0, plan="none"), X_sites, lengths)
                base = {"features": name, "n_features": A.shape[0], "subjects": M}
                rows.append({**base, "epsilon": "none", "vs CanICA": mean_r(rd.expand(ref), can),
                             "vs CanICA worst": "", "vs non-private": 1.0, "vs non-private worst": ""})
                print(rows[-1], flush=True)
                for eps in epsilons:
                    vc, vn = [], []
                    for seed in seeds:
                        try:
                            cfg = planned(replace(cfg0, seed=seed), lengths, eps, dim=A.shape[0])
                        except ConfigError as e:
                            print(f"  {name} M={M} eps {eps}: {e}", flush=True)
                            break
                        maps = run_maps(cfg, X_sites, lengths)
                        vc.append(mean_r(rd.expand(maps), can))
                        vn.append(mean_r(maps, ref))
                    if vc:
                        rows.append({**base, "epsilon": eps, "vs CanICA": statistics.median(vc),
                                     "vs CanICA worst": min(vc), "vs non-private": statistics.median(vn),
                                     "vs non-private worst": min(vn)})
                        print(rows[-1], flush=True)
    meta = {"data": d["source"], "n_sites": N_SITES, "n_components": N_COMPONENTS, "window": WINDOW,
            "subjects": list(subjects_grid), "epsilons": list(epsilons), "seeds": seeds, "canica_n_init": n_init,
            "smoothing_fwhm": SMOOTHING, "voxels": int((labels > 0).sum())}
    return _write(rows, meta, "feature_frontier", args.quick, t0, args.only)


if __name__ == "__main__":
    sys.exit(main())
