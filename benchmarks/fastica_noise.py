"""FastICA on pure-noise bases: no fit ends in an exception; collapses are caught and restarted.

On a basis that is mostly noise, the stabilised FastICA's damped step can
collapse two directions into one; before the guard this ended in scipy's
"array must not contain infs or NaNs" (4 of 2,580 single fits, 3 of 30
spatial ICAs). This script runs, with the product's code:

1. single FastICA fits (``dpneuro.algorithms._fastica.fastica``, tol 1e-6,
   max_iter 2000) on whitened Gaussian bases, fit i on an n = D x K matrix
   drawn with ``default_rng(i)`` (D uniform in 100..900, K in 8..30) from
   ``random_start(i, K)``, a collapsed fit restarted as the spatial ICA does
   (``restart_seed(i, 1), ...``, at most ``FASTICA_RESTARTS`` times);
2. ``spatial_ica`` with its defaults (20 starts) on orthonormal pure-noise
   bases, basis b drawn with ``default_rng(1000 + b)``: D 250 or 900,
   K 20 or 30 in turn.

It counts exceptions (the goal: none), RuntimeWarnings, collapses, restarts,
starts that collapsed on every restart, fits that did not converge, the
largest |W W^T - I| of the results, and the time per fit (each on one BLAS
thread, as the product runs them; ``--workers`` processes side by side).

    python benchmarks/fastica_noise.py            # 10,000 fits + 32 spatial ICAs, ~40 min on 2 cores
    python benchmarks/fastica_noise.py --quick    # smoke run: 40 fits + 1 spatial ICA, < 30 s

Writes benchmarks/results/fastica_noise[_quick].{csv,json}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import write_results  # noqa: E402

TOL, MAX_ITER = 1e-6, 2000
D_RANGE, K_RANGE = (100, 900), (8, 30)
#: spatial ICA bases: (D, K) of basis b is SPATIAL_SHAPES[b % 4]
SPATIAL_SHAPES = ((250, 20), (900, 20), (250, 30), (900, 30))


def white(A: np.ndarray) -> np.ndarray:
    """Centred columns of ``A`` rotated to identity covariance (what the spatial ICA hands FastICA)."""
    A = A - A.mean(axis=0)
    _, s, vt = np.linalg.svd(A, full_matrices=False)
    return A @ vt.T * (np.sqrt(len(A)) / s)


def single_fit(i: int) -> dict:
    """Fit i: FastICA on a whitened Gaussian basis, restarted while it collapses."""
    from dpneuro._utils.blas import one_blas_thread
    from dpneuro.algorithms._fastica import fastica, random_start, restart_seed
    from dpneuro.algorithms.spatial_ica import FASTICA_RESTARTS

    rng = np.random.default_rng(i)
    D, K = int(rng.integers(D_RANGE[0], D_RANGE[1] + 1)), int(rng.integers(K_RANGE[0], K_RANGE[1] + 1))
    Z = white(rng.standard_normal((D, K)))
    out: dict = {"seed": i, "D": D, "K": K, "exception": "", "seconds": float("nan"), "collapsed": False,
                 "restart_seeds": [], "still_collapsed": False, "converged": False, "n_iter": 0,
                 "orth_error": float("nan")}
    with one_blas_thread(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t0 = time.perf_counter()
            fit = fastica(Z, random_start(i, K), tol=TOL, max_iter=MAX_ITER)
            out["seconds"] = time.perf_counter() - t0
            out["collapsed"] = fit.collapsed
            while fit.collapsed and len(out["restart_seeds"]) < FASTICA_RESTARTS:
                out["restart_seeds"].append(restart_seed(i, len(out["restart_seeds"]) + 1))
                fit = fastica(Z, random_start(out["restart_seeds"][-1], K), tol=TOL, max_iter=MAX_ITER)
            out.update(still_collapsed=fit.collapsed, converged=fit.converged, n_iter=fit.n_iter,
                       orth_error=float(np.abs(fit.W @ fit.W.T - np.eye(K)).max()))
        except Exception as e:  # counted: the goal is none
            out["exception"] = f"{type(e).__name__}: {e}"
    out["warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    return out


def spatial_fit(b: int) -> dict:
    """Basis b: ``spatial_ica`` with its defaults on an orthonormal pure-noise basis."""
    from dpneuro.algorithms.spatial_ica import spatial_ica

    rng = np.random.default_rng(1000 + b)
    D, K = SPATIAL_SHAPES[b % len(SPATIAL_SHAPES)]
    V = np.linalg.qr(rng.standard_normal((D, K)))[0]
    lam = np.sort(rng.uniform(1.0, 2.0, K))[::-1]
    out: dict = {"seed": 1000 + b, "D": D, "K": K, "exception": "", "seconds": float("nan"), "restarts": [],
                 "left_out": [], "status": "", "n_converged": 0, "note": ""}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            t0 = time.perf_counter()
            r = spatial_ica(V, lam)
            out.update(seconds=time.perf_counter() - t0, restarts=[list(x) for x in r.restarts],
                       left_out=list(r.left_out), status=r.status, n_converged=r.n_converged,
                       note=r.restart_note(), n_init=len(r.scores if r.scores is not None else []))
        except Exception as e:  # counted: the goal is none
            out["exception"] = f"{type(e).__name__}: {e}"
    out["warnings"] = sorted({str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)})
    return out


def summarise_single(fits: list[dict]) -> dict:
    ok = [f for f in fits if not f["exception"]]
    return {"part": "single FastICA fits", "runs": len(fits),
            "fits": sum(1 + len(f["restart_seeds"]) for f in fits),
            "exceptions": len(fits) - len(ok), "runtime_warnings": sum(bool(f["warnings"]) for f in fits),
            "collapsed": sum(f["collapsed"] for f in ok),
            "restarts": sum(len(f["restart_seeds"]) for f in ok),
            "collapsed_after_restarts": sum(f["still_collapsed"] for f in ok),
            "not_converged": sum(not f["converged"] for f in ok),
            "median_s_per_fit": statistics.median(f["seconds"] for f in ok) if ok else float("nan"),
            # a string: the CSV rounds floats to 6 decimals, and this is ~1e-10
            "max_orth_error": f"{max((f['orth_error'] for f in ok), default=float('nan')):.2e}"}


def summarise_spatial(runs: list[dict]) -> dict:
    ok = [r for r in runs if not r["exception"]]
    starts = [r["n_init"] for r in ok]
    return {"part": "spatial_ica (20 starts)", "runs": len(runs),
            "fits": sum(r["n_init"] + len(r["restarts"]) for r in ok),
            "exceptions": len(runs) - len(ok), "runtime_warnings": sum(bool(r["warnings"]) for r in runs),
            "collapsed": sum(len({i for i, _ in r["restarts"]}) for r in ok),
            "restarts": sum(len(r["restarts"]) for r in ok),
            "collapsed_after_restarts": sum(len(r["left_out"]) for r in ok),
            "not_converged": sum(r["status"] != "converged" for r in ok),
            # per FastICA start: a basis' time over its starts (restarts and the kept run's polishing included)
            "median_s_per_fit": statistics.median(r["seconds"] / n for r, n in zip(ok, starts)) if ok else
            float("nan"),
            "max_orth_error": ""}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="40 single fits and one spatial ICA (smoke run)")
    ap.add_argument("--fits", type=int, default=10_000, help="single FastICA fits (seeds 0, 1, ...)")
    ap.add_argument("--bases", type=int, default=32, help="pure-noise bases for spatial_ica")
    ap.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="processes side by side")
    args = ap.parse_args(argv)
    n_fits, n_bases, stem = args.fits, args.bases, "fastica_noise"
    if args.quick:
        n_fits, n_bases, stem = 40, 1, "fastica_noise_quick"
    t0 = time.perf_counter()
    with ProcessPoolExecutor(max_workers=max(1, args.workers)) as pool:
        spatial = list(pool.map(spatial_fit, range(n_bases)))  # the long ones first: better packing
        fits = list(pool.map(single_fit, range(n_fits), chunksize=max(1, min(50, n_fits // (8 * args.workers)))))
    rows = [summarise_single(fits), summarise_spatial(spatial)]
    keys = list(rows[0])
    print(" | ".join(keys))
    for r in rows:
        print(" | ".join(f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys))
    events = [{k: f[k] for k in ("seed", "D", "K", "restart_seeds", "still_collapsed", "converged", "n_iter")}
              for f in fits if f["collapsed"]]
    for e in events:
        print(f"fit {e['seed']} (D = {e['D']}, K = {e['K']}) collapsed; restarted from {e['restart_seeds']}")
    for r in spatial:
        if r["note"] or r["exception"]:
            print(f"basis {r['seed']} ({r['D']} x {r['K']}): {r['note'] or r['exception']}")
    meta = {"summary": rows, "tol": TOL, "max_iter": MAX_ITER, "D_range": D_RANGE, "K_range": K_RANGE,
            "spatial_shapes": SPATIAL_SHAPES, "workers": args.workers, "quick": args.quick,
            "collapses": events,
            "exceptions": [{"seed": x["seed"], "D": x["D"], "K": x["K"], "exception": x["exception"]}
                           for x in fits + spatial if x["exception"]],
            "warnings": sorted({w for x in fits + spatial for w in x["warnings"]}),
            "spatial": [{k: v for k, v in r.items() if k != "warnings"} for r in spatial],
            "runtime_s": time.perf_counter() - t0}
    write_results(stem, rows, meta, keys=keys, digits=6, default=float)
    return 1 if any(r["exceptions"] for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
