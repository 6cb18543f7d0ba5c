"""The consortium's outputs, written the same way by a simulation and by a deployed aggregator.

A simulated run (:mod:`dpneuro.run.pipeline`) and the aggregator of a deployed
run (:mod:`dpneuro.deploy.party`) both end with the same three things: the
spatial maps painted back to voxels, ``privacy.json`` composed from every
site's ledger, and the report's headline. They call these functions, so a
deployment and its simulation write the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
from scipy import stats

from dpneuro._utils.files import write_json
from dpneuro.algorithms.dfnc import n_components_of, site_dynamics, state_matrices
from dpneuro.algorithms.djica import spatial_maps, time_courses
from dpneuro.algorithms.fnc import site_fnc
from dpneuro.algorithms.glm import detectable, measure_names
from dpneuro.config import RunConfig
from dpneuro.data.images import load_mask
from dpneuro.data.parcellation import space_parcels
from dpneuro.privacy import PrivacyLedger, privacy_report
from dpneuro.report.figures import (
    convergence_figure,
    fnc_figure,
    matrix_figure,
    overview_figure,
    render_components,
    spectrum_figure,
    states_figure,
    template_problem,
    write_components,
    write_dynamics,
    write_timecourses,
)
from dpneuro.report.html import report_headline, write_report
from dpneuro.report.timings import label
from dpneuro.run.expectations import (
    expected_noise,
    run_warnings,
    signal_components,
    signal_sentence,
    supported_components,
)
from dpneuro.run.factory import fnc_settings, glm_settings
from dpneuro.run.naming import component_labels, painted, read_component_table, write_component_table
from dpneuro.run.roles import contribution_note, describe_unmixing, site_windows, unmixing_input
from dpneuro.run.site_maps import made, write_site_maps

__all__ = ["component_maps", "consortium_privacy", "headline", "states_section", "to_voxels", "write_maps",
           "write_states"]


def component_maps(space: dict, basis, eigenvalues, W) -> np.ndarray:
    """z-scored spatial maps in voxels (voxels x R): the ICA mixing in the released basis, parcels painted back."""
    return painted(space_parcels(space), spatial_maps(basis, eigenvalues, W))


def to_voxels(space: dict, A: np.ndarray) -> np.ndarray:
    """Feature values (rows) painted back to the mask's voxels: parcels expanded, voxels as they are."""
    parcels = space_parcels(space)
    return parcels.expand(A) if parcels is not None else A


def write_maps(space: dict, basis, eigenvalues, W, path, *, signal: dict | None = None) -> tuple[Path, np.ndarray]:
    """``components.nii.gz`` (one volume per component on the mask's grid), ``components.tsv`` beside it (each
    component named, :mod:`dpneuro.run.naming`, and with ``signal`` marked when it is below the privacy noise)
    and the voxel maps written."""
    maps = component_maps(space, basis, eigenvalues, W)
    path = write_components(maps, space["mask"], path)
    mask, affine = load_mask(space["mask"])
    write_component_table(component_labels(maps, mask, affine, eigenvalues, W), table_path(path), signal=signal)
    return path, maps


def table_path(components) -> Path:
    """Where ``components.tsv`` lies: beside the maps."""
    return Path(components).with_name("components.tsv")


def fnc_matrix(vector) -> np.ndarray:
    """The R x R Fisher-z matrix of an FNC vector (upper triangle, row by row; diagonal 0)."""
    return state_matrices(np.asarray(vector, np.float64)[:, None], fisher=False)[0] - np.eye(
        n_components_of(len(vector)))


def noise_names(signal: dict | None) -> list[str]:
    """The components below the privacy noise (:func:`dpneuro.run.expectations.signal_components`), by name."""
    return [] if signal is None else [f"IC{k + 1:02d}" for k, on in enumerate(signal["signal"]) if not on]


