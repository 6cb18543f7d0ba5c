"""benchmarks/group_findings.py: which planted FNC group differences the private group statistics find end to end on
the "networks" fMRI generator, against plain OLS on the same data, per total epsilon and budget split."""

from sections import fmt, pick, table

TEMPLATE = """\
### Group findings end to end: planted FNC differences on synthetic fMRI

The product end to end (`DecentralizedICA` with `design = "group + age"`: load, capePCA, spatial ICA, the FNC, the
group GLM) on the "{m[consortium][model]}" generator with planted group differences (`make_consortium(effects=...)`):
{m[consortium][n_sites]} sites of {sizes} subjects (patient fractions {fractions}, ages uniform on 20-70),
{m[consortium][n_components]} sources and components, {m[consortium][n_timepoints]} volumes, `{m[consortium][space]}`
voxels; patients' population correlation of sources {planted}. Each consortium is generated once per seed and size
and every method fits the same data: "pooled OLS" is plain OLS (numpy, t intervals, BH q over the group contrast's
{n_measures} measures) on every subject's FNC and amplitudes from the run without privacy (plan "none", reduction
"none"): the reference; "no noise" is that run's own group statistics (the library's GLM: bounded measures, no
noise); "eps E group" sets the total epsilon E (per site, headline sense, delta {m[delta]!p}) with question "group
differences" (up to three quarters of the budget's mu^2 to the GLM, the maps keeping at least half their
components), "eps 4 maps" the default split. Components are paired
with the sources by their maps and the edges named by the sources, signed by the pairs' time courses. On the group
contrast: found, the planted edges with q < {m[alpha]!p}; ratio, their estimate over pooled OLS's (own OLS: over OLS
on the same run's un-noised measures, without what the maps' noise changes); width, the median interval width over
pooled OLS's; coverage, the intervals covering pooled OLS's estimate (own OLS: the run's own); FDR, discoveries
outside the planted edges over all (a planted shift leaking into a neighbouring edge through the unmixing counts as
false); predicted power, `glm.bh_power` at pooled OLS's effect and the run's se (0 for an edge of a component below the
privacy noise, which is no finding); detectable, the run's own smallest
FNC effect found with 80 % power; scaled, the subjects whose measures the sites scaled onto the GLM's bound; fit s,
one fit's wall time. A run the planner refuses ("this budget buys no component") is counted apart. Seeds: {seeds}.

{run}

{table}

{findings}
"""

COLUMNS = ["subjects per site", "method", "runs", "refused", "found", "ratio", "ratio own OLS", "width ratio",
           "coverage", "coverage own OLS", "fdr", "predicted power", "detectable 80 fnc", "scaled by bound",
           "maps mean |r| with truth", "seconds"]
HEADER = ["subjects / site", "method", "runs", "refused", "found", "ratio", "ratio own OLS", "width", "coverage",
          "coverage own OLS", "FDR", "predicted power", "detectable", "scaled", "maps \\|r\\|", "fit s"]


def _seeds(seeds: list[int]) -> str:
    return f"{seeds[0]}-{seeds[-1]}" if len(seeds) > 2 and seeds == list(range(seeds[0], seeds[-1] + 1)) else \
        ", ".join(str(s) for s in seeds)


def _f2(v) -> str:
    return f"{v:.2f}" if isinstance(v, (int, float)) else "-"


def findings(rows: list[dict], meta: dict) -> str:
    """What the table says, per size: the reference, the refusals, each private method."""
    out = []
    for size in dict.fromkeys(r["subjects per site"] for r in rows):
        mine = pick(rows, **{"subjects per site": size})
        ols, none = (next(iter(pick(mine, method=m)), None) for m in ("pooled OLS", "no noise"))
        if ols is None:
            continue
        text = (f"At {size} subjects per site pooled OLS finds {_f2(ols['found'])} of the planted edges over "
                f"{ols['runs']} seed{'s' if ols['runs'] != 1 else ''} (FDR {_f2(ols['fdr'])}, maps |r| {_f2(ols['maps mean |r| with truth'])})")
        if none is not None:
            text += (f"; the library's GLM without noise finds {_f2(none['found'])}, its planted estimates "
                     f"{_f2(none['ratio'])} times OLS's, with {_f2(none['scaled by bound'])} of the subjects' "
                     "measures scaled onto the bound")
        sentences = [text + "."]
        refused = [r for r in mine if r["refused"]]
        if refused:
            sentences.append("The planner refuses " + ", ".join(
                f"{r['method']} ({r['refused']} of {r['runs'] + r['refused']} seeds)" for r in refused)
                + ": this budget buys no component.")
        for r in mine:
            if r["method"] in ("pooled OLS", "no noise") or not r["runs"]:
                continue
            sentences.append(
                f"`{r['method']}` (glm eps {fmt(r['glm epsilon'])}) finds {_f2(r['found'])} "
                f"(predicted power {_f2(r['predicted power'])}), its planted estimates {_f2(r['ratio'])} times "
                f"OLS's ({_f2(r['ratio own OLS'])} of its own OLS's), intervals {_f2(r['width ratio'])} times as "
                f"wide covering OLS's estimate {_f2(r['coverage'])} of the time ({_f2(r['coverage own OLS'])} its "
                f"own), FDR {_f2(r['fdr'])}, maps |r| {_f2(r['maps mean |r| with truth'])}.")
        out.append(" ".join(sentences))
    return "\n\n".join(out)


def fields(R):
    rows = R.csv("group_findings.csv")
    if not rows:
        return None
    meta = R.json("group_findings.json")
    con = meta["consortium"]
    shifts = con["effects"]["fnc_shift"]
    return {"m": meta, "sizes": " or ".join(str(p["subjects_per_site"]) for p in meta["plan"]),
            "fractions": ", ".join(f"{f:g}" for f in con["effects"]["patients"]),
            "planted": " and ".join(f"{j}-{k} {'raised' if d > 0 else 'lowered'} by {abs(d):g}" for j, k, d in shifts),
            "n_measures": con["n_components"] * (con["n_components"] - 1) // 2 + con["n_components"],
            "seeds": "; ".join(f"{p['subjects_per_site']} subjects per site: seeds {_seeds(p['seeds'])} "
                               f"({', '.join(p['methods'])})" for p in meta["plan"]),
            "run": R.run(meta.get("command", "python benchmarks/group_findings.py"),
                         ["group_findings.csv", "group_findings.json"], meta.get("runtime_s")),
            "table": table(HEADER, [[r[k] for k in COLUMNS] for r in rows]),
            "findings": findings(rows, meta)}
