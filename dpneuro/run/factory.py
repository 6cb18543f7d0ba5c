"""A run's algorithms, built from its :class:`~dpneuro.config.RunConfig` in exactly one place.

capePCA or PD-SVD (reduce), capeDJICA or the cumulant ICA (unmix) and the dFNC
brain states' releases, with their seeds, noise plans (:func:`noise_plan`: the
configured collusion assumption reaches every protocol and ledger) and the
refusals of what cannot fit. The roles that run them (:mod:`dpneuro.run.roles`)
and the planner that predicts what they spend (:mod:`dpneuro.run.planner`) both
build them here. Each algorithm reports what it spends
(``budget``: a :class:`~dpneuro.privacy.GaussianBudget`) and the ledger's
names of its releases (``ledger_stages``); each stage of
:data:`dpneuro.run.stages.RELEASES` lists its algorithms, and :func:`epsilon_field`
says which setting a releasing stage's budget is.
"""

from __future__ import annotations

from dataclasses import replace

from dpneuro.algorithms.cumulant_ica import CapeCumulantICA, release_bytes
from dpneuro.algorithms.dfnc import StateSettings
from dpneuro.algorithms.djica import OPTIMIZERS, CapeDJICA
from dpneuro.algorithms.fnc import FNCSettings
from dpneuro.algorithms.glm import Design, GLMSettings, kind, normal_hypothesis, parse_design
from dpneuro.algorithms.pca import CapePCA, covariance_bytes, covariance_release_bytes
from dpneuro.algorithms.pdsvd import PDSVD
from dpneuro.config import ConfigError, RunConfig
from dpneuro.protocol.cape.plans import NoisePlan
from dpneuro.protocol.exchange.inprocess import DEFAULT_MAX_BYTES
from dpneuro.run.features import features


def stage_seed(cfg: RunConfig, stage: int) -> int | None:
    """The seed of stage ``stage`` (1 reduce, 2 unmix, 3 states, 4 fnc, 5 glm); None (OS entropy) when the config has
    none."""
    return None if cfg.seed is None else int(cfg.seed) * 1000 + stage


def noise_plan(cfg: RunConfig) -> NoisePlan:
    """The run's noise plan: ``plan`` under the configured collusion assumption ``n_colluding``.

    Every protocol of a run gets it, so each ledger (and the planner, which records with the same function)
    computes the guarantee against the colluders the configuration assumes.
    """
    return NoisePlan(kind=cfg.plan, n_colluding=cfg.n_colluding)


# -- reduce: capePCA or PD-SVD --------------------------------------------------------------

def reduce_plan(cfg: RunConfig) -> NoisePlan:
    """Noise plan of the reduction: ``reduction = "none"`` runs the PCA without noise (PD-SVD adds none)."""
    plan = noise_plan(cfg)
    return replace(plan, kind="none") if cfg.reduction in ("none", "pdsvd") else plan


#: what PD-SVD as the reduction reveals, and to whom (the report's privacy box and every ledger carry it)
PDSVD_THREAT_MODEL = (
    "Reduction PD-SVD: no differential privacy. The basis comes from secure sums of every site's products "
    "S_s V (secure aggregation: no single site's input is seen); each power iteration's column sums are "
    "blinded by factors derived from a secret the sites agree on through secure aggregation's keys, so the "
    "aggregator learns the directions (the basis every party gets) but not the iterates' singular values. "
    "The final k eigenvalues are revealed to every party, because whitening and the maps need them, and so "
    "is the total number of time points; with the final eigenvalues the aggregator can undo the run's fixed "
    "blinding factor, so the earlier iterates' norms stay hidden only within each round's fresh factor (up "
    "to 2^5). The aggregator colluding with any one site learns the secret and with it every iterate's "
    "singular values; honest-but-curious parties only. What it leaks on given data is measured, not "
    "bounded: dpneuro.algorithms.pdsvd.ks_privacy.")


#: the PCA without noise, streamed (D too large for D x D): k extra columns (rate lambda_2k / lambda_k per
#: iteration), stopped once every top-k Ritz pair's residual is below STREAMED_PCA_TOL * lambda_1
#: (benchmarks/scale.py measures the rounds), at most STREAMED_PCA_ITERATIONS passes over the data
STREAMED_PCA_ITERATIONS = 30
STREAMED_PCA_TOL = 1e-4


