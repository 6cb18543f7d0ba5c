"""The analysis stages split by role: what a site runs, what the aggregator runs.

The stages' algorithms (capePCA or PD-SVD to reduce, spatial ICA of the basis
or a temporal unmixing, dFNC brain states) are built from a
:class:`~dpneuro.config.RunConfig` in exactly one place (:mod:`dpneuro.run.factory`)
and wrapped with :func:`dpneuro.protocol.cape.cape_protocol`; each stage then has a
*site role* (``*_site``: :func:`dpneuro.protocol.driver.run_site`) and an *aggregator
role* (``*_aggregator``: :func:`dpneuro.protocol.driver.run_aggregator`) that run over
whatever exchange they are given, with the signatures the stage table declares
(:class:`dpneuro.run.stages.ReleasingStage`), which holds them. Three callers share them:

- the simulation, every party in one process (:func:`dpneuro.run.stages.run_inprocess`, called by
  :func:`dpneuro.run.pipeline.stage_release` for every stage of the table, hence by the Pydra workflow);
- ``dpneuro site`` / ``dpneuro aggregator`` over a shared folder
  (:mod:`dpneuro.deploy.sharedfs`);
- the COINSTAC computation (:mod:`dpneuro.deploy.coinstac`).

So a deployment computes what the simulation computes: with the same seeds,
the same numbers. A third, tiny stage (:class:`SummaryProtocol`) closes a
deployed run: every site sends its ledger and subject count (public metadata),
the aggregator answers with the reported unmixing (public), so that sites can
compute their own time courses.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpneuro._utils.errors import ConfigError
from dpneuro.algorithms.dfnc import UNIT_NOTE as DFNC_UNIT_NOTE
from dpneuro.algorithms.dfnc import WindowSet, site_dynamics
from dpneuro.algorithms.dfnc import site_windows as windows_of
from dpneuro.algorithms.djica import reported_unmixing, whitening_matrix
from dpneuro.algorithms.fnc import site_fnc
from dpneuro.algorithms.glm import network_pairs, pack_statistics, subject_measures
from dpneuro.algorithms.pca import SiteSource, as_source
from dpneuro.algorithms.spatial_ica import spatial_ica
from dpneuro.config import RunConfig
from dpneuro.data.matrix import column_blocks, scale_columns, site_matrix
from dpneuro.data.participants import check_covariates, participants_path
from dpneuro.privacy import PrivacyLedger
from dpneuro.privacy.budget import SiteBudget
from dpneuro.protocol.cape import cape_protocol
from dpneuro.protocol.driver import Checkpoint, Phase, RunOptions, State, run_aggregator, run_site
from dpneuro.protocol.exchange.base import Exchange, Payload
from dpneuro.run.factory import (
    fnc_settings,
    glm_settings,
    ica_algorithm,
    noise_plan,
    pca_algorithm,
    pdsvd_protocol,
    reduce_plan,
    states_settings,
)
from dpneuro.run.naming import component_networks, ordered_unmixing

__all__ = [
    "ReduceResult",
    "SCALING_NOTE",
    "SUBSPACE_NOTE",
    "contribution_note",
    "SummaryProtocol",
    "UnmixResult",
    "reduce_aggregator",
    "reduce_protocol",
    "pca_source",
    "reduce_site",
    "site_whiten",
    "check_window_fits",
    "site_windows",
    "window_counts",
    "states_aggregator",
    "states_site",
    "summary_aggregator",
    "summary_site",
    "describe_unmixing",
    "unmix_aggregator",
    "unmix_protocol",
    "unmix_site",
]

SCALING_NOTE = (
    "Every time point (column of the reduced data) is scaled to unit L2 norm at its site, so one subject "
    "changes a site's second-moment matrix by at most 1/M_s; the scaling looks at one time point at a "
    "time and costs no privacy."
)
#: the same under subspace contributions (pca_contribution = "subspace"; docs/privacy.md)
SUBSPACE_NOTE = (
    "Every time point (column of the reduced data) is scaled to unit L2 norm at its site, and each subject "
    "contributes the projector onto its own top-k principal subspace (weighted by its share of the site's time "
    "points), of Frobenius norm at most its share / sqrt(k) whatever its data: one subject changes a site's "
    "release by at most sqrt(2) n_max / (sqrt(k) N_s). The subject's subspace is computed at its site and "
    "never leaves it."
)


def contribution_note(cfg: RunConfig) -> str:
    """What bounds a subject's part of the PCA release, in words, for the privacy record's assumptions."""
    return SUBSPACE_NOTE if cfg.reduction != "pdsvd" and cfg.contribution == "subspace" else SCALING_NOTE


# -- reduce: capePCA or PD-SVD ------------------------------------------------------------

def reduce_protocol(cfg: RunConfig, n_sites: int, dim: int | None = None, budget: SiteBudget | None = None):
    """The run's reduction as driver phases: capePCA under the run's noise plan, or PD-SVD (no noise to guard).
    ``budget``: the one site's that runs it (its guard's total and earlier spend)."""
    if cfg.reduction == "pdsvd":
        return pdsvd_protocol(cfg, n_sites)
    return cape_protocol(pca_algorithm(cfg, dim), reduce_plan(cfg), n_sites=n_sites, budget=budget)


def pca_source(X, lengths: Sequence[int]):
    """A site's data for capePCA; a source the caller validated already is used as it is (read once)."""
    return X if isinstance(X, SiteSource) else as_source(X, [int(n) for n in lengths])


