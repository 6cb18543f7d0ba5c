"""capeDJICA speed: seconds per round for R = 20, N = 256K samples in all, S = 4 sites.

Measures (median over repeats)

* pure compute: every site's clipped-gradient function plus the aggregator's
  update, float64 and float32 data, sites one after the other and on a pool
  of 2 threads (the driver runs sites in threads), with BLAS on 1 thread and
  on its default;
* the naive float64 baseline that materialises every per-sample R x R
  gradient to take its norm (chunked so it fits in memory);
* subject-level clipping (``clip_unit="subject"``);
* a full protocol round over the in-process exchange for plans "none",
  "conv" and "cape" (secure aggregation included): the slope of wall time
  against rounds between a short and a longer run, so set-up is excluded;
* where the time of a CAPE round goes (cProfile, grouped by module).

Writes benchmarks/results/djica_speed.{csv,json,png}. ``--quick`` runs a
seconds-long smoke version (N = 16K).
"""

from __future__ import annotations

import argparse
import cProfile
import csv
import json
import os
import platform
import pstats
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path

import numpy as np

from dpneuro.algorithms.djica import (
    INFOMAX_SCALE,
    OPTIMIZERS,
    CapeDJICA,
    _lr_step,
    cape_djica,
    infomax_gradients,
    subject_clipped_gradients,
)

RESULTS = Path(__file__).resolve().parent / "results"


def blas_threads(n):
    """Context limiting BLAS threads (threadpoolctl, shipped with scikit-learn) or a no-op."""
    if n is None:
        return nullcontext()
    try:
        from threadpoolctl import threadpool_limits
    except ImportError:  # pragma: no cover
        return nullcontext()
    return threadpool_limits(limits=n, user_api="blas")


def make_sites(N, R, S, dtype, seed=0):
    rng = np.random.default_rng(seed)
    Z = rng.laplace(size=(R, N)) / np.sqrt(2)  # unit variance, super-Gaussian
    return [np.ascontiguousarray(z, dtype=dtype) for z in np.array_split(Z, S, axis=1)]


def naive_gradients(X, W, b, BG, Bh, chunk=4096):
    """Per-sample R x R matrices and their norms (what the identity avoids), float64."""
    R, N = X.shape
    G, h = np.zeros((R, R)), np.zeros(R)
    I = np.eye(R)
    for lo in range(0, N, chunk):
        x = np.asarray(X[:, lo:lo + chunk], np.float64)
        U = W @ x + b[:, None]
        Y = 1 - 2 / (1 + np.exp(-U))
        Gn = (I[None] + Y.T[:, :, None] * U.T[:, None, :]) @ W  # n x R x R
        c = np.minimum(1.0, BG / np.linalg.norm(Gn, axis=(1, 2)))
        G += np.tensordot(c, Gn, axes=1)
        ch = np.minimum(1.0, Bh / np.linalg.norm(Y, axis=0))
        h += Y @ ch
    return G / N, h / N


def median_time(fn, repeats):
    fn()  # warm-up
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def compute_round(sites, W, b, kernel, pool, lengths=None):
    """All sites' gradients (sequentially or on the pool) + one aggregator update."""
    R = W.shape[0]
    if kernel == "subject":
        def f(i):
            return subject_clipped_gradients(sites[i], W, b, lengths[i], 2.0, 1.0)
    elif kernel == "naive":
        def f(i):
            return naive_gradients(sites[i], W, b, 30.0, 30.0)
    else:
        def f(i):
            return infomax_gradients(sites[i], W, b, 30.0, 30.0)
    out = list(pool.map(f, range(len(sites)))) if pool is not None else [f(i) for i in range(len(sites))]
    n = np.array([s.shape[1] for s in sites], float)
    G = sum(w * o[0] for w, o in zip(n / n.sum(), out))
    h = sum(w * o[1] for w, o in zip(n / n.sum(), out))
    st = CapeDJICA(R=R, plan="none", optimizer=OPTIMIZERS["fast"], rounds=10).aggregator_init()["ica"]
    _lr_step(st, OPTIMIZERS["fast"], G, h)


def protocol_seconds_per_round(sites, subjects, plan, short, long, repeats):
    # tol = 0: every run goes to its round limit (a non-private run could stop early)
    # per-sample clipping with the bias released, as when the table was measured ([capeDJICA] as published)
    kw = dict(plan=plan, optimizer=replace(OPTIMIZERS["fast"], tol=0.0), random_state=0, clip_G=30.0, clip_h=30.0,
              clip_unit="sample", bias=True, calibration="classic")
    if plan != "none":
        kw.update(epsilon_i=0.5, delta_i=1e-2)

    def run(J):
        t0 = time.perf_counter()
        cape_djica(sites, subjects, rounds=J, **kw)
        return time.perf_counter() - t0

    slopes = []
    for _ in range(repeats):
        slopes.append((run(long) - run(short)) / (long - short))
    return statistics.median(slopes)


