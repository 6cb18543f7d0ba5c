"""benchmarks/group_stats.py: the private group GLM's intervals, power (measured and predicted before the run) and false
discoveries (measure-level simulation, 4 x 100 and 4 x 250 subjects), its false discoveries on real fMRI with random
pseudo-groups (``--part real``) and the whole pipeline on synthetic fMRI (``--part fmri``)."""

from sections import one, pick, render, table

TEMPLATE = """\
### Group statistics: coverage, power and false discoveries of the private GLM

The group GLM (`dpneuro.algorithms.glm`: one CAPE release per site of its subjects' packed sufficient statistics,
the per-site sums of the covariates and the measures, the covariates' products, X'Y and each family's sum of
squares; at the aggregator the within-site least squares of the released sums, every moment unbiased under the
noise, the noise's share of the standard error by the delta method, no bootstrap) on a measure-level simulation,
no fMRI: {m[n_sites]} sites x {m[subjects_per_site]} subjects, patient fractions {fractions}, ages uniform on 20-70,
sex 50/50; design `{m[design]}`, a level coded +1 at the level and -1 elsewhere, age mapped onto [-1, 1], an
intercept per site (every effect a within-site one); R = {m[n_components]} components, so {m[n_measures]} measures
(FNC edges: site offset N(0, {m[noise][site_offset_sd]!p}^2) + subject N(0, {m[noise][fnc_sd]!p}^2), Fisher z;
log amplitudes: subject sd {m[noise][amplitude_sd]!p}). Scenario "effects": patients' FNC shifted by 0.3 on two
edges and 0.5 on three, their log amplitude of component 1 by {m[planted][amplitude_1_group]!p}, an age slope of
{m[planted][amplitude_2_age_per_year]!p} per year on component 2's; every other contrast x measure is 0. Scenario
"null": nothing planted. {m[reps]} repetitions per method and scenario (data seed [{m[seed]}, rep], the same
subjects in both scenarios; noise seed rep), eps {epsilons} per site (headline, delta {m[delta]!p}); "no noise" is
the same fit with plan "none" (in every repetition the same estimates as OLS on the measures as the public bound
scaled them, to {ols_check}), "pooled OLS" plain OLS of the raw measures on the full design rows (the covariates
and the sites' one-hot) with t intervals. Coverage of the 95% intervals over the 3 contrasts x {m[n_measures]}
measures and over the 7 planted effects; FDR: false / all discoveries at q < 0.05 (0 without one), averaged, per
contrast (the family Benjamini-Hochberg controls; the worst of the three) and over all contrasts together; "any
false": repetitions with a false discovery (under the null, with any discovery); type-I: p < 0.05 on the null
entries; se / sd: the RMS standard error over the spread of the estimates across repetitions (null entries; 1 when
calibrated); width: the interval's width over pooled OLS's on the same data; weak directions: directions of the
within-site X'X below `glm.WEAK_DESIGN` = {m[glm_constants][WEAK_DESIGN]!p} times its noise, held there (mean
per fit; 0 when the budget resolves the design); design SNR: the smallest eigenvalue of the within-site X'X over
its noise's spectral norm (median; inf without noise); fit ms: median wall time of one fit (the sites' packing,
CAPE, the fit). Fraction of subjects whose measures the public bound scaled: {m[subjects_scaled_by_bound]!n}.

{run}

{calibration}

Power (scenario "effects") at q < 0.05 (Benjamini-Hochberg within each contrast), beside the power predicted
before the run from public quantities only: `glm.contrast_errors` (the sites' counts and patient fractions, the
plan's noise 2 z per entry of the consortium's sum, a residual sd per family of {residual_sd}, the simulation's
subject sd combined with its site offset sd), then `glm.bh_power` over the {m[predicted][n_measures]} FNC edges,
{m[predicted][n_effects]} of them planted. se FNC 0.5: the median reported se on the edges shifted by 0.5, beside
the predicted one; estimate / truth: the planted effects' mean ratio of estimate to truth (1: unbiased); noise sd:
the privacy noise's part of the se on the group contrast's FNC edges (median).

{power}

{prediction}

{verdict}

{larger}

{real}

{fmri}
"""

