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
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from dpneuro._utils.errors import DataValidationError
from dpneuro.config import ConfigError, RunConfig, check_delta
from dpneuro.data.cleaning import CleaningError
from dpneuro.data.discovery import subject_lengths
from dpneuro.privacy import PrivacyLedger, gdp_epsilon, gdp_mu, split_gdp
from dpneuro.privacy.rmt import detection_threshold, eigenvector_overlap, wigner_edge
from dpneuro.privacy.summary import headline_lines, privacy_report, privacy_warnings
from dpneuro.protocol.cape import ReleaseSpec
from dpneuro.run.factory import epsilon_field
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


def expected_noise(cfg: RunConfig, n_samples: dict[str, int], dim: int, privacy: dict) -> dict[str, float]:
    """Expected noise std of the averaged releases: covariance entries (off the diagonal), gradient entries (per
    round), and the covariance noise's spectral norm.

    Under CAPE the zero-sum parts cancel in the N_s-weighted average, which keeps the local parts
    (variance tau_s^2 / S); under 'conv' every site's full noise stays.
    """
    n = dict(n_samples)
    N, S = sum(n.values()), len(n)
    share = 1.0 / S if cfg.plan == "cape" else 1.0
    # the D x D release's off-diagonal entries (what sets its spectral norm) stand for 2 entries of the matrix:
    # symmetrized noise, the releases' default, divides their std by sqrt(2) (dpneuro.protocol.cape.packing)
    copies = 2.0 if ReleaseSpec.symmetric_noise == "symmetrized" else 1.0
    out = {}
    for stage, name, key, c in (("capepca", "A", "covariance", copies), ("capepca-power", "AV", "covariance", 1.0),
                                ("ica", "G", "gradient (per round)", 1.0)):
        var = 0.0
        for site, s in privacy["sites"].items():
            for r in s["ledger"]["releases"]:
                if r["stage"] == stage and r["name"] == name:
                    var += (n[site] / N) ** 2 * share * r["sigma"] ** 2 / c
        if var > 0:
            out[key] = math.sqrt(var)
    if "covariance" in out:
        # semicircle edge of a symmetric Gaussian matrix: 2 sqrt(D) times its off-diagonal std
        out["covariance spectral norm"] = 2 * out["covariance"] * math.sqrt(dim)
    return out


#: eigenvalues (fractions of the total) of real fMRI's normalised second moment, unit-norm time points: 33
#: people, 122 regions of the MIST atlas (OpenNeuro ds000140, as in benchmarks/real_frontier.py). The planner
#: counts how many stand above the expected noise: on that data private maps agreed with the non-private ones
#: at mean |r| ~0.46 when about half of 20 components did, 0.72-0.88 when all did.
REFERENCE_SPECTRUM = (0.237, 0.0851, 0.0649, 0.059, 0.0366, 0.0271, 0.0248, 0.0215, 0.0201, 0.0184, 0.0154,
                      0.0135, 0.0134, 0.0107, 0.0104, 0.0098, 0.00918, 0.00862, 0.00843, 0.00818, 0.00762,
                      0.00749, 0.00725, 0.00716, 0.00694, 0.00681, 0.00673, 0.00599, 0.00592, 0.0058, 0.00568,
                      0.00551, 0.00534, 0.00525, 0.00517, 0.00503, 0.00479, 0.00472, 0.00456, 0.00449)
