"""capeDJICA: differentially private decentralized joint ICA ([capeDJICA] Sec. IV, Alg. 4).

Temporal joint ICA of decentralized fMRI, solved by natural-gradient infomax
on the R-dimensional whitened data Z_s = Lambda^{-1/2} V_R^T X_s of every site.
Round j (one round = one release per site):

site s       U = W Z_s + b 1^T,  Y = 1 - 2 sigmoid(U)  (= -tanh(U / 2))
             G_n = (I + y_n u_n^T) W clipped to ||G_n||_F <= B_G,
             h_n = y_n clipped to ||h_n||_2 <= B_h,
             releases G_s = mean_n G_n (R x R) and h_s = mean_n h_n (R) with
             CAPE noise; subject-level L2 sensitivities 2 B_G T_max / N_s and
             2 B_h T_max / N_s (= 2 B / M_s for M_s subjects of equal length)
aggregator   G, h = weighted average of the noisy releases (weights N_s),
             W += rho G, b += rho h, learning-rate rules, broadcast W, b

Note on u_n: the per-sample gradient multiplies y_n by the *source estimate*
u_n = W x_n + b (a column of U; [capeDJICA] Sec. IV writes it z_{s,n}, the djICA
reference code ``u``), not by the data sample x_n: (I + y u^T) W is Amari's
natural gradient of the infomax likelihood, whose fixed points are the
unmixing matrices. With x_n instead the rule has the wrong fixed points.
Its per-sample Frobenius norm needs no R x R matrix per sample:

    ||(I + y u^T) W||_F^2 = ||W||_F^2 + 2 y^T W W^T u + ||y||^2 ||W^T u||^2

and the clipped sum is sum_n c_n (I + y_n u_n^T) W = (sum_n c_n) W + (Y diag(c) U^T) W.

Everything the aggregator does (learning-rate rules, stopping, restarts,
averaging) works on the noisy averages only, so it is post-processing.

Noise calibration ([capeDJICA] Sec. V, "Performance Index"): every round each of the
two releases gets the classic Gaussian mechanism for (epsilon_i, delta_i),
tau_s = Delta_s sqrt(2 ln(1.25 / delta_i)) / epsilon_i, with delta_i = 1e-2 in
their experiments; a round is thus (2 eps_i, 2 delta_i)-DP by basic
composition ([capeDJICA] Thm. 2), and the ledger composes the J rounds exactly
(mu-GDP, mu^2 = 2 J / z^2 with z = sqrt(2 ln(1.25/delta_i)) / eps_i), or by
RDP/PLD. ``calibration="analytic"`` uses Balle & Wang's calibration instead
(less noise for the same (eps_i, delta_i), and valid for eps_i >= 1).

The learning-rate rules follow the djICA reference code (Baker et al. 2019,
``djica.m``, built on EEGLAB's runica), applied once per round:

- initial rho = 0.015 / ln(R);
- blow-up (any |W_ij| > 1e8 or a non-finite update): restart from the start
  W (= I), b = 0 with rho *= 0.9 (the releases already made stay in the ledgers and
  the round limit counts every round, restarted or not);
- annealing: rho *= 0.9 when the update turns by more than 60 degrees from
  the reference update; as in the reference code, the reference is the
  update of step 1 or of the last annealing step ("accumulate angledelta
  until annealdeg is reached"), and the angle is checked from step 3 on;
- ||delta W||_F^2 > 1e9: rho *= 0.8; rho < 1e-6 after a restart: give up;
- stop when ||delta W||_F^2 < 1e-6 (from step 3 on) or at the round limit.

With DP noise the reference rules fail in a way worth knowing: a noisy update
is nearly orthogonal to the reference one, so rho is annealed almost every
round, collapses geometrically and the ||delta W||^2 < 1e-6 rule then stops
the run after some 50-100 rounds, close to where it started. Even without
noise, rho = 0.015 / ln R with *mean* gradients (Alg. 4) moves W so little
that the stopping rule fires long before convergence on weakly non-Gaussian
sources. ``optimizer="fast"`` (:data:`OPTIMIZERS`) keeps the blow-up and
annealing safety but fixes both; see ``benchmarks/djica_utility.py``.

Two mechanism options cut the noise at the same privacy (both off by default,
i.e. as published in [capeDJICA]): ``clip_unit="subject"`` clips each subject's mean
gradient instead of every sample's (same sensitivity formula, a bound an
order of magnitude smaller), and ``bias=False`` releases G only (one release
per round instead of two; whitened data are centred).

Entry points: :func:`cape_djica` (simulation, any plan), :func:`local_dp_ica`
(one site), :class:`CapeDJICA` (the protocol object for
:func:`dpneuro.protocol.cape.cape_protocol` in deployments), :func:`whiten`,
:func:`spatial_maps` and :func:`time_courses` (stages around it).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from dpneuro import privacy
from dpneuro.algorithms.metrics import qngi
from dpneuro.data.matrix import SiteData, subject_ranges
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import ReleaseSpec, cape_protocol, ledgers
from dpneuro.protocol.cape.plans import PLAN_KINDS, NoisePlan
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange import Payload
from dpneuro.protocol.simulation import SimulationResult, simulate

__all__ = [
    "DJICAResult",
    "CapeDJICA",
    "INFOMAX_SCALE",
    "LearningRate",
    "OPTIMIZERS",
    "PRESETS",
    "cape_djica",
    "local_dp_ica",
    "infomax_gradients",
    "subject_clipped_gradients",
    "whiten",
    "spatial_maps",
    "time_courses",
]

#: columns per chunk in :func:`infomax_gradients`: R x 2048 working arrays stay in L2 cache
DEFAULT_CHUNK = 2048


# ---------------------------------------------------------------------------------------
# learning-rate rules
# ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class LearningRate:
    """Learning-rate rules applied by the aggregator after every round.

    Parameters
    ----------
    rho0 : float or None
        Initial learning rate; None means the reference heuristic 0.015 / ln(R).
    anneal_deg, anneal_factor : float
        rho *= anneal_factor when the update turns by more than anneal_deg
        degrees from the reference update (see the module docstring).
    restart_factor : float
        On a blow-up, restart from W = I, b = 0 with rho *= restart_factor.
    max_weight : float
        A blow-up is any |W_ij| above this (or a non-finite W).
    tol : float
        Stop when ||delta W||_F^2 < tol (checked from the third step on).
    blowup_change, blowup_factor : float
        rho *= blowup_factor when ||delta W||_F^2 > blowup_change.
    min_rho : float
        Give up (status ``"lr_underflow"``) if a restart takes rho below this.
    momentum : float
        Heavy-ball momentum beta: the update is rho v with v <- beta v + G
        (and likewise for b); 0 is the reference rule. Speeds up the slow
        modes of infomax (pairs of nearly Gaussian sources) that plain steps
        take hundreds of rounds to resolve.
    smoothing : float
        0 (the reference rule) tests the angle of the raw updates. ``beta`` in
        (0, 1) tests it on the exponential moving average
        m <- beta m + (1 - beta) delta W instead: privacy noise makes raw
        updates nearly orthogonal (about 90 degrees apart in R^2 dimensions),
        so the raw rule anneals every round and rho collapses geometrically.
    anneal_reference : {"accumulated", "previous"}
        What the update's angle is measured against: ``"accumulated"`` (the
        reference code) keeps the update of step 1 or of the last annealing
        step; ``"previous"`` uses the previous (smoothed) update, so annealing
        reacts to oscillation (successive updates pointing back) and not to
        slow drift.
    init_scale : float
        Start (and restart) from W = init_scale * I. 1 is the reference; the
        logistic infomax fixed point of a unit-variance Gaussian source is
        1.749 (:data:`INFOMAX_SCALE`), close to where whitened super-Gaussian
        sources end up, so starting there skips the scale adaptation that
        otherwise dominates the first gradients (and their clipping budget).
    average_from : float or None
        None reports the last iterate. ``f`` in [0, 1) reports the mean of the
        iterates from round ``f * rounds`` on (Polyak-Ruppert averaging, reset
        by a restart; the last iterate if the run converged): post-processing
        that averages the privacy noise out of the reported W and b.
    """

    rho0: float | None = None
    anneal_deg: float = 60.0
    anneal_factor: float = 0.9
    restart_factor: float = 0.9
    max_weight: float = 1e8
    tol: float = 1e-6
    blowup_change: float = 1e9
    blowup_factor: float = 0.8
    min_rho: float = 1e-6
    momentum: float = 0.0
    smoothing: float = 0.0
    anneal_reference: str = "accumulated"
    init_scale: float = 1.0
    average_from: float | None = None

    def __post_init__(self):
        if self.rho0 is not None and not (self.rho0 > 0 and math.isfinite(self.rho0)):
            raise ValueError(f"the learning rate must be a positive number, got {self.rho0}")
        for name in ("anneal_factor", "restart_factor", "blowup_factor"):
            v = getattr(self, name)
            if not 0 < v <= 1:
                raise ValueError(f"{name} must be in (0, 1], got {v}")
        if not 0 <= self.anneal_deg <= 180:
            raise ValueError(f"anneal_deg must be in [0, 180], got {self.anneal_deg}")
        if not 0 <= self.momentum < 1:
            raise ValueError(f"momentum must be in [0, 1), got {self.momentum}")
        if not 0 <= self.smoothing < 1:
            raise ValueError(f"smoothing must be in [0, 1), got {self.smoothing}")
        if self.anneal_reference not in ("accumulated", "previous"):
            raise ValueError(f"anneal_reference must be 'accumulated' or 'previous', got {self.anneal_reference!r}")
        if not (self.init_scale > 0 and math.isfinite(self.init_scale)):
            raise ValueError(f"init_scale must be a positive number, got {self.init_scale}")
        if self.average_from is not None and not 0 <= self.average_from < 1:
            raise ValueError(f"average_from must be None or in [0, 1), got {self.average_from}")
        if not (self.tol >= 0 and self.min_rho >= 0 and self.max_weight > 0 and self.blowup_change > 0):
            raise ValueError("tol, min_rho, max_weight and blowup_change must be positive")

    def initial_rho(self, R: int) -> float:
        return float(self.rho0) if self.rho0 is not None else 0.015 / math.log(R)


#: E[u tanh(u/2)] = 1 for u ~ N(0, s^2): the scale at which logistic infomax is stationary
#: on a Gaussian direction of whitened data (data-independent, so free to use)
INFOMAX_SCALE = 1.7488007394419698

#: ``"paper"``: the reference rules exactly ([capeDJICA] Sec. V, djica.m). ``"fast"``: the same
#: blow-up/annealing safety from a 100x larger step with heavy-ball momentum, the angle
#: test on smoothed successive updates (noise-proof), a start at the infomax scale and
#: Polyak averaging over the second half of the rounds (benchmarks/djica_utility.py).
OPTIMIZERS: dict[str, LearningRate] = {
    "paper": LearningRate(),
    "fast": LearningRate(rho0=0.5, momentum=0.8, smoothing=0.9, anneal_reference="previous",
                         init_scale=INFOMAX_SCALE, average_from=0.5),
}


#: Complete settings of the unmixing. ``"recommended"`` (the defaults everywhere) is measured by
#: ``benchmarks/djica_utility.py`` and ``benchmarks/demo_speed.py``; ``"paper"`` is [capeDJICA]
#: as published (per-sample clipping at 30, bias released, classic calibration, its learning-rate rules).
PRESETS: dict[str, dict[str, Any]] = {
    "recommended": dict(clip_G=0.7, clip_h=0.7, rounds=40, optimizer="fast", calibration="analytic",
                        clip_unit="subject", bias=False),
    "paper": dict(clip_G=30.0, clip_h=30.0, rounds=1000, optimizer="paper", calibration="classic",
                  clip_unit="sample", bias=True),
}


class _FromPreset:
    """Default of a setting that the preset fills in."""

    def __repr__(self) -> str:
        return "<from preset>"


FROM_PRESET: Any = _FromPreset()


def preset_settings(preset: str, **given) -> dict[str, Any]:
    """The preset's settings, overridden by every ``given`` one that is not :data:`FROM_PRESET`."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; use one of {sorted(PRESETS)}")
    return {**PRESETS[preset], **{k: v for k, v in given.items() if v is not FROM_PRESET}}