@dataclass
class ReduceResult:
    """What the reduction released: the basis, its eigenvalues, each site's ledger, its rounds (0: unknown)."""

    basis: np.ndarray
    eigenvalues: np.ndarray
    ledgers: list[PrivacyLedger | None] = field(default_factory=list)
    rounds: int = 0


def reduce_site(cfg: RunConfig, step: str, site: int, X, lengths: Sequence[int], exchange: Exchange, *,
                n_sites: int, dim: int | None = None, previous=None, checkpoint: Checkpoint | None = None,
                timeout: float | None = None,
                budget: SiteBudget | None = None) -> dict[str, Any]:
    """One site's part of capePCA (or PD-SVD): X is its D x N matrix, ``lengths`` its subjects' time points.

    Returns this site's ledger and the public basis and eigenvalues (the aggregator's final broadcast).
    """
    st = run_site(reduce_protocol(cfg, n_sites, dim, budget), site, pca_source(X, lengths), exchange,
                  checkpoint=checkpoint, timeout=timeout)
    final = st["final"]
    return {"ledger": st["ledger"], "basis": np.asarray(final.arrays["V"]),
            "eigenvalues": np.asarray(final.arrays["eigenvalues"])}


def reduce_aggregator(cfg: RunConfig, step: str, exchange: Exchange, *, n_sites: int, dim: int | None = None,
                      public=None, previous=None, checkpoint: Checkpoint | None = None,
                      options: RunOptions | None = None) -> dict[str, Any]:
    """The aggregator's part of capePCA: averages the noisy second moments, eigendecomposes."""
    st = run_aggregator(reduce_protocol(cfg, n_sites, dim), exchange, checkpoint=checkpoint, options=options)
    # how far one deviating site could move each averaged release past the aggregator's checks (CAPE only)
    influence = {k: dict(v) for k, v in st.get("cape", {}).get("influence", {}).items()}
    return {"basis": np.asarray(st["basis"]), "eigenvalues": np.asarray(st["eigenvalues"]),
            "rounds": int(st.get("rounds", 0)), "influence": influence}


# -- unmix: spatial ICA, or capeDJICA / the cumulant ICA --------------------------------

