"""Two levers for capeDJICA's per-round releases, measured by their accounting: subsampling, correlated noise.

1. Subsampling. capeDJICA releases every site's mean gradient every round,
over all of its subjects. Amplification by subsampling would release the mean
over a random fraction q of them instead. At the *same noise std on the mean
gradient* (what sets the unmixing's accuracy; the sampling's own variance comes
on top and is ignored here, which favours subsampling), the batch sum carries q
times the full batch's noise multiplier. dp-accounting (0.6.0) says what the
unmixing's 200 rounds then cost, at delta 1e-5, for the per-round noise of the
"tuned" runs of djica_utility.py (eps_i in {0.25, 0.5, 0.9}, classic
calibration at delta_i 1e-2, M = 1024 subjects):

``full batch``       every subject every round (today): exact GDP (dpneuro's ledger) and dp-accounting's
                     PLD, both under replace-one neighbours (sensitivity 2B / M)
``without repl.``    a fixed batch of q M subjects drawn without replacement, replace-one neighbours
                     (the relation dpneuro's guarantee uses): dp-accounting's RDP (its q = 1 row is
                     the full batch in the same, looser accountant)
``Poisson``          each subject in with probability q, add/remove neighbours (the DP-SGD
                     literature's relation; sensitivity B): dp-accounting's PLD, next to the full
                     batch under the same relation

2. Noise correlated across rounds (tree aggregation, matrix factorisation as
in DP-FTRL). The optimizer's trajectory is a linear function of the prefix sums
of the noisy gradients (workload A, T x T lower-triangular ones). A
factorisation A = B C releases C g + noise and post-processes with B; its
squared error is ||B||_F^2 sens(C)^2 times the noise multiplier squared. When a
subject contributes to one round only (streaming, DP-FTRL's setting),
sens(C)^2 = max_t ||C e_t||^2; in capeDJICA every subject contributes to every
round with any gradient direction, so sens(C)^2 = sup ||sum_t C_t u_t||^2 over
||u_t|| <= 1, which is 1^T C^T C 1 when C^T C >= 0 entrywise (checked). The
table gives each factorisation's error relative to independent noise (C = I)
at T = 200, in both settings.

No CAPE here: one site's releases as a conventional mechanism (CAPE's
guarantee against the aggregator would need its own derivation under
sampling). Writes benchmarks/results/temporal_levers.json. ``--quick`` computes
one subsampling row.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from importlib.metadata import version
from pathlib import Path

import dp_accounting as dpa
import numpy as np
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpneuro.privacy import gdp_epsilon, noise_multiplier

RESULTS = Path(__file__).resolve().parent / "results"
DELTA, DELTA_I, ROUNDS, M = 1e-5, 1e-2, 200, 1024




def pld(event, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
    acc.compose(event, ROUNDS)
    return float(acc.get_epsilon(DELTA))


def rdp(event, relation) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    acc.compose(event, ROUNDS)
    return float(acc.get_epsilon(DELTA))


def row(eps_i: float, q: float) -> dict:
    # the classic per-round calibration; noise std on the mean / (2B / M): the replace-one multiplier
    z = noise_multiplier(eps_i, DELTA_I, method="classic")
    out = {"eps_i": eps_i, "q": q, "rounds": ROUNDS, "M": M, "z_full_replace": z,
           "full_exact_gdp": gdp_epsilon(DELTA, math.sqrt(ROUNDS) / z),
           # dp-accounting's PLD takes a Gaussian's multiplier on the add/remove sensitivity B under either relation
           "full_pld_replace": pld(dpa.GaussianDpEvent(2 * z), dpa.NeighboringRelation.REPLACE_ONE),
           # add/remove: one subject moves the sum by B, so the multiplier on B doubles
           "full_pld_add_remove": pld(dpa.GaussianDpEvent(2 * z))}
    # the same std on the mean over q M subjects: the batch sum's noise is q M sigma = q z (2B)
    zq = q * z
    out["without_replacement_rdp_replace"] = rdp(
        dpa.SampledWithoutReplacementDpEvent(M, int(round(q * M)), dpa.GaussianDpEvent(zq)),
        dpa.NeighboringRelation.REPLACE_ONE)
    out["poisson_pld_add_remove"] = pld(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(2 * zq)))
    return out


def factorizations(T: int = ROUNDS) -> list[dict]:
    """Squared error of prefix sums under each factorisation, relative to independent noise (C = I)."""
    A = np.tril(np.ones((T, T)))
    coef = np.array([math.comb(2 * k, k) / 4 ** k for k in range(T)])  # A^(1/2): lower-triangular Toeplitz
    root = np.zeros((T, T))
    for i in range(T):
        root[i, :i + 1] = coef[:i + 1][::-1]
    tree, width = [], 1
    while width <= T:  # binary tree aggregation: one node per dyadic interval
        for a in range(0, T, width):
            r = np.zeros(T)
            r[a:a + width] = 1
            tree.append(r)
        width *= 2
    tree = np.array(tree)

    def error(B, C):
        G = C.T @ C
        if not (G >= -1e-12).all():
            raise AssertionError("C^T C has a negative entry: 1^T C^T C 1 is then not the supremum")
        ones = np.ones(T)
        return np.sum(B ** 2) * float(ones @ G @ ones), np.sum(B ** 2) * float(np.max(np.diag(G)))

    base = error(A, np.eye(T))
    out = []
    for name, B, C in (("independent (C = I)", A, np.eye(T)), ("square root (C = A^1/2)", root, root),
                       ("binary tree", A @ np.linalg.pinv(tree), tree)):
        full, single = error(B, C)
        out.append({"factorisation": name, "rounds": T, "every_round_vs_independent": full / base[0],
                    "one_round_vs_independent": single / base[1]})
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="one row")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    grid = [(0.5, 0.5)] if args.quick else [(e, q) for e in (0.25, 0.5, 0.9) for q in (1.0, 0.5, 0.25, 0.1)]
    rows = []
    print(f"{'eps_i':>5} {'q':>5} {'full GDP':>8} {'full PLD':>8} {'w/o repl':>8} {'full a/r':>8} {'Poisson':>8}")
    for e, q in grid:
        r = row(e, q)
        rows.append(r)
        print(f"{e:5g} {q:5g} {r['full_exact_gdp']:8.2f} {r['full_pld_replace']:8.2f} "
              f"{r['without_replacement_rdp_replace']:8.2f} {r['full_pld_add_remove']:8.2f} "
              f"{r['poisson_pld_add_remove']:8.2f}", flush=True)
    fac = factorizations(30 if args.quick else ROUNDS)
    print(f"\n{'factorisation':26} {'every round':>12} {'one round':>10}  (squared error / independent noise's)")
    for r in fac:
        print(f"{r['factorisation']:26} {r['every_round_vs_independent']:12.3f} {r['one_round_vs_independent']:10.3f}")
    wall = time.perf_counter() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    (RESULTS / f"temporal_levers{tag}.json").write_text(json.dumps(
        {"settings": {"delta": DELTA, "delta_i": DELTA_I, "rounds": ROUNDS, "M": M,
                      "dp_accounting": version("dp-accounting"), "wall_seconds": wall},
         "subsampling": rows, "factorisations": fac}, indent=1))
    print(f"wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
