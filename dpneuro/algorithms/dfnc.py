"""Dynamic functional network connectivity (dFNC) states, private, over CAPE.

GIFT's dFNC (Allen et al. 2014, "Tracking whole-brain connectivity dynamics in
the resting state", Cerebral Cortex), with the clustering done by the
consortium from CAPE releases and subjects as the privacy unit.

At a site (nothing leaves it):

- each subject's R component time courses (R x T, each standardised) are cut
  into tapered windows: a rectangle of ``window`` TRs convolved with a
  Gaussian of ``sigma`` TRs, scaled to peak 1, one window every ``step`` TRs
  (window starts 0, step, ..., T - window; the taper's tails are cut at the
  scan's ends, not wrapped round as GIFT's circular shift does);
- a window's connectivity is the Pearson correlation of the tapered time
  courses (GIFT's ``corr`` of the windowed data), Fisher z, upper triangle: a
  vector of D = R(R-1)/2 entries. A site's windows are a D x N matrix
  (:class:`WindowSet`, windows as columns, with each subject's window count).

Privacy unit and bound (docs/privacy.md, "dFNC states"): each subject's
windows are weighted 1/n_windows, and the subject's whole contribution to the
k-means sums (a K x D matrix: its weighted windows summed per state) is
clipped to the public Frobenius norm ``bound`` B; its contribution to the
counts is its occupancy vector (sums to 1). However many windows it has, a
subject moves a site's sums by at most 2B / M_s and its counts by at most
sqrt(2) / M_s (replacement). Clipping the subject's contribution rather than
each window lets B sit at the size of a subject's *mean* windows, in which
the windows' own sampling noise has averaged out, so the same noise buys a
clearer signal (benchmarks/dfnc_states.py measures the result). capeAGN's
moments clip each window (scaled by B) as :mod:`dpneuro.algorithms.agn` does.

Consortium states (each a CAPE release per site, composed in the ledger):

- ``"kmeans"``: CAPE k-means (Lloyd). Each round the sites assign their windows
  to the public centroids (``metric``: correlation distance by default;
  city-block as GIFT, or Euclidean) and release per-state weighted clipped
  sums (K x D, sensitivity 2B / M_s) and counts (K, sensitivity sqrt(2) / M_s);
  the aggregator divides the averages and broadcasts the new centroids. The
  centroid is the mean (GIFT's city-block k-means uses the median, which has
  no bounded-sensitivity sum). Without another start, round 0 puts every
  window in one state (the consortium mean) and the aggregator splits it
  along public random directions. The final centroids divide the average of
  the last ``average_last`` rounds' sums by that of their counts (free
  post-processing; once assignments settle the rounds release nearly the same
  sums). Correlation assignment is the default: a noisy count
  rescales a centroid, which moves city-block and Euclidean assignments but
  not correlation ones (benchmarks/dfnc_states.py has both).
- ``"agn"``: capeAGN's one-shot moments of the window vectors ([CAPE-TF]
  Alg. 3, :mod:`dpneuro.algorithms.agn`, reused as is): M2 and M3 of the
  windows scaled by B, the tensor power method; the MOG means are the states
  and the weights their occupancies.
- ``"agn+kmeans"``: the capeAGN means start the CAPE k-means.

The budget (epsilon, delta) is the whole stage's per site, against the
headline adversary (the aggregator colluding with the assumed number of
sites): mu(epsilon, delta) is split over the releases by ``mu^2`` shares
(:func:`noise_multipliers`), and the ledger's composed figure equals epsilon
for equal sites (at most epsilon for unequal ones).

Per subject, from the public centroids at its own site: fraction of windows in
each state, mean dwell time (windows and seconds) and number of transitions
(:func:`subject_dynamics`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import privacy
from ..cape import NoisePlan, ReleaseSpec, ledgers as cape_ledgers, planned_ledgers, run_cape
from ..cape.plans import symmetric_guarantee
from ..exchange import Payload
from ..privacy import PrivacyLedger
from . import tensor as tz
from .agn import _M3Stage, _third_moment_whitened, finish_moments, moment_stage, prepare_site

__all__ = [
    "DFNCStates",
    "METHODS",
    "METRICS",
    "StateSettings",
    "UNIT_NOTE",
    "CapeKMeans",
    "WindowSet",
    "assign",
    "dfnc_states",
    "matrix_to_vector",
    "noise_multipliers",
    "plan_ledgers",
    "site_dynamics",
    "site_windows",
    "stage_ledgers",
    "state_matrices",
    "subject_dynamics",
    "taper",
    "window_connectivity",
]

METHODS = ("kmeans", "agn", "agn+kmeans")
METRICS = ("cityblock", "euclidean", "correlation")
#: |r| is capped below 1 before Fisher z (a window of perfectly collinear courses)
_R_MAX = 1.0 - 1e-7
UNIT_NOTE = ("dFNC privacy unit: one subject (all its windows); each window clipped to the public bound B, "
              "each subject's windows weighted 1 / n_windows (docs/privacy.md, 'dFNC states')")


# -- windows -------------------------------------------------------------------------------

def taper(n_timepoints: int, window: int = 22, sigma: float = 3.0, step: int = 1) -> np.ndarray:
    """GIFT's tapered windows as rows: (n_windows, T) weights, peak 1.

    Window i is a rectangle on TRs [i step, i step + window) convolved with a
    Gaussian of std ``sigma`` TRs (tails cut at the scan's ends).
    """
    T = int(n_timepoints)
    if isinstance(window, bool) or int(window) != window or window < 3:
        raise ValueError(f"window must be an integer >= 3 TRs, got {window!r}")
    if isinstance(step, bool) or int(step) != step or step < 1:
        raise ValueError(f"step must be a positive integer, got {step!r}")
    if not (sigma >= 0 and math.isfinite(sigma)):
        raise ValueError(f"sigma must be finite and >= 0, got {sigma}")
    if T < window:
        raise ValueError(f"{T} time points are fewer than one window of {window} TRs")
    starts = np.arange(0, T - window + 1, step)
    rect = np.zeros((len(starts), T))
    for i, t0 in enumerate(starts):
        rect[i, t0:t0 + window] = 1.0
    if sigma == 0:
        return rect
    half = int(math.ceil(4 * sigma))
    u = np.arange(-half, half + 1)
    g = np.exp(-0.5 * (u / sigma) ** 2)
    w = np.stack([np.convolve(r, g, mode="same") for r in rect])
    return w / w.max(axis=1, keepdims=True)


def window_connectivity(tc, *, window: int = 22, sigma: float = 3.0, step: int = 1,
                        fisher: bool = True) -> np.ndarray:
    """One subject's window vectors: D x n_windows (correlation of the tapered courses, Fisher z).

    ``tc`` is R x T (components as rows); each course is standardised first
    (GIFT's courses are, and the taper would otherwise carry the mean into the
    correlation).
    """
    x = np.asarray(tc, np.float64)
    if x.ndim != 2 or x.shape[0] < 2:
        raise ValueError(f"time courses must be R x T with R >= 2, got shape {x.shape}")
    if not np.all(np.isfinite(x)):
        raise ValueError("time courses contain NaN or infinite values")
    sd = x.std(axis=1, keepdims=True)
    if np.any(sd == 0):
        raise ValueError("a component's time course is constant")
    x = (x - x.mean(axis=1, keepdims=True)) / sd
    w = taper(x.shape[1], window, sigma, step)
    Y = w[:, None, :] * x[None, :, :]  # n_w x R x T
    Y = Y - Y.mean(axis=2, keepdims=True)
    C = Y @ Y.transpose(0, 2, 1)
    d = np.sqrt(np.einsum("wrr->wr", C))
    r = C / d[:, :, None] / d[:, None, :]
    iu = np.triu_indices(x.shape[0], 1)
    v = r[:, iu[0], iu[1]].T  # D x n_w
    return np.arctanh(np.clip(v, -_R_MAX, _R_MAX)) if fisher else v


def n_components_of(D: int) -> int:
    """R such that R(R-1)/2 = D."""
    R = int(round((1 + math.sqrt(1 + 8 * D)) / 2))
    if R * (R - 1) // 2 != D:
        raise ValueError(f"{D} is not R(R-1)/2 for any R: not a vector of a correlation matrix's upper triangle")
    return R


def state_matrices(vectors, *, fisher: bool = True) -> np.ndarray:
    """K x R x R correlation matrices from D x K window-space vectors (inverse Fisher z; diagonal 1)."""
    V = np.asarray(vectors, np.float64)
    V = V[:, None] if V.ndim == 1 else V
    R = n_components_of(V.shape[0])
    iu = np.triu_indices(R, 1)
    out = np.repeat(np.eye(R)[None], V.shape[1], axis=0)
    vals = np.tanh(V) if fisher else V
    out[:, iu[0], iu[1]] = vals.T
    out[:, iu[1], iu[0]] = vals.T
    return out


def matrix_to_vector(C, *, fisher: bool = True) -> np.ndarray:
    """Upper triangle (Fisher z) of R x R matrices: D, or D x K for a K x R x R stack."""
    C = np.asarray(C, np.float64)
    iu = np.triu_indices(C.shape[-1], 1)
    v = C[..., iu[0], iu[1]]
    v = np.arctanh(np.clip(v, -_R_MAX, _R_MAX)) if fisher else v
    return v.T if v.ndim == 2 else v


@dataclass
class WindowSet:
    """One site's window vectors (stays at the site): D x N, windows as columns, subject by subject."""

    X: np.ndarray
    lengths: list[int]
    tr: float = 2.0
    step: int = 1

    def __post_init__(self):
        self.X = np.asarray(self.X, np.float64)
        self.lengths = [int(n) for n in self.lengths]
        if self.X.ndim != 2 or sum(self.lengths) != self.X.shape[1] or min(self.lengths, default=0) < 1:
            raise ValueError(f"window vectors {self.X.shape} do not match the subjects' window counts "
                             f"(sum {sum(self.lengths)}, every subject needs >= 1 window)")
        if not np.all(np.isfinite(self.X)):
            raise ValueError("window vectors contain NaN or infinite values")

    @property
    def D(self) -> int:
        return self.X.shape[0]

    @property
    def n_subjects(self) -> int:
        return len(self.lengths)

    def subject_weights(self) -> np.ndarray:
        """1 / n_windows of each window's subject (a subject's weights sum to 1)."""
        return np.repeat([1.0 / n for n in self.lengths], self.lengths)

    def subject_index(self) -> np.ndarray:
        """Each window's subject (0 .. M - 1)."""
        return np.repeat(np.arange(len(self.lengths)), self.lengths)

    def subjects(self):
        start = 0
        for n in self.lengths:
            yield self.X[:, start:start + n]
            start += n


def site_windows(subject_tcs: Sequence, *, window: int = 22, sigma: float = 3.0, step: int = 1,
                 tr: float = 2.0) -> WindowSet:
    """A site's :class:`WindowSet` from its subjects' R x T component time courses."""
    vecs = [window_connectivity(tc, window=window, sigma=sigma, step=step) for tc in subject_tcs]
    if not vecs:
        raise ValueError("a site needs at least one subject")
    return WindowSet(np.concatenate(vecs, axis=1), [v.shape[1] for v in vecs], tr=tr, step=step)


# -- assignment and per-subject dynamics ---------------------------------------------------

def _check_metric(metric: str) -> None:
    if metric not in METRICS:
        raise ValueError(f"unknown metric {metric!r}; use one of {METRICS}")


def assign(X, centroids, metric: str = "correlation", chunk: int = 4096) -> np.ndarray:
    """Nearest centroid (columns of the D x K ``centroids``) of every column of ``X``."""
    _check_metric(metric)
    X = np.asarray(X, np.float64)
    C = np.asarray(centroids, np.float64)
    if metric == "euclidean":
        d = np.einsum("dk,dk->k", C, C)[None, :] - 2.0 * X.T @ C
        return np.argmin(d, axis=1)
    if metric == "correlation":
        Xc = X - X.mean(axis=0)
        Cc = C - C.mean(axis=0)
        Cc = Cc / np.maximum(np.linalg.norm(Cc, axis=0), 1e-300)
        return np.argmax(Xc.T @ Cc, axis=1)  # the row norm of X does not change the argmax
    out = np.empty(X.shape[1], np.int64)
    for a in range(0, X.shape[1], chunk):
        blk = X[:, a:a + chunk]
        out[a:a + chunk] = np.argmin(np.abs(blk[:, :, None] - C[:, None, :]).sum(axis=0), axis=1)
    return out


def subject_dynamics(labels, n_states: int, *, tr: float = 2.0, step: int = 1) -> dict[str, Any]:
    """GIFT's per-subject state statistics from its window-by-window state sequence.

    Returns ``occupancy`` (fraction of windows per state), ``dwell_windows``
    and ``dwell_seconds`` (mean run length per state; 0 for a state never
    visited, as GIFT) and ``transitions`` (number of changes of state).
    """
    h = np.asarray(labels, np.int64)
    occ = np.bincount(h, minlength=n_states) / max(h.size, 1)
    change = np.flatnonzero(np.diff(h)) + 1
    starts = np.r_[0, change]
    runs = np.diff(np.r_[starts, h.size])
    dwell = np.zeros(n_states)
    for k in range(n_states):
        r = runs[h[starts] == k]
        dwell[k] = r.mean() if r.size else 0.0
    return {"occupancy": occ, "dwell_windows": dwell, "dwell_seconds": dwell * step * tr,
            "transitions": int(change.size)}


def site_dynamics(ws: WindowSet, centroids, metric: str = "correlation") -> dict[str, np.ndarray]:
    """Every subject's :func:`subject_dynamics` at its site from the public centroids (D x K); subjects x ..."""
    K = np.shape(centroids)[1]
    labels = assign(ws.X, centroids, metric)
    per, start = [], 0
    for n in ws.lengths:
        per.append(subject_dynamics(labels[start:start + n], K, tr=ws.tr, step=ws.step))
        start += n
    return {key: np.array([p[key] for p in per]) for key in per[0]}


# -- budget ----------------------------------------------------------------------------------

def noise_multipliers(epsilon: float | None, delta: float, shares: dict[str, float], *, n_sites: int,
                      plan: NoisePlan | str = "cape", repeats: dict[str, int] | None = None) -> dict[str, float]:
    """Noise multiplier of each release so that the stage composes to (epsilon, delta) per site.

    ``shares`` are fractions of mu^2 (summing to 1) for each named release
    over all its ``repeats`` (rounds; default 1): one release of share f made
    r times gets mu_i = sqrt(f / r) mu(epsilon, delta) against the headline
    adversary; under CAPE one release at noise multiplier z is worth m / z
    against it (m = :func:`dpneuro.cape.plans.symmetric_guarantee`), so
    z_i = m / mu_i. ``epsilon`` None needs plan "none": zeros (not private).
    """
    plan = NoisePlan.coerce(plan)
    repeats = repeats or {}
    tot = sum(shares.values())
    if not shares or any(not (f > 0) for f in shares.values()) or not math.isclose(tot, 1.0, abs_tol=1e-9):
        raise ValueError(f"budget shares must be positive and sum to 1, got {shares}")
    if plan.kind == "none" or epsilon is None:
        if plan.kind != "none":
            raise ValueError(f"epsilon None means no noise: use plan 'none', not {plan.kind!r}")
        return {k: 0.0 for k in shares}
    plan.check(n_sites)
    mu = privacy.gdp_mu(float(epsilon), float(delta))
    m = symmetric_guarantee(n_sites, plan.colluders(n_sites), plan.zero_sum_variance) if plan.kind == "cape" else 1.0
    return {k: m * math.sqrt(repeats.get(k, 1) / f) / mu for k, f in shares.items()}


def _shares(method: str, count_share: float, agn_share: float) -> dict[str, float]:
    """Fractions of the stage's mu^2 per named release (all its rounds together)."""
    km = {"kmeans": 1.0, "agn": 0.0}.get(method, 1.0 - agn_share)
    agn = 0.0 if method == "kmeans" else (1.0 if method == "agn" else agn_share)
    out = {"m2": agn / 2, "m3": agn / 2, "sums": km * (1 - count_share), "counts": km * count_share}
    return {k: v for k, v in out.items() if v > 0}


# -- CAPE k-means ----------------------------------------------------------------------------

class CapeKMeans:
    """Lloyd's k-means as a CAPE algorithm: per round, per-state clipped weighted sums and counts.

    ``init``: D x K public centroids, or None to spend round 0 on the
    consortium mean (every window in state 0) and split it along public
    random directions of norm ``split_scale`` B. Every round releases "sums"
    and "counts", with noise multipliers ``z_sums``, ``z_counts``; ``bound``
    is the Frobenius bound B of one subject's K x D contribution. ``random_state`` (None, an int or a
    Generator, which gives the seed by one draw) seeds the sites' noise and the split's directions.
    """

    name = "dfnc-kmeans"

    def __init__(self, n_states: int, n_rounds: int, bound: float, z_sums: float, z_counts: float, *,
                 init: np.ndarray | None = None, metric: str = "correlation", random_state=None,
                 min_count: float = 0.01, split_scale: float = 0.25, average_last: int = 1):
        _check_metric(metric)
        if isinstance(n_rounds, bool) or int(n_rounds) != n_rounds or n_rounds < 1:
            raise ValueError(f"n_rounds must be a positive integer, got {n_rounds!r}")
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"bound must be finite and > 0, got {bound}")
        self.K, self.max_rounds, self.B = int(n_states), int(n_rounds), float(bound)
        self.z_sums, self.z_counts, self.metric = z_sums, z_counts, metric
        self.random_state = privacy.resolve_random_state(random_state)
        self.init = None if init is None else np.asarray(init, np.float64)
        self.min_count, self.split_scale = min_count, split_scale
        if isinstance(average_last, bool) or int(average_last) != average_last or not 1 <= average_last <= n_rounds:
            raise ValueError(f"average_last must be an integer in [1, n_rounds = {n_rounds}], got {average_last!r}")
        self.average_last = int(average_last)

    # site steps
    def site_init(self, site: int, data) -> dict:
        ws = data if isinstance(data, WindowSet) else WindowSet(*data)
        state: dict[str, Any] = {"_X": ws.X, "_w": ws.subject_weights(), "_subject": ws.subject_index(),
                                 "M": ws.n_subjects, "D": ws.D}
        if self.random_state is not None:
            state["rng"] = np.random.default_rng([self.random_state, 11, site])
        return state

    def public_state(self, site: int, lengths, dim: int) -> dict:
        """What a site's releases depend on (the planner calls this without data)."""
        return {"M": len(lengths), "D": int(dim)}

    def site_weight(self, state) -> float:
        return float(state["M"])

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        M, D, K = state["M"], state["D"], self.K
        # replacing a subject: two contributions of norm <= B (sums) / two probability vectors (counts)
        return {"sums": ReleaseSpec((K, D), 2.0 * self.B / M, self.z_sums, unit="subject", stage="dfnc-kmeans"),
                "counts": ReleaseSpec((K,), math.sqrt(2.0) / M, self.z_counts, unit="subject",
                                      stage="dfnc-kmeans")}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        X, w = state["_X"], state["_w"]
        if broadcast.meta.get("one_state"):
            lab = np.zeros(X.shape[1], np.int64)
        else:
            lab = assign(X, broadcast.arrays["centroids"], self.metric)
        M, D, K = state["M"], X.shape[0], self.K
        # each subject's K x D contribution (its windows weighted 1 / n_windows), clipped to Frobenius norm B
        cell = state["_subject"] * K + lab
        G = np.zeros((M * K, D))
        _add_rows(G, cell, X.T * w[:, None])
        G = G.reshape(M, K, D)
        norms = np.sqrt(np.einsum("mkd,mkd->m", G, G))
        G *= np.minimum(1.0, self.B / np.maximum(norms, 1e-300))[:, None, None]
        counts = np.bincount(lab, weights=w, minlength=K)
        return {"sums": G.sum(axis=0) / M, "counts": counts / M}

    # aggregator steps
    def aggregator_init(self) -> dict:
        return {"history": []}

    def aggregator_first(self, state) -> Payload:
        if self.init is None:
            return Payload(meta={"one_state": True})
        state["centroids"] = self.init
        return Payload({"centroids": self.init}, carries={"centroids": "public"})

    def aggregator_update(self, state, round, combined) -> Payload:
        sums, counts = combined["sums"], combined["counts"]
        if round == 0 and self.init is None:
            mean = sums[0] / max(counts[0], self.min_count)
            rng = np.random.default_rng(None if self.random_state is None else [self.random_state, 12])
            R = rng.standard_normal((mean.size, self.K))
            C = mean[:, None] + self.split_scale * self.B * R / np.linalg.norm(R, axis=0)
        else:
            old = state["centroids"]
            ok = counts > self.min_count  # a state (nearly) empty or swamped by noise keeps its centroid
            C = np.where(ok[None, :], sums.T / np.where(ok, counts, 1.0)[None, :], old)
        state["history"].append(C)
        state["releases"] = (state.get("releases", []) + [(sums, counts)])[-self.average_last:]
        stop = round == self.max_rounds - 1
        if stop:
            # once assignments settle, successive rounds release nearly the same sums: their average has the
            # precision of all of them (post-processing)
            s_avg = np.mean([r[0] for r in state["releases"]], axis=0)
            c_avg = np.mean([r[1] for r in state["releases"]], axis=0)
            ok = c_avg > self.min_count
            C = np.where(ok[None, :], s_avg.T / np.where(ok, c_avg, 1.0)[None, :], C)
            counts = c_avg
        state["centroids"] = C
        state["counts"] = counts
        return Payload({"centroids": C}, {"stop": stop}, carries={"centroids": "public (post-processing)"})


