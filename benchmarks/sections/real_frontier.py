"""benchmarks/real_frontier.py: real fMRI, agreement with CanICA and the privacy-utility frontier."""

from sections import fmt, frontier_table, one, r2, render

#: the agreement with the non-private maps a consortium wants from its private maps (issue 36's statement)
GOOD_MAPS = 0.8

TEMPLATE = """\
### Real fMRI: agreement with CanICA, and the privacy-utility frontier

Region time series of {m[people]} people ({dataset}; task runs, not rest; pip package `connattractor`, read by
`benchmarks/_real_data.py`), every region z-scored within its run. Without noise, split over 4 sites, 20
components, against nilearn's CanICA on the series painted into the atlas on the 6 mm grid as 4-D images (mean
matched |r| over the atlas voxels). dpneuro on the same images (every voxel a feature) and on the 122 regions as
features (maps painted); over voxels each region weighs as much as it has voxels, which is why the two differ:
{agreement}.

Frontier: pseudo-consortia of {m[n_sites]} sites, each pseudo-subject one of the real people (drawn with
replacement) and a random {m[window]}-volume window of one of its runs. Cell: mean matched |r| of the private maps
with the same method's maps without noise on the same pseudo-consortium, median of {m[seeds]} noise seeds; eps is
the run's total per site in the headline sense (against the aggregator and its colluders, delta 1e-5), split by
the planner. `contribution`: what a subject adds to the PCA (`pca_contribution`: its second moment, or the
projector on its own principal subspace, norm 1/sqrt(20) = 0.22 by construction); `bound`: `pca_subject_bound`
(1 = none). The `no noise` column compares the pseudo-consortium's maps with the real 33 people's. Spatial ICA is
the product's stable ICA (best of 20 public FastICA starts, CanICA's sparsity rule); `spatial, single FastICA` is
the ablation with one start (what the product did before), on the same releases and against its own non-private
maps.{sizes_run}

{run}

{table}

{edge}

{fig}

{sweep}

{unequal}
"""

SIZES_RUN = " Sizes run: {sizes} subjects per site."
EDGE = """\
Released eigenvalues above the noise's edge 2 sigma sqrt(D) (`dpneuro.privacy.rmt`; sigma the planner's public noise std),
of the 20 released, spatial ICA with subject subspaces, median of the seeds: the components the noise allows."""
SWEEP = """\
The default run (spatial ICA, subject subspaces) at every size measured, equal sites: the consortium a budget needs
for maps at {good} with the non-private maps (the smallest size from which the median stays at {good} or above):
{sizes}."""
UNEQUAL = """\
Unequal sites ({sites} subjects) against equal ones of the same total ({each} each), the default run: CAPE weighs
each site by its share of the time points and each site's noise by its own sensitivity, so the aggregator's noise
is the pooled one either way."""
NEEDS = {True: "eps {eps:g} needs {m} subjects per site ({r})", False: "eps {eps:g} more than {largest} per site"}

GLANCE = {
    "agreement": ("""Real fMRI (33 people, 122 regions): do dpneuro's maps look like CanICA's on the same data?
                  (non-private)""",
                  "mean matched |r| with CanICA: {agreement}",
                  {"default": "spatial ICA with subspace contributions (the default) gives the maps users know",
                   "partly": "partly"}),
    "eps8": ("""Real fMRI pseudo-consortia, 4 sites, 20 components, total eps 8: private maps vs the same method's
             non-private maps (goal: 0.7 at 100 subjects per site)""",
             """100 per site {m100!n} (second moments: bound 0.25 {b100!n}, no bound {n100!n}); 500 per site
             {m500!n}""",
             {"at 500": """met at 500 subjects per site, not at 100: the 20th direction is shared by too few subjects
              to stand clear of the noise""", "met": "met", "not met": "not met"}),
    "eps16": ("""Real fMRI pseudo-consortia, eps 16: private maps converge to the same method's non-private maps
              (issue 36 goal: >= 0.97 at 250 and 500 subjects per site)""",
              "{cells}", {"met": "met", "not met": "not met"}),
    "goals": ("""Real fMRI pseudo-consortia at strong privacy (issue 36 goals: 4 x 100 subjects eps 1 >= 0.6, eps 2
              >= 0.75, eps 4 >= 0.85; 4 x 50 eps 4 >= 0.7)""",
              "{cells}. For maps at {good}: {sizes}",
              {"met": "met", "not met": """not met: the Gaussian noise a budget needs, not the method, sets them;
               {ceiling}; the size a budget needs is stated"""}),
}
EPS16 = "{m} per site {r!n}"
SINGLE = " (one FastICA run: {r!n})"
GOAL = "{m} per site eps {eps:g}: {r!n}"
GOALS = [(100, 1.0, 0.6), (100, 2.0, 0.75), (100, 4.0, 0.85), (50, 4.0, 0.7)]

