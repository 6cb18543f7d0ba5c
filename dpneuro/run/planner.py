"""Privacy budget planning: what a configuration spends, and the settings that spend a target.

The planner never models releases on its own: it builds every stage's
algorithm from the run configuration exactly as the run does
(:mod:`dpneuro.run.factory`), asks it for each site's releases from the
site's public counts, and records them with the function the CAPE protocol
records real releases with (:func:`dpneuro.protocol.cape.planned_ledgers`). So the
planned ledgers are the ones the run fills (for a run that uses all its
ICA rounds; one that stops early spends less), and the headline is the
same: eps against the aggregator colluding with the assumed sites. To
spend a target it rescales each releasing stage's noise multiplier, which
the stage's algorithms report with the setting's calibration (``budget``).
What the planned noise leaves of the maps is :mod:`dpneuro.run.expectations`'s.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from dpneuro._utils.errors import DataValidationError
from dpneuro.algorithms.glm import REFERENCE_SD, contrast_errors, detectable, kind
from dpneuro.config import ConfigError, RunConfig, check_delta
from dpneuro.config.schema import QUESTIONS
from dpneuro.data.cleaning import CleaningError
from dpneuro.data.discovery import subject_lengths
from dpneuro.privacy import PrivacyLedger, gdp_epsilon, gdp_mu, split_gdp
from dpneuro.privacy.summary import headline_lines, privacy_report
from dpneuro.run.expectations import (
    REFERENCE_DIMS,
    expected_noise,
    last_component_overlap,
    random_matrix_line,
    reference_spectrum,
    run_warnings,
    supported_components,
)
from dpneuro.run.factory import epsilon_field, glm_settings
from dpneuro.run.features import features
from dpneuro.run.stages import RELEASES, release


@dataclass(frozen=True)
class SiteShape:
    """A site's public counts: its subjects' time points (the privacy unit is the subject)."""

    name: str
    lengths: tuple[int, ...]

    @property
    def n_samples(self) -> int:
        return int(sum(self.lengths))


def _per_site(value, n_sites: int, flag: str) -> list[int]:
    """One count per site from a number (every site) or a sequence (one entry per site, in the sites' order)."""
    values = [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)] * n_sites
    if len(values) != n_sites:
        raise ConfigError(f"{flag}: {len(values)} numbers for {n_sites} sites; give one, or one per site")
    if min(values) < 1:
        raise ConfigError(f"{flag} must be >= 1, got {values}")
    return values


def site_shapes(cfg: RunConfig, *, subjects: int | Sequence[int] | None = None,
                timepoints: int | Sequence[int] | None = None) -> list[SiteShape]:
    """Each site's subject lengths, or ``subjects`` x ``timepoints`` (a number for every site, or one per site:
    unequal sites are planned without their data).

    Read as the site reads its data (:func:`dpneuro.data.discovery.subject_lengths`: the same discovery, each run's
    volumes from its header and, when scrubbing, the volumes its confounds keep; no image data read).
    A subject that ``on_bad_subject = "skip"`` leaves out at load time is still counted here.
    """
    if subjects is not None:
        n = len(cfg.sites)
        counts, lengths = _per_site(subjects, n, "--subjects"), _per_site(timepoints or 150, n, "--timepoints")
        return [SiteShape(s.name, (t,) * c) for s, c, t in zip(cfg.sites, counts, lengths)]
    cleaning = cfg.cleaning()
    out = []
    for s in cfg.sites:
        src = s.files or s.path
        if not src or (isinstance(src, str) and not Path(src).exists()):
            raise ConfigError(f"site {s.name!r}: its data are not here ({src or 'no path'}); give --subjects and "
                              "--timepoints to plan without data")
        try:
            lengths = subject_lengths(src, cleaning, filters=cfg.bids, subjects_tsv=s.subjects_tsv or None,
                                      exclude=s.exclude)
            out.append(SiteShape(s.name, tuple(lengths)))
        except (DataValidationError, CleaningError) as exc:
            raise ConfigError(f"site {s.name!r}: {exc}") from None
    return out


#: the stages that release (``planned_ledgers(stages=...)``): a whole run, or the PCA alone
RELEASING_STAGES = tuple(r.name for r in RELEASES)