def _coerce_optimizer(optimizer: str | LearningRate, lr: float | None) -> LearningRate:
    if isinstance(optimizer, LearningRate):
        opt = optimizer
    elif optimizer in OPTIMIZERS:
        opt = OPTIMIZERS[optimizer]
    else:
        raise ValueError(f"unknown optimizer {optimizer!r}; use one of {sorted(OPTIMIZERS)} or a LearningRate")
    return replace(opt, rho0=lr) if lr is not None else opt


# ---------------------------------------------------------------------------------------
# the site computation
# ---------------------------------------------------------------------------------------

def _as_bound(clip: float | None) -> float:
    """A clipping bound as a float; None means no clipping (inf)."""
    if clip is None:
        return math.inf
    clip = float(clip)
    if not clip > 0:
        raise ValueError(f"a clipping bound must be > 0 (or None for no clipping), got {clip}")
    return clip


def infomax_gradients(X: np.ndarray, W: np.ndarray, b: np.ndarray, clip_G: float | None = 30.0,
                      clip_h: float | None = 30.0, *, chunk: int = DEFAULT_CHUNK,
                      return_scales: bool = False):
    """Means of the per-sample clipped infomax gradients of one site.

    Parameters
    ----------
    X : ndarray, shape (R, N)
        Whitened data, one sample per column. The computation runs in X's
        dtype (float32 is about twice as fast); sums across chunks in float64.
    W : ndarray, shape (R, R)
        Current unmixing matrix.
    b : ndarray, shape (R,)
        Current bias.
    clip_G, clip_h : float or None
        Per-sample bounds B_G (Frobenius norm of G_n) and B_h (L2 norm of
        h_n = y_n); None disables clipping.
    chunk : int
        Columns per chunk (cache blocking; does not change the result beyond
        rounding).
    return_scales : bool
        Also return the per-sample clipping factors c_n and c^h_n (for tests).

    Returns
    -------
    G : ndarray, shape (R, R), float64
        (1/N) sum_n min(1, B_G / ||G_n||_F) G_n with G_n = (I + y_n u_n^T) W.
    h : ndarray, shape (R,), float64
        (1/N) sum_n min(1, B_h / ||y_n||) y_n.
    c, ch : ndarray, shape (N,)
        Only with ``return_scales``.

    Notes
    -----
    u_n = W x_n + b and y_n = 1 - 2 sigmoid(u_n). Per-sample norms come from
    ||G_n||_F^2 = ||W||_F^2 + 2 y_n^T P u_n + ||y_n||^2 u_n^T P u_n with
    P = W W^T (P u_n = W (W^T u_n)), so one R x R x N product gives both
    quadratic forms; the clipped sum is (sum c_n) W + (Y diag(c) U^T) W.
    Three R x R x N products per call in all; no per-sample matrices.
    """
    X = _float_data(X)
    R, N = X.shape
    dt = X.dtype
    W64 = np.asarray(W, np.float64)
    Wc = W64.astype(dt)
    b64 = np.asarray(b, np.float64)
    bc = b64.astype(dt)[:, None] if np.any(b64) else None
    P = (W64 @ W64.T).astype(dt)
    w2 = float(np.sum(W64 * W64))
    BG, Bh = _as_bound(clip_G), _as_bound(clip_h)
    # rounding in the implicit norms is ~R eps relative: inflate them a little so that the
    # clipped gradient never exceeds the bound the sensitivity is computed from
    safety = 1.0 + 64 * R * float(np.finfo(dt).eps)
    C = max(1, min(int(chunk), N))
    U_buf, Y_buf, PU_buf, T_buf = (np.empty((R, C), dt) for _ in range(4))
    csum = 0.0
    M = np.zeros((R, R))
    h = np.zeros(R)
    if return_scales:
        c_all, ch_all = np.empty(N), np.empty(N)
    for lo in range(0, N, C):
        hi = min(lo + C, N)
        n = hi - lo
        U, Y, PU, T = U_buf[:, :n], Y_buf[:, :n], PU_buf[:, :n], T_buf[:, :n]
        np.matmul(Wc, X[:, lo:hi], out=U)
        if bc is not None:
            U += bc
        np.multiply(U, -0.5, out=Y)
        np.tanh(Y, out=Y)  # 1 - 2 sigmoid(u) = -tanh(u / 2)
        y2 = np.einsum("ij,ij->j", Y, Y).astype(np.float64)
        if math.isinf(BG):
            c = np.ones(n)
        else:
            np.matmul(P, U, out=PU)
            cross = np.einsum("ij,ij->j", Y, PU).astype(np.float64)
            norm2 = np.einsum("ij,ij->j", U, PU).astype(np.float64)  # ||W^T u||^2
            norm2 *= y2
            norm2 += 2.0 * cross
            norm2 += w2
            np.maximum(norm2, 0.0, out=norm2)  # rounding can dip below 0 only when the norm is ~0
            np.sqrt(norm2, out=norm2)
            norm2 *= safety
            np.maximum(norm2, BG, out=norm2)
            c = np.divide(BG, norm2, out=norm2)  # min(1, B_G / ||G_n||)
        if math.isinf(Bh):
            ch = np.ones(n)
        else:
            ch = np.sqrt(y2)
            ch *= safety
            np.maximum(ch, Bh, out=ch)
            np.divide(Bh, ch, out=ch)
        csum += float(c.sum())
        np.multiply(Y, c.astype(dt, copy=False), out=T)
        M += T @ U.T
        h += Y @ ch.astype(dt, copy=False)
        if return_scales:
            c_all[lo:hi], ch_all[lo:hi] = c, ch
    G = (csum * W64 + M @ W64) / N
    h /= N
    if return_scales:
        return G, h, c_all, ch_all
    return G, h


