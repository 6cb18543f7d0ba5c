"""capeDJICA qNGI and total epsilon vs the number of subjects M ([capeDJICA] Fig. 2), and the spatial maps of [capeDJICA] Fig. 3.

Data and configurations come from ``benchmarks/djica_utility.py`` (imported,
not repeated): R = 20 GARCH sources x blob maps on the 30 x 30 grid (D = 900),
250 time points per subject, M subjects split equally over S = 4 sites,
whitening by the pooled non-private PCA (so epsilon is the ICA's alone, as in
[capeDJICA]), delta_i = 1e-2 per release, total epsilon per site at delta = 1e-5 from
the ledgers (exact mu-GDP; RDP alongside).

Sweep: M in {64, 128, 256, 512, 1024} (16 to 256 subjects per site) at
eps_i in {0.5 (classic calibration), 2 (analytic)}, configuration ``tuned``
of djica_utility.py (fast optimizer, subject-level clipping B_G = 2, no bias
release, 200 rounds) for capeDJICA (plan "cape"), conv, local (site 1 alone)
and non-private (plan "none", same clipping); 3 noise seeds per point. The
reference configuration ``paper`` (the optimizer and clipping of [capeDJICA], at most 1000
rounds) runs for capeDJICA and non-private at eps_i = 0.5 with 2 seeds, to
show where the paper's rules end up. Reduction against [capeDJICA]: 10 -> 3 (2) runs
per point and 200 rounds (tuned) to keep the full run near 10 minutes.

Maps ([capeDJICA] Fig. 3): truth, non-private, local, conv and capeDJICA at M = 1024,
eps_i = 0.5 (tuned, first seed), 6 components matched to the truth (Hungarian
on |correlation|), sign-fixed, each scaled to max |value| 1. With noise-free
rank-R data the whitening basis satisfies V Lambda^{1/2} = A A_w^{-1}, so the
estimated maps V Lambda^{1/2} W^{-1} are A (W A_w)^{-1}, computed that way.

    python benchmarks/djica_vs_m.py            # full, about 10 minutes on 2 cores (2 worker processes)
    python benchmarks/djica_vs_m.py --quick    # seconds-long smoke run (writes *_quick.*)

Writes benchmarks/results/djica_vs_m.{csv,json,png} and djica_maps.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # parallelism comes from sites and worker processes
os.environ.setdefault("MPLBACKEND", "Agg")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import multiprocessing as mp  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from djica_utility import CONFIGS, DELTA_I, DELTA_TOTAL, data_for  # noqa: E402

from dpneuro.algorithms.djica import cape_djica, local_dp_ica  # noqa: E402
from dpneuro.algorithms.metrics import match_components, qngi  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
M_GRID = (64, 128, 256, 512, 1024)
EPS_I = (0.5, 2.0)
METHODS = ("cape", "conv", "local", "nonprivate")
LABEL = {"cape": "capeDJICA", "conv": "conv", "local": "local DP-ICA", "nonprivate": "non-private"}


def run_task(task: dict) -> dict:
    """One run; returns the metrics (and W when the task feeds the maps figure)."""
    d = data_for(task["M"], task["R"], task["T"])
    cfg = dict(CONFIGS[task["config"]])
    cfg["rounds"] = task["rounds"]
    kw = dict(cfg, random_state=task["seed"])
    if task["method"] != "nonprivate":
        eps_i = task["eps_i"]
        kw.update(epsilon_i=eps_i, delta_i=DELTA_I, calibration="classic" if eps_i < 1 else "analytic")
    t0 = time.perf_counter()
    if task["method"] == "local":
        res = local_dp_ica(d["Z"][0], d["subjects"][0], plan="conv", **kw)
    else:
        res = cape_djica(d["Z"], d["subjects"], plan={"cape": "cape", "conv": "conv", "nonprivate": "none"}
                         [task["method"]], **kw)
    out = dict(task, qngi=qngi(res.W @ d["Aw"]), rounds_run=res.rounds, status=res.status,
               eps_exact=res.epsilon(DELTA_TOTAL, "exact") if task["method"] != "nonprivate" else float("inf"),
               eps_rdp=res.epsilon(DELTA_TOTAL, "rdp") if task["method"] != "nonprivate" else float("inf"),
               seconds=time.perf_counter() - t0)
    if task.get("keep_W"):
        # estimated maps V Lambda^{1/2} W^{-1} = A (W A_w)^{-1} for noise-free rank-R data (see docstring)
        out["maps"] = d["A"] @ np.linalg.inv(res.W @ d["Aw"])
        out["truth_maps"] = d["A"]
    return out


def build_tasks(quick: bool, repeats: int, paper_repeats: int) -> list[dict]:
    if quick:
        Ms, eps_list, R, T, rounds, repeats, paper_repeats = (16, 32), (2.0,), 8, 100, 30, 1, 1
    else:
        Ms, eps_list, R, T, rounds = M_GRID, EPS_I, 20, 250, CONFIGS["tuned"]["rounds"]
    tasks = []
    for M in Ms:
        base = dict(M=M, R=R, T=T)
        tasks.append(dict(base, config="tuned", method="nonprivate", eps_i=None, seed=0, rounds=rounds,
                          keep_W=M == Ms[-1]))
        for eps_i in eps_list:
            for method in ("cape", "conv", "local"):
                for rep in range(repeats):
                    tasks.append(dict(base, config="tuned", method=method, eps_i=eps_i, seed=1000 + rep,
                                      rounds=rounds, keep_W=(M == Ms[-1] and eps_i == eps_list[0] and rep == 0)))
        # the paper's optimizer and clipping (round limit 1000; it usually stops far earlier)
        p_rounds = 30 if quick else CONFIGS["paper"]["rounds"]
        tasks.append(dict(base, config="paper", method="nonprivate", eps_i=None, seed=0, rounds=p_rounds))
        for rep in range(paper_repeats):
            tasks.append(dict(base, config="paper", method="cape", eps_i=eps_list[0], seed=1000 + rep,
                              rounds=p_rounds))
    # grouped by M (each worker keeps one data set cached), most expensive first within a group
    cost = {"cape": 3, "conv": 2, "local": 1, "nonprivate": 2}
    tasks.sort(key=lambda t: (t["M"], -cost[t["method"]]))
    return tasks


def summarise(results: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in results:
        groups.setdefault((r["config"], r["method"], r["eps_i"], r["M"]), []).append(r)
    rows = []
    for (config, method, eps_i, M), rs in sorted(
            groups.items(), key=lambda kv: (kv[0][0] != "tuned", METHODS.index(kv[0][1]), kv[0][2] or 0, kv[0][3])):
        q = np.array([r["qngi"] for r in rs])
        rows.append({"config": config, "method": method, "eps_i": "" if eps_i is None else eps_i,
                     "calibration": "" if eps_i is None else ("classic" if eps_i < 1 else "analytic"),
                     "M": M, "subjects_per_site": M // 4, "qngi_median": float(np.median(q)),
                     "qngi_min": float(q.min()), "qngi_max": float(q.max()),
                     "eps_total_exact": float(np.median([r["eps_exact"] for r in rs])),
                     "eps_total_rdp": float(np.median([r["eps_rdp"] for r in rs])),
                     "rounds_run_median": float(np.median([r["rounds_run"] for r in rs])),
                     "round_limit": rs[0]["rounds"], "repeats": len(rs),
                     "seconds_median": float(np.median([r["seconds"] for r in rs]))})
    return rows


def plot_sweep(rows: list[dict], path: Path) -> None:
    import matplotlib.pyplot as plt

    eps_list = sorted({r["eps_i"] for r in rows if r["eps_i"] != ""})
    fig, axes = plt.subplots(1, len(eps_list), figsize=(6.2 * len(eps_list), 5.2), squeeze=False)
    colors = {"cape": "tab:red", "conv": "tab:blue", "local": "tab:green", "nonprivate": "k"}
    for ax, eps_i in zip(axes[0], eps_list):
        ax2 = ax.twinx()
        for r_set, style in (("tuned", "-"), ("paper", ":")):
            for m in METHODS:
                rs = sorted((r for r in rows if r["config"] == r_set and r["method"] == m
                             and r["eps_i"] in (eps_i, "")), key=lambda r: r["M"])
                if not rs:
                    continue
                Ms = [r["M"] for r in rs]
                err = [[r["qngi_median"] - r["qngi_min"] for r in rs], [r["qngi_max"] - r["qngi_median"] for r in rs]]
                ax.errorbar(Ms, [r["qngi_median"] for r in rs], yerr=err, color=colors[m], ls=style, marker="o",
                            ms=3, capsize=2, label=f"{LABEL[m]} ({r_set})")
                if m != "nonprivate":
                    ax2.plot(Ms, [r["eps_total_exact"] for r in rs], color=colors[m], ls=style, lw=0.6,
                             marker="x", ms=4, alpha=0.5)
        ax.axhline(0.1, color="gray", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("total subjects M (S = 4 sites)")
        ax.set_ylabel("qNGI (median, bars: min-max)")
        ax.set_ylim(0, 0.5)
        ax2.set_ylabel(f"total epsilon per site (x, thin lines; exact GDP, delta {DELTA_TOTAL:g})")
        ax2.set_ylim(0, 1.3 * max(r["eps_total_exact"] for r in rows if r["eps_i"] == eps_i))
        ax.set_title(f"eps_i = {eps_i:g}, delta_i = {DELTA_I:g}")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_maps(results: list[dict], path: Path, n_show: int = 6, grid: int = 30) -> dict:
    """[capeDJICA] Fig. 3: truth and every method's matched maps on the grid; returns mean |r| per method."""
    import matplotlib.pyplot as plt

    keep = {r["method"]: r for r in results if "maps" in r and r["config"] == "tuned"}
    truth = next(iter(keep.values()))["truth_maps"]
    order = [m for m in ("nonprivate", "local", "conv", "cape") if m in keep]
    R = truth.shape[1]
    show = list(range(min(n_show, R)))
    fig, axes = plt.subplots(1 + len(order), len(show), figsize=(1.6 * len(show) + 1.4, 1.7 * (1 + len(order))),
                             squeeze=False)
    corr_summary = {}

    def draw(ax, v, title=None):
        ax.imshow(v.reshape(grid, grid), cmap="RdBu_r", vmin=-1, vmax=1)
        ax.set_xticks([])
        ax.set_yticks([])
        if title:
            ax.set_title(title, fontsize=7)

    for j, c in enumerate(show):
        draw(axes[0][j], truth[:, c] / np.abs(truth[:, c]).max(), f"component {c + 1}")
    axes[0][0].set_ylabel("truth", fontsize=8)
    for i, m in enumerate(order, start=1):
        est = keep[m]["maps"]
        perm, corr = match_components(est, truth)  # est[:, perm[j]] matches truth[:, j]
        corr_summary[m] = {"mean_abs_r": float(np.mean(np.abs(corr))), "qngi": keep[m]["qngi"],
                           "eps_total_exact": keep[m]["eps_exact"]}
        for j, c in enumerate(show):
            v = est[:, perm[c]] * np.sign(corr[c])
            draw(axes[i][j], v / np.abs(v).max(), f"|r| = {abs(corr[c]):.2f}")
        eps = "" if m == "nonprivate" else f"\neps = {keep[m]['eps_exact']:.1f}"
        axes[i][0].set_ylabel(f"{LABEL[m]}{eps}", fontsize=8)
    r0 = keep[order[-1]]
    fig.suptitle(f"spatial maps, M = {r0['M']}, eps_i = {r0['eps_i']}, delta_i = {DELTA_I:g} "
                 f"(tuned, {r0['rounds']} rounds); eps = total per site at delta {DELTA_TOTAL:g}", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return corr_summary


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (M = 16, 32; R = 8; 30 rounds)")
    ap.add_argument("--repeats", type=int, default=3, help="noise seeds per point (tuned configuration)")
    ap.add_argument("--paper-repeats", type=int, default=2, help="noise seeds for the 'paper' configuration")
    ap.add_argument("--workers", type=int, default=2, help="worker processes (full run)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    tasks = build_tasks(a.quick, a.repeats, a.paper_repeats)
    print(f"{len(tasks)} runs", flush=True)
    results = []
    if a.workers > 1 and not a.quick:
        with mp.get_context("fork").Pool(a.workers) as pool:
            for i, r in enumerate(pool.imap_unordered(run_task, tasks, chunksize=1)):
                results.append(r)
                if (i + 1) % 10 == 0:
                    print(f"  {i + 1}/{len(tasks)} runs, {time.perf_counter() - t_start:.0f} s", flush=True)
    else:
        results = [run_task(t) for t in tasks]
    rows = summarise(results)
    tag = "_quick" if a.quick else ""
    maps = plot_maps(results, a.out / f"djica_maps{tag}.png")
    plot_sweep(rows, a.out / f"djica_vs_m{tag}.png")
    with open(a.out / f"djica_vs_m{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    wall = time.perf_counter() - t_start
    (a.out / f"djica_vs_m{tag}.json").write_text(json.dumps(
        {"settings": {"R": tasks[0]["R"], "T": tasks[0]["T"], "S": 4, "D": 900, "delta_i": DELTA_I,
                      "delta_total": DELTA_TOTAL, "M": sorted({t["M"] for t in tasks}),
                      "configs": {k: CONFIGS[k] for k in ("tuned", "paper")}, "repeats": a.repeats,
                      "paper_repeats": a.paper_repeats, "workers": a.workers,
                      "whitening": "pooled non-private PCA (ICA-only epsilon)"},
         "maps_figure": maps, "summary": rows, "wall_seconds": wall, "date": time.strftime("%Y-%m-%d"),
         "runs": [{k: v for k, v in r.items() if k not in ("maps", "truth_maps")} for r in results]},
        indent=1, default=str))

    Ms = sorted({r["M"] for r in rows})
    print(f"\n{'config':6} {'method':10} {'eps_i':>5} " + "".join(f"{'M=' + str(M):>16}" for M in Ms))
    for key in sorted({(r["config"], r["method"], r["eps_i"]) for r in rows},
                      key=lambda k: (k[0] != "tuned", METHODS.index(k[1]), k[2] or 0)):
        rs = sorted((r for r in rows if (r["config"], r["method"], r["eps_i"]) == key), key=lambda r: r["M"])
        eps = f"{key[2]:g}" if key[2] != "" else "-"
        print(f"{key[0]:6} {key[1]:10} {eps:>5} " + "".join(
            f"{r['qngi_median']:7.3f} (e={r['eps_total_exact']:5.1f})" for r in rs))
    print("\nmaps figure (M max, first seed): " + ", ".join(
        f"{LABEL[m]} mean |r| {v['mean_abs_r']:.3f}, qNGI {v['qngi']:.3f}" for m, v in maps.items()))
    print(f"\nwrote {a.out}/djica_vs_m{tag}.csv, .json, .png, djica_maps{tag}.png in {wall:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
