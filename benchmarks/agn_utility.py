"""capeAGN utility and speed on the synthetic MOG / STM set-ups of [CAPE-TF] Sec. VI-B.

Utility: q_comp ([CAPE-TF] Sec. VI-B: mean distance of each recovered a_k to the
nearest true a_j; the Hungarian-matched version alongside) against epsilon for
capeAGN (CAPE), conv (independent noise per site), local (AGN on one site),
pooled AGN and AVN (one party holding all data; capeAGN's target), the
non-private method of moments and random vectors. Median over repeats; each
repeat draws a fresh data set (shared by all methods and epsilons) and fresh
noise.

Set-up ([CAPE-TF] Sec. VI-B and the authors' data-generation scripts):
K = 5, D = 10 and K = 10, D = 50; w proportional to linspace(1, 10K, K);
S = 5 equal sites; delta = 0.01; eps and delta split equally between the two
stages; the papers' noise shape on the symmetric moments ("mirrored": every
unique entry at the full std; dpneuro's default halves the off-diagonal
variance, see dpneuro.protocol.cape.packing). MOG: a_k = first K columns of a random orthogonal matrix,
sigma^2 = 0.05, N = 50k; samples are divided by a public bound zeta computed
from the model (never from the data; see ``mog_scale``) and projected onto the
unit ball. STM: topics = the same columns with negatives zeroed and
renormalised, 3 one-hot words per document, N = 100k (the smallest N of the
authors' STM result files).

Timings (seconds, this machine): the symmetric D x D x D noise tensor from
its C(D+2, 3) unique draws (first call, including the cached index arrays, and
warm), E(W, W, W), M3(W, W, W) straight from the pooled samples, one site's
full M3_s (what a CAPE site protects), a full capeAGN run (plan "cape", with
secure aggregation) and a pooled AGN run.

    python benchmarks/agn_utility.py            # full (about 5-10 minutes on 2 cores)
    python benchmarks/agn_utility.py --quick    # seconds-long smoke run
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import time
from pathlib import Path

import numpy as np
from scipy import stats
from scipy.stats import ortho_group

from dpneuro.algorithms import tensor as tz
from dpneuro.algorithms.agn import agn, avn, cape_agn, local_agn, otd, prepare_site
from dpneuro.algorithms.metrics import q_comp
from dpneuro.protocol.cape.packing import unique_indices

RESULTS = Path(__file__).resolve().parent / "results"
SIGMA2 = 0.05
DELTA = 0.01
EPSILONS = (0.1, 0.5, 1.0, 5.0, 10.0)
METHODS = ("capeagn", "conv", "local", "agn_pooled", "avn_pooled", "nonprivate", "random")


# -- data ---------------------------------------------------------------------------------------

def _weights(K):
    w = np.linspace(1, 10 * K, K)
    return w / w.sum()


def mog_scale(D: int) -> float:
    """Public norm bound from the model: ||a_k|| = 1 plus a 1e-4 chi-square tail of ||z||^2 and the cross term."""
    return float(np.sqrt(1 + SIGMA2 * stats.chi2.ppf(1 - 1e-4, D) + 8 * np.sqrt(SIGMA2)))


def make_mog(D, K, N, S, rng):
    A = ortho_group.rvs(D, random_state=rng)[:, :K]
    h = rng.choice(K, size=N, p=_weights(K))
    X = A[:, h] + np.sqrt(SIGMA2) * rng.standard_normal((D, N))
    return A, np.array_split(X, S, axis=1)


def make_stm(D, K, N, S, rng):
    A = np.maximum(ortho_group.rvs(D, random_state=rng)[:, :K], 0)
    A /= A.sum(axis=0)
    h = rng.choice(K, size=N, p=_weights(K))
    words = np.empty((3, N), np.int64)
    for j in range(K):
        idx = np.flatnonzero(h == j)
        words[:, idx] = rng.choice(D, size=(3, len(idx)), p=A[:, j])
    onehot = np.zeros((3, D, N), np.uint8)
    onehot[np.arange(3)[:, None], words, np.arange(N)[None, :]] = 1
    return A, np.array_split(onehot, S, axis=2)


# -- utility ------------------------------------------------------------------------------------

def run_config(model, D, K, N, S, epsilons, repeats, seed0=0):
    rows = {(eps, m): [] for eps in epsilons for m in METHODS}
    for rep in range(repeats):
        rng = np.random.default_rng([seed0, D, rep])
        if model == "mog":
            A, sites = make_mog(D, K, N, S, rng)
            scale = mog_scale(D)
            sds = [prepare_site(x, "mog", scale=scale, site=s) for s, x in enumerate(sites)]
            pooled = prepare_site(np.hstack(sites), "mog", scale=scale, site="pooled")
            R = rng.standard_normal((D, K))
            R /= np.linalg.norm(R, axis=0)
        else:
            A, sites = make_stm(D, K, N, S, rng)
            sds = [prepare_site(x, "stm", site=s) for s, x in enumerate(sites)]
            pooled = prepare_site(np.concatenate(sites, axis=2), "stm", site="pooled")
            R = rng.dirichlet(np.ones(D), size=K).T
        kw = dict(model=model, symmetric_noise="mirrored")  # the papers' noise on the moments' unique entries
        q = lambda res: (q_comp(res.components, A), q_comp(res.components, A, "hungarian"))  # noqa: E731
        nonpriv = q(otd(pooled, K, random_state=rep, model=model))
        rnd = (q_comp(R, A), q_comp(R, A, "hungarian"))
        for eps in epsilons:
            rows[(eps, "capeagn")].append(q(cape_agn(sds, K, eps, DELTA, plan="cape", random_state=rep, **kw)))
            rows[(eps, "conv")].append(q(cape_agn(sds, K, eps, DELTA, plan="conv", random_state=rep, **kw)))
            rows[(eps, "local")].append(q(local_agn(sds, K, eps, DELTA, site=0, random_state=rep, **kw)))
            rows[(eps, "agn_pooled")].append(q(agn(pooled, K, eps, DELTA, random_state=rep, **kw)))
            rows[(eps, "avn_pooled")].append(q(avn(pooled, K, eps, DELTA, random_state=rep, **kw)))
            rows[(eps, "nonprivate")].append(nonpriv)
            rows[(eps, "random")].append(rnd)
    out = []
    for (eps, m), vals in rows.items():
        v = np.asarray(vals)
        out.append({"model": model, "D": D, "K": K, "N": N, "S": S, "delta": DELTA, "epsilon": eps,
                    "method": m, "q_comp_median": float(np.median(v[:, 0])),
                    "q_comp_q25": float(np.percentile(v[:, 0], 25)),
                    "q_comp_q75": float(np.percentile(v[:, 0], 75)),
                    "q_comp_hungarian_median": float(np.median(v[:, 1])), "repeats": len(v)})
    return out


# -- timings ------------------------------------------------------------------------------------

def _clock(fn, reps=3):
    best = np.inf
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def timings(dims, N, S, K_of):
    out = []
    for D in dims:
        K = K_of[D]
        rng = np.random.default_rng(D)
        A, sites = make_mog(D, K, N, S, rng)
        scale = mog_scale(D)
        sds = [prepare_site(x, "mog", scale=scale) for x in sites]
        pooled = prepare_site(np.hstack(sites), "mog", scale=scale)
        W = np.linalg.qr(rng.standard_normal((D, K)))[0]
        unique_indices.cache_clear()  # the first call builds the index arrays of the unique entries
        b = rng.standard_normal(tz.n_sym(D))
        t0 = time.perf_counter()
        E = tz.sym_from_unique(b, D)
        cold = time.perf_counter() - t0
        warm = _clock(lambda: tz.sym_from_unique(rng.standard_normal(tz.n_sym(D)), D), 5)
        ewww = _clock(lambda: tz.multilinear(E, W), 5)
        m3w = _clock(lambda: tz.whitened_third_moment(pooled.X, W), 3)
        m3_site = _clock(lambda: tz.third_moment(sds[0].X), 2)
        cape_total, cape = np.inf, None
        for rep in range(3):  # fresh sites: the run includes every site's full M3_s
            fresh = [prepare_site(x, "mog", scale=scale) for x in sites]
            t0 = time.perf_counter()
            res = cape_agn(fresh, K, 1.0, DELTA, plan="cape", random_state=rep)
            if time.perf_counter() - t0 < cape_total:
                cape_total, cape = time.perf_counter() - t0, res
        pooled_run = _clock(lambda: agn(pooled, K, 1.0, DELTA, random_state=0), 2)
        out.append({"D": D, "K": K, "n_sym": tz.n_sym(D), "N": N, "S": S,
                    "noise_tensor_first_call_s": cold, "noise_tensor_s": warm, "noise_contract_EWWW_s": ewww,
                    "m3_whitened_pooled_s": m3w, "m3_full_one_site_s": m3_site,
                    "capeagn_run_s": cape_total, "capeagn_stage1_s": cape.info["time"]["stage1"],
                    "capeagn_stage2_s": cape.info["time"]["stage2"], "capeagn_tpm_s": cape.info["time"]["tpm"],
                    "agn_pooled_run_s": pooled_run})
    return out


# -- output -------------------------------------------------------------------------------------

def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def print_table(rows):
    configs = sorted({(r["model"], r["D"], r["K"], r["N"]) for r in rows}, key=lambda c: (c[0], c[1]))
    for model, D, K, N in configs:
        sub = [r for r in rows if (r["model"], r["D"]) == (model, D)]
        print(f"\n{model.upper()}  D={D} K={K} N={N} S={sub[0]['S']} delta={DELTA}  "
              f"(median q_comp over {sub[0]['repeats']} repeats; lower is better)")
        print("  eps   " + "".join(f"{m:>12s}" for m in METHODS))
        for eps in sorted({r["epsilon"] for r in sub}):
            vals = {r["method"]: r["q_comp_median"] for r in sub if r["epsilon"] == eps}
            print(f"{eps:6.2f} " + "".join(f"{vals[m]:12.4f}" for m in METHODS))


def plot(rows, path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = sorted({(r["model"], r["D"], r["K"], r["N"]) for r in rows}, key=lambda c: (c[0], c[1]))
    fig, axes = plt.subplots(1, len(configs), figsize=(4.2 * len(configs), 3.6), squeeze=False)
    for ax, (model, D, K, N) in zip(axes[0], configs):
        for m in METHODS:
            sub = sorted((r for r in rows if (r["model"], r["D"], r["method"]) == (model, D, m)),
                         key=lambda r: r["epsilon"])
            e = [r["epsilon"] for r in sub]
            ax.plot(e, [r["q_comp_median"] for r in sub], marker="o", ms=3, label=m,
                    ls="--" if m in ("nonprivate", "random") else "-")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("epsilon")
        ax.set_title(f"{model.upper()} D={D} K={K} N={N // 1000}k")
    axes[0][0].set_ylabel("q_comp (median)")
    axes[0][-1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run (D = 10 only, small N)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats per point (default 10; quick 2)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    if args.quick:
        configs = [("mog", 10, 5, 10_000), ("stm", 10, 5, 20_000)]
        epsilons, repeats = (0.5, 5.0), args.repeats or 2
        tdims, tN = (10,), 10_000
        tag, sfx = "agn", "_quick"  # quick outputs never overwrite the full-size results
    else:
        configs = [("mog", 10, 5, 50_000), ("mog", 50, 10, 50_000),
                   ("stm", 10, 5, 100_000), ("stm", 50, 10, 100_000)]
        epsilons, repeats = EPSILONS, args.repeats or 10
        tdims, tN = (10, 30, 50), 50_000
        tag, sfx = "agn", ""
    rows = []
    for model, D, K, N in configs:
        t = time.perf_counter()
        rows += run_config(model, D, K, N, 5, epsilons, repeats)
        print(f"[{model} D={D}: {time.perf_counter() - t:.1f} s]", file=sys.stderr)
    print_table(rows)
    trows = timings(tdims, tN, 5, {10: 5, 30: 8, 50: 10})
    print("\nTimings (s):")
    for r in trows:
        print("  " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))
    write_csv(args.out / f"{tag}_utility{sfx}.csv", rows)
    write_csv(args.out / f"{tag}_timings{sfx}.csv", trows)
    plot(rows, args.out / f"{tag}_utility{sfx}.png")
    meta = {"repeats": repeats, "epsilons": list(epsilons), "delta": DELTA, "sigma2": SIGMA2, "sites": 5,
            "split": [0.5, 0.5], "calibration": "analytic Gaussian (Balle & Wang 2018)",
            "mog_scale": {D: mog_scale(D) for _, D, _, _ in configs},
            "runtime_s": time.perf_counter() - t_start, "numpy": np.__version__}
    (args.out / f"{tag}_utility{sfx}.json").write_text(json.dumps(meta, indent=2))
    print(f"\nwrote {args.out}/{tag}_utility{sfx}.csv, {tag}_timings{sfx}.csv, {tag}_utility{sfx}.png "
          f"({meta['runtime_s']:.0f} s)")


if __name__ == "__main__":
    main()