def site_whiten(X, basis, eigenvalues, *, linear: bool = False) -> np.ndarray:
    """A site's whitened data Z = Lambda^{-1/2} V^T x for its unit-norm time points (float32).

    ``linear``: x / sqrt(D) instead of x / ||x||: the same scale on average for standardized features (each of
    unit variance), without rescaling each time point, which would flatten the amplitude fluctuations that
    make sources non-Gaussian (the cumulant unmixing reads them; :func:`unmixing_input`).

    ``X`` is the site's D x N matrix, or the path of its ``.npy`` file: it is
    read in column blocks, so only the k x N result and one block are in
    memory. The basis is made C-contiguous first: BLAS rounds a float32
    product differently for another memory layout, and the basis reaches a
    site in different layouts (from ``np.load`` of a Fortran-ordered file in
    a simulation, from a decoded message in a deployment).
    """
    V = np.ascontiguousarray(basis, dtype=np.float64)
    lam = np.ascontiguousarray(eigenvalues, dtype=np.float64)
    X = site_matrix(X)
    T = whitening_matrix(V, lam, np.float32)  # checked and formed once, not per block; scale_columns gives float32
    if X.ndim != 2 or X.shape[0] != T.shape[1]:
        raise ValueError(f"X must be D x N with D = {T.shape[1]}, got shape {X.shape}")
    Z = np.empty((T.shape[0], X.shape[1]), dtype=np.float32)
    scale = np.float32(1.0 / math.sqrt(T.shape[1]))
    for a, b, blk in column_blocks(X):
        Z[:, a:b] = T @ (np.asarray(blk, np.float32) * scale if linear else scale_columns(blk, "unit"))
    return Z


def unmixing_input(cfg: RunConfig, X, basis, eigenvalues) -> np.ndarray:
    """The whitened data a run's unmixing and time courses use: unit-norm time points, or with the cumulant
    unmixing the linear scaling, which keeps the amplitude fluctuations its cumulants read (unit-norm time points
    flatten them). Its releases clip each subject's whole term, so no time point needs a norm bound."""
    return site_whiten(X, basis, eigenvalues, linear=cfg.cumulant_unmixing)


def unmix_protocol(cfg: RunConfig, n_sites: int, budget: SiteBudget | None = None):
    """The run's temporal unmixing under its noise plan, as driver phases."""
    return cape_protocol(ica_algorithm(cfg), noise_plan(cfg), n_sites=n_sites, budget=budget)


@dataclass
class UnmixResult:
    """What the unmixing stage produced (the aggregator's view) and each site's ledger."""

    W: np.ndarray
    b: np.ndarray
    history: dict[str, list[float]] = field(default_factory=dict)
    rounds: int = 0
    status: str = ""
    ledgers: list[PrivacyLedger | None] = field(default_factory=list)


def _unmix_result(agg: State) -> UnmixResult:
    if "ica" not in agg:  # the cumulant ICA: its two releases, then W
        W = np.asarray(agg["W"])
        return UnmixResult(W, np.zeros(W.shape[0]), {}, 2 if "P" in agg else 1, "separated")
    st = agg["ica"]
    W, b = reported_unmixing(st)  # the Polyak average when the optimizer keeps one, else the last iterate
    hist = {k: [float(x) for x in v] for k, v in st["history"].items()}
    return UnmixResult(np.array(W), np.array(b), hist, len(hist.get("rho", [])), str(st["status"]))


def _spatial_result(basis, eigenvalues) -> UnmixResult:
    r = spatial_ica(basis, eigenvalues)
    note = r.restart_note()  # collapsed FastICA starts, restarted: in the run's record and the report's headline
    return UnmixResult(r.W, np.zeros(r.W.shape[0]), {}, 0, f"{r.status}; {note}" if note else r.status)


