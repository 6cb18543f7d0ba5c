"""Stable spatial ICA (restarts, selection) and the random-matrix post-processing of the released matrix."""

from __future__ import annotations

import inspect
import math

import numpy as np
import pytest

from dpneuro.algorithms.metrics import match_components
from dpneuro.algorithms.spatial_ica import SPATIAL_ICA_RESTARTS, SPATIAL_ICA_TOL, _whiten, spatial_ica
from dpneuro.privacy import rmt


def _planted(seed: int, D: int = 200, R: int = 8, noise: float = 0.5):
    """An orthonormal basis spanning R sparse sources of graded sparsity, blurred by noise (several optima)."""
    rng = np.random.default_rng(seed)
    S = np.stack([rng.standard_normal(D) * (rng.random(D) < p) + 0.3 * rng.standard_normal(D)
                  for p in np.linspace(0.1, 0.5, R)], 1)
    S = (S - S.mean(0)) / S.std(0)
    X = S @ rng.standard_normal((R, R)) + noise * rng.standard_normal((D, R))
    return np.linalg.svd(X, full_matrices=False)[0], np.linspace(2.0, 1.0, R), S


def _recovery(maps, S) -> float:
    return float(np.mean(np.abs(match_components(maps, S)[1])))


def test_restarts_deterministic_given_the_public_seed():
    V, lam, _ = _planted(3)
    a, b = spatial_ica(V, lam, n_init=6, init_seed=5), spatial_ica(V, lam, n_init=6, init_seed=5)
    assert np.array_equal(a.maps, b.maps) and np.array_equal(a.W, b.W) and np.array_equal(a.scores, b.scores)
    # start i is the single run from init_seed + i
    for i in (0, 4):
        assert spatial_ica(V, lam, n_init=1, init_seed=5 + i).scores[0] == pytest.approx(a.scores[i], rel=1e-12)
    assert SPATIAL_ICA_RESTARTS > 1  # the product's default restarts


@pytest.mark.parametrize("select", ["sparsity", "contrast"])
def test_keeps_the_run_the_criterion_picks(select):
    V, lam, _ = _planted(17)
    r = spatial_ica(V, lam, n_init=8, select=select)
    assert len(np.unique(np.round(r.scores, 6))) > 1  # the starts reach different optima here
    best = r.scores.min() + 1e-6 * abs(r.scores.min())  # one optimum reached from several starts: a tie
    assert r.scores[r.kept] <= best and np.all(r.scores[:r.kept] > best)  # the earliest of the best
    # the returned maps are the kept run's (gone on towards the polishing tolerance, as a single run does)
    np.testing.assert_array_equal(r.maps, spatial_ica(V, lam, n_init=1, init_seed=r.kept, select=select).maps)
    M = (r.maps - r.maps.mean(0)) / r.maps.std(0)
    score = (np.abs(M).sum(0).max() if select == "sparsity"
             else -np.sum((np.mean(np.log(np.cosh(M)), 0) - 0.3745672075) ** 2))
    assert score == pytest.approx(r.scores.min(), rel=1e-3)  # scored where the run stopped, at tol
    assert r.stability.shape == (V.shape[1],) and np.all((r.stability > 0) & (r.stability <= 1 + 1e-9))


@pytest.mark.slow  # 3,400 FastICA runs: about a minute
def test_restarts_make_the_maps_independent_of_the_public_start():
    # What lets private maps converge to the non-private ones (benchmarks/stable_ica.py): the kept run does not
    # depend on which public starts were used. 40 fixed problems, starts from seed 0 against seed 1000; measured
    # with scikit-learn 1.9.1 at the default tolerance: one run gives different maps on 12 problems (mean |r|
    # 0.979 between the two), the default 20 starts on 6 (0.994; the same 6 at tol 1e-12), 4 of them problems
    # whose kept runs oscillate without converging at any tolerance. On these planted sources restarts neither
    # help nor hurt recovery of the sources themselves (0.785 and 0.789), so that is not asserted.
    def start_dependent(n_init):
        agree = []
        for seed in range(40):
            V, lam, _ = _planted(seed)
            a = spatial_ica(V, lam, n_init=n_init, init_seed=0).maps
            b = spatial_ica(V, lam, n_init=n_init, init_seed=1000).maps
            agree.append(_recovery(a, b))
        return int(np.sum(np.array(agree) < 0.999)), float(np.mean(agree))

    single, stable = start_dependent(1), start_dependent(SPATIAL_ICA_RESTARTS)
    assert stable[0] <= single[0] / 2 and stable[1] > single[1]