LARGER_TEMPLATE = """#### At {m[n_sites]} x {m[subjects_per_site]} subjects

The same simulation with {m[subjects_per_site]} subjects per site (`--subjects {m[subjects_per_site]}`; the
predictions at these counts; fraction of subjects the bound scaled {m[subjects_scaled_by_bound]!n}).

{run}

{calibration}

{power}

{prediction}
"""

PREDICTION = """The prediction from public quantities against the measured power on the planted FNC shifts, over the
{cells} private cells (eps {epsilons}, shifts 0.5 and 0.3): the measured power is below the prediction in {below} of
them, by at most {gap!n} (at {gap_where}: measured {gap_measured!n}, predicted {gap_predicted!n}); at eps 4 the
reported se on the edges shifted by 0.5 is {se_ratio!n} times the predicted one (eps 8 {se_ratio8!n})."""

REAL_TEMPLATE = """#### On real fMRI: random pseudo-groups, every null hypothesis true

The same GLM on real measures (`--part real`): the {m[people]} people of ds000140 (`benchmarks/_real_data.py`: runs
3 and 7 of a heat-pain task, {m[regions]} MIST regions, {m[volumes_per_person]} volumes each; no diagnosis labels)
split at random over {m[n_sites]} pseudo-sites of {sizes} people. R = {m[n_components]} components from the
product's own pipeline without noise (PCA and spatial ICA of the pooled regions); per person the
{m[n_measures]} measures of `subject_measures` (FNC edges centred on the people's mean FNC, relative log
amplitudes). The components only need to be realistic: what is tested is the GLM. {m[reps]} draws of pseudo-groups
independent of the data (a random half of each site's people "patients", ages uniform on 20-70, sex 50/50; labels
seed [{m[seed]}, 1, draw], noise seed the draw), design `{m[design]}`, eps {epsilons} per site (headline, delta
{m[delta]!p}). Per method: the fraction of draws with any discovery at q < 0.05 in each contrast (BH's family: under
this null its FDR) and in any of the three, the per-test type-I error (p < 0.05, nominal 0.05), the 95% intervals'
coverage of 0 (t intervals: 1 - the type-I error), the mean count of discoveries in a contrast that has any (above 1
when false discoveries come together), the RMS se over the spread of the estimates across draws, the width over
pooled OLS's, the weak design directions (of the 3 within-site directions of X'X, those below `glm.WEAK_DESIGN`
times its noise, held there; mean per fit) and the design's signal to noise (median; below 0 when the noise leaves
the released X'X with a negative eigenvalue), and the median time per fit. Fraction of people whose measures the
public bound scaled: {m[subjects_scaled_by_bound]!n}.

{run}

{table}

{verdict}
"""

REAL_VERDICT = """{headline}: the worst contrast's fraction of draws with a discovery is at most {worst!n} over the private
fits ({none[any discovery (worst contrast)]!n} without noise, {ols[any discovery (worst contrast)]!n} pooled OLS) and
the per-test type-I error at most {t1!n} ({none[type-I per test]!n}, {ols[type-I per test]!n}), against 0.05 plus
twice the Monte Carlo se of a rate of 0.05 over {reps} draws, {tol!n} (for the per-test rate, an average of
correlated tests, a loose tolerance): {verdict}. With {sizes} people per site the budget leaves {e4[floored]!n} of the
3 within-site directions weak at eps 4 ({e8[floored]!n} at eps 8; design SNR {e4[design snr]!n} and
{e8[design snr]!n}): each test alone is conservative (type-I {e4[type-I per test]!n} at eps 4, intervals
{e4[width ratio to OLS]!n} times as wide as pooled OLS's){together}
"""
#: the real part's close: whether the weak design's shared error made discoveries together, or was held back
REAL_TOGETHER = {True: ", and a contrast that loads on a weak direction reports no finding (q NaN), since an error "
                       "shared by every measure's estimate (the noise on the design's moments) would make its false "
                       "discoveries come together.",
                 False: ", but the false discoveries come together: a contrast that has one has {n} on average ({o} "
                        "for pooled OLS), as an error shared by every measure's estimate makes them (the noise on "
                        "the design's moments is one)."}