#: the same people under subspace contributions (pca_contribution = "subspace"; 150-volume windows of their
#: runs): k times the eigenvalues of the subjects' averaged projectors P_m / k on their own top-k subspaces, by k
#: (1 would be a direction every subject shares). A k between two keys uses the nearer one.
REFERENCE_SUBSPACE_SPECTRA: dict[int, tuple[float, ...]] = {
    5: (0.926, 0.693, 0.599, 0.54, 0.283, 0.197, 0.155, 0.124, 0.118, 0.0963),
    10: (0.944, 0.792, 0.732, 0.689, 0.539, 0.451, 0.405, 0.362, 0.345, 0.314, 0.238, 0.219, 0.185, 0.152, 0.148,
         0.139, 0.119, 0.114, 0.108, 0.102),
    15: (0.952, 0.826, 0.777, 0.74, 0.632, 0.57, 0.522, 0.477, 0.47, 0.457, 0.372, 0.349, 0.325, 0.262, 0.246,
         0.237, 0.224, 0.212, 0.209, 0.193, 0.182, 0.181, 0.177, 0.165, 0.157, 0.153, 0.15, 0.138, 0.131, 0.131),
    20: (0.958, 0.845, 0.807, 0.776, 0.691, 0.646, 0.595, 0.556, 0.555, 0.529, 0.462, 0.44, 0.419, 0.347, 0.336,
         0.326, 0.31, 0.296, 0.286, 0.285, 0.266, 0.264, 0.261, 0.251, 0.241, 0.227, 0.222, 0.214, 0.203, 0.196,
         0.195, 0.191, 0.186, 0.183, 0.175, 0.174, 0.168, 0.16, 0.156, 0.151),
    30: (0.967, 0.878, 0.847, 0.819, 0.756, 0.725, 0.692, 0.662, 0.649, 0.632, 0.572, 0.563, 0.542, 0.508, 0.475,
         0.468, 0.46, 0.441, 0.432, 0.423, 0.407, 0.399, 0.395, 0.388, 0.381, 0.364, 0.352, 0.338, 0.333, 0.329,
         0.323, 0.318, 0.315, 0.308, 0.304, 0.294, 0.288, 0.28, 0.275, 0.271),
    40: (0.973, 0.9, 0.876, 0.851, 0.803, 0.776, 0.755, 0.728, 0.714, 0.702, 0.659, 0.647, 0.628, 0.598, 0.581,
         0.569, 0.566, 0.544, 0.536, 0.529, 0.517, 0.512, 0.506, 0.489, 0.484, 0.47, 0.465, 0.454, 0.45, 0.445,
         0.441, 0.431, 0.425, 0.414, 0.408, 0.407, 0.397, 0.392, 0.389, 0.38),
}
#: feature counts the reference spectrum speaks for (region/parcel level; voxels spread the variance thinner)
REFERENCE_DIMS = (50, 400)


def reference_spectrum(contribution: str = "moment", k: int = 20) -> tuple[float, ...]:
    """Eigenvalues of typical region-level fMRI's released matrix: :data:`REFERENCE_SPECTRUM`, or under
    subspace contributions for ``k`` components (:data:`REFERENCE_SUBSPACE_SPECTRA`)."""
    if contribution != "subspace":
        return REFERENCE_SPECTRUM
    near = min(REFERENCE_SUBSPACE_SPECTRA, key=lambda key: (abs(key - k), key))
    return tuple(v / near for v in REFERENCE_SUBSPACE_SPECTRA[near])


def supported_components(spectral_norm: float, dim: int, contribution: str = "moment", k: int = 20) -> int | None:
    """How many components of typical parcel-level fMRI stand above covariance noise of this spectral norm.

    None when ``dim`` is outside :data:`REFERENCE_DIMS` (the reference does not apply).
    """
    if not REFERENCE_DIMS[0] <= dim <= REFERENCE_DIMS[1]:
        return None
    return sum(1 for lam in reference_spectrum(contribution, k) if lam > spectral_norm)


def last_component_overlap(noise_std: float, dim: int, spectrum, n_components: int) -> float:
    """The squared overlap with its noise-free eigenvector expected for the ``n_components``-th eigenvector of
    ``spectrum`` under covariance noise of off-diagonal std ``noise_std`` (spiked Wigner,
    :mod:`dpneuro.privacy.rmt`)."""
    spec = np.asarray(spectrum, np.float64)
    return float(eigenvector_overlap([spec[min(n_components, len(spec)) - 1]], noise_std, dim)[0])