def write_fnc(vector, noise_var: float, folder, *, bound: float, signal: dict | None = None) -> dict[str, Any]:
    """The consortium's static FNC in ``folder``: ``fnc.tsv`` (R x R, Fisher z, components.nii.gz's order) and
    ``fnc.json`` (what it is, the noise each entry carries and the components below the privacy noise, whose
    entries are no finding)."""
    folder = Path(folder)
    Z = fnc_matrix(vector)
    names = [f"IC{i + 1:02d}" for i in range(Z.shape[0])]
    with open(folder / "fnc.tsv", "w") as f:
        f.write("\t".join(["component", *names]) + "\n")
        for name, row in zip(names, Z):
            f.write(name + "\t" + "\t".join(f"{x:.6g}" for x in row) + "\n")
    noise_sd = float(np.sqrt(max(noise_var, 0.0)))
    write_json(folder / "fnc.json", {
        "units": "Fisher z", "noise_sd": noise_sd, "subject_bound": bound, "noise_components": noise_names(signal),
        "description": "The consortium's mean static FNC: every subject's Fisher-z correlation between its component "
                       "time courses, bounded at its site (L2 norm of its pairs <= subject_bound), averaged through "
                       "one CAPE release per site; each entry carries Gaussian noise of standard deviation noise_sd "
                       "(diagonal: 0, not released). An entry of a component in noise_components (below the "
                       "privacy noise, components.tsv) is no finding."})
    return {"tsv": str(folder / "fnc.tsv"), "json": str(folder / "fnc.json"), "noise_sd": noise_sd,
            "noise_components": noise_names(signal)}


#: what the group statistics call significant: FDR (Benjamini-Hochberg) q below this
FDR_LEVEL = 0.05
#: the report lists at most this many significant effects per contrast (group_effects.tsv has them all)
SHOWN = 20
GROUP_COLUMNS = ("contrast", "measure", "estimate", "se", "ci_low", "ci_high", "p", "q", "noise_sd", "signal")


def measure_signal(name: str, signal: dict | None) -> bool:
    """Whether a measure (:func:`dpneuro.algorithms.glm.measure_names`) involves only components above the
    privacy noise (a brain-state measure, of every component's FNC, counts as signal)."""
    noise = set(noise_names(signal))
    return not any(part in noise for part in name.replace("-", " ").split())


def _findings_q(rows: list[dict]) -> None:
    """Each row's q: Benjamini-Hochberg within its contrast over the measures of signal components only (the
    findings' family; NaN for a measure of a noise component, which is no finding)."""
    for contrast in dict.fromkeys(r["contrast"] for r in rows):
        mine = [r for r in rows if r["contrast"] == contrast and r["signal"]]
        if mine:
            q = stats.false_discovery_control([r["p"] for r in mine], method="bh")
            for r, v in zip(mine, q):
                r["q"] = float(v)
        for r in rows:
            if r["contrast"] == contrast and not r["signal"]:
                r["q"] = float("nan")