def _add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """out[index[i]] += rows[i] for all i (sorted segments: far faster than np.add.at)."""
    order = np.argsort(index, kind="stable")
    idx, starts = np.unique(index[order], return_index=True)
    out[idx] += np.add.reduceat(rows[order], starts, axis=0)


# -- capeAGN on windows -----------------------------------------------------------------------

class _WindowM3(_M3Stage):
    """capeAGN's M3 release without the D^3 moment: (M3_s + E)(W, W, W) = M3_s(W, W, W) + E(W, W, W).

    The protocol adds the symmetric noise E to the declared D x D x D release
    (here zeros) and the site contracts it with the public W before adding
    its own contracted moment: the same number the stage sends, at
    N k^3 instead of N D^3 / 2 operations.
    """

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        D = state["D"]
        return {"m3": np.zeros((D, D, D))}

    def site_postprocess(self, state, name: str, noisy: np.ndarray) -> np.ndarray:
        return tz.multilinear(noisy, self.W) + _third_moment_whitened(state["_data"], self.W, self.sigma2)


def _agn_stages(n_states: int, z2: float, z3: float, groups: dict, bound: float, seed, W=None, sigma2=None):
    if W is None:
        return moment_stage(2, n_states, z2, groups, scale=bound, random_state=seed)
    st = _WindowM3("mog", z3, unit="subject", groups=groups, seed=seed, stage_id=2, scale=bound,
                   W=np.asarray(W, np.float64), sigma2=float(sigma2 or 0.0))
    st.quiet_clipping = True
    return st


