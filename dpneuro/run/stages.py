"""The run's releasing stages as one table: what a site does and what the aggregator does, stage by stage.

A run is: the space (mask and features) and each site's data, then the
releases of :data:`RELEASES` in order (capePCA or PD-SVD, the unmixing, the
brain states), then the outputs. Every entry point reads this table:

- the simulation (:func:`dpneuro.run.pipeline.run_stages`) and the Pydra workflow
  (:mod:`dpneuro.deploy.workflow`) run each entry with every party in this
  process (:func:`run_inprocess`);
- a deployed site and the aggregator (:mod:`dpneuro.deploy.party`, hence
  ``dpneuro site`` / ``dpneuro aggregator`` and COINSTAC) run its site step
  or its aggregator step over their exchange, one exchange topic per step.

So a new stage is one new :class:`ReleasingStage` in :data:`RELEASES`.

A stage's *public result* is what its aggregator step returns (the
aggregator's view) and what its site step returns besides the ledger (the
final broadcast as a site sees it). Later stages read earlier public results
by stage name: ``public["reduce"]["basis"]``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from dpneuro.algorithms.djica import time_courses
from dpneuro.algorithms.pca import check_sources
from dpneuro.config import RunConfig
from dpneuro.privacy import PrivacyLedger
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol.cape import planned_ledgers as cape_planned
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange.inprocess import InProcessExchange
from dpneuro.protocol.simulation import run_parties
from dpneuro.run import factory, roles
from dpneuro.run.factory import (
    PDSVD_THREAT_MODEL,
    ica_algorithm,
    noise_plan,
    pca_algorithm,
    reduce_plan,
    states_settings,
)

__all__ = ["RELEASES", "ReleasingStage", "active_releases", "from_reply", "reduce_inprocess", "release",
           "run_inprocess", "sites_reply", "states_inprocess", "unmix_inprocess", "new_reads"]

Public = Mapping[str, Mapping[str, Any]]


@dataclass(frozen=True)
class ReleasingStage:
    """One releasing stage.

    Attributes
    ----------
    name : str
        The stage's name (its folder, its timing label, its configuration
        digest in :func:`dpneuro.config.stage_fields`).
    steps : callable
        ``steps(cfg)``: the stage's releases in order, each run over its own
        exchange topic; empty when the run has no such stage.
    site_input : callable
        ``site_input(cfg, site, public)``: what the site's steps read, from
        the loader's record of the site (its data matrix ``site["X"]``, the
        ``.npy`` path; its ``subject_ids``) and the earlier public results, or
        None when they read nothing. A deployed site keeps it in its working
        folder.
    site : callable
        ``site(cfg, step, site, data, lengths, exchange, *, n_sites, dim,
        previous, checkpoint, timeout, budget)``: one site's part of ``step``; returns
        its ledger under ``"ledger"`` and the step's public result as the site
        sees it. ``previous`` is the site's result of the stage's previous step;
        ``budget`` the site's total and what its earlier steps spent
        (:class:`~dpneuro.privacy.budget.SiteBudget`), which its guard holds it to.
        A role of :mod:`dpneuro.run.roles`, which every entry point calls
        directly.
    aggregator : callable
        ``aggregator(cfg, step, exchange, *, n_sites, dim, public, previous,
        checkpoint, options)``: the aggregator's part of ``step``; returns the
        step's public result. A role of :mod:`dpneuro.run.roles`.
    to_sites : tuple of str
        Public results the aggregator sends every site at the end of a
        deployed run (what the sites need for their own outputs).
    check : callable or None
        ``check(cfg, inputs, lengths)``: a simulation's test of every site's
        input before anything is released; returns the inputs to run on.
    spends : callable
        ``spends(cfg)``: whether the stage adds privacy noise in this
        configuration (the planner splits a total epsilon over those that do).
    algorithms : callable or None
        ``algorithms(cfg, dim)``: the stage's algorithms, which report the
        budget setting they are calibrated from (``.budget``) and the ledger
        names of their releases (``.ledger_stages``).
    planned : callable or None
        ``planned(cfg, algorithms, shapes, dim)``: each site's ledger of the
        stage on sites of these shapes (``.lengths``, ``.n_samples``), without
        data, from the stage's ``algorithms(cfg, dim)``: what the planner
        predicts and the run then records (:meth:`plan` builds them).
    reads : tuple of (stage, key)
        Earlier public results ``site_input`` reads that a site's own steps
        did not return (the aggregator's alone, e.g. the spatial ICA's W): a
        deployed aggregator sends them to the sites before this stage.
    files : callable
        ``files(cfg)``: files ``site_input`` reads besides the sites' data
        (the participants tables): their contents name the stage's cached
        results, so an edited table is read again.
    """

    name: str
    steps: Callable[[RunConfig], tuple[str, ...]]
    site_input: Callable[[RunConfig, Any, Public], Any]
    site: Callable[..., dict[str, Any]]
    aggregator: Callable[..., dict[str, Any]]
    to_sites: tuple[str, ...] = ()
    check: Callable[[RunConfig, Sequence[Any], Sequence[Sequence[int]]], Sequence[Any]] | None = None
    spends: Callable[[RunConfig], bool] = lambda cfg: False
    algorithms: Callable[[RunConfig, int], list] | None = None
    planned: Callable[[RunConfig, list, Sequence[Any], int], list[PrivacyLedger | None]] | None = None
    reads: tuple[tuple[str, str], ...] = ()
    files: Callable[[RunConfig], list[str]] = lambda cfg: []

    def active(self, cfg: RunConfig) -> bool:
        return bool(self.steps(cfg))

    def plan(self, cfg: RunConfig, shapes: Sequence[Any], dim: int, algorithms: list | None = None
             ) -> list[PrivacyLedger | None]:
        """Each site's ledger of the stage on sites of these shapes (:attr:`planned`), from ``algorithms`` built
        once by the caller, else built here."""
        if self.planned is None or self.algorithms is None:
            raise ValueError(f"stage {self.name!r} releases nothing to plan")
        return self.planned(cfg, self.algorithms(cfg, dim) if algorithms is None else algorithms, shapes, dim)


# -- reduce: capePCA or PD-SVD ------------------------------------------------------------------

def _reduce_check(cfg, inputs, lengths):
    """Finite values, one D, k <= min(D, N) over every site: a simulation refuses before any site releases.
    Returns the validated sources, which the sites then read (each matrix is read once to validate)."""
    return check_sources([roles.pca_source(X, ln).validate(f"site {s}")
                          for s, (X, ln) in enumerate(zip(inputs, lengths, strict=True))], cfg.n_components)


def _reduce_planned(cfg, algorithms, shapes, dim):
    if cfg.reduction == "pdsvd":  # secure sums, no noise: every ledger says so
        leds = [PrivacyLedger(owner=f"site-{i}") for i in range(len(shapes))]
        for led in leds:
            led.mark_not_private(PDSVD_THREAT_MODEL)
        return leds
    pca, = algorithms
    return cape_planned(pca, reduce_plan(cfg), [pca.public_state(i, s.lengths, s.n_samples, dim)
                                                for i, s in enumerate(shapes)])


# -- unmix: spatial ICA of the basis, capeDJICA or the cumulant ICA -------------------------------

def _unmix_input(cfg, site, public):
    if cfg.ica == "spatial":  # the aggregator unmixes the released basis alone: the sites read nothing
        return None
    return roles.unmixing_input(cfg, site["X"], public["reduce"]["basis"], public["reduce"]["eigenvalues"])


def _unmix_planned(cfg, algorithms, shapes, dim):
    ica, = algorithms
    return cape_planned(ica, noise_plan(cfg), [ica.public_state(i, s.lengths) for i, s in enumerate(shapes)])


def _unmix_check(cfg, inputs, lengths):
    """Every site's whitened data accepted by the unmixing (a simulation refuses before any site releases)."""
    if cfg.ica == "temporal":
        alg = ica_algorithm(cfg)
        for s, (Z, ln) in enumerate(zip(inputs, lengths, strict=True)):
            alg.site_init(s, (Z, [int(n) for n in ln]))
    return inputs