VERDICT = """\
The done-when at eps 4 and {m[n_sites]} x {m[subjects_per_site]} subjects: the intervals cover the truth at least
0.9 x 0.95 = 0.855 of the time ({cov[all]!n} over every contrast x measure, {cov[planted]!n} on the planted
effects): {verdicts[coverage]}; the FDR stays at most 0.05 up to the Monte Carlo error ({fdr[null]!n} under the null,
{fdr[effects]!n} with the planted effects, the worst contrast, against 0.05 plus two Monte Carlo se, {fdr_tol!n}; pooled
OLS, exact by construction, scores {ols_null[fdr per contrast (worst)]!n} and {ols[fdr per contrast (worst)]!n} on
the same data, the worst of three estimates being biased up): {verdicts[fdr]}. Power at eps 4 against
pooled OLS on the same data: FNC 0.5 {pw[power fnc 0.5]!n} (predicted {pw[predicted power fnc 0.5]!n}; OLS
{ols[power fnc 0.5]!n}), FNC 0.3 {pw[power fnc 0.3]!n} (predicted {pw[predicted power fnc 0.3]!n}; OLS
{ols[power fnc 0.3]!n}), amplitude group {pw[power amplitude group]!n} ({ols[power amplitude group]!n}), age slope
{pw[power amplitude age]!n} ({ols[power amplitude age]!n}), with intervals {pw[width ratio to OLS]!n} times as wide
and the planted effects estimated at {pw[planted estimate / truth]!n} times their truth on average (eps 1
{e1[planted estimate / truth]!n}, where the budget leaves {e1[floored]!n} of the 3 within-site directions weak). Over
the three contrasts together BH per contrast is not an FDR guarantee: under the null even pooled OLS makes a
discovery in {ols_null[any false discovery]!n} of the repetitions (about 1 - 0.95^3).
"""

#: the done-when's thresholds
COVERAGE_MIN, FDR_MAX, EPS = 0.9 * 0.95, 0.05, 4.0
VERDICTS = {"coverage": {True: "met", False: "not met"}, "fdr": {True: "met", False: "not met"}}

#: the real part's tolerance: the nominal rate plus MC_SE Monte Carlo standard errors of a rate of ALPHA
ALPHA, MC_SE = 0.05, 2.0
REAL_VERDICTS = {True: "met", False: "not met"}

GLANCE = {"group stats": (
    """Private group GLM ({m[n_sites]} x {m[subjects_per_site]} subjects, eps 4): 95% intervals cover the truth
    >= 0.855, FDR <= 0.05 (up to two Monte Carlo se)""",
    """coverage {cov[all]!n} (planted effects {cov[planted]!n}); FDR of the worst contrast {fdr[null]!n} under the
    null, {fdr[effects]!n} with effects; power on an FNC shift of 0.5 {pw[power fnc 0.5]!n} (predicted
    {pw[predicted power fnc 0.5]!n}) against {ols[power fnc 0.5]!n} for pooled OLS""",
    {"met": "met", "coverage": "not met: the intervals undercover", "fdr": "not met: too many false discoveries",
     "both": "not met: the intervals undercover and the FDR is above 0.05"}),
    "group stats real": (
        """Private group GLM on real fMRI ({m[people]} people, {m[n_sites]} pseudo-sites), random pseudo-groups:
        nothing significant beyond the nominal 0.05""",
        """draws with a discovery in the worst contrast at most {worst!n} at eps {epsilons} (pooled OLS
        {ols[any discovery (worst contrast)]!n}); per-test type-I at most {t1!n} (tolerance {tol!n})""",
        {"met": "met", "not met": "not met: more false discoveries than the nominal rate"})}