def write_group_effects(cfg: RunConfig, glm: dict, folder, *, signal: dict | None = None) -> dict[str, Any]:
    """The group statistics in ``folder``: ``group_effects.tsv`` (one row per contrast and measure) and
    ``group_effects.json`` (the design, the subjects per site, how the intervals were made). A measure of a
    component below the privacy noise (``signal``) is marked and left out of the FDR's family."""
    folder = Path(folder)
    settings = glm_settings(cfg, None if glm.get("networks") is None else tuple(glm["networks"]))
    contrasts = [lab for lab, _, _ in settings.design.contrasts()]
    names = list(glm.get("measures") or settings.names)
    # a hypothesis of a network pair the run has no components for: measured as 0 everywhere, no finding
    present = set(measure_names(("networks",), cfg.n_components, 0, settings.networks))
    absent = [n for n in names if n.startswith("networks ") and n not in present]
    rows = []
    for c, contrast in enumerate(contrasts):
        for q, name in enumerate(names):
            rows.append({"contrast": contrast, "measure": name,
                         **{k: float(np.asarray(glm[k])[c, q]) for k in GROUP_COLUMNS[2:-1]},
                         "signal": measure_signal(name, signal) and name not in absent})
    _findings_q(rows)
    unresolved = [c for c, off in zip(contrasts, np.asarray(glm.get("unresolved", [False] * len(contrasts)))) if off]
    for r in rows:  # a contrast the budget does not resolve: no finding (its errors move every measure together)
        if r["contrast"] in unresolved:
            r["q"] = float("nan")
    with open(folder / "group_effects.tsv", "w") as f:
        f.write("\t".join(GROUP_COLUMNS) + "\n")
        for r in rows:
            f.write("\t".join([r["contrast"], r["measure"], *(f"{r[k]:.6g}" for k in GROUP_COLUMNS[2:-1]),
                               str(r["signal"])]) + "\n")
    counts = {s.name: int(n) for s, n in zip(cfg.sites, np.asarray(glm["counts"]))}
    floored = int(np.asarray(glm.get("floored", 0)))
    # what these intervals can find: the smallest effect found with 80 % power, per contrast and family
    tested = max(1, sum(measure_signal(n, signal) for n in names))  # the FDR's family: a contrast's signal measures
    found_at = {contrast: {fam: detectable(float(np.median(np.asarray(glm["se"])[c, sl])), tested)
                           for fam, sl in settings.families.items() if sl.stop > sl.start}
                for c, contrast in enumerate(contrasts)}
    write_json(folder / "group_effects.json", {
        "design": cfg.design, "covariates": cfg.covariates, "columns": list(settings.design.columns),
        "measures": list(settings.measures), "subjects": counts, "level": settings.level, "fdr_level": FDR_LEVEL,
        "design_directions_shrunk": floored, "unresolved_contrasts": unresolved,
        "noise_components": noise_names(signal),
        "detectable_80": found_at, "not_measured": absent,
        "design_snr": float(np.asarray(glm.get("design_snr", np.inf))),
        "description": "Each contrast's effect on every measure from one linear model per measure with an intercept "
                       "per site (within-site effects), fitted from sufficient statistics each site bounded and "
                       "released through CAPE, every term unbiased under the noise. Continuous covariates: effect "
                       "per unit; a level: its difference from the reference. se: the sampling error (each family's "
                       "pooled residual variance) and the release's public noise (delta method); p: t test (N - S - "
                       "C degrees of freedom); q: Benjamini-Hochberg within each contrast over the measures of "
                       "components above the privacy noise (signal: true; a measure of a component in "
                       "noise_components is no finding, q NaN); noise_sd: the part of the estimate's standard "
                       "deviation the privacy noise adds."})
    return {"tsv": str(folder / "group_effects.tsv"), "json": str(folder / "group_effects.json"),
            "subjects": counts, "level": settings.level, "shrunk": floored, "p": settings.design.p,
            "unresolved": unresolved,
            "detectable_80": found_at}


def read_group_effects(path) -> list[dict[str, Any]]:
    """The rows of a ``group_effects.tsv`` (``signal`` as a bool)."""
    def value(k: str, v: str) -> Any:
        return v if k in ("contrast", "measure") else v == "True" if k == "signal" else float(v)

    with open(path) as f:
        header = f.readline().rstrip("\n").split("\t")
        return [{"signal": True, **{k: value(k, v) for k, v in zip(header, line.rstrip("\n").split("\t"))}}
                for line in f]


