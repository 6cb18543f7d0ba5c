"""capeDJICA utility on the paper's synthetic setting ([capeDJICA] Sec. V): qNGI against total epsilon.

Data (generated in memory, one data set per M, fixed seed): R = 20 spatial
maps on a 30 x 30 grid (D = 900; 1-3 Gaussian blobs each, as
``dpneuro.datasets.synth`` draws them for ``space="grid30"``), R GARCH(1,1) source time
courses per subject (alpha ~ U(0.1, 0.2), beta ~ U(0.7, 0.8), as
``dpneuro.datasets.synth``), 250 time points per subject, X = A S without added noise,
M subjects split equally over S = 4 sites. Whitening to R = 20 uses the
pooled non-private PCA, as [capeDJICA] did ("we are reporting the privacy spent during
the course of the gradient descent"), so the main table's epsilon is the ICA's
alone; benchmarks/djica_end_to_end.py whitens privately instead.
The main table runs the papers' CAPE plan (zero-sum variance tau^2, so its
eps against the aggregator is theirs).

Per-round privacy as in [capeDJICA] Sec. V: each of the two releases (G and h) gets
the Gaussian mechanism for (eps_i, delta_i = 1e-2) -- the classic formula for
eps_i < 1, the analytic one (Balle & Wang) for eps_i >= 1, where the classic
one does not hold. Total epsilon per site at delta = 1e-5 from the ledgers:
exact (mu-GDP) and RDP (dp-accounting).

Configurations

``paper``  [capeDJICA] exactly: per-sample clipping B_G = B_h = 30, bias released,
           rho = 0.015 / ln R with the reference rules, at most 1000 rounds.
``fast``   same mechanism, ``optimizer="fast"`` (momentum, noise-proof
           annealing, infomax-scale start, Polyak averaging), 200 rounds.
``tuned``  ``optimizer="fast"``, subject-level clipping of the mean gradient
           (B_G = 2), no bias release (one release per round), 200 rounds.

Methods: capeDJICA (plan "cape", S = 4, secure aggregation), conv (plan
"conv"), local (site 1 alone, M/4 subjects, own noise), non-private (plan
"none", same clipping, no noise). qNGI of W A_w (A_w = whitened true mixing),
median over noise seeds. eps* = smallest total epsilon (exact) of a grid
point whose median qNGI <= 0.1, and a log-linear interpolation between the
neighbouring grid points.

Writes benchmarks/results/djica_utility.{csv,json,png}. ``--quick`` runs a
seconds-long smoke version (M = 32, R = 8, 30 rounds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # parallelism comes from sites and worker processes

import argparse
import csv
import json
import math
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np

from dpneuro.algorithms.djica import PRESETS, cape_djica, local_dp_ica
from dpneuro.algorithms.metrics import qngi
from dpneuro.datasets.synth import paper_ica_data
from dpneuro.protocol.cape import NoisePlan

RESULTS = Path(__file__).resolve().parent / "results"
DELTA_TOTAL = 1e-5
DELTA_I = 1e-2
#: the papers' CAPE plan (zero-sum variance tau^2, [capeDJICA]'s system for unequal sites): the main table
#: reproduces [capeDJICA], its eps columns too
PAPERS_PLAN = NoisePlan("cape", zero_sum_variance=1.0, unequal="papers")

CONFIGS = {
    "paper": dict(preset="paper", rounds=PRESETS["paper"]["rounds"]),
    "fast": dict(optimizer="fast", clip_G=30.0, clip_h=30.0, clip_unit="sample", bias=True, rounds=200),
    "tuned": dict(optimizer="fast", clip_G=2.0, clip_h=1.0, clip_unit="subject", bias=False, rounds=200),
}


# -- data ------------------------------------------------------------------------------------

def make_data(M: int, R: int = 20, T: int = 250, S: int = 4, seed: int = 0) -> dict:
    """Raw per-site data, truth, and the pooled-PCA whitened per-site data (float32)."""
    return paper_ica_data(M, np.random.default_rng([seed, M]), R=R, T=T, S=S)


_CACHE: dict = {}


def data_for(M: int, R: int, T: int) -> dict:
    key = (M, R, T)
    if key not in _CACHE:
        _CACHE.clear()  # one data set per worker at a time keeps memory flat
        _CACHE[key] = make_data(M, R, T)
    return _CACHE[key]


# -- one run ---------------------------------------------------------------------------------

def run_task(task: dict) -> dict:
    d = data_for(task["M"], task["R"], task["T"])
    cfg = dict(CONFIGS[task["config"]])
    if task["quick"]:
        cfg["rounds"] = min(cfg["rounds"], 30)
    eps_i = task["eps_i"]
    kw = dict(cfg, random_state=task["seed"])
    if task["method"] != "nonprivate":
        kw.update(epsilon_i=eps_i, delta_i=DELTA_I, calibration="classic" if eps_i < 1 else "analytic")
    t0 = time.perf_counter()
    if task["method"] == "local":
        res = local_dp_ica(d["Z"][0], d["subjects"][0], plan="conv", **kw)
    else:
        plan = {"cape": PAPERS_PLAN, "conv": "conv", "nonprivate": "none"}[task["method"]]
        res = cape_djica(d["Z"], d["subjects"], plan=plan, **kw)
    out = dict(task)
    out.update(qngi=qngi(res.W @ d["Aw"]), rounds_run=res.rounds, status=res.status,
               eps_exact=res.epsilon(DELTA_TOTAL, "exact"), eps_rdp=res.epsilon(DELTA_TOTAL, "rdp"),
               eps_collusion=(res.epsilon(DELTA_TOTAL, "exact", collusion=True) if task["method"] == "cape"
                              else math.nan),
               seconds=time.perf_counter() - t0)
    return out


# -- summary ---------------------------------------------------------------------------------

def summarise(results: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in results:
        groups.setdefault((r["M"], r["config"], r["method"], r["eps_i"]), []).append(r)
    rows = []
    for (M, config, method, eps_i), rs in sorted(groups.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2],
                                                                              kv[0][3] or 0)):
        q = np.array([r["qngi"] for r in rs])
        statuses = {}
        for r in rs:
            statuses[r["status"]] = statuses.get(r["status"], 0) + 1
        rows.append({
            "M": M, "config": config, "method": method, "eps_i": eps_i if eps_i is not None else "",
            "calibration": "" if eps_i is None else ("classic" if eps_i < 1 else "analytic"),
            "delta_i": "" if eps_i is None else DELTA_I, "round_limit": rs[0]["round_limit"],
            "rounds_run_median": float(np.median([r["rounds_run"] for r in rs])),
            "qngi_median": float(np.median(q)), "qngi_min": float(q.min()), "qngi_max": float(q.max()),
            "eps_total_exact": float(np.median([r["eps_exact"] for r in rs])),
            "eps_total_rdp": float(np.median([r["eps_rdp"] for r in rs])),
            "eps_total_collusion": float(np.median([r["eps_collusion"] for r in rs])),
            "delta_total": DELTA_TOTAL, "repeats": len(rs),
            "status": ";".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
            "seconds_median": float(np.median([r["seconds"] for r in rs])),
        })
    return rows


def eps_star(rows: list[dict]) -> list[dict]:
    """Smallest total epsilon with median qNGI <= 0.1, per (M, config, method)."""
    out = []
    keys = sorted({(r["M"], r["config"], r["method"]) for r in rows if r["method"] != "nonprivate"})
    for key in keys:
        pts = sorted((r["eps_total_exact"], r["qngi_median"]) for r in rows
                     if (r["M"], r["config"], r["method"]) == key)
        ok = [e for e, q in pts if q <= 0.1]
        star = min(ok) if ok else math.nan
        interp = math.nan
        if ok:
            i = [e for e, _ in pts].index(star)
            if i > 0 and pts[i - 1][1] > 0.1:  # log-linear between the last miss and the first hit
                (e0, q0), (e1, q1) = pts[i - 1], pts[i]
                t = (q0 - 0.1) / (q0 - q1)
                interp = float(math.exp(math.log(e0) + t * (math.log(e1) - math.log(e0))))
            else:
                interp = star
        best = min(q for _, q in pts)
        out.append({"M": key[0], "config": key[1], "method": key[2], "eps_star_grid": star,
                    "eps_star_interp": interp, "best_median_qngi": best})
    return out


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    Ms = sorted({r["M"] for r in rows})
    fig, axes = plt.subplots(1, len(Ms), figsize=(6.5 * len(Ms), 4.8), squeeze=False)
    colors = {"cape": "tab:red", "conv": "tab:blue", "local": "tab:green", "nonprivate": "k"}
    styles = {"paper": ":", "fast": "--", "tuned": "-"}
    for ax, M in zip(axes[0], Ms):
        for (config, method) in sorted({(r["config"], r["method"]) for r in rows if r["M"] == M}):
            rs = sorted((r for r in rows if (r["M"], r["config"], r["method"]) == (M, config, method)),
                        key=lambda r: r["eps_total_exact"])
            if method == "nonprivate":
                ax.axhline(rs[0]["qngi_median"], color="k", ls=styles[config], lw=1,
                           label=f"non-private ({config})")
                continue
            x = [r["eps_total_exact"] for r in rs]
            y = [r["qngi_median"] for r in rs]
            err = [[r["qngi_median"] - r["qngi_min"] for r in rs], [r["qngi_max"] - r["qngi_median"] for r in rs]]
            ax.errorbar(x, y, yerr=err, color=colors[method], ls=styles[config], marker="o", ms=3, capsize=2,
                        label=f"{'capeDJICA' if method == 'cape' else method} ({config})")
        ax.axhline(0.1, color="gray", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel(f"total epsilon per site (exact GDP, delta = {DELTA_TOTAL:g}; ICA only)")
        ax.set_ylabel("qNGI (median over noise seeds)")
        ax.set_title(f"M = {M} subjects, S = 4, R = 20, D = 900")
        ax.set_ylim(0, 0.5)
        ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# -- main ------------------------------------------------------------------------------------

def build_tasks(args) -> list[dict]:
    if args.quick:
        Ms, R, T, repeats = [32], 8, 100, 1
        grids = {"paper": [0.5, 4.0], "fast": [0.5, 4.0], "tuned": [0.5, 4.0]}
    else:
        Ms, R, T, repeats = [256, 1024], 20, 250, args.repeats
        grids = {"paper": [0.1, 0.5, 0.9, 4.0], "fast": [0.5, 0.9, 2.0, 4.0, 8.0],
                 "tuned": [0.1, 0.25, 0.5, 0.9, 2.0, 4.0, 8.0]}
    methods = {"paper": ["cape", "conv", "local"], "fast": ["cape"], "tuned": ["cape", "conv", "local"]}
    tasks = []
    for M in Ms:
        for config in ("paper", "fast", "tuned"):
            base = dict(M=M, R=R, T=T, config=config, quick=args.quick,
                        round_limit=min(CONFIGS[config]["rounds"], 30) if args.quick else CONFIGS[config]["rounds"])
            if config != "fast":
                tasks.append(dict(base, method="nonprivate", eps_i=None, seed=0))
            n_rep = repeats if config != "paper" else max(1, min(repeats, args.paper_repeats))
            for method in methods[config]:
                for eps_i in grids[config]:
                    for rep in range(n_rep):
                        tasks.append(dict(base, method=method, eps_i=eps_i, seed=1000 + rep))
    # longest first, grouped by M so that workers keep one data set cached
    cost = {"cape": 3, "conv": 2, "local": 1, "nonprivate": 2}
    tasks.sort(key=lambda t: (t["M"], -cost[t["method"]] * t["round_limit"]))
    return tasks


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--repeats", type=int, default=3, help="noise seeds per grid point (full run)")
    ap.add_argument("--paper-repeats", type=int, default=2, help="noise seeds for the 'paper' configuration")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    tasks = build_tasks(args)
    print(f"{len(tasks)} runs on {args.workers} worker processes", flush=True)
    results = []
    if args.workers > 1 and not args.quick:
        with mp.get_context("fork").Pool(args.workers, maxtasksperchild=None) as pool:
            for i, r in enumerate(pool.imap_unordered(run_task, tasks, chunksize=1)):
                results.append(r)
                if (i + 1) % 10 == 0:
                    print(f"  {i + 1}/{len(tasks)} runs, {time.perf_counter() - t_start:.0f} s", flush=True)
    else:
        results = [run_task(t) for t in tasks]
    rows = summarise(results)
    stars = eps_star(rows)

    # -- print
    hdr = f"{'M':>5} {'config':6} {'method':10} {'eps_i':>6} {'cal':8} {'rounds':>6} {'qNGI med':>8} " \
          f"{'[min,max]':>15} {'eps exact':>10} {'eps RDP':>9}"
    print("\n" + hdr)
    for r in rows:
        eps_i = f"{r['eps_i']:g}" if r["eps_i"] != "" else "-"
        print(f"{r['M']:5d} {r['config']:6} {r['method']:10} {eps_i:>6} {r['calibration'] or '-':8} "
              f"{r['rounds_run_median']:6.0f} {r['qngi_median']:8.3f} [{r['qngi_min']:.3f},{r['qngi_max']:.3f}]"
              f" {r['eps_total_exact']:10.2f} {r['eps_total_rdp']:9.2f}")
    print("\neps* (smallest total epsilon, exact GDP at delta 1e-5, with median qNGI <= 0.1; ICA only):")
    for s in stars:
        g = "not reached" if math.isnan(s["eps_star_grid"]) else f"{s['eps_star_grid']:.1f}"
        i = "" if math.isnan(s["eps_star_interp"]) else f" (interpolated {s['eps_star_interp']:.1f})"
        print(f"  M = {s['M']:5d} {s['config']:6} {s['method']:6}: {g}{i}; best median qNGI {s['best_median_qngi']:.3f}")
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f} s")

    # -- save
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    with open(RESULTS / f"djica_utility{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (RESULTS / f"djica_utility{tag}.json").write_text(json.dumps(
        {"settings": {"R": tasks[0]["R"], "T": tasks[0]["T"], "S": 4, "D": 900, "delta_i": DELTA_I,
                      "delta_total": DELTA_TOTAL, "configs": CONFIGS, "repeats": args.repeats,
                      "paper_repeats": args.paper_repeats, "whitening": "pooled non-private PCA (ICA-only epsilon)",
                      "wall_seconds": wall},
         "summary": rows, "eps_star": stars, "runs": results}, indent=1, default=str))
    plot(rows, RESULTS / f"djica_utility{tag}.png")


if __name__ == "__main__":
    main()
