"""dFNC states under CAPE: the private k-means and capeAGN's moments against planted states.

Data: :func:`dpneuro.datasets.states.make_dfnc_consortium`, 4 sites x 100 subjects,
R = 20 components (D = 190 window pairs), K = 4 planted states (mean dwell
30 / 50 / 70 / 90 s, so occupancies of about 0.13 / 0.2 / 0.29 / 0.38), 200
TRs of 2 s, low-passed at 0.15 Hz; GIFT-style windows (22 TRs, Gaussian 3 TR,
step 1: 179 per subject). The data seed and the noise seed are the row's seed.

Per method, stage budget eps (the whole dFNC stage per site, headline:
against the aggregator and its colluders; delta 1e-5) and seed:

- ``state_r``: mean over states of the correlation between an estimated
  state's connectivity matrix (upper triangle) and its matched planted one;
- ``occ_err``: largest |consortium occupancy - planted| over states (the
  released counts of the last rounds, capeAGN's weights for "agn"; planted:
  each window's majority state);
- ``subj_occ_err``: mean |subject occupancy - planted| over subjects and
  states, each computed at its site from the public centroids;
- ``r_vs_pooled``: states against scikit-learn's KMeans on the pooled windows
  (Euclidean, k-means++, 10 starts; what GIFT computes up to the distance);
- ``eps_ledger``: the largest site ledger's composed headline eps.

"kmeans" is the CAPE k-means of the run (``dpneuro.algorithms.dfnc.StateSettings``:
the mean, 8 states for 3 rounds merged to 4, one round at 4, two averaged
final rounds, low-rank denoising, the occupancy; debiased assignment); "agn"
capeAGN's one-shot moments. Reference rows: "pooled-kmeans" (sklearn, no
privacy) and "pooled-l1" (city-block k-medians started at sklearn's
centroids, GIFT's distance) against the truth. ``state_r_min``: the worst seed.

    python benchmarks/dfnc_states.py            # full: 5 seeds, ~5 min on a shared 2-core machine
    python benchmarks/dfnc_states.py --quick    # smoke run: 4 x 25 subjects, R = 10, one seed (< 1 min)

Writes benchmarks/results/dfnc_states{,_quick}.{csv,json}.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
import time
from pathlib import Path

import numpy as np
from sklearn.cluster import KMeans

from dpneuro.algorithms import dfnc
from dpneuro.algorithms.metrics import match_components
from dpneuro.datasets.states import make_dfnc_consortium, window_labels

RESULTS = Path(__file__).resolve().parent / "results"
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0, None)
METHODS = {"kmeans": dict(method="kmeans"), "agn": dict(method="agn")}
DELTA = 1e-5


def _state_r(vectors, truth) -> tuple[float, np.ndarray]:
    perm, corr = match_components(np.tanh(vectors), np.tanh(truth))
    return float(np.mean(corr)), perm


def _kmedians(X, C, iters=20):
    """City-block k-means (component-wise median centroids), GIFT's distance."""
    for _ in range(iters):
        lab = dfnc.assign(X, C, "cityblock")
        C = np.stack([np.median(X[:, lab == k], axis=1) if np.any(lab == k) else C[:, k]
                      for k in range(C.shape[1])], axis=1)
    return C