def glm_section(glm: dict | None, table: list[dict], figs: Path) -> dict | None:
    """The report's group-statistics section from :func:`write_group_effects`'s record: per contrast the
    significant effects (FDR q < :data:`FDR_LEVEL`; else the five smallest p) and, with FNC measures, the matrix
    of t values with the significant edges marked."""
    if not glm:
        return None
    rows = read_group_effects(glm["tsv"])
    networks = [r["network_name"] for r in table] if table and table[0]["network"] != "unnamed" else None
    out = []
    hidden = [not r.get("signal", True) for r in table] if table else None
    for i, contrast in enumerate(dict.fromkeys(r["contrast"] for r in rows)):
        every = [r for r in rows if r["contrast"] == contrast]
        mine = [r for r in every if r["signal"]]  # a measure of a noise component is no finding
        sig = [r for r in mine if r["q"] < FDR_LEVEL]
        shown = sorted(sig or mine, key=lambda r: r["p"])[:SHOWN if sig else 5]
        summary = (f"{len(sig)} of {len(mine)} measures differ at FDR q < {FDR_LEVEL:g}"
                   + (f"; the {SHOWN} with the smallest p are listed" if len(sig) > SHOWN else "") if sig else
                   f"no measure of {len(mine)} differs at FDR q < {FDR_LEVEL:g}"
                   + ("; the five smallest p are listed" if mine else ""))
        if len(mine) < len(every):
            summary += (f". {len(every) - len(mine)} measures of components below the privacy noise are no "
                        "findings and are left out (group_effects.tsv marks them, signal = False)")
        entry = {"label": contrast, "summary": summary, "rows": shown, "figure": None}
        edges = [r for r in every if r["measure"].startswith("fnc ")]
        if edges:
            t = np.array([r["estimate"] / r["se"] if r["se"] > 0 else 0.0 for r in edges])
            marks = fnc_matrix(np.array([r["q"] < FDR_LEVEL for r in edges], float)) > 0.5
            entry["figure"] = str(matrix_figure(fnc_matrix(t), networks, figs / f"group_effects_{i + 1}.png",
                                                label="t (estimate / se)", title=f"FNC: {contrast}", least=3.0,
                                                marks=marks, hidden=hidden))
        out.append(entry)
    n, per_site = sum(glm["subjects"].values()), ", ".join(f"{k} {v}" for k, v in glm["subjects"].items())
    text = (f"Every measure's linear model over {n} subjects ({per_site}), with an intercept per site. Each site "
            "bounded its subjects' contributions and released their sufficient statistics through CAPE; the "
            f"{glm['level']:.0%} intervals and the p-values include the release's noise, "
            "q is the Benjamini-Hochberg FDR within each contrast, and noise sd is what the privacy noise adds to "
            "each estimate's uncertainty. Every effect: group_effects.tsv.")
    if glm.get("detectable_80"):
        text += (" With these intervals an effect is found with 80 % power from about: " + "; ".join(
            f"{contrast}: " + ", ".join(f"{v:.3g} ({fam})" for fam, v in fams.items())
            for contrast, fams in glm["detectable_80"].items()) + " (one effect among the contrast's measures).")
    if glm.get("shrunk"):
        text += (f" The noise on the released design moments drowned {glm['shrunk']} of its directions: their "
                 "effects are shrunk toward zero"
                 + (f", and {', '.join(glm.get('unresolved') or [])} report no finding (q NaN): the design's noise "
                    "would move every measure together" if glm.get("unresolved") else "")
                 + ". More subjects per site or a larger share of the budget (question = \"group differences\") "
                   "resolve it.")
    return {"text": text, "contrasts": out, "level": glm["level"]}


def read_fnc(components) -> np.ndarray | None:
    """The consortium's FNC matrix (``fnc.tsv`` beside the maps), or None when the run had no FNC stage."""
    path = Path(components).with_name("fnc.tsv")
    if not path.exists():
        return None
    return np.loadtxt(path, skiprows=1, dtype=str, ndmin=2)[:, 1:].astype(np.float64)


def write_subject_fnc(F: np.ndarray, subject_ids: list[str], path) -> Path:
    """A site's own subjects' FNC (never released): one row per subject, one column per pair (Fisher z)."""
    R = n_components_of(F.shape[1])
    iu = np.triu_indices(R, 1)
    pairs = [f"IC{i + 1:02d}-IC{j + 1:02d}" for i, j in zip(*iu)]
    with open(path, "w") as f:
        f.write("\t".join(["subject", *pairs]) + "\n")
        for sid, row in zip(subject_ids, F):
            f.write(str(sid) + "\t" + "\t".join(f"{x:.6g}" for x in row) + "\n")
    return Path(path)