def describe_unmixing(cfg: RunConfig, rounds: int, status: str) -> str:
    """How the maps were unmixed, for a report's headline."""
    if cfg.ica == "spatial":
        return f"spatial ICA of the released basis, no further release (FastICA {status})"
    if cfg.cumulant_unmixing:
        return "temporal ICA, the whitening refined and the subjects' fourth-order cumulants released (2 releases)"
    return f"temporal ICA, {rounds} capeDJICA rounds ({status})"


def unmix_site(cfg: RunConfig, step: str, site: int, Z, lengths: Sequence[int], exchange: Exchange, *,
               n_sites: int, dim: int | None = None, previous=None, checkpoint: Checkpoint | None = None,
               timeout: float | None = None,
               budget: SiteBudget | None = None) -> dict[str, Any]:
    """One site's part of the temporal unmixing on its whitened data Z (R x N); returns its ledger.

    Spatial ICA is the aggregator's post-processing of the released basis: the
    site sends nothing and its ledger stays empty.
    """
    if cfg.ica == "spatial":
        return {"ledger": PrivacyLedger()}
    st = run_site(unmix_protocol(cfg, n_sites, budget), site, (Z, [int(n) for n in lengths]), exchange,
                  checkpoint=checkpoint, timeout=timeout)
    return {"ledger": st["ledger"]}


def unmix_aggregator(cfg: RunConfig, step: str, exchange: Exchange, *, n_sites: int, dim: int | None = None,
                     public: Mapping[str, Mapping[str, Any]], previous=None, checkpoint: Checkpoint | None = None,
                     options: RunOptions | None = None) -> dict[str, Any]:
    """The aggregator's part of the temporal unmixing (capeDJICA: averages the noisy gradients, updates W and b).

    With spatial ICA it unmixes the released basis and eigenvalues (``public["reduce"]``) alone, without
    messages. The components are then put in the run's public order (:func:`dpneuro.run.naming.ordered_unmixing`),
    which every later reader sees.
    """
    V, lam = public["reduce"]["basis"], public["reduce"]["eigenvalues"]
    if cfg.ica == "spatial":
        r = _spatial_result(V, lam)
    else:
        r = _unmix_result(run_aggregator(unmix_protocol(cfg, n_sites), exchange, checkpoint=checkpoint,
                                         options=options))
    W, b = ordered_unmixing(cfg, V, lam, r.W, r.b)
    return {"W": W, "b": b, "history": r.history, "rounds": r.rounds, "status": r.status}


# -- fnc: static functional network connectivity ----------------------------------------------

def _fnc_protocol(cfg: RunConfig, n_sites: int, budget: SiteBudget | None = None):
    P = cfg.n_components * (cfg.n_components - 1) // 2
    return cape_protocol(fnc_settings(cfg).algorithm(P=P, n_sites=n_sites), noise_plan(cfg), n_sites=n_sites,
                         budget=budget)


def fnc_site(cfg: RunConfig, step: str, site: int, S, lengths: Sequence[int], exchange: Exchange, *, n_sites: int,
             dim: int | None = None, previous=None, checkpoint: Checkpoint | None = None,
             timeout: float | None = None,
             budget: SiteBudget | None = None) -> dict[str, Any]:
    """One site's FNC release from its component time courses S (R x N): its subjects' FNC, each bounded, their
    mean released. Returns the site's ledger and the consortium's mean as broadcast."""
    r = run_site(_fnc_protocol(cfg, n_sites, budget), site, site_fnc(S, lengths), exchange, checkpoint=checkpoint,
                 timeout=timeout)
    final = r.get("final")
    return {"ledger": r["ledger"], **({"fnc": np.asarray(final.arrays["fnc"])} if final is not None else {})}


def fnc_aggregator(cfg: RunConfig, step: str, exchange: Exchange, *, n_sites: int, dim: int | None = None,
                   public=None, previous=None, checkpoint: Checkpoint | None = None,
                   options: RunOptions | None = None) -> dict[str, Any]:
    """The consortium's mean FNC (Fisher z, P = R(R-1)/2 pairs) and its noise's variance per entry."""
    st = run_aggregator(_fnc_protocol(cfg, n_sites), exchange, checkpoint=checkpoint, options=options)
    return {"fnc": np.asarray(st["fnc"]), "noise_var": float(st["noise_var"])}