def pca_mode(cfg: RunConfig, dim: int, message_limit: int = DEFAULT_MAX_BYTES) -> str:
    """"covariance" (one D x D release) or "power" (D x k per round) for a run on ``dim`` features.

    ``capepca-power`` always streams. The covariance mode must fit ``max_memory_gb``, and its D x D release
    one message of the exchange (``message_limit`` bytes of arrays): the PCA without noise then streams
    instead (no privacy changes), and capePCA is refused before anything runs.
    """
    if cfg.reduction == "capepca-power":
        return "power"
    need, limit = covariance_bytes(dim), cfg.max_memory_gb * 2**30
    message = covariance_release_bytes(dim)
    if need <= limit and message <= message_limit:
        return "covariance"
    if cfg.reduction == "none":
        return "power"
    if need > limit:
        why = (f"D = {dim} features need about {need / 2**30:.1f} GB per site, more than max_memory_gb = "
               f"{cfg.max_memory_gb:g}")
        more = ", or raise max_memory_gb if every site has the memory"
    else:
        why = (f"its D x D release (D = {dim} features) is a message of {message / 2**20:.0f} MB, more than the "
               f"exchange carries ({message_limit / 2**20:.0f} MB)")
        more = ""
    raise ConfigError(
        f"config field 'reduction': capePCA's covariance mode forms D x D matrices, and {why}. Use reduction = "
        f"'capepca-power' (releases D x k per round, O(D k) memory) or fewer features (parcels){more}. "
        "Nothing was released")


def check_reduction_fits(cfg: RunConfig, dim: int | None = None, message_limit: int = DEFAULT_MAX_BYTES) -> None:
    """Refuse, before any data are read, a reduction that cannot fit (:func:`pca_mode`; PD-SVD holds D x k), and a
    cumulant unmixing whose R^2 x R^2 release is larger than one message."""
    if cfg.reduction != "pdsvd":
        pca_mode(cfg, features(cfg, dim), message_limit)
    if cfg.cumulant_unmixing:
        size = release_bytes(cfg.n_components)
        if size > message_limit:
            raise ConfigError(
                f"config field 'n_components': the cumulant unmixing releases an R^2 x R^2 matrix, and R = "
                f"{cfg.n_components} makes a message of {size / 2**20:.0f} MB, more than the exchange carries "
                f"({message_limit / 2**20:.0f} MB). Use fewer components or ica_unmixing = 'capedjica'. "
                "Nothing was released")


def pca_algorithm(cfg: RunConfig, dim: int | None = None) -> CapePCA:
    """The capePCA algorithm of a run (``dim``: D if known, checked against every site; default: the run's grid)."""
    mode = pca_mode(cfg, features(cfg, dim))
    power, eps = {}, cfg.pca_epsilon
    if mode == "power" and cfg.reduction == "none":
        # no noise: the data may decide when to stop (not when a planned variance round follows)
        power = {"n_iter": STREAMED_PCA_ITERATIONS, "oversample": cfg.n_components,
                 "tol": None if cfg.pca_variances else STREAMED_PCA_TOL}
        eps = None
    # every time point scaled to unit norm at its site (dpneuro.run.roles.SCALING_NOTE)
    return CapePCA(cfg.n_components, eps, cfg.pca_delta, mode=mode, scale="unit",
                   random_state=stage_seed(cfg, 1), dim=dim, subject_bound=cfg.pca_subject_bound,
                   contribution=cfg.contribution, variances=cfg.pca_variances, **power)


def pdsvd_protocol(cfg: RunConfig, n_sites: int) -> PDSVD:
    """PD-SVD as the reduction: unit-norm time points, a group secret from secure aggregation, eigenvalues."""
    return PDSVD(cfg.n_components, cfg.pdsvd_iterations, n_sites=n_sites, random_state=stage_seed(cfg, 1),
                 norm_bound=1.0, scale="unit", group_secret=True, eigenvalues=True,
                 privacy_note=PDSVD_THREAT_MODEL)


# -- unmix: capeDJICA or the cumulant ICA ---------------------------------------------------