def write_states(vectors, occupancy, folder, *, method: str = "") -> dict[str, Any]:
    """The dFNC states' files in ``folder``: ``states.npy`` (K x R x R connectivity matrices, ordered like the
    components) and ``states.json`` (the consortium's occupancy, the state vectors' meaning)."""
    folder = Path(folder)
    mats = state_matrices(vectors)
    np.save(folder / "states.npy", mats)
    occ = [float(x) for x in occupancy]
    write_json(folder / "states.json", {
        "n_states": int(mats.shape[0]), "occupancy": occ, "method": method,
        "states": "states.npy: K x R x R correlation matrices between the components (components.nii.gz order), "
                  "the centroids of the consortium's dFNC windows (Fisher z averaged, then tanh)"})
    return {"matrices": str(folder / "states.npy"), "json": str(folder / "states.json"), "occupancy": occ}


def states_section(states: dict, figs: Path) -> dict:
    """The report's brain-states section: ``states`` has the paths of :func:`write_states`, the consortium's
    ``occupancy`` and optionally ``truth`` (matched correlations with a synthetic truth)."""
    mats = np.load(states["matrices"])
    return {"n_states": int(mats.shape[0]), "occupancy": states["occupancy"], "truth": states.get("truth"),
            "figure": str(states_figure(mats, states["occupancy"], figs / "states.png"))}


def consortium_privacy(cfg: RunConfig, ledgers: dict[str, PrivacyLedger], n_subjects: dict[str, int], *,
                       assumptions: tuple[str, ...] = ()) -> dict[str, Any]:
    """``privacy.json``: every site's ledger composed and summarised, with the run's assumptions in words."""
    for name, led in ledgers.items():
        led.owner = name
    priv = privacy_report(ledgers, delta=cfg.delta, n_subjects=n_subjects, plan=cfg.plan,
                          n_colluding=cfg.n_colluding, seeded=cfg.seed is not None, scaling_note=contribution_note(cfg))
    priv["assumptions"] += list(assumptions)
    return priv


def influence_notes(public: dict) -> list[str]:
    """What one deviating site can do to the result, in words, from the influence each stage's aggregator kept
    (:func:`dpneuro.protocol.cape.phases.site_influence`)."""
    notes = []
    for stage, r in public.items():
        for name, v in ((r.get("influence") or {}) if isinstance(r, dict) else {}).items():
            notes.append(
                f"A site that deviates from the protocol can move the averaged release {name!r} of stage {stage!r} "
                f"by at most {v['largest']:.3g} in Frobenius norm ({v['relative']:.3g} times the public bound "
                f"{v['bound']:.3g} of one site's statistic; an honest site's own data can move it by up to "
                f"{v['honest']:.3g}) before the aggregator's checks stop the run: its own release's norm, and the "
                "combined release's once the zero-sum noise cancels.")
    return notes


def headline(cfg: RunConfig, priv: dict, *, n_components: int, n_subjects: int, warnings: list[str],
             ica: str = "") -> list[str]:
    """The box at the top of the consortium's report: what ran, the privacy headline, the warnings."""
    what = (f"{n_components} components from {len(cfg.sites)} sites, {n_subjects} subjects; plan '{cfg.plan}'"
            + (f"; {ica}" if ica else "") + ".")
    return report_headline(what, priv, warnings)


def fnc_section(fnc: dict | None, table: list[dict], figs: Path) -> dict | None:
    """The report's FNC section from :func:`write_fnc`'s files: the matrix drawn in the components' (network)
    order with the networks marked, and the noise each entry carries."""
    if not fnc:
        return None
    Z = read_fnc(fnc["tsv"])
    networks = [r["network"] for r in table] if len(table) == len(Z) else None
    hidden = [not r.get("signal", True) for r in table] if len(table) == len(Z) else None
    return {"figure": str(fnc_figure(Z, networks, fnc["noise_sd"], figs / "fnc.png", hidden=hidden)),
            "noise_sd": fnc["noise_sd"], "n_components": int(len(Z)),
            "noise_components": list(fnc.get("noise_components", []))}


