"""benchmarks/agn_vs_n.py: capeAGN's q_comp against the sample size."""

from sections import one, pick, render, table
from sections.agn_utility import METHODS

TEMPLATE = """\
### capeAGN: q_comp vs sample size N ([CAPE-TF] Figs. 3-4, bottom rows)

D = {m[D]}, K = {m[K]}, S = {m[S]} (N_s = N / {m[S]}), delta = {m[delta]}; epsilon in {m[epsilons]} (the text of
[CAPE-TF] gives neither the N grid nor the fixed epsilon; chosen here). Median of {m[repeats]} repeats.

{run}

{tables}

{fig}
"""

PANEL = "{model}, D = {D}, epsilon = {eps!p}"

GLANCE = {"agnn": (
    "[CAPE-TF] Figs. 3-4 (bottom): capeAGN approaches non-private as N grows (D = 10)",
    "at N = {big:,}: {panels}",
    {"matches": "matches (the gap to non-private shrinks with N in every panel)", "partly": "partly"})}
AT_BIG = "{model} eps {eps!p}: capeAGN {cape!n} vs non-private {nonprivate!n}"


def fields(R):
    rows = R.csv("agn_vs_n.csv")
    if not rows:
        return None
    meta = R.json("agn_vs_n.json")
    tables = []
    for model in ("mog", "stm"):
        for e in meta.get("epsilons", []):
            sub = pick(rows, model=model, epsilon=e)
            if sub:
                tables.append(render(PANEL, {"model": model.upper(), "D": meta.get("D"), "eps": e}))
                tables.append(table(["N"] + METHODS, [[f"{n:,}"] + [one(sub, N=n, method=m)["q_comp_median"]
                                                                    for m in METHODS]
                                                      for n in sorted({r["N"] for r in sub})]))
    return {"m": meta, "tables": "\n\n".join(tables), "fig": R.fig("agn_vs_n.png", "capeAGN q_comp vs N"),
            "run": R.run("python benchmarks/agn_vs_n.py", ["agn_vs_n.csv", "agn_vs_n.json", "agn_vs_n.png"],
                         meta.get("runtime_s"))}


def glance(R):
    rows = R.csv("agn_vs_n.csv")
    if not rows:
        return
    big, small = max(r["N"] for r in rows), min(r["N"] for r in rows)

    def q(model, e, n, m):
        return one(rows, model=model, epsilon=e, N=n, method=m)["q_comp_median"]

    panels = [(model, e) for model in ("mog", "stm") for e in R.json("agn_vs_n.json").get("epsilons", [])]
    shrinks = all(q(*p, big, "capeagn") - q(*p, big, "nonprivate") < q(*p, small, "capeagn")
                  - q(*p, small, "nonprivate") for p in panels)
    yield "agnn", {"big": big, "panels": "; ".join(
        render(AT_BIG, {"model": model.upper(), "eps": e, "cape": q(model, e, big, "capeagn"),
                        "nonprivate": q(model, e, big, "nonprivate")}) for model, e in panels)}, \
        "matches" if shrinks else "partly"
