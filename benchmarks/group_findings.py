"""Private group findings end to end: which planted FNC differences the private group statistics find, at what cost.

The whole pipeline (``dpneuro.DecentralizedICA`` with ``design = "group + age"``: load, capePCA, spatial ICA,
the FNC, the group GLM) on the synthetic "networks" fMRI generator with planted group differences
(``make_consortium(model="networks", effects=...)``): 4 sites x M subjects (M = 100; ``--subjects``), patient
fractions 0.3, 0.45, 0.55, 0.7, ages uniform on 20-70, R = 8 sources and components, 150 volumes, the
``grid30`` space, voxels (``parcels=0``). Patients' population correlation between sources 0 and 1 is raised
by 0.45 and between sources 2 and 3 lowered by 0.4; nothing else differs. Each (seed, M) consortium is
generated once and every method fits the same data.

Methods (each ``DecentralizedICA(n_components=8, random_state=seed, design="group + age", covariates={"group":
["control", "patient"], "age": [20, 70]})``):

- ``pooled OLS``: plain OLS computed here (numpy) on every subject's measures of the run without privacy
  (``plan="none", reduction="none"``): the per-subject FNC (Fisher z; checked against the run's own
  ``timecourses/<site>_fnc.tsv``) and relative log amplitudes (``glm.subject_measures``) of its time courses,
  regressed on patient (0/1), age and an intercept per site; t intervals with N - 6 degrees of freedom, BH q
  within the group contrast. This is the reference;
- ``no noise``: that run's own group statistics (``group_effects_``: the library's GLM with plan "none", its
  subjects' measures bounded, no noise);
- ``eps E group``: ``epsilon=E, question="group differences"`` (up to three quarters of the budget's mu^2 to the GLM),
  E = 2, 4, 8 (total epsilon per site, headline sense, delta 1e-5);
- ``eps 4 maps``: ``epsilon=4, question="maps"`` (the default split).

A run the planner refuses ("this budget buys no component") is recorded with its error and left out of the
averages. Components are paired with the sources by their maps (``match_components``, Hungarian on |r|) and
every measure is named by its sources, an FNC edge's estimate and interval times the product of its two pairs'
signs, so runs are compared measure by measure. The sign of a pair is its time courses' (the sign of the mean
correlation of the component's time course with the true source's over the first site's subjects), not its
map's: the FNC is the time courses', and the written maps' sign can differ from theirs (each run's row in the
JSON counts those pairs). Per method over the seeds, on the group contrast (patient vs control): ``found``,
the fraction of the 2 planted edges with q < 0.05; ``ratio``, the mean of the estimate over the reference's
(pooled OLS) on the planted edges; ``ratio own OLS``, the same
over pooled OLS on the run's own (un-noised) measures, which leaves out what the maps' noise changes;
``width ratio``, the median over the 36 measures (28 FNC edges, 8 amplitudes) of the 95 % interval's width over
the reference's; ``coverage``, the fraction of the 36 intervals that cover the reference's estimate (coverage of
the OLS estimate, not of a population truth), and ``coverage own OLS`` of the run's own OLS estimate; ``FDR``,
the mean over runs of the discoveries (q < 0.05, rows with ``signal`` True) outside the planted edges over
max(discoveries, 1) (a planted shift leaking into a neighbouring edge through imperfect unmixing counts as
false); ``predicted power``, the mean over planted edges of ``glm.bh_power(|reference estimate|, the run's se,
the signal measures, 2 effects)``; ``detectable 80 fnc``, the run's own ``detectable_80`` (group contrast, fnc,
group_effects.json: the smallest effect found with 80 % power); ``scaled by bound``, the fraction of subjects
whose measures the sites scaled onto the GLM's bound (the sites' console notes); maps mean |r| with the true
maps; seconds per fit (pooled OLS: its run's).

    python benchmarks/group_findings.py             # full: M = 100 x seeds 0-5, all methods, and M = 250 x
                                                    # seeds 0-1 at eps 4 (~18 min on 2 cores)
    python benchmarks/group_findings.py --quick     # smoke run: M = 20, 1 seed, eps 4 only, allow_noise_maps
                                                    # (~35 s; writes *_quick.*)
    python benchmarks/group_findings.py --subjects 100 --reps 1   # one size, N seeds, all methods (M = 100,
                                                                  # one seed: ~85 s)

Writes benchmarks/results/group_findings{,_quick}.csv (one row per subjects per site x method) and
group_findings{,_quick}.json (the set-up, every run's row, the environment).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parent))
from frontier import write_results  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
#: the versions of the library files measured, as imported (a later edit does not change this run)
SOURCES = {p: hashlib.sha256((ROOT / p).read_bytes()).hexdigest()
           for p in ("dpneuro/algorithms/glm.py", "dpneuro/run/planner.py", "dpneuro/config/schema.py")}

N_SITES = 4
SUBJECTS = 100
N_COMPONENTS = 8
N_TIMEPOINTS = 150
SPACE = "grid30"
MODEL = "networks"
EFFECTS = {"patients": [0.3, 0.45, 0.55, 0.7], "fnc_shift": [[0, 1, 0.45], [2, 3, -0.4]]}
DESIGN = "group + age"
COVARIATES = {"group": ["control", "patient"], "age": [20, 70]}
GROUP = "group: patient vs control"
EPSILONS = (2.0, 4.0, 8.0)
ALPHA = 0.05
LEVEL = 0.95
SEEDS = 6
#: the full run's second size: more subjects per site at eps 4 only
LARGE, LARGE_SEEDS = 250, 2
QUICK_SUBJECTS = 20
#: per run (printed as it goes; every run in the JSON)
RUN_KEYS = ["subjects per site", "seed", "method", "total epsilon", "glm epsilon", "found", "ratio", "ratio own OLS",
            "width ratio", "coverage", "coverage own OLS", "fdp", "discoveries", "predicted power",
            "detectable 80 fnc", "scaled by bound", "maps mean |r| with truth", "seconds", "note"]
#: per subjects per site x method (the CSV)
KEYS = ["subjects per site", "method", "question", "epsilon", "runs", "refused", "total epsilon", "glm epsilon",
        "found", "ratio", "ratio own OLS", "width ratio", "coverage", "coverage own OLS", "fdr", "predicted power",
        "detectable 80 fnc", "scaled by bound", "maps mean |r| with truth", "seconds"]


def environment() -> dict:
    try:
        head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "dpneuro"],
                                    capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError):
        head, dirty = None, None
    return {"machine": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(), "python": platform.python_version(), "numpy": np.__version__,
            "load_average": list(os.getloadavg()), "git_head": head, "dpneuro_modified": dirty}


def methods(quick: bool, eps_only4: bool) -> list[tuple[str, str, float | None, dict]]:
    """(name, question, epsilon, DecentralizedICA keywords) of the private methods, in order."""
    out = []
    for eps in EPSILONS:
        if eps_only4 and eps != 4.0:
            continue
        out.append((f"eps {eps:g} group", "group differences", eps, {"epsilon": eps, "question": "group differences"}))
        if eps == 4.0:
            out.append((f"eps {eps:g} maps", "maps", eps, {"epsilon": eps, "question": "maps"}))
    if quick:
        for _, _, _, kw in out:
            kw["allow_noise_maps"] = True
    return out


# -- measures, OLS and the pairing with the sources --------------------------------------------------------

def participants(man: dict) -> dict[str, dict[str, dict[str, str]]]:
    """site -> subject id -> its participants.tsv row."""
    out = {}
    for s in man["sites"]:
        with open(Path(s["path"]) / "participants.tsv", newline="") as f:
            out[s["site"]] = {r["participant_id"]: r for r in csv.DictReader(f, delimiter="\t")}
    return out


def own_measures(ica, people: dict) -> tuple[np.ndarray, np.ndarray, list[str], float]:
    """Every subject's design row (patient, age, site one-hots) and measures (FNC, amplitude) from the run's
    time courses; the measures' names; the largest |difference| from the run's own fnc_subjects.tsv."""
    from dpneuro.algorithms.glm import measure_names, subject_measures

    sites = list(ica.timecourses_)
    X, Y, check = [], [], 0.0
    for s_idx, site in enumerate(sites):
        subs = ica.timecourses_[site]
        S = np.concatenate([np.asarray(subs[sid], np.float64) for sid in subs], axis=0).T  # R x N
        Ym, _, _ = subject_measures(S, [len(subs[sid]) for sid in subs], ["fnc", "amplitude"])
        Y.append(Ym)
        for sid in subs:
            row = people[site][sid]
            onehot = [0.0] * len(sites)
            onehot[s_idx] = 1.0
            X.append([float(row["group"] == "patient"), float(row["age"]), *onehot])
        tsv = Path(ica.output_dir_) / "timecourses" / f"{site}_fnc.tsv"
        if tsv.exists():  # the run's own per-subject FNC: the same numbers
            with open(tsv) as f:
                next(f)
                F = {ln.split("\t")[0]: np.array(ln.split("\t")[1:], float) for ln in f if ln.strip()}
            P = N_COMPONENTS * (N_COMPONENTS - 1) // 2
            check = max(check, float(np.max(np.abs(np.array([F[sid] for sid in subs]) - Ym[:, :P]))))
        else:
            check = float("nan")
    return np.array(X), np.vstack(Y), measure_names(["fnc", "amplitude"], N_COMPONENTS), check


def ols(X: np.ndarray, Y: np.ndarray, names: list[str]) -> list[dict]:
    """Plain OLS of every measure on the design (column 0: patient): the group contrast's rows, as
    ``group_effects_`` has them (t intervals, BH q over every measure)."""
    n, p = X.shape
    beta, *_ = np.linalg.lstsq(X, Y, rcond=None)
    resid = Y - X @ beta
    s2 = (resid**2).sum(axis=0) / (n - p)
    se = np.sqrt(s2 * np.linalg.inv(X.T @ X)[0, 0])
    est = beta[0]
    t = stats.t.ppf(0.5 + LEVEL / 2, n - p)
    pv = 2 * stats.t.sf(np.abs(est / se), n - p)
    q = stats.false_discovery_control(pv, method="bh")
    return [{"contrast": GROUP, "measure": m, "estimate": float(e), "se": float(s), "ci_low": float(e - t * s),
             "ci_high": float(e + t * s), "p": float(a), "q": float(b), "noise_sd": 0.0, "signal": True}
            for m, e, s, a, b in zip(names, est, se, pv, q)]


def by_source(rows: list[dict], perm: np.ndarray, sign: np.ndarray) -> dict[str, dict]:
    """The group contrast's rows named by the sources their components are paired with ("fnc s0-s1",
    "amplitude s0"), an FNC edge's estimate and interval times the product of its two pairs' ``sign``."""
    source = {int(ic): k for k, ic in enumerate(perm)}  # component index -> source index
    out = {}
    for r in rows:
        if r["contrast"] != GROUP:
            continue
        ics = [int(x) - 1 for x in re.findall(r"IC(\d+)", r["measure"])]
        src = [source[i] for i in ics]
        g = float(np.prod([sign[k] for k in src])) if r["measure"].startswith("fnc") else 1.0
        lo, hi = sorted((g * r["ci_low"], g * r["ci_high"]))
        name = (f"fnc s{min(src)}-s{max(src)}" if r["measure"].startswith("fnc") else f"amplitude s{src[0]}")
        out[name] = {**r, "estimate": g * r["estimate"], "ci_low": lo, "ci_high": hi, "component_measure": r["measure"]}
    return out


def planted() -> dict[str, float]:
    """The planted edges by source name, with the sign of their shift."""
    return {f"fnc s{min(j, k)}-s{max(j, k)}": float(np.sign(d)) for j, k, d in EFFECTS["fnc_shift"]}


def pairing(ica, man: dict, truth: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Each source's component (``match_components`` of the maps), the maps' signed correlations, and the sign
    of each pair's time courses: the sign of the mean correlation of the component's time course with the true
    source's over the first site's subjects. The FNC is the time courses', so their sign names an edge's
    direction (the written maps' sign can differ from their time courses')."""
    from dpneuro.algorithms.metrics import match_components

    perm, corr = match_components(ica.components_.T, truth)
    site = man["sites"][0]
    r = np.zeros(len(perm))
    for sub in site["subjects"]:
        S = np.load(sub["sources"]).astype(np.float64)  # R x T
        tc = np.asarray(ica.timecourses_[site["site"]][sub["id"]], np.float64)  # T x R
        for k, ic in enumerate(perm):
            r[k] += np.corrcoef(S[k], tc[:, int(ic)])[0, 1]
    return perm, corr, np.where(r < 0, -1.0, 1.0)