def _timecourses_input(cfg, site, public):
    """The site's component time courses (R x N), the same as its ``timecourses.tsv``: the FNC and the states
    read them."""
    Z = roles.unmixing_input(cfg, site["X"], public["reduce"]["basis"], public["reduce"]["eigenvalues"])
    return time_courses(np.asarray(public["unmix"]["W"]), Z, np.asarray(public["unmix"]["b"]))


# -- fnc: static functional network connectivity ------------------------------------------------

def _fnc_planned(cfg, algorithms, shapes, dim):
    settings, = algorithms
    return settings.planned([len(s.lengths) for s in shapes], cfg.n_components)


# -- states: dFNC brain states ------------------------------------------------------------------

def _states_steps(cfg: RunConfig) -> tuple[str, ...]:
    return tuple(f"states-{s}" for s in states_settings(cfg).steps()) if cfg.brain_states else ()


def _states_check(cfg, inputs, lengths):
    """Every subject has a window (a simulation refuses before any site releases)."""
    for s, ln in enumerate(lengths):
        roles.check_window_fits(cfg, ln, f"site {s}")
    return inputs


def _states_algorithms(cfg, dim):
    return [states_settings(cfg)]  # the stage's budget and ledger names (the planner's view)


def _states_planned(cfg, algorithms, shapes, dim):
    settings, = algorithms
    for s in shapes:  # the planner refuses what the run refuses
        roles.check_window_fits(cfg, s.lengths, f"site {s.name}")
    return settings.planned([roles.window_counts(cfg, s.lengths) for s in shapes], cfg.n_components)


