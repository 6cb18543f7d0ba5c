"""Temporal ICA end to end on [capeDJICA]'s synthetic set-up: private whitening from D = 900, then private unmixing.

Data: those of djica_utility.py (R = 20 grid maps x GARCH sources, 250 time
points per subject, X = A S, D = 900), M = 1024 subjects over S = 4 sites.
Time points are divided by the 99th percentile of their norms (a public
constant here taken from the data, as the papers' preprocessing) and clipped
to norm 1.

Whitening: capePCA (plan "cape", subject level, delta 1e-6) at eps_pca, four ways:

``moment``             each subject adds X_m X_m^T, no subject bound ([capeDJICA]'s capePCA)
``moment, bound 0.25`` the same clipped at dpneuro's subject bound (its temporal default until now)
``subspace+var``       each subject adds its own top-R subspace; a second, R x R release gives the
                       variances in the released basis (``variances=True``; dpneuro's default for
                       temporal ICA), subject bound 0.25 (the default)
``subspace+var, 0.14`` the same with the subject bound fitted to these data (subjects' normalised
                       second moments have Frobenius norm 0.12-0.14)

Unmixing: djica_utility.py's "tuned" capeDJICA (fast optimizer, subject-level
clipping, 200 rounds) at eps_i in {0.5, 0.9} (classic calibration, delta_i
1e-2, plan "cape"), without noise (what the whitening alone allows), and the
cumulant unmixing (``dpneuro.algorithms.cumulant_ica``, ``ica_unmixing =
"cumulant"``: the whitening refined by one CAPE release of the subjects' R x R
second moments, then one of their fourth-order cumulants, together at
(eps_c, 1e-6), eps_c in {2, 4}; its default public bounds). qNGI of W A_w,
A_w the truth in the released whitening; median over noise seeds.
Totals per site at delta 1e-5 composed exactly (GDP) from the merged ledgers:
"exact" against the other parties, "headline" against the aggregator colluding
with one of the four sites.

Goal: qNGI <= 0.1 at a total headline eps <= 4. The cumulant unmixing after the
default whitening (subspaces + variances, bound 0.25), eps_pca in {1.25, 1.5,
1.75, 2} by eps_c in {3, 3.2, 3.35}, 10 noise seeds each: around the split the
planner's CUMULANT_PCA_SHARE gives (eps_pca 1.5 with eps_c 3.35 is a headline
just below 4).

Rounds at a fixed budget (the lever "fewer releases"): the unmixing alone on
the pooled whitening (as djica_utility.py), "tuned" at 40, 100, 200 and 400
rounds, each round's noise multiplier scaled by sqrt(rounds / 200) so that
every run's total (exact GDP) equals that of 200 rounds at eps_i 0.25 or 0.5
(analytic calibration per round).

Writes benchmarks/results/djica_end_to_end.{csv,json}. ``--quick`` runs a
seconds-long smoke version (M = 32, R = 8, 30 rounds).
"""

from __future__ import annotations

import os

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # parallelism comes from worker processes

import argparse
import csv
import json
import math
import multiprocessing as mp
import time
from pathlib import Path

import numpy as np
from djica_utility import CONFIGS, DELTA_I, DELTA_TOTAL, data_for

from dpneuro.algorithms.cumulant_ica import cape_cumulant_ica
from dpneuro.algorithms.djica import cape_djica, whiten
from dpneuro.algorithms.metrics import qngi
from dpneuro.algorithms.pca import cape_pca
from dpneuro.privacy.gaussian import epsilon_for_multiplier, noise_multiplier

RESULTS = Path(__file__).resolve().parent / "results"
DELTA_PCA = 1e-6
WHITENINGS = {
    "moment": dict(contribution="moment"),
    "moment, bound 0.25": dict(contribution="moment", subject_bound=0.25),
    "subspace+var": dict(contribution="subspace", variances=True, subject_bound=0.25),
    "subspace+var, bound 0.14": dict(contribution="subspace", variances=True, subject_bound=0.14),
}


