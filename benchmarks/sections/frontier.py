"""benchmarks/frontier.py: realistic synthetic networks, the frontier against a known truth."""

from sections import fmt, frontier_table, one, r2

TEMPLATE = """\
### Realistic synthetic networks: the frontier against a known truth

`dpneuro.datasets.synth.network_model` (model "networks": {m[n_components]} distributed, partly bilateral, overlapping
networks; slow, correlated, near-Gaussian time courses; global signal, structured and white noise), {m[n_sites]}
sites, {m[timepoints]} volumes per subject at {m[space]}, averaged into 100 or 400 data-independent parcels. Cell:
mean matched |r| of the maps with the true networks, median of {m[seeds]} noise seeds; eps as above (total,
headline, planned). Parcel ceiling (the true maps averaged into the parcels and painted back): {ceiling}. Temporal
ICA at eps 1 is refused by the planner (40 rounds cannot share it at the ICA's per-release delta).

{run}

{table}

{fig}
"""

README = {"frontier": """\
| 4 sites x 250 subjects | 100 parcels, no noise | 100 parcels, eps 8 | 400 parcels, no noise | 400 parcels, eps 8 |
|---|---|---|---|---|
| spatial, subspaces (default) | {default} |
| spatial, second moments, bound 0.25 | {moment} |
| temporal, second moments, bound 0.25 | {temporal} |"""}


def fields(R):
    rows = R.csv("frontier.csv")
    if not rows:
        return None
    meta = R.json("frontier.json")
    return {"m": meta, "ceiling": ", ".join(f"{k} parcels {fmt(v)}" for k, v in meta.get("parcel_ceiling", {}).items()),
            "run": R.run("python benchmarks/frontier.py", ["frontier.csv", "frontier.json", "frontier.png"],
                         meta.get("runtime_s")),
            "table": frontier_table(rows, ["subjects", "ica", "parcels", "contribution", "bound"], "r_truth_median",
                                    meta.get("epsilons", [])),
            "fig": R.fig("frontier.png", "synthetic frontier")}


def readme(R):
    rows = R.csv("frontier.csv")
    if not rows:
        return {}

    def cells(ica, contribution, parcels):
        got = [r2(one(rows, subjects=250, ica=ica, parcels=p, contribution=contribution, bound=0.25,
                      epsilon=e)["r_truth_median"]) for p in parcels for e in ("none", 8.0)]
        return " | ".join(got + [""] * (4 - len(got)))

    return {"frontier": {"default": cells("spatial", "subspace", (100, 400)),
                         "moment": cells("spatial", "moment", (100, 400)),
                         "temporal": cells("temporal", "moment", (100,))}}