# -- glm: group statistics ---------------------------------------------------------------------

def _glm_input(cfg, site, public):
    """The site's bounded contributions to the group model, from its subjects' measures and covariates."""
    return roles.glm_input(cfg, site, _timecourses_input(cfg, site, public), public)


def _glm_planned(cfg, algorithms, shapes, dim):
    settings, = algorithms
    return settings.planned([len(s.lengths) for s in shapes])


#: the run's releasing stages, in run order
RELEASES: tuple[ReleasingStage, ...] = (
    ReleasingStage("reduce", lambda cfg: ("reduce",), lambda cfg, site, public: site["X"], roles.reduce_site,
            roles.reduce_aggregator,
            check=_reduce_check, spends=lambda cfg: cfg.reduction != "pdsvd",
            algorithms=lambda cfg, dim: [pca_algorithm(cfg, dim)], planned=_reduce_planned),
    # spatial ICA unmixes the released basis at the aggregator: post-processing, no release
    ReleasingStage("unmix", lambda cfg: ("unmix",), _unmix_input, roles.unmix_site, roles.unmix_aggregator,
            to_sites=("W", "b"),
            check=_unmix_check, spends=lambda cfg: cfg.ica == "temporal",
            algorithms=lambda cfg, dim: [ica_algorithm(cfg)], planned=_unmix_planned),
    ReleasingStage("fnc", lambda cfg: ("fnc",) if cfg.fnc else (), _timecourses_input, roles.fnc_site,
            roles.fnc_aggregator,
            to_sites=("fnc",), reads=(("unmix", "W"), ("unmix", "b")), spends=lambda cfg: cfg.fnc,
            algorithms=lambda cfg, dim: [factory.fnc_settings(cfg)], planned=_fnc_planned),
    ReleasingStage("states", _states_steps, _timecourses_input, roles.states_site, roles.states_aggregator,
            to_sites=("vectors",),
            reads=(("unmix", "W"), ("unmix", "b")), check=_states_check, spends=lambda cfg: cfg.brain_states > 0,
            algorithms=_states_algorithms, planned=_states_planned),
    ReleasingStage("glm", lambda cfg: ("glm",) if cfg.design else (), _glm_input, roles.glm_site,
            roles.glm_aggregator,
            reads=(("unmix", "W"), ("unmix", "b"), ("states", "vectors")), spends=lambda cfg: bool(cfg.design),
            algorithms=lambda cfg, dim: [factory.glm_settings(cfg)], planned=_glm_planned,
            files=lambda cfg: [str(roles.participants_table(cfg, s.name)) for s in cfg.sites] if cfg.design else []),
)


def release(name: str) -> ReleasingStage:
    """The entry of :data:`RELEASES` called ``name``."""
    for r in RELEASES:
        if r.name == name:
            return r
    raise KeyError(f"no releasing stage {name!r}; stages: {[r.name for r in RELEASES]}")


def active_releases(cfg: RunConfig) -> tuple[ReleasingStage, ...]:
    """The stages this configuration runs, in order."""
    return tuple(r for r in RELEASES if r.active(cfg))


def new_reads(cfg: RunConfig, stage: ReleasingStage) -> tuple[tuple[str, str], ...]:
    """What a deployed aggregator sends the sites before ``stage``: its ``reads`` of stages that ran and that no
    earlier stage of the run has sent them already (the FNC and the brain states both read the unmixing: it is
    sent once)."""
    sent, ran = set(), set()
    for r in active_releases(cfg):
        if r.name == stage.name:
            return tuple(x for x in stage.reads if x not in sent and x[0] in ran)
        sent.update(r.reads)
        ran.add(r.name)
    raise KeyError(f"stage {stage.name!r} does not run in this configuration")


def sites_reply(public: Public) -> dict[str, Any]:
    """What the aggregator sends every site at the end of a deployed run: each stage's ``to_sites``."""
    return {k: public[r.name][k] for r in RELEASES if r.name in public for k in r.to_sites if k in public[r.name]}