def releases_in(cfg: RunConfig, stage: str) -> bool:
    """Whether ``stage`` spends privacy in a run of ``cfg`` (each stage of :data:`dpneuro.run.stages.RELEASES`
    says so: spatial ICA is post-processing of the basis, PD-SVD adds no noise, brain states only when asked
    for)."""
    return release(stage).spends(cfg)


def _planned_stages(cfg: RunConfig, stages: tuple[str, ...]) -> list[str]:
    """The stages whose ledgers a plan of ``stages`` predicts: the reduction always, the others that spend."""
    return [rel.name for rel in RELEASES if rel.planned is not None
            and (rel.name == "reduce" or (rel.name in stages and rel.spends(cfg)))]


def stage_algorithms(cfg: RunConfig, dim: int, stages: tuple[str, ...] = RELEASING_STAGES) -> dict[str, list]:
    """Each planned stage's algorithms, built once from ``cfg``: the planner predicts the ledgers and reads the
    budget settings from the same objects."""
    return {name: release(name).algorithms(cfg, dim) for name in _planned_stages(cfg, stages)}


def planned_ledgers(cfg: RunConfig, shapes: list[SiteShape], dim: int,
                    stages: tuple[str, ...] = RELEASING_STAGES, *,
                    algorithms: dict[str, list] | None = None) -> dict[str, PrivacyLedger]:
    """Every site's ledger of a run of ``cfg`` (its ``stages``; the reduction always) on sites of these shapes
    (no data needed): each stage's own prediction (:meth:`dpneuro.run.stages.ReleasingStage.plan`), from
    ``algorithms`` (:func:`stage_algorithms`) when the caller built them already."""
    algs = stage_algorithms(cfg, dim, stages) if algorithms is None else algorithms
    per_stage = [release(name).plan(cfg, shapes, dim, algs[name]) for name in _planned_stages(cfg, stages)]
    out = {}
    for i, s in enumerate(shapes):
        led = PrivacyLedger.merge_all([leds[i] for leds in per_stage if leds[i] is not None])
        led.owner = s.name
        out[s.name] = led
    return out