#: the calibration table (both scenarios) and the power table (scenario "effects")
CAL_COLUMNS = ["scenario", "method", "coverage all", "coverage planted", "fdr per contrast (worst)", "fdr all contrasts",
               "any false discovery", "type-I per test", "se / sd of estimates", "width ratio to OLS", "floored",
               "design snr", "fit ms"]
CAL_HEADER = ["scenario", "method", "coverage", "coverage planted", "FDR (worst contrast)", "FDR (all contrasts)",
              "any false", "type-I", "se / sd", "width / OLS", "weak directions", "design SNR", "fit ms"]
POWER_COLUMNS = ["method", "power fnc 0.5", "predicted power fnc 0.5", "power fnc 0.3", "predicted power fnc 0.3",
                 "se fnc 0.5", "predicted se fnc 0.5", "power amplitude group", "power amplitude age",
                 "planted estimate / truth", "width ratio to OLS", "noise sd group fnc"]
POWER_HEADER = ["method", "power FNC 0.5", "predicted", "power FNC 0.3", "predicted", "se FNC 0.5", "predicted se",
                "power amplitude group", "power age slope", "estimate / truth (planted)", "width / OLS", "noise sd"]


def _method(r) -> str:
    if r["method"] == "cape":
        return f"eps {r['epsilon']:g}"
    return "no noise" if r["method"] == "none" else r["method"]


def _tables(rows) -> dict[str, str]:
    """The calibration table (both scenarios) and the power table (scenario "effects") of one run's rows."""
    cal = [[_method(r) if k == "method" else r[k] for k in CAL_COLUMNS]
           for s in ("effects", "null") for r in pick(rows, scenario=s)]
    power = [[_method(r) if k == "method" else r[k] for k in POWER_COLUMNS] for r in pick(rows, scenario="effects")]
    return {"calibration": table(CAL_HEADER, cal), "power": table(POWER_HEADER, power)}


def _prediction(rows, meta) -> str:
    """The predicted against the measured power over the private cells, or "" without the predictions."""
    priv = [r for r in pick(rows, scenario="effects", method="cape")
            if all(isinstance(r.get(f"{k} fnc {s}"), (int, float)) for k in ("power", "predicted power")
                   for s in ("0.5", "0.3"))]
    if not priv:
        return ""
    cells = [(r["power fnc " + s] - r["predicted power fnc " + s], r, s) for r in priv for s in ("0.5", "0.3")]
    gap, worst, size = max(cells, key=lambda c: abs(c[0]))
    e4, e8 = one(priv, epsilon=EPS), one(priv, epsilon=8.0)

    def ratio(r):
        return r["se fnc 0.5"] / r["predicted se fnc 0.5"] if r else None

    return render(PREDICTION, {
        "cells": len(cells), "epsilons": ", ".join(f"{r['epsilon']:g}" for r in priv),
        "below": sum(g < 0 for g, _, _ in cells), "gap": abs(gap), "gap_where": f"eps {worst['epsilon']:g}, shift {size}",
        "gap_measured": worst["power fnc " + size], "gap_predicted": worst["predicted power fnc " + size],
        "se_ratio": ratio(e4), "se_ratio8": ratio(e8)})


