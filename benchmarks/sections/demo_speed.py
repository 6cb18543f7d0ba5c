"""benchmarks/demo_speed.py: `dpneuro demo` end to end."""

from sections import fmt, r2, render, table

TEMPLATE = """\
### End-to-end `dpneuro demo`

{body}
"""

MEASURED = """\
`dpneuro demo` in a fresh process and folder: synthesize a 4-site consortium and run the whole private analysis
({stages}) with the library's defaults. qNGI exists for temporal ICA only (the truth's sources are temporal).

{run}

{table}"""
NOT_MEASURED = "Not measured in this snapshot (see the report that accompanies it)."
STAGES = "load, capePCA, unmixing, maps, report"

GLANCE = {"demo": ("`dpneuro demo` end to end{size}",
                   """{d[median_wall_s]!n} s; mean |r| with truth {d[mean_abs_r]!n}{qngi} at total epsilon per site
                   {eps} (against the aggregator and its colluders)""",
                   {"measured": "measured"})}
SIZE = {True: " ({d[sites]} sites x {d[subjects_per_site]} subjects, {d[space]}, private)", False: " (private)"}
QNGI = ", qNGI {q!n}"

README = {"demo": """\
The demo (4 sites x 32 subjects, 6 mm MNI grid averaged into 100
data-independent parcels, 8 components) recovers maps that correlate {r} on
average with the truth (each site's own voxel maps, below, {site}) at eps = {eps:g} per
site against the aggregator colluding with one site (delta = 1e-5, exact Gaussian-DP
composition, replace-one-subject neighbours; at most {alone:.1f} for someone who sees
one site's releases alone; `benchmarks/demo_speed.py`)."""}


def fields(R):
    d = R.json("demo_speed.json")
    if not d:
        return {"body": NOT_MEASURED}
    return {"body": render(MEASURED, {
        "stages": d.get("stages") or STAGES,
        "run": R.run(f"python benchmarks/demo_speed.py --repeats {d.get('repeats')}", ["demo_speed.json"],
                     sum(d.get("wall_s", [])) or None),
        "table": table(["repeats", "median wall s", "peak RSS MB", "mean abs r with truth", "qNGI",
                        "epsilon per site (vs aggregator + colluders)"],
                       [[d.get("repeats"), d.get("median_wall_s"), d.get("peak_rss_mb"), d.get("mean_abs_r"),
                         d.get("qngi"), ", ".join(fmt(x) for x in d.get("epsilon", []))]])})}


def glance(R):
    d = R.json("demo_speed.json")
    if d:
        yield "demo", {"d": d, "size": render(SIZE[d.get("sites") is not None], {"d": d}),
                       "qngi": render(QNGI, {"q": d["qngi"]}) if d.get("qngi") is not None else "",
                       "eps": ", ".join(fmt(e) for e in sorted(set(d.get("epsilon", []))))}, "measured"


def readme(R):
    d = R.json("demo_speed.json")
    if not d:
        return {}
    return {"demo": {"r": r2(d["mean_abs_r"]), "site": r2(d["site_maps_mean_abs_r"]), "eps": max(d["epsilon"]),
                     "alone": max(d["epsilon_one_site_alone"])}}