# -- the consortium's states -----------------------------------------------------------------

@dataclass
class DFNCStates:
    """dFNC states of a consortium.

    Attributes
    ----------
    vectors : ndarray, shape (D, K)
        State centroids in window space (Fisher z of the upper triangle).
    states : ndarray, shape (K, R, R)
        The states' connectivity (correlation) matrices.
    occupancy : ndarray, shape (K,)
        The consortium's fraction of windows per state: the last k-means
        round's released counts, or capeAGN's weights (post-processing).
    ledgers : list of PrivacyLedger
        One per site, every release of the stage.
    """

    vectors: np.ndarray
    occupancy: np.ndarray
    ledgers: list
    method: str
    metric: str
    bound: float
    info: dict = field(default_factory=dict)

    @property
    def states(self) -> np.ndarray:
        return state_matrices(self.vectors)


def default_bound(D: int) -> float:
    """The public bound B: 0.1 sqrt(D), an RMS Fisher z of 0.1 per pair of a subject's contribution.

    Data-independent. Most subjects' contributions exceed it and are scaled
    onto it, which weights subjects equally and costs little: the states are
    read from directions. capeAGN uses it as the windows' scale.
    """
    return 0.1 * math.sqrt(D)


def _check_sites(sites) -> list[WindowSet]:
    if isinstance(sites, (np.ndarray, WindowSet)) or not isinstance(sites, Sequence) or not sites:
        raise ValueError("sites must be a non-empty list with one WindowSet per site")
    out = [s if isinstance(s, WindowSet) else WindowSet(*s) for s in sites]
    if len({s.D for s in out}) != 1:
        raise ValueError(f"sites disagree on the window dimension: {[s.D for s in out]}")
    return out