# -- glm: group statistics ----------------------------------------------------------------

def participants_table(cfg: RunConfig, name: str):
    """Where site ``name`` keeps its subjects' covariates: its entry's ``participants``, else participants.tsv in
    its folder (or beside its first file)."""
    entry = next((s for s in cfg.sites if s.name == name), None)
    if entry is None:
        raise ConfigError(f"config field 'sites': no site named {name!r}")
    return participants_path(entry.path or (entry.files[0] if entry.files else ""), entry.participants)


def glm_input(cfg: RunConfig, site: Mapping[str, Any], S, public: Mapping[str, Mapping[str, Any]]) -> np.ndarray:
    """A site's contributions to the group model (one bounded row per subject in it) from its loader's record
    (subject ids, name), component time courses S (R x N) and the earlier public results (the mean FNC the edges
    are centred on, the brain states its subjects' dynamics are measured against); its participants table gives
    the covariates.

    A subject without them stops the site, naming it, or with ``on_bad_subject = "skip"`` is left out of the
    model (named on the site's console); continuous values outside the agreed range are clipped and counted.
    """
    settings = glm_settings(cfg, run_networks(cfg, public))
    name = site.get("site", "this site")
    names = [s.name for s in cfg.sites]
    path = participants_table(cfg, name)
    ids = list(site["subject_ids"])
    at = names.index(name) if name in names else 0
    # the pre-flight's own check, on the subjects loaded
    rows, clipped, why = check_covariates(path, ids, settings.design, at, name, cfg.on_bad_subject)
    lengths = [int(b) - int(a) for a, b in site["boundaries"]]
    dynamics = None
    if "states" in settings.measures:
        ws = site_windows(cfg, S, lengths, tr=site.get("tr"), where=f"site {name}")
        dynamics = {**site_dynamics(ws, np.asarray(public["states"]["vectors"]), cfg.states_metric),
                    "n_windows": np.asarray(ws.lengths)}
    Y, names, _ = subject_measures(S, lengths, settings.computed, public.get("fnc", {}).get("fnc"), dynamics,
                                   settings.networks)
    Y, absent = settings.select(Y, names)
    keep = [i for i, sid in enumerate(ids) if sid in rows]
    X = np.array([rows[ids[i]] for i in keep]).reshape(len(keep), settings.design.p)
    T, scaled = pack_statistics(X, Y[keep], settings.design, settings.families)
    notes = [f"{len(keep)} of {len(ids)} subjects in the model"]
    if absent:
        notes.append("not measured in this run (no components): " + ", ".join(absent))
    if why:
        notes.append("left out: " + "; ".join(f"{k} ({v})" for k, v in why.items()))
    if clipped:
        notes.append(f"{clipped} covariate value(s) clipped to the agreed range")
    if scaled:
        notes.append(f"{scaled} subject(s)' measures scaled onto their bound")
    print(f"site {name}: group statistics: " + "; ".join(notes), file=sys.stderr)
    return T


def _glm_protocol(cfg: RunConfig, n_sites: int, budget: SiteBudget | None = None):
    return cape_protocol(glm_settings(cfg).algorithm(n_sites=n_sites), noise_plan(cfg), n_sites=n_sites,
                         budget=budget)


def glm_site(cfg: RunConfig, step: str, site: int, T, lengths: Sequence[int], exchange: Exchange, *, n_sites: int,
             dim: int | None = None, previous=None, checkpoint: Checkpoint | None = None,
             timeout: float | None = None,
             budget: SiteBudget | None = None) -> dict[str, Any]:
    """One site's group-statistics release: the mean of its subjects' bounded contributions (:func:`glm_input`)."""
    r = run_site(_glm_protocol(cfg, n_sites, budget), site, T, exchange, checkpoint=checkpoint, timeout=timeout)
    return {"ledger": r["ledger"]}