def component_title(row: dict) -> str:
    """A component's caption from its components.tsv row: network, hemisphere, a noise flag; a component below
    the privacy noise is named noise and nothing else."""
    if not row.get("signal", True):
        return "noise (below the privacy noise)"
    if row["network"] == "unnamed":
        return ""
    side = "" if row["hemisphere"] == "bilateral" else f", {row['hemisphere']}"
    return f"{row['network_name']}{side}" + (" (noise?)" if row["noise"] else "")


#: the consortium report's title, the same for a simulation and a deployed aggregator
REPORT_TITLE = "dpneuro: decentralized private ICA"


def consortium_report_parts(cfg: RunConfig, space: dict, components: str, priv: dict, unmixing: dict, *,
                            n_subjects: int, warnings: list[str], template_problem: str | None, figs: Path,
                            states: dict | None = None, truth: dict | None = None,
                            fnc: dict | None = None, spectrum: dict | None = None,
                            glm: dict | None = None) -> dict[str, Any]:
    """What the consortium's report shows, drawn the same way by the simulation and the deployed aggregator: each
    component's figures, the unmixing's convergence, the headline (with the agreement with a synthetic truth,
    when known) and the brain states. ``unmixing`` is the unmixing stage's public result."""
    table = read_component_table(table_path(components))
    comps, maps_note, _ = render_components(components, space["mask"], figs, truth=truth,
                                            interactive=cfg.interactive_maps, problem=template_problem,
                                            names=[component_title(r) for r in table] or None)
    titles = [f"IC{k + 1:02d} {component_title(r)}".strip() for k, r in enumerate(table)] or [
        f"IC{k + 1:02d}" for k in range(len(comps))]
    overview = overview_figure(components, space["mask"], titles, figs / "overview.png")
    spectrum_png = None if not spectrum else spectrum_figure(spectrum["eigenvalues"], figs / "spectrum.png",
                                                             edge=spectrum["edge"])
    rounds = int(unmixing["rounds"])
    conv = (convergence_figure({k: np.asarray(v, float) for k, v in unmixing["history"].items()},
                               figs / "convergence.png") if rounds else None)
    top = headline(cfg, priv, n_components=int(np.asarray(unmixing["W"]).shape[0]), n_subjects=n_subjects,
                   warnings=warnings, ica=describe_unmixing(cfg, rounds, str(unmixing["status"])))
    said = (spectrum or {}).get("sentence")
    if said and not any(said in w for w in top):  # every component's standing, said once
        top.insert(2, said)
    metrics = truth["metrics"] if truth else None
    if metrics:
        top.append("Agreement with the ground truth: " + ", ".join(f"{k} = {v:.3f}" for k, v in metrics.items()))
    return {"components": comps, "maps_note": maps_note, "convergence_png": conv, "headline": top,
            "metrics": metrics, "component_table": table, "fnc": fnc_section(fnc, table, figs),
            "glm": glm_section(glm, table, figs),
            "overview_png": str(overview), "spectrum": None if spectrum_png is None else {**spectrum,
                                                                                          "figure": str(spectrum_png)},
            "states": None if states is None else states_section(states, figs)}


def write_consortium_report(out: Path, parts: dict[str, Any], priv: dict, *, timings: dict, run: dict,
                            notes: list[str], site_maps: dict | None, data: dict) -> Path:
    """``out/report.html`` from :func:`consortium_report_parts` and what the caller recorded of its run."""
    return write_report(out / "report.html", title=REPORT_TITLE, headline=parts["headline"],
                        components=parts["components"], privacy=priv, metrics=parts["metrics"],
                        convergence_png=parts["convergence_png"], maps_note=parts["maps_note"], timings=timings,
                        component_table=parts["component_table"], fnc=parts["fnc"], glm=parts["glm"],
                        overview_png=parts["overview_png"], spectrum=parts["spectrum"],
                        run=run, notes=notes, states=parts["states"], site_maps=site_maps, data=data)