def run_seed(seed: int, subjects: int, R: int, K: int, T: int, epsilons) -> list[dict]:
    t0 = time.perf_counter()
    P = make_dfnc_consortium(4, subjects, R, K, n_timepoints=T, random_state=seed)
    ws = [dfnc.site_windows(tc) for tc in P.timecourses]
    truth = dfnc.matrix_to_vector(P.states)
    taper = dfnc.taper(T)
    win_lab = [[window_labels(h, taper, K) for h in site] for site in P.labels]
    lab = np.concatenate([h for site in win_lab for h in site])
    true_occ = np.bincount(lab, minlength=K) / lab.size
    subj_true = np.array([np.bincount(h, minlength=K) / h.size for site in win_lab for h in site])
    X = np.concatenate([w.X for w in ws], axis=1)
    km = KMeans(K, n_init=10, random_state=seed).fit(X.T)
    pooled = km.cluster_centers_.T
    l1 = _kmedians(X, pooled)
    rows = []
    for name, C in (("pooled-kmeans", pooled), ("pooled-l1", l1)):
        r, perm = _state_r(C, truth)
        occ = np.bincount(dfnc.assign(X, C, "euclidean" if name == "pooled-kmeans" else "cityblock"),
                          minlength=K) / X.shape[1]
        rows.append(dict(method=name, eps=None, seed=seed, state_r=r, occ_err=float(np.abs(occ[perm] - true_occ).max()),
                         subj_occ_err=None, r_vs_pooled=_state_r(C, pooled)[0], eps_ledger=None, seconds=None))
    print(f"seed {seed}: data and pooled k-means in {time.perf_counter() - t0:.1f} s", flush=True)
    for name, kw in METHODS.items():
        for eps in epsilons:
            t = time.perf_counter()
            res = dfnc.dfnc_states(ws, K, eps, DELTA, plan="none" if eps is None else "cape", random_state=seed, **kw)
            secs = time.perf_counter() - t
            r, perm = _state_r(res.vectors, truth)
            subj = np.concatenate([dfnc.site_dynamics(w, res.vectors)["occupancy"] for w in ws])
            rows.append(dict(
                method=name, eps=eps, seed=seed, state_r=r,
                occ_err=float(np.abs(res.occupancy[perm] - true_occ).max()),
                subj_occ_err=float(np.abs(subj[:, perm] - subj_true).mean()),
                r_vs_pooled=_state_r(res.vectors, pooled)[0],
                eps_ledger=None if eps is None else max(led.epsilon(DELTA, collusion=True) for led in res.ledgers),
                seconds=secs))
            print(f"  {name:11s} eps {eps!s:5s} state_r {r:.3f} occ_err {rows[-1]['occ_err']:.3f} "
                  f"vs pooled {rows[-1]['r_vs_pooled']:.3f} ({secs:.1f} s)", flush=True)
    return rows


def summarise(rows: list[dict]) -> list[dict]:
    out = []
    keys = sorted({(r["method"], r["eps"]) for r in rows}, key=lambda k: (k[0], np.inf if k[1] is None else k[1]))
    for method, eps in keys:
        sel = [r for r in rows if r["method"] == method and r["eps"] == eps]
        agg = {"method": method, "eps": "none" if eps is None else eps, "seeds": len(sel)}
        for m in ("state_r", "occ_err", "subj_occ_err", "r_vs_pooled", "eps_ledger", "seconds"):
            vals = [r[m] for r in sel if r[m] is not None]
            agg[m] = round(statistics.median(vals), 4) if vals else ""
            if m == "state_r":
                agg["state_r_min"] = round(min(vals), 4) if vals else ""
        out.append(agg)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="4 x 25 subjects, R = 10, one seed, eps 4 and none")
    args = ap.parse_args()
    if args.quick:
        subjects, R, K, T, seeds, eps = 25, 10, 4, 200, (0,), (4.0, None)
    else:
        subjects, R, K, T, seeds, eps = 100, 20, 4, 200, (0, 1, 2, 3, 4), EPSILONS
    t0 = time.perf_counter()
    rows = [r for s in seeds for r in run_seed(s, subjects, R, K, T, eps)]
    table = summarise(rows)
    runtime = time.perf_counter() - t0
    cols = list(table[0])
    print("\nmedian over seeds:")
    print(" | ".join(cols))
    for t in table:
        print(" | ".join(str(t[c]) for c in cols))
    RESULTS.mkdir(exist_ok=True)
    suffix = "_quick" if args.quick else ""
    with open(RESULTS / f"dfnc_states{suffix}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=cols)
        w.writeheader()
        w.writerows(table)
    meta = {"sites": 4, "subjects_per_site": subjects, "R": R, "K": K, "timepoints": T, "tr": 2.0,
            "window": 22, "sigma": 3.0, "delta": DELTA, "seeds": list(seeds), "runtime_s": round(runtime, 1),
            "table": table, "runs": rows}
    (RESULTS / f"dfnc_states{suffix}.json").write_text(json.dumps(meta, indent=1, default=float))
    print(f"wrote {RESULTS / f'dfnc_states{suffix}.csv'} in {runtime:.0f} s")


if __name__ == "__main__":
    main()
