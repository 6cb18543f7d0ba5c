"""benchmarks/feature_frontier.py: which features, privately (real fMRI, and the realistic generator)."""

from sections import render, table

TEMPLATE = """\
### Which features: coordinate parcels, atlases, smoothing, privately

Real fMRI: pseudo-consortia of {m[n_sites]} sites from the 33 people above ({m[window]}-volume windows), the series
painted into the MIST 122 atlas on the 6 mm grid as a site's voxel data, each subject's voxels z-scored and reduced
to the features as the product reduces them. Mean matched |r| of the maps (rendered to voxels through the features)
with nilearn's CanICA (its defaults, 6 mm smoothing, unthresholded) on the 33 people's images, and in brackets with
the same features' non-private maps; total eps in the headline sense, the planner splitting it; median of seeds
{m[seeds]}. Power's 264 ROIs are 5 mm spheres: their maps cover the spheres only. The data are constant on the MIST
regions, which flatters the MIST rows.

{run}

{table}

{synthetic}
"""

SYNTHETIC = """\
The realistic generator (20 networks, 6 mm, {m[window]} volumes): mean matched |r| with the true maps (in
brackets: with the same features' non-private maps; ceiling: the true maps reduced to the features and rendered
back, the most any map on them can reach). The atlases come from an independent cohort of the same population
({m[cohort_subjects]} other subjects, never the truth): Ward clustering (nilearn `Parcellations`) and dictionary
learning (nilearn `DictLearning`, as DiFuMo was built); seeds {m[seeds]}.

{run}

{table}"""


def feature_table(rows: list[dict], metric: str, other: str, extra: str = "") -> str:
    """One row per feature type and size: ``metric`` (``other``) at every eps[, then the ``extra`` column]."""
    eps = list(dict.fromkeys(r["epsilon"] for r in rows))
    out = []
    for (feat, M) in dict.fromkeys((r["features"], r["subjects"]) for r in rows):
        cells = {r["epsilon"]: r for r in rows if r["features"] == feat and r["subjects"] == M}
        out.append([feat, M] + [f"{cells[e][metric]} ({cells[e][other]})" if e in cells else "-" for e in eps]
                   + ([next(iter(cells.values()))[extra]] if extra else []))
    return table(["features", "subjects per site"] + [f"eps {e}" for e in eps] + ([extra] if extra else []), out)


def fields(R):
    rows = R.csv("feature_frontier.csv")
    if not rows:
        return None
    meta, syn, smeta = R.json("feature_frontier.json"), R.csv("feature_frontier_synthetic.csv"), \
        R.json("feature_frontier_synthetic.json")
    return {"m": meta, "table": feature_table(rows, "vs CanICA", "vs non-private"),
            "run": R.run("python benchmarks/feature_frontier.py", ["feature_frontier.csv", "feature_frontier.json"],
                         meta.get("runtime_s")),
            "synthetic": render(SYNTHETIC, {
                "m": smeta, "table": feature_table(syn, "vs truth", "vs non-private", "ceiling"),
                "run": R.run("python benchmarks/feature_frontier.py --synthetic",
                             ["feature_frontier_synthetic.csv", "feature_frontier_synthetic.json"],
                             smeta.get("runtime_s"))}) if syn else ""}