def _group(file: str, func: str) -> str:
    if "djica" in file:
        return "djica kernel" if func in ("infomax_gradients", "subject_clipped_gradients") else "djica other"
    if "secagg" in file:
        return "secagg (masks, Shamir, ChaCha20, fixed point)"
    if "exchange" in file or "hmac" in file or "json" in file or "hashlib" in func:
        return "exchange (encode, HMAC, decode)"
    if "/cape/" in file:
        return "cape wrapper"
    if "privacy" in file:
        return "privacy (noise draws, ledger)"
    if func.startswith("<method 'acquire'") or func.startswith("<method 'wait'") or "threading" in file:
        return "waiting for other parties (locks)"
    if file == "~":
        return "numpy / builtins called directly (" + func[:28] + ")"
    return "other python"


def profile_cape(sites, subjects, rounds):
    """cProfile of every party's thread during a CAPE run, tottime grouped by module."""
    import dpneuro.protocol.simulation as protocol_module  # the in-process runner calls run_site by this name

    profiles = []
    original = protocol_module.run_site

    def profiled_site(*a, **k):  # one profiler per site thread (cProfile is per thread)
        prof = cProfile.Profile()
        prof.enable()
        try:
            return original(*a, **k)
        finally:
            prof.disable()
            profiles.append(prof)

    protocol_module.run_site = profiled_site
    agg = cProfile.Profile()
    try:
        agg.enable()
        cape_djica(sites, subjects, rounds=rounds, epsilon_i=0.5, delta_i=1e-2, plan="cape", preset="paper",
                   optimizer=replace(OPTIMIZERS["fast"], tol=0.0), random_state=0)
        agg.disable()
    finally:
        protocol_module.run_site = original
    out = {}
    for who, profs in (("sites (all threads)", profiles), ("aggregator", [agg])):
        stats = pstats.Stats(profs[0])
        for p in profs[1:]:
            stats.add(p)
        groups: dict[str, float] = {}
        for (file, _line, func), (_cc, _nc, tt, _ct, _callers) in stats.stats.items():
            key = _group(file, func)
            groups[key] = groups.get(key, 0.0) + tt / rounds
        out[who] = dict(sorted(groups.items(), key=lambda kv: -kv[1]))
    return out