README = {"real_frontier": """\
| subjects per site | {sizes} |
|---|---|---|---|
| second moments, no bound | {moment_1} |
| second moments, bound 0.25 | {moment_025} |
| subspaces, bound 0.25 (default) | {subspace} |

At eps = 4 the default reaches {a4[0]} at 100 subjects per site, {a4[1]} at 250
and {a4[2]} at 500; at eps 16, {a16[0]}, {a16[1]} and {a16[2]}.{needs}{unequal}"""}
README_NEEDS = """\
For maps at {good} (the smallest size measured from which the median stays there): {sizes}; `dpneuro budget` \
gives a consortium's own size from its settings, by a criterion these cells calibrate."""
README_UNEQUAL = """\
Unequal sites cost nothing: {sites} subjects reach {unequal} at eps 1, 2 and 4, against {equal} with {each} at \
every site."""


def equal(rows):
    return [r for r in rows if r.get("sites", "equal") == "equal"]


def default_real(rows) -> list[dict]:
    """The real-data frontier's rows of the default run (spatial ICA, subject subspaces, bound 0.25), equal sites."""
    return [r for r in equal(rows) if r["ica"] == "spatial" and r["contribution"] == "subspace" and r["bound"] == 0.25
            and r["epsilon"] != "none" and r["r_median"] != ""]


def subjects_for(rows, epsilon: float, level: float = GOOD_MAPS):
    """(subjects per site, its median) of the smallest measured size from which the default run's maps stay at
    ``level`` or above at total ``epsilon``; None when no measured size reaches it."""
    cells = sorted((int(r["subjects"]), r["r_median"]) for r in default_real(rows) if r["epsilon"] == epsilon)
    found = None
    for m, v in reversed(cells):
        if v < level:
            break
        found = (m, v)
    return found


def sizes_sentence(rows) -> str:
    """The consortium size a budget of eps 1, 2 and 4 needs for maps at GOOD_MAPS (README and report)."""
    parts = []
    for eps in (1.0, 2.0, 4.0):
        got = subjects_for(rows, eps)
        largest = max((int(r["subjects"]) for r in default_real(rows) if r["epsilon"] == eps), default=0)
        parts.append(NEEDS[bool(got)].format(eps=eps, m=got and got[0], r=got and r2(got[1]), largest=largest))
    return "; ".join(parts)


def agreement(meta) -> str:
    return ", ".join(f"{k.replace(' vs CanICA', '')} {fmt(v)}" for k, v in meta.get("agreement", {}).items()
                     if k.endswith("vs CanICA"))


def fields(R):
    rows = R.csv("real_frontier.csv")
    if not rows:
        return None
    meta = R.json("real_frontier.json")
    eps, sizes = meta.get("epsilons", []), meta.get("subjects_per_site")
    grid = [r for r in equal(rows) if int(r["subjects"]) in meta.get("subjects_per_site", [r["subjects"]])]
    edge = sorted((r for r in equal(rows) if r.get("above_edge") not in (None, "") and r["ica"] == "spatial"
                   and r["contribution"] == "subspace"), key=lambda r: int(r["subjects"]))
    default = sorted(default_real(rows), key=lambda r: int(r["subjects"]))
    uneq = [r for r in rows if r.get("sites", "equal") != "equal"]
    f = {"m": meta, "dataset": (meta.get("data") or {}).get("dataset"), "agreement": agreement(meta),
         "sizes_run": render(SIZES_RUN, {"sizes": ", ".join(str(x) for x in sizes)}) if sizes and 50 not in sizes
         else "",
         "run": R.run("python benchmarks/real_frontier.py", ["real_frontier.csv", "real_frontier.json",
                                                             "real_frontier.png"], meta.get("runtime_s")),
         "table": frontier_table(grid, ["subjects", "ica", "contribution", "bound"], "r_median", eps),
         # no "no noise" column: nothing to count
         "edge": render(EDGE, {}) + "\n\n" + frontier_table(edge, ["subjects"], "above_edge", eps, no_noise=False)
         if edge else "",
         "fig": R.fig("real_frontier.png", "real-data frontier"),
         "sweep": render(SWEEP, {"good": GOOD_MAPS, "sizes": sizes_sentence(rows)}) + "\n\n" + frontier_table(
             default, ["subjects"], "r_median", eps, no_noise=False) if meta.get("sweep") and default else "",
         "unequal": ""}
    if uneq and meta.get("equal"):
        same = [r for r in default if int(r["subjects"]) == meta["equal"][0]]
        f["unequal"] = render(UNEQUAL, {"sites": uneq[0]["sites"], "each": meta["equal"][0]}) + "\n\n" + \
            frontier_table(uneq + same, ["sites"], "r_median", eps, no_noise=False)
    return f