def random_matrix_line(noise_std: float, dim: int, spectrum, n_components: int) -> str:
    """The planner's random-matrix summary for covariance noise of off-diagonal std ``noise_std``
    (:mod:`dpneuro.privacy.rmt`): the edge, how many reference eigenvalues are detectable (BBP), and the squared
    eigenvector overlap expected for the ``n_components``-th."""
    spec = np.asarray(spectrum, np.float64)
    detectable = int(np.sum(spec > detection_threshold(noise_std, dim)))
    overlap = last_component_overlap(noise_std, dim, spec, n_components)
    return (f"random-matrix view: noise edge 2 sigma sqrt(D) = {wigner_edge(noise_std, dim):.3g}; an eigenvalue "
            f"above sigma sqrt(D) = {detection_threshold(noise_std, dim):.3g} leaves the noise (BBP): "
            f"{'{} or more'.format(detectable) if detectable == len(spec) else detectable} of the reference; "
            f"component {n_components}'s eigenvector at squared overlap ~{overlap:.2f} with the noise-free one")


def run_warnings(cfg: RunConfig, n_samples: dict[str, int], dim: int, privacy: dict) -> list[str]:
    """What a user must hear before trusting a run: weak privacy, components the data cannot carry, noise maps.

    ``n_samples``: time points per site (public), ``dim``: features D after reduction.
    """
    out = list(privacy_warnings(privacy))
    n_total = sum(n_samples.values())
    if cfg.n_components >= 0.5 * min(dim, n_total):
        out.append(f"WARNING: n_components = {cfg.n_components} is close to or above half of min(D = {dim}, "
                   f"time points = {n_total}): components cannot be recovered reliably.")
    spec = expected_noise(cfg, n_samples, dim, privacy).get("covariance spectral norm")
    ref = reference_spectrum(cfg.contribution, cfg.n_components)
    supported = supported_components(spec, dim, cfg.contribution, cfg.n_components) if spec is not None else None
    if supported is not None and supported < cfg.n_components and spec <= 1.0 / cfg.n_components:
        out.append(f"WARNING: n_components = {cfg.n_components}, but on real fMRI at the region level only about "
                   f"{supported} components stand above this run's covariance noise (spectral norm ~{spec:.3g}; "
                   f"the {cfg.n_components}th eigenvalue of such data is ~"
                   f"{ref[min(cfg.n_components, len(ref)) - 1]:.2g} of the total): "
                   "expect the weaker components to be noise. Ask for fewer, add subjects or raise the budget.")
    if spec is not None and spec > 1.0 / cfg.n_components:
        out.append(f"WARNING: the covariance noise (spectral norm ~{spec:.3g}) exceeds the average signal "
                   f"eigenvalue of {cfg.n_components} components (~{1 / cfg.n_components:.3g}; unit-norm time "
                   "points put eigenvalues summing to 1): expect noise maps. Add subjects, use fewer features "
                   "(parcels) or components, or a larger budget.")
    return out


@dataclass
class BudgetPlan:
    """What a configuration spends per site, and the noise to expect; prints as a table."""

    config: RunConfig
    shapes: list[SiteShape]
    dim: int
    privacy: dict[str, Any]
    target_epsilon: float | None = None

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
        return out + self.warnings()

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
    if pca_share is not None and later:
        mu2 = {st: max(m[st] for m in site_mu) ** 2 for st in active}
        part = {st: mu2[st] / sum(mu2.values()) for st in active}
        rest = sum(part[st] for st in later)
        share = {"reduce": pca_share, **{st: (1 - pca_share) * part[st] / rest for st in later}}
    z = split_gdp(site_mu, mu_t, {st: budgets[st].noise_multiplier for st in active}, share)
    planned_cfg = _with_multipliers(cfg, z, budgets)
    planned = _spend(planned_cfg.validate(data_sites=()), shapes, dim, stages)
    planned.target_epsilon = target_epsilon
    return planned


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
    plan = _plan_for_target(replace(cfg, epsilon=None), shapes, features(cfg, dim), cfg.epsilon, pca_share=None,
                            stages=stages)
    return replace(plan.config, epsilon=cfg.epsilon), plan


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
