"""Scale: time and peak memory of every stage, from NIfTI files to maps, at parcel and voxel resolution.

Data: ``make_consortium`` (the demo's generator) at 4 mm and 6 mm MNI, 4 sites
x up to 200 subjects x 150 volumes, 20 components, int16 NIfTI (gzip). Each
configuration reads the first M subjects of every site (explicit file lists):

- ``200 parcels``: the 4 mm data averaged into 200 data-independent parcels;
- ``6 mm voxels``: 8,735 features; ``4 mm voxels``: 29,398 features;
- ``3 mm voxels``: 69,765 features, on request (``--configs "3 mm voxels"``:
  4.2 GB of float32 per site at 100 subjects).

Every stage runs in a fresh process (``pipeline.run_stages`` up to that stage;
the earlier stages come from the run's cache), which reports its wall time and
peak resident memory (VmHWM). The whole consortium runs in that one process
(every site and the aggregator), so a stage's peak bounds what one site process
of a deployment needs. Load: the sites one after another, each decoding its
subjects in parallel threads. Two reductions per cell: without noise
(``none``: the covariance when D x D fits ``max_memory_gb``, streamed otherwise,
stopping when converged; ``reduce_rounds`` counts its passes over the data) and
private (capePCA; ``capepca-power`` where the covariance does not fit).
The floor is the time to decompress every input once with as many threads
as the loader uses; the table gives total / floor.

Writes benchmarks/results/scale.csv and .json (``_quick`` with --quick). A run
of some configurations or sizes replaces those rows of the committed table and
keeps the others.
"""

from __future__ import annotations

import argparse
import csv
import gzip
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
HERE = Path(__file__).resolve()

#: name -> (grid, parcels)
CONFIGS = {"200 parcels": ("mni4mm", 200), "6 mm voxels": ("mni6mm", 0), "4 mm voxels": ("mni4mm", 0),
           "3 mm voxels": ("mni3mm", 0)}
DEFAULT_CONFIGS = ("200 parcels", "6 mm voxels", "4 mm voxels")
QUICK_CONFIGS = {"50 parcels": ("mni6mm", 50), "6 mm voxels": ("mni6mm", 0)}
#: each measured in its own process; "load" includes the mask and parcels (pipeline.run_stages always runs both)
STAGES = ("load", "reduce", "unmix", "maps")


def _vm_hwm_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def child(cfg_path: str, until: str) -> None:
    """One stage in this fresh process: the earlier stages are read from the run's cache."""
    from dpneuro.config import RunConfig
    from dpneuro.run import pipeline

    cfg = RunConfig.from_dict(json.loads(Path(cfg_path).read_text()))
    t0 = time.perf_counter()
    out = pipeline.run_stages(cfg, until=until)
    print(json.dumps({"seconds": time.perf_counter() - t0, "peak_mb": _vm_hwm_mb(),
                      "out": out[until] if isinstance(out[until], str) else out[until][0]}))


def stage(cfg_path: Path, until: str) -> dict:
    env = {**os.environ, "NO_ET": "1", "MPLBACKEND": "Agg"}
    p = subprocess.run([sys.executable, str(HERE), "--child", str(cfg_path), until], capture_output=True, text=True,
                       env=env, timeout=6 * 3600)
    if p.returncode:
        raise RuntimeError(f"stage {until} failed:\n{p.stderr[-3000:]}")
    return json.loads(p.stdout.strip().splitlines()[-1])


def make_data(root: Path, space: str, sites: int, subjects: int, T: int, R: int,
              model: str = "blobs") -> tuple[dict, float]:
    """The consortium's files under ``root`` (reused when there), and the seconds it took to write them."""
    from dpneuro.datasets.synth import load_manifest, make_consortium

    folder = root / f"{'data' if model == 'blobs' else model}-{space}-{sites}x{subjects}x{T}"
    if (folder / "manifest.json").exists():
        return load_manifest(folder), float("nan")
    t0 = time.perf_counter()
    make_consortium(folder, n_sites=sites, subjects_per_site=subjects, n_components=R, n_timepoints=T, space=space,
                    random_state=0, dtype="int16", model=model)
    return load_manifest(folder), time.perf_counter() - t0


