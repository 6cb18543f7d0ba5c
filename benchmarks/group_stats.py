"""Private group statistics: do the GLM's intervals cover the truth, and what does the privacy cost in power?

A measure-level simulation (no fMRI): 4 sites x 100 subjects (``--subjects``;
``--subjects 250`` writes group_stats_250.*) with unequal patient fractions
(0.3, 0.4, 0.5, 0.6), ages uniform on 20-70, sex 50/50. Design
``group + age + sex`` (public age range [20, 70]): a design row is the
covariate columns (a level +1 at the level and -1 elsewhere, age mapped onto
[-1, 1]) followed by a one-hot of the site, an intercept per site, so every
effect is a within-site one. Each subject has R = 10 components' measures:
Q = 45 FNC edges (a site offset N(0, 0.1^2) per site and edge, plus
N(0, 0.2^2) per subject: Fisher-z deviations from the consortium's mean) and
10 log amplitudes (site offset N(0, 0.1^2), per subject N(0, 0.15^2)).

Scenarios (the same subjects and noise seeds in both):

- ``effects``: patients' FNC shifted on 5 edges (0.3 on two, 0.5 on three,
  Fisher z), patients' log amplitude of component 1 shifted by 0.2, and an age
  slope of 0.006 per year on the log amplitude of component 2 (centred at 45);
  every other contrast x measure is 0;
- ``null``: nothing planted.

Each repetition fits the model (``dpneuro.algorithms.glm.GLMSettings.run``:
one CAPE release per site, the within-site least squares of the released sums,
its noise's variance by the delta method) at eps 1, 2, 4, 8 (CAPE, delta 1e-5,
per site against the headline adversary), without noise (``plan="none"``) and
as plain pooled OLS on every subject's raw data (numpy: Y on the full design
row, covariates and the sites' one-hot; each contrast's coefficient times its
factor to per unit; t intervals with N - p degrees of freedom, BH q-values per
contrast, as the GLM). Every repetition checks that the fit without noise is
that OLS on the measures as the public bound scaled them (the same estimates
to 1e-8; its se pools each family's residual variance, so it differs slightly
from per-measure OLS's). Per method, over the repetitions: the intervals'
coverage of the truth (all 3 contrasts x 55 measures; the 7 planted effects
alone), the power on the planted effects (q < 0.05, Benjamini-Hochberg within
each contrast) beside the power predicted before the run from public
quantities (``glm.contrast_errors`` at the plan's noise, 2 z per entry of the
consortium's sum, the sites' counts and patient fractions, and the simulation's
residual sd per family, the subject's sd combined with the site offset's,
sqrt(0.2^2 + 0.1^2) for FNC; then ``glm.bh_power`` over the 45 FNC edges, 5 of
them planted), the false discovery rate (false / all discoveries at q < 0.05,
0 without a discovery, averaged over the repetitions) of each contrast, the
family BH controls (the worst of the three is reported), and over every
contrast x measure together, the rate of repetitions with a false discovery
(under the null: with any discovery), the per-test type-I error (p < 0.05 on
the null entries), the calibration of the standard errors (RMS se over the
repetitions / sd of the estimates over the repetitions, averaged over the null
entries: 1 when the se is right), the mean ratio of the interval's width to
pooled OLS's, the planted effects' mean ratio of estimate to truth (1:
unbiased), the median reported se on the FNC edges shifted by 0.5 beside the
predicted one, the weak design directions (``floored``: directions of the
within-site X'X below ``glm.WEAK_DESIGN`` times its noise, held there; 0 in a
design the budget resolves) and the design's signal to noise (``design_snr``,
median), and the median time per fit.

Part ``real`` (``--part real``): real fMRI under the null. The 33 people of
``benchmarks/_real_data.py`` (ds000140, runs 3 and 7, 122 MIST regions, 382
volumes each; no diagnosis labels) split at random (seed 2024) over 4
pseudo-sites (9, 8, 8, 8). Their R = 10 components come from the product's
own pipeline without noise (``reduce_inprocess`` / ``unmix_inprocess`` of
``dpneuro.run.stages``: PCA and spatial ICA of the pooled regions, each region
z-scored per run as ``real_frontier.py`` prepares them), each person's time
courses from the run's whitened data and unmixing; the measures are
``subject_measures`` (45 FNC edges centred on the 33 people's mean FNC, 10
relative log amplitudes). The components only need to be realistic: what is
tested is the GLM on real measures. Each repetition draws pseudo-groups
independent of the data (stream ``default_rng([2024, 1, rep])``): a random
half of each site's people are "patients", ages uniform on 20-70, sex 50/50;
the same design and methods as above. Every null hypothesis is true, so per
method: the rate of repetitions with any discovery at q < 0.05 in each
contrast (BH's family; under this null its FDR), the per-test type-I error at
p < 0.05 (nominal 0.05), the 95 % intervals' coverage of 0 (t intervals:
1 - the type-I error), the mean count of discoveries in a contrast that has
any (above 1 when false discoveries come together), the se against the
spread of the estimates over the repetitions, the width over pooled OLS's,
the weak design directions (``floored``, of the 3 within-site directions)
and the design's signal to noise (median), and the median time per fit.

Part ``fmri`` (``--part fmri``): the whole pipeline (``DecentralizedICA`` with a design) on the synthetic
fMRI generator with planted group differences (``make_consortium(effects=...)``: sites of 80/100/120/100
subjects, patient fractions 0.3-0.6, patients' correlation between sources 0-1 and 2-3 raised by 0.5, an
age slope on source 4's amplitude), without noise and privately (the defaults and glm_epsilon 4), 3 seeds:
which planted effects are found (sources paired with components by their maps).

    python benchmarks/group_stats.py                  # full simulation, 4 x 100: 500 repetitions (~4 min on 2 cores)
    python benchmarks/group_stats.py --subjects 250   # the same at 4 x 250 (group_stats_250.*; ~4.5 min)
    python benchmarks/group_stats.py --part real      # full real part: 500 repetitions (~1.5-2 min)
    python benchmarks/group_stats.py --part fmri      # the whole pipeline, 3 seeds (~1 min)
    python benchmarks/group_stats.py --quick          # smoke run of every part: 10 repetitions (~30-45 s; writes
                                                      # *_quick.*); --part sim, real or fmri for one of them

Writes benchmarks/results/group_stats.{csv,json} (simulation; group_stats_<M>.* at M subjects per site other
than 100), group_stats_real.{csv,json} (real part) and group_stats_fmri.{csv,json} (fMRI part).
"""