@dataclass
class BudgetPlan:
    """What a configuration spends per site, and the noise to expect; prints as a table."""

    config: RunConfig
    shapes: list[SiteShape]
    dim: int
    privacy: dict[str, Any]
    target_epsilon: float | None = None
    #: the configuration the plan was made from (its own per-stage settings, before the split)
    base: RunConfig | None = None

    @property
    def epsilon(self) -> dict[str, float]:
        """Headline eps per site (against the aggregator and its colluders)."""
        return dict(self.privacy["epsilon"])

    def noise(self) -> dict[str, float]:
        """Expected noise std of the averaged releases (see :func:`expected_noise`)."""
        return expected_noise(self.config, self._n_samples(), self.dim, self.privacy)

    def warnings(self) -> list[str]:
        return run_warnings(self.config, self._n_samples(), self.dim, self.privacy)

    def _n_samples(self) -> dict[str, int]:
        return {s.name: s.n_samples for s in self.shapes}

    def lines(self) -> list[str]:
        cfg = self.config
        M = [len(s.lengths) for s in self.shapes]
        out = []
        if self.target_epsilon is not None:
            out.append(f"proposal for eps = {self.target_epsilon:g} per site at delta = {cfg.delta:g} "
                       f"(against the aggregator and its colluders):")
        temporal = releases_in(cfg, "unmix")
        cumulant = cfg.cumulant_unmixing
        ica = ("temporal ICA: cumulant unmixing (the whitening refined, then the subjects' fourth-order cumulants: "
               "2 releases)" if cumulant
               else f"temporal ICA: rounds J = {cfg.ica_rounds}, clip {cfg.clip_G:g} ({cfg.ica_clip_unit}), "
               f"bias {'on' if cfg.ica_bias else 'off'}" if temporal
               else "spatial ICA (post-processing of the released basis: no further release)")
        out.append(f"sites S = {len(self.shapes)}, subjects per site {M} (privacy unit: one subject, replace "
                   f"neighbours), D = {self.dim} features, plan '{cfg.plan}', reduction '{cfg.reduction}', {ica}")
        if not releases_in(cfg, "reduce"):
            out.append("reduction PD-SVD: secure sums without privacy noise; the run is not differentially "
                       "private (the report states what PD-SVD reveals)")
        out.append((f"settings: pca_epsilon = {cfg.pca_epsilon:.6g} (at delta/2), subject bound "
                    f"{cfg.pca_subject_bound:g}, subject contribution '{cfg.contribution}'"
                    if releases_in(cfg, "reduce")
                    else "settings:")
                   + (f", cumulant_epsilon = {cfg.cumulant_epsilon:.6g} (at delta/2) for its two releases together"
                      if cumulant else
                      f", ica_epsilon_i = {cfg.ica_epsilon_i:.6g}, ica_delta_i = {cfg.ica_delta_i:g} per release, "
                      f"calibration '{cfg.calibration}'" if temporal else "")
                   + (f", brain states K = {cfg.brain_states}: states_epsilon = {cfg.states_epsilon:.6g} (at "
                      "delta/2) for the whole stage" if releases_in(cfg, "states") else "")
                   + (f", group statistics ({cfg.design}): glm_epsilon = {cfg.glm_epsilon:.6g} (at delta/2)"
                      if releases_in(cfg, "glm") else ""))
        out += headline_lines(self.privacy)
        for name, s in self.privacy["sites"].items():
            stages = ", ".join(f"{k} {gdp_epsilon(cfg.delta, v):.3g}" for k, v in s["by_stage_mu"].items() if v > 0)
            out.append(f"  {name}: eps = {s['epsilon']:.3f} (exact GDP), {s['epsilon_rdp']:.3f} (RDP); "
                       f"by stage: {stages}; one site's releases alone at most {s['epsilon_single_release']:.3f}")
        noise = self.noise()
        if noise:
            out.append("expected noise after averaging: " + ", ".join(f"{k} sd {v:.3g}" if "norm" not in k
                                                                         else f"{k} {v:.3g}"
                                                                         for k, v in noise.items()))
            supported = supported_components(noise.get("covariance spectral norm", 0.0), self.dim, cfg.contribution,
                                             cfg.n_components)
            if "covariance spectral norm" in noise and supported is not None:
                spectrum = reference_spectrum(cfg.contribution, cfg.n_components)
                about = (f"{supported} or more" if supported == len(spectrum)
                         else f"about {supported}")
                out.append(f"components this budget supports: {about} on real fMRI at the region level "
                           f"(eigenvalues above the noise; reference: 33 people, 122 regions); n_components = "
                           f"{cfg.n_components}")
                out.append(random_matrix_line(noise["covariance"], self.dim, spectrum, cfg.n_components))
        out += self.question_lines() + self.group_lines()
        return out + self.warnings()

    def question_lines(self) -> list[str]:
        """What the run's question gives each releasing stage of the total, and what the maps lose by it."""
        cfg = self.config
        if self.target_epsilon is None or not QUESTIONS[cfg.question]:
            return []
        mu = stage_mu(self)
        total = sum(v**2 for v in mu.values())
        parts = ", ".join(f"{st} {v**2 / total:.0%} (eps {gdp_epsilon(cfg.delta, v):.3g} alone)"
                          for st, v in mu.items() if v > 0)
        line = f"question \"{cfg.question}\": the budget's shares of mu^2: {parts}"
        maps = _plan_for_target(replace(self.base or cfg, question="maps", epsilon=None), self.shapes, self.dim,
                                self.target_epsilon, pca_share=None, stages=RELEASING_STAGES)
        ours, theirs = components_supported(self), components_supported(maps)
        if ours is not None and theirs is not None:
            line += (f"; the maps lose {theirs - ours} of the components the budget supports for maps alone "
                     f"({ours} instead of {theirs})" if theirs > ours
                     else f"; the maps keep the {ours} components the budget supports for maps alone")
        return [line]

    def group_lines(self) -> list[str]:
        """The smallest effect each contrast finds with 80 % power on a measure of each family, from public
        quantities only (:func:`group_detectable`)."""
        if not releases_in(self.config, "glm"):
            return []
        settings = glm_settings(self.config)
        assumed = ", ".join(f"{k} {REFERENCE_SD[k]:g}" for k in dict.fromkeys(kind(f) for f in settings.families))
        out = [f"group statistics ({self.config.design}): smallest effect found with 80 % power at q < 0.05 "
               f"(one effect among the contrast's {settings.n_measures} measures; residual sd assumed {assumed}; "
               "levels equally frequent at every site):"]
        rows = group_detectable(self.config, [len(s.lengths) for s in self.shapes])
        for row in rows:
            found = (f"{row['detectable']:.3g} (se {row['se']:.3g})" if math.isfinite(row["detectable"])
                     else "none: the budget does not resolve this contrast's design at these sizes")
            out.append(f"  {row['contrast']}, {row['family']} ({row['measures']} measures): {found}; pooled data "
                       f"without privacy: {row['pooled']:.3g}")
        if settings.n_measures > 12:
            out.append("  every measure shares the release's bound: glm_measures = [\"networks\"] (the FNC between "
                       "atlas networks) or glm_hypotheses (the measures named before the run, each bounded alone) "
                       "narrow the intervals")
        return out

    def __str__(self) -> str:
        return "\n".join(self.lines())

    def to_dict(self) -> dict[str, Any]:
        return {"epsilon": self.epsilon, "delta": self.config.delta, "target_epsilon": self.target_epsilon,
                "pca_epsilon": self.config.pca_epsilon, "ica_epsilon_i": self.config.ica_epsilon_i,
                "cumulant_epsilon": self.config.cumulant_epsilon, "ica_unmixing": self.config.ica_unmixing,
                "ica_delta_i": self.config.ica_delta_i, "states_epsilon": self.config.states_epsilon,
                "brain_states": self.config.brain_states, "fnc_epsilon": self.config.fnc_epsilon,
                "glm_epsilon": self.config.glm_epsilon, "sites": {s.name: list(s.lengths) for s in self.shapes},
                "dim": self.dim, "noise": self.noise(), "privacy": self.privacy, "warnings": self.warnings(),
                "lines": self.lines()}


