"""benchmarks/cape_delta.py: CAPE's delta against the noise level and the colluding sites."""

from sections import pick, render, table

TEMPLATE = """\
### CAPE delta vs noise level and colluding sites ([capeDJICA] Fig. 5 / App. F)

For per-site sensitivity 1/N_s (N_s = 100) at epsilon = 0.5: delta of CAPE ([capeDJICA] Thm. 1 with the corrected
mu_z, see docs/privacy.md), of [capeDJICA] eq. (1) as printed, of the conventional scheme with the same aggregator
noise and of pooled data (exact Gaussian curve). Selected rows; all rows in the CSV.

{run}

{table}

{colluders}

{fig}
"""

COLLUDERS = "Colluders sweep, S = {S}, tau = {tau}:"


def fields(R):
    rows = R.csv("cape_delta.csv")
    if not rows:
        return None
    taus = sorted({r["tau"] for r in pick(rows, sweep="tau")})
    show = sorted({min(taus, key=lambda t: abs(t - x)) for x in (0.03, 0.05, 0.1, 0.2)})
    col = pick(rows, sweep="colluders")
    return {"run": R.run("python benchmarks/cape_delta.py", ["cape_delta.csv", "cape_delta.png"],
                         R.runtime("cape_delta")),
            "table": table(["S", "colluding S_C", "tau", "delta CAPE", "delta [capeDJICA] eq. (1)", "delta conv",
                            "delta pooled"],
                           [[r["S"], r["S_C"], f"{r['tau']:.3f}", r["cape"], r["paper"], r["conv"], r["pool"]]
                            for r in pick(rows, sweep="tau") if r["tau"] in show]),
            "colluders": render(COLLUDERS, col[0]) + "\n\n" + table(
                ["S_C", "delta CAPE", "delta [capeDJICA] eq. (1)", "delta conv"],
                [[r["S_C"], r["cape"], r["paper"], r["conv"]] for r in col]) if col else "",
            "fig": R.fig("cape_delta.png", "CAPE delta")}
