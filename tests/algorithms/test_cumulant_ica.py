"""Cumulant ICA: the statistics, the refinement, the separation, its two releases and their worst cases."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpneuro.algorithms.cumulant_ica import (
    REFINE_SHARE,
    CapeCumulantICA,
    cape_cumulant_ica,
    contrast,
    default_clips,
    gaussian_part_of,
    polish_directions,
    power_directions,
    separate,
    subject_cumulant,
    subject_second_moment,
    symmetrize4,
)
from dpneuro.algorithms.metrics import qngi
from dpneuro.privacy import noise_multiplier
from dpneuro.protocol.cape.packing import pack_weighted

DELTA = 1e-5


def _mixed(R=4, S=3, subjects=6, T=400, seed=0):
    """Heavy-tailed (Laplace) sources, whitened by an orthogonal mixing, split over sites and subjects."""
    rng = np.random.default_rng(seed)
    A = np.linalg.qr(rng.standard_normal((R, R)))[0]
    sites = [A @ (rng.laplace(size=(R, subjects * T)) / math.sqrt(2)) for _ in range(S)]
    return A, sites, [subjects] * S


def test_subject_cumulant_is_the_fourth_moment_minus_its_own_gaussian_part_and_clips():
    rng = np.random.default_rng(1)
    Y = rng.standard_normal((3, 50)) * np.array([[0.5], [1.0], [2.0]])
    C = subject_cumulant(Y)
    S = Y @ Y.T / 50
    for i, j, k, l in itertools.product(range(3), repeat=4):
        m4 = np.mean(Y[i] * Y[j] * Y[k] * Y[l])
        g = S[i, j] * S[k, l] + S[i, k] * S[j, l] + S[i, l] * S[j, k]
        assert C[3 * i + j, 3 * k + l] == pytest.approx(m4 - g, abs=1e-12)
    assert np.linalg.norm(subject_cumulant(Y, clip=0.5)) == pytest.approx(0.5, rel=1e-12)
    np.testing.assert_allclose(subject_second_moment(Y), S, atol=1e-15)
    assert np.linalg.norm(subject_second_moment(Y, clip=0.5)) == pytest.approx(0.5, rel=1e-12)
    # white Gaussian data have no cumulant (it vanishes as n grows), and with its own covariance subtracted the
    # cumulant follows any linear map exactly, so Gaussian data of any covariance have none either
    big = rng.standard_normal((3, 400_000))
    assert np.abs(subject_cumulant(big)).max() < 0.05
    L = rng.standard_normal((3, 3))
    np.testing.assert_allclose(subject_cumulant(L @ Y), np.kron(L, L) @ subject_cumulant(Y) @ np.kron(L, L).T,
                               atol=1e-10)
    G = gaussian_part_of(np.eye(2))
    assert G[0, 0] == 3 and G[1, 1] == 1 and G[0, 3] == 1


def test_default_clips_are_the_rms_norms_of_a_white_gaussian_subject():
    R, n = 4, 60
    rng = np.random.default_rng(2)
    Ys = [rng.standard_normal((R, n)) for _ in range(3000)]
    c, B = default_clips(R, n)
    rms_S = math.sqrt(np.mean([np.linalg.norm(subject_second_moment(Y)) ** 2 for Y in Ys]))
    YY = [(Y[:, None, :] * Y[None, :, :]).reshape(R * R, n) for Y in Ys]
    rms_M4 = math.sqrt(np.mean([np.linalg.norm(a @ a.T / n - gaussian_part_of(np.eye(R))) ** 2 for a in YY]))
    assert rms_S == pytest.approx(c, rel=0.02)  # 3000 draws: the mean square's relative error is ~1 %
    assert rms_M4 == pytest.approx(B, rel=0.05)  # the fourth moment's heavier tail: ~3 %


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_noise_the_directions_are_the_mixing(seed):
    A, sites, subjects = _mixed(seed=seed)
    res = cape_cumulant_ica(sites, subjects, None, DELTA, clip=1e6, refine_clip=1e6, plan="none", random_state=seed)
    assert qngi(res.W @ A) < 0.05
    Z = np.hstack(sites)
    np.testing.assert_allclose(res.W @ (Z @ Z.T / Z.shape[1]) @ res.W.T, np.eye(4), atol=1e-10)  # white sources


def test_two_releases_compose_to_the_stages_budget_and_noise_degrades_gracefully():
    A, sites, subjects = _mixed(subjects=20, T=300, seed=3)
    res = cape_cumulant_ica(sites, subjects, 4.0, DELTA, clip=5.0, refine_clip=3.0, plan="cape", random_state=0)
    z = noise_multiplier(4.0, DELTA)
    for led in res.ledgers:
        rels = {r.name: r for r in led.releases}
        assert sorted(rels) == ["K4", "S2"] and all(r.count == 1 and r.stage == "cumulant-ica" for r in rels.values())
        assert rels["K4"].sensitivity == pytest.approx(2 * 5.0 / 20, rel=1e-12)  # 2 B n_max / N_s
        assert rels["S2"].sensitivity == pytest.approx(math.sqrt(2) * 3.0 / 20, rel=1e-12)  # sqrt(2) c n_max / N_s
        assert rels["S2"].noise_multiplier == pytest.approx(z / math.sqrt(REFINE_SHARE), rel=1e-12)
        assert rels["K4"].noise_multiplier == pytest.approx(z / math.sqrt(1 - REFINE_SHARE), rel=1e-12)
        assert led.epsilon(DELTA, collusion=False) == pytest.approx(4.0, rel=1e-6)  # exactly the stage's eps
    assert qngi(res.W @ A) < 0.2
    weak = cape_cumulant_ica(sites, subjects, 0.05, DELTA, clip=5.0, plan="cape", random_state=0)
    assert qngi(weak.W @ A) > qngi(res.W @ A)
    one = cape_cumulant_ica(sites, subjects, 4.0, DELTA, clip=5.0, refine_share=0, plan="cape", random_state=0)
    assert [r.name for r in one.ledgers[0].releases] == ["K4"]
    assert one.ledgers[0].releases[0].noise_multiplier == pytest.approx(z, rel=1e-12)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_refinement_whitens_what_the_pca_left_unwhite(seed):
    """Data whitened with wrong variances (covariance eigenvalues 0.3-2.5, as after a private PCA): without
    noise the refined run separates them, the run without refinement does not, and W unmixes the given data."""
    A, sites, subjects = _mixed(subjects=10, T=400, seed=seed)
    D = np.diag([0.55, 0.8, 1.2, 1.6])
    off = [D @ Z for Z in sites]
    refined = cape_cumulant_ica(off, subjects, None, DELTA, clip=1e6, refine_clip=1e6, plan="none",
                                random_state=seed)
    plain = cape_cumulant_ica(off, subjects, None, DELTA, clip=1e6, refine_share=0, plan="none", random_state=seed)
    assert qngi(refined.W @ D @ A) < 0.05
    assert qngi(plain.W @ D @ A) > 2 * qngi(refined.W @ D @ A)


def test_replace_worst_case_is_the_recorded_sensitivity():
    """Subject 0 replaced by each candidate: the largest change of the release, in the Frobenius norm the noise
    is calibrated to, stays within 2 B n / N, and clipped opposite extremes come close to it."""
    R, T, B = 2, 4, 0.8
    rng = np.random.default_rng(5)
    base = [rng.standard_normal((R, T)) for _ in range(3)]
    alg = CapeCumulantICA(R, 1.0, DELTA, clip=B, refine_share=0, random_state=0)
    lengths = [T] * 3
    recorded = alg.site_releases(alg.site_init(0, (np.hstack(base), lengths)))["K4"].sensitivity
    cands = [np.tile(np.array([[a], [b]]) * s, (1, T)) for a, b in ((1, 0), (0, 1), (1, 1), (1, -1)) for s in (0.1, 3)]
    # a constant subject has a negative cumulant, one spike a positive one: opposite extremes along (0000)
    cands += [np.hstack([np.array([[a], [b]]) * s, np.zeros((R, T - 1))])
              for a, b in ((1, 0), (0, 1)) for s in (0.1, 3)]
    cands += [rng.standard_normal((R, T)) for _ in range(20)]
    vals = []
    for c in cands:
        blocks = [c] + base[1:]
        st = alg.site_init(0, (np.hstack(blocks), lengths))
        vals.append(pack_weighted(alg.site_compute(st, 0, None)["K4"]))
    worst = max(np.linalg.norm(a - b) for a, b in itertools.combinations(vals, 2))
    assert recorded == pytest.approx(2 * B * T / (3 * T), rel=1e-12)
    assert worst <= recorded * (1 + 1e-9)
    assert worst > 0.9 * recorded


def test_refinement_replace_worst_case_is_the_recorded_sensitivity():
    """Subject 0 replaced by each candidate: the second-moment release moves by at most sqrt(2) c n / N (PSD
    terms), attained by clipped terms on orthogonal directions."""
    R, T, c = 2, 4, 0.7
    rng = np.random.default_rng(6)
    base = [rng.standard_normal((R, T)) for _ in range(3)]
    alg = CapeCumulantICA(R, 1.0, DELTA, refine_clip=c, random_state=0)
    lengths = [T] * 3
    recorded = alg.site_releases(alg.site_init(0, (np.hstack(base), lengths)))["S2"].sensitivity
    cands = [np.tile(np.array([[a], [b]]) * s, (1, T)) for a, b in ((1, 0), (0, 1), (1, 1), (1, -1)) for s in (0.1, 3)]
    cands += [rng.standard_normal((R, T)) for _ in range(20)]
    vals = [pack_weighted(alg.site_compute(alg.site_init(0, (np.hstack([x] + base[1:]), lengths)), 0, None)["S2"])
            for x in cands]
    worst = max(np.linalg.norm(a - b) for a, b in itertools.combinations(vals, 2))
    assert recorded == pytest.approx(math.sqrt(2) * c / 3, rel=1e-12)
    assert worst <= recorded * (1 + 1e-9)
    assert worst > 0.99 * recorded


def _planted(R, k, seed):
    """sum_r k_r a_r^(x)4 for a random orthogonal A (columns a_r), as an R^2 x R^2 matrix."""
    A = np.linalg.qr(np.random.default_rng(seed).standard_normal((R, R)))[0]
    return A, sum(kr * np.einsum("i,j,k,l->ijkl", a, a, a, a) for kr, a in zip(k, A.T)).reshape(R * R, R * R)


def test_every_separator_finds_planted_orthogonal_directions_of_either_sign():
    R = 5
    A, T = _planted(R, [3.0, -2.0, 1.5, 1.0, -0.8], 7)
    assert qngi(power_directions(T, R, np.random.default_rng(0)) @ A) < 1e-6
    assert qngi(separate(T, R, np.random.default_rng(0)) @ A) < 1e-6
    # the refit from a start 0.2 away: the planted frame exactly (the parabola refines the angle grid),
    # where the contrast is its maximum sum_r k_r^2
    start = (A @ np.linalg.qr(np.eye(R) + 0.2 * np.random.default_rng(1).standard_normal((R, R)))[0]).T
    assert qngi(start @ A) > 0.1
    U = polish_directions(T, start)
    assert qngi(U @ A) < 1e-6
    assert contrast(T, U) == pytest.approx(3.0**2 + 2.0**2 + 1.5**2 + 1.0**2 + 0.8**2, rel=1e-9)
    np.testing.assert_allclose(U @ U.T, np.eye(R), atol=1e-12)


def test_the_joint_refit_beats_the_power_method_alone_under_noise():
    """20 planted tensors plus symmetrised Gaussian noise (R = 8, unit kurtoses, noise 0.2 per entry before
    symmetrising): the refit never lowers the contrast, and its directions are nearer the planted ones than the
    power method's on average (measured 0.064 against 0.098) and in most draws (measured 20 of 20)."""
    R, power_err, refit_err, wins = 8, [], [], 0
    for d in range(20):
        A, T = _planted(R, np.ones(R), 100 + d)
        K = T + 0.2 * symmetrize4(np.random.default_rng(200 + d).standard_normal((R * R, R * R)), R)
        U0 = power_directions(K, R, np.random.default_rng(d))
        U = separate(K, R, np.random.default_rng(d))  # the refit of U0: the same restarts
        assert contrast(K, U) >= contrast(K, U0)
        power_err.append(qngi(U0 @ A))
        refit_err.append(qngi(U @ A))
        wins += refit_err[-1] < power_err[-1]
    assert np.mean(refit_err) < 0.85 * np.mean(power_err)
    assert wins >= 15