def spend(cfg: RunConfig, shapes: list[SiteShape], dim: int,
          stages: tuple[str, ...] = RELEASING_STAGES) -> BudgetPlan:
    """What a run of ``cfg`` (its ``stages``) spends per site (refuses what the run refuses)."""
    return _spend(cfg.validate(data_sites=()), shapes, dim, stages)


def _spend(cfg: RunConfig, shapes: list[SiteShape], dim: int, stages: tuple[str, ...],
           algorithms: dict[str, list] | None = None) -> BudgetPlan:
    """:func:`spend` of a configuration validated already, from the stages' ``algorithms`` if built already."""
    check_delta(cfg.delta, min(len(s.lengths) for s in shapes))  # as the run does once it has counted
    leds = planned_ledgers(cfg, shapes, dim, stages, algorithms=algorithms)
    priv = privacy_report(leds, delta=cfg.delta, n_subjects={s.name: len(s.lengths) for s in shapes},
                          plan=cfg.plan, n_colluding=cfg.n_colluding, seeded=cfg.seed is not None)
    return BudgetPlan(cfg, shapes, dim, priv)


def _with_multipliers(cfg: RunConfig, z: dict[str, float], budgets: dict) -> RunConfig:
    """``cfg`` with the per-stage settings that give these noise multipliers (stage -> z), each found by the
    calibration of its stage's algorithms (``budgets``: stage -> :class:`~dpneuro.privacy.GaussianBudget`)."""
    changes = {}
    for stage, zs in z.items():
        name, delta = epsilon_field(cfg, stage), budgets[stage].delta
        v = budgets[stage].epsilon_for(zs)
        if not v > 0:
            raise ConfigError(f"the target needs a noise multiplier the setting {name!r} cannot express at delta "
                              f"{delta:g} (eps would be 0); raise the target, lower "
                              f"{'ica_delta_i' if name == 'ica_epsilon_i' else 'delta'}, or use fewer ICA rounds")
        changes[name] = v
    return replace(cfg, **changes)