def glance(R):
    from sections.strong_privacy import ceiling_sentence

    rows = R.csv("real_frontier.csv")
    if not rows:
        return
    ag = R.json("real_frontier.json").get("agreement", {})
    if ag:
        yield "agreement", {"agreement": agreement({"agreement": ag})}, \
            "default" if ag.get("spatial (subspace) on the same images vs CanICA", 0) >= 0.6 else "partly"
    cells = {(int(r["subjects"]), r["ica"], r["contribution"], float(r["bound"])): r for r in rows if r["epsilon"] == 8}
    m100, m500 = cells.get((100, "spatial", "subspace", 0.25)), cells.get((500, "spatial", "subspace", 0.25))
    b100, n100 = cells.get((100, "spatial", "moment", 0.25)), cells.get((100, "spatial", "moment", 1.0))
    if m100 and m500 and n100 and b100:
        yield "eps8", {"m100": m100["r_median"], "b100": b100["r_median"], "n100": n100["r_median"],
                       "m500": m500["r_median"]}, \
            "at 500" if m500["r_median"] >= 0.7 > m100["r_median"] else "met" if m100["r_median"] >= 0.7 \
            else "not met"
    c16 = {(int(r["subjects"]), r["ica"]): r for r in rows if r["epsilon"] == 16 and r["contribution"] == "subspace"}
    big = [(m, c16[m, "spatial"]["r_median"], c16.get((m, "spatial, single FastICA"), {}).get("r_median"))
           for m in (250, 500) if (m, "spatial") in c16]
    if big:
        yield "eps16", {"cells": "; ".join(render(EPS16, {"m": m, "r": v}) + (render(SINGLE, {"r": o}) if o is not None
                                                                               else "") for m, v, o in big)}, \
            "met" if all(v >= 0.97 for _, v, _ in big) else "not met"
    got = [(m, e, g, one(default_real(rows), subjects=m, epsilon=e)) for m, e, g in GOALS]
    if all(r for *_, r in got):
        yield "goals", {"cells": "; ".join(render(GOAL, {"m": m, "eps": e, "r": r["r_median"]}) for m, e, _, r in got),
                        "good": GOOD_MAPS, "sizes": sizes_sentence(rows), "ceiling": ceiling_sentence(R)}, \
            "met" if all(r["r_median"] >= g for _, _, g, r in got) else "not met"


def readme(R):
    rows = R.csv("real_frontier.csv")
    if not rows:
        return {}

    def cells(contribution, bound, epsilon):
        return [r2(one(equal(rows), subjects=n, ica="spatial", contribution=contribution, bound=bound,
                       epsilon=epsilon)["r_median"]) for n in (100, 250, 500)]

    f = {"sizes": " | ".join(str(n) for n in (100, 250, 500)), "moment_1": " | ".join(cells("moment", 1.0, 8.0)),
         "moment_025": " | ".join(cells("moment", 0.25, 8.0)), "subspace": " | ".join(cells("subspace", 0.25, 8.0)),
         "a4": cells("subspace", 0.25, 4.0), "a16": cells("subspace", 0.25, 16.0), "unequal": "",
         "needs": "\n" + render(README_NEEDS, {"good": GOOD_MAPS, "sizes": sizes_sentence(rows)}, soft=False)
         if subjects_for(rows, 4.0) else ""}
    meta = R.json("real_frontier.json")
    uneq = [r for r in rows if r.get("sites", "equal") != "equal" and r["epsilon"] in (1.0, 2.0, 4.0)]
    if uneq and meta.get("equal"):
        each = meta["equal"][0]
        eq = [one(default_real(rows), subjects=each, epsilon=e) for e in (1.0, 2.0, 4.0)]
        if None not in eq:
            f["unequal"] = "\n" + render(README_UNEQUAL, {
                "sites": uneq[0]["sites"], "each": each, "equal": ", ".join(r2(r["r_median"]) for r in eq),
                "unequal": ", ".join(r2(r["r_median"]) for r in sorted(uneq, key=lambda r: r["epsilon"]))},
                soft=False)
    return {"real_frontier": f}
