"""benchmarks/strong_privacy.py: real fMRI at strong privacy, what the remaining levers buy, and what limits them."""

from sections import fmt, one, r2, render, table

TEMPLATE = """\
### Real fMRI at strong privacy: what the remaining levers buy

The real-data pseudo-consortia above at {m[n_sites]} x {m[subjects_per_site]} subjects, the default run, each lever
measured on the product's own release at the planner's `pca_epsilon` and post-processed as a run. Cells: mean
matched |r| of the private maps with the same lever's non-private maps (`own`) / with the default's non-private
maps (122 regions, 20 components; `default`), median of {m[seeds]} noise seeds. `rank r`: a subject adds the
projector on its top r directions (same norm); `weights a`: its directions weighted by their singular values to
the power a; `features g`: the regions merged into g groups by k-means of the atlas's centroids, maps painted
back; `components k`: k maps, matched to the default's best k; `public prior b`: {m[public_people]} of the
{m[people]} people stand for a public dataset and the consortium is drawn from the others, the aggregator adding b
times the public people's matrix to the release (post-processing; its cells compare with that consortium's
non-private maps, so `own` = `default`); `public data alone`: the public matrix without the release. `no noise vs
default`: the lever's non-private maps against the default's.

{run}

{table}

{limits}
"""

LIMITS = """\
What limits the default at the goals' sizes: against the same size's non-private maps, the private maps; FastICA
on the released basis started from the rotation closest to the non-private maps (where the ICA's criterion lands
from a perfect start); and two ceilings of the released 20 eigenvectors: per map, the mean over the non-private
maps of the largest |r| any map in their span reaches with it; for a rotation, the largest mean matched |r| of
maps that are a rotation of the whitened basis (the nuclear norm of the correlations between the basis and the
maps, reached by the Procrustes rotation). Every spatial ICA of the release gives such a rotation, so none agrees
more than the rotation ceiling. `random basis`: a random 20-dimensional basis instead of the release (chance).
Median of {seeds} noise seeds (rotation ceiling: also the best seed); `goal`: the issue's target for the cell.

{run}

{table}"""

#: benchmarks/real_frontier.py's verdict on the goals quotes the limits
CEILING = """\
no spatial ICA of the released basis can reach them: the best rotation of it agrees at most {cells} (best of
{seeds} seeds; benchmarks/strong_privacy.py --part limits)"""
CEILING_CELL = "{ceiling} at {subjects} per site and eps {epsilon:g} (goal {goal})"

README = {"strong_privacy": """\
What else was tried at 4 x 100 subjects (`benchmarks/strong_privacy.py`; mean |r| with the default's \
non-private maps at eps 1, 2 and 4): the default reaches {default}. A subject's top 10, 15 or 30 directions \
instead of 20, or its directions weighted by their singular values, stay within {spread} of it: the norm \
bound, not the shape of a subject's contribution, sets the noise. Fewer features (the regions merged into 40 \
groups) or fewer components (5) agree with their own non-private maps at {g40} and {k5}: the noise's edge \
grows with sqrt(D) and a component's share is 1/k, but these are coarser maps (without noise {coarse} with the \
default's). A public dataset (11 of the people; the consortium drawn from the other 22) added to the release, \
post-processing at no privacy cost, lifts the maps from {b0} to {b1}, but the public data alone give {public}: \
at eps 1 and 2 with 100 per site, public data of the same kind show a consortium's maps better than its \
private release does.{limits}"""}
README_LIMITS = """\
What limits these budgets is the release itself (`benchmarks/strong_privacy.py --part limits`): the best \
rotation of the released basis, which no spatial ICA of it can beat, agrees with the maps without noise at \
most at {c100} at 4 x 100 subjects and eps 1, 2, 4 (best of {seeds} noise draws), and at {c50} at 4 x 50 and \
eps 4. The ICA loses more below that ceiling: the noise moves FastICA's optimum, and started from the best \
rotation it lands where the default does ({guided} against {maps})."""