#: share of mu^2 the planner gives the PCA of a temporal-ICA run: what pca_epsilon 16 with the tuned capeDJICA
#: settings (40 rounds at eps_i 0.7) gives; it did better than a 25 % share on the demo's consortium, and the
#: frontier benchmarks plan at it (benchmarks/README.md)
TEMPORAL_PCA_SHARE = 0.55
#: the same with the cumulant unmixing: the split of the cumulant rows of benchmarks/djica_end_to_end.py that
#: reach its goal (benchmarks/README.md, "Temporal ICA end to end")
CUMULANT_PCA_SHARE = 0.2


def plan_for_target(cfg: RunConfig, shapes: list[SiteShape], dim: int, target_epsilon: float, *,
                    pca_share: float | None = None, stages: tuple[str, ...] = RELEASING_STAGES) -> BudgetPlan:
    """The settings of ``cfg`` rescaled so that the largest headline eps over the sites is ``target_epsilon``.

    ``pca_share`` of mu^2 goes to the reduction, the rest to the later
    releasing stages (ICA rounds, brain states) in the ratio of ``cfg``'s own
    settings; all of it to the reduction when it is the only releasing stage.
    Default: :data:`TEMPORAL_PCA_SHARE` with temporal ICA (the measured best
    split), otherwise every stage keeps its share under ``cfg``'s own settings.
    """
    return _plan_for_target(cfg.validate(data_sites=()), shapes, dim, target_epsilon, pca_share=pca_share,
                            stages=stages)


def _plan_for_target(cfg: RunConfig, shapes: list[SiteShape], dim: int, target_epsilon: float, *,
                     pca_share: float | None, stages: tuple[str, ...]) -> BudgetPlan:
    """:func:`plan_for_target` of a configuration validated already. The stages' algorithms are built once for
    ``cfg`` (its ledgers and its budget settings) and once for the planned settings, whose configuration is
    validated as a run would validate it."""
    if pca_share is None and "unmix" in stages and releases_in(cfg, "unmix") and releases_in(cfg, "reduce"):
        pca_share = CUMULANT_PCA_SHARE if cfg.cumulant_unmixing else TEMPORAL_PCA_SHARE
    if pca_share is not None and not 0 < pca_share < 1:
        raise ConfigError(f"pca_share must be in (0, 1), got {pca_share}")
    if not (target_epsilon > 0 and math.isfinite(target_epsilon)):
        raise ConfigError(f"target epsilon must be a finite number > 0, got {target_epsilon}")
    if cfg.plan == "none" or cfg.reduction in ("none", "pdsvd"):
        raise ConfigError(f"plan {cfg.plan!r} / reduction {cfg.reduction!r}: the reduction adds no noise, so the "
                          "run has no differential-privacy budget to plan")
    mu_t = gdp_mu(target_epsilon, cfg.delta)
    algorithms = stage_algorithms(cfg, dim, stages)
    base = _spend(cfg, shapes, dim, stages, algorithms)
    active = [st for st in RELEASING_STAGES if st in stages and releases_in(cfg, st)]
    budgets = {st: algorithms[st][0].budget for st in active}  # a stage's algorithms share one setting
    names = {st: {n for alg in algorithms[st] for n in alg.ledger_stages} for st in active}
    # each site's mu per stage (the stage's ledger names composed); every stage's mu is 1 / its noise multiplier
    # times a constant of the plan, so the mu of any rescaling follows from these without another plan
    site_mu = [{st: math.sqrt(sum(v**2 for k, v in s["by_stage_mu"].items() if k in names[st])) for st in active}
               for s in base.privacy["sites"].values()]
    later = [st for st in active if st != "reduce"]
    share = None  # every stage keeps its part of mu^2 (the PCA alone: all of it)
    mu2 = {st: max(m[st] for m in site_mu) ** 2 for st in active}
    part = {st: mu2[st] / sum(mu2.values()) for st in active}
    if pca_share is not None and later:
        rest = sum(part[st] for st in later)
        part = {"reduce": pca_share, **{st: (1 - pca_share) * part[st] / rest for st in later}}
        share = part
    asked = {st: f for st, f in QUESTIONS[cfg.question].items() if st in active}

    def split(given: dict[str, float] | None) -> BudgetPlan:
        mixed = share
        if given:  # the question's stages get their share, the others the rest in their own ratio
            rest = sum(part[st] for st in active if st not in given)
            mixed = {st: given[st] if st in given else (1 - sum(given.values())) * part[st] / rest for st in active}
        z = split_gdp(site_mu, mu_t, {st: budgets[st].noise_multiplier for st in active}, mixed)
        planned = _spend(_with_multipliers(cfg, z, budgets).validate(data_sites=()), shapes, dim, stages)
        planned.target_epsilon, planned.base = target_epsilon, cfg
        return planned

    if not asked or len(active) == len(asked):
        return split(None)
    # the question's stages take their share, but the maps keep at least half of the components they would
    # support without it (on maps the reference does not describe: at least one above the noise), since a
    # measure of a noise component finds nothing: the largest share up to the question's that keeps them
    plain = split(None)
    supported = components_supported(plain)
    keep = None if supported is None else max(1, math.ceil(min(supported, cfg.n_components) / 2))

    def enough(plan: BudgetPlan) -> bool:
        return (components_supported(plan) or 0) >= keep if keep is not None else buys_nothing(plan) is None

    full = split(asked)
    if enough(full) or not enough(plain):
        return full if enough(full) else plain
    lo, hi = 0.0, 1.0  # fractions of the way from the stages' own shares to the question's
    own = {st: part[st] for st in asked}
    for _ in range(12):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if enough(split({st: own[st] + mid * (asked[st] - own[st]) for st in asked})) else (lo, mid)
    return split({st: own[st] + lo * (asked[st] - own[st]) for st in asked})