@dataclass(frozen=True)
class StateSettings:
    """The public settings of a dFNC states stage, identical at every party.

    The stage is a sequence of CAPE releases (:meth:`steps`), each one CAPE
    algorithm (:meth:`algorithm`) whose site part reads the site's
    :class:`WindowSet` (:meth:`site_data`) and whose public result
    (:meth:`aggregator_result` at the aggregator, :meth:`site_result` at a site)
    the next step's algorithm is built from. :func:`dfnc_states` runs them with
    every party in this process; a deployed run runs the same steps over its
    exchange.

    ``epsilon``/``delta``: the whole stage per site (None with plan "none").
    ``init`` (D x K, public) starts "kmeans" instead of the split of the mean.
    ``random_state`` (None or an int) fixes the noise: simulations and tests only.
    """

    n_states: int
    epsilon: float | None
    delta: float = 1e-5
    method: str = "kmeans"
    plan: Any = "cape"
    n_rounds: int = 4
    bound: float | None = None
    metric: str = "correlation"
    count_share: float = 0.1
    agn_share: float = 0.3
    average_last: int = 2
    n_restarts: int = 30
    n_iter: int = 50
    init: Any = None
    random_state: int | None = None

    def __post_init__(self):
        _check_metric(self.metric)
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {METHODS}")
        if not 0 < self.count_share < 1 or not 0 < self.agn_share < 1:
            raise ValueError("count_share and agn_share must be in (0, 1)")
        if isinstance(self.n_states, bool) or int(self.n_states) != self.n_states or self.n_states < 2:
            raise ValueError(f"n_states must be an integer >= 2, got {self.n_states!r}")

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The (eps, delta) the whole stage is calibrated to (a planner scales the noise from it)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    @property
    def ledger_stages(self) -> tuple[str, ...]:
        """The ledger's names of the stage's releases."""
        names = {"m2": ("agn-m2",), "m3": ("agn-m3",), "kmeans": (CapeKMeans.name,)}
        return tuple(n for step in self.steps() for n in names[step])

    def steps(self) -> tuple[str, ...]:
        """The stage's releases in order (one exchange topic each)."""
        return {"kmeans": ("kmeans",), "agn": ("m2", "m3"), "agn+kmeans": ("m2", "m3", "kmeans")}[self.method]

    def check_dim(self, D: int) -> None:
        if not 2 <= self.n_states <= D:
            raise ValueError(f"n_states must be in [2, D = {D}], got {self.n_states}")

    def scale(self, D: int) -> float:
        """The public bound B (:func:`default_bound` unless given)."""
        return default_bound(D) if self.bound is None else float(self.bound)

    def multipliers(self, n_sites: int) -> dict[str, float]:
        return noise_multipliers(self.epsilon, self.delta, _shares(self.method, self.count_share, self.agn_share),
                                 n_sites=n_sites, plan=self.plan,
                                 repeats={"sums": self.n_rounds, "counts": self.n_rounds})

    def algorithm(self, step: str, *, D: int, n_sites: int, groups: dict | None = None,
                  previous: dict | None = None):
        """The CAPE algorithm of ``step``; ``previous`` is the public result of the stage's previous step
        (:meth:`aggregator_result` at the aggregator, :meth:`site_result` at a site); ``groups`` maps a site
        to its longest subject's window count (capeAGN's subject-level bound; a site needs only its own)."""
        self.check_dim(D)
        z, B, K, seed = self.multipliers(n_sites), self.scale(D), int(self.n_states), self.random_state
        if step == "m2":
            return _agn_stages(K, z["m2"], z["m3"], groups or {}, B, seed)
        if step == "m3":
            return _agn_stages(K, z["m2"], z["m3"], groups or {}, B, seed, W=previous["W"],
                               sigma2=previous.get("sigma2") or 0.0)
        if step == "kmeans":
            init = previous["vectors"] if previous is not None and "vectors" in previous else self.init
            return CapeKMeans(K, self.n_rounds, B, z["sums"], z["counts"], init=init, metric=self.metric,
                              random_state=seed, average_last=self.average_last)
        raise KeyError(f"no dFNC step {step!r}; steps: {self.steps()}")

    def planned(self, lengths: Sequence[Sequence[int]], n_components: int) -> list[PrivacyLedger]:
        """The ledgers the stage fills, from each site's window counts per subject alone."""
        D = n_components * (n_components - 1) // 2
        groups = {s: max(ln) for s, ln in enumerate(lengths)}
        previous = {"W": np.zeros((D, self.n_states)), "sigma2": 0.0}  # shapes only: values change no release
        parts = []
        for step in self.steps():
            alg = self.algorithm(step, D=D, n_sites=len(lengths), groups=groups, previous=previous)
            parts.append(planned_ledgers(alg, NoisePlan.coerce(self.plan),
                                         [alg.public_state(s, ln, D) for s, ln in enumerate(lengths)]))
        return stage_ledgers(parts)

    def site_data(self, step: str, ws: WindowSet, site: int):
        """What ``step``'s site part reads from the site's windows."""
        if step in ("m2", "m3"):
            return prepare_site(ws.X, "mog", scale=self.scale(ws.D), site=site, warn_clipping=False)
        return ws

    def site_result(self, step: str, final: Payload | None) -> dict[str, Any]:
        """A site's public result of ``step`` from the step's last broadcast."""
        arrays = {} if final is None else final.arrays
        if step == "m2":
            s2 = arrays.get("sigma2")
            return {"W": np.asarray(arrays["W"]), "sigma2": None if s2 is None else float(np.ravel(s2)[0])}
        if step == "kmeans":
            return {"vectors": np.asarray(arrays["centroids"])}
        return {}

    def aggregator_result(self, step: str, state: dict, previous: dict | None = None) -> dict[str, Any]:
        """The public result of ``step`` from the aggregator's final state (post-processing only);
        after the last step it holds the states' ``vectors`` (D x K) and ``occupancy`` (K)."""
        if step == "m2":
            s2 = state.get("sigma2")
            return {"W": np.asarray(state["W"]), "sigma2": None if s2 is None else float(np.ravel(s2)[0])}
        if step == "m3":
            C, wts = finish_moments(state["m3w"], previous["W"], int(self.n_states), scale=self.scale(
                previous["W"].shape[0]), random_state=self.random_state, n_restarts=self.n_restarts,
                n_iter=self.n_iter)
            wts = np.clip(np.nan_to_num(wts, nan=0.0, posinf=0.0), 0.0, None)
            occ = wts / wts.sum() if wts.sum() > 0 else np.full(len(wts), 1.0 / len(wts))
            return {"vectors": np.asarray(C), "occupancy": occ, "agn_vectors": np.asarray(C)}
        cnt = np.clip(state["counts"], 0.0, None)
        occ = cnt / cnt.sum() if cnt.sum() > 0 else np.full(len(cnt), 1.0 / len(cnt))
        return {"vectors": np.asarray(state["centroids"]), "occupancy": occ, "history": state["history"]}


