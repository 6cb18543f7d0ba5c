"""Loading one subject whose run is on fMRIPrep's 2 mm MNI grid: time and peak memory, whole run vs chunks.

A site whose runs are at 2 mm (``res-2``, 99 x 117 x 95 voxels) resamples
each one to the analysis grid (here mni4mm) with nilearn before masking. The
whole run at once holds every volume at 2 mm (0.88 GB of float32 for 200
volumes) plus nilearn's resampled copy; ``dpneuro.data.load.RESAMPLE_CHUNK`` volumes
at a time (50) hold a quarter of it. Each mode runs in a fresh process:
``load_site`` on one subject (one float32 run, generated: a smooth brain-like
image plus noise), its wall time and the growth of the process's peak RSS
over the call (Linux ``VmHWM``, reset before the call), and tracemalloc's peak
of the same call run again. The two modes' site matrices must be equal.

    python benchmarks/resample_memory.py            # 200 volumes
    python benchmarks/resample_memory.py --quick    # 20 volumes

Writes benchmarks/results/resample_memory[_quick].json and .csv.
"""

from __future__ import annotations

import argparse
import csv
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import nibabel as nib
import numpy as np

MODES = {"whole run": None, "chunks of 50": 50}


def write_run(path: Path, n_volumes: int, seed: int = 0) -> Path:
    """A float32 run on the MNI 2 mm grid (as fMRIPrep's res-2), written volume block by volume block."""
    from nilearn.datasets import load_mni152_template

    tpl = load_mni152_template(resolution=2)
    shape, affine = tpl.shape[:3], tpl.affine
    brain = np.asarray(tpl.dataobj, np.float32)
    brain /= brain.max()
    rng = np.random.default_rng(seed)
    data = np.empty(shape + (n_volumes,), np.float32)
    for t in range(n_volumes):
        data[..., t] = 1000 * brain + 20 * rng.standard_normal(shape, dtype=np.float32) * (brain > 0.1)
    img = nib.Nifti1Image(data, affine)
    img.header.set_sform(affine, code="mni")
    img.header.set_qform(affine, code="mni")
    img.header.set_xyzt_units("mm", "sec")
    img.header.set_zooms((2.0, 2.0, 2.0, 2.0))
    img.to_filename(path)
    return path


def child(run: str, chunk: str, out: str) -> None:
    """One mode in this process: load the subject twice (RSS, then tracemalloc); save the matrix."""
    import tracemalloc

    from dpneuro.data import images, load

    load.RESAMPLE_CHUNK = None if chunk == "none" else int(chunk)
    mask = images.load_space("mni4mm")
    target = nib.Nifti1Image(mask[0].astype(np.uint8), mask[1])
    tiny = Path(out).with_suffix(".tiny.nii.gz")  # imports and first-call set-up outside the measurement
    nib.Nifti1Image(np.zeros((4, 4, 4, 12), np.float32), nib.load(run).affine).to_filename(tiny)
    load.resampled_block(tiny, np.ones((4, 4, 4), bool), target=None, smoothing_fwhm=6.0)
    before = _reset_peak_rss()
    t0 = time.perf_counter()
    sd = load.load_site([run], target, workers=1)
    seconds = time.perf_counter() - t0
    rss = _peak_rss() - before
    np.save(out, np.asarray(sd.X))
    del sd
    tracemalloc.start()
    load.load_site([run], target, workers=1)
    traced = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    print(json.dumps({"seconds": seconds, "rss_before_mb": before / 1024, "peak_rss_growth_mb": rss / 1024,
                      "tracemalloc_peak_mb": traced / 2**20}))


def _status(key: str) -> int:
    """A /proc/self/status field in KiB."""
    return int(Path("/proc/self/status").read_text().split(f"{key}:")[1].split()[0])


def _reset_peak_rss() -> int:
    """Reset the process's peak RSS (Linux: VmHWM) to its current RSS, which is returned (KiB); ru_maxrss can
    only grow, and imports leave it above the steady RSS."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return _status("VmRSS")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def _peak_rss() -> int:
    try:
        return _status("VmHWM")
    except OSError:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--child", nargs=3, metavar=("RUN", "CHUNK", "OUT"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(*args.child)
        return
    n_vol = 20 if args.quick else 200
    rows = []
    with tempfile.TemporaryDirectory(prefix="dpneuro-resample-") as tmp:
        tmp = Path(tmp)
        t0 = time.perf_counter()
        run = write_run(tmp / "sub-01_task-rest_space-MNI152NLin2009cAsym_res-2_desc-preproc_bold.nii.gz", n_vol)
        print(f"wrote a {n_vol}-volume 2 mm run ({run.stat().st_size / 2**20:.0f} MB gzipped) in "
              f"{time.perf_counter() - t0:.0f} s", flush=True)
        matrices = {}
        for mode, chunk in MODES.items():
            out = tmp / f"X_{chunk}.npy"
            res = subprocess.run([sys.executable, __file__, "--child", str(run), str(chunk).lower(), str(out)],
                                 check=True, capture_output=True, text=True)
            row = {"mode": mode, "volumes": n_vol, **json.loads(res.stdout.strip().splitlines()[-1])}
            rows.append(row)
            matrices[mode] = np.load(out)
            print(f"{mode:>14}: load {row['seconds']:.2f} s, peak RSS {row['rss_before_mb']:.0f} MB + "
                  f"{row['peak_rss_growth_mb']:.0f} MB, "
                  f"tracemalloc peak {row['tracemalloc_peak_mb']:.0f} MB", flush=True)
        a, b = matrices.values()
        equal = bool(np.array_equal(a, b))
        print(f"site matrices equal: {equal} (shape {a.shape})")
        if not equal:
            raise SystemExit("the chunked load differs from the whole run's")
    res_dir = Path(__file__).parent / "results"
    name = f"resample_memory{'_quick' if args.quick else ''}"
    (res_dir / f"{name}.json").write_text(json.dumps(
        {"input": "MNI 2 mm (99 x 117 x 95), float32, gzipped", "analysis_grid": "mni4mm", "rows": rows,
         "matrices_equal": equal}, indent=1))
    with open(res_dir / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


if __name__ == "__main__":
    main()