def subject_clipped_gradients(X: np.ndarray, W: np.ndarray, b: np.ndarray, subject_lengths: Sequence[int],
                              clip_G: float | None, clip_h: float | None, *, chunk: int = DEFAULT_CHUNK,
                              return_scales: bool = False):
    """Site means of the infomax gradients with each *subject's* mean gradient clipped.

    The subject-level alternative to :func:`infomax_gradients` ([capeDJICA] Sec. IV:
    "the gradients due to each subject can be clipped"): subject m with T_m
    samples contributes T_m min(1, B_G / ||g_m||_F) g_m with
    g_m = (1/T_m) sum_{n in m} (I + y_n u_n^T) W, and likewise h_m clipped to
    B_h; the release is the sum over subjects divided by N_s. A subject's
    term has norm <= T_m B / N_s, so the sensitivity is 2 B T_max / N_s as
    for per-sample clipping, but B can be an order of magnitude smaller:
    within-subject averaging shrinks the gradient norm (about 2.5 on the
    paper-style data against per-sample norms of 10-60).

    Parameters
    ----------
    X, W, b, clip_G, clip_h, chunk
        As in :func:`infomax_gradients`.
    subject_lengths : sequence of int
        Samples per subject, in column order; they add up to N.
    return_scales : bool
        Also return the per-subject factors c_m, c^h_m.

    Returns
    -------
    G : ndarray (R, R), h : ndarray (R,) [, c, ch : ndarray (M,)]
    """
    X = _float_data(X)
    R, N = X.shape
    lengths = np.asarray(subject_lengths, dtype=np.int64)
    if lengths.sum() != N or np.any(lengths < 1):
        raise ValueError(f"subject lengths must be positive and add up to {N}")
    dt = X.dtype
    W64 = np.asarray(W, np.float64)
    Wc = W64.astype(dt)
    bc = np.asarray(b, np.float64).astype(dt)[:, None]
    BG, Bh = _as_bound(clip_G), _as_bound(clip_h)
    safety = 1.0 + 64 * R * float(np.finfo(np.float64).eps)  # norms below are computed in float64
    I = np.eye(R)
    G = np.zeros((R, R))
    h = np.zeros(R)
    cs, chs = [], []
    # runs of consecutive subjects of equal length are processed k at a time as a batch
    starts = np.concatenate([[0], np.cumsum(lengths)])
    m = 0
    while m < len(lengths):
        T = int(lengths[m])
        run_end = m
        while run_end < len(lengths) and lengths[run_end] == T:
            run_end += 1
        k_max = max(1, int(chunk) // T)
        for m0 in range(m, run_end, k_max):
            k = min(k_max, run_end - m0)
            lo, hi = int(starts[m0]), int(starts[m0 + k])
            U = Wc @ X[:, lo:hi]
            U += bc
            Y = np.multiply(U, -0.5)
            np.tanh(Y, out=Y)
            Ub = U.reshape(R, k, T).transpose(1, 2, 0)  # k x T x R
            Yb = Y.reshape(R, k, T).transpose(1, 0, 2)  # k x R x T
            rel = I + np.matmul(Yb, Ub).astype(np.float64) / T  # k x R x R: mean of I + y u^T per subject
            g = rel @ W64
            hm = Yb.sum(axis=2).astype(np.float64) / T  # k x R
            c = np.ones(k) if math.isinf(BG) else BG / np.maximum(safety * np.linalg.norm(g, axis=(1, 2)), BG)
            ch = np.ones(k) if math.isinf(Bh) else Bh / np.maximum(safety * np.linalg.norm(hm, axis=1), Bh)
            # subject m carries weight T_m: the release is (1/N) sum_m T_m clip(g_m)
            G += np.tensordot(c * T, g, axes=1)
            h += (ch * T) @ hm
            if return_scales:
                cs.append(c)
                chs.append(ch)
        m = run_end
    G /= N
    h /= N
    if return_scales:
        return G, h, np.concatenate(cs), np.concatenate(chs)
    return G, h


def _float_data(X) -> np.ndarray:
    X = np.asarray(X)
    if X.dtype not in (np.float32, np.float64):
        X = X.astype(np.float64)
    if X.ndim != 2:
        raise ValueError(f"data must be an R x N matrix, got shape {X.shape}")
    return X


# ---------------------------------------------------------------------------------------
# whitening and back-projection
# ---------------------------------------------------------------------------------------

#: a released eigenvalue <= 0 (noise above the signal) is raised to this fraction of the largest for whitening
EIGENVALUE_FLOOR = 1e-3


def usable_eigenvalues(eigenvalues) -> np.ndarray:
    """Released eigenvalues made positive for whitening, by post-processing.

    The top-k eigenvalues of a noisy second moment can be <= 0 when the noise
    exceeds the signal; whitening needs them positive, and failing after the
    release would waste the privacy it spent. Each one <= 0 becomes
    :data:`EIGENVALUE_FLOOR` times the largest (1 when none is positive): its
    component is noise, and the run warns about it.
    """
    lam = np.asarray(eigenvalues, np.float64)
    if np.all(lam > 0):
        return lam
    top = float(lam.max()) if lam.size and lam.max() > 0 else 1.0 / EIGENVALUE_FLOOR
    return np.where(lam > 0, lam, EIGENVALUE_FLOOR * top)


def check_basis(basis, eigenvalues) -> tuple[np.ndarray, np.ndarray]:
    V = np.asarray(basis, np.float64)
    lam = np.asarray(eigenvalues, np.float64).reshape(-1)
    if V.ndim != 2:
        raise ValueError(f"basis must be a D x k matrix, got shape {V.shape}")
    if lam.size < V.shape[1] and lam.size > 0:
        V = V[:, : lam.size]
    lam = lam[: V.shape[1]]
    if lam.size != V.shape[1]:
        raise ValueError(f"{V.shape[1]} basis vectors but {lam.size} eigenvalues")
    if not np.all(np.isfinite(lam)):
        raise ValueError("eigenvalues contain NaN or infinite values")
    lam = usable_eigenvalues(lam)
    if not np.all(np.isfinite(V)):
        raise ValueError("basis contains NaN or infinite values")
    return V, lam


def whiten(X, basis, eigenvalues) -> np.ndarray:
    """Whitened data Z = Lambda^{-1/2} V^T X.

    Parameters
    ----------
    X : ndarray, shape (D, N)
        A site's data (features x samples).
    basis : ndarray, shape (D, R)
        Orthonormal columns V (capePCA's ``.basis``).
    eigenvalues : ndarray, shape (R,)
        The matching eigenvalues of the (consortium) second-moment matrix.

    Returns
    -------
    ndarray, shape (R, N)
        In X's floating dtype (float64 for integer input).
    """
    X = np.asarray(X)
    dt = X.dtype if X.dtype in (np.float32, np.float64) else np.float64
    T = whitening_matrix(basis, eigenvalues, dt)
    if X.ndim != 2 or X.shape[0] != T.shape[1]:
        raise ValueError(f"X must be D x N with D = {T.shape[1]}, got shape {X.shape}")
    return T @ X.astype(dt, copy=False)


def whitening_matrix(basis, eigenvalues, dtype=np.float64) -> np.ndarray:
    """T = Lambda^{-1/2} V^T (R x D) in ``dtype``, checked once: ``whiten(X) == T @ X``."""
    V, lam = check_basis(basis, eigenvalues)
    return (V / np.sqrt(lam)).T.astype(dtype)


def spatial_maps(basis, eigenvalues, W) -> np.ndarray:
    """Spatial maps A = V_R Lambda^{1/2} W^{-1} (D x R, one map per column)."""
    V, lam = check_basis(basis, eigenvalues)
    W = np.asarray(W, np.float64)
    if W.shape != (V.shape[1], V.shape[1]):
        raise ValueError(f"W must be {V.shape[1]} x {V.shape[1]}, got shape {W.shape}")
    return (V * np.sqrt(lam)) @ np.linalg.inv(W)


def time_courses(W, Z, b=None) -> np.ndarray:
    """Component time courses S = W Z + b 1^T (R x N) of whitened data Z."""
    W = np.asarray(W, np.float64)
    S = W @ np.asarray(Z, np.float64)
    if b is not None:
        S += np.asarray(b, np.float64).reshape(-1, 1)
    return S


# ---------------------------------------------------------------------------------------
# the CAPE algorithm
# ---------------------------------------------------------------------------------------

def _subject_lengths(subjects, n_samples: int, site: int) -> tuple[int, ...]:
    """Per-subject sample counts from an int (equal lengths), a list of lengths or of column ranges."""
    if isinstance(subjects, (bool, np.bool_)):
        raise ValueError(f"site {site}: subjects must be a count or a list of lengths, got {subjects!r}")
    try:
        ranges = subject_ranges(subjects, n_samples)
    except ValueError as exc:
        raise ValueError(f"site {site}: {exc}") from None
    return tuple(b - a for a, b in ranges)


def _check_privacy(plan: str, epsilon_i, delta_i, calibration: str) -> float:
    """Noise multiplier z per release (0 for plan 'none')."""
    if plan == "none":
        return 0.0
    if epsilon_i is None or delta_i is None:
        raise ValueError(f"plan {plan!r} needs epsilon_i and delta_i (per-round privacy of each release)")
    return privacy.noise_multiplier(float(epsilon_i), float(delta_i), 1, calibration)


CLIP_UNITS = ("sample", "subject")


@dataclass
class CapeDJICA:
    """capeDJICA as a :class:`~dpneuro.protocol.cape.CapeAlgorithm` (run it with
    :func:`~dpneuro.protocol.cape.run_cape`).

    Site data: a :class:`dpneuro.data.matrix.SiteData` of the R x N_s whitened data, or
    the pair ``(Z_s, subjects_s)`` with subjects_s the number of subjects
    (equal lengths) or their lengths in samples, in column order. Subject lengths are public metadata (as in
    [capeDJICA] Sec. IV, where N_m is "known a priori").

    Parameters are those of :func:`cape_djica` (defaults: ``PRESETS["recommended"]``).
    ``truth`` (R x R mixing in the whitened space) only adds qNGI to the
    history of a simulation.
    """

    R: int
    epsilon_i: float | None = None
    delta_i: float | None = None
    clip_G: float | None = PRESETS["recommended"]["clip_G"]
    clip_h: float | None = PRESETS["recommended"]["clip_h"]
    rounds: int = PRESETS["recommended"]["rounds"]
    optimizer: LearningRate = field(default_factory=lambda: OPTIMIZERS[PRESETS["recommended"]["optimizer"]])
    plan: str = "cape"
    calibration: str = PRESETS["recommended"]["calibration"]
    clip_unit: str = PRESETS["recommended"]["clip_unit"]
    bias: bool = PRESETS["recommended"]["bias"]
    random_state: Any = None
    truth: np.ndarray | None = None
    chunk: int = DEFAULT_CHUNK
    name: str = "capedjica"

    def __post_init__(self):
        if isinstance(self.R, bool) or int(self.R) != self.R or self.R < 2:
            raise ValueError(f"R must be an integer >= 2 (the learning rate uses ln R), got {self.R}")
        self.R = int(self.R)
        self.random_state = privacy.resolve_random_state(self.random_state)
        if isinstance(self.rounds, bool) or int(self.rounds) != self.rounds or self.rounds < 1:
            raise ValueError(f"rounds must be a positive integer, got {self.rounds}")
        self.rounds = int(self.rounds)
        if self.plan not in PLAN_KINDS:
            raise ValueError(f"unknown plan {self.plan!r}; use 'cape', 'conv' or 'none'")
        if self.clip_unit not in CLIP_UNITS:
            raise ValueError(f"clip_unit must be one of {CLIP_UNITS}, got {self.clip_unit!r}")
        self.z = _check_privacy(self.plan, self.epsilon_i, self.delta_i, self.calibration)
        self.BG, self.Bh = _as_bound(self.clip_G), _as_bound(self.clip_h)
        if self.plan != "none" and not (math.isfinite(self.BG) and (math.isfinite(self.Bh) or not self.bias)):
            raise ValueError("a private run needs finite clipping bounds clip_G and clip_h "
                             "(they set the sensitivity); only plan 'none' may run unclipped")
        if self.truth is not None:
            self.truth = np.asarray(self.truth, np.float64)
            if self.truth.shape != (self.R, self.R):
                raise ValueError(f"truth must be the {self.R} x {self.R} mixing matrix of the whitened data")
        self.max_rounds = self.rounds

    #: the ledger's stage name of every release (G, h)
    ledger_stages = ("ica",)

    @property
    def budget(self) -> privacy.GaussianBudget:
        """Each release's (eps_i, delta_i) and its calibration (what a planner rescales)."""
        return privacy.GaussianBudget(self.epsilon_i, self.delta_i, self.calibration)

    # -- sites ---------------------------------------------------------------------------
    def site_init(self, site: int, data) -> dict:
        if isinstance(data, SiteData):
            data = (data.X, data.lengths)
        try:
            Z, subjects = data
        except (TypeError, ValueError):
            raise ValueError(f"site {site}: data must be a SiteData or a pair (Z_s, subjects_s)") from None
        Z = np.asarray(Z)
        if Z.dtype not in (np.float32, np.float64):
            Z = Z.astype(np.float64)
        if Z.ndim != 2 or Z.shape[0] != self.R:
            raise ValueError(f"site {site}: whitened data must be R x N_s with R = {self.R}, got shape {Z.shape}")
        if Z.shape[1] < 1:
            raise ValueError(f"site {site}: no samples")
        if not np.all(np.isfinite(Z)):
            raise ValueError(f"site {site}: whitened data contain NaN or infinite values")
        state = self.public_state(site, _subject_lengths(subjects, Z.shape[1], site))
        state["_Z"] = Z
        if self.random_state is not None:
            state["rng"] = np.random.default_rng(_site_seed(self.random_state, site))
        return state

    def public_state(self, site: int, lengths: Sequence[int]) -> dict:
        """What a site's releases depend on: its subjects' lengths (the planner calls this without data)."""
        lengths = tuple(int(n) for n in lengths)
        return {"_lengths": lengths, "n": int(sum(lengths)), "subjects": len(lengths), "t_max": max(lengths)}

    def sensitivity(self, state) -> tuple[float, float]:
        """Subject-level L2 sensitivities of the released means (G, h) at this site.

        Replacing one subject changes at most t_max per-sample terms, each of
        norm <= B (or one subject term of norm <= t_max B with subject-level
        clipping), in a mean over N_s samples: 2 B t_max / N_s (= 2 B / M_s).
        """
        k = 2.0 * state["t_max"] / state["n"]
        return k * self.BG, k * self.Bh

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        R = self.R
        if self.plan == "none":
            dG = dh = z = 0.0
        else:
            (dG, dh), z = self.sensitivity(state), self.z
        stage = self.ledger_stages[0]
        private = self.plan != "none"  # then clipped: a mean of terms of norm <= B has norm <= B
        out = {"G": ReleaseSpec((R, R), dG, z, stage=stage, bound=float(self.BG) if private else None)}
        if self.bias:
            out["h"] = ReleaseSpec((R,), dh, z, stage=stage, bound=float(self.Bh) if private else None)
        return out

    def site_weight(self, state) -> float:
        return float(state["n"])  # the weighted average of the site means is the pooled mean

    def site_compute(self, state, round: int, broadcast: Payload) -> dict[str, np.ndarray]:
        W = np.asarray(broadcast.arrays["W"], np.float64)
        b = np.asarray(broadcast.arrays["b"], np.float64)
        if W.shape != (self.R, self.R) or b.shape != (self.R,) or not (np.all(np.isfinite(W))
                                                                       and np.all(np.isfinite(b))):
            raise ValueError(f"site {state.get('site')}: bad broadcast W {W.shape} / b {b.shape}")
        if self.clip_unit == "subject":
            G, h = subject_clipped_gradients(state["_Z"], W, b, state["_lengths"], self.BG, self.Bh,
                                             chunk=self.chunk)
        else:
            G, h = infomax_gradients(state["_Z"], W, b, self.BG, self.Bh, chunk=self.chunk)
        return {"G": G, "h": h} if self.bias else {"G": G}

    # -- aggregator ----------------------------------------------------------------------
    def aggregator_init(self) -> dict:
        R = self.R
        opt = self.optimizer
        avg_from = None if opt.average_from is None else int(math.floor(opt.average_from * self.rounds))
        return {"ica": {
            "W": opt.init_scale * np.eye(R), "b": np.zeros(R), "rho": opt.initial_rho(R), "round": 0,
            "avg_from": avg_from,
            "step": 0, "restarts": 0, "status": "running",
            "olddelta": np.zeros(R * R), "oldchange": 0.0, "smooth": np.zeros(R * R),
            "vW": np.zeros((R, R)), "vb": np.zeros(R),
            "W_sum": np.zeros((R, R)), "b_sum": np.zeros(R), "n_avg": 0,
            "history": {k: [] for k in _HISTORY_KEYS + (("qngi",) if self.truth is not None else ())},
        }}

    def aggregator_first(self, state) -> Payload:
        st = state["ica"]
        return Payload({"W": st["W"], "b": st["b"]}, {})

    def aggregator_update(self, state, round: int, combined: dict[str, np.ndarray]) -> Payload:
        st = state["ica"]
        G = np.asarray(combined["G"], np.float64)
        h = np.asarray(combined["h"], np.float64) if self.bias else np.zeros(self.R)
        _lr_step(st, self.optimizer, G, h)
        hist = st["history"]
        if "qngi" in hist:
            hist["qngi"].append(_qngi(reported_unmixing(st)[0], self.truth))
        stop = st["status"] != "running" or round >= self.rounds - 1
        if stop and st["status"] == "running":
            st["status"] = "max_rounds"
        return Payload({"W": st["W"], "b": st["b"]}, {"stop": bool(stop)})


_HISTORY_KEYS = ("rho", "dW2", "angle", "restarts")


def _site_seed(seed, site: int):
    """Entropy for site ``site``'s generator from the run seed (an int or a SeedSequence)."""
    if isinstance(seed, np.random.SeedSequence):
        return np.random.SeedSequence(seed.entropy, spawn_key=tuple(seed.spawn_key) + (site,))
    return [int(seed), site]


def _lr_step(st: dict, opt: LearningRate, G: np.ndarray, h: np.ndarray) -> None:
    """One round of the reference djICA update and learning-rate rules, in place on ``st``.

    Post-processing of the noisy averages G and h only.
    """
    R = st["W"].shape[0]
    rho = st["rho"]
    hist = st["history"]
    st["round"] += 1
    if opt.momentum > 0:
        vW, vb = opt.momentum * st["vW"] + G, opt.momentum * st["vb"] + h
    else:
        vW, vb = G, h
    dW = rho * vW
    W_new = st["W"] + dW
    b_new = st["b"] + rho * vb
    change = float(np.sum(dW * dW))
    angle = 0.0
    blowup = (not np.all(np.isfinite(W_new)) or not np.all(np.isfinite(b_new))
              or float(np.max(np.abs(W_new))) > opt.max_weight or not math.isfinite(change))
    if blowup:
        # restart from the start point with a smaller rate (releases already made stay spent)
        st.update(W=opt.init_scale * np.eye(R), b=np.zeros(R), step=0, olddelta=np.zeros(R * R), oldchange=0.0,
                  smooth=np.zeros(R * R), vW=np.zeros((R, R)), vb=np.zeros(R), W_sum=np.zeros((R, R)),
                  b_sum=np.zeros(R), n_avg=0)
        st["restarts"] += 1
        st["rho"] = rho * opt.restart_factor
        if st["rho"] < opt.min_rho:
            st["status"] = "lr_underflow"
        change = math.nan
    else:
        st["step"] += 1
        if opt.momentum > 0:
            st["vW"], st["vb"] = vW, vb
        delta = dW.reshape(-1)
        if opt.smoothing > 0:
            # the angle rule looks at a moving average of the updates, which noise does not turn
            beta = opt.smoothing if st["step"] > 1 else 0.0
            st["smooth"] = beta * st["smooth"] + (1 - beta) * delta
            delta = st["smooth"]
        dd = float(delta @ delta)
        if st["step"] > 2 and st["oldchange"] > 0 and dd > 0:
            cos = float(delta @ st["olddelta"]) / math.sqrt(dd * st["oldchange"])
            angle = math.degrees(math.acos(min(1.0, max(-1.0, cos))))
        st["W"], st["b"] = W_new, b_new
        if angle > opt.anneal_deg:
            st["rho"] = rho * opt.anneal_factor
        if angle > opt.anneal_deg or st["step"] == 1 or opt.anneal_reference == "previous":
            # the reference code keeps the old direction until it anneals ("accumulate angledelta")
            st["olddelta"], st["oldchange"] = delta.copy(), dd
        if st["avg_from"] is not None and st["round"] > st["avg_from"]:
            st["W_sum"] = st["W_sum"] + W_new
            st["b_sum"] = st["b_sum"] + b_new
            st["n_avg"] += 1
        if st["step"] > 2 and change < opt.tol:
            st["status"] = "converged"
        elif change > opt.blowup_change:
            st["rho"] = st["rho"] * opt.blowup_factor
    hist["rho"].append(rho)
    hist["dW2"].append(change)
    hist["angle"].append(angle)
    hist["restarts"].append(st["restarts"])


def reported_unmixing(st: dict) -> tuple[np.ndarray, np.ndarray]:
    """The (W, b) a run reports: the Polyak average if one is kept (and the run did not converge)."""
    if st["n_avg"] > 0 and st["status"] != "converged":
        return st["W_sum"] / st["n_avg"], st["b_sum"] / st["n_avg"]
    return st["W"], st["b"]


def _qngi(W: np.ndarray, A: np.ndarray) -> float:
    P = W @ A
    if not np.all(np.isfinite(P)):
        return math.nan
    try:
        return qngi(P)
    except ValueError:
        return math.nan


# ---------------------------------------------------------------------------------------
# simulation entry points
# ---------------------------------------------------------------------------------------

@dataclass
class DJICAResult:
    """Outcome of a capeDJICA simulation.

    Attributes
    ----------
    W : ndarray (R, R)
        Unmixing matrix of the whitened data: the Polyak average of the
        iterates when the optimizer keeps one (``average_from``) and the run
        did not converge, else the last iterate. Spatial maps:
        :func:`spatial_maps`; time courses: :meth:`sources`.
    b : ndarray (R,)
        Bias, reported like W.
    W_last, b_last : ndarray
        The last iterate.
    history : dict of str to ndarray
        Per round: ``rho`` (rate used), ``dW2`` (||delta W||_F^2, NaN on a
        restart), ``angle`` (degrees, 0 before step 3), ``restarts``
        (cumulative) and ``qngi`` when a truth was given.
    ledgers : list of PrivacyLedger
        One per site (None for a site that dropped out).
    rounds : int
        Rounds run (= releases per site and quantity).
    status : str
        ``"converged"``, ``"max_rounds"`` or ``"lr_underflow"``.
    noise_multiplier : float
        z = noise std / sensitivity of every release (0 for plan "none").
    """

    W: np.ndarray
    b: np.ndarray
    W_last: np.ndarray
    b_last: np.ndarray
    history: dict[str, np.ndarray]
    ledgers: list[PrivacyLedger | None]
    rounds: int
    status: str
    plan: str
    optimizer: LearningRate
    noise_multiplier: float
    rho: float
    restarts: int
    simulation: SimulationResult | None = None

    def epsilon(self, delta: float, method: str = "exact", **kwargs) -> float:
        """Largest total epsilon over the sites at ``delta`` for this run's ICA releases.

        Keyword arguments go to :meth:`PrivacyLedger.epsilon` (e.g. ``collusion=True``).
        Plan "none" is not private: infinity.
        """
        eps = [led.epsilon(delta, method, **kwargs) for led in self.ledgers if led is not None]
        return max(eps) if eps else 0.0

    def sources(self, Z, dtype=np.float64) -> np.ndarray:
        """Time courses S = W Z + b of whitened data Z."""
        return time_courses(self.W, Z, self.b).astype(dtype, copy=False)


def _prepare(Z_sites, subjects_per_site) -> tuple[list, int]:
    if isinstance(Z_sites, np.ndarray):
        raise ValueError("Z_sites must be a list with one R x N_s array (or SiteData) per site")
    Z_sites = list(Z_sites)
    if subjects_per_site is None:  # SiteData carry their subjects' boundaries
        if not all(isinstance(z, SiteData) for z in Z_sites):
            raise ValueError("give subjects_per_site, or every site's whitened data as a SiteData")
        subjects_per_site = [z.lengths for z in Z_sites]
    Z_sites = [z.X if isinstance(z, SiteData) else z for z in Z_sites]
    subjects = list(subjects_per_site) if not isinstance(subjects_per_site, (int, np.integer)) \
        else [subjects_per_site] * len(Z_sites)
    if not Z_sites:
        raise ValueError("no sites")
    if len(subjects) != len(Z_sites):
        raise ValueError(f"{len(Z_sites)} sites but subjects for {len(subjects)}")
    shapes = [np.shape(z) for z in Z_sites]
    if any(len(s) != 2 for s in shapes):
        raise ValueError(f"every site's whitened data must be R x N_s, got shapes {shapes}")
    Rs = {s[0] for s in shapes}
    if len(Rs) != 1:
        raise ValueError(f"sites have different numbers of components R: {[s[0] for s in shapes]}")
    return list(zip(Z_sites, subjects)), Rs.pop()


def cape_djica(
    Z_sites: Sequence[np.ndarray],
    subjects_per_site=None,
    *,
    epsilon_i: float | None = None,
    delta_i: float | None = None,
    preset: str = "recommended",
    clip_G: float | None = FROM_PRESET,
    clip_h: float | None = FROM_PRESET,
    rounds: int = FROM_PRESET,
    plan: str | NoisePlan = "cape",
    lr: float | None = None,
    random_state=None,
    exchange=None,
    optimizer: str | LearningRate = FROM_PRESET,
    checkpoint: str | os.PathLike | None = None,
    calibration: str = FROM_PRESET,
    clip_unit: str = FROM_PRESET,
    bias: bool = FROM_PRESET,
    truth: np.ndarray | None = None,
    chunk: int = DEFAULT_CHUNK,
    options: RunOptions | None = None,
    secagg_config=None,
) -> DJICAResult:
    """Simulate capeDJICA (or a baseline) with every party in this process.

    Parameters
    ----------
    Z_sites : list of ndarray (R, N_s) or of :class:`dpneuro.data.matrix.SiteData`
        Whitened data of every site (see :func:`whiten`), samples as columns,
        subjects one after the other.
    subjects_per_site : int or list, optional
        Per site: the number of subjects M_s (equal lengths) or the list of
        subject lengths. A single int applies to every site. Not needed when
        the sites are SiteData (their boundaries are used).
    epsilon_i, delta_i : float
        Per-round privacy of *each* of the two releases (G and h), as in
        [capeDJICA] Sec. V (which uses delta_i = 1e-2). Not needed for plan "none".
    preset : {"recommended", "paper"}
        Fills every setting below that is not given: the measured best
        (default) or [capeDJICA] as published (:data:`PRESETS`).
    clip_G, clip_h : float or None
        Clipping bounds B_G, B_h of each clipping unit's gradient (recommended
        0.7 per subject; [capeDJICA] Sec. V: 30 per sample). None (no clipping)
        only with plan "none": plain infomax.
    rounds : int
        Round limit J (= releases per site per quantity at most).
    plan : {"cape", "conv", "none"} or NoisePlan
        Correlated noise (needs >= 3 sites and secure aggregation),
        independent noise at full std per site, or no noise (not private).
    lr : float, optional
        Initial learning rate; overrides the optimizer's.
    random_state : int or Generator, optional
        Reproducible simulation: every site's noise generator is seeded from
        (random_state, site) (a Generator is turned into a seed by one draw).
        Default: OS entropy.
    exchange : Exchange, optional
        Defaults to a fresh in-process exchange.
    optimizer : {"paper", "fast"} or LearningRate
    checkpoint : path, optional
        Folder for per-party checkpoints (``aggregator.npz``,
        ``site-XXX.npz``). Calling again with the same folder and a
        persistent exchange (e.g. a DirectoryExchange over the same folder
        and run id) resumes where the parties stopped without releasing any
        round twice.
    calibration : {"analytic", "classic"}
        Per-release Gaussian calibration for (epsilon_i, delta_i)
        (:func:`dpneuro.privacy.noise_multiplier`).
    clip_unit : {"sample", "subject"}
        Clip every sample's gradient ([capeDJICA] Alg. 4) or every
        subject's mean gradient (recommended) (:func:`subject_clipped_gradients`); the
        sensitivity formula is the same, the useful bounds are not.
    bias : bool
        Learn and release the bias h (as [capeDJICA] does). False releases G only and keeps
        b = 0, which halves the privacy cost of a round (whitened data are
        centred, so the bias has little to learn).
    truth : ndarray (R, R), optional
        Mixing matrix in the whitened space; adds qNGI(W A) to the history.
    chunk : int
        Cache-blocking width of the site computation.
    options : RunOptions, optional
        Driver options (timeouts, progress bar).
    secagg_config : SecAggConfig, optional
        Secure-aggregation parameters for plan "cape".

    Returns
    -------
    DJICAResult
    """
    site_data, R = _prepare(Z_sites, subjects_per_site)
    nplan = NoisePlan.coerce(plan)
    st = preset_settings(preset, clip_G=clip_G, clip_h=clip_h, rounds=rounds, optimizer=optimizer,
                         calibration=calibration, clip_unit=clip_unit, bias=bias)
    opt = _coerce_optimizer(st.pop("optimizer"), lr)
    alg = CapeDJICA(R=R, epsilon_i=epsilon_i, delta_i=delta_i, optimizer=opt, plan=nplan.kind,
                    random_state=random_state, truth=truth, chunk=chunk, **st)
    # validate every site before anything runs (and so before any release)
    for s, data in enumerate(site_data):
        alg.site_init(s, data)
    proto = cape_protocol(alg, nplan, n_sites=len(site_data), secagg_config=secagg_config)
    sim = simulate(proto, site_data, exchange=exchange, options=options, checkpoint_dir=checkpoint)
    st = sim.aggregator["ica"]
    W, b = reported_unmixing(st)
    return DJICAResult(
        W=np.array(W), b=np.array(b), W_last=np.array(st["W"]), b_last=np.array(st["b"]),
        history={k: np.asarray(v, float) for k, v in st["history"].items()},
        ledgers=ledgers(sim), rounds=len(st["history"]["rho"]), status=st["status"], plan=nplan.kind,
        optimizer=opt, noise_multiplier=alg.z, rho=float(st["rho"]), restarts=int(st["restarts"]),
        simulation=sim,
    )


def local_dp_ica(Z, subjects, **kwargs) -> DJICAResult:
    """DP infomax ICA of one site's data alone (the paper's ``local DP-ICA`` baseline).

    Same code path as :func:`cape_djica` with a single site; CAPE needs at
    least 3 sites, so the noise is the site's own (plan ``"conv"``, or
    ``"none"`` for the non-private local baseline). Keyword arguments are
    those of :func:`cape_djica`.
    """
    plan = kwargs.pop("plan", "conv")
    if plan == "cape":
        raise ValueError("local DP-ICA runs on one site: plan 'cape' needs >= 3 sites; use 'conv'")
    return cape_djica([Z], [subjects], plan=plan, **kwargs)