def fields(R):
    rows = R.csv("strong_privacy.csv")
    if not rows:
        return None
    meta = R.json("strong_privacy.json")
    eps = meta.get("epsilons", [])
    lim, lmeta = R.csv("strong_privacy_limits.csv"), R.json("strong_privacy_limits.json")
    return {"m": meta,
            "run": R.run("python benchmarks/strong_privacy.py", ["strong_privacy.csv", "strong_privacy.json"],
                         meta.get("runtime_s")),
            "table": table(["lever", "no noise vs default"] + [f"eps {e:g} own / default" for e in eps],
                           [[r["lever"], r["none_vs_default"]] + [f"{fmt(r[f'own_{e:g}'])} / {fmt(r[f'default_{e:g}'])}"
                                                                  for e in eps] for r in rows]),
            "limits": render(LIMITS, {
                "seeds": lmeta.get("seeds"),
                "run": R.run("python benchmarks/strong_privacy.py --part limits",
                             ["strong_privacy_limits.csv", "strong_privacy_limits.json"], lmeta.get("runtime_s")),
                "table": table(["subjects per site", "eps", "goal", "private maps", "FastICA from the best rotation",
                                "ceiling per map", "ceiling for a rotation (best seed)"],
                               [[r["subjects"], r["epsilon"], r["goal"], r["maps_median"], r["guided_median"],
                                 r["map_ceiling_median"],
                                 f"{fmt(r['rotation_ceiling_median'])} ({fmt(r['rotation_ceiling_max'])})"]
                                for r in lim])}) if lim else ""}


def ceiling_sentence(R) -> str:
    """The released basis' rotation ceiling at each goal's cell against the goal."""
    cells = [r for r in R.csv("strong_privacy_limits.csv") if r["goal"] != ""]
    if not cells:
        return "benchmarks/strong_privacy.py"
    return render(CEILING, {"seeds": R.json("strong_privacy_limits.json").get("seeds"), "cells": ", ".join(
        render(CEILING_CELL, {**r, "ceiling": r2(r["rotation_ceiling_max"]), "goal": r2(r["goal"])}) for r in cells)})


def readme(R):
    levers = R.csv("strong_privacy.csv")
    if not levers:
        return {}

    def at(lever, col="default"):
        r = one(levers, lever=lever)
        return ", ".join(r2(r[f"{col}_{e:g}"]) for e in (1, 2, 4))

    shape = [r for r in levers if str(r["lever"]).startswith(("rank r", "weights a"))]
    base = one(levers, lever="default")
    coarse = [one(levers, lever="features g = 40"), one(levers, lever="components k = 5")]
    f = {"default": at("default"), "g40": at("features g = 40", "own"), "k5": at("components k = 5", "own"),
         "spread": r2(max(abs(r[f"default_{e:g}"] - base[f"default_{e:g}"]) for r in shape for e in (1, 2, 4))),
         "coarse": " and ".join(r2(c["none_vs_default"]) for c in coarse), "b0": at("public prior b = 0"),
         "b1": at("public prior b = 1"), "public": r2(one(levers, lever="public data alone")["default_1"]),
         "limits": ""}
    lim = R.csv("strong_privacy_limits.csv")
    if lim:
        def lcol(subjects, col, eps=(1.0, 2.0, 4.0)):
            return ", ".join(r2(one(lim, subjects=subjects, epsilon=e)[col]) for e in eps)

        f["limits"] = "\n" + render(README_LIMITS, {
            "c100": lcol(100, "rotation_ceiling_max"), "seeds": R.json("strong_privacy_limits.json").get("seeds"),
            "c50": lcol(50, "rotation_ceiling_max", (4.0,)), "guided": lcol(100, "guided_median"),
            "maps": lcol(100, "maps_median")}, soft=False)
    return {"strong_privacy": f}