def apply_target(cfg: RunConfig, stages: tuple[str, ...] = RELEASING_STAGES, *,
                 shapes: list[SiteShape] | None = None, dim: int | None = None) -> tuple[RunConfig, BudgetPlan | None]:
    """``cfg`` with its per-stage settings (:func:`planned_settings`) planned from ``cfg.epsilon`` and the sites'
    counts: ``shapes``, else read from the sites' headers; ``dim``, else the run's features.

    Every simulation entry point (the estimators, ``dpneuro run``, the Pydra
    workflow) calls this before the first stage, so the run spends what the
    plan printed; every party of a deployed run calls it on the counts the
    sites announced (:mod:`dpneuro.deploy.party`), so all plan the same split.
    Without ``cfg.epsilon`` the configuration is returned as is. ``cfg`` is validated already (each of those
    entry points validates it first); the planned configuration is validated here.
    """
    if cfg.epsilon is None:
        return cfg, None
    shapes = site_shapes(cfg) if shapes is None else shapes
    dim = features(cfg, dim)
    plan = _plan_for_target(replace(cfg, epsilon=None), shapes, dim, cfg.epsilon, pca_share=None, stages=stages)
    if not cfg.allow_noise_maps and (why := buys_nothing(plan, stages)):
        raise ConfigError(why)
    return replace(plan.config, epsilon=cfg.epsilon), plan


