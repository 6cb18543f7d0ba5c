"""benchmarks/dfnc_real.py: dFNC states on real fMRI (shown with benchmarks/dfnc_states.py's section)."""

from sections import one, r2, render, table

TEMPLATE = """\
On real fMRI (`benchmarks/_real_data.py`: the 33 people of ds000140, 122 regions, two task runs of 191 TRs;
{m[R]} components from the exact PCA and the product's spatial ICA, so that only the states stage is private;
K = {m[K]}): the states k-means finds on half of the people against those on the other half ({m[splits]} random
splits), and the run's private states on 4 pseudo-sites of {sites} people against k-means on all 33 ({seeds} noise
seeds).

{run}

{table}

What limits the private states here is the number of people per site: every release's sensitivity is a bound over
the site's subject count, so 8 people per site carry 12.5 times the noise of 100.
"""

#: the end of benchmarks/dfnc_states.py's README passage
STATES = """\
On real task fMRI (33 people) the states are stable between halves of the people
(r = {half}) and the stage without noise finds them ({none}), but split into 4 sites of 8-9
people the private states at eps 8 are noise ({eps8}; `benchmarks/dfnc_real.py`): states need
about 100 people per site at eps 4."""


def fields(R):
    real = R.csv("dfnc_real.csv")
    if not (real and R.csv("dfnc_states.csv")):
        return None
    meta = R.json("dfnc_real.json")
    return {"m": meta, "sites": ", ".join(str(x) for x in meta.get("sites", [])), "seeds": len(meta.get("seeds", [])),
            "run": R.run("python benchmarks/dfnc_real.py", ["dfnc_real.csv", "dfnc_real.json"], meta.get("runtime_s")),
            "table": table(["states", "eps", "mean r (median)", "mean r (worst)"],
                           [[r["method"], r["eps"], r["r_median"], r["r_min"]] for r in real])}


def real_states(R) -> str:
    real = R.csv("dfnc_real.csv")
    if not real:
        return ""
    priv = {e: one(real, eps=e, method="private k-means vs pooled k-means")["r_median"] for e in (8.0, "none")}
    return "\n" + render(STATES, {"half": r2(one(real, eps="none", method="split-half k-means (no noise)")["r_median"]),
                           "none": r2(priv["none"]), "eps8": r2(priv[8.0])}, soft=False)