def _cells(R):
    """The eps-4 cells the done-when reads, with pooled OLS's, or None when eps 4 was not measured."""
    rows = R.csv("group_stats.csv")
    meta = R.json("group_stats.json")
    eff, null = (one(rows, scenario=s, method="cape", epsilon=EPS) for s in ("effects", "null"))
    ols, ols_null = (one(rows, scenario=s, method="pooled OLS") for s in ("effects", "null"))
    if not (eff and null and ols and ols_null):
        return None
    cov = {"all": min(eff["coverage all"], null["coverage all"]), "planted": eff["coverage planted"]}
    fdr = {"null": null["fdr per contrast (worst)"], "effects": eff["fdr per contrast (worst)"]}
    se = (FDR_MAX * (1 - FDR_MAX) / eff["reps"]) ** 0.5
    ok = {"coverage": min(cov.values()) >= COVERAGE_MIN, "fdr": max(fdr.values()) <= FDR_MAX + MC_SE * se}
    return {"m": meta, "cov": cov, "fdr": fdr, "pw": eff, "ols": ols, "ols_null": ols_null, "ok": ok,
            "e1": one(rows, scenario="effects", method="cape", epsilon=1.0) or {},
            "fdr_se": se, "fdr_tol": FDR_MAX + MC_SE * se}


REAL_COLUMNS = ["method", "any discovery group", "any discovery age", "any discovery sex",
                "any discovery (worst contrast)", "any discovery (all contrasts)", "type-I per test", "coverage of 0",
                "discoveries per discovering contrast", "se / sd of estimates", "width ratio to OLS", "floored",
                "design snr", "fit ms"]
REAL_HEADER = ["method", "any discovery: group", "age", "sex", "worst contrast", "any of the three", "type-I",
               "coverage of 0", "discoveries when any", "se / sd", "width / OLS", "weak directions", "design SNR",
               "fit ms"]


def _real(R):
    """The real part's cells and verdict, or None without its results (or without eps 4 and 8, no noise, OLS)."""
    rows = R.csv("group_stats_real.csv")
    priv = pick(rows, method="cape")
    none, ols = one(rows, method="none"), one(rows, method="pooled OLS")
    e4, e8 = one(rows, method="cape", epsilon=4.0), one(rows, method="cape", epsilon=8.0)
    if not (priv and none and ols and e4 and e8):
        return None
    meta = R.json("group_stats_real.json")
    reps = min(r["reps"] for r in rows)
    tol = ALPHA + MC_SE * (ALPHA * (1 - ALPHA) / reps) ** 0.5
    # the GLM's fits (private and without noise); pooled OLS is the reference
    ok = all(r["any discovery (worst contrast)"] <= tol and r["type-I per test"] <= tol for r in [*priv, none])
    return {"m": meta, "rows": rows, "none": none, "ols": ols, "e4": e4, "e8": e8, "reps": reps, "tol": tol, "ok": ok,
            "headline": "Nothing significant beyond the nominal rate" if ok else "More discoveries than the nominal rate",
            "worst": max(r["any discovery (worst contrast)"] for r in priv),
            "t1": max(r["type-I per test"] for r in priv), "verdict": REAL_VERDICTS[ok],
            "sizes": "/".join(str(n) for n in meta["people_per_site"]),
            "epsilons": ", ".join(f"{e:g}" for e in meta["epsilons"])}


def real_section(R) -> str:
    c = _real(R)
    if c is None:
        return ""
    meta = c["m"]
    return render(REAL_TEMPLATE, {
        **c, "run": R.run(meta.get("command", "python benchmarks/group_stats.py --part real"),
                          ["group_stats_real.csv", "group_stats_real.json"], meta.get("runtime_s")),
        "table": table(REAL_HEADER, [[_method(r) if k == "method" else r[k] for k in REAL_COLUMNS] for r in c["rows"]]),
        "verdict": render(REAL_VERDICT, {**c, "together": _together(c)})})


def _together(c) -> str:
    e4, ols = c["e4"], c["ols"]
    many = e4["discoveries per discovering contrast"]
    if not isinstance(many, (int, float)):
        return REAL_TOGETHER[True]
    return REAL_TOGETHER[False].format(n=f"{many:.1f}", o=f"{ols['discoveries per discovering contrast']:.1f}")