def buys_nothing(plan: BudgetPlan, stages: tuple[str, ...] = RELEASING_STAGES) -> str | None:
    """Why ``plan`` would give noise maps only, with what it would take instead; None when it supports a component.

    Its covariance noise's spectral norm above the largest eigenvalue of typical fMRI's released matrix
    (:func:`dpneuro.run.expectations.reference_spectrum`, fractions of the total) leaves no component above the
    noise. What it would take: the subjects per site (:func:`subjects_needed`, equal sites of the median
    subject's volumes) and the total epsilon with these sites (:func:`epsilon_needed`) at which every one of
    ``n_components`` stands above it.
    """
    cfg = plan.config
    spec = plan.noise().get("covariance spectral norm")
    top = reference_spectrum(cfg.contribution, cfg.n_components)[0]
    if spec is None or spec < top or plan.target_epsilon is None:
        return None
    eps = plan.target_epsilon
    lengths = sorted(n for s in plan.shapes for n in s.lengths)
    volumes = lengths[len(lengths) // 2]
    base = replace(cfg, epsilon=None)
    subjects = subjects_needed(base, plan.dim, eps, timepoints=volumes)
    more = epsilon_needed(base, plan.shapes, plan.dim, stages=stages)
    ways = [f"about {subjects} subjects per site ({volumes} volumes each) at epsilon = {eps:g}" if subjects else "",
            f"epsilon = {more:.3g} with these sites" if more else ""]
    ways = [w for w in ways if w]
    return (f"this budget buys no component: at epsilon = {eps:g} the covariance noise (spectral norm ~{spec:.3g}) "
            f"exceeds even the largest eigenvalue of typical fMRI (~{top:.3g} of the total), so every map would be "
            "noise and nothing is released. "
            + (f"All {cfg.n_components} components would stand above the noise with " + " or ".join(ways) + ". "
               if ways else "")
            + "Fewer parcels (features) or components help too; `dpneuro budget` prints the plan. Set "
              "allow_noise_maps = true to run anyway.")


def epsilon_needed(cfg: RunConfig, shapes: list[SiteShape], dim: int, *, stages: tuple[str, ...] = RELEASING_STAGES,
                   largest: float = 1e3) -> float | None:
    """The smallest total epsilon (to 2 %) at which a run of ``cfg`` on sites of ``shapes`` keeps all its
    ``n_components`` components of typical fMRI above its covariance noise (:func:`components_supported`); None
    where the reference does not apply or ``largest`` is not enough."""
    def enough(eps: float) -> bool | None:
        try:
            plan = _plan_for_target(cfg, shapes, dim, eps, pca_share=None, stages=stages)
        except ConfigError:  # a setting cannot express so small a target
            return False
        supported = components_supported(plan)
        return None if supported is None else supported >= cfg.n_components

    if not enough(largest):
        return None
    lo, hi = largest / 2**20, largest  # the noise only falls as epsilon grows
    if enough(lo):
        return lo
    while hi / lo > 1.02:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def planned_settings(cfg: RunConfig) -> dict[str, float]:
    """The settings a total ``epsilon`` plans in a run of ``cfg``: the eps of each stage that spends."""
    return {epsilon_field(cfg, st): float(getattr(cfg, epsilon_field(cfg, st)))
            for st in RELEASING_STAGES if releases_in(cfg, st)}


def components_supported(plan: BudgetPlan) -> int | None:
    """How many components of typical region-level fMRI stand above the covariance noise of ``plan``
    (None where the reference spectrum does not apply: fewer than 50 or more than 400 features)."""
    spec = plan.noise().get("covariance spectral norm")
    cfg = plan.config
    return None if spec is None else supported_components(spec, plan.dim, cfg.contribution, cfg.n_components)


#: the squared overlap of the last component's eigenvector (:func:`maps_overlap`) at which private maps agree with
#: the non-private ones at mean |r| >= 0.8: on real fMRI pseudo-consortia (benchmarks/real_frontier.py, 4 sites,
#: 50-1000 subjects each, eps 1-16, subject subspaces) every cell above it did and every cell below it did not
MAPS_OVERLAP = 0.9
#: what subjects_needed asks of a plan
CRITERIA = ("components", "maps")


def maps_overlap(plan: BudgetPlan) -> float | None:
    """:func:`last_component_overlap` of typical region-level fMRI's reference spectrum under ``plan``'s
    covariance noise; None where the reference spectrum does not apply (fewer than 50 or more than 400 features)
    or nothing is released."""
    sigma = plan.noise().get("covariance")
    cfg = plan.config
    if sigma is None or not REFERENCE_DIMS[0] <= plan.dim <= REFERENCE_DIMS[1]:
        return None
    return last_component_overlap(sigma, plan.dim, reference_spectrum(cfg.contribution, cfg.n_components),
                                  cfg.n_components)


def subjects_needed(cfg: RunConfig, dim: int, target_epsilon: float, *, timepoints: int = 150,
                    max_subjects: int = 20000, criterion: str = "components") -> int | None:
    """The fewest subjects per site (equal sites of ``timepoints`` volumes each) at which a run of ``cfg``
    spending ``target_epsilon`` keeps all ``cfg.n_components`` components above its covariance noise
    (``criterion="components"``: :func:`components_supported`, the planner's own warning), or gives maps that
    agree with the non-private ones at about 0.8 (``"maps"``: :func:`maps_overlap` >= :data:`MAPS_OVERLAP`);
    None where the reference does not apply or ``max_subjects`` is not enough.
    """
    if criterion not in CRITERIA:
        raise ValueError(f"criterion must be one of {CRITERIA}, got {criterion!r}")

    def enough(n: int) -> bool | None:
        plan = plan_for_target(cfg, site_shapes(cfg, subjects=n, timepoints=timepoints), dim, target_epsilon)
        if criterion == "maps":
            overlap = maps_overlap(plan)
            return None if overlap is None else overlap >= MAPS_OVERLAP
        supported = components_supported(plan)
        return None if supported is None else supported >= cfg.n_components

    if not enough(max_subjects):
        return None
    if enough(1):
        return 1
    lo, hi = 1, max_subjects  # not enough(lo), enough(hi); the noise only falls as subjects are added
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if enough(mid) else (mid, hi)
    return hi


def stage_mu(plan: BudgetPlan) -> dict[str, float]:
    """Each releasing stage's mu (GDP) in ``plan``, the largest over the sites (its ledger names composed)."""
    cfg = plan.config
    algorithms = stage_algorithms(cfg, plan.dim)
    out = {}
    for st, algs in algorithms.items():
        names = {n for alg in algs for n in alg.ledger_stages}
        out[st] = max(math.sqrt(sum(v**2 for k, v in s["by_stage_mu"].items() if k in names))
                      for s in plan.privacy["sites"].values())
    return out


def group_detectable(cfg: RunConfig, counts: Sequence[int], *, power: float = 0.8,
                     residual_sd: dict[str, float] | None = None, effect: float | None = None
                     ) -> list[dict[str, Any]]:
    """For each contrast of ``cfg``'s design and each measure family: the standard error the fit will report
    (:func:`dpneuro.algorithms.glm.contrast_errors`, at the planned noise) and the smallest effect found with
    ``power`` at q < 0.05 (:func:`dpneuro.algorithms.glm.detectable`, one effect among the family's measures),
    beside the same without privacy. ``cfg`` carries the planned ``glm_epsilon``. With ``effect``: the subjects
    per site (every site scaled alike) at which it is found with ``power``, from the standard error's two parts
    (sampling variance falls as 1/N, the noise's as 1/N^2 at a fixed epsilon); None beyond 100 times these
    sites."""
    settings = glm_settings(cfg)
    z = settings.algorithm(n_sites=len(counts)).z
    exact = replace(settings, epsilon=None, plan="none")
    tested = settings.n_measures  # the FDR runs over every measure of the contrast
    at_zero = contrast_errors(settings, counts, noise_sd=2 * z, residual_sd=residual_sd)
    without = contrast_errors(exact, counts, noise_sd=0.0, residual_sd=residual_sd, draws=1)
    rows = []
    for c, (label, _, _) in enumerate(settings.design.contrasts()):
        for f, (family, sl) in enumerate(settings.families.items()):
            size = sl.stop - sl.start
            if size == 0:  # the "networks" measures: named from the maps, counted in the run
                continue
            se, pooled = float(at_zero[c, f]), float(without[c, f])
            eff = detectable(se, tested, power=power)
            if math.isfinite(eff):  # the standard error at that effect (the design's noise meets it)
                se = float(contrast_errors(settings, counts, noise_sd=2 * z, residual_sd=residual_sd,
                                           effect=eff)[c, f])
            row = {"contrast": label, "family": family, "measures": size, "se": se,
                   "detectable": detectable(se, tested, power=power),
                   "pooled": detectable(pooled, tested, power=power)}
            if effect is not None:
                noise2 = max(se**2 - pooled**2, 0.0)

                def found(k: float) -> bool:
                    s_k = math.sqrt(pooled**2 / k + noise2 / k**2)
                    return detectable(s_k, tested, power=power) <= abs(effect)

                lo, hi = 1e-3, 100.0
                if not found(hi):
                    row["subjects_for_effect"] = None
                else:
                    for _ in range(40):
                        mid = math.sqrt(lo * hi)
                        lo, hi = (lo, mid) if found(mid) else (mid, hi)
                    row["subjects_for_effect"] = max(1, math.ceil(hi * max(counts)))
            rows.append(row)
    return rows
