"""benchmarks/djica_vs_m.py: capeDJICA's qNGI and total epsilon against the number of subjects, and its maps."""

from sections import fmt, one, par, pick, render, table

TEMPLATE = """\
### capeDJICA: qNGI and total epsilon vs number of subjects M ([capeDJICA] Fig. 2), spatial maps ([capeDJICA] Fig. 3)

Data and configurations of djica_utility.py; M in {s[M]} (M / 4 subjects per site), eps_i in {{0.5 (classic),
2 (analytic)}}, delta_i = {s[delta_i]}, configuration 'tuned' (200 rounds) for all methods, 'paper' for capeDJICA
and non-private at the first eps_i. Median over {s[repeats]} noise seeds ({s[paper_repeats]} for 'paper');
[capeDJICA] used 10 runs and up to 1000 rounds: reduced to keep the run near 10 minutes.

{run}

Median qNGI (total epsilon per site at delta 1e-5, exact GDP):

{table}

{fig}

{maps}
"""

MAPS = """\
Spatial maps at M = {M}, eps_i = {eps!p}, tuned (first seed; 6 of 20 components, Hungarian-matched to the
truth):"""
LABEL = {"cape": "capeDJICA", "conv": "conv", "local": "local DP-ICA", "nonprivate": "non-private"}

GLANCE = {
    "trend": ("[capeDJICA] Fig. 2: capeDJICA beats conv and local and approaches non-private as M grows",
              """M = {M}, eps_i = {eps!p}: capeDJICA {cape!n}, conv {conv!n}, local {local!n}, non-private
              {nonprivate!n}; capeDJICA at M = {small_M}: {small!n}""",
              {"matches": "matches (tuned configuration)", "partly": "partly"}),
    "epsilon": ("[capeDJICA] Fig. 2: overall epsilon decreases with M",
                """tuned: total epsilon per site is the same for every M at a fixed round count (each release is
                calibrated to (eps_i, delta_i); the sensitivity 2B/M_s shrinks the noise instead){paper}""",
                {"stopping rule": """trend reproduced only with the stopping rule of [capeDJICA]; more subjects buy
                 utility, not epsilon"""}),
}
PAPER = """; with the rules of [capeDJICA] it falls from {small!n} (M = {small_M}) to {big!n} (M = {M}) only
because the stopping rule fires after fewer rounds"""


def fields(R):
    rows = R.csv("djica_vs_m.csv")
    if not rows:
        return None
    meta = R.json("djica_vs_m.json")
    Ms = sorted({r["M"] for r in rows})
    body = []
    for config, method, e in dict.fromkeys((r["config"], r["method"], r["eps_i"]) for r in rows):
        cells = [one(rows, config=config, method=method, eps_i=e, M=M) for M in Ms]
        body.append([config, method, "-" if e == "" else par(e)] + [
            "" if r is None else fmt(r["qngi_median"]) + ("" if method == "nonprivate" else
                                                          f" ({fmt(r['eps_total_exact'])})") for r in cells])
    mf = meta.get("maps_figure", {})
    maps = ""
    if mf:
        e_map = min(r["eps_i"] for r in rows if r["eps_i"] != "")
        maps = render(MAPS, {"M": max(Ms), "eps": e_map}) + "\n\n" + table(
            ["method", "mean abs r (20 maps)", "qNGI", "total epsilon"],
            [[LABEL.get(m, m), v["mean_abs_r"], v["qngi"], v["eps_total_exact"]] for m, v in mf.items()]) + \
            "\n\n" + R.fig("djica_maps.png", "spatial maps")
    return {"s": meta.get("settings", {}), "maps": maps,
            "run": R.run("python benchmarks/djica_vs_m.py", ["djica_vs_m.csv", "djica_vs_m.json", "djica_vs_m.png",
                                                             "djica_maps.png"], meta.get("wall_seconds")),
            "table": table(["config", "method", "eps_i"] + [f"M = {M}" for M in Ms], body),
            "fig": R.fig("djica_vs_m.png", "capeDJICA qNGI vs M")}


def glance(R):
    rows = R.csv("djica_vs_m.csv")
    if not rows:
        return
    Ms = sorted({r["M"] for r in rows})
    big, small = max(Ms), min(Ms)
    e0 = min(r["eps_i"] for r in rows if r["eps_i"] != "")
    g = {m: one(rows, config="tuned", method=m, eps_i=e0, M=big) for m in ("cape", "conv", "local")}
    g["nonprivate"] = one(rows, config="tuned", method="nonprivate", M=big)
    f = {"M": big, "small_M": small, "eps": e0, "paper": ""}
    if all(g.values()):
        s = one(rows, config="tuned", method="cape", eps_i=e0, M=small)
        yield "trend", {**f, **{m: r["qngi_median"] for m, r in g.items()}, "small": s["qngi_median"]}, \
            "matches" if g["cape"]["qngi_median"] < min(g["conv"]["qngi_median"], g["local"]["qngi_median"]) \
            else "partly"
    if len({round(r["eps_total_exact"], 6) for r in pick(rows, config="tuned", method="cape", eps_i=e0)}) == 1:
        p0, p1 = (one(rows, config="paper", method="cape", M=M) for M in (small, big))
        if p0 and p1:
            f["paper"] = render(PAPER, {**f, "small": p0["eps_total_exact"], "big": p1["eps_total_exact"]})
        yield "epsilon", f, "stopping rule"
