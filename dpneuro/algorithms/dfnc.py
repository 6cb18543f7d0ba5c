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

Privacy unit and bounds (docs/privacy.md, "Brain states: dFNC states"): each
subject's windows are weighted 1/n_windows, and each release bounds the
subject's whole contribution (its mean window to B0 = 0.3 sqrt(D), its K x D
per-state sums to Frobenius norm B = 0.1 sqrt(D)), so however many windows
it has a subject moves a release by at most 2 B0 / M_s, 2B / M_s or
sqrt(2) / M_s (replacement). Bounding the subject rather than each window
lets B sit at the size of a subject's *mean* deviations, in which the
windows' own sampling noise has averaged out. capeAGN's moments clip each
window (scaled by B) as :mod:`dpneuro.algorithms.agn` does.

Consortium states (each a CAPE release per site, composed in the ledger;
:class:`StateSettings` is the sequence):

- ``"kmeans"``, the CAPE k-means: the mean window (:class:`CapeMean`), on
  which the windows are centred; Lloyd rounds (:class:`CapeKMeans`) with
  clipped per-state sums and counts, first over-clustered (2K states from
  public random starts, 3 rounds, merged to K at the aggregator by
  :func:`merge_centroids`), then one round at K and two final rounds with
  most of the budget, averaged; each final state denoised
  (:func:`lowrank_denoise`); then the occupancy of the final states
  (:class:`CapeOccupancy`). A window goes to the centroid nearest by the
  squared distance minus the centroid's public noise energy, which keeps the
  least noisy centroid from taking every window. The centroid is the mean
  (GIFT's city-block k-means uses the median, which has no bounded-sensitivity
  sum). ``benchmarks/dfnc_states.py`` measures it.
- ``"agn"``: capeAGN's one-shot moments of the window vectors ([CAPE-TF]
  Alg. 3, :mod:`dpneuro.algorithms.agn`, reused as is): M2 and M3 of the
  windows scaled by B, the tensor power method; the MOG means are the states
  and the weights their occupancies.

The budget (epsilon, delta) is the whole stage's per site, against the
headline adversary (the aggregator colluding with the assumed number of
sites): mu(epsilon, delta) is split over the releases by ``mu^2`` shares
(:data:`KMEANS_SHARES`, :func:`noise_multipliers`), and the ledger's composed
figure equals epsilon for equal sites (at most epsilon for unequal ones).

