"""Real fMRI from NIfTI files: dpneuro's non-private maps against nilearn's CanICA, and the wall time of each.

Data: region time series of 33 people (OpenNeuro ds000140, heat-pain task runs
3 and 7, 122 regions of the MIST/BASC atlas, TR 2 s; pip package
``connattractor``, read by ``benchmarks/_real_data.py``), each region z-scored
within its run, painted into the atlas on the 6 mm MNI grid and written as one
4-D NIfTI file per person (both runs), over 4 site folders (9, 8, 8, 8). The
mask is the atlas's voxels on the grid (7,037). Every method reads the same
files, 20 components.

- CanICA: nilearn's CanICA with its defaults (6 mm smoothing, detrending,
  standardisation, 10 FastICA starts, threshold "auto": each map keeps about
  1/20 of the voxels), and the same without the threshold.
- dpneuro: ``DecentralizedICA(plan="none")`` (no noise, everything else the
  product's defaults) with the features a consortium can choose: 100
  coordinate parcels (the default), coordinate parcels of other sizes, the
  MIST 122 label atlas (``atlas=``), the shipped Schaefer 200 atlas with 50
  coordinate parcels of the voxels it leaves out, and every voxel (``parcels=0``, the PCA
  without noise streamed); with and without 6 mm smoothing.

Agreement: mean matched |r| (Hungarian) over the mask's voxels between a
method's maps and CanICA's, thresholded (what CanICA shows) and not. CanICA's
thresholded maps agree with its own unthresholded ones at only about 0.78, so
no unthresholded map can agree with the thresholded ones much above that;
the unthresholded column compares like with like, and so does "both
thresholded" (dpneuro's maps thresholded as CanICA thresholds its own). Time: wall clock from the
files to the maps (dpneuro: the whole run with its report and each site's
voxel maps), one run each, same process, BLAS threads at their defaults.

Caveat: the data are painted from the MIST atlas, so they are exactly constant
on its regions. The atlas row is therefore the best case of a label atlas (on
voxel data a functional atlas approximates the signal); coordinate parcels
cut across the regions, as they would across real networks.

    python benchmarks/canica_agreement.py            # full: ~10 min on 2 cores
    python benchmarks/canica_agreement.py --quick    # smoke run: 8 people, 8 components, no CanICA restarts

Writes benchmarks/results/canica_agreement.{csv,json}.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import mean_r, write_results  # noqa: E402
from real_frontier import atlas_on_grid, real_subjects  # noqa: E402

N_SITES, N_COMPONENTS, SMOOTHING = 4, 20, 6.0
#: (name, DecentralizedICA options beyond plan="none"): the features a consortium can choose
VARIANTS = (
    ("100 coordinate parcels (default)", {}),
    ("400 coordinate parcels", {"parcels": 400}),
    ("MIST 122 atlas", {"atlas": "ATLAS"}),
    ("MIST 122 atlas, smoothed 6 mm", {"atlas": "ATLAS", "smoothing_fwhm": SMOOTHING}),
    ("Schaefer 200 + 50 parcels of the rest (shipped atlas)", {"atlas": "schaefer_2018:200", "atlas_fill": 50}),
    ("Schaefer 200 + 50 parcels of the rest, smoothed 6 mm (fmriprep.toml's features)",
     {"atlas": "schaefer_2018:200", "atlas_fill": 50, "smoothing_fwhm": SMOOTHING}),
    ("voxels", {"parcels": 0, "reduction": "none"}),
    ("voxels, smoothed 6 mm", {"parcels": 0, "reduction": "none", "smoothing_fwhm": SMOOTHING}),
)
QUICK_VARIANTS = ("100 coordinate parcels (default)", "MIST 122 atlas")


def write_consortium(root: Path, runs, labels, affine, n_sites: int) -> tuple[dict[str, list[str]], Path]:
    """One 4-D NIfTI per person (its runs one after the other) in ``n_sites`` site folders, and the mask."""
    import nibabel as nib

    inside = labels > 0
    idx = labels[inside] - 1
    root.mkdir(parents=True, exist_ok=True)
    mask = root / "mask.nii.gz"
    nib.Nifti1Image(inside.astype(np.uint8), affine).to_filename(mask)
    sites = {}
    for s, group in enumerate(np.array_split(np.arange(len(runs)), n_sites)):
        d = root / f"site-{s + 1:02d}"
        d.mkdir(parents=True)
        sites[d.name] = []
        for i in group:
            X = np.hstack(runs[i])
            vol = np.zeros(labels.shape + (X.shape[1],), np.float32)
            vol[inside] = X[idx]
            img = nib.Nifti1Image(vol, affine)
            img.header.set_xyzt_units("mm", "sec")
            img.header["pixdim"][4] = 2.0
            path = d / f"sub-{i + 1:02d}_task-pain_bold.nii.gz"
            img.to_filename(path)
            sites[d.name].append(str(path))
    return sites, mask


def canica_threshold(maps: np.ndarray) -> np.ndarray:
    """CanICA's threshold "auto" on voxels x components maps: keep the 1/k of all values largest in magnitude."""
    from scipy.stats import scoreatpercentile

    out = np.array(maps, dtype=np.float64)
    cut = scoreatpercentile(np.abs(out), 100.0 - 100.0 / out.shape[1])
    out[np.abs(out) < cut] = 0.0
    return out