def run_task(task: dict) -> list[dict]:
    """One private whitening, then the unmixing at every eps_i (and without noise) on it."""
    d, pca, Z, Aw, t_pca = _whitened(task)
    cfg = dict(CONFIGS["tuned"])
    if task["quick"]:
        cfg["rounds"] = 30
    rows = []
    for eps_i in task["eps_i"]:
        kw = dict(plan="none") if eps_i is None else dict(plan="cape", epsilon_i=eps_i, delta_i=DELTA_I,
                                                           calibration="classic" if eps_i < 1 else "analytic")
        t0 = time.perf_counter()
        res = cape_djica(Z, d["subjects"], random_state=task["seed"] + 7, **kw, **cfg)
        rows.append(_row(task, "capeDJICA", eps_i, res, pca, Aw, t_pca, t0))
    for eps_c in task["eps_c"]:
        t0 = time.perf_counter()
        res = cape_cumulant_ica(Z, d["subjects"], eps_c, DELTA_PCA, plan="cape", random_state=task["seed"] + 11)
        rows.append(_row(task, "cumulant", eps_c, res, pca, Aw, t_pca, t0))
    return rows


def _whitened(task: dict):
    """The data, whitened by a private capePCA of ``task`` (eps_pca, whitening, seed): (d, pca, Z, Aw, seconds)."""
    d = data_for(task["M"], task["R"], task["T"])
    X = d["X"]
    c = float(np.percentile(np.linalg.norm(np.concatenate(X, axis=1), axis=0), 99))
    scaled = [x / c for x in X]
    scaled = [x / np.maximum(1.0, np.linalg.norm(x, axis=0)) for x in scaled]
    t0 = time.perf_counter()
    pca = cape_pca(X, task["R"], task["eps_pca"], DELTA_PCA, plan="cape", subjects=d["subjects"], scale=c,
                   random_state=task["seed"], **WHITENINGS[task["whitening"]])
    t_pca = time.perf_counter() - t0
    lam = np.maximum(pca.eigenvalues, 1e-12)
    Z = [whiten(x, pca.basis, lam).astype(np.float32) for x in scaled]
    return d, pca, Z, whiten(d["A"] / c, pca.basis, lam), t_pca


GOAL_PCA = (1.25, 1.5, 1.75, 2.0)
GOAL_CUMULANT = (3.0, 3.2, 3.35)
GOAL_SEEDS = 10


def run_goal(task: dict) -> list[dict]:
    """The cumulant unmixing at every eps_c after one private whitening at eps_pca."""
    d, pca, Z, Aw, t_pca = _whitened(task)
    rows = []
    for eps_c in task["eps_c"]:
        t0 = time.perf_counter()
        res = cape_cumulant_ica(Z, d["subjects"], eps_c, DELTA_PCA, plan="cape", random_state=task["seed"] + 11)
        rows.append(_row(task, "cumulant", eps_c, res, pca, Aw, t_pca, t0))
    return rows


def _row(task: dict, unmixing: str, eps_u, res, pca, Aw, t_pca: float, t0: float) -> dict:
    row = {k: task[k] for k in ("M", "whitening", "eps_pca", "seed")}
    row.update(unmixing=unmixing if eps_u is not None else "no noise", eps_i=eps_u, qngi=qngi(res.W @ Aw),
               eps_pca_exact=max(l.epsilon(DELTA_TOTAL) for l in pca.ledgers), seconds_pca=t_pca,
               seconds_ica=time.perf_counter() - t0)
    if eps_u is None:
        row.update(eps_total_exact=row["eps_pca_exact"],
                   eps_total_headline=max(l.epsilon(DELTA_TOTAL, collusion=True) for l in pca.ledgers))
    else:
        led = [p.merge(i) for p, i in zip(pca.ledgers, res.ledgers)]
        row.update(eps_total_exact=max(l.epsilon(DELTA_TOTAL) for l in led),
                   eps_total_headline=max(l.epsilon(DELTA_TOTAL, collusion=True) for l in led))
    return row


ROUNDS = (40, 100, 200, 400)
ROUNDS_REFERENCE = (0.25, 0.5)  # eps_i of the 200-round runs whose total every round count spends