FMRI_TEMPLATE = """#### The whole pipeline on synthetic fMRI with planted differences

`--part fmri`: the product end to end (`DecentralizedICA` with `design = "group + age + sex"`: load, capePCA, spatial
ICA, the FNC, the group statistics) on the blobs generator with planted effects (`make_consortium(effects=...)`):
sites of {sizes} subjects, patient fractions {fractions}, {m[consortium][n_components]} sources, 150 volumes; patients'
correlation between sources 0-1 and 2-3 raised by 0.5, source 4's amplitude growing with age. Each source is paired
with a component by its map; a planted edge counts as found when its group q < {m[alpha]!p}. "no noise" is the same
pipeline with plan "none"; the private run keeps the library's defaults and sets glm_epsilon 4 (its total headline eps
in the table). Seeds {seeds}.

{run}

{table}

Without noise the two planted FNC shifts and the age slope are found in {found_none} of {n} runs (and {other_none} other
edges on average, which the imperfect unmixing lets the planted shifts leak into); privately, with every stage's noise,
{found_priv} of the {planted} planted shifts are found over the {n} runs ({age_priv} age slopes), with no other
discovery in {clean_priv} of the {n} runs: at {total} subjects the group statistics find the largest differences, and
the maps agree with the truth at mean |r| {r_priv} (without noise {r_none}).
"""

FMRI_COLUMNS = ["seed", "method", "total epsilon", "planted fnc found", "planted age slope found",
                "planted fnc estimate", "planted fnc noise sd", "other group discoveries", "maps mean |r| with truth",
                "fit s"]
FMRI_HEADER = ["seed", "method", "total eps", "planted FNC found (of 2)", "age slope found", "planted FNC estimate",
               "its noise sd", "other group discoveries", "maps |r| with truth", "fit s"]


def fmri_section(R) -> str:
    rows = R.csv("group_stats_fmri.csv")
    if not rows:
        return ""
    meta = R.json("group_stats_fmri.json")
    none, priv = pick(rows, method="no noise"), [r for r in rows if r["method"] != "no noise"]
    if not none or not priv:
        return ""
    sizes = meta["consortium"]["subjects_per_site"]
    return render(FMRI_TEMPLATE, {
        "m": meta, "sizes": "/".join(str(n) for n in sizes), "total": sum(sizes),
        "fractions": ", ".join(f"{f:g}" for f in meta["consortium"]["effects"]["patients"]),
        "seeds": ", ".join(str(x) for x in meta["seeds"]), "n": len(priv), "planted": 2 * len(priv),
        "found_none": sum(r["planted fnc found"] == 2 and r["planted age slope found"] == 1 for r in none),
        "other_none": f"{sum(r['other group discoveries'] for r in none) / len(none):.1f}",
        "found_priv": sum(r["planted fnc found"] for r in priv), "age_priv": sum(r["planted age slope found"] for r in priv),
        "clean_priv": sum(r["other group discoveries"] == 0 for r in priv),
        "r_priv": f"{sum(r['maps mean |r| with truth'] for r in priv) / len(priv):.2f}",
        "r_none": f"{sum(r['maps mean |r| with truth'] for r in none) / len(none):.2f}",
        "run": R.run(meta.get("command", "python benchmarks/group_stats.py --part fmri"),
                     ["group_stats_fmri.csv", "group_stats_fmri.json"], meta.get("runtime_s")),
        "table": table(FMRI_HEADER, [[r[k] for k in FMRI_COLUMNS] for r in rows])})


#: the simulation's other sizes (subjects per site), each in group_stats_<M>.{csv,json} when run
LARGER_SIZES = (250,)


def _residual_sd(meta) -> str:
    sd = meta.get("predicted", {}).get("residual_sd", {})
    return ", ".join(f"{f} {v:.3f}" for f, v in sd.items())


def _ols_check(meta) -> str:
    diff = meta.get("ols_check", {}).get("estimate_vs_ols_scaled")
    return "1e-8" if diff is None else f"{max(diff, 1e-16):.0e} at most"


