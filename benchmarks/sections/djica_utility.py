"""benchmarks/djica_utility.py: capeDJICA's qNGI against the total epsilon."""

from sections import fmt, one, par, pick, render, table

CONFIGS = ["paper", "fast", "tuned"]

TEMPLATE = """\
### capeDJICA: qNGI vs total epsilon ([capeDJICA] Fig. 1 set-up)

[capeDJICA] Sec. V synthetic data: R = {s[R]} GARCH sources, {s[T]} time points per subject, 30 x 30 grid
(D = {s[D]}), S = {s[S]} sites, whitening by pooled non-private PCA (epsilon of the ICA only, as [capeDJICA]),
delta_i = {s[delta_i]}, total epsilon per site at delta = {s[delta_total]} (exact GDP). Configurations: 'paper' =
the optimizer and clipping of [capeDJICA] (B_G = B_h = 30, rho = 0.015 / ln R, <= 1000 rounds); 'fast' =
dpneuro's optimizer, the clipping of [capeDJICA], 200 rounds; 'tuned' = fast optimizer, subject-level clipping
B_G = 2, no bias release, 200 rounds. Median over {s[repeats]} noise seeds ({s[paper_repeats]} for 'paper').

{run}

{tables}

{stars}

{fig}
"""

PER_M = "M = {M} subjects: median qNGI (total epsilon per site)"
STARS = "Smallest total epsilon reaching median qNGI <= 0.1 (grid point; log-linear interpolation):"

GLANCE = {
    "paper": ("[capeDJICA] Figs. 1-2: capeDJICA reaches qNGI <= 0.1 with the paper's optimizer and clipping",
              "best median qNGI with the 'paper' configuration: {best}",
              {"no": "doesn't reproduce: the paper's rules (rho = 0.015 / ln R, B = 30) stop near qNGI 0.26 even "
                     "without noise"}),
    "tuned": ("capeDJICA with dpneuro's optimizer ('tuned')",
              "smallest total epsilon with median qNGI <= 0.1: {eps}",
              {"falls": "beats the configuration of [capeDJICA]: usable maps (qNGI <= 0.1), at a total epsilon "
                        "that falls with M",
               "beats": "beats the configuration of [capeDJICA]: usable maps (qNGI <= 0.1)"}),
}
BEST = "M = {M}: {best_median_qngi!n}"
EPS_STAR = "M = {M}: {eps_star_grid!n} (interp. {eps_star_interp!n})"


def cell(r, method):
    return "" if r is None else fmt(r["qngi_median"]) + ("" if method == "nonprivate" else
                                                         f" ({fmt(r['eps_total_exact'])})")


def fields(R):
    rows = R.csv("djica_utility.csv")
    if not rows:
        return None
    meta = R.json("djica_utility.json")
    tables = []
    for M in sorted({r["M"] for r in rows}):
        keys = sorted({(r["config"], r["method"]) for r in pick(rows, M=M)},
                      key=lambda k: (CONFIGS.index(k[0]) if k[0] in CONFIGS else 9, k[1]))
        eps_all = sorted({r["eps_i"] for r in pick(rows, M=M) if r["eps_i"] != ""})
        body = [[c, m] + [cell(one(rows, M=M, config=c, method=m) if m == "nonprivate" else
                               one(rows, M=M, config=c, method=m, eps_i=e), m) for e in eps_all] for c, m in keys]
        tables += [render(PER_M, {"M": M}), table(["config", "method"] + [f"eps_i = {par(e)}" for e in eps_all],
                                                  body)]
    stars = meta.get("eps_star", [])
    return {"s": meta.get("settings", {}), "tables": "\n\n".join(tables),
            "run": R.run("python benchmarks/djica_utility.py", ["djica_utility.csv", "djica_utility.json",
                                                                 "djica_utility.png"],
                         meta.get("settings", {}).get("wall_seconds")),
            "stars": STARS + "\n\n" + table(
                ["M", "config", "method", "eps* (grid)", "eps* (interpolated)", "best median qNGI"],
                [[s["M"], s["config"], s["method"], s["eps_star_grid"], s["eps_star_interp"], s["best_median_qngi"]]
                 for s in stars]) if stars else "",
            "fig": R.fig("djica_utility.png", "capeDJICA qNGI vs epsilon")}


def glance(R):
    if not R.csv("djica_utility.csv"):
        return
    stars = {(s["M"], s["config"], s["method"]): s for s in R.json("djica_utility.json").get("eps_star", [])}
    paper = [v for (M, c, m), v in stars.items() if c == "paper" and m == "cape"]
    tuned = {M: v for (M, c, m), v in stars.items() if c == "tuned" and m == "cape"}
    if paper:
        yield "paper", {"best": ", ".join(render(BEST, v) for v in paper)}, "no"
    if tuned:
        falls = len(tuned) < 2 or tuned[max(tuned)]["eps_star_grid"] < tuned[min(tuned)]["eps_star_grid"]
        yield "tuned", {"eps": ", ".join(render(EPS_STAR, v) for M, v in sorted(tuned.items()))}, \
            "falls" if falls else "beats"
