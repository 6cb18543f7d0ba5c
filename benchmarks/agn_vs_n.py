"""capeAGN q_comp vs sample size N ([CAPE-TF] Figs. 3-4, bottom rows): MOG and STM, D = 10, K = 5.

Data, methods, metric and repeats come from ``benchmarks/agn_utility.py``
(``run_config`` is imported from there, not repeated): S = 5 equal sites
(N_s = N / 5), delta = 0.01 split equally between the two stages, analytic
Gaussian calibration; methods capeAGN (CAPE), conv, local (site 0), pooled AGN
and AVN, the non-private method of moments and random vectors; q_comp = mean
distance of each recovered a_k to the nearest true a_j (median over repeats;
the Hungarian-matched version is in the CSV).

The text of [CAPE-TF] gives neither the N grid nor the fixed epsilon of the
N-sweeps (they are on the figures' axes only), so they are chosen here:
N in {10k, 25k, 50k, 100k, 250k, 500k} at epsilon = 1 and epsilon = 5
(agn_utility.py's epsilon sweeps sit at N = 50k for MOG and 100k for STM).
D = 50 is left out: its capeAGN is no better than random vectors at
eps <= 1 and N = 50k (agn_utility.csv), and its tensor work dominates the run time.

    python benchmarks/agn_vs_n.py            # full: 10 repeats, a few minutes on 2 cores
    python benchmarks/agn_vs_n.py --quick    # seconds-long smoke run (writes *_quick.*)

Writes benchmarks/results/agn_vs_n.{csv,json,png}.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from agn_utility import DELTA, METHODS, SIGMA2, run_config  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
N_GRID = (10_000, 25_000, 50_000, 100_000, 250_000, 500_000)
EPSILONS = (1.0, 5.0)


def plot(rows, path, epsilons):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = sorted({r["model"] for r in rows})
    fig, axes = plt.subplots(1, len(models) * len(epsilons), figsize=(4.0 * len(models) * len(epsilons), 3.6),
                             squeeze=False)
    axes = iter(axes[0])
    for model in models:
        for eps in epsilons:
            ax = next(axes)
            for m in METHODS:
                sub = sorted((r for r in rows if (r["model"], r["epsilon"], r["method"]) == (model, eps, m)),
                             key=lambda r: r["N"])
                ax.plot([r["N"] for r in sub], [r["q_comp_median"] for r in sub], marker="o", ms=3, label=m,
                        ls="--" if m in ("nonprivate", "random") else "-")
            ax.set_xscale("log")
            ax.set_yscale("log")
            ax.set_xlabel("N (all sites; N_s = N / 5)")
            D, K = rows[0]["D"], rows[0]["K"]
            ax.set_title(f"{model.upper()} D={D} K={K}, eps={eps:g}")
    fig.axes[0].set_ylabel("q_comp (median)")
    fig.axes[-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (two small N)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per point (default 10; quick 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    a.out.mkdir(parents=True, exist_ok=True)
    if a.quick:
        n_grid, epsilons, repeats, name = (5_000, 20_000), (1.0,), a.repeats or 2, "agn_vs_n_quick"
    else:
        n_grid, epsilons, repeats, name = N_GRID, EPSILONS, a.repeats or 10, "agn_vs_n"
    D, K, S = 10, 5, 5
    t_start = time.perf_counter()
    rows, seconds = [], {}
    for model in ("mog", "stm"):
        for N in n_grid:
            t = time.perf_counter()
            rows += run_config(model, D, K, N, S, epsilons, repeats)
            seconds[f"{model} N={N}"] = time.perf_counter() - t
            print(f"[{model} N={N}: {seconds[f'{model} N={N}']:.1f} s]", file=sys.stderr, flush=True)
    for r in rows:
        r["N_s"] = r["N"] // S
    with open(a.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    plot(rows, a.out / f"{name}.png", epsilons)
    meta = {"D": D, "K": K, "S": S, "N": list(n_grid), "epsilons": list(epsilons), "delta": DELTA,
            "sigma2": SIGMA2, "repeats": repeats, "split": [0.5, 0.5],
            "calibration": "analytic Gaussian (Balle & Wang 2018)", "seconds": seconds,
            "runtime_s": time.perf_counter() - t_start, "date": time.strftime("%Y-%m-%d")}
    (a.out / f"{name}.json").write_text(json.dumps(meta, indent=2))
    for model in ("mog", "stm"):
        for eps in epsilons:
            print(f"\n{model.upper()} D={D} K={K} S={S} eps={eps:g} delta={DELTA} "
                  f"(median q_comp over {repeats} repeats; lower is better)")
            print("  N       " + "".join(f"{m:>12s}" for m in METHODS))
            for N in n_grid:
                v = {r["method"]: r["q_comp_median"] for r in rows
                     if (r["model"], r["epsilon"], r["N"]) == (model, eps, N)}
                print(f"{N:<9d} " + "".join(f"{v[m]:12.4f}" for m in METHODS))
    print(f"\nwrote {a.out}/{name}.csv, .json, .png ({meta['runtime_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
