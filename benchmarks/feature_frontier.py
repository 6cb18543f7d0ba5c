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

What it does not show: the painting makes the data constant on MIST regions,
which flatters the MIST row and makes voxels no richer than it; real voxel
data also carry within-region structure that no atlas keeps.

    python benchmarks/feature_frontier.py            # full: ~20 min on 2 cores
    python benchmarks/feature_frontier.py --quick    # smoke run (writes *_quick.*)

Writes benchmarks/results/feature_frontier.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from canica_agreement import canica, write_consortium  # noqa: E402
from frontier import base_config, mean_r, planned, run_maps  # noqa: E402
from real_frontier import atlas_on_grid, real_subjects  # noqa: E402

from dpneuro.config import ConfigError  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SUBJECTS = (50, 100, 250)
EPSILONS = (1.0, 2.0, 4.0, 8.0)
N_SITES, N_COMPONENTS, WINDOW, SMOOTHING = 4, 20, 150, 6.0
#: (row name, features, smoothed)
FEATURES = (("100 coordinate parcels", "parcels100", False), ("400 coordinate parcels", "parcels400", False),
            ("MIST 122 atlas", "mist", False), ("MIST 122 atlas, smoothed 6 mm", "mist", True),
            ("Power 264 spheres", "power_2011", False), ("Power 264 spheres, smoothed 6 mm", "power_2011", True),
            ("100 coordinate parcels, smoothed 6 mm", "parcels100", True))
QUICK_FEATURES = ("100 coordinate parcels", "MIST 122 atlas")


def reducer(key: str, labels, affine, mist_img):
    """A feature type's reducer (``reduce``/``expand`` over the atlas's voxels), built as the product builds it."""
    from dpneuro.parcellation import Parcellation, atlas_labels, coordinate_parcels

    inside = labels > 0
    if key.startswith("parcels"):
        return Parcellation(coordinate_parcels(inside, int(key[len("parcels"):]), seed=0))
    if key == "mist":
        return Parcellation(atlas_labels(mist_img, inside, affine)[0], weighting="orthonormal")
    from dpneuro.atlases import resolve_atlas

    return Parcellation(atlas_labels(resolve_atlas(key, inside, affine), inside, affine)[0], weighting="orthonormal")


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


def pseudo_windows(runs, subjects: int, seed: int):
    """Per site, per subject, a 150-volume window of one person's run (regions x volumes, z-scored)."""
    from dpneuro.io import preprocess

    rng = np.random.default_rng(seed)
    sites = []
    for _ in range(N_SITES):
        blocks = []
        for _ in range(subjects):
            run = runs[int(rng.integers(len(runs)))][int(rng.integers(2))]
            a = int(rng.integers(run.shape[1] - WINDOW + 1))
            blocks.append(run[:, a:a + WINDOW])
        sites.append(blocks)
    return sites, preprocess


def features_of(sites, A: np.ndarray, preprocess):
    """Site feature matrices: each subject's voxel data reduced by ``A``, then z-scored within the subject."""
    X_sites = [np.hstack([preprocess(A @ b) for b in blocks]).astype(np.float32) for blocks in sites]
    return X_sites, [[WINDOW] * len(blocks) for blocks in sites]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="12 subjects per site, two budgets, one seed, 2 features")
    ap.add_argument("--seeds", type=int, default=3)
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    d, runs = real_subjects()
    subjects_grid, epsilons, seeds, features, n_init = SUBJECTS, EPSILONS, list(range(args.seeds)), FEATURES, 10
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
        windows = {M: pseudo_windows(runs, M, seed=1) for M in subjects_grid}
        for name, key, smoothed in features:
            rd = red[key]
            A = rd.reduce(paint[smoothed])  # features x regions
            for M in subjects_grid:
                X_sites, lengths = features_of(windows[M][0], A, windows[M][1])
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
    runtime = time.perf_counter() - t0
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    keys = list(rows[0])
    with open(RESULTS / f"feature_frontier{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: (round(v, 3) if isinstance(v, float) else v) for k, v in r.items()})
    meta = {"data": d["source"], "n_sites": N_SITES, "n_components": N_COMPONENTS, "window": WINDOW,
            "subjects": list(subjects_grid), "epsilons": list(epsilons), "seeds": seeds, "canica_n_init": n_init,
            "smoothing_fwhm": SMOOTHING, "voxels": int((labels > 0).sum()), "runtime_s": runtime}
    (RESULTS / f"feature_frontier{suffix}.json").write_text(json.dumps(meta, indent=1, default=str))
    print(f"wrote {RESULTS / f'feature_frontier{suffix}.csv'} in {runtime:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