def detectable_fnc(ica) -> float:
    path = Path(ica.output_dir_) / "group_effects.json"
    if not path.exists():
        return float("nan")
    import json
    got = json.loads(path.read_text()).get("detectable_80", {}).get(GROUP, {})
    return float(got.get("fnc", float("nan")))


def score(rows: dict[str, dict], ref: dict[str, dict], own: dict[str, dict] | None) -> dict:
    """A run's scores on the group contrast against the reference (and its own OLS)."""
    from dpneuro.algorithms.glm import bh_power

    plant = planted()
    found = [rows[m]["q"] < ALPHA for m in plant]
    ratio = [rows[m]["estimate"] / ref[m]["estimate"] for m in plant]
    width = [(r["ci_high"] - r["ci_low"]) / (ref[m]["ci_high"] - ref[m]["ci_low"]) for m, r in rows.items()]
    cover = [r["ci_low"] <= ref[m]["estimate"] <= r["ci_high"] for m, r in rows.items()]
    disc = [m for m, r in rows.items() if r["signal"] and r["q"] < ALPHA]
    false = [m for m in disc if m not in plant]
    n_signal = sum(bool(r["signal"]) for r in rows.values())
    power = [bh_power(abs(ref[m]["estimate"]), rows[m]["se"], max(n_signal, 1), n_effects=len(plant))
             if rows[m]["signal"] else 0.0 for m in plant]
    out = {"found": float(np.mean(found)), "ratio": float(np.mean(ratio)), "width ratio": float(np.median(width)),
           "coverage": float(np.mean(cover)), "fdp": len(false) / max(len(disc), 1), "discoveries": len(disc),
           "predicted power": float(np.mean(power)),
           "planted": {m: {k: rows[m][k] for k in ("estimate", "se", "q", "noise_sd", "signal")} | {
               "reference": ref[m]["estimate"], "component_measure": rows[m]["component_measure"]} for m in plant},
           "false discoveries": false}
    if own is not None:
        out["ratio own OLS"] = float(np.mean([rows[m]["estimate"] / own[m]["estimate"] for m in plant]))
        out["coverage own OLS"] = float(np.mean([r["ci_low"] <= own[m]["estimate"] <= r["ci_high"]
                                                 for m, r in rows.items()]))
    return out