def ica_algorithm(cfg: RunConfig) -> CapeDJICA | CapeCumulantICA:
    """The temporal unmixing of a run (R = n_components): capeDJICA, or the cumulant ICA (``ica_unmixing``)."""
    if cfg.cumulant_unmixing:
        return CapeCumulantICA(cfg.n_components, None if cfg.plan == "none" else cfg.cumulant_epsilon,
                               cfg.pca_delta, random_state=stage_seed(cfg, 2))
    if cfg.optimizer not in OPTIMIZERS:
        raise ConfigError(f"config field 'optimizer': {cfg.optimizer!r}, use one of {sorted(OPTIMIZERS)}")
    return CapeDJICA(R=cfg.n_components, epsilon_i=cfg.ica_epsilon_i, delta_i=cfg.ica_delta_i, clip_G=cfg.clip_G,
                     clip_h=cfg.clip_h, rounds=cfg.ica_rounds, optimizer=OPTIMIZERS[cfg.optimizer],
                     plan=cfg.plan,  # the kind: its per-release noise needs no more; its protocol gets noise_plan
                     calibration=cfg.calibration, random_state=stage_seed(cfg, 2), clip_unit=cfg.ica_clip_unit,
                     bias=cfg.ica_bias)


# -- states: dFNC brain states --------------------------------------------------------------

def states_settings(cfg: RunConfig) -> StateSettings:
    """The brain-states stage's public settings: ``brain_states`` dFNC states clustered by ``states_method``,
    the whole stage calibrated to (``states_epsilon``, delta / 2) per site against the headline adversary."""
    if not cfg.brain_states:
        raise ConfigError("config field 'brain_states': 0, the run has no brain-states stage")
    private = cfg.plan != "none"
    return StateSettings(cfg.brain_states, cfg.states_epsilon if private else None, cfg.pca_delta,
                         method=cfg.states_method, plan=noise_plan(cfg), metric=cfg.states_metric,
                         random_state=stage_seed(cfg, 3))


def fnc_settings(cfg: RunConfig) -> FNCSettings:
    """The static-FNC stage's public settings: one release calibrated to (``fnc_epsilon``, delta / 2) per site
    against the headline adversary."""
    if not cfg.fnc:
        raise ConfigError("config field 'fnc': false, the run has no FNC stage")
    return FNCSettings(cfg.fnc_epsilon if cfg.plan != "none" else None, cfg.pca_delta, plan=noise_plan(cfg),
                       random_state=stage_seed(cfg, 4))


def glm_measures(cfg: RunConfig) -> tuple[str, ...]:
    """The measures of the group statistics, in the order of their families."""
    return (cfg.glm_measures,) if isinstance(cfg.glm_measures, str) else tuple(cfg.glm_measures)


def glm_settings(cfg: RunConfig, networks: tuple[str, ...] | None = None) -> GLMSettings:
    """The group-statistics stage's public settings: the design (its covariates and every site as one), the
    measures (or the hypotheses), one release calibrated to (``glm_epsilon``, delta / 2) per site against the
    headline adversary. ``networks``: each component's atlas network, which the "networks" measures need
    (:func:`dpneuro.run.naming.component_networks`; the planner needs none)."""
    if not cfg.design:
        raise ConfigError("config field 'design': empty, the run has no group-statistics stage")
    design = Design(parse_design(cfg.design, cfg.covariates), tuple(s.name for s in cfg.sites))
    measures = glm_measures(cfg)
    hypotheses = tuple(normal_hypothesis(h) for h in cfg.glm_hypotheses)
    computed = tuple(dict.fromkeys(kind(h) for h in hypotheses)) if hypotheses else measures
    return GLMSettings(design, measures, cfg.n_components, cfg.glm_epsilon if cfg.plan != "none" else None,
                       cfg.pca_delta, cfg.brain_states if "states" in computed else 0, plan=noise_plan(cfg),
                       random_state=stage_seed(cfg, 5), networks=networks, hypotheses=hypotheses)


# -- what each releasing stage spends -------------------------------------------------------

def epsilon_field(cfg: RunConfig, stage: str) -> str:
    """The setting that holds the eps of releasing ``stage`` (the unmixing's depends on ``ica_unmixing``)."""
    if stage == "unmix":
        return "cumulant_epsilon" if cfg.cumulant_unmixing else "ica_epsilon_i"
    return {"reduce": "pca_epsilon", "fnc": "fnc_epsilon", "states": "states_epsilon", "glm": "glm_epsilon"}[stage]
