"""Would subsampling subjects per round buy capeDJICA privacy? The accounting, at equal gradient noise.

capeDJICA releases every site's mean gradient every round, over all of its
subjects. Amplification by subsampling would release the mean over a random
fraction q of them instead. At the *same noise std on the mean gradient* (what
sets the unmixing's accuracy; the sampling's own variance comes on top and is
ignored here, which favours subsampling), the batch sum carries q times the
full batch's noise multiplier. This script asks dp-accounting (0.6.0) what the
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

No CAPE here: one site's releases as a conventional mechanism (CAPE's
guarantee against the aggregator would need its own derivation under
sampling). Writes benchmarks/results/subsampling_accounting.{csv,json}.
``--quick`` computes one row.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import time
from pathlib import Path

import dp_accounting as dpa
from dp_accounting.pld import pld_privacy_accountant
from dp_accounting.rdp import rdp_privacy_accountant

from dpneuro.privacy import gdp_epsilon

RESULTS = Path(__file__).resolve().parent / "results"
DELTA, DELTA_I, ROUNDS, M = 1e-5, 1e-2, 200, 1024


def classic_multiplier(eps_i: float) -> float:
    """The per-round noise multiplier of the classic Gaussian mechanism at (eps_i, delta_i)."""
    return math.sqrt(2 * math.log(1.25 / DELTA_I)) / eps_i


def pld(event, relation=dpa.NeighboringRelation.ADD_OR_REMOVE_ONE) -> float:
    acc = pld_privacy_accountant.PLDAccountant(neighboring_relation=relation, value_discretization_interval=1e-3)
    acc.compose(event, ROUNDS)
    return float(acc.get_epsilon(DELTA))


def rdp(event, relation) -> float:
    acc = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    acc.compose(event, ROUNDS)
    return float(acc.get_epsilon(DELTA))


def row(eps_i: float, q: float) -> dict:
    z = classic_multiplier(eps_i)  # noise std on the mean / (2B / M): the replace-one multiplier
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
    wall = time.perf_counter() - t0
    RESULTS.mkdir(parents=True, exist_ok=True)
    tag = "_quick" if args.quick else ""
    with open(RESULTS / f"subsampling_accounting{tag}.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    (RESULTS / f"subsampling_accounting{tag}.json").write_text(json.dumps(
        {"settings": {"delta": DELTA, "delta_i": DELTA_I, "rounds": ROUNDS, "M": M, "dp_accounting": dpa.__name__,
                      "wall_seconds": wall}, "rows": rows}, indent=1))
    print(f"wall time {wall:.0f} s")


if __name__ == "__main__":
    main()