def glm_aggregator(cfg: RunConfig, step: str, exchange: Exchange, *, n_sites: int, dim: int | None = None,
                   public=None, previous=None, checkpoint: Checkpoint | None = None,
                   options: RunOptions | None = None) -> dict[str, Any]:
    """The consortium's group effects (each contrast x measure: estimate, interval, p, q, noise sd) fitted from
    the release (post-processing), and the subjects each site put in the model (public)."""
    st = run_aggregator(_glm_protocol(cfg, n_sites), exchange, checkpoint=checkpoint, options=options)
    settings = glm_settings(cfg, run_networks(cfg, public or {}))
    return {**settings.fit(st["glm"], st["counts"], st["noise_var"]), "counts": np.asarray(st["counts"]),
            "measures": settings.names,
            "networks": None if settings.networks is None else list(settings.networks)}


def run_networks(cfg: RunConfig, public: Mapping[str, Mapping[str, Any]]) -> tuple[str, ...] | None:
    """Each component's atlas network when the group statistics need them ("networks" measures or
    hypotheses), from the released basis and the unmixing (:func:`dpneuro.run.naming.component_networks`: the
    same at every party); None when they need none. Refuses a run whose components cannot be named."""
    settings = glm_settings(cfg)
    if "networks" not in settings.computed:
        return None
    nets = component_networks(cfg, public["reduce"]["basis"], public["reduce"]["eigenvalues"],
                              public["unmix"]["W"])
    if nets is None or (not settings.hypotheses and not network_pairs(nets)):
        found = "" if nets is None else f" (this run's components: {', '.join(sorted(set(nets)))})"
        raise ConfigError("the \"networks\" measures need two or more components named with an atlas network on "
                          f"the run's grid (a standard MNI space){found}; use \"fnc\" instead")
    return nets


# -- states: dFNC brain states -----------------------------------------------------------