def run_rounds(task: dict) -> dict:
    """The unmixing alone (pooled whitening) at ``rounds``, spending what 200 rounds at ``eps_ref`` spend."""
    d = data_for(task["M"], task["R"], task["T"])
    z = noise_multiplier(task["eps_ref"], DELTA_I, method="classic") * math.sqrt(task["rounds"] / 200)
    eps_i = epsilon_for_multiplier(z, DELTA_I, 1, "analytic")
    cfg = dict(CONFIGS["tuned"], rounds=task["rounds"])
    res = cape_djica(d["Z"], d["subjects"], plan="cape", epsilon_i=eps_i, delta_i=DELTA_I, calibration="analytic",
                     random_state=1000 + task["seed"], **cfg)
    return {k: task[k] for k in ("M", "eps_ref", "rounds", "seed")} | {
        "eps_i": eps_i, "qngi": qngi(res.W @ d["Aw"]), "eps_total_exact": res.epsilon(DELTA_TOTAL),
        "eps_total_headline": res.epsilon(DELTA_TOTAL, collusion=True)}


def summarise_rounds(runs: list[dict]) -> list[dict]:
    out = []
    for ref in sorted({r["eps_ref"] for r in runs}):
        for n in sorted({r["rounds"] for r in runs}):
            rs = [r for r in runs if (r["eps_ref"], r["rounds"]) == (ref, n)]
            q = np.array([r["qngi"] for r in rs])
            out.append({"eps_ref": ref, "rounds": n, "eps_i": rs[0]["eps_i"], "qngi_median": float(np.median(q)),
                        "qngi_min": float(q.min()), "qngi_max": float(q.max()),
                        "eps_total_exact": float(np.median([r["eps_total_exact"] for r in rs])),
                        "eps_total_headline": float(np.median([r["eps_total_headline"] for r in rs])),
                        "repeats": len(rs)})
    return out