def released_spectrum(cfg: RunConfig, eigenvalues, W, n_samples: dict[str, int], dim: int, priv: dict) -> dict:
    """The released eigenvalues against the noise the plan put on the released matrix (per-entry std sigma and
    its edge, :func:`dpneuro.privacy.rmt.noise_edge`; None without noise), which components stand above it (``signal``,
    :func:`dpneuro.run.expectations.signal_components`) and the sentence every output says it with."""
    noise = expected_noise(cfg, n_samples, dim, priv)
    sigma = noise.get("covariance")
    signal = signal_components(eigenvalues, W, sigma, dim)
    spec = noise.get("covariance spectral norm")
    expected = None if spec is None else supported_components(spec, dim, cfg.contribution, cfg.n_components)
    return {"eigenvalues": [float(x) for x in eigenvalues], "dim": dim, "noise_sd": sigma,
            "edge": signal["edge"], "signal": signal, "expected": expected,
            "sentence": signal_sentence(signal, expected)}


def consortium_signal(cfg: RunConfig, public: dict, ledgers: dict[str, PrivacyLedger],
                      n_samples: dict[str, int]) -> dict:
    """Which components stand above the privacy noise (:func:`released_spectrum`'s ``signal``) from the stages'
    public results and every site's ledger: what the aggregator tells the sites, so that their own
    components.tsv says what the consortium's does."""
    V, lam = np.asarray(public["reduce"]["basis"]), np.asarray(public["reduce"]["eigenvalues"])
    priv = {"sites": {name: {"ledger": led.to_dict()} for name, led in ledgers.items()}}
    return released_spectrum(cfg, lam, np.asarray(public["unmix"]["W"]), n_samples, int(V.shape[0]), priv)["signal"]


