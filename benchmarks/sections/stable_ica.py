"""benchmarks/stable_ica.py: real fMRI, what capped the frontier at high eps, and the post-processing levers."""

from sections import fmt, render, table

TEMPLATE = """\
### Real fMRI: what capped the frontier at high eps, and the post-processing levers

The real-data pseudo-consortia above ({m[n_sites]} sites, spatial ICA with subject subspaces, {m[n_components]}
components, {m[regions]} regions), the planner splitting each total eps. Diagnosis at 4 x 250 subjects: the private
basis against the non-private one (principal angles of the 20-dimensional subspaces) and the maps of one FastICA
run, or of the stable ICA, against the same rule's non-private maps; then, on the same releases, each way of
choosing among FastICA runs against the same rule on the non-private basis (mean matched |r|, median and worst of
{m[seeds]} noise seeds).

{run}

{diagnosis}

Choosing among FastICA runs (median (worst)); `above edge`: released eigenvalues above the noise's edge 2 sigma
sqrt(D); `eigenvalue error`: median |lambda / lambda_nonprivate - 1| of the released eigenvalues, raw and debiased
by the spiked-Wigner formula (`dpneuro.privacy.rmt`); the debiased eigenvalues change the spatial maps by 1 - |r| =
{change!n} at most.

{table}
"""

OPTIMA_KEY = "optima of one FastICA run on the non-private basis (20 starts)"
DIAGNOSIS = """\
FastICA's optima on the non-private basis (4 x 250), 20 starts: {optima}. Subject bound 0.25 against 1: the basis
changes by {d[basis change, subject bound 0.25 -> 1 (max abs entry)]!n} (nothing is clipped); PCA mode (plan none,
private): {pca_mode}."""
OPTIMUM = "{name}: {v[starts]} starts, mean |r| {v[mean |r| with start 0]!n} with start 0's"


def fields(R):
    rows = R.csv("stable_ica.csv")
    if not rows:
        return None
    meta = R.json("stable_ica.json")
    diag = meta.get("diagnosis_250", {})
    optima = diag.get(OPTIMA_KEY, {})
    rules = meta.get("rules", [])
    diagnosis = ""
    if optima:
        drows = [[key, c["seed"], fmt(c["min cos of principal angles"]), fmt(c["mean cos^2"]),
                  fmt(c["single run vs non-private single run"]), fmt(c["stable vs non-private stable"])]
                 for key, cells in diag.items() if key.startswith("eps ") for c in cells]
        diagnosis = render(DIAGNOSIS, {"d": diag, "pca_mode": ", ".join(diag.get("PCA mode (plan none, private)", [])),
                                       "optima": "; ".join(render(OPTIMUM, {"name": k, "v": v})
                                                           for k, v in optima.items())}) + "\n\n" + table(
            ["budget", "seed", "min cos (subspace)", "mean cos^2", "one FastICA run", "stable ICA"], drows)
    return {"m": meta, "diagnosis": diagnosis, "change": max(float(r["maps_change_debiased"]) for r in rows),
            "run": R.run("python benchmarks/stable_ica.py", ["stable_ica.csv", "stable_ica.json"],
                         meta.get("runtime_s")),
            "table": table(["subjects", "eps", "above edge", "eigenvalue error (raw, debiased)", *rules],
                           [[r["subjects"], fmt(r["epsilon"]), r["above_edge_median"],
                             f"{fmt(r['eigenvalue_error_raw'])}, {fmt(r['eigenvalue_error_debiased'])}",
                             *(f"{fmt(r[f'{k}: median'])} ({fmt(r[f'{k}: min'])})" for k in rules)] for r in rows])}