@pytest.mark.parametrize("seed", [0, 1, 2, 3, 5, 6, 7, 8])  # 4 and 9: some starts do not converge at 1e-10
def test_the_default_tolerance_keeps_the_maps_of_a_much_tighter_one(seed):
    # measured: at 1e-6 the kept maps matched 1e-12's on every basis tried (|r| >= 0.9995, 1.000000 once the kept
    # run is polished); at 1e-4 not (0.885 here on seed 7: a start that stopped early won the selection)
    V, lam, _ = _planted(seed)
    tight = spatial_ica(V, lam, tol=1e-10)
    assert tight.n_converged == SPATIAL_ICA_RESTARTS
    r = spatial_ica(V, lam)
    assert SPATIAL_ICA_TOL > 1e-10 and r.n_converged == SPATIAL_ICA_RESTARTS
    assert _recovery(r.maps, tight.maps) >= 0.999


def test_every_start_converges_where_a_tighter_tolerance_met_the_rounding_floor():
    # measured: at the former tol 1e-12, start 12 stalls at 1.4e-12 and runs to max_iter (19 of 20 converge)
    V, lam, _ = _planted(15)
    r = spatial_ica(V, lam)
    assert r.status == "converged" and r.n_converged == SPATIAL_ICA_RESTARTS


def test_rejects_bad_settings():
    V, lam, _ = _planted(0)
    with pytest.raises(ValueError, match="n_init"):
        spatial_ica(V, lam, n_init=0)
    with pytest.raises(ValueError, match="select"):
        spatial_ica(V, lam, select="kurtosis")


# -- random-matrix post-processing ---------------------------------------------------------------------------

def test_wigner_edge_matches_the_products_symmetric_noise():
    """Largest eigenvalue of dpneuro's symmetric release noise (off-diagonal std tau / sqrt 2) at the edge."""
    from dpneuro.privacy import PrivacyLedger
    from dpneuro.privacy.noise import gaussian

    D, tau = 400, 0.01
    rng = np.random.default_rng(0)
    edge = rmt.wigner_edge(tau / math.sqrt(2), D)
    for _ in range(10):
        E = gaussian(rng, (D, D), tau, PrivacyLedger(), symmetric=True)
        top = np.linalg.eigvalsh(E)[[0, -1]]
        assert abs(top[1] / edge - 1) < 0.05 and abs(-top[0] / edge - 1) < 0.05


def test_spiked_wigner_debias_and_overlap():
    D, sigma = 400, 1.0
    rng = np.random.default_rng(1)
    thr = rmt.detection_threshold(sigma, D)
    thetas = np.array([4.0, 2.5, 1.6, 0.5]) * thr  # three spikes above the threshold, one below
    U = np.linalg.qr(rng.standard_normal((D, len(thetas))))[0]
    obs, ovl = [], []
    for _ in range(5):
        G = rng.standard_normal((D, D)) * sigma
        E = (G + G.T) / math.sqrt(2)  # off-diagonal std sigma
        lam, vec = np.linalg.eigh((U * thetas) @ U.T + E)
        obs.append(lam[::-1][:4])
        ovl.append((U.T @ vec[:, ::-1][:, :3]).diagonal() ** 2)
    lam = np.median(obs, axis=0)
    assert rmt.components_above_edge(lam, sigma, D) == 3
    debiased = rmt.debias_eigenvalues(lam[:3], sigma, D)
    assert np.all(np.abs(debiased / thetas[:3] - 1) < 0.05)  # raw: 1.06-1.39 times theta
    assert np.all(np.abs(lam[:3] / thetas[:3] - 1) > 0.05)
    assert np.allclose(np.median(ovl, axis=0), rmt.eigenvector_overlap(thetas[:3], sigma, D), atol=0.06)
    assert rmt.eigenvector_overlap([thetas[3]], sigma, D)[0] == 0.0
    # below the edge: the detection threshold, continuous at the edge
    assert rmt.debias_eigenvalues([0.5 * rmt.wigner_edge(sigma, D)], sigma, D)[0] == pytest.approx(thr)
    assert rmt.debias_eigenvalues([rmt.wigner_edge(sigma, D) * (1 + 1e-9)], sigma, D)[0] == pytest.approx(thr, rel=1e-3)