Per subject, from the public states at its own site (assigned by ``metric``:
correlation by default, GIFT's city-block, or Euclidean): fraction of windows
in each state, mean dwell time (windows and seconds) and number of
transitions (:func:`subject_dynamics`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpneuro import privacy
from dpneuro.algorithms import tensor as tz
from dpneuro.algorithms.agn import M3Stage, finish_moments, moment_stage, prepare_site, third_moment_whitened
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import NoisePlan, ReleaseSpec, noise_variance, planned_ledgers, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers
from dpneuro.protocol.cape.plans import symmetric_guarantee
from dpneuro.protocol.exchange import Payload

__all__ = [
    "DFNCStates",
    "METHODS",
    "METRICS",
    "StateSettings",
    "UNIT_NOTE",
    "CapeKMeans",
    "CapeMean",
    "CapeOccupancy",
    "KMEANS_SHARES",
    "MEAN_BOUND",
    "WindowSet",
    "assign",
    "dfnc_states",
    "lowrank_denoise",
    "matrix_to_vector",
    "merge_centroids",
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

METHODS = ("kmeans", "agn")
METRICS = ("cityblock", "euclidean", "correlation")
#: |r| is capped below 1 before Fisher z (a window of perfectly collinear courses)
_R_MAX = 1.0 - 1e-7
UNIT_NOTE = ("dFNC privacy unit: one subject (all its windows, each weighted 1 / n_windows); each release bounds "
             "the subject's whole contribution (docs/privacy.md, 'Brain states: dFNC states')")


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
    against it (m = :func:`dpneuro.protocol.cape.plans.symmetric_guarantee`), so
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


#: the CAPE k-means' fractions of the stage's mu^2 per release (all its rounds together) and the rounds each is
#: spread over: a small release of the mean, cheap over-clustered rounds that find the partition, one round at K,
#: two averaged final rounds with most of the budget, the occupancy of the final states
#: (benchmarks/README.md, "dFNC states", measures the split)
KMEANS_SHARES = {"mean": 0.05, "init_sums": 0.27, "init_counts": 0.03, "refine_sums": 0.09, "refine_counts": 0.01,
                 "final_sums": 0.5, "final_counts": 0.05}
KMEANS_OCCUPANCY_SHARE = 0.05
KMEANS_REPEATS = {"init_sums": 3, "init_counts": 3, "final_sums": 2, "final_counts": 2}


def _shares(method: str) -> tuple[dict[str, float], dict[str, int]]:
    """Fractions of the stage's mu^2 per named release (summing to 1) and each one's rounds."""
    if method == "agn":
        return {"m2": 0.5, "m3": 0.5}, {}
    raw = {**KMEANS_SHARES, "occupancy": KMEANS_OCCUPANCY_SHARE}
    tot = sum(raw.values())
    return {k: v / tot for k, v in raw.items()}, dict(KMEANS_REPEATS)


# -- CAPE k-means ----------------------------------------------------------------------------

def _clip_rows(G: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Each subject's block (first axis) scaled to Frobenius norm <= bound; the blocks and the factors a_i."""
    n = np.sqrt((G.reshape(G.shape[0], -1) ** 2).sum(axis=1))
    a = np.minimum(1.0, bound / np.maximum(n, 1e-300))
    return G * a.reshape((-1,) + (1,) * (G.ndim - 1)), a


class _WindowsRelease:
    """What every k-means release shares: the site's windows, subject weights 1 / n_windows, its count M."""

    name = "dfnc"
    max_rounds = 1
    #: distinguishes the releases' noise streams
    tag = 0

    def __init__(self, random_state=None):
        self.random_state = privacy.resolve_random_state(random_state)

    def site_init(self, site: int, data) -> dict:
        ws = data if isinstance(data, WindowSet) else WindowSet(*data)
        state: dict[str, Any] = {"_X": ws.X, "_w": ws.subject_weights(), "_subject": ws.subject_index(),
                                 "M": ws.n_subjects, "D": ws.D}
        if self.random_state is not None:
            state["rng"] = np.random.default_rng([self.random_state, 31, self.tag, site])
        return state

    def public_state(self, site: int, lengths, dim: int) -> dict:
        """What a site's releases depend on (the planner calls this without data)."""
        return {"M": len(lengths), "D": int(dim)}

    def site_weight(self, state) -> float:
        return float(state["M"])

    def aggregator_init(self) -> dict:
        return {}

    def aggregator_first(self, state) -> Payload:
        return Payload()


class CapeMean(_WindowsRelease):
    """The consortium's mean window (its static connectivity), which the k-means rounds centre on.

    Site s releases (1/M_s) sum_i clip(m_i, B0), m_i subject i's mean window: replacing a subject moves it by at
    most 2 B0 / M_s. Its noise cancels in the final states (they add back what they subtract); it only lets
    the rounds' bound cover the windows' deviations instead of the static connectivity.
    """

    name = "dfnc-mean"
    tag = 1

    def __init__(self, bound: float, z: float, random_state=None):
        super().__init__(random_state)
        self.B0, self.z = float(bound), float(z)

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        return {"mean": ReleaseSpec((state["D"],), 2.0 * self.B0 / state["M"], self.z, unit="subject",
                                    stage=self.name)}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        X, M = state["_X"], state["M"]
        m = np.zeros((M, X.shape[0]))
        _add_rows(m, state["_subject"], X.T * state["_w"][:, None])
        return {"mean": _clip_rows(m, self.B0)[0].sum(axis=0) / M}

    def aggregator_update(self, state, round, combined) -> Payload:
        state["mean"] = combined["mean"]
        return Payload({"mean": combined["mean"]}, {"stop": True}, carries={"mean": "public"})


class CapeKMeans(_WindowsRelease):
    """Lloyd's rounds on the centred windows y = x - mu as a CAPE algorithm: clipped per-state sums and counts.

    Each round the aggregator broadcasts the public centroids c_k (centred) and the public variance v_k of
    each one's noise per entry; a site assigns every window to argmin_k ||y - c_k||^2 - D v_k (the expected
    squared norm of c_k's noise removed: without it the noisiest centroid is the farthest from every window
    and the least noisy one takes them all). Subject i's contribution G_i (K x D: its windows weighted
    1 / n_i and summed per state) is scaled by a_i onto Frobenius norm B; the site releases the sums
    (1/M_s) sum_i a_i G_i (sensitivity 2B / M_s) and counts (1/M_s) sum_i a_i p_i, p_i the subject's
    occupancy (a_i p_i >= 0 of norm <= 1: sensitivity sqrt(2) / M_s). The aggregator's centroid is
    sums_k / max(counts_k, floor / K), the clip-weighted mean of the state's windows, and its noise
    variance the plan's variance of the averaged sums over that count squared. The last ``average_last``
    rounds are averaged (post-processing). ``init``: D x K public starts; ``init_var``: their variances.
    """

    name = "dfnc-kmeans"

    def __init__(self, n_states: int, n_rounds: int, bound: float, z_sums: float, z_counts: float, *,
                 init: np.ndarray, centre: np.ndarray, init_var=None, average_last: int = 1,
                 count_floor: float = 0.5, random_state=None, tag: int = 2):
        super().__init__(random_state)
        if isinstance(n_rounds, bool) or int(n_rounds) != n_rounds or n_rounds < 1:
            raise ValueError(f"n_rounds must be a positive integer, got {n_rounds!r}")
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"bound must be finite and > 0, got {bound}")
        if isinstance(average_last, bool) or int(average_last) != average_last or not 1 <= average_last <= n_rounds:
            raise ValueError(f"average_last must be an integer in [1, n_rounds = {n_rounds}], got {average_last!r}")
        self.K, self.max_rounds, self.B = int(n_states), int(n_rounds), float(bound)
        self.z_sums, self.z_counts, self.tag = float(z_sums), float(z_counts), int(tag)
        self.init = np.asarray(init, np.float64)
        self.centre = np.asarray(centre, np.float64)
        self.init_var = np.zeros(self.K) if init_var is None else np.asarray(init_var, np.float64)
        self.average_last, self.floor = int(average_last), float(count_floor) / self.K

    def site_init(self, site: int, data) -> dict:
        state = super().site_init(site, data)
        state["_Y"] = state["_X"] - self.centre[:, None]
        return state

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        M, D, K = state["M"], state["D"], self.K
        # replacing a subject: two contributions of norm <= B (sums) / two vectors a p of norm <= 1 (counts)
        return {"sums": ReleaseSpec((K, D), 2.0 * self.B / M, self.z_sums, unit="subject", stage=self.name),
                "counts": ReleaseSpec((K,), math.sqrt(2.0) / M, self.z_counts, unit="subject", stage=self.name)}

    @staticmethod
    def labels(Y: np.ndarray, C: np.ndarray, noise_var: np.ndarray) -> np.ndarray:
        """Nearest centroid of every column of Y by the debiased squared distance."""
        d = np.einsum("dk,dk->k", C, C)[None, :] - 2.0 * Y.T @ C - Y.shape[0] * np.asarray(noise_var)[None, :]
        return np.argmin(d, axis=1)

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        Y, w, M, K = state["_Y"], state["_w"], state["M"], self.K
        lab = self.labels(Y, broadcast.arrays["centroids"], broadcast.arrays["noise_var"])
        cell = state["_subject"] * K + lab
        G = np.zeros((M * K, Y.shape[0]))
        _add_rows(G, cell, Y.T * w[:, None])
        G, a = _clip_rows(G.reshape(M, K, -1), self.B)
        p = np.bincount(cell, weights=w, minlength=M * K).reshape(M, K) * a[:, None]
        return {"sums": G.sum(axis=0) / M, "counts": p.sum(axis=0) / M}

    def aggregator_init(self) -> dict:
        return {"releases": []}

    def aggregator_first(self, state) -> Payload:
        state["centroids"] = self.init
        return Payload({"centroids": self.init, "noise_var": self.init_var},
                       carries={"centroids": "public", "noise_var": "public"})

    def aggregator_update(self, state, round, combined) -> Payload:
        state["releases"] = (state["releases"] + [(combined["sums"], combined["counts"])])[-self.average_last:]
        stop = round == self.max_rounds - 1
        used = state["releases"] if stop else state["releases"][-1:]
        sums, counts = (np.mean([r[i] for r in used], axis=0) for i in (0, 1))
        n = np.maximum(counts, self.floor)  # a state (nearly) empty or swamped by noise: a floor, not a blow-up
        C = sums.T / n[None, :]
        v = noise_variance(state, "sums") / (len(used) * n**2)
        state.update(centroids=C, counts=counts, noise_var=v)
        return Payload({"centroids": C, "noise_var": v}, {"stop": stop},
                       carries={"centroids": "public (post-processing)", "noise_var": "public (the noise plan)"})


class CapeOccupancy(_WindowsRelease):
    """The consortium's fraction of windows in each final (public) state: (1/M_s) sum_i p_i, p_i subject i's
    occupancy by ``metric`` (as its own statistics); p_i >= 0 sums to 1, so sensitivity sqrt(2) / M_s.
    Unweighted: the k-means counts are clip-weighted, which weighs subjects unequally."""

    name = "dfnc-occupancy"
    tag = 5

    def __init__(self, vectors, z: float, metric: str = "correlation", random_state=None):
        super().__init__(random_state)
        _check_metric(metric)
        self.V, self.z, self.metric = np.asarray(vectors, np.float64), float(z), metric

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        return {"occupancy": ReleaseSpec((self.V.shape[1],), math.sqrt(2.0) / state["M"], self.z, unit="subject",
                                         stage=self.name)}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        lab = assign(state["_X"], self.V, self.metric)
        return {"occupancy": np.bincount(lab, weights=state["_w"], minlength=self.V.shape[1]) / state["M"]}

    def aggregator_update(self, state, round, combined) -> Payload:
        o = np.clip(combined["occupancy"], 0.0, None)
        state["occupancy"] = o / o.sum() if o.sum() > 0 else np.full(o.size, 1.0 / o.size)
        return Payload({"occupancy": state["occupancy"]}, {"stop": True}, carries={"occupancy": "public"})


# -- the aggregator's post-processing -------------------------------------------------------------

def merge_centroids(C, counts, n_states: int, noise_var, *, n_init: int = 50, n_iter: int = 50,
                    random_state=None) -> tuple[np.ndarray, np.ndarray]:
    """K groups of the K' released centroids (D x K'): count-weighted k-means (many seeded starts) of the
    centroids centred over their entries and scaled to unit norm (the correlation geometry). Returns each
    group's count-weighted mean centroid (D x K) and its noise variance."""
    C, nv = np.asarray(C, np.float64), np.asarray(noise_var, np.float64)
    n = np.clip(np.asarray(counts, np.float64), 1e-6, None)
    Z = C - C.mean(axis=0)
    Z = Z / np.maximum(np.linalg.norm(Z, axis=0), 1e-300)
    K, rng = int(n_states), np.random.default_rng([0 if random_state is None else random_state, 77])
    best, best_cost = None, np.inf
    for _ in range(n_init):
        cen = Z[:, rng.choice(Z.shape[1], K, replace=False, p=n / n.sum())]
        for _ in range(n_iter):
            lab = np.argmin(((Z[:, :, None] - cen[:, None, :]) ** 2).sum(axis=0), axis=1)
            new = np.stack([(Z[:, lab == k] * n[lab == k]).sum(axis=1) / n[lab == k].sum() if np.any(lab == k)
                            else cen[:, k] for k in range(K)], axis=1)
            if np.allclose(new, cen):
                break
            cen = new
        cost = float((n * ((Z - cen[:, lab]) ** 2).sum(axis=0)).sum())
        if cost < best_cost and len(np.unique(lab)) == K:
            best, best_cost = lab, cost
    lab = best if best is not None else np.arange(Z.shape[1]) % K
    out, v = np.empty((C.shape[0], K)), np.empty(K)
    for k in range(K):
        g = lab == k
        out[:, k] = (C[:, g] * n[g]).sum(axis=1) / n[g].sum()
        v[k] = (n[g] ** 2 * nv[g]).sum() / n[g].sum() ** 2
    return out, v


def lowrank_denoise(vectors, noise_var, *, n_iter: int = 30) -> np.ndarray:
    """Each state's R x R matrix (Fisher z pairs) with the eigenvalues below its noise edge set to 0.

    A symmetric noise matrix of per-entry variance v has its spectrum within 2 sqrt(R v) (the semicircle's
    edge); what lies below it cannot be told from noise. The unknown diagonal is imputed by iterating (each
    pass puts the low-rank fit's diagonal back). ``vectors`` D x K, ``noise_var`` K (public); returns D x K.
    """
    V = np.asarray(vectors, np.float64)
    R = n_components_of(V.shape[0])
    iu = np.triu_indices(R, 1)
    out = np.empty_like(V)
    for k in range(V.shape[1]):
        A = np.zeros((R, R))
        A[iu] = V[:, k]
        A = A + A.T
        edge = 2.0 * math.sqrt(R * max(float(noise_var[k]), 0.0))
        if edge == 0.0:
            out[:, k] = V[:, k]
            continue
        Z, F = A.copy(), A
        for _ in range(n_iter):
            ev, U = np.linalg.eigh(Z)
            keep = np.abs(ev) > edge
            F = (U[:, keep] * ev[keep]) @ U[:, keep].T
            Z = A.copy()
            np.fill_diagonal(Z, np.diag(F))
        out[:, k] = F[iu]
    return out


def _add_rows(out: np.ndarray, index: np.ndarray, rows: np.ndarray) -> None:
    """out[index[i]] += rows[i] for all i (sorted segments: far faster than np.add.at)."""
    order = np.argsort(index, kind="stable")
    idx, starts = np.unique(index[order], return_index=True)
    out[idx] += np.add.reduceat(rows[order], starts, axis=0)


# -- capeAGN on windows -----------------------------------------------------------------------

class _WindowM3(M3Stage):
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
        return tz.multilinear(noisy, self.W) + third_moment_whitened(state["_data"], self.W, self.sigma2)


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
    """The public bound B of a subject's k-means contribution: 0.1 sqrt(D), an RMS Fisher z of 0.1 per pair.

    Data-independent. Most subjects' contributions exceed it and are scaled
    onto it, which weights subjects equally and costs little: the states are
    read from directions (benchmarks/README.md measures 0.05 to 0.2 sqrt(D);
    0.1 is best or tied). capeAGN uses it as the windows' scale.
    """
    return 0.1 * math.sqrt(D)


#: the public bound of a subject's mean window, B0 = MEAN_BOUND sqrt(D): the static connectivity is larger than
#: the windows' deviations from it
MEAN_BOUND = 0.3


def _check_sites(sites) -> list[WindowSet]:
    if isinstance(sites, (np.ndarray, WindowSet)) or not isinstance(sites, Sequence) or not sites:
        raise ValueError("sites must be a non-empty list with one WindowSet per site")
    out = [s if isinstance(s, WindowSet) else WindowSet(*s) for s in sites]
    if len({s.D for s in out}) != 1:
        raise ValueError(f"sites disagree on the window dimension: {[s.D for s in out]}")
    return out


def _check_int(value, name: str, low: int) -> int:
    if isinstance(value, bool) or int(value) != value or value < low:
        raise ValueError(f"{name} must be an integer >= {low}, got {value!r}")
    return int(value)


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

    "kmeans" (the CAPE k-means): ``mean`` (:class:`CapeMean`), ``init``
    (:class:`CapeKMeans` with ``over`` x K states from public random starts,
    3 rounds, :data:`KMEANS_REPEATS`; the aggregator merges them to K by
    :func:`merge_centroids`), ``refine`` (one round at K), ``final`` (two
    rounds, averaged, then :func:`lowrank_denoise`), ``occupancy``
    (:class:`CapeOccupancy` of the final states). "agn": capeAGN's ``m2``, ``m3``.

    ``epsilon``/``delta``: the whole stage per site (None with plan "none").
    ``random_state`` (None or an int) fixes the noise and the public random starts: simulations and tests only.
    """

    n_states: int
    epsilon: float | None
    delta: float = 1e-5
    method: str = "kmeans"
    plan: Any = "cape"
    bound: float | None = None
    metric: str = "correlation"
    over: int = 2
    n_restarts: int = 30
    n_iter: int = 50
    random_state: int | None = None

    def __post_init__(self):
        _check_metric(self.metric)
        if self.method not in METHODS:
            raise ValueError(f"unknown method {self.method!r}; use one of {METHODS}")
        _check_int(self.n_states, "n_states", 2)
        _check_int(self.over, "over", 1)

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The (eps, delta) the whole stage is calibrated to (a planner scales the noise from it)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    @property
    def ledger_stages(self) -> tuple[str, ...]:
        """The ledger's names of the stage's releases."""
        if self.method == "agn":
            return ("agn-m2", "agn-m3")
        return (CapeMean.name, CapeKMeans.name, CapeOccupancy.name)

    def steps(self) -> tuple[str, ...]:
        """The stage's releases in order (one exchange topic each)."""
        return ("m2", "m3") if self.method == "agn" else ("mean", "init", "refine", "final", "occupancy")

    def check_dim(self, D: int) -> None:
        if not 2 <= self.n_states <= D:
            raise ValueError(f"n_states must be in [2, D = {D}], got {self.n_states}")

    def scale(self, D: int) -> float:
        """The public bound B (:func:`default_bound` unless given)."""
        return default_bound(D) if self.bound is None else float(self.bound)

    def multipliers(self, n_sites: int) -> dict[str, float]:
        shares, repeats = _shares(self.method)
        return noise_multipliers(self.epsilon, self.delta, shares, n_sites=n_sites, plan=self.plan, repeats=repeats)

    def _starts(self, mean: np.ndarray, D: int) -> np.ndarray:
        """The public random starts of the over-clustered rounds, of the released mean's norm."""
        rng = np.random.default_rng(None if self.random_state is None else [self.random_state, 78])
        init = rng.standard_normal((D, self.over * self.n_states))
        return init * (np.linalg.norm(mean) / np.linalg.norm(init, axis=0))

    def algorithm(self, step: str, *, D: int, n_sites: int, groups: dict | None = None,
                  previous: dict | None = None):
        """The CAPE algorithm of ``step``; ``previous`` is the public result of the stage's previous step
        (:meth:`aggregator_result` at the aggregator, :meth:`site_result` at a site); ``groups`` maps a site
        to its longest subject's window count (capeAGN's subject-level bound; a site needs only its own)."""
        self.check_dim(D)
        z, B, K, seed = self.multipliers(n_sites), self.scale(D), int(self.n_states), self.random_state
        prev = previous or {}
        if step == "m2":
            return _agn_stages(K, z["m2"], z["m3"], groups or {}, B, seed)
        if step == "m3":
            return _agn_stages(K, z["m2"], z["m3"], groups or {}, B, seed, W=prev["W"],
                               sigma2=prev.get("sigma2") or 0.0)
        if step == "mean":
            return CapeMean(MEAN_BOUND * math.sqrt(D), z["mean"], random_state=seed)
        if step == "init":
            return CapeKMeans(self.over * K, KMEANS_REPEATS["init_sums"], B, z["init_sums"], z["init_counts"],
                              init=self._starts(prev["mean"], D), centre=prev["mean"], random_state=seed, tag=2)
        if step in ("refine", "final"):
            final, rounds = step == "final", KMEANS_REPEATS.get(f"{step}_sums", 1)  # the budget's rounds
            return CapeKMeans(K, rounds, B, z[f"{step}_sums"], z[f"{step}_counts"],
                              init=prev.get("centroids", np.zeros((D, K))), init_var=prev.get("noise_var"),
                              centre=prev["mean"], average_last=rounds if final else 1, random_state=seed,
                              tag=4 if final else 3)
        if step == "occupancy":
            return CapeOccupancy(prev["vectors"], z["occupancy"], self.metric, random_state=seed)
        raise KeyError(f"no dFNC step {step!r}; steps: {self.steps()}")

    def planned(self, lengths: Sequence[Sequence[int]], n_components: int) -> list[PrivacyLedger]:
        """The ledgers the stage fills, from each site's window counts per subject alone."""
        D, K = n_components * (n_components - 1) // 2, int(self.n_states)
        groups = {s: max(ln) for s, ln in enumerate(lengths)}
        # shapes only: the values change no release
        previous = {"W": np.zeros((D, K)), "sigma2": 0.0, "mean": np.zeros(D), "vectors": np.zeros((D, K))}
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

    def site_result(self, step: str, final: Payload | None, previous: dict | None = None) -> dict[str, Any]:
        """A site's public result of ``step`` from the step's last broadcast: what its next steps read."""
        arrays, prev = ({} if final is None else final.arrays), previous or {}
        if step == "m2":
            s2 = arrays.get("sigma2")
            return {"W": np.asarray(arrays["W"]), "sigma2": None if s2 is None else float(np.ravel(s2)[0])}
        if step == "mean":
            return {"mean": np.asarray(arrays["mean"])}
        if step in ("init", "refine"):
            return {"mean": prev["mean"]}
        if step == "final":
            return {"mean": prev["mean"], "vectors": self._vectors(prev["mean"], arrays)}
        return {}

    @staticmethod
    def _vectors(mean: np.ndarray, final: dict) -> np.ndarray:
        return lowrank_denoise(np.asarray(mean)[:, None] + np.asarray(final["centroids"]), final["noise_var"])

    def aggregator_result(self, step: str, state: dict, previous: dict | None = None) -> dict[str, Any]:
        """The public result of ``step`` from the aggregator's final state (post-processing only); after the
        last step it holds the states' ``vectors`` (D x K) and ``occupancy`` (K)."""
        prev = previous or {}
        if step == "m2":
            s2 = state.get("sigma2")
            return {"W": np.asarray(state["W"]), "sigma2": None if s2 is None else float(np.ravel(s2)[0])}
        if step == "m3":
            C, wts = finish_moments(state["m3w"], prev["W"], int(self.n_states), scale=self.scale(
                prev["W"].shape[0]), random_state=self.random_state, n_restarts=self.n_restarts,
                n_iter=self.n_iter)
            wts = np.clip(np.nan_to_num(wts, nan=0.0, posinf=0.0), 0.0, None)
            occ = wts / wts.sum() if wts.sum() > 0 else np.full(len(wts), 1.0 / len(wts))
            return {"vectors": np.asarray(C), "occupancy": occ}
        if step == "mean":
            return {"mean": np.asarray(state["mean"])}
        if step == "init":
            C, v = merge_centroids(state["centroids"], state["counts"], self.n_states, state["noise_var"],
                                   random_state=self.random_state)
            return {"mean": prev["mean"], "centroids": C, "noise_var": v}
        if step == "refine":
            return {"mean": prev["mean"], "centroids": state["centroids"], "noise_var": state["noise_var"]}
        if step == "final":
            return {"mean": prev["mean"], "vectors": self._vectors(prev["mean"], state)}
        return {"vectors": prev["vectors"], "occupancy": np.asarray(state["occupancy"])}


def dfnc_states(sites: Sequence, n_states: int, epsilon: float | None, delta: float = 1e-5, *,
                random_state=None, **settings) -> DFNCStates:
    """The consortium's K dFNC states from every site's :class:`WindowSet`, all parties in this process.

    ``settings``: the other fields of :class:`StateSettings` (method, plan, bound, metric, over, ...).
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
    info = {"noise_multipliers": st.multipliers(len(ws))}
    if "mean" in result:
        info["mean"] = result["mean"]
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
