"""benchmarks/noise_ablation.py: real fMRI, what each noise lever buys."""

from sections import fmt, table

TEMPLATE = """\
### Real fMRI: what each noise lever buys

The real-data pseudo-consortium above at {m[n_sites]} sites x {m[subjects_per_site]} subjects (spatial ICA,
subject subspaces), one noise lever at a time, at the same headline eps (against the aggregator and one colluder,
delta 1e-5) and the same noise seeds. `papers`: every unique covariance entry at the release std and zero-sum
draws of variance tau^2; `symmetrized`: off-diagonal std tau / sqrt(2) at the same guarantee; `+ zero-sum 100`:
the zero-sum draws at 100 tau^2, which lowers the coalition's mu and so lets the same eps carry a smaller noise
multiplier (the defaults). Cell: mean matched |r| with the same data's maps without noise, median of {m[seeds]}
seeds; z = the PCA's noise multiplier.

{run}

{table}
"""


def fields(R):
    rows = R.csv("noise_ablation.csv")
    if not rows:
        return None
    meta = R.json("noise_ablation.json")
    eps = list(dict.fromkeys(r["epsilon"] for r in rows))
    cell = {(r["variant"], r["epsilon"]): r for r in rows}
    return {"m": meta, "run": R.run("python benchmarks/noise_ablation.py", ["noise_ablation.csv",
                                                                           "noise_ablation.json"],
                                    meta.get("runtime_s")),
            "table": table(["variant", *(f"eps {fmt(e)}: mean abs r (z)" for e in eps)],
                           [[v, *(f"{fmt(cell[v, e]['r_median'])} ({fmt(cell[v, e]['noise_multiplier'])})"
                                  for e in eps)] for v in dict.fromkeys(r["variant"] for r in rows)])}
