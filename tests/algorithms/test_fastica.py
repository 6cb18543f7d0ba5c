"""The stabilised FastICA: scikit-learn's iteration while it converges, a fixed point where scikit-learn's cycles."""

import warnings

import numpy as np
import pytest
from sklearn.decomposition import FastICA
from sklearn.exceptions import ConvergenceWarning

from dpneuro.algorithms._fastica import _aligned, fastica, random_start


def _white(A: np.ndarray) -> np.ndarray:
    """Centred columns of ``A`` rotated to identity covariance (what the spatial ICA hands FastICA)."""
    A = A - A.mean(axis=0)
    _, s, vt = np.linalg.svd(A, full_matrices=False)
    return A @ vt.T * (np.sqrt(len(A)) / s)


def _sklearn(Z, w_init, tol, max_iter):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        ica = FastICA(whiten=False, fun="logcosh", tol=tol, max_iter=max_iter, w_init=w_init).fit(Z)
    return ica, not any(issubclass(w.category, ConvergenceWarning) for w in caught)


@pytest.mark.parametrize("seed", range(3))
def test_a_converging_fit_is_scikit_learns(seed):
    """Step size 1 until half of max_iter: the same iteration, the same stop, the same answer."""
    rng = np.random.default_rng(seed)
    Z = _white(rng.laplace(size=(2000, 5)) ** 3 @ rng.standard_normal((5, 5)))
    ica, ok = _sklearn(Z, random_start(seed, 5), 1e-8, 400)
    fit = fastica(Z, random_start(seed, 5), tol=1e-8, max_iter=400)
    assert ok and fit.converged and fit.n_iter == ica.n_iter_ < 200
    np.testing.assert_allclose(fit.W, ica.components_, atol=1e-12)


def test_random_start_is_scikit_learns():
    Z = _white(np.random.default_rng(0).laplace(size=(500, 4)))
    ica = FastICA(whiten=False, fun="logcosh", max_iter=1, random_state=7)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        ica.fit(Z)
    np.testing.assert_allclose(fastica(Z, random_start(7, 4), tol=0.0, max_iter=1).W, ica.components_, atol=1e-13)


@pytest.mark.parametrize("seed", [0, 2, 3, 4])
def test_converges_where_the_plain_iteration_cycles(seed):
    """Half Gaussian directions, as a site's subspace beyond the consortium's networks: scikit-learn's step
    never settles (9 of seeds 0-9 run to max_iter, these among them); the stabilised one stops at a fixed
    point that still holds the non-Gaussian maps."""
    rng = np.random.default_rng(seed)
    D, R = 3000, 6
    A = np.c_[rng.laplace(size=(D, R)) ** 3, rng.standard_normal((D, R))]
    Z = _white(A @ np.linalg.qr(rng.standard_normal((2 * R, 2 * R)))[0])
    w0 = random_start(seed, 2 * R)
    _, ok = _sklearn(Z, w0, 1e-10, 2000)
    fit = fastica(Z, w0, tol=1e-10, max_iter=2000)
    assert not ok
    assert fit.converged and fit.n_iter < 2000
    S = Z @ fit.W.T
    best = np.abs(np.corrcoef(np.c_[S, A[:, :R]].T)[: 2 * R, 2 * R:]).max(axis=0)
    assert best.min() > 0.99, best  # every heavy-tailed map found
    # a fixed point of the plain step too: it turns no component by more than the damped step's tolerance
    # scaled to its size (a turn of angle a changes 1 - |cos| by about a^2 / 2)
    assert fastica(Z, fit.W, tol=2e-10 / fit.step**2, max_iter=1).converged


def test_says_when_it_did_not_converge():
    Z = _white(np.random.default_rng(1).standard_normal((1000, 6)))
    fit = fastica(Z, random_start(0, 6), tol=1e-12, max_iter=20)
    assert not fit.converged and fit.n_iter == 20
    np.testing.assert_allclose(fit.W @ fit.W.T, np.eye(6), atol=1e-12)  # still an orthogonal unmixing


def test_a_damped_step_mixes_each_row_with_its_own_component():
    """A step that swapped two rows and flipped one is undone before mixing: averaging a row with another
    component's would collapse two directions into one (a singular mix)."""
    W = np.linalg.qr(np.random.default_rng(2).standard_normal((5, 5)))[0]
    F = W[[1, 0, 2, 3, 4]] * np.array([1, -1, 1, -1, 1])[:, None]
    np.testing.assert_allclose(_aligned(F, W), W, atol=1e-15)
