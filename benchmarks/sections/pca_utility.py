"""benchmarks/pca_utility.py: capePCA's captured energy against epsilon."""

from sections import one, par, pick, table

METHODS = ["capePCA", "conv", "DPdisPCA", "local", "pooled DP"]

TEMPLATE = """\
### capePCA: captured energy vs epsilon ([CAPE-TF] Fig. 2(a), [DPdisPCA] Fig. 1(a))

Synthetic set-up of [CAPE-TF] / [DPdisPCA]: D = {m[D]}, K = {m[K]}, S = {m[S]} sites x N_s = {m[N_s]},
delta = {m[delta]}, {m[preprocessing]}. q / q_o = captured energy over the non-private pooled top-K subspace's;
median of {m[repeats]} repeats (interquartile range in the CSV).

{run}

{tables}

{fig}
"""

CALIBRATION = {"classic": "the papers' formula, valid for eps < 1", "analytic": "Balle & Wang"}

GLANCE = {"pca": (
    "[CAPE-TF] Sec. VI-A: capePCA reaches the pooled-data utility (CAPE's claim) and beats DPdisPCA, conv and local",
    """q/q_o at eps = 0.5 (N_s = 1000): capePCA {v[capePCA]!n}, pooled DP {v[pooled DP]!n}, conv {v[conv]!n},
    DPdisPCA {v[DPdisPCA]!n}, local {v[local]!n}; largest |capePCA - pooled DP| over every eps and N_s: {maxdiff!n}""",
    {"matches": "matches", "partly": "partly"})}


def fields(R):
    rows = R.csv("pca_utility.csv")
    if not rows:
        return None
    meta = R.json("pca_utility.json")
    tables = []
    for cal in ("analytic", "classic"):
        sub = pick(rows, calibration=cal)
        if sub:
            eps = sorted({r["epsilon"] for r in sub})
            tables.append(f"q / q_o, {cal} Gaussian calibration ({CALIBRATION[cal]})")
            tables.append(table(["epsilon"] + METHODS, [[par(e)] + [one(sub, epsilon=e, method=m)["median"]
                                                                    for m in METHODS] for e in eps]))
    classic = any(r["calibration"] == "classic" for r in rows)
    return {"m": meta, "tables": "\n\n".join(tables),
            "fig": R.fig("pca_utility.png", "capePCA captured energy vs epsilon"),
            "run": R.run("python benchmarks/pca_utility.py" + (" --classic" if classic else ""),
                         ["pca_utility.csv", "pca_utility.json", "pca_utility.png"], meta.get("wall_seconds"))}


def compare(rows, key):
    """(largest |capePCA - pooled DP|, capePCA beats conv, DPdisPCA and local everywhere) over ``key``'s values."""
    at = {k: {m: one(rows, **{key: k}, method=m)["median"] for m in METHODS} for k in {r[key] for r in rows}}
    return (max(abs(g["capePCA"] - g["pooled DP"]) for g in at.values()),
            all(g["capePCA"] > max(g["conv"], g["DPdisPCA"], g["local"]) for g in at.values()))


def glance(R):
    an = pick(R.csv("pca_utility.csv"), calibration="analytic")
    if not R.csv("pca_utility.csv"):
        return
    maxdiff, beats = compare(an, "epsilon")
    n = R.csv("pca_vs_n.csv")
    nmax, nbeats = compare(n, "N_s") if n else (0, True)
    v = {m: one(an, epsilon=0.5, method=m)["median"] for m in METHODS} if one(an, epsilon=0.5, method="capePCA") \
        else {}
    same = maxdiff < 0.01 and nmax < 0.01
    yield "pca", {"v": {m: v.get(m) for m in METHODS}, "maxdiff": max(maxdiff, nmax)}, \
        "matches" if same and beats and nbeats else "partly"