def from_reply(reply: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """What a site received at the end of a deployed run (:func:`sites_reply`), by stage."""
    return {r.name: {k: reply[k] for k in r.to_sites if k in reply} for r in RELEASES
            if any(k in reply for k in r.to_sites)}


def run_inprocess(stage: ReleasingStage, cfg: RunConfig, inputs: Sequence[Any], lengths: Sequence[Sequence[int]], *,
                  dim: int, public: Public, options: RunOptions | None = None,
                  budgets: Sequence[SiteBudget] | None = None) -> tuple[dict[str, Any], list[PrivacyLedger]]:
    """Every party of ``stage`` in this process (a thread per site, one in-process exchange per step).

    ``budgets``: each site's total and what it spent before this stage (default: the configured total, nothing
    spent); every step's releases count against it, as at a deployed site. Returns the stage's public result
    (the aggregator's) and each site's ledger.
    """
    n, opts = len(inputs), options or RunOptions()
    if stage.check is not None:
        inputs = stage.check(cfg, inputs, lengths)
    result: dict[str, Any] = {}
    site_prev: list[Any] = [None] * n
    agg_prev: Any = None
    ledgers: list[list[PrivacyLedger]] = [[] for _ in range(n)]
    spent = list(budgets) if budgets is not None else [site_budget(cfg, f"site {s}") for s in range(n)]
    for step in stage.steps(cfg):
        # each party's own step with its arguments bound: a site thread calls the stage's site step directly
        sites = [partial(stage.site, cfg, step, s, inputs[s], [int(x) for x in lengths[s]], n_sites=n, dim=dim,
                         previous=site_prev[s], checkpoint=None, budget=spent[s]) for s in range(n)]
        aggregator = partial(stage.aggregator, cfg, step, n_sites=n, dim=dim, public=public, previous=agg_prev,
                             checkpoint=None, options=opts)
        agg_prev, site_prev = run_parties(sites, aggregator, InProcessExchange(n_sites=n), timeout=opts.timeout)
        result.update(agg_prev)
        for s, r in enumerate(site_prev):
            if r is not None:
                ledgers[s].append(r["ledger"])
                spent[s] = spent[s].after(r["ledger"])
    return result, [PrivacyLedger.merge_all(led) for led in ledgers]


def site_budget(cfg: RunConfig, owner: str, spent: Sequence[PrivacyLedger] = ()) -> SiteBudget:
    """A site's budget for its next stage: the configured total (``cfg.epsilon``, None for per-stage settings)
    at ``cfg.delta``, and the ledgers of the stages it has finished."""
    return SiteBudget(owner, cfg.epsilon, cfg.delta, PrivacyLedger.merge_all(spent))


# -- one stage in this process, for notebooks, tests and benchmarks -------------------------------

def reduce_inprocess(cfg: RunConfig, X_sites: Sequence[Any], lengths: Sequence[Sequence[int]], *,
                     options: RunOptions | None = None) -> roles.ReduceResult:
    """The run's reduction (capePCA or PD-SVD) with every party in this process, as the simulation runs it.

    Every site's data are validated (finite values, common D, k <= min(D, N)) before anything is released.
    """
    srcs = _reduce_check(cfg, X_sites, lengths)
    res, leds = run_inprocess(release("reduce"), cfg, srcs, lengths, dim=srcs[0].dim, public={}, options=options)
    return roles.ReduceResult(res["basis"], res["eigenvalues"], leds, int(res.get("rounds", 0)))


def unmix_inprocess(cfg: RunConfig, X_sites: Sequence[Any], lengths: Sequence[Sequence[int]], basis, eigenvalues,
                    *, options: RunOptions | None = None) -> roles.UnmixResult:
    """The run's unmixing with every party in this process; each site whitens its data with the public basis
    (with spatial ICA no site takes part: the maps come from the released basis alone)."""
    rel, public = release("unmix"), {"reduce": {"basis": np.asarray(basis), "eigenvalues": np.asarray(eigenvalues)}}
    inputs = [rel.site_input(cfg, {"X": X}, public) for X in X_sites]
    res, leds = run_inprocess(rel, cfg, inputs, lengths, dim=int(np.shape(basis)[0]), public=public, options=options)
    return roles.UnmixResult(res["W"], res["b"], res["history"], res["rounds"], res["status"], leds)


def states_inprocess(cfg: RunConfig, S_sites: Sequence[Any], lengths: Sequence[Sequence[int]], *,
                     options: RunOptions | None = None) -> dict[str, Any]:
    """The brain-states stage with every party in this process, on the sites' component time courses (R x N):
    its public result (``vectors``, ``occupancy``) and each site's ledger under ``"ledgers"``."""
    res, leds = run_inprocess(release("states"), cfg, S_sites, lengths, dim=cfg.n_components, public={},
                              options=options)
    return {**res, "ledgers": leds}