def kernel_breakdown(X, W, b, chunk=2048, repeats=3):
    """Milliseconds per site (one site's data) spent in each step of the sample kernel."""
    R, N = X.shape
    dt = X.dtype
    Wc, P, bc = W.astype(dt), (W @ W.T).astype(dt), b.astype(dt)[:, None]
    U, Y, PU, T = (np.empty((R, chunk), dt) for _ in range(4))
    ops: dict[str, float] = {}

    def t(name, f):
        t0 = time.perf_counter()
        f()
        ops[name] = ops.get(name, 0.0) + time.perf_counter() - t0

    for _ in range(repeats):
        for lo in range(0, N - chunk + 1, chunk):
            x = X[:, lo:lo + chunk]
            t("U = W X + b (matmul, add)", lambda: (np.matmul(Wc, x, out=U), np.add(U, bc, out=U)))
            t("Y = -tanh(U/2)", lambda: (np.multiply(U, -0.5, out=Y), np.tanh(Y, out=Y)))
            t("P U (matmul)", lambda: np.matmul(P, U, out=PU))
            t("3 column dot products", lambda: (np.einsum("ij,ij->j", Y, Y), np.einsum("ij,ij->j", Y, PU),
                                                 np.einsum("ij,ij->j", U, PU)))
            c = np.ones(chunk, dt)
            t("clip factors (N-vectors)", lambda: np.minimum(1.0, 30.0 / np.sqrt(np.abs(c) + 1.0)))
            t("(Y c) U^T (scale, matmul)", lambda: (np.multiply(Y, c, out=T), T @ U.T))
            t("h = Y c_h (matvec)", lambda: Y @ c)
    return {k: 1e3 * v / repeats for k, v in ops.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--repeats", type=int, default=None)
    args = ap.parse_args(argv)
    load_before = os.getloadavg()
    print(f"load average before: {load_before[0]:.2f} (2 cores here; other jobs distort every number)", flush=True)
    R, S = 20, 4
    N = 16 * 1024 if args.quick else 256 * 1024
    repeats = args.repeats or (2 if args.quick else 7)
    rows = []
    pool = ThreadPoolExecutor(2)
    W = INFOMAX_SCALE * np.eye(R) + 0.05 * np.random.default_rng(1).standard_normal((R, R))
    b = 0.01 * np.ones(R)
    T = 250
    for dtype in (np.float64, np.float32):
        sites = make_sites(N, R, S, dtype)
        lengths = [[T] * (s.shape[1] // T) + ([s.shape[1] % T] if s.shape[1] % T else []) for s in sites]
        name = np.dtype(dtype).name
        for kernel in ("sample", "subject", "naive"):
            if kernel == "naive" and dtype is np.float32:
                continue
            for threads, blas in ((1, 1), (2, 1), (2, None)):
                if kernel == "naive" and (threads, blas) != (1, 1):
                    continue
                with blas_threads(blas):
                    p = pool if threads == 2 else None
                    sec = median_time(lambda: compute_round(sites, W, b, kernel, p, lengths),
                                      1 if kernel == "naive" else repeats)
                rows.append({"what": "compute", "kernel": kernel, "dtype": name, "site_threads": threads,
                             "blas_threads": blas or "default", "seconds_per_round": sec})
                print(f"compute  {kernel:8s} {name:8s} site threads {threads} blas {blas or 'default':7} "
                      f"{sec * 1e3:8.1f} ms/round", flush=True)
    # the full protocol round over the in-process exchange (sites in driver threads)
    sites = make_sites(N, R, S, np.float32)
    subjects = [s.shape[1] // T if s.shape[1] % T == 0 else 1 for s in sites]
    short, long = (3, 8) if args.quick else (5, 30)
    for plan in ("none", "conv", "cape"):
        with blas_threads(1):
            sec = protocol_seconds_per_round(sites, subjects, plan, short, long, 1 if args.quick else 3)
        rows.append({"what": "protocol", "kernel": "sample", "dtype": "float32", "site_threads": S,
                     "blas_threads": 1, "plan": plan, "seconds_per_round": sec})
        print(f"protocol plan {plan:5s} float32 {sec * 1e3:8.1f} ms/round", flush=True)
    breakdown = {}
    for dtype in (np.float64, np.float32):
        X = make_sites(N, R, S, dtype)[0]
        with blas_threads(1):
            breakdown[np.dtype(dtype).name] = kernel_breakdown(X, W, b)
        tot = sum(breakdown[np.dtype(dtype).name].values())
        print(f"\none site's kernel ({X.shape[1]} samples, {np.dtype(dtype).name}, 1 thread): {tot:.1f} ms")
        for k, v in breakdown[np.dtype(dtype).name].items():
            print(f"  {k:34s} {v:7.2f} ms  {100 * v / tot:5.1f} %")
    with blas_threads(1):
        groups = profile_cape(sites, subjects, 5 if args.quick else 20)
    print("\nwhere a CAPE protocol round goes (cProfile tottime per round, float32):")
    for who, g in groups.items():
        tot = sum(g.values())
        print(f"  {who}: {tot * 1e3:.1f} ms of thread time per round")
        for k, v in g.items():
            if v / tot > 0.01:
                print(f"    {k:52s} {v * 1e3:8.1f} ms  {100 * v / tot:5.1f} %")

    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    with open(RESULTS / f"djica_speed{tag}.csv", "w", newline="") as f:
        keys = ["what", "kernel", "dtype", "site_threads", "blas_threads", "plan", "seconds_per_round"]
        w = csv.DictWriter(f, keys)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in keys})
    load_after = os.getloadavg()
    print(f"\nload average after: {load_after[0]:.2f}")
    meta = {"R": R, "S": S, "N": N, "repeats": repeats, "machine": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "load_average_before_after": [load_before[0], load_after[0]], "python": sys.version.split()[0], "numpy": np.__version__,
            "rows": rows, "kernel_breakdown_ms_per_site": breakdown,
            "cape_profile_ms_per_round": {w: {k: v * 1e3 for k, v in g.items()} for w, g in groups.items()}}
    (RESULTS / f"djica_speed{tag}.json").write_text(json.dumps(meta, indent=2))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        labels = [f"{r['what']} {r.get('plan', r['kernel'])} {r['dtype']} t{r['site_threads']}/b{r['blas_threads']}"
                  for r in rows]
        fig, ax = plt.subplots(figsize=(8, 0.32 * len(rows) + 1))
        ax.barh(labels, [1e3 * r["seconds_per_round"] for r in rows], color="tab:blue")
        ax.axvline(60, color="k", ls="--", lw=1, label="goal 60 ms")
        ax.set_xscale("log")
        ax.set_xlabel("ms per round (R = 20, N = %dK, S = 4)" % (N // 1024))
        ax.invert_yaxis()
        ax.legend()
        fig.tight_layout()
        fig.savefig(RESULTS / f"djica_speed{tag}.png", dpi=120)
    except Exception as exc:  # noqa: BLE001 - the table is the result; the figure is a convenience
        print(f"(no figure: {exc})")


if __name__ == "__main__":
    main()