from __future__ import annotations

import argparse
import hashlib
import math
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import write_results  # noqa: E402

from dpneuro.algorithms import glm  # noqa: E402
from dpneuro.algorithms.glm import Design, GLMSettings, pack_statistics, parse_design, subject_measures  # noqa: E402
from dpneuro.algorithms.subject_mean import clip_subjects  # noqa: E402

#: the version of the GLM measured: its source as imported (a later edit of the file does not change this run)
GLM_SHA256 = hashlib.sha256((Path(__file__).resolve().parents[1] / "dpneuro" / "algorithms" / "glm.py")
                            .read_bytes()).hexdigest()

SEED = 2024
N_SITES = 4
#: the default subjects per site; another size writes group_stats_<M>.*
DEFAULT_SUBJECTS = 100
PATIENT_FRACTIONS = (0.3, 0.4, 0.5, 0.6)
N_COMPONENTS = 10
MEASURES = ("fnc", "amplitude")
EPSILONS = (1.0, 2.0, 4.0, 8.0)
DELTA = 1e-5
ALPHA = 0.05
LEVEL = 0.95
FNC_SD, AMP_SD, SITE_SD = 0.2, 0.15, 0.1
AGE_RANGE = (20.0, 70.0)
#: planted effects: (label, contrast row, measure column, size per unit of the contrast)
FNC_EDGES = {0: 0.3, 12: 0.3, 20: 0.5, 31: 0.5, 44: 0.5}  # edge index (of 45) -> patients' shift (Fisher z)
AMP_GROUP, AMP_AGE = 0.2, 0.006  # patients' shift of log amplitude 1; slope per year of log amplitude 2
#: the fit without noise is OLS on the bound-scaled measures: its estimates agree to this (else the run stops)
OLS_TOLERANCE = 1e-8
#: the table's columns
KEYS = ["scenario", "method", "epsilon", "reps", "coverage all", "coverage planted", "power fnc 0.3",
        "predicted power fnc 0.3", "power fnc 0.5", "predicted power fnc 0.5", "power amplitude group",
        "power amplitude age", "fdr per contrast (worst)", "fdr all contrasts", "any false discovery",
        "type-I per test", "se / sd of estimates", "width ratio to OLS", "planted estimate / truth",
        "se fnc 0.5", "predicted se fnc 0.5", "noise sd group fnc", "floored", "design snr", "fit ms"]
#: the columns averaged over the repetitions (the others: counts, medians, predictions)
MEANS = ["coverage all", "coverage planted", "power fnc 0.3", "power fnc 0.5", "power amplitude group",
         "power amplitude age", "fdr all contrasts", "any false discovery", "type-I per test", "width ratio to OLS",
         "planted estimate / truth", "floored"]
MEDIANS = ["se fnc 0.5", "noise sd group fnc", "design snr"]


def make_design() -> Design:
    covs = parse_design("group + age + sex", {"group": ["control", "patient"], "age": list(AGE_RANGE),
                                             "sex": ["F", "M"]})
    return Design(covs, tuple(f"site-{i + 1}" for i in range(N_SITES)))


def truth(settings: GLMSettings, planted: bool) -> np.ndarray:
    """The true value of every contrast (group, age per year, sex) on every measure: C x Q."""
    fam = settings.families
    T = np.zeros((3, settings.n_measures))
    if planted:
        for e, size in FNC_EDGES.items():
            T[0, fam["fnc"].start + e] = size
        T[0, fam["amplitude"].start + 0] = AMP_GROUP
        T[1, fam["amplitude"].start + 1] = AMP_AGE
    return T


def planted_groups(settings: GLMSettings) -> dict[str, list[tuple[int, int]]]:
    """The planted entries (contrast, measure) by kind, for the power columns."""
    fam = settings.families
    return {"power fnc 0.3": [(0, fam["fnc"].start + e) for e, s in FNC_EDGES.items() if s == 0.3],
            "power fnc 0.5": [(0, fam["fnc"].start + e) for e, s in FNC_EDGES.items() if s == 0.5],
            "power amplitude group": [(0, fam["amplitude"].start)],
            "power amplitude age": [(1, fam["amplitude"].start + 1)]}


