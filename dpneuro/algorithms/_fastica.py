"""FastICA's symmetric fixed-point iteration (logcosh), stabilised as the reference FastICA package does it.

scikit-learn's FastICA has no step size: on a basis whose directions are
nearly Gaussian (a private basis that is mostly noise, a site's directions
beyond the consortium's components) the plain fixed-point step overshoots and
the estimate cycles for ever. Hyvarinen's "Fast and robust fixed-point
algorithms for independent component analysis" (1999) stabilises the step
with a step size mu, and the reference implementation (the FastICA package,
``'stabilization', 'on'``) halves mu for one step when the estimate returns
to where it was two steps before, and for good after half of ``max_iter``.
:func:`fastica` applies that rule to scikit-learn's step, and halves mu again
after half of the iterations left each time (one real-data start needed the
second halving). With mu = 1 it is scikit-learn's iteration exactly (same
update, same symmetric decorrelation, same start from a seed), so a fit that
converges within ``max_iter / 2`` iterations and never cycles is
scikit-learn's. With mu < 1 the new estimate is the decorrelated mix
``(1 - mu) W + mu F(W)``, which has the same fixed points, after F(W)'s rows
are matched to W's (a step may swap two components between rows).
Convergence means one thing throughout: the plain step F(W) turns no
component further than ``tol``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg
from scipy.optimize import linear_sum_assignment

__all__ = ["FastICAFit", "fastica", "random_start"]


@dataclass
class FastICAFit:
    """One FastICA run: ``W`` (K x K, orthogonal; the sources are ``X @ W.T``), its iterations, whether
    every component's last step turned it by less than ``tol``, and the step size it ended with (1: the plain
    step; a damped step of size mu turns a component about mu times as far as the plain one would)."""

    W: np.ndarray
    n_iter: int
    converged: bool
    step: float = 1.0


def random_start(random_state: int, K: int) -> np.ndarray:
    """scikit-learn's start for an integer ``random_state``: a K x K standard normal draw of its ``RandomState``.

    A public seed, not a noise draw: FastICA's starts are part of the published algorithm (no privacy role)."""
    return np.random.RandomState(int(random_state)).normal(size=(K, K))


def fastica(X: np.ndarray, w_init: np.ndarray, *, tol: float, max_iter: int, step: float = 1.0) -> FastICAFit:
    """Symmetric FastICA with G = log cosh of whitened ``X`` (n x K, identity covariance) from ``w_init``.

    Stops when the plain step would turn no component further than ``tol`` (scikit-learn's measure,
    ``max_k |1 - |<w_k new, w_k old>||``; once the step is damped, after matching the plain step's rows to the
    current ones) and returns that step, or after ``max_iter`` iterations; the step size starts at ``step``
    (1: the plain step; a fit continued from where another stopped goes on at its step size) and follows the
    reference package's rule (module notes).
    """
    Xt = np.asarray(X, np.float64).T
    n = Xt.shape[1]
    W = _decorrelate(np.asarray(w_init, np.float64))
    before = np.zeros_like(W)  # the estimate two steps back, for the cycle test
    mu, stroke, long = float(step), 0.0, max_iter / 2
    for it in range(1, int(max_iter) + 1):
        G = np.tanh(W @ Xt)
        plain = _decorrelate(G @ Xt.T / n - (1.0 - G**2).mean(axis=1)[:, None] * W)
        if mu < 1.0:
            plain = _aligned(plain, W)
        if _turn(plain, W) < tol:  # the plain step's turn, whatever step is taken: one meaning of converged
            return FastICAFit(plain, it, True, mu)
        nxt = plain if mu == 1.0 else _decorrelate((1.0 - mu) * W + mu * plain)
        back = _turn(nxt, before)
        before, W = W, nxt
        if not stroke and back < tol:  # a two-step cycle: one step at half the size
            stroke, mu = mu, mu / 2
        elif stroke:
            mu, stroke = stroke, 0.0
        elif it > long:  # taking long: half the step from here on, again after half of what is left
            long, mu = (long + max_iter) / 2, mu / 2
    return FastICAFit(W, int(max_iter), False, mu)


def _aligned(F: np.ndarray, W: np.ndarray) -> np.ndarray:
    """The rows of ``F`` reordered and signed to match those of ``W`` (largest summed |cos|): a FastICA step
    may swap two components between rows or flip one, and the mix of a row with another component's is not a
    smaller step but a collapse of two directions into one."""
    C = F @ W.T
    rows, cols = linear_sum_assignment(-np.abs(C))
    out = np.empty_like(F)
    out[cols] = F[rows] * np.sign(C[rows, cols])[:, None]
    return out


def _cosines(A: np.ndarray, B: np.ndarray) -> np.ndarray:
    return np.einsum("ij,ij->i", A, B)


def _turn(A: np.ndarray, B: np.ndarray) -> float:
    """max_k |1 - |cos(a_k, b_k)||: how far the rows turned (opposite signs count as the same direction)."""
    return float(np.abs(np.abs(_cosines(A, B)) - 1.0).max())


def _decorrelate(W: np.ndarray) -> np.ndarray:
    """(W W^T)^(-1/2) W, as scikit-learn's FastICA computes it."""
    s, u = scipy.linalg.eigh(W @ W.T)
    s = np.clip(s, np.finfo(W.dtype).tiny, None)
    return np.linalg.multi_dot([u * (1.0 / np.sqrt(s)), u.T, W])
