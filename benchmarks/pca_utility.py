"""Captured-energy ratio q / q_o vs epsilon for capePCA and its baselines ([CAPE-TF] Sec. VI-A, [DPdisPCA] Sec. 4).

Set-up of the papers' synthetic experiment: D = 200, K = 50, zero-mean Gaussian
samples with covariance diag(linspace(10, 1, 50), 0.5 * U(0, 1)^150) (the
papers give no rotation, so none is applied; ``--rotate`` adds a random
orthogonal one), S = 10 sites x N_s = 1000, delta = 0.01. Preprocessing as in
the papers and *not private*: centre, then divide every sample by the largest
sample norm in the pooled data (so max ||x|| = 1).

q = tr(V^T A V) with A the pooled second-moment matrix of the (preprocessed)
data; q_o = the same for the non-private pooled top-K subspace. Methods:
capePCA (plan "cape"), conv (independent noise per site), DPdisPCA (R = 2K),
local (site 0 alone), pooled DP (Analyze Gauss on the pooled data). Noise is
calibrated with the analytic Gaussian mechanism; ``--classic`` adds rows with
the papers' classic formula for eps < 1 (the only range where it is valid).
The noise has the papers' shape ("mirrored": every unique entry of the
covariance at the full std); dpneuro's default ("symmetrized") halves the
off-diagonal variance at the same guarantee (dpneuro.protocol.cape.packing).

Writes benchmarks/results/pca_utility.csv (median and quartiles over the
repeats), pca_utility.json (set-up and timing) and pca_utility.png.
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # the sites run as threads: one BLAS thread each
os.environ.setdefault("MPLBACKEND", "Agg")

import argparse  # noqa: E402
import csv  # noqa: E402
import json  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402

from dpneuro.algorithms import cape_pca  # noqa: E402
from dpneuro.algorithms.baselines import dpdispca, local_pca, pooled_dp_pca  # noqa: E402
from dpneuro.algorithms.metrics import captured_energy  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
METHODS = ("capePCA", "conv", "DPdisPCA", "local", "pooled DP")


def make_data(D: int, K: int, S: int, Ns: int, seed: int, rotate: bool = False):
    rng = np.random.default_rng(seed)
    lam = np.r_[np.linspace(10, 1, K), 0.5 * rng.uniform(size=D - K)]
    X = rng.standard_normal((D, S * Ns)) * np.sqrt(lam)[:, None]
    if rotate:
        X = np.linalg.qr(rng.standard_normal((D, D)))[0] @ X
    X -= X.mean(axis=1, keepdims=True)  # papers' preprocessing (not private)
    X /= np.linalg.norm(X, axis=0).max()  # max sample norm 1 (not private)
    return [X[:, s * Ns:(s + 1) * Ns] for s in range(S)], X


def run_method(name, Xs, X, K, eps, delta, seed, calibration="analytic"):
    # the papers' relation (one sample added or removed) and their noise on the covariance's unique entries
    # (each at the full std): this benchmark reproduces their figures
    kw = dict(random_state=seed, calibration=calibration, neighbour="add-remove", symmetric_noise="mirrored")
    if name == "capePCA":
        return cape_pca(Xs, K, eps, delta, plan="cape", **kw)
    if name == "conv":
        return cape_pca(Xs, K, eps, delta, plan="conv", **kw)
    if name == "DPdisPCA":
        return dpdispca(Xs, K, eps, delta, R=2 * K, **kw)
    if name == "local":
        return local_pca(Xs[0], K, eps, delta, **kw)
    if name == "pooled DP":
        return pooled_dp_pca(X, K, eps, delta, **kw)
    raise ValueError(name)


def plot_ratio(rows, x_key: str, xlabel: str, title: str, path) -> None:
    """Median q / q_o with its interquartile band per method, against ``x_key`` (log axis)."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for m, mk in zip(METHODS, "osd^v"):
        r = [x for x in rows if x["method"] == m]
        xs = [x[x_key] for x in r]
        ax.plot(xs, [x["median"] for x in r], marker=mk, label=m)
        ax.fill_between(xs, [x["q25"] for x in r], [x["q75"] for x in r], alpha=0.15)
    ax.axhline(1.0, color="k", lw=0.8, ls=":", label="non-private pooled")
    ax.set_xscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel("captured energy q / q_o")
    ax.set_title(title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run at small size")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--rotate", action="store_true", help="rotate the covariance by a random orthogonal matrix")
    ap.add_argument("--classic", action="store_true", help="also run the papers' classic calibration (eps < 1)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    a = ap.parse_args(argv)
    if a.quick:
        D, K, S, Ns, epsilons, repeats = 50, 10, 5, 200, [0.5, 5.0], a.repeats or 2
    else:
        D, K, S, Ns, epsilons, repeats = 200, 50, 10, 1000, [0.1, 0.5, 1.0, 5.0, 10.0], a.repeats or 10
    delta = 0.01
    a.out.mkdir(parents=True, exist_ok=True)
    ratios: dict[tuple[float, str, str], list[float]] = {}
    times: dict[str, list[float]] = {m: [] for m in METHODS}
    t_start = time.time()
    for rep in range(repeats):
        Xs, X = make_data(D, K, S, Ns, seed=rep, rotate=a.rotate)
        A = X @ X.T / X.shape[1]
        q_o = float(np.sort(np.linalg.eigvalsh(A))[::-1][:K].sum())
        for ie, eps in enumerate(epsilons):
            cals = ["analytic"] + (["classic"] if a.classic and eps < 1 else [])
            for cal in cals:
                for im, m in enumerate(METHODS):
                    t = time.time()
                    res = run_method(m, Xs, X, K, eps, delta, seed=10_000 * rep + 100 * ie + im, calibration=cal)
                    if cal == "analytic":
                        times[m].append(time.time() - t)
                    ratios.setdefault((eps, m, cal), []).append(captured_energy(res.basis, A) / q_o)
        print(f"repeat {rep + 1}/{repeats} done ({time.time() - t_start:.0f} s)", flush=True)

    rows = []
    for (eps, m, cal), v in sorted(ratios.items(), key=lambda kv: (kv[0][2], kv[0][0], METHODS.index(kv[0][1]))):
        v = np.array(v)
        rows.append({"epsilon": eps, "method": m, "calibration": cal, "median": float(np.median(v)),
                     "q25": float(np.quantile(v, 0.25)), "q75": float(np.quantile(v, 0.75)),
                     "mean": float(v.mean()), "std": float(v.std(ddof=1)) if len(v) > 1 else 0.0, "n": len(v)})
    name = "pca_utility_quick" if a.quick else "pca_utility"
    with open(a.out / f"{name}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"D": D, "K": K, "S": S, "N_s": Ns, "delta": delta, "epsilons": epsilons, "repeats": repeats,
            "rotate": a.rotate, "unit": "sample", "neighbour": "add-remove", "DPdisPCA_R": 2 * K,
            "preprocessing": "centred, divided by the pooled max sample norm (as the papers; not private)",
            "seconds_per_run_median": {m: float(np.median(t)) for m, t in times.items()},
            "wall_seconds": time.time() - t_start}
    (a.out / f"{name}.json").write_text(json.dumps(meta, indent=2))

    # table: median ratio, methods as columns
    print(f"\nq/q_o (median over {repeats}; D={D}, K={K}, S={S}, N_s={Ns}, delta={delta}, analytic calibration)")
    print("eps    " + "".join(f"{m:>11}" for m in METHODS))
    for eps in epsilons:
        med = {r["method"]: r["median"] for r in rows if r["epsilon"] == eps and r["calibration"] == "analytic"}
        print(f"{eps:<6} " + "".join(f"{med[m]:>11.3f}" for m in METHODS))
    if a.classic:
        print("classic calibration (papers' formula, eps < 1):")
        for eps in [e for e in epsilons if e < 1]:
            med = {r["method"]: r["median"] for r in rows if r["epsilon"] == eps and r["calibration"] == "classic"}
            print(f"{eps:<6} " + "".join(f"{med[m]:>11.3f}" for m in METHODS))

    plot_ratio([x for x in rows if x["calibration"] == "analytic"], "epsilon", "epsilon (per site, delta = 0.01)",
               f"D={D}, K={K}, S={S}, N_s={Ns} (median of {repeats})", a.out / f"{name}.png")
    print(f"\nwrote {a.out / (name + '.csv')}, .json, .png in {time.time() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