def test_refusals():
    with pytest.raises(ValueError, match="clip"):
        CapeCumulantICA(3, 1.0, DELTA, clip=0)
    with pytest.raises(ValueError, match="refine_clip"):
        CapeCumulantICA(3, 1.0, DELTA, refine_clip=math.inf)
    for share in (1.0, -0.1, True):
        with pytest.raises(ValueError, match="refine_share"):
            CapeCumulantICA(3, 1.0, DELTA, refine_share=share)
    A, sites, subjects = _mixed()
    with pytest.raises(ValueError, match="finite epsilon"):
        cape_cumulant_ica(sites, subjects, None, DELTA, clip=1.0)
    with pytest.raises(ValueError, match="4 x N"):
        cape_cumulant_ica([sites[0]] + [s[:3] for s in sites[1:]], subjects, 1.0, DELTA, clip=1.0, plan="conv")


def test_distinguishing_attack_sees_the_calibrated_separation():
    """One site; subject 0 is one of two subjects whose clipped cumulants differ most. The likelihood-ratio
    statistic of the noisy release (in the coordinates its noise is iid in) has unit std in units of the
    recorded sigma, and the worlds sit ||Delta||_w / sigma apart, never more than Delta / sigma = 1 / z."""
    from dpneuro.protocol.cape import run_cape

    R, T, B = 2, 4, 0.8
    rng = np.random.default_rng(11)
    rest = [rng.standard_normal((R, T)) for _ in range(2)]
    spike = np.hstack([np.array([[3.0], [0.0]]), np.zeros((R, T - 1))])  # cumulant along (0000) > 0
    subject = [np.tile(np.array([[3.0], [0.0]]), (1, T)), spike]  # constant: < 0; both clipped to B
    worlds = [(np.hstack([s] + rest), [T] * 3) for s in subject]
    clean = []
    for w in worlds:
        alg = CapeCumulantICA(R, None, DELTA, clip=B, refine_share=0)
        clean.append(pack_weighted(alg.site_compute(alg.site_init(0, w), 0, None)["K4"]))
    u = clean[1] - clean[0]
    n_draws, stats_ = 400, [[], []]
    for i in range(n_draws):
        for j, w in enumerate(worlds):
            res = run_cape(CapeCumulantICA(R, 2.0, DELTA, clip=B, refine_share=0, random_state=2 * i + j), [w], "conv")
            rel = res.sites[0]["ledger"].releases[0]
            stats_[j].append(float((pack_weighted(res.aggregator["K4"]) - clean[0]) @ u / np.linalg.norm(u)
                                   / rel.sigma))
    a, b = np.array(stats_[0]), np.array(stats_[1])
    se = math.sqrt(2 / n_draws)
    assert np.std(a) == pytest.approx(1.0, rel=0.1) and np.std(b) == pytest.approx(1.0, rel=0.1)
    predicted = np.linalg.norm(u) / rel.sigma
    assert predicted <= rel.sensitivity / rel.sigma * (1 + 1e-9)
    assert predicted > 0.8 * rel.sensitivity / rel.sigma
    assert abs((b.mean() - a.mean()) - predicted) < 4 * se


