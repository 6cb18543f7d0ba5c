"""benchmarks/temporal_levers.py: subsampling subjects, and noise correlated across rounds."""

from sections import par, render, table

TEMPLATE = """\
### capeDJICA: subsampling subjects, and noise correlated across rounds

{run}

Subsampling: the unmixing's {s[rounds]} rounds at M = {s[M]} with each round's mean gradient over a random
fraction q of the subjects instead of all, at the same noise std on the mean gradient (the sampling's own
variance, which would come on top, ignored). Total epsilon per site at delta {s[delta]} from dp-accounting
{s[dp_accounting]}: full batch by exact GDP (dpneuro's ledger) and PLD, replace-one; a fixed batch drawn without
replacement, replace-one (RDP; its q = 1 row is the full batch in that accountant); Poisson sampling against the
full batch under add/remove (PLD). One site, no CAPE.

{table}

{factorisations}
"""

FACTORISATIONS = """\
Noise correlated across rounds (matrix factorisations of the prefix sums A = B C, as tree aggregation and DP-FTRL):
squared error relative to independent noise at the same guarantee, when every subject contributes to every round
(capeDJICA) and when each contributes to one round only (streaming):"""


def fields(R):
    meta = R.json("temporal_levers.json")
    rows, fac = meta.get("subsampling", []), meta.get("factorisations", [])
    if not rows:
        return None
    return {"s": meta.get("settings", {}),
            "run": R.run("python benchmarks/temporal_levers.py", ["temporal_levers.json"],
                         meta.get("settings", {}).get("wall_seconds")),
            "table": table(["eps_i", "q", "full batch (GDP)", "full batch (PLD)", "without replacement (RDP)",
                            "full batch, add/remove", "Poisson, add/remove"],
                           [[par(r["eps_i"]), par(r["q"]), r["full_exact_gdp"], r["full_pld_replace"],
                             r["without_replacement_rdp_replace"], r["full_pld_add_remove"],
                             r["poisson_pld_add_remove"]] for r in rows]),
            "factorisations": render(FACTORISATIONS, {}) + "\n\n" + table(
                ["factorisation", "rounds", "every subject every round", "one round per subject"],
                [[r["factorisation"], r["rounds"], r["every_round_vs_independent"], r["one_round_vs_independent"]]
                 for r in fac]) if fac else ""}
