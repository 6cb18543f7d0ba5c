"""benchmarks/pca_vs_n.py: capePCA's captured energy against the samples per site."""

from sections import one, table
from sections.pca_utility import METHODS

TEMPLATE = """\
### capePCA: captured energy vs samples per site N_s ([CAPE-TF] Fig. 2(d), [DPdisPCA] Fig. 1(d))

Same set-up as above at epsilon = {m[epsilon]}, delta = {m[delta]} (the papers' text gives neither the N_s grid
nor the fixed epsilon of this figure; both are chosen here). Median of {m[repeats]} repeats, a fresh data set per
N_s and repeat.

{run}

{table}

{fig}
"""

GLANCE = {"pcan": (
    "[CAPE-TF] Fig. 2(d): utility grows with N_s and reaches non-private pooled",
    """eps = {eps!p}: capePCA {cape1!n} at N_s = {n1} to {capeb!n} at N_s = {nb:,} (conv {conv1!n} to
    {convb!n})""",
    {"matches": "matches", "partly": "partly"})}


def fields(R):
    rows = R.csv("pca_vs_n.csv")
    if not rows:
        return None
    meta = R.json("pca_vs_n.json")
    ns = sorted({r["N_s"] for r in rows})
    return {"m": meta, "run": R.run("python benchmarks/pca_vs_n.py", ["pca_vs_n.csv", "pca_vs_n.json", "pca_vs_n.png"],
                                    meta.get("wall_seconds")),
            "table": table(["N_s"] + METHODS, [[n] + [one(rows, N_s=n, method=m)["median"] for m in METHODS]
                                              for n in ns]),
            "fig": R.fig("pca_vs_n.png", "capePCA captured energy vs N_s")}


def glance(R):
    rows = R.csv("pca_vs_n.csv")
    if not rows:
        return
    n1, nb = min(r["N_s"] for r in rows), max(r["N_s"] for r in rows)
    at = {(n, m): one(rows, N_s=n, method=m)["median"] for n in (n1, nb) for m in ("capePCA", "conv")}
    yield "pcan", {"eps": R.json("pca_vs_n.json").get("epsilon"), "n1": n1, "nb": nb, "cape1": at[n1, "capePCA"],
                   "capeb": at[nb, "capePCA"], "conv1": at[n1, "conv"], "convb": at[nb, "conv"]}, \
        "matches" if at[nb, "capePCA"] > 0.99 else "partly"