def summarise(runs: list[dict]) -> list[dict]:
    groups: dict = {}
    for r in runs:
        groups.setdefault((r["whitening"], r["eps_pca"], r["unmixing"], r["eps_i"]), []).append(r)
    order, unmixings = list(WHITENINGS), ["no noise", "capeDJICA", "cumulant"]
    out = []
    for (wh, ep, um, ei), rs in sorted(groups.items(), key=lambda kv: (
            order.index(kv[0][0]), kv[0][1], unmixings.index(kv[0][2]), -1 if kv[0][3] is None else kv[0][3])):
        q = np.array([r["qngi"] for r in rs])
        out.append({"M": rs[0]["M"], "whitening": wh, "eps_pca": ep, "unmixing": um, "eps_i": "" if ei is None else ei,
                    "qngi_median": float(np.median(q)), "qngi_min": float(q.min()), "qngi_max": float(q.max()),
                    "eps_total_exact": float(np.median([r["eps_total_exact"] for r in rs])),
                    "eps_total_headline": float(np.median([r["eps_total_headline"] for r in rs])),
                    "repeats": len(rs), "seconds_pca_median": float(np.median([r["seconds_pca"] for r in rs]))})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="seconds-long smoke run")
    ap.add_argument("--repeats", type=int, default=3, help="noise seeds per grid point")
    ap.add_argument("--workers", type=int, default=2)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    if args.quick:
        M, R, T, eps_pcas, eps_is, eps_cs, repeats = 32, 8, 100, [2.0], [None, 0.5], [4.0], 1
    else:
        M, R, T, eps_pcas, eps_is, eps_cs, repeats = (1024, 20, 250, [1.0, 2.0, 4.0], [None, 0.5, 0.9], [2.0, 4.0],
                                                      args.repeats)
    tasks = [dict(M=M, R=R, T=T, whitening=w, eps_pca=e, eps_i=eps_is, eps_c=eps_cs, seed=s, quick=args.quick)
             for w in WHITENINGS for e in eps_pcas for s in range(repeats)]
    print(f"{len(tasks)} whitenings x {len(eps_is)} unmixings on {args.workers} worker processes", flush=True)
    rounds_tasks = [dict(M=M, R=R, T=T, eps_ref=e, rounds=min(n, 30) if args.quick else n, seed=s)
                    for e in ROUNDS_REFERENCE[:1 if args.quick else None] for n in ROUNDS[:2 if args.quick else None]
                    for s in range(repeats)]
    goal_pca, goal_c, goal_seeds = (eps_pcas, eps_cs, repeats) if args.quick else (GOAL_PCA, GOAL_CUMULANT,
                                                                                    GOAL_SEEDS)
    goal_tasks = [dict(M=M, R=R, T=T, whitening="subspace+var", eps_pca=e, eps_c=goal_c, seed=100 + s)
                  for e in goal_pca for s in range(goal_seeds)]
    runs, rounds_runs, goal_runs = [], [], []
    if args.workers > 1 and not args.quick:
        with mp.get_context("fork").Pool(args.workers) as pool:
            for i, rs in enumerate(pool.imap_unordered(run_task, tasks, chunksize=1)):
                runs += rs
                print(f"  {i + 1}/{len(tasks)}, {time.perf_counter() - t_start:.0f} s", flush=True)
            rounds_runs = list(pool.imap_unordered(run_rounds, rounds_tasks, chunksize=1))
            for rs in pool.imap_unordered(run_goal, goal_tasks, chunksize=1):
                goal_runs += rs
    else:
        for t in tasks:
            runs += run_task(t)
        rounds_runs = [run_rounds(t) for t in rounds_tasks]
        goal_runs = [r for t in goal_tasks for r in run_goal(t)]
    rows = summarise(runs)
    rounds_rows = summarise_rounds(rounds_runs)
    goal_rows = summarise(goal_runs)
    print(f"\n{'whitening':26} {'eps_pca':>7} {'unmixing':10} {'eps':>5} {'qNGI med':>8} {'[min,max]':>15} "
          f"{'eps exact':>9} {'headline':>9}")
    for r in rows:
        print(f"{r['whitening']:26} {r['eps_pca']:7g} {r['unmixing']:10} {r['eps_i'] if r['eps_i'] != '' else '-':>5} "
              f"{r['qngi_median']:8.3f} [{r['qngi_min']:.3f},{r['qngi_max']:.3f}] {r['eps_total_exact']:9.2f} "
              f"{r['eps_total_headline']:9.2f}")
    print("\nunmixing alone (pooled whitening) at a fixed total:")
    for r in rounds_rows:
        print(f"  total of 200 rounds at eps_i {r['eps_ref']:g} ({r['eps_total_exact']:.2f}, headline "
              f"{r['eps_total_headline']:.2f}), {r['rounds']:4d} rounds: qNGI {r['qngi_median']:.3f} "
              f"[{r['qngi_min']:.3f},{r['qngi_max']:.3f}]")
    print("\ngoal (qNGI <= 0.1 at headline <= 4), cumulant unmixing after the default whitening:")
    for r in goal_rows:
        print(f"  eps_pca {r['eps_pca']:g}, eps_c {r['eps_i']:g}: qNGI {r['qngi_median']:.3f} "
              f"[{r['qngi_min']:.3f},{r['qngi_max']:.3f}], total {r['eps_total_exact']:.2f} exact, "
              f"{r['eps_total_headline']:.2f} headline")
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.0f} s")
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    with open(RESULTS / f"djica_end_to_end{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (RESULTS / f"djica_end_to_end{tag}.json").write_text(json.dumps(
        {"settings": {"M": M, "R": R, "T": T, "S": 4, "D": 900, "delta_pca": DELTA_PCA, "delta_i": DELTA_I,
                      "delta_total": DELTA_TOTAL, "unmixing": CONFIGS["tuned"], "whitenings": WHITENINGS,
                      "repeats": repeats, "wall_seconds": wall},
         "summary": rows, "rounds": rounds_rows, "goal": goal_rows, "runs": runs, "rounds_runs": rounds_runs,
         "goal_runs": goal_runs}, indent=1, default=str))


if __name__ == "__main__":
    main()