def canica(files: list[str], mask: Path, n_components: int, threshold, n_init: int):
    """CanICA's maps over the mask's voxels (voxels x components) and its wall time."""
    import nibabel as nib
    from nilearn.decomposition import CanICA

    t = time.perf_counter()
    ica = CanICA(n_components=n_components, mask=str(mask), random_state=0, n_jobs=1, threshold=threshold,
                 n_init=n_init).fit(files)
    seconds = time.perf_counter() - t
    inside = np.asarray(nib.load(str(mask)).dataobj).astype(bool)
    return np.asarray(ica.components_img_.dataobj)[inside], seconds


def dpneuro_maps(sites: dict[str, list[str]], mask: Path, out: Path, n_components: int, options: dict):
    """dpneuro's non-private maps (voxels x components), the run's wall time from the files, the part of it the
    report took (its figures; CanICA draws none), and the configuration."""
    import dpneuro
    from dpneuro.report.timings import label

    t = time.perf_counter()
    ica = dpneuro.DecentralizedICA(n_components=n_components, plan="none", mask=str(mask), random_state=0,
                                   out=out, **options).fit(sites)
    seconds = time.perf_counter() - t
    timings = json.loads((Path(ica.output_dir_) / "run.json").read_text())["timings_s"]
    return ica.components_.T, seconds, timings[label(ica.config_, "report")], dict(ica.config_.to_json())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="8 people, 8 components, two variants, one CanICA start")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    d, runs = real_subjects()
    k, n_init, variants = N_COMPONENTS, 10, VARIANTS
    if args.quick:
        runs, k, n_init = runs[:8], 8, 1
        variants = tuple(v for v in VARIANTS if v[0] in QUICK_VARIANTS)
    labels, affine = atlas_on_grid(d["atlas"])
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-canica-") as tmp:
        tmp = Path(tmp)
        atlas = tmp / "MIST_122.nii.gz"
        d["atlas"].to_filename(atlas)
        sites, mask = write_consortium(tmp / "data", runs, labels, affine, N_SITES)
        files = [f for fs in sites.values() for f in fs]
        shown, can_s = canica(files, mask, k, "auto", n_init)
        raw, _ = canica(files, mask, k, None, n_init)
        ceiling = mean_r(raw, shown)
        rows.append({"method": "nilearn CanICA (its defaults)", "vs CanICA": 1.0, "both thresholded": 1.0,
                     "seconds without report": can_s, "vs CanICA unthresholded":
                     ceiling, "seconds": can_s, "features": "voxels"})
        print(rows[-1], flush=True)
        for name, opts in variants:
            opts = {key: (str(atlas) if v == "ATLAS" else v) for key, v in opts.items()}
            M, seconds, report_s, cfg = dpneuro_maps(sites, mask, tmp / "runs" / str(len(rows)), k, opts)
            rows.append({"method": f"dpneuro, {name}", "vs CanICA": mean_r(M, shown),
                         "both thresholded": mean_r(canica_threshold(M), shown),
                         "vs CanICA unthresholded": mean_r(M, raw), "seconds": seconds,
                         "seconds without report": seconds - report_s,
                         "features": "atlas" if cfg["atlas"] else (cfg["parcels"] or "voxels")})
            print(rows[-1], flush=True)
    keys = ["method", "features", "vs CanICA", "both thresholded", "vs CanICA unthresholded", "seconds",
            "seconds without report"]
    meta = {"data": d["source"], "people": len(runs), "n_sites": N_SITES, "n_components": k, "canica_n_init": n_init,
            "voxels": int((labels > 0).sum()), "canica_thresholded_vs_unthresholded": ceiling,
            "runtime_s": time.perf_counter() - t0}
    write_results("canica_agreement" + ("_quick" if args.quick else ""), rows, meta, keys=keys)
    return 0


if __name__ == "__main__":
    sys.exit(main())
