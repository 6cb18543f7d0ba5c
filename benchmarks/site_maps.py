"""Each site's own voxel maps against the consortium's painted parcels: realistic networks at 4 mm, from files.

Data: ``make_consortium(model="networks")`` (20 distributed, bilateral,
overlapping networks with correlated slow time courses; ``dpneuro.datasets.synth``) on
the 4 mm MNI grid (29,398 voxels), 4 sites x M subjects x 150 volumes at TR
2 s, int16 gzip NIfTI, seed 0. Every cell runs the pipeline from the files,
as ``dpneuro run`` does (``pipeline.run_stages``: load, capePCA, spatial
ICA, maps), and reports the mean matched |r| with the true maps of

- the consortium's maps: parcel values painted back to voxels (what the
  consortium shares);
- each site's own voxel maps (``site_voxel_maps``, the default with parcels),
  computed at the site with no release (mean over the sites; the worst site
  in the CSV), by the default ``site_maps_method = "guided_ica"`` (spatial
  ICA of the site's own principal subspace, started from and paired with the
  dual-regression maps) and, from the same run's time courses, by
  ``"dual_regression"`` (the site's subjects' voxels regressed on their time
  courses, averaged).

Cells: parcels 100 (the default), 200 and 400, each without noise
(``reduction = "none"``) and private at a total eps of 8 per site (headline
sense: against the aggregator colluding with one site, delta 1e-5; the
planner sets ``pca_epsilon``), noise seeds 0-2. For reference, the same data
at voxel resolution (``parcels = 0``): without noise, and private
(``capepca-power``, D x k releases; one seed).

    python benchmarks/site_maps.py                  # full: ~35 min on 2 cores
    python benchmarks/site_maps.py --quick          # smoke run (writes *_quick.*)

Writes benchmarks/results/site_maps.{csv,json} and site_maps.png.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from scale import make_data  # noqa: E402  (the same files, written the same way)

RESULTS = Path(__file__).resolve().parent / "results"
EPSILON = 8.0
N_SITES, N_COMPONENTS, N_TIMEPOINTS, SPACE = 4, 20, 150, "mni4mm"
PARCELS = (100, 200, 400)
SEEDS = (0, 1, 2)


def run_cell(man: dict, out: Path, M: int, R: int, space: str, parcels: int, private: bool, seed: int) -> dict:
    """One run from the files up to the maps; the maps stage timed on its own (it decodes every file again)."""
    from dpneuro.config import RunConfig
    from dpneuro.run.pipeline import prepare, run_stages

    sites = [{"name": s["site"], "path": s["path"],
              "files": sorted(str(p) for p in Path(s["path"]).glob("*.nii*"))[:M]} for s in man["sites"]]
    kw = dict(sites=sites, out=str(out), mask=man["mask"], space=space, parcels=parcels, n_components=R, seed=seed,
              truth=str(Path(man["mask"]).parent), reduction="capepca" if private else "none")
    if private:
        # each site's own maps are measured at every size, also where the consortium's are noise
        kw.update(epsilon=EPSILON, allow_noise_maps=True)
        if not parcels:
            kw["reduction"] = "capepca-power"  # the D x D covariance of 29,398 voxels does not fit
    cfg, _ = prepare(RunConfig.from_dict(kw), until="maps")
    t0 = time.perf_counter()
    run_stages(cfg, until="unmix")
    t1 = time.perf_counter()
    res = run_stages(cfg, until="maps")
    t2 = time.perf_counter()
    mp = json.loads(Path(res["maps"]).read_text())
    metrics = mp["truth"]["metrics"]
    site_r = mp["truth"].get("site_r", {})
    dr = _dual_regression_r(res, mp) if site_r else []
    return {"parcels": parcels, "reduction": cfg.reduction, "seed": seed,
            "epsilon": _epsilon(mp) if private else float("inf"),
            "r_consortium": round(metrics["mean |r| with truth"], 4),
            "r_sites": round(metrics.get("site voxel maps: mean |r| with truth", float("nan")), 4),
            "r_worst_site": round(min(site_r.values()), 4) if site_r else float("nan"),
            "r_sites_dual_regression": round(statistics.fmean(dr), 4) if dr else float("nan"),
            "until_unmix_s": round(t1 - t0, 1), "maps_s": round(t2 - t1, 1)}


def _dual_regression_r(res: dict, mp: dict) -> list[float]:
    """Every site's dual-regression voxel maps from the run's own time courses: mean |r| with the truth."""
    import nibabel as nib
    import numpy as np

    from dpneuro.algorithms.metrics import match_components
    from dpneuro.data.images import load_mask
    from dpneuro.report.figures import read_timecourses
    from dpneuro.run.site_maps import site_voxel_maps

    space = json.loads(Path(mp["space"]).read_text())
    mask, _ = load_mask(space["mask"])
    truth = np.asarray(nib.load(mp["truth"]["maps"]).dataobj)[mask]
    out = []
    for load in res["load"]:
        site = json.loads(Path(load).read_text())
        _, S = read_timecourses(mp["timecourses"][site["site"]])
        maps = site_voxel_maps(site["runs"], site["boundaries"], S, mask, method="dual_regression")
        out.append(float(np.mean(np.abs(match_components(maps, truth)[1]))))
    return out


def _epsilon(mp: dict) -> float:
    priv = json.loads(Path(mp["privacy"]).read_text())
    return round(max(priv["epsilon"].values()), 3)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="smoke size for CI (3 sites x 3 subjects, 6 mm, 50 parcels)")
    ap.add_argument("--subjects", type=int, default=100, help="subjects per site")
    ap.add_argument("--no-voxels", action="store_true", help="leave out the voxel-resolution reference runs")
    ap.add_argument("--workdir", default=None, help="data and runs (default: a temporary folder, removed)")
    args = ap.parse_args(argv)
    os.environ.setdefault("NO_ET", "1")
    if args.quick:
        sites, M, T, R, space, parcels, seeds, voxels = 3, 3, 30, 4, "mni6mm", (50,), (0,), False
    else:
        sites, M, T, R, space = N_SITES, args.subjects, N_TIMEPOINTS, N_COMPONENTS, SPACE
        parcels, seeds = PARCELS, SEEDS
        voxels = not args.no_voxels
    root = Path(args.workdir) if args.workdir else Path(f"/tmp/dpneuro_site_maps_{os.getpid()}")
    root.mkdir(parents=True, exist_ok=True)
    t_all = time.perf_counter()
    rows = []
    try:
        man, gen_s = make_data(root, space, sites, M, T, R, model="networks")
        print(f"data: {sites} x {M} subjects ({space}) in {gen_s:.0f} s", flush=True)
        cells = [(P, False, 0) for P in parcels] + [(P, True, s) for P in parcels for s in seeds]
        if voxels:
            cells += [(0, False, 0), (0, True, 0)]
        for P, private, seed in cells:
            row = {"subjects": M, **run_cell(man, root / f"run-{P}", M, R, space, P, private, seed)}
            rows.append(row)
            print(json.dumps(row), flush=True)
        for P in sorted({P for P, _, _ in cells}):
            shutil.rmtree(root / f"run-{P}", ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(root, ignore_errors=True)
    summary = summarise(rows)
    meta = {"model": "networks", "space": space, "n_sites": sites, "subjects_per_site": M, "n_components": R,
            "n_timepoints": T, "epsilon_target": EPSILON, "seeds": list(seeds), "data_seconds": gen_s,
            "runtime_s": round(time.perf_counter() - t_all), "summary": summary, "rows": rows}
    save(rows, meta, args.quick)
    print(json.dumps(summary, indent=1))
    return 0


def summarise(rows: list[dict]) -> list[dict]:
    """Per (parcels, private or not): the median over noise seeds of every |r|."""
    out = []
    for key in sorted({(r["parcels"], r["reduction"]) for r in rows}, key=lambda k: (k[0] == 0, k[0], k[1])):
        cell = [r for r in rows if (r["parcels"], r["reduction"]) == key]
        out.append({"parcels": key[0], "reduction": key[1], "epsilon": statistics.median(r["epsilon"] for r in cell),
                    "n_seeds": len(cell),
                    **{k: statistics.median(r[k] for r in cell)
                       for k in ("r_consortium", "r_sites", "r_worst_site", "r_sites_dual_regression")},
                    "r_sites_min_over_seeds": min(r["r_sites"] for r in cell),
                    "maps_s": statistics.median(r["maps_s"] for r in cell)})
    return out


def save(rows: list[dict], meta: dict, quick: bool) -> None:
    RESULTS.mkdir(exist_ok=True)
    stem = "site_maps_quick" if quick else "site_maps"
    with open(RESULTS / f"{stem}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (RESULTS / f"{stem}.json").write_text(json.dumps(meta, indent=1))
    figure(meta["summary"], RESULTS / f"{stem}.png")


def figure(summary: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    groups = sorted({s["parcels"] for s in summary}, key=lambda P: (P == 0, P))
    labels = [f"{P} parcels" if P else "voxels" for P in groups]
    series = [("r_consortium", False, "consortium (painted), no noise"),
              ("r_consortium", True, f"consortium (painted), eps {EPSILON:g}"),
              ("r_sites_dual_regression", True, f"sites' voxel maps, dual regression, eps {EPSILON:g}"),
              ("r_sites", False, "sites' voxel maps, guided ICA, no noise"),
              ("r_sites", True, f"sites' voxel maps, guided ICA, eps {EPSILON:g}")]
    fig, ax = plt.subplots(figsize=(8, 4))
    x = np.arange(len(groups))
    width = 0.16
    for i, (key, private, label) in enumerate(series):
        vals = []
        for P in groups:
            cell = [s for s in summary if s["parcels"] == P and (s["reduction"] != "none") == private]
            vals.append(cell[0][key] if cell and cell[0][key] == cell[0][key] else 0.0)
        ax.bar(x + (i - 2) * width, vals, width, label=label)
    ax.set_xticks(x, labels)
    ax.set_ylim(0, 1)
    ax.axhline(0.8, color="k", lw=0.8, ls=":")
    ax.set_ylabel("mean |r| with the true maps")
    ax.legend(fontsize=8, loc="upper left")
    ax.set_title("Realistic networks, 4 mm, from files")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
