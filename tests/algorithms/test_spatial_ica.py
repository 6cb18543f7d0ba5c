"""Spatial group ICA of the released basis: recovery, the shared parametrisation, the conventions."""

from importlib import import_module

import numpy as np
import pytest

from dpneuro.algorithms.djica import spatial_maps, time_courses, whiten
from dpneuro.algorithms.metrics import match_components
from dpneuro.algorithms.spatial_ica import (
    GUIDED_ICA_MAX_ITER,
    SPATIAL_ICA_MAX_ITER,
    SPATIAL_ICA_RESTARTS,
    guided_ica,
    spatial_ica,
)


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


def _site_basis(seed: int, D: int = 3000, R: int = 6, N: int = 400, others: str = "networks"):
    """A site's principal subspace of 2R directions (as site_maps takes it), noisy references for R of its maps.

    The other R directions hold the site's own sources: heavy-tailed maps (``"networks"``) or Gaussian noise.
    """
    rng = np.random.default_rng(seed)
    A = rng.laplace(size=(D, 2 * R)) ** 3
    if others == "noise":
        A[:, R:] = rng.standard_normal((D, R))
    A /= A.std(axis=0)
    X = A @ rng.standard_normal((2 * R, N)) + 0.5 * rng.standard_normal((D, N))
    U = np.linalg.svd(X, full_matrices=False)[0][:, :2 * R]
    return U, A[:, :R] + 2.0 * rng.standard_normal((D, R)), A[:, :R]


def _mean_r(a, b) -> float:
    return float(np.mean(np.abs(match_components(a, b)[1])))


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
    # (to where FastICA stops: the kept run is polished towards tol 1e-12, a last step of ~1e-6 rad)
    np.testing.assert_allclose(np.abs(spatial_ica(V * flip, lam).maps), np.abs(r.maps), atol=2e-5)


def test_refuses_what_it_cannot_unmix():
    V = np.linalg.qr(np.random.default_rng(0).standard_normal((5, 5)))[0]
    with pytest.raises(ValueError, match="more features than components"):
        spatial_ica(V, np.ones(5))
    with pytest.raises(ValueError, match="NaN or infinite"):
        spatial_ica(np.eye(10)[:, :3], np.array([1.0, 0.5, np.inf]))


@pytest.mark.parametrize("seed", range(3))
def test_the_default_tolerances_converge_on_realistic_problems(seed):
    """Every start of the spatial ICA and the site's guided ICA stop on the tolerance, well within max_iter."""
    S, _, V, lam = _consortium_basis(seed)
    r = spatial_ica(V, lam)
    assert r.status == "converged" and r.n_iter < SPATIAL_ICA_MAX_ITER / 10, r.n_iter
    assert r.n_converged == SPATIAL_ICA_RESTARTS  # every start, not only the kept one
    U, ref, A = _site_basis(seed)
    g = guided_ica(U, ref)
    assert g.status == "converged" and g.n_iter < GUIDED_ICA_MAX_ITER / 10, g.n_iter
    assert _mean_r(g.maps, A) > 0.99


def test_guided_ica_converges_with_gaussian_noise_in_the_other_directions():
    """Where plain FastICA cycles among the Gaussian directions for ever, the stabilised step stops, and the
    referenced maps are found; with too few iterations it says it did not converge."""
    U, ref, A = _site_basis(0, others="noise")
    g = guided_ica(U, ref)
    assert g.status == "converged" and GUIDED_ICA_MAX_ITER / 2 < g.n_iter < GUIDED_ICA_MAX_ITER, g.n_iter
    assert _mean_r(g.maps, A) > 0.99
    g = guided_ica(U, ref, max_iter=20)
    assert g.status == "not converged" and g.n_iter == 20


def test_every_start_converges_on_a_basis_of_noise():
    """A private basis that is mostly noise (the run warns of it) has no clear optimum: plain FastICA's starts
    ran to max_iter on such bases; the stabilised ones stop."""
    V = np.linalg.qr(np.random.default_rng(3).standard_normal((250, 8)))[0]
    r = spatial_ica(V, np.linspace(1.0, 0.9, 8))
    assert r.n_converged == SPATIAL_ICA_RESTARTS and r.status == "converged"