def window_counts(cfg: RunConfig, lengths: Sequence[int]) -> list[int]:
    """Each subject's number of dFNC windows from its volume count (the planner needs no data)."""
    return [(int(n) - cfg.states_window) // cfg.states_step + 1 for n in lengths]


def check_window_fits(cfg: RunConfig, lengths: Sequence[int], where: str) -> None:
    """Refuse a subject shorter than one window, naming the setting."""
    short = min(int(n) for n in lengths)
    if short < cfg.states_window:
        raise ConfigError(f"config field 'states_window': {where} has a subject of {short} volumes, fewer than one "
                          f"window of {cfg.states_window}; lower states_window or leave such subjects out "
                          "(min_volumes)")


def site_windows(cfg: RunConfig, S, lengths: Sequence[int], *, tr: float | None = None,
                 where: str = "this site") -> WindowSet:
    """A site's dFNC windows from its component time courses S (R x N, subjects' columns in order)."""
    check_window_fits(cfg, lengths, where)
    S = np.asarray(S, np.float64)
    bounds = np.cumsum([0, *[int(n) for n in lengths]])
    return windows_of([S[:, a:b] for a, b in zip(bounds[:-1], bounds[1:])], window=cfg.states_window,
                      step=cfg.states_step, tr=tr or 2.0)


def states_site(cfg: RunConfig, step: str, site: int, S, lengths: Sequence[int], exchange: Exchange, *,
                n_sites: int, dim: int | None = None, previous: dict | None = None,
                checkpoint: Checkpoint | None = None, timeout: float | None = None,
                budget: SiteBudget | None = None) -> dict[str, Any]:
    """One site's part of one brain-states release (``step``: ``states-<release>``), on its component time
    courses S (R x N); ``previous`` is its result of the stage's previous release. Returns the site's ledger and
    what the release made public."""
    step = step.removeprefix("states-")
    st = states_settings(cfg)
    ws = site_windows(cfg, S, lengths, where=f"site {site}")
    alg = st.algorithm(step, D=ws.D, n_sites=n_sites, groups={site: max(ws.lengths)}, previous=previous)
    r = run_site(cape_protocol(alg, noise_plan(cfg), n_sites=n_sites, budget=budget), site,
                 st.site_data(step, ws, site), exchange,
                 checkpoint=checkpoint, timeout=timeout)
    r["ledger"].note(DFNC_UNIT_NOTE)
    return {"ledger": r["ledger"], **st.site_result(step, r.get("final"), previous)}


def states_aggregator(cfg: RunConfig, step: str, exchange: Exchange, *, n_sites: int, dim: int | None = None,
                      public=None, previous: dict | None = None, checkpoint: Checkpoint | None = None,
                      options: RunOptions | None = None) -> dict[str, Any]:
    """The aggregator's part of one brain-states release; after the last, the states' ``vectors`` (D x K,
    Fisher z of the connectivity pairs) and the consortium's ``occupancy`` (K)."""
    step = step.removeprefix("states-")
    st = states_settings(cfg)
    D = cfg.n_components * (cfg.n_components - 1) // 2
    alg = st.algorithm(step, D=D, n_sites=n_sites, previous=previous)
    state = run_aggregator(cape_protocol(alg, noise_plan(cfg), n_sites=n_sites), exchange, checkpoint=checkpoint,
                           options=options)
    return st.aggregator_result(step, state, previous)


# -- summary: close a deployed run --------------------------------------------------------

class SummaryProtocol:
    """One phase: sites send public metadata (ledger, counts), the aggregator answers with ``reply``.

    Site data: a JSON-safe dict (what the site declares). The aggregator keeps
    them in ``state["sites"]`` keyed by site id. ``reply`` is a payload, or a
    function of what the sites declared (site id -> dict) that makes it: the
    aggregator then answers with what it gathered (every site's counts).
    """

    name = "summary"
    max_rounds = 1

    def __init__(self, reply: Payload | Callable[[dict[int, dict]], Payload] | None = None):
        self.reply = reply or Payload()

    def phases(self, round: int) -> Sequence[Phase]:
        return [Phase("summary", self._site, self._aggregator)]

    def site_init(self, site: int, data: Any) -> State:
        return {"site": site, "info": dict(data)}

    def aggregator_init(self) -> State:
        return {"sites": {}}

    def _site(self, state: State, rnd: int, incoming: Payload | None) -> Payload:
        return Payload(meta={"summary": state["info"]})  # public metadata only, no arrays

    def _aggregator(self, state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
        state["sites"] = {str(s): dict(m.meta["summary"]) for s, m in msgs.items()}
        reply = self.reply({int(s): d for s, d in state["sites"].items()}) if callable(self.reply) else self.reply
        return Payload(dict(reply.arrays), {**reply.meta, "stop": True}, carries={k: "public" for k in reply.arrays})


def summary_site(site: int, info: dict, exchange: Exchange, *, checkpoint: Checkpoint | None = None,
                 timeout: float | None = None) -> Payload:
    """Send ``info`` (public) to the aggregator; return its reply."""
    return run_site(SummaryProtocol(), site, info, exchange, checkpoint=checkpoint, timeout=timeout)["final"]


def summary_aggregator(reply: Payload | Callable[[dict[int, dict]], Payload], exchange: Exchange, *,
                       checkpoint: Checkpoint | None = None, options: RunOptions | None = None) -> dict[int, dict]:
    """Collect every site's declared metadata; answer with ``reply`` (public arrays and metadata; a function of
    what the sites declared, to broadcast it)."""
    st = run_aggregator(SummaryProtocol(reply), exchange, checkpoint=checkpoint, options=options)
    return {int(s): info for s, info in st["sites"].items()}