# -- the runs -------------------------------------------------------------------------------------------

def fit(man: dict, seed: int, out: Path, kw: dict):
    """One DecentralizedICA fit; its seconds and the fraction of subjects the sites scaled onto the bound."""
    import dpneuro

    ica = dpneuro.DecentralizedICA(n_components=N_COMPONENTS, mask=man["mask"], random_state=seed, parcels=0,
                                   out=out, design=DESIGN, covariates=COVARIATES, **kw)
    err = io.StringIO()
    t = time.perf_counter()
    try:
        with contextlib.redirect_stderr(err):
            ica.fit({x["site"]: x["path"] for x in man["sites"]})
    except BaseException:
        sys.stderr.write(err.getvalue())
        raise
    seconds = time.perf_counter() - t
    notes = re.findall(r"group statistics: (\d+) of (\d+) subjects in the model(?:; (\d+) subject\(s\)' measures "
                       r"scaled)?", err.getvalue())
    scaled = (sum(int(c or 0) for _, _, c in notes) / sum(int(n) for n, _, _ in notes)) if notes else float("nan")
    return ica, seconds, scaled


def run_dataset(M: int, seed: int, private: list, runs: list[dict]) -> None:
    """Every method on one consortium: rows appended to ``runs`` (and printed)."""
    from dpneuro.config import ConfigError
    from dpneuro.datasets.synth import make_consortium

    with tempfile.TemporaryDirectory(prefix="dpneuro-group-findings-") as tmp:
        t = time.perf_counter()
        try:
            man = make_consortium(Path(tmp) / "data", n_sites=N_SITES, subjects_per_site=M,
                                  n_components=N_COMPONENTS, n_timepoints=N_TIMEPOINTS, space=SPACE, model=MODEL,
                                  random_state=seed, effects=EFFECTS)
        except ValueError as exc:  # a seed whose networks cannot carry the shifts: said, and the next one taken
            print(f"{M} | {seed} | generator refused: {exc}", flush=True)
            return
        gen_s = time.perf_counter() - t
        truth = np.load(man["truth"]["A"]).astype(np.float64)
        people = participants(man)

        def row(method, question, eps, **kw):
            r = {"subjects per site": M, "seed": seed, "method": method, "question": question,
                 "epsilon": "" if eps is None else eps, "total epsilon": "", "glm epsilon": "", "note": "",
                 "generate seconds": gen_s, **kw}
            runs.append(r)
            print(" | ".join(f"{r.get(k, ''):.3f}" if isinstance(r.get(k), float) else str(r.get(k, ""))
                             for k in RUN_KEYS), flush=True)

        # the reference: the run without privacy, and plain OLS on its subjects' measures
        ica, seconds, scaled = fit(man, seed, Path(tmp) / "none", {"plan": "none", "reduction": "none"})
        perm, corr, sign = pairing(ica, man, truth)
        flips = int(np.sum(sign != np.sign(corr)))
        X, Y, names, fnc_check = own_measures(ica, people)
        ref = by_source(ols(X, Y, names), perm, sign)
        maps_r = float(np.mean(np.abs(corr)))
        row("pooled OLS", "", None, **score(ref, ref, ref),
            **{"detectable 80 fnc": float("nan"), "scaled by bound": 0.0, "maps mean |r| with truth": maps_r,
               "seconds": seconds, "fnc_subjects max |diff|": fnc_check, "map/time-course sign flips": flips})
        row("no noise", "", None, **score(by_source(ica.group_effects_, perm, sign), ref, ref),
            **{"detectable 80 fnc": detectable_fnc(ica), "scaled by bound": scaled, "maps mean |r| with truth": maps_r,
               "seconds": seconds})
        del ica

        for method, question, eps, kw in private:
            try:
                ica, seconds, scaled = fit(man, seed, Path(tmp) / method.replace(" ", "_"), kw)
            except ConfigError as exc:
                if "buys no component" not in str(exc):
                    raise
                row(method, question, eps, note=f"refused: {exc}")
                continue
            perm, corr, sign = pairing(ica, man, truth)
            X, Y, names, _ = own_measures(ica, people)
            own = by_source(ols(X, Y, names), perm, sign)
            cfg = ica.config_
            row(method, question, eps, **score(by_source(ica.group_effects_, perm, sign), ref, own),
                **{"total epsilon": max(ica.privacy_.epsilon.values()),
                   "glm epsilon": float(getattr(cfg, "glm_epsilon", float("nan"))),
                   "stage epsilons": {k: getattr(cfg, k, None) for k in ("pca_epsilon", "fnc_epsilon", "glm_epsilon")},
                   "detectable 80 fnc": detectable_fnc(ica), "scaled by bound": scaled,
                   "maps mean |r| with truth": float(np.mean(np.abs(corr))), "seconds": seconds,
                   "signal components": int(np.sum(ica.signal_components_)),
                   "map/time-course sign flips": int(np.sum(sign != np.sign(corr)))})
            del ica


