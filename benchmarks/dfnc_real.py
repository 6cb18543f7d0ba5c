"""dFNC states on real fMRI: split-half stability without noise, and the private states against them.

Data: the 33 participants of ``benchmarks/_real_data.py`` (ds000140, 122 MIST regions, runs 3 and 7 of a
heat-pain task, 191 TRs each at TR 2 s; task runs, not rest). Components: 20, from the pooled regions
(each region z-scored per run; the exact PCA of the unit-norm time points and the product's spatial ICA
of it, ``dpneuro.algorithms.spatial_ica``: no noise, so that only the states stage differs between rows).
Each subject's component time courses are the whitened data times the unmixing, as the run computes them;
GIFT's windows (22 TRs, Gaussian 3 TRs, step 1) are cut in each run separately (none spans the two runs).

- ``split-half``: scikit-learn's k-means (K = 4, 10 starts; what GIFT computes) on the windows of a random
  half of the people against the other half, state matrices matched one to one, mean r; 10 random splits.
- private rows: 4 pseudo-sites (8, 8, 8, 9 people), the run's dFNC stage (``dfnc.dfnc_states``, the
  default k-means) at each eps (the whole stage per site against the aggregator and its colluders,
  delta 1e-5), against pooled k-means on all 33 people; 5 noise seeds. ``none``: the stage without noise.

    python benchmarks/dfnc_real.py            # full: ~2 min
    python benchmarks/dfnc_real.py --quick    # smoke run: 3 splits, 2 seeds, eps 8 and none

Writes benchmarks/results/dfnc_real{,_quick}.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _real_data import load_real_regions  # noqa: E402

from dpneuro.algorithms import dfnc  # noqa: E402
from dpneuro.algorithms.metrics import match_components  # noqa: E402
from dpneuro.algorithms.spatial_ica import spatial_ica  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
R, K, DELTA = 20, 4, 1e-5
EPSILONS = (4.0, 8.0, 16.0, None)
SITES = (8, 8, 8, 9)


def subject_windows() -> list[np.ndarray]:
    """Each person's window vectors (D x n), from the pooled components' time courses, run by run."""
    d = load_real_regions(runs=(3, 7), standardize_runs=True, load_atlas=False)
    X = [np.asarray(x, np.float64) for x in d["series"]]
    U = np.concatenate(X, axis=1)
    U = U / np.maximum(np.linalg.norm(U, axis=0), 1e-12)
    lam, V = np.linalg.eigh(U @ U.T / U.shape[1])
    lam, V = lam[::-1][:R], V[:, ::-1][:, :R]
    W = spatial_ica(V, lam).W
    T = W @ (V / np.sqrt(lam)).T  # time courses of whitened unit-norm time points, as the run's
    out = []
    for x in X:
        x = x / np.maximum(np.linalg.norm(x, axis=0), 1e-12)
        S = T @ x
        half = S.shape[1] // 2  # runs 3 and 7, 191 TRs each
        out.append(np.concatenate([dfnc.window_connectivity(S[:, :half]), dfnc.window_connectivity(S[:, half:])],
                                  axis=1))
    return out


def kmeans(windows: list[np.ndarray], seed: int) -> np.ndarray:
    return KMeans(K, n_init=10, random_state=seed).fit(np.concatenate(windows, axis=1).T).cluster_centers_.T


def state_r(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.mean(match_components(np.tanh(a), np.tanh(b))[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="3 splits, 2 seeds, eps 8 and none")
    args = ap.parse_args()
    splits, seeds, epsilons = (3, (0, 1), (8.0, None)) if args.quick else (10, (0, 1, 2, 3, 4), EPSILONS)
    t0 = time.perf_counter()
    subj = subject_windows()
    n = len(subj)
    pooled = kmeans(subj, 0)
    rows = []
    halves = []
    for s in range(splits):
        perm = np.random.default_rng(s).permutation(n)
        a, b = perm[: n // 2], perm[n // 2:]
        halves.append(state_r(kmeans([subj[i] for i in a], s), kmeans([subj[i] for i in b], s)))
    rows.append({"method": "split-half k-means (no noise)", "eps": "none", "repeats": splits,
                 "r_median": statistics.median(halves), "r_min": min(halves), "eps_ledger": ""})
    print(rows[-1], flush=True)
    bounds = np.cumsum([0, *SITES])
    order = np.random.default_rng(99).permutation(n)
    sites = [dfnc.WindowSet(np.concatenate([subj[i] for i in order[a:b]], axis=1),
                            [subj[i].shape[1] for i in order[a:b]]) for a, b in zip(bounds[:-1], bounds[1:])]
    for eps in epsilons:
        rs, leds = [], []
        for seed in seeds:
            res = dfnc.dfnc_states(sites, K, eps, DELTA, plan="none" if eps is None else "cape", random_state=seed)
            rs.append(state_r(res.vectors, pooled))
            if eps is not None:
                leds.append(max(led.epsilon(DELTA, collusion=True) for led in res.ledgers))
        rows.append({"method": "private k-means vs pooled k-means", "eps": "none" if eps is None else eps,
                     "repeats": len(seeds), "r_median": statistics.median(rs), "r_min": min(rs),
                     "eps_ledger": max(leds) if leds else ""})
        print(rows[-1], flush=True)
    runtime = time.perf_counter() - t0
    suffix = "_quick" if args.quick else ""
    RESULTS.mkdir(exist_ok=True)
    with open(RESULTS / f"dfnc_real{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    meta = {"subjects": n, "sites": list(SITES), "R": R, "K": K, "runs": [3, 7], "tr": 2.0, "window": 22,
            "delta": DELTA, "splits": splits, "seeds": list(seeds), "runtime_s": round(runtime, 1), "table": rows}
    (RESULTS / f"dfnc_real{suffix}.json").write_text(json.dumps(meta, indent=1))
    print(f"wrote {RESULTS / f'dfnc_real{suffix}.csv'} in {runtime:.0f} s")


if __name__ == "__main__":
    main()