def test_the_cumulant_unmixing_reads_linearly_scaled_time_points():
    """Unit-norm time points flatten the amplitude fluctuations a cumulant reads: with ica_unmixing = "cumulant"
    the unmixing (and the time courses) get x / sqrt(D) whitened, every other run unit-norm time points."""
    from dpneuro.config import RunConfig
    from dpneuro.run.roles import site_whiten, unmixing_input

    rng = np.random.default_rng(4)
    D, R = 9, 3
    X = rng.standard_normal((D, 50)) * rng.uniform(0.2, 3.0, 50)  # time points of very different norms
    V = np.linalg.qr(rng.standard_normal((D, R)))[0]
    lam = np.array([0.5, 0.3, 0.2])
    white = (V / np.sqrt(lam)).T
    linear, unit = white @ (X / math.sqrt(D)), white @ (X / np.linalg.norm(X, axis=0))
    np.testing.assert_allclose(site_whiten(X, V, lam, linear=True), linear, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(site_whiten(X, V, lam), unit, rtol=1e-5, atol=1e-6)
    base = RunConfig.from_dict({"sites": [{"name": "a", "path": "."}], "out": ".", "ica": "temporal"})
    np.testing.assert_array_equal(unmixing_input(RunConfig.from_dict({**base.to_json(), "ica_unmixing": "cumulant"}),
                                                 X, V, lam), site_whiten(X, V, lam, linear=True))
    np.testing.assert_array_equal(unmixing_input(base, X, V, lam), site_whiten(X, V, lam))