def write_consortium_outputs(cfg: RunConfig, space: dict, public: dict, ledgers: dict[str, PrivacyLedger],
                             n_subjects: dict[str, int], n_samples: dict[str, int], out: Path, *,
                             assumptions: tuple[str, ...] = (), transport: str = "") -> dict[str, Any]:
    """The consortium's files in ``out`` from the stages' public results (:mod:`dpneuro.run.stages`) and every
    site's ledger: ``components.nii.gz``, ``privacy.json``, the brain states; and the run's warnings.

    The simulation's maps stage and the deployed aggregator both write them here. Returns the paths, the
    voxel maps (``maps``), the privacy record (``priv``), ``warnings``, the mask's ``template_problem`` and,
    with brain states, ``states`` (paths and the consortium's occupancy).
    ``transport``: what authenticates a deployment's messages, recorded among the assumptions.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    V, lam = np.asarray(public["reduce"]["basis"]), np.asarray(public["reduce"]["eigenvalues"])
    W = np.asarray(public["unmix"]["W"])
    priv = consortium_privacy(cfg, ledgers, n_subjects, assumptions=(*assumptions, *([transport] if transport else []),
                                                                     *influence_notes(public)))
    spectrum = released_spectrum(cfg, lam, W, n_samples, int(V.shape[0]), priv)
    signal = spectrum["signal"]
    comp_path, maps = write_maps(space, V, lam, W, out / "components.nii.gz", signal=signal)
    if transport:
        priv["transport"] = transport
    priv["site_influence"] = {stage: dict(r["influence"]) for stage, r in public.items()
                              if isinstance(r, dict) and r.get("influence")}
    warnings = run_warnings(cfg, n_samples, int(V.shape[0]), priv)
    if signal["n_signal"] < len(signal["signal"]):
        warnings.append(f"WARNING: {spectrum['sentence']}")
    problem = template_problem(space["mask"])
    if problem:
        warnings.append(f"WARNING: {problem}")
    if np.any(lam <= 0):
        warnings.append(f"WARNING: {int(np.sum(lam <= 0))} of the {lam.size} released eigenvalues are <= 0: the "
                        "noise exceeds the signal in those directions, so their components are noise (whitened with "
                        "a floor). Ask for fewer components or spend more budget (dpneuro budget says how many it "
                        "supports).")
    result: dict[str, Any] = {"components": str(comp_path), "maps": maps,
                              "privacy": str(write_json(out / "privacy.json", priv)), "priv": priv,
                              "warnings": warnings, "template_problem": problem, "states": None,
                              "spectrum": spectrum, "signal": signal}
    result["fnc"] = None
    if "fnc" in public.get("fnc", {}):
        fnc = public["fnc"]
        result["fnc"] = write_fnc(fnc["fnc"], float(fnc.get("noise_var", 0.0)), out,
                                  bound=fnc_settings(cfg).scale(len(fnc["fnc"])), signal=signal)
    result["glm"] = None
    if "estimate" in public.get("glm", {}):
        result["glm"] = write_group_effects(cfg, public["glm"], out, signal=signal)
    states = public.get("states", {})
    if "vectors" in states:
        result["states"] = write_states(states["vectors"], states["occupancy"], out, method=cfg.states_method)
    return result


def write_site_outputs(cfg: RunConfig, info: dict, space: dict, public: dict, out: Path, *, unmix_input=None,
                       timecourses=None, timer, progress: bool = False) -> dict[str, Any]:
    """A site's own files in ``out``, computed at the site from the public results and its own data:
    ``timecourses.tsv`` (its subjects' time courses), ``fnc_subjects.tsv`` (each subject's FNC, with the FNC
    stage), ``site_maps.nii.gz`` (its voxel maps, when the run makes them) and ``states.tsv`` (its subjects' dFNC
    state statistics, with brain states). Nothing here is released.

    ``info`` is the site's loader record; ``unmix_input`` its input of the unmixing when it kept it (a deployed
    site), else whitened here from its data matrix; ``timecourses`` its time courses when the states stage
    already computed them (a deployed site: nothing is whitened again); ``timer(name)`` a context manager that
    times each part. The simulation's maps stage writes every site's, a deployed site its own.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    site = info["site"]
    V, lam = public["reduce"]["basis"], public["reduce"]["eigenvalues"]
    with timer(label(cfg, "timecourses", site)):
        if timecourses is not None:
            S = np.asarray(timecourses)
        else:
            if unmix_input is None:  # a simulation keeps no inputs; with spatial ICA the sites took no part
                unmix_input = unmixing_input(cfg, info["X"], V, lam)
            S = time_courses(np.asarray(public["unmix"]["W"]), unmix_input, np.asarray(public["unmix"]["b"]))
        result: dict[str, Any] = {"timecourses": str(write_timecourses(S, out / "timecourses.tsv", info)),
                                  "site_maps": None, "site_maps_values": None, "states_occupancy": None,
                                  "states_summary": None, "fnc_subjects": None,
                                  "site_maps_ica": None}
    if cfg.fnc:  # the same per-subject FNC the site's release averaged, kept here for the group statistics
        F = site_fnc(S, [b - a for a, b in info["boundaries"]])
        result["fnc_subjects"] = str(write_subject_fnc(F, info["subject_ids"], out / "fnc_subjects.tsv"))
    if made(cfg, space):
        with timer(label(cfg, "site_maps", site)):
            path, result["site_maps_values"] = write_site_maps(cfg, info, space, S, out / "site_maps.nii.gz",
                                                               progress=progress, record=result)
            result["site_maps"] = str(path)
    C = public.get("states", {}).get("vectors")
    if C is not None:
        with timer(label(cfg, "occupancy", site)):
            lengths = [b - a for a, b in info["boundaries"]]
            ws = site_windows(cfg, S, lengths, tr=info.get("tr"), where=f"site {site}")
            dyn = site_dynamics(ws, np.asarray(C), cfg.states_metric)
            result["states_occupancy"] = str(write_dynamics(dyn, info["subject_ids"], out / "states.tsv"))
            result["states_summary"] = {"occupancy": dyn["occupancy"].mean(axis=0).tolist(),
                                        "dwell_seconds": dyn["dwell_seconds"].mean(axis=0).tolist(),
                                        "transitions": float(dyn["transitions"].mean())}
    return result