def test_post_processing_reads_released_values_and_public_facts_only(monkeypatch):
    """Their inputs are released eigenvalues/basis, the public noise std, D and public settings; no file access."""
    allowed = {"eigenvalues", "spikes", "noise_std", "dim"}
    for fn in (rmt.wigner_edge, rmt.detection_threshold, rmt.components_above_edge, rmt.debias_eigenvalues,
               rmt.eigenvector_overlap):
        assert set(inspect.signature(fn).parameters) <= allowed, fn.__name__
    assert set(inspect.signature(spatial_ica).parameters) == {"basis", "eigenvalues", "max_iter", "tol",
                                                              "init_seed", "n_init", "select"}

    import builtins

    real_open = builtins.open

    def refuse(*a, **k):
        if a[:1] == ("/proc/self/maps",):  # threadpoolctl listing the loaded BLAS (one thread for the fits)
            return real_open(*a, **k)
        raise AssertionError("post-processing opened a file")

    V, lam, _ = _planted(2, D=60, R=4)
    monkeypatch.setattr("builtins.open", refuse)
    monkeypatch.setattr(np, "load", refuse)
    spatial_ica(V, lam, n_init=3)
    rmt.debias_eigenvalues(lam, 0.01, 60)
    rmt.components_above_edge(lam, 0.01, 60)


def test_planner_reports_the_random_matrix_view():
    from dpneuro.run.expectations import random_matrix_line, reference_spectrum

    spec = reference_spectrum("subspace", 20)
    # off-diagonal std 0.0024 at D = 122 (4 x 100 subjects, eps 1): edge 0.053, 9 reference eigenvalues detectable
    line = random_matrix_line(0.0024, 122, spec, 20)
    assert "edge 2 sigma sqrt(D) = 0.053" in line
    assert f"(BBP): {sum(v > 0.0024 * math.sqrt(122) for v in spec)} of the reference" in line
    assert "overlap ~0.00" in line


def test_subspace_ceilings_bound_every_rotation_of_the_basis():
    """benchmarks/strong_privacy.py's ceilings: no rotation of a basis (so no spatial ICA of it) agrees more."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from strong_privacy import subspace_ceilings

    rng = np.random.default_rng(0)
    D, R = 150, 6
    V, lam, S = _planted(4, D=D, R=R)
    Z = _whiten(V)[0]  # the ICA's whitened basis: centred, uncorrelated unit-variance columns
    rotated = Z @ np.linalg.qr(rng.standard_normal((R, R)))[0]
    assert subspace_ceilings(V, rotated) == pytest.approx((1.0, 1.0), abs=1e-10)
    # maps in the span that no rotation gives at once (they are correlated): each alone is reachable
    mixed = V @ rng.standard_normal((R, R))
    per_map, rotation = subspace_ceilings(V, mixed)
    assert per_map == pytest.approx(1.0, abs=1e-10) and rotation < 0.97
    # centred references at angle theta to the centred span: the per-map ceiling is cos(theta)
    Q, _ = np.linalg.qr(np.column_stack([V - V.mean(0), np.ones(D)]))
    W = rng.standard_normal((D, R))
    W -= Q @ (Q.T @ W)  # orthogonal to the span and to constants
    W /= np.linalg.norm(W, axis=0)
    inside = Q[:, :R] @ rng.standard_normal((R, R))
    inside /= np.linalg.norm(inside, axis=0)
    theta = np.linspace(0.2, 1.2, R)
    ref = inside * np.cos(theta) + W * np.sin(theta)
    assert subspace_ceilings(V, ref)[0] == pytest.approx(float(np.mean(np.cos(theta))), abs=1e-10)
    assert subspace_ceilings(V, W) == pytest.approx((0.0, 0.0), abs=1e-10)
    # every rotation of the basis, and its spatial ICA, stays at or below the rotation ceiling of noisy
    # references, which the best rotation reaches
    noisy = S + 1.5 * rng.standard_normal(S.shape)
    per_map, rotation = subspace_ceilings(V, noisy)
    assert 0.3 < rotation <= per_map < 0.9
    rotations = [np.linalg.qr(rng.standard_normal((R, R)))[0] for _ in range(50)]
    got = [_recovery(Z @ U, noisy) for U in rotations] + [_recovery(spatial_ica(V, lam, n_init=3).maps, noisy)]
    assert max(got) <= rotation + 1e-12
    C = Z.T @ ((noisy - noisy.mean(0)) / noisy.std(0)) / D
    u, _, vt = np.linalg.svd(C)
    assert _recovery(Z @ (u @ vt), noisy) == pytest.approx(rotation, abs=1e-10)