def larger_section(R) -> str:
    out = []
    for M in LARGER_SIZES:
        rows = R.csv(f"group_stats_{M}.csv")
        if not rows:
            continue
        meta = R.json(f"group_stats_{M}.json")
        out.append(render(LARGER_TEMPLATE, {
            "m": meta, **_tables(rows), "prediction": _prediction(rows, meta),
            "run": R.run(meta.get("command", f"python benchmarks/group_stats.py --subjects {M}"),
                         [f"group_stats_{M}.csv", f"group_stats_{M}.json"], meta.get("runtime_s"))}))
    return "\n\n".join(out)


def fields(R):
    rows = R.csv("group_stats.csv")
    if not rows:
        return None
    meta = R.json("group_stats.json")
    c = _cells(R)
    verdict = ""
    if c is not None:
        verdict = render(VERDICT, {**c, "verdicts": {k: VERDICTS[k][v] for k, v in c["ok"].items()}})
    return {"m": meta, "fractions": ", ".join(f"{f:g}" for f in meta["patient_fractions"]),
            "epsilons": ", ".join(f"{e:g}" for e in meta["epsilons"]), "residual_sd": _residual_sd(meta),
            "ols_check": _ols_check(meta),
            "run": R.run(meta.get("command", "python benchmarks/group_stats.py"),
                         ["group_stats.csv", "group_stats.json"], meta.get("runtime_s")),
            **_tables(rows), "prediction": _prediction(rows, meta),
            "verdict": verdict, "larger": larger_section(R), "real": real_section(R), "fmri": fmri_section(R)}


def glance(R):
    c = _cells(R)
    if c is not None:
        cov, fdr = c["ok"]["coverage"], c["ok"]["fdr"]
        yield "group stats", c, "met" if cov and fdr else "coverage" if fdr else "fdr" if cov else "both"
    r = _real(R)
    if r is not None:
        yield "group stats real", r, r["verdict"]


README = {"group_stats": (
    "On a measure-level simulation ({m[n_sites]} sites x {m[subjects_per_site]} subjects, {m[n_measures]} FNC and "
    "amplitude measures of {m[n_components]} components, design `group + age + sex`; `benchmarks/group_stats.py`, "
    "{m[reps]} repetitions) the 95 % intervals at eps 4 cover the truth {cov} of the time ({covp} on the planted "
    "effects). The false discovery rate of the q-values (BH, per contrast) is {fdr_null} under the null and {fdr_eff} "
    "with planted effects (the worst of the three contrasts; pooled OLS on the raw data {ols_fdr_null} and "
    "{ols_fdr_eff}, Monte Carlo se about {fdr_se}). The privacy costs power: patients' FNC shifts of 0.5 and 0.3 "
    "(Fisher z) are found in {p5} and {p3} of the tests (predicted before the run from public quantities: {pp5} and "
    "{pp3}), against {o5} and {o3} for pooled OLS, with intervals {w} times as wide.{larger} On real fMRI with random "
    "pseudo-groups (the {r[people]} people of ds000140 at {r[n_sites]} pseudo-sites of {sizes}, {r[reps]} draws "
    "independent of the data) the private fits at eps {epsilons} make a discovery in at most {worst} of the draws in "
    "any contrast (per-test type-I at most {t1}), against {none} without noise and {ols} for pooled OLS at a nominal "
    "0.05: {real_tail}{fmri}")}
#: the README's clause on the larger simulation, when it was run
README_LARGER = (" At {n_sites} x {subjects} subjects the same shifts are found in {p5} and {p3} of the tests at eps 2 "
                 "({w} times the width of pooled OLS's intervals).")