def dfnc_states(sites: Sequence, n_states: int, epsilon: float | None, delta: float = 1e-5, *,
                random_state=None, **settings) -> DFNCStates:
    """The consortium's K dFNC states from every site's :class:`WindowSet`, all parties in this process.

    ``settings``: the other fields of :class:`StateSettings` (method, plan, n_rounds, bound, metric, ...).
    ``random_state`` (None, an int or a Generator, which gives the seed by one draw) fixes the noise.
    """
    st = StateSettings(n_states, epsilon, delta, random_state=privacy.resolve_random_state(random_state), **settings)
    ws = _check_sites(sites)
    D = ws[0].D
    st.check_dim(D)
    nplan = NoisePlan.coerce(st.plan)
    groups = {s: max(w.lengths) for s, w in enumerate(ws)}
    result: dict[str, Any] = {}
    leds: list[list[PrivacyLedger | None]] = []
    previous = None
    for step in st.steps():
        alg = st.algorithm(step, D=D, n_sites=len(ws), groups=groups, previous=previous)
        r = run_cape(alg, [st.site_data(step, w, s) for s, w in enumerate(ws)], nplan)
        previous = st.aggregator_result(step, r.aggregator, previous)
        result.update(previous)
        leds.append(cape_ledgers(r))
    info = {"noise_multipliers": st.multipliers(len(ws)), "n_rounds": st.n_rounds,
            **{k: result[k] for k in ("history", "agn_vectors") if k in result}}
    return DFNCStates(result["vectors"], result["occupancy"], stage_ledgers(leds), st.method, st.metric,
                      st.scale(D), info)


def stage_ledgers(per_step: Sequence[Sequence[PrivacyLedger | None]]) -> list[PrivacyLedger]:
    """Each site's ledger of the whole stage from its ledgers of every step, with the privacy unit's note."""
    merged = []
    for parts in zip(*per_step):
        led = PrivacyLedger.merge_all([p for p in parts if p is not None])
        led.note(UNIT_NOTE)
        merged.append(led)
    return merged


def plan_ledgers(lengths: Sequence[Sequence[int]], n_components: int, n_states: int, epsilon: float | None,
                 delta: float = 1e-5, **settings) -> list[PrivacyLedger]:
    """The ledgers :func:`dfnc_states` will fill, from each site's window counts per subject alone."""
    return StateSettings(n_states, epsilon, delta, **settings).planned(lengths, n_components)
