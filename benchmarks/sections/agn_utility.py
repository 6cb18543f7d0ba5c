"""benchmarks/agn_utility.py: capeAGN's q_comp against epsilon, MOG and STM."""

from sections import one, par, pick, render, table

METHODS = ["capeagn", "conv", "local", "agn_pooled", "avn_pooled", "nonprivate", "random"]

TEMPLATE = """\
### capeAGN: q_comp vs epsilon, MOG and STM ([CAPE-TF] Figs. 3-4, top rows)

[CAPE-TF] Sec. VI-B set-ups: S = {m[sites]} sites, delta = {m[delta]} split {m[split]} between the stages,
sigma^2 = {m[sigma2]} (MOG), {m[calibration]}. q_comp = mean distance of each recovered a_k to the nearest true
a_j (lower is better; Hungarian-matched version in the CSV); median of {m[repeats]} repeats.

{run}

{tables}

{fig}

{timings}
"""

CONFIG = "{model}, D = {D}, K = {K}, N = {N:,} (N_s = {N_s:,})"

TIMINGS = """\
Timings (seconds, best of a few calls): symmetric noise tensor from its C(D+2,3) unique draws, a site's full third
moment, a whole capeAGN run (plan cape with secure aggregation) and pooled AGN."""

GLANCE = {
    "wins": ("[CAPE-TF] Figs. 3-4: capeAGN beats conv and local",
             "lower q_comp than both in {wins} of {total} (set-up, eps) points",
             {"matches": "matches", "mostly": "mostly", "partly": "partly"}),
    "random": ("capeAGN, MOG D = 50, N = 50k",
               "{points}",
               {"better": "better than random vectors",
                "no better": "doesn't: no better than random vectors at eps <= {worst!p}{tail}"}),
}
POINT = "eps {eps!p}: q_comp {q!n} vs random vectors {random!n}"
TAIL = "only {ratio!n}x better than random at eps {eps!p}"


def configs(rows):
    return sorted({(r["model"], r["D"], r["K"], r["N"]) for r in rows}, key=lambda c: (c[0], c[1]))


def fields(R):
    rows = R.csv("agn_utility.csv")
    if not rows:
        return None
    meta = R.json("agn_utility.json")
    tables = []
    for model, D, K, N in configs(rows):
        sub = pick(rows, model=model, D=D)
        tables.append(render(CONFIG, {"model": model.upper(), "D": D, "K": K, "N": N, "N_s": N // sub[0]["S"]}))
        tables.append(table(["epsilon"] + METHODS, [[par(e)] + [one(sub, epsilon=e, method=m)["q_comp_median"]
                                                                for m in METHODS]
                                                   for e in sorted({r["epsilon"] for r in sub})]))
    t = R.csv("agn_timings.csv")
    return {"m": meta, "tables": "\n\n".join(tables), "fig": R.fig("agn_utility.png", "capeAGN q_comp vs epsilon"),
            "run": R.run("python benchmarks/agn_utility.py", ["agn_utility.csv", "agn_utility.json",
                                                               "agn_utility.png", "agn_timings.csv"],
                         meta.get("runtime_s")),
            "timings": render(TIMINGS, {}) + "\n\n" + table(
                ["D", "K", "N", "noise tensor s", "M3 one site s", "capeAGN run s", "stage 1 s", "stage 2 s",
                 "pooled AGN s"],
                [[r["D"], r["K"], r["N"], r["noise_tensor_s"], r["m3_full_one_site_s"], r["capeagn_run_s"],
                  r["capeagn_stage1_s"], r["capeagn_stage2_s"], r["agn_pooled_run_s"]] for r in t]) if t else ""}


def glance(R):
    rows = R.csv("agn_utility.csv")
    if not rows:
        return
    wins = total = 0
    for model, D, K, N in configs(rows):
        for e in sorted({r["epsilon"] for r in pick(rows, model=model, D=D)}):
            g = {m: one(rows, model=model, D=D, epsilon=e, method=m)["q_comp_median"] for m in METHODS}
            total += 1
            wins += g["capeagn"] < min(g["conv"], g["local"])
    yield "wins", {"wins": wins, "total": total}, \
        "matches" if wins == total else "mostly" if wins >= 0.8 * total else "partly"
    mog50 = pick(rows, model="mog", D=50)
    pts = [(r["epsilon"], r["q_comp_median"], one(mog50, epsilon=r["epsilon"], method="random")["q_comp_median"])
           for r in mog50 if r["method"] == "capeagn" and r["epsilon"] <= 1]
    if pts:
        # "no better" = within 10% of random vectors or worse
        worse = [e for e, q, r in pts if q >= 0.9 * r]
        tail = "; ".join(render(TAIL, {"ratio": r / q, "eps": e}) for e, q, r in pts if worse and e > max(worse))
        yield "random", {"points": "; ".join(render(POINT, {"eps": e, "q": q, "random": r}) for e, q, r in pts),
                         "worst": max(worse) if worse else None, "tail": "; " + tail if tail else ""}, \
            "no better" if worse else "better"
