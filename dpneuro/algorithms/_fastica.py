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

Collapse guard. On a basis that is mostly noise the damped mix can collapse:
two of its rows collinear to rounding, W W^T singular (measured: condition
2e15 to inf, where the other mixes stay below 10), and the inverse square root
of its smallest eigenvalue would overflow into infs and NaNs. The
decorrelation takes scikit-learn's route, (W W^T)^(-1/2) W by ``eigh``, while
W W^T's condition number is at most ``COLLAPSE_CONDITION`` (the same numbers
as scikit-learn's) and the nearest orthogonal matrix by SVD beyond it: always
finite and orthogonal. A plain step that ill-conditioned is ordinary on
Gaussian directions (the update nearly vanishes there) and the fit goes on; a
start or a damped mix that ill-conditioned, or a non-finite update, ends the
fit with ``collapsed`` set, the last orthogonal estimate and ``converged``
False. The callers restart such a fit from :func:`restart_seed`'s seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import scipy.linalg
from scipy.optimize import linear_sum_assignment

__all__ = ["COLLAPSE_CONDITION", "FastICAFit", "fastica", "random_start", "restart_seed"]

#: W W^T's condition number beyond which the decorrelation takes the SVD route. eigh's rows are orthogonal to about
#: 1e-16 times it (~1e-3 at the bound, which the next step's decorrelation repairs: plain steps on Gaussian
#: directions pass 1e12 in 1 fit in 10 and still converge), to nothing near 1e16, and it overflows on a singular W
COLLAPSE_CONDITION = 1e14


@dataclass
class FastICAFit:
    """One FastICA run: ``W`` (K x K, orthogonal; the sources are ``X @ W.T``), its iterations, whether
    every component's last step turned it by less than ``tol``, and the step size it ended with (1: the plain
    step; a damped step of size mu turns a component about mu times as far as the plain one would)."""

    W: np.ndarray
    n_iter: int
    converged: bool
    step: float = 1.0
    #: the start or a damped step collapsed (two directions into one; module notes): ``W`` is the last orthogonal
    #: estimate before it, ``converged`` False; start again elsewhere (:func:`restart_seed`)
    collapsed: bool = False


def random_start(random_state: int, K: int) -> np.ndarray:
    """scikit-learn's start for an integer ``random_state``: a K x K standard normal draw of its ``RandomState``.

    A public seed, not a noise draw: FastICA's starts are part of the published algorithm (no privacy role)."""
    return np.random.RandomState(int(random_state)).normal(size=(K, K))


def restart_seed(random_state: int, attempt: int) -> int:
    """The public seed of restart ``attempt`` (1, 2, ...) of a fit started from seed ``random_state`` that
    collapsed: the first 32-bit word of numpy's ``SeedSequence([random_state, attempt])``, a deterministic function
    of the two (so a run is reproducible from its seeds) that does not fall on the neighbouring starts' seeds
    ``random_state + 1, ...``."""
    return int(np.random.SeedSequence([int(random_state), int(attempt)]).generate_state(1)[0])


def fastica(X: np.ndarray, w_init: np.ndarray, *, tol: float, max_iter: int, step: float = 1.0) -> FastICAFit:
    """Symmetric FastICA with G = log cosh of whitened ``X`` (n x K, identity covariance) from ``w_init``.

    Stops when the plain step would turn no component further than ``tol`` (scikit-learn's measure,
    ``max_k |1 - |<w_k new, w_k old>||``; once the step is damped, after matching the plain step's rows to the
    current ones) and returns that step, or after ``max_iter`` iterations; the step size starts at ``step``
    (1: the plain step; a fit continued from where another stopped goes on at its step size) and follows the
    reference package's rule (module notes). A start or a damped step that collapses ends the fit with
    ``collapsed`` set (module notes).
    """
    Xt = np.asarray(X, np.float64).T
    n = Xt.shape[1]
    W, cond = _orthogonal(np.asarray(w_init, np.float64))
    mu, stroke, long = float(step), 0.0, max_iter / 2
    if not cond <= COLLAPSE_CONDITION:  # a singular start: nothing to iterate from
        return FastICAFit(W, 0, False, mu, collapsed=True)
    before = np.zeros_like(W)  # the estimate two steps back, for the cycle test
    for it in range(1, int(max_iter) + 1):
        G = np.tanh(W @ Xt)
        update = G @ Xt.T / n - (1.0 - G**2).mean(axis=1)[:, None] * W
        if not np.isfinite(update).all():  # non-finite data
            return FastICAFit(W, it, False, mu, collapsed=True)
        plain, _ = _orthogonal(update)  # ill-conditioned where directions are Gaussian: fine by the SVD route
        if mu < 1.0:
            plain = _aligned(plain, W)
        if _turn(plain, W) < tol:  # the plain step's turn, whatever step is taken: one meaning of converged
            return FastICAFit(plain, it, True, mu)
        if mu == 1.0:
            nxt = plain
        else:
            nxt, cond = _orthogonal((1.0 - mu) * W + mu * plain)
            if not cond <= COLLAPSE_CONDITION:  # the mix of two orthogonal estimates lost a direction
                return FastICAFit(W, it, False, mu, collapsed=True)
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
    """(W W^T)^(-1/2) W, as scikit-learn's FastICA computes it while W W^T is well conditioned; else the nearest
    orthogonal matrix by SVD (module notes). Always finite and orthogonal."""
    return _orthogonal(W)[0]


def _orthogonal(W: np.ndarray) -> tuple[np.ndarray, float]:
    """(W's decorrelation, W W^T's condition number: inf when singular or not finite)."""
    with np.errstate(over="ignore", invalid="ignore"):  # a huge W's overflow is caught below
        C = W @ W.T
    if not np.isfinite(C).all():
        return _polar(W), np.inf
    s, u = scipy.linalg.eigh(C)
    tiny = np.finfo(W.dtype).tiny
    # Python floats: inf, not a warning, where a singular W overflows it
    cond = float(s[-1]) / float(s[0]) if s[0] >= tiny else np.inf
    if cond <= COLLAPSE_CONDITION:  # scikit-learn's route, exactly as before (its clip changes nothing here)
        s = np.clip(s, tiny, None)
        return np.linalg.multi_dot([u * (1.0 / np.sqrt(s)), u.T, W]), cond
    return _polar(W), cond


def _polar(W: np.ndarray) -> np.ndarray:
    """The orthogonal factor U V^T of W = U S V^T (W's finite entries, scaled first so nothing overflows): the
    nearest orthogonal matrix, defined even where W is singular."""
    W = np.where(np.isfinite(W), W, 0.0)
    top = np.abs(W).max()
    if top > 0:
        W = W / top
    try:
        u, _, vt = np.linalg.svd(W)
    except np.linalg.LinAlgError:  # gesdd did not converge: the slower, sturdier driver
        u, _, vt = scipy.linalg.svd(W, lapack_driver="gesvd")
    return u @ vt
