"""Spatial group ICA of the released basis: recovery, the shared parametrisation, the conventions."""

import numpy as np
import pytest

from dpneuro.algorithms.djica import spatial_maps, time_courses, whiten
from dpneuro.algorithms.spatial_ica import spatial_ica


def _consortium_basis(seed: int, D: int = 2500, R: int = 6, N: int = 500, corr: float = 0.8):
    """Independent heavy-tailed maps, strongly correlated time courses (what temporal ICA cannot separate)."""
    rng = np.random.default_rng(seed)
    S = rng.laplace(size=(D, R)) ** 3
    T = rng.standard_normal((N, R))
    T[:, 1:] = corr * T[:, :1] + np.sqrt(1 - corr**2) * T[:, 1:]
    X = S @ T.T + 0.3 * S.std() * rng.standard_normal((D, N))
    X /= np.linalg.norm(X, axis=0)  # unit-norm time points, as the pipeline scales them
    lam, V = np.linalg.eigh(X @ X.T / N)
    return S, X, V[:, ::-1][:, :R], lam[::-1][:R]


@pytest.mark.parametrize("seed", range(5))
def test_recovers_independent_maps_even_with_correlated_time_courses(seed):
    S, X, V, lam = _consortium_basis(seed)
    r = spatial_ica(V, lam)
    assert r.status == "converged"
    corr = np.corrcoef(np.c_[r.maps, S].T)[: S.shape[1], S.shape[1]:]
    best = np.abs(corr).max(axis=1)
    assert best.min() > 0.98, best
    assert sorted(np.abs(corr).argmax(axis=1)) == list(range(S.shape[1]))  # one map per source


def test_maps_and_time_courses_use_capedjicas_parametrisation():
    S, X, V, lam = _consortium_basis(0)
    r = spatial_ica(V, lam)
    # A = V Lambda^1/2 W^-1 are the maps; W z is the least-squares fit of x on them (dual regression, stage 1)
    np.testing.assert_allclose(spatial_maps(V, lam, r.W), r.maps, atol=1e-9)
    t = time_courses(r.W, whiten(X, V, lam))
    np.testing.assert_allclose(t, np.linalg.lstsq(r.maps, X, rcond=None)[0], atol=1e-8)


def test_signs_order_and_determinism():
    S, X, V, lam = _consortium_basis(1)
    r = spatial_ica(V, lam)
    M = (r.maps - r.maps.mean(0)) / r.maps.std(0)
    assert np.all((M**3).mean(0) > 0)  # heavy tail positive, as CanICA
    t = time_courses(r.W, whiten(X, V, lam))
    explained = (t**2).mean(axis=1) * (r.maps**2).sum(0)  # the data's second moment each component carries
    assert np.all(np.diff(explained) <= 1e-9 * explained[0]), explained  # largest first
    again = spatial_ica(V.copy(), lam.copy())
    np.testing.assert_array_equal(again.W, r.W)  # a fixed, public start: the aggregator's result is reproducible
    # the answer does not depend on the eigenvectors' signs (a noisy release flips them at random)
    flip = np.where(np.arange(V.shape[1]) % 2, -1.0, 1.0)
    # (to FastICA's stopping angle, sqrt(tol) = 1e-6 rad, times maps of unit variance over features)
    np.testing.assert_allclose(np.abs(spatial_ica(V * flip, lam).maps), np.abs(r.maps), atol=2e-5)


def test_refuses_what_it_cannot_unmix():
    V = np.linalg.qr(np.random.default_rng(0).standard_normal((5, 5)))[0]
    with pytest.raises(ValueError, match="more features than components"):
        spatial_ica(V, np.ones(5))
    with pytest.raises(ValueError, match="NaN or infinite"):
        spatial_ica(np.eye(10)[:, :3], np.array([1.0, 0.5, np.inf]))