def test_the_fits_run_on_one_blas_thread(monkeypatch):
    """Their small products gain nothing from more threads, which slowed them up to 10x on busy cores."""
    from threadpoolctl import threadpool_info, threadpool_limits

    module = import_module("dpneuro.algorithms.spatial_ica")  # the package's name spatial_ica is the function
    seen = []
    fit = module.fastica

    def spy(*args, **kwargs):
        seen.append({i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"})
        return fit(*args, **kwargs)

    monkeypatch.setattr(module, "fastica", spy)
    _, _, V, lam = _consortium_basis(0, D=300)
    U, ref, _ = _site_basis(0, D=300)
    with threadpool_limits(limits=2, user_api="blas"):
        spatial_ica(V, lam, n_init=2)
        guided_ica(U, ref)
        after = {i["num_threads"] for i in threadpool_info() if i["user_api"] == "blas"}
    assert len(seen) >= 3 and all(s == {1} for s in seen), seen  # (the kept run's polishing is a fit too)
    assert after <= {2}  # restored after each


def site_blocks(D: int = 400, R: int = 3, M: int = 6, T: int = 50):
    """A site of M subjects whose voxels (D, a D x 1 x 1 mask) mix 2R heavy-tailed maps, and its time courses of
    the first R: (decoded blocks by file, runs, boundaries, S, mask), as site_voxel_maps takes them."""
    rng = np.random.default_rng(5)
    A = rng.laplace(size=(D, 2 * R)) ** 3
    blocks, tcs = {}, []
    for m in range(M):
        S_m = rng.standard_normal((2 * R, T))
        blocks[f"sub-{m}.nii.gz"] = A @ S_m + rng.standard_normal((D, T))
        tcs.append(S_m[:R] + 0.3 * rng.standard_normal((R, T)))
    runs, S = [[f] for f in blocks], np.concatenate(tcs, axis=1)
    return blocks, runs, [(T * m, T * (m + 1)) for m in range(M)], S, np.ones((D, 1, 1), bool)


def test_site_voxel_maps_record_whether_their_guided_ica_converged():
    """The run's record of each site's voxel maps (``site_maps_ica``), for run.json and the report."""
    from dpneuro.run.site_maps import site_voxel_maps

    blocks, runs, boundaries, S, mask = site_blocks()
    D, R = mask.size, S.shape[0]
    record: dict = {}
    maps = site_voxel_maps(runs, boundaries, S, mask, decode=blocks.__getitem__, workers=1, record=record)
    ica = record["site_maps_ica"]
    assert ica["status"] == "converged" and 0 < ica["n_iter"] < ica["max_iter"] == GUIDED_ICA_MAX_ITER, ica
    assert maps.shape == (D, R)
    record = {}
    site_voxel_maps(runs, boundaries, S, mask, method="dual_regression", decode=blocks.__getitem__, workers=1,
                    record=record)
    assert record == {"site_maps_ica": None}  # no guided ICA ran


def test_the_kept_run_is_polished_only_towards_its_own_maps(monkeypatch):
    """Polishing goes on from where the kept run stopped, at its step size; should the plain steps wander off to
    another optimum (as from points only damped steps reach), the run's own maps are kept."""
    module = import_module("dpneuro.algorithms.spatial_ica")
    _, _, V, lam = _consortium_basis(2, D=600)
    Z, _ = module._whiten(V)
    run = module._run(Z, 0, SPATIAL_ICA_MAX_ITER, 1e-6)
    assert run.fit.converged
    W, S = module._polish(Z, run, 500)
    assert not np.array_equal(W, run.fit.W) and _mean_r(S, run.S) > 0.999  # polished, same maps
    c, s = np.cos(0.3), np.sin(0.3)
    turn = np.eye(len(W))
    turn[:2, :2] = [[c, -s], [s, c]]  # another optimum: two maps mixed
    monkeypatch.setattr(module, "fastica", lambda *a, **k: module.FastICAFit(turn @ run.fit.W, 5, True, 1.0))
    W, S = module._polish(Z, run, 500)
    assert np.array_equal(W, run.fit.W) and np.array_equal(S, run.S)
