"""Captured-energy ratio q / q_o vs samples per site N_s for capePCA and its baselines ([CAPE-TF] Fig. 2(d), [DPdisPCA] Fig. 1(d)).

The set-up, the preprocessing and the methods are those of
``benchmarks/pca_utility.py`` (imported from there, not repeated): D = 200,
K = 50, S = 10 sites, delta = 0.01, covariance diag(linspace(10, 1, 50),
0.5 * U(0, 1)^150), centred and divided by the pooled max sample norm (not
private, as in the papers); capePCA (plan "cape"), conv, DPdisPCA (R = 2K),
local (site 0 alone) and pooled DP (Analyze Gauss on the pooled data), with the
analytic Gaussian calibration.

The N_s grid and the fixed epsilon of the papers' figure are not in the text
(only on the figure's axes), so they are chosen here: N_s in
{100, 250, 500, 1000, 2500, 5000, 10000} at epsilon = 0.5 (the middle of
pca_utility.py's epsilon grid; that script's N_s = 1000 column is one point of
this sweep). Every repeat draws a fresh data set per N_s and fresh noise.

    python benchmarks/pca_vs_n.py            # full: 10 repeats, about 1-2 minutes on 2 cores
    python benchmarks/pca_vs_n.py --quick    # seconds-long smoke run (writes *_quick.*)

Writes benchmarks/results/pca_vs_n.{csv,json,png}.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the sites run as threads: one BLAS thread each
os.environ.setdefault("MPLBACKEND", "Agg")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from pca_utility import METHODS, make_data, plot_ratio, run_method  # noqa: E402

from dpneuro.algorithms.metrics import captured_energy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
N_S = (100, 250, 500, 1000, 2500, 5000, 10000)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run at small size")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per point (default 10; quick 2)")
    ap.add_argument("--epsilon", type=float, default=0.5)
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        D, K, S, n_grid, repeats = 50, 10, 5, (100, 400), a.repeats or 2
    else:
        D, K, S, n_grid, repeats = 200, 50, 10, N_S, a.repeats or 10
    delta, eps = 0.01, a.epsilon
    a.out.mkdir(parents=True, exist_ok=True)
    ratios: dict[tuple[int, str], list[float]] = {}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    t_start = time.time()
    for rep in range(repeats):
        for i_n, Ns in enumerate(n_grid):
            Xs, X = make_data(D, K, S, Ns, seed=1000 * rep + i_n)
            A = X @ X.T / X.shape[1]
            q_o = float(np.sort(np.linalg.eigvalsh(A))[::-1][:K].sum())
            for im, m in enumerate(METHODS):
                t = time.time()
                res = run_method(m, Xs, X, K, eps, delta, seed=10_000 * rep + 100 * i_n + im)
                times[m].append(time.time() - t)
                ratios.setdefault((Ns, m), []).append(captured_energy(res.basis, A) / q_o)
        print(f"repeat {rep + 1}/{repeats} done ({time.time() - t_start:.0f} s)", flush=True)

    rows = []
    for (Ns, m), v in sorted(ratios.items(), key=lambda kv: (kv[0][0], METHODS.index(kv[0][1]))):
        v = np.array(v)
        rows.append({"N_s": Ns, "N": S * Ns, "method": m, "epsilon": eps, "median": float(np.median(v)),
                     "q25": float(np.quantile(v, 0.25)), "q75": float(np.quantile(v, 0.75)), "n": len(v)})
    name = "pca_vs_n_quick" if a.quick else "pca_vs_n"
    with open(a.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"D": D, "K": K, "S": S, "N_s": list(n_grid), "epsilon": eps, "delta": delta, "repeats": repeats,
            "calibration": "analytic", "unit": "sample", "DPdisPCA_R": 2 * K,
            "preprocessing": "centred, divided by the pooled max sample norm (as the papers; not private)",
            "seconds_per_run_median": {m: float(np.median(t)) for m, t in times.items()},
            "wall_seconds": time.time() - t_start, "date": time.strftime("%Y-%m-%d")}
    (a.out / f"{name}.json").write_text(json.dumps(meta, indent=2))

    print(f"\nq/q_o (median over {repeats}; D={D}, K={K}, S={S}, eps={eps}, delta={delta}, analytic calibration)")
    print("N_s    " + "".join(f"{m:>11}" for m in METHODS))
    for Ns in n_grid:
        med = {r["method"]: r["median"] for r in rows if r["N_s"] == Ns}
        print(f"{Ns:<6} " + "".join(f"{med[m]:>11.3f}" for m in METHODS))

    plot_ratio(rows, "N_s", "samples per site N_s", f"D={D}, K={K}, S={S}, eps={eps}, delta={delta} (median of {repeats})",
               a.out / f"{name}.png")
    print(f"\nwrote {a.out / (name + '.csv')}, .json, .png in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