def summarise(runs: list[dict]) -> list[dict]:
    """One row per subjects per site x method: the means over its runs (the refused ones counted apart)."""
    out = []
    for key in dict.fromkeys((r["subjects per site"], r["method"]) for r in runs):
        mine = [r for r in runs if (r["subjects per site"], r["method"]) == key]
        ok = [r for r in mine if not r["note"]]
        row = {"subjects per site": key[0], "method": key[1], "question": mine[0]["question"],
               "epsilon": mine[0]["epsilon"], "runs": len(ok), "refused": len(mine) - len(ok)}
        for k in KEYS[6:]:
            vals = [r.get("fdp" if k == "fdr" else k) for r in ok]
            vals = [v for v in vals if isinstance(v, (int, float)) and not isinstance(v, bool) and np.isfinite(v)]
            row[k] = float(np.mean(vals)) if vals else ""
        out.append(row)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help=f"M = {QUICK_SUBJECTS}, 1 seed, eps 4 only, "
                                                         "allow_noise_maps (writes *_quick.*)")
    ap.add_argument("--reps", type=int, default=None, help=f"seeds 0..N-1 (default {SEEDS}; quick 1)")
    ap.add_argument("--subjects", type=int, default=None,
                    help=f"subjects per site: this size only, every method (default {SUBJECTS}, and {LARGE} at eps 4)")
    args = ap.parse_args(argv)
    given = sys.argv[1:] if argv is None else list(argv)
    reps = args.reps or (1 if args.quick else SEEDS)
    if args.quick:
        plan = [(args.subjects or QUICK_SUBJECTS, reps, methods(True, True))]
    elif args.subjects:
        plan = [(args.subjects, reps, methods(False, False))]
    else:
        plan = [(SUBJECTS, reps, methods(False, False)), (LARGE, min(LARGE_SEEDS, reps), methods(False, True))]
    t0, cpu0, runs = time.perf_counter(), time.process_time(), []
    print(" | ".join(RUN_KEYS), flush=True)
    for M, n_seeds, private in plan:
        for seed in range(n_seeds):
            run_dataset(M, seed, private, runs)
    rows = summarise(runs)
    print()
    print(" | ".join(KEYS))
    for r in rows:
        print(" | ".join(f"{r[k]:.3f}" if isinstance(r[k], float) else str(r[k]) for k in KEYS))
    meta = {"command": " ".join(["python benchmarks/group_findings.py", *given]),
            "consortium": {"generator": "dpneuro.datasets.synth.make_consortium", "model": MODEL, "n_sites": N_SITES,
                           "n_components": N_COMPONENTS, "n_timepoints": N_TIMEPOINTS, "space": SPACE,
                           "effects": EFFECTS,
                           "planted": "patients' population correlation of sources 0-1 raised by 0.45, of sources "
                                      "2-3 lowered by 0.4; nothing else differs"},
            "plan": [{"subjects_per_site": M, "seeds": list(range(n)), "methods": ["pooled OLS", "no noise",
                                                                                  *(m[0] for m in private)]}
                     for M, n, private in plan],
            "design": DESIGN + " (+ site)", "covariates": COVARIATES, "contrast": GROUP, "alpha": ALPHA, "level": LEVEL,
            "delta": 1e-5, "quick": args.quick, "allow_noise_maps": args.quick,
            "methods": {"pooled OLS": "plain OLS (numpy) of every measure of the run without privacy (plan none, "
                                      "reduction none) on patient, age and site intercepts; t intervals, BH q over "
                                      "the 36 measures of the group contrast: the reference",
                        "no noise": "the same run's group_effects_ (the library's GLM, plan none: bounded measures, "
                                    "no noise)",
                        "eps E group": "epsilon E, question \"group differences\"",
                        "eps 4 maps": "epsilon 4, question \"maps\" (the default split)"},
            "matching": "match_components of the run's maps with the true maps; measures named by sources, FNC "
                        "estimates times the product of the pairs' time-course signs (the sign of the mean "
                        "correlation of the component's time course with the true source's over the first site's "
                        "subjects; 'map/time-course sign flips' in a run's row counts the pairs whose map sign "
                        "differs)",
            "metrics": {"found": "planted edges with q < alpha (group contrast)",
                        "ratio": "estimate / pooled OLS estimate, mean over planted edges",
                        "ratio own OLS": "estimate / OLS on the run's own measures, planted edges",
                        "width ratio": "median over the 36 group-contrast measures of the interval width / pooled "
                                       "OLS's",
                        "coverage": "intervals covering the pooled OLS estimate, over the 36 measures",
                        "coverage own OLS": "intervals covering the OLS estimate on the run's own measures",
                        "fdr": "mean over runs of discoveries (signal rows, q < alpha) outside the planted edges / "
                               "max(discoveries, 1)",
                        "predicted power": "mean over planted edges of glm.bh_power(|pooled OLS estimate|, run's se, "
                                           "the run's signal measures, 2 effects); 0 for a noise component's edge",
                        "detectable 80 fnc": "group_effects.json detectable_80 (group contrast, fnc)",
                        "scaled by bound": "subjects whose measures the sites scaled onto the GLM bound (console "
                                           "notes) / subjects"},
            "runs": runs, "library_sha256": SOURCES, "environment": environment(),
            "runtime_s": time.perf_counter() - t0, "cpu_s": time.process_time() - cpu0}
    write_results("group_findings" + ("_quick" if args.quick else ""), rows, meta, keys=KEYS)
    return 0


if __name__ == "__main__":
    sys.exit(main())