def decompress_seconds(files: list[str], workers: int) -> float:
    """Time to decompress every file once (the I/O floor), with the loader's number of threads."""
    from concurrent.futures import ThreadPoolExecutor

    def gunzip(f: str) -> int:
        n = 0
        with gzip.open(f, "rb") if f.endswith(".gz") else open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                n += len(chunk)
        return n

    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as pool:
        list(pool.map(gunzip, files))
    return time.perf_counter() - t0


def site_files(man: dict, M: int) -> list[dict]:
    out = []
    for s in man["sites"]:
        files = sorted(str(p) for p in Path(s["path"]).glob("*.nii*"))[:M]
        out.append({"name": s["site"], "path": s["path"], "files": files})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke size for CI (3 sites x 3 subjects, 6 mm)")
    ap.add_argument("--sizes", default="50,100,200", help="subjects per site (comma list)")
    ap.add_argument("--configs", default=",".join(DEFAULT_CONFIGS), help="which of: " + ", ".join(CONFIGS))
    ap.add_argument("--reductions", default="none,private", help="which of: none, private")
    ap.add_argument("--workdir", default=None, help="data and runs (default: a temporary folder, removed)")
    ap.add_argument("--child", nargs=2, metavar=("CFG", "STAGE"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0
    os.environ.setdefault("NO_ET", "1")
    from dpneuro._utils.parallel import resolve_workers
    from dpneuro.config import RunConfig

    if args.quick:
        sites, T, R, sizes, configs = 3, 30, 4, [3], QUICK_CONFIGS
    else:
        sites, T, R = 4, 150, 20
        sizes = [int(x) for x in args.sizes.split(",")]
        configs = {k: CONFIGS[k] for k in args.configs.split(",")}
    reductions = [r for r in ("none", "private") if r in args.reductions.split(",")]
    workers = resolve_workers()
    root = Path(args.workdir) if args.workdir else Path(f"/tmp/dpneuro_scale_{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rows, synth = [], {}
    kept, before = ([], {}) if args.quick else previous(configs, sizes, reductions)
    seconds_before = before.get("total_seconds", 0.0) if kept else 0.0

    def save_all() -> dict:
        return save(kept + rows, {**before.get("synth", {}), **synth}, workers,
                    seconds_before + time.perf_counter() - t_all, args.quick)

    try:
        for name, (space, parcels) in configs.items():
            man, gen_s = make_data(root, space, sites, max(sizes), T, R)
            if gen_s == gen_s:
                synth[space] = {"seconds": gen_s, "subjects": sites * max(sizes), "timepoints": T}
                print(f"synth {space}: {sites * max(sizes)} subjects in {gen_s:.0f} s", flush=True)
            features = parcels or _n_voxels(man["mask"])
            for M in sizes:
                sf = site_files(man, M)
                floor = decompress_seconds([f for s in sf for f in s["files"]], workers)
                for reduction in reductions:
                    cfg = RunConfig.from_dict(dict(
                        sites=sf, out=str(root / f"run-{space}-{parcels}-{M}"), mask=man["mask"], space=space,
                        parcels=parcels, n_components=R, seed=0, truth=str(Path(man["mask"]).parent),
                        reduction="none" if reduction == "none" else "capepca"))
                    if reduction == "private":
                        from dpneuro.config import ConfigError
                        from dpneuro.run.factory import pca_mode

                        try:
                            pca_mode(cfg, features)
                        except ConfigError:  # D x D does not fit: the power mode
                            cfg = RunConfig.from_dict({**cfg.to_json(), "reduction": "capepca-power"})
                    cfg_path = Path(cfg.out) / f"cfg-{reduction}.json"
                    cfg_path.parent.mkdir(parents=True, exist_ok=True)
                    cfg_path.write_text(json.dumps(cfg.to_json(), default=str))
                    row = {"config": name, "features": features,
                           "subjects_per_site": M, "sites": sites, "timepoints": T, "reduction": cfg.reduction,
                           "workers": workers, "decompress_s": round(floor, 2)}
                    for st in STAGES:
                        if st == "load" and reduction == "private" and "none" in reductions:  # shared with it
                            row[f"{st}_s"], row[f"{st}_peak_mb"] = rows[-1][f"{st}_s"], rows[-1][f"{st}_peak_mb"]
                            continue
                        r = stage(cfg_path, st)
                        row[f"{st}_s"], row[f"{st}_peak_mb"] = round(r["seconds"], 2), round(r["peak_mb"])
                        if st == "reduce":
                            row["reduce_rounds"] = json.loads(Path(r["out"]).read_text()).get("rounds", "")
                        if st == "maps":
                            truth = json.loads(Path(r["out"]).read_text()).get("truth")
                            row["mean_r_truth"] = round(truth["metrics"]["mean |r| with truth"], 3) if truth else ""
                    row["total_s"] = round(sum(row[f"{st}_s"] for st in STAGES), 2)
                    row["total_over_decompress"] = round(row["total_s"] / floor, 2)
                    row["peak_mb"] = max(row[f"{st}_peak_mb"] for st in STAGES)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
                    save_all()  # hours of work: keep each row
                shutil.rmtree(root / f"run-{space}-{parcels}-{M}", ignore_errors=True)  # the site matrices
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    print(json.dumps(save_all(), indent=1))
    return 0


def _number(v: str):
    for cast in (int, float):
        try:
            return cast(v)
        except ValueError:
            pass
    return v


def previous(configs: dict, sizes: list[int], reductions: list[str]) -> tuple[list[dict], dict]:
    """The committed rows this run does not measure again, and the committed summary."""
    path = RESULTS / "scale.csv"
    if not path.exists():
        return [], {}
    with open(path, newline="") as f:
        rows = [{k: _number(v) for k, v in r.items()} for r in csv.DictReader(f)]
    kept = [r for r in rows if not (r["config"] in configs and r["subjects_per_site"] in sizes
                                    and ("none" if r["reduction"] == "none" else "private") in reductions)]
    meta = json.loads((RESULTS / "scale.json").read_text()) if (RESULTS / "scale.json").exists() else {}
    return kept, meta


def save(rows: list[dict], synth: dict, workers: int, seconds: float, quick: bool) -> dict:
    """Write the table (in CONFIGS order, then size) and its summary (growth exponents) as they stand."""
    suffix = "_quick" if quick else ""
    RESULTS.mkdir(exist_ok=True)
    order = {c: i for i, c in enumerate(dict.fromkeys([*CONFIGS, *QUICK_CONFIGS]))}
    rows = sorted(rows, key=lambda r: (order.get(r["config"], len(order)), r["subjects_per_site"],
                                       r["reduction"] != "none"))
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(RESULTS / f"scale{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, restval="")
        w.writeheader()
        w.writerows(rows)
    meta = {"total_seconds": seconds, "synth": synth, "growth": growth(rows), "workers": workers}
    (RESULTS / f"scale{suffix}.json").write_text(json.dumps(meta, indent=1))
    return meta


def _n_voxels(mask_path: str) -> int:
    from dpneuro.data.images import load_mask

    return int(load_mask(mask_path)[0].sum())


def growth(rows: list[dict]) -> dict:
    """Exponents b of time ~ x^b: with the features (voxel grids, same subjects) and with the subjects."""
    out = {}
    for stage_ in ("load", "reduce"):
        for reduction in {r["reduction"] for r in rows}:
            sub = [r for r in rows if r["reduction"] == reduction]
            by_m: dict[int, list] = {}
            for r in sub:
                if r["config"].endswith("voxels"):
                    by_m.setdefault(r["subjects_per_site"], []).append(r)
            feats = [np.polyfit(np.log([r["features"] for r in rs]), np.log([r[f"{stage_}_s"] for r in rs]), 1)[0]
                     for rs in by_m.values() if len({r["features"] for r in rs}) > 1]
            by_c: dict[str, list] = {}
            for r in sub:
                by_c.setdefault(r["config"], []).append(r)
            subs = {c: float(np.polyfit(np.log([r["subjects_per_site"] for r in rs]),
                                        np.log([r[f"{stage_}_s"] for r in rs]), 1)[0])
                    for c, rs in by_c.items() if len(rs) > 1}
            out[f"{stage_} {reduction}"] = {"with features": float(np.median(feats)) if feats else None,
                                            "with subjects": subs}
    return out


if __name__ == "__main__":
    sys.exit(main())