#: the README's close of the real part, as its verdict reads
README_REAL = {True: "with so few people per site the budget leaves the design weak ({k} of its 3 within-site "
                     "directions at eps 4), so the private fits report no finding there (q NaN), their intervals "
                     "{rw} times as wide as pooled OLS's.",
               False: "with so few people per site the noise leaves the design weak ({k} of its 3 within-site "
                      "directions at eps 4) and each test conservative (intervals {rw} times as wide as pooled OLS's), "
                      "but the false discoveries come together ({n} per discovering contrast at eps 4)."}
#: the README passage's last sentence, from the fMRI part when it was run
README_FMRI = (" End to end on the synthetic fMRI generator ({total} subjects at 4 unequal sites, `--part fmri`), the "
               "private run (glm_epsilon 4, total eps {eps}) finds {found} of {planted} planted FNC shifts over {n} "
               "seeds with no other discovery in {clean} of them; the same pipeline without noise finds {found_none}.")


def _num1(v) -> str:
    return f"{v:.1f}" if isinstance(v, (int, float)) else "none"


def readme(R):
    c, r = _cells(R), _real(R)
    if c is None or r is None:
        return {}
    ols_eff = c["ols"]

    def f2(v):
        return f"{v:.2f}"

    def f3(v):
        return f"{v:.3f}"

    fm = ""
    rows = R.csv("group_stats_fmri.csv")
    priv = [x for x in rows if x["method"] != "no noise"]
    if priv:
        sizes = R.json("group_stats_fmri.json")["consortium"]["subjects_per_site"]
        fm = README_FMRI.format(total=sum(sizes), eps=f"{priv[0]['total epsilon']:.1f}",
                                found=sum(x["planted fnc found"] for x in priv), planted=2 * len(priv), n=len(priv),
                                clean=sum(x["other group discoveries"] == 0 for x in priv),
                                found_none=sum(x["planted fnc found"] for x in rows if x["method"] == "no noise"))
    larger = ""
    for M in LARGER_SIZES:
        e2 = one(R.csv(f"group_stats_{M}.csv"), scenario="effects", method="cape", epsilon=2.0)
        if e2:
            larger += README_LARGER.format(n_sites=R.json(f"group_stats_{M}.json")["n_sites"], subjects=M,
                                           p5=f2(e2["power fnc 0.5"]), p3=f2(e2["power fnc 0.3"]),
                                           w=f"{e2['width ratio to OLS']:.1f}")
    e4 = r["e4"]
    real_tail = README_REAL[r["ok"]].format(rw=f"{e4['width ratio to OLS']:.1f}", k=f"{e4['floored']:.1f}",
                                            n=_num1(e4["discoveries per discovering contrast"]))
    return {"group_stats": {
        "fmri": fm, "larger": larger, "real_tail": real_tail, "m": c["m"], "cov": f3(c["cov"]["all"]),
        "covp": f3(c["cov"]["planted"]), "fdr_null": f3(c["fdr"]["null"]),
        "fdr_eff": f3(c["fdr"]["effects"]), "ols_fdr_null": f3(c["ols_null"]["fdr per contrast (worst)"]),
        "ols_fdr_eff": f3(ols_eff["fdr per contrast (worst)"]), "fdr_se": f3(c["fdr_se"]),
        "p5": f2(c["pw"]["power fnc 0.5"]), "p3": f2(c["pw"]["power fnc 0.3"]),
        "pp5": f2(c["pw"]["predicted power fnc 0.5"]), "pp3": f2(c["pw"]["predicted power fnc 0.3"]),
        "o5": f2(ols_eff["power fnc 0.5"]), "o3": f2(ols_eff["power fnc 0.3"]),
        "w": f"{c['pw']['width ratio to OLS']:.1f}",
        "r": r["m"], "sizes": r["sizes"], "epsilons": "1-8" if r["epsilons"] == "1, 2, 4, 8" else r["epsilons"],
        "worst": f3(r["worst"]), "t1": f3(r["t1"]), "none": f3(r["none"]["any discovery (worst contrast)"]),
        "ols": f3(r["ols"]["any discovery (worst contrast)"])}}