def simulate(design: Design, settings: GLMSettings, M: int, rep: int, planted: bool
             ) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every site's (X, Y) for repetition ``rep``: the same subjects and noise in both scenarios. A measure is
    its site's offset (N(0, SITE_SD^2), one per site and measure) plus the subject's own deviation (N(0, FNC_SD^2)
    or N(0, AMP_SD^2)) plus the planted effects (patients' shift, 0 for controls; the age slope from 45)."""
    rng = np.random.default_rng([SEED, rep])
    fam, Q = settings.families, settings.n_measures
    n_fnc = fam["fnc"].stop - fam["fnc"].start
    T = truth(settings, planted)
    sites = []
    for s, frac in enumerate(PATIENT_FRACTIONS):
        patient = rng.random(M) < frac
        age = rng.uniform(*AGE_RANGE, M)
        male = rng.random(M) < 0.5
        values = [{"group": "patient" if g else "control", "age": repr(float(a)), "sex": "M" if m else "F"}
                  for g, a, m in zip(patient, age, male)]
        X, _ = design.rows(values, s)
        offset = rng.normal(0.0, SITE_SD, Q)
        noise = np.concatenate([rng.normal(0.0, FNC_SD, (M, n_fnc)), rng.normal(0.0, AMP_SD, (M, Q - n_fnc))], 1)
        Y = offset + noise + patient[:, None] * T[0] + (age - np.mean(AGE_RANGE))[:, None] * T[1] + male[:, None] * T[2]
        sites.append((X, Y))
    return sites


def pooled_ols(design: Design, sites) -> dict[str, np.ndarray]:
    """Plain OLS on every subject's raw data: Y on the full design row (the covariate columns and the site's
    one-hot, which holds the sites' intercepts), each contrast's coefficient times its factor to per unit; t
    intervals and p-values (N - p dof), BH q-values per contrast."""
    X = np.vstack([x for x, _ in sites])
    Y = np.vstack([y for _, y in sites])
    N, p = X.shape
    XtX_inv = np.linalg.inv(X.T @ X)
    beta = XtX_inv @ (X.T @ Y)
    resid = Y - X @ beta
    sigma2 = (resid**2).sum(0) / (N - p)
    cols = [j for _, j, _ in design.contrasts()]
    unit = np.array([u for _, _, u in design.contrasts()])[:, None]
    est = beta[cols] * unit
    se = np.sqrt(np.diag(XtX_inv)[cols][:, None] * sigma2[None, :]) * unit
    tq = stats.t.ppf(1 - (1 - LEVEL) / 2, N - p)
    pval = 2 * stats.t.sf(np.abs(est / se), N - p)
    return {"estimate": est, "se": se, "ci_low": est - tq * se, "ci_high": est + tq * se, "p": pval,
            "q": np.array([stats.false_discovery_control(row, method="bh") for row in pval]), "noise_sd": np.zeros_like(est)}


def bound_scaled(sites, families) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every site's (X, Y) with each subject's measures scaled onto their family's public bound, as
    ``pack_statistics`` scales them."""
    bounds = glm.family_bounds(families)
    out = []
    for X, Y in sites:
        Y = np.array(Y, np.float64)
        for m, sl in families.items():
            Y[:, sl] = clip_subjects(Y[:, sl], bounds[m])[0]
        out.append((X, Y))
    return out


#: every method a repetition fits: the private GLM at each eps, the same fit without noise, pooled OLS
METHODS = [("cape", e) for e in EPSILONS] + [("none", None), ("pooled OLS", None)]


def method_fits(design: Design, sites, rep: int, ledger_eps: dict, checks: dict):
    """Each of :data:`METHODS` fitted on ``sites`` (noise seed ``rep``): (plan, eps, fit, seconds, pooled OLS's
    interval widths); the first fit at each eps records its ledgers' headline in ``ledger_eps``. The fit without
    noise is checked against OLS on the bound-scaled measures (``checks``: the largest differences seen)."""
    t = time.perf_counter()
    ols = pooled_ols(design, sites)
    ols_time = time.perf_counter() - t
    width = ols["ci_high"] - ols["ci_low"]
    for plan, eps in METHODS:
        if plan == "pooled OLS":
            yield plan, eps, ols, ols_time, width
            continue
        st = GLMSettings(design, MEASURES, N_COMPONENTS, eps, delta=DELTA, plan=plan, random_state=rep, level=LEVEL)
        t = time.perf_counter()
        fit = st.run(sites)
        dt = time.perf_counter() - t
        if eps is not None and eps not in ledger_eps:
            ledger_eps[eps] = max(led.epsilon(DELTA, collusion=True) for led in fit["ledgers"])
        if plan == "none":
            exact = pooled_ols(design, bound_scaled(sites, st.families))
            diff = float(np.abs(fit["estimate"] - exact["estimate"]).max())
            if diff > OLS_TOLERANCE:
                raise RuntimeError(f"the fit without noise is not OLS on the bound-scaled measures: {diff:.3g}")
            ratio = fit["se"] / exact["se"]
            checks["estimate_vs_ols_scaled"] = max(checks.get("estimate_vs_ols_scaled", 0.0), diff)
            checks["estimate_vs_ols_raw"] = max(checks.get("estimate_vs_ols_raw", 0.0),
                                                float(np.abs(fit["estimate"] - ols["estimate"]).max()))
            checks["se_ratio_min"] = min(checks.get("se_ratio_min", math.inf), float(ratio.min()))
            checks["se_ratio_max"] = max(checks.get("se_ratio_max", 0.0), float(ratio.max()))
        yield plan, eps, fit, dt, width


def predictions(design: Design, M: int) -> tuple[dict, dict]:
    """The power each method is predicted to have on the planted FNC shifts, before the run and from public
    quantities: the se ``glm.contrast_errors`` gives (the sites' counts and patient fractions, the plan's noise
    2 z per entry of the consortium's sum, 0 without noise; each family's residual sd as the simulation makes it,
    the subject's sd combined with the site offset's), then ``glm.bh_power`` over the 45 FNC edges, 5 of them
    planted. Returns {(plan, eps): columns} (pooled OLS: the prediction without noise) and what was assumed."""
    fractions = [{"group": f, "sex": 0.5} for f in PATIENT_FRACTIONS]
    residual_sd = {"fnc": math.hypot(FNC_SD, SITE_SD), "amplitude": math.hypot(AMP_SD, SITE_SD)}
    n_fnc, n_effects = N_COMPONENTS * (N_COMPONENTS - 1) // 2, len(FNC_EDGES)
    out = {}
    for plan, eps in METHODS:
        if plan == "pooled OLS":
            out[plan, eps] = out["none", None]
            continue
        st = GLMSettings(design, MEASURES, N_COMPONENTS, eps, delta=DELTA, plan=plan, level=LEVEL)
        z = st.algorithm(n_sites=N_SITES).z if plan != "none" else 0.0
        f = list(st.families).index("fnc")
        row = {}
        for size in sorted(set(FNC_EDGES.values())):
            se = float(glm.contrast_errors(st, [M] * N_SITES, noise_sd=2 * z, residual_sd=residual_sd,
                                           fractions=fractions, effect=size, **({} if z else {"draws": 1}))[0, f])
            row[f"predicted se fnc {size:g}"] = se
            row[f"predicted power fnc {size:g}"] = glm.bh_power(size, se, n_fnc, n_effects=n_effects)
        out[plan, eps] = row
    how = {"function": "glm.contrast_errors(settings, [M] * 4, noise_sd=2 z, residual_sd, fractions, effect=size)"
                       "[group, fnc] then glm.bh_power(size, se, 45, n_effects=5)",
           "z": "settings.algorithm(n_sites=4).z (0 without noise)", "residual_sd": residual_sd,
           "fractions": fractions, "n_measures": n_fnc, "n_effects": n_effects,
           "values": {f"{p} {'' if e is None else e}".strip(): v for (p, e), v in out.items()}}
    return out, how


def fdp(false: np.ndarray, disc: np.ndarray) -> float:
    """The false discovery proportion: false / all discoveries, 0 without a discovery."""
    return float(false.sum() / disc.sum()) if disc.any() else 0.0


def score(fit: dict, T: np.ndarray, groups: dict, ols_width: np.ndarray) -> dict[str, float]:
    """One fit's coverage, discoveries and widths against the truth ``T``."""
    lo, hi = fit["ci_low"], fit["ci_high"]
    covered = (lo <= T) & (T <= hi)
    nonzero = T != 0
    disc = fit["q"] < ALPHA
    false = disc & ~nonzero
    out = {"_estimate": fit["estimate"], "_se": fit["se"], "_fdr": [fdp(f, d) for f, d in zip(false, disc)],
           "coverage all": covered.mean(), "fdr all contrasts": fdp(false, disc),
           "any false discovery": float(false.any()), "type-I per test": (fit["p"][~nonzero] < ALPHA).mean(),
           "width ratio to OLS": ((hi - lo) / ols_width).mean(),
           "noise sd group fnc": float(np.median(fit["noise_sd"][0, :45]))}
    if "floored" in fit:
        out["floored"], out["design snr"] = float(fit["floored"]), float(fit["design_snr"])
    if nonzero.any():
        out["coverage planted"] = covered[nonzero].mean()
        out["planted estimate / truth"] = (fit["estimate"][nonzero] / T[nonzero]).mean()
        out["se fnc 0.5"] = float(np.median([fit["se"][c] for c in groups["power fnc 0.5"]]))
        for key, cells in groups.items():
            out[key] = np.mean([disc[c] for c in cells])
    return out


def environment() -> dict:
    return {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "load_average": list(os.getloadavg())}


def glm_constants() -> dict:
    """The GLM's public constants this run measured."""
    return {"SHARES": glm.SHARES, "WEAK_DESIGN": glm.WEAK_DESIGN, "FAMILY_RMS": glm.FAMILY_RMS}


def result_name(M: int, quick: bool) -> str:
    """group_stats at the default size, group_stats_<M> at another; *_quick for a smoke run."""
    return "group_stats" + ("" if M == DEFAULT_SUBJECTS else f"_{M}") + ("_quick" if quick else "")


def simulation(args, given: list[str]) -> None:
    """The measure-level simulation: group_stats{,_<M>}{,_quick}.{csv,json}."""
    reps = args.reps or (10 if args.quick else 500)
    M = args.subjects
    t0, cpu0 = time.perf_counter(), time.process_time()
    design = make_design()
    acc: dict[tuple, list[dict]] = {}
    times: dict[tuple, list[float]] = {}
    scaled, ledger_eps, checks = [], {}, {}
    ref = GLMSettings(design, MEASURES, N_COMPONENTS, None, plan="none")  # the measures' layout
    predicted, predicted_how = predictions(design, M)
    print(f"  predictions: {time.perf_counter() - t0:.1f} s", flush=True)
    for rep in range(reps):
        for scenario in ("effects", "null"):
            planted = scenario == "effects"
            sites = simulate(design, ref, M, rep, planted)
            T, groups = truth(ref, planted), planted_groups(ref)
            scaled.append(sum(pack_statistics(X, Y, design, ref.families)[1] for X, Y in sites) / (N_SITES * M))
            for plan, eps, fit, dt, width in method_fits(design, sites, rep, ledger_eps, checks):
                acc.setdefault((scenario, plan, eps), []).append(score(fit, T, groups, width))
                times.setdefault((scenario, plan, eps), []).append(dt)
        if (rep + 1) % max(1, reps // 10) == 0:
            print(f"  {rep + 1}/{reps} repetitions, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (scenario, plan, eps), got in acc.items():
        row = {k: "" for k in KEYS}
        row.update({"scenario": scenario, "method": plan, "epsilon": "" if eps is None else eps, "reps": len(got)})
        for k in MEANS:
            vals = [g[k] for g in got if k in g]
            row[k] = float(np.mean(vals)) if vals else ""
        for k in MEDIANS:
            vals = [g[k] for g in got if k in g]
            row[k] = float(np.median(vals)) if vals else ""
        if scenario == "effects":
            row.update({k: v for k, v in predicted[plan, eps].items() if k in KEYS})
        # BH runs within each contrast: its FDR is each contrast's, the worst of the three here
        row["fdr per contrast (worst)"] = float(np.max(np.mean([g["_fdr"] for g in got], axis=0)))
        # the reported se against the spread of the estimates over the repetitions, on the entries that are null
        # in this scenario (their truth is the same in every repetition)
        est, se = np.array([g["_estimate"] for g in got]), np.array([g["_se"] for g in got])
        null = truth(ref, scenario == "effects") == 0
        row["se / sd of estimates"] = float(np.mean(np.sqrt((se**2).mean(0))[null] / est.std(0, ddof=1)[null]))
        row["fit ms"] = 1000 * statistics.median(times[scenario, plan, eps])
        rows.append(row)
    print()
    print(" | ".join(KEYS))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in KEYS))
    meta = {"command": " ".join(["python benchmarks/group_stats.py", *given]),
            "n_sites": N_SITES, "subjects_per_site": M, "patient_fractions": list(PATIENT_FRACTIONS),
            "n_components": N_COMPONENTS, "n_measures": ref.n_measures, "design": "group + age + sex (+ site)",
            "columns": list(design.columns), "contrasts": [c for c, _, _ in design.contrasts()],
            "epsilons": list(EPSILONS), "delta": DELTA, "plan": "cape", "level": LEVEL, "alpha": ALPHA,
            "reps": reps, "seed": SEED,
            "seeds": {"data": f"numpy default_rng([{SEED}, rep]), rep = 0..{reps - 1} (same subjects in both "
                              "scenarios)", "noise": "GLMSettings(random_state=rep) (same at every eps)"},
            "noise": {"fnc_sd": FNC_SD, "amplitude_sd": AMP_SD, "site_offset_sd": SITE_SD},
            "planted": {"fnc_group_edges": {str(k): v for k, v in FNC_EDGES.items()}, "amplitude_1_group": AMP_GROUP,
                        "amplitude_2_age_per_year": AMP_AGE},
            "predicted": predicted_how,
            "ols_check": {"what": "the fit without noise (plan none) against OLS of the bound-scaled measures on the "
                                  "full design rows: largest |estimate difference| (the run stops above "
                                  f"{OLS_TOLERANCE:g}), and against OLS of the raw measures (the bound's scaling); "
                                  "the range of se(fit) / se(OLS): the fit pools each family's residual variance",
                          **checks},
            "subjects_scaled_by_bound": float(np.mean(scaled)),
            "ledger_epsilon_headline": {str(k): v for k, v in ledger_eps.items()},
            "environment": environment(),
            "glm_py_sha256": GLM_SHA256, "glm_constants": glm_constants(),
            "runtime_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
    write_results(result_name(M, args.quick), rows, meta, keys=KEYS)


# -- part "real": real fMRI, random pseudo-groups (every null hypothesis true) ------------------------------

REAL_SITES = 4
#: the real part's label draws: default_rng([SEED, REAL_STREAM, rep]) (the simulation's are [SEED, rep])
REAL_STREAM = 1
#: the real part's table
REAL_KEYS = ["method", "epsilon", "reps", "any discovery group", "any discovery age", "any discovery sex",
             "any discovery (worst contrast)", "any discovery (all contrasts)", "type-I per test", "coverage of 0",
             "discoveries per discovering contrast", "se / sd of estimates", "width ratio to OLS", "floored",
             "design snr", "fit ms"]
#: the contrasts' short names, in the order of Design.contrasts()
CONTRASTS = ("group", "age", "sex")


def real_measures() -> tuple[dict, list[np.ndarray], list[np.ndarray], dict]:
    """The 33 real people at 4 pseudo-sites: the data's description, each site's people (indices), each site's
    measures (people x Q) and how the components were computed."""
    from frontier import base_config
    from real_frontier import real_subjects

    from dpneuro.algorithms.djica import time_courses
    from dpneuro.run.roles import unmixing_input
    from dpneuro.run.stages import reduce_inprocess, unmix_inprocess

    d, runs = real_subjects()
    people = np.array_split(np.random.default_rng(SEED).permutation(len(runs)), REAL_SITES)
    X_sites = [np.hstack([np.hstack(runs[i]) for i in g]).astype(np.float32) for g in people]
    lengths = [[sum(r.shape[1] for r in runs[i]) for i in g] for g in people]
    t = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="dpneuro-glm-real-") as tmp:
        cfg = base_config(Path(tmp), REAL_SITES, n_components=N_COMPONENTS, plan="none", parcels=0, seed=0)
        red = reduce_inprocess(cfg, X_sites, lengths)
        unm = unmix_inprocess(cfg, X_sites, lengths, red.basis, red.eigenvalues)
        S = [time_courses(unm.W, unmixing_input(cfg, X, red.basis, red.eigenvalues), unm.b) for X in X_sites]
    seconds = time.perf_counter() - t
    # the FNC's public centre: the 33 people's mean FNC (what the run's private FNC estimates)
    centre = np.vstack([subject_measures(s, ln, ("fnc",))[0] for s, ln in zip(S, lengths)]).mean(axis=0)
    Y = [subject_measures(s, ln, MEASURES, centre)[0] for s, ln in zip(S, lengths)]
    how = {"pipeline": "dpneuro.run.stages.reduce_inprocess + unmix_inprocess, plan none (no noise), "
                       f"ica {cfg.ica}, pca_contribution {cfg.pca_contribution}, parcels 0 (the 122 regions), seed 0",
           "time_courses": "dpneuro.algorithms.djica.time_courses(W, unmixing_input(cfg, X, basis, eigenvalues), b)",
           "fnc_centre": "the 33 people's mean FNC (Fisher z), exact", "seconds": seconds}
    return d, people, Y, how


def pseudo_groups(design: Design, Y_sites: list[np.ndarray], rep: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every site's (X, Y) with random pseudo-groups: a random half of its people patients (of an odd count, a
    coin decides who has one more), ages uniform on the public range, sex 50/50; all independent of the data."""
    rng = np.random.default_rng([SEED, REAL_STREAM, rep])
    sites = []
    for s, Y in enumerate(Y_sites):
        M = len(Y)
        patient = rng.permutation(M) < (M + int(rng.integers(2))) // 2
        age = rng.uniform(*AGE_RANGE, M)
        male = rng.random(M) < 0.5
        values = [{"group": "patient" if g else "control", "age": repr(float(a)), "sex": "M" if m else "F"}
                  for g, a, m in zip(patient, age, male)]
        sites.append((design.rows(values, s)[0], Y))
    return sites


def null_score(fit: dict, ols_width: np.ndarray) -> dict:
    """One fit under the null (every truth 0): its discoveries, type-I errors, coverage of 0, widths and the weak
    design directions (pooled OLS has none)."""
    lo, hi = fit["ci_low"], fit["ci_high"]
    out = {"_any": (fit["q"] < ALPHA).any(axis=1), "_count": (fit["q"] < ALPHA).sum(axis=1), "_estimate": fit["estimate"], "_se": fit["se"],
           "type-I per test": float((fit["p"] < ALPHA).mean()), "coverage of 0": float(((lo <= 0) & (0 <= hi)).mean()),
           "width ratio to OLS": float(((hi - lo) / ols_width).mean())}
    if "floored" in fit:
        out["floored"], out["design snr"] = float(fit["floored"]), float(fit["design_snr"])
    return out


def real(args, given: list[str]) -> None:
    """The real part: group_stats_real{,_quick}.{csv,json}."""
    reps = args.reps or (10 if args.quick else 500)
    t0, cpu0 = time.perf_counter(), time.process_time()
    design = make_design()
    d, people, Y_sites, how = real_measures()
    print(f"  components: {how['seconds']:.1f} s; sites of {[len(g) for g in people]} people", flush=True)
    ref = GLMSettings(design, MEASURES, N_COMPONENTS, None, plan="none")
    scaled = sum(pack_statistics(np.zeros((len(Y), design.p)), Y, design, ref.families)[1] for Y in Y_sites)
    acc: dict[tuple, list[dict]] = {}
    times: dict[tuple, list[float]] = {}
    ledger_eps, checks = {}, {}
    for rep in range(reps):
        sites = pseudo_groups(design, Y_sites, rep)
        for plan, eps, fit, dt, width in method_fits(design, sites, rep, ledger_eps, checks):
            acc.setdefault((plan, eps), []).append(null_score(fit, width))
            times.setdefault((plan, eps), []).append(dt)
        if (rep + 1) % max(1, reps // 10) == 0:
            print(f"  {rep + 1}/{reps} repetitions, {time.perf_counter() - t0:.0f} s", flush=True)
    rows = []
    for (plan, eps), got in acc.items():
        anyd = np.array([g["_any"] for g in got])  # reps x contrasts
        row = {"method": plan, "epsilon": "" if eps is None else eps, "reps": len(got),
               **{f"any discovery {c}": float(v) for c, v in zip(CONTRASTS, anyd.mean(axis=0))},
               "any discovery (worst contrast)": float(anyd.mean(axis=0).max()),
               "any discovery (all contrasts)": float(anyd.any(axis=1).mean())}
        # how many measures a contrast's discoveries hold when it has any: false discoveries that come together
        counts = np.array([g["_count"] for g in got])
        row["discoveries per discovering contrast"] = float(counts[counts > 0].mean()) if (counts > 0).any() else ""
        for k in ("type-I per test", "coverage of 0", "width ratio to OLS"):
            row[k] = float(np.mean([g[k] for g in got]))
        floored, snr = [g["floored"] for g in got if "floored" in g], [g["design snr"] for g in got if "design snr" in g]
        row["floored"] = float(np.mean(floored)) if floored else ""
        row["design snr"] = float(np.median(snr)) if snr else ""
        est, se = np.array([g["_estimate"] for g in got]), np.array([g["_se"] for g in got])
        row["se / sd of estimates"] = float(np.mean(np.sqrt((se**2).mean(0)) / est.std(0, ddof=1)))
        row["fit ms"] = 1000 * statistics.median(times[plan, eps])
        rows.append(row)
    print()
    print(" | ".join(REAL_KEYS))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in REAL_KEYS))
    n = sum(len(g) for g in people)
    meta = {"command": " ".join(["python benchmarks/group_stats.py", *given]), "part": "real",
            "data": d["source"], "people": n, "regions": int(d["series"][0].shape[0]),
            "volumes_per_person": int(d["series"][0].shape[1]), "n_sites": REAL_SITES,
            "people_per_site": [len(g) for g in people], "site_split": f"numpy default_rng({SEED}).permutation({n}), "
                                                                       f"split in {REAL_SITES}",
            "components": how, "n_components": N_COMPONENTS, "n_measures": ref.n_measures,
            "design": "group + age + sex (+ site)", "columns": list(design.columns),
            "contrasts": [c for c, _, _ in design.contrasts()],
            "pseudo_groups": {"group": "a random half of each site's people patients (odd count: a coin gives "
                                       "patients or controls the extra one)",
                              "age": f"uniform on {list(AGE_RANGE)}", "sex": "50/50",
                              "independent_of_the_data": True},
            "epsilons": list(EPSILONS), "delta": DELTA, "plan": "cape", "level": LEVEL, "alpha": ALPHA,
            "reps": reps, "seed": SEED,
            "seeds": {"labels": f"numpy default_rng([{SEED}, {REAL_STREAM}, rep]), rep = 0..{reps - 1}",
                      "noise": "GLMSettings(random_state=rep) (same at every eps)"},
            "subjects_scaled_by_bound": scaled / n,
            "ols_check": {"what": "the fit without noise (plan none) against OLS of the bound-scaled measures on the "
                                  "full design rows: largest |estimate difference| (the run stops above "
                                  f"{OLS_TOLERANCE:g}), and against OLS of the raw measures (the bound's scaling); "
                                  "the range of se(fit) / se(OLS): the fit pools each family's residual variance",
                          **checks},
            "ledger_epsilon_headline": {str(k): v for k, v in ledger_eps.items()},
            "environment": environment(), "glm_py_sha256": GLM_SHA256, "glm_constants": glm_constants(),
            "runtime_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
    write_results("group_stats_real" + ("_quick" if args.quick else ""), rows, meta, keys=REAL_KEYS)


# -- part "fmri": the whole pipeline on synthetic fMRI with planted group differences ----------------------

#: the fMRI part's consortium: unequal sites and patient fractions, 2 planted FNC shifts, an age slope
FMRI_SITES, FMRI_COMPONENTS = [80, 100, 120, 100], 8
FMRI_EFFECTS = {"patients": [0.3, 0.4, 0.5, 0.6], "fnc_shift": [[0, 1, 0.5], [2, 3, 0.5]], "amplitude_age": [[4, 0.3]]}
FMRI_GLM_EPSILON = 4.0
FMRI_KEYS = ["seed", "method", "total epsilon", "planted fnc found", "planted age slope found",
             "planted fnc estimate", "planted fnc noise sd", "other group discoveries", "maps mean |r| with truth",
             "fit s"]


def fmri(args, given: list[str]) -> None:
    """The fMRI part: group_stats_fmri{,_quick}.{csv,json}."""
    import dpneuro
    from dpneuro.algorithms.metrics import match_components
    from dpneuro.datasets.synth import make_consortium

    seeds = range(1) if args.quick else range(args.reps or 3)
    sizes = [10, 12, 14, 12] if args.quick else FMRI_SITES
    covariates = {"group": ["control", "patient"], "age": list(AGE_RANGE), "sex": ["F", "M"]}
    t0, cpu0, rows = time.perf_counter(), time.process_time(), []
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="dpneuro-glm-fmri-") as tmp:
            man = make_consortium(Path(tmp) / "data", n_sites=len(sizes), subjects_per_site=sizes,
                                  n_components=FMRI_COMPONENTS, n_timepoints=150, space="grid30",
                                  random_state=seed, effects=FMRI_EFFECTS)
            truth = np.load(man["truth"]["A"]).astype(np.float64)
            for method, kw in (("no noise", {"plan": "none", "reduction": "none"}),
                               (f"glm eps {FMRI_GLM_EPSILON:g}", {"glm_epsilon": FMRI_GLM_EPSILON})):
                t = time.perf_counter()
                ica = dpneuro.DecentralizedICA(n_components=FMRI_COMPONENTS, mask=man["mask"], random_state=seed,
                                               parcels=0, out=Path(tmp) / method.replace(" ", "_"),
                                               design="group + age + sex", covariates=covariates, **kw)
                ica.fit({x["site"]: x["path"] for x in man["sites"]})
                seconds = time.perf_counter() - t
                perm, corr = match_components(ica.components_.T, truth)  # source k is IC perm[k] + 1
                planted = {}
                for j, k, _ in FMRI_EFFECTS["fnc_shift"]:
                    a, b = sorted((int(perm[j]), int(perm[k])))
                    planted[f"fnc IC{a + 1:02d}-IC{b + 1:02d}"] = float(np.sign(corr[j] * corr[k]))
                age_ic = f"amplitude IC{int(perm[FMRI_EFFECTS['amplitude_age'][0][0]]) + 1:02d}"
                rows_g = {r["measure"]: r for r in ica.group_effects_ if r["contrast"].startswith("group")}
                rows_a = {r["measure"]: r for r in ica.group_effects_ if r["contrast"].startswith("age")}
                rows.append({
                    "seed": seed, "method": method,
                    "total epsilon": max(ica.privacy_.epsilon.values()) if kw.get("plan") != "none" else "",
                    "planted fnc found": sum(rows_g[m]["q"] < ALPHA for m in planted),
                    "planted age slope found": int(rows_a[age_ic]["q"] < ALPHA),
                    "planted fnc estimate": float(np.mean([rows_g[m]["estimate"] * sg for m, sg in planted.items()])),
                    "planted fnc noise sd": float(np.mean([rows_g[m]["noise_sd"] for m in planted])),
                    "other group discoveries": sum(r["q"] < ALPHA for m, r in rows_g.items() if m not in planted),
                    "maps mean |r| with truth": float(np.mean(np.abs(corr))), "fit s": seconds})
                print(" | ".join(f"{rows[-1][k]:.3f}" if isinstance(rows[-1][k], float) else str(rows[-1][k])
                                 for k in FMRI_KEYS), flush=True)
    meta = {"command": " ".join(["python benchmarks/group_stats.py", *given]), "part": "fmri",
            "consortium": {"generator": "dpneuro.datasets.synth.make_consortium (blobs)", "subjects_per_site": sizes,
                           "n_components": FMRI_COMPONENTS, "n_timepoints": 150, "space": "grid30",
                           "effects": FMRI_EFFECTS,
                           "planted": "patients' correlation between sources 0-1 and 2-3 raised by 0.5 (Fisher z "
                                      "+0.55); source 4's log amplitude +0.3 per half range of age (0.012 per year)"},
            "design": "group + age + sex (+ site)", "covariates": covariates,
            "methods": {"no noise": "plan none, reduction none: the same pipeline without privacy",
                        f"glm eps {FMRI_GLM_EPSILON:g}": "the library's defaults (pca_epsilon 6, fnc_epsilon 2) "
                                                         f"and glm_epsilon {FMRI_GLM_EPSILON:g}"},
            "matching": "each source's map paired with a component by |r| (Hungarian); a planted edge is found when "
                        f"its q < {ALPHA} for the group contrast", "seeds": list(seeds), "alpha": ALPHA,
            "environment": environment(), "glm_py_sha256": GLM_SHA256,
            "runtime_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
    write_results("group_stats_fmri" + ("_quick" if args.quick else ""), rows, meta, keys=FMRI_KEYS)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="10 repetitions (writes *_quick.*)")
    ap.add_argument("--part", choices=("sim", "real", "fmri", "all"), default=None,
                    help="the simulation, the real-fMRI null, the whole pipeline on synthetic fMRI, or all (default: "
                         "sim; with --quick: all)")
    ap.add_argument("--subjects", type=int, default=DEFAULT_SUBJECTS,
                    help=f"subjects per site (simulation; other than {DEFAULT_SUBJECTS}: writes group_stats_<M>.*)")
    ap.add_argument("--reps", type=int, default=None, help="repetitions per method and scenario (default 500)")
    args = ap.parse_args(argv)
    part = args.part or ("all" if args.quick else "sim")
    given = sys.argv[1:] if argv is None else list(argv)
    if part in ("sim", "all"):
        simulation(args, given)
    if part in ("real", "all"):
        real(args, given)
    if part in ("fmri", "all"):
        fmri(args, given)
    return 0


if __name__ == "__main__":
    sys.exit(main())
