"""One-shot cumulant ICA: the cumulant, the separation, its one release and its worst case."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from dpneuro.algorithms.cumulant_ica import (CapeCumulantICA, cape_cumulant_ica, gaussian_part, power_directions,
                                             subject_cumulant)
from dpneuro.cape.packing import pack_weighted
from dpneuro.metrics import qngi

DELTA = 1e-5


def _mixed(R=4, S=3, subjects=6, T=400, seed=0):
    """Heavy-tailed (Laplace) sources, whitened by an orthogonal mixing, split over sites and subjects."""
    rng = np.random.default_rng(seed)
    A = np.linalg.qr(rng.standard_normal((R, R)))[0]
    sites = [A @ (rng.laplace(size=(R, subjects * T)) / math.sqrt(2)) for _ in range(S)]
    return A, sites, [subjects] * S


def test_subject_cumulant_is_the_fourth_moment_minus_the_gaussian_part_and_clips():
    rng = np.random.default_rng(1)
    Y = rng.standard_normal((3, 50))
    C = subject_cumulant(Y)
    for i, j, k, l in itertools.product(range(3), repeat=4):
        m4 = np.mean(Y[i] * Y[j] * Y[k] * Y[l])
        g = (i == j) * (k == l) + (i == k) * (j == l) + (i == l) * (j == k)
        assert C[3 * i + j, 3 * k + l] == pytest.approx(m4 - g, abs=1e-12)
    assert np.linalg.norm(subject_cumulant(Y, clip=0.5)) == pytest.approx(0.5, rel=1e-12)
    # the Gaussian part is what white Gaussian noise gives: its cumulant vanishes as n grows
    big = rng.standard_normal((3, 400_000))
    assert np.abs(subject_cumulant(big)).max() < 0.05
    assert gaussian_part(2)[0, 0] == 3 and gaussian_part(2)[1, 1] == 1 and gaussian_part(2)[0, 3] == 1


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_without_noise_the_directions_are_the_mixing(seed):
    A, sites, subjects = _mixed(seed=seed)
    res = cape_cumulant_ica(sites, subjects, None, DELTA, clip=1e6, plan="none", random_state=seed)
    assert qngi(res.W @ A) < 0.05
    assert np.allclose(res.W @ res.W.T, np.eye(4), atol=1e-10)


def test_one_release_at_the_runs_budget_and_noise_degrades_gracefully():
    A, sites, subjects = _mixed(subjects=20, T=300, seed=3)
    res = cape_cumulant_ica(sites, subjects, 4.0, DELTA, clip=5.0, plan="cape", random_state=0)
    for led in res.ledgers:
        (rel,) = led.releases
        assert (rel.name, rel.count, rel.stage) == ("K4", 1, "cumulant-ica")
        assert rel.sensitivity == pytest.approx(2 * 5.0 / 20, rel=1e-12)  # 2 B n_max / N_s
        assert led.epsilon(DELTA, collusion=False) <= 4.0 * (1 + 1e-9)
    assert qngi(res.W @ A) < 0.2
    weak = cape_cumulant_ica(sites, subjects, 0.05, DELTA, clip=5.0, plan="cape", random_state=0)
    assert qngi(weak.W @ A) > qngi(res.W @ A)


def test_replace_worst_case_is_the_recorded_sensitivity():
    """Subject 0 replaced by each candidate: the largest change of the release, in the Frobenius norm the noise
    is calibrated to, stays within 2 B n / N, and clipped opposite extremes come close to it."""
    R, T, B = 2, 4, 0.8
    rng = np.random.default_rng(5)
    base = [rng.standard_normal((R, T)) for _ in range(3)]
    alg = CapeCumulantICA(R, 1.0, DELTA, clip=B, seed=0)
    lengths = [T] * 3
    recorded = alg.site_releases(alg.site_init(0, (np.hstack(base), lengths)))["K4"].sensitivity
    cands = [np.tile(np.array([[a], [b]]) * s, (1, T)) for a, b in ((1, 0), (0, 1), (1, 1), (1, -1)) for s in (0.1, 3)]
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


def test_power_directions_finds_planted_orthogonal_directions():
    R = 5
    rng = np.random.default_rng(7)
    A = np.linalg.qr(rng.standard_normal((R, R)))[0]
    k = np.array([3.0, -2.0, 1.5, 1.0, -0.8])
    T = sum(kr * np.einsum("i,j,k,l->ijkl", a, a, a, a) for kr, a in zip(k, A.T)).reshape(R * R, R * R)
    W = power_directions(T, R, np.random.default_rng(0))
    assert qngi(W @ A) < 1e-6


def test_refusals():
    with pytest.raises(ValueError, match="clip"):
        CapeCumulantICA(3, 1.0, DELTA, clip=0)
    A, sites, subjects = _mixed()
    with pytest.raises(ValueError, match="finite epsilon"):
        cape_cumulant_ica(sites, subjects, None, DELTA, clip=1.0)
    with pytest.raises(ValueError, match="4 x N"):
        cape_cumulant_ica([sites[0]] + [s[:3] for s in sites[1:]], subjects, 1.0, DELTA, clip=1.0, plan="conv")


def test_distinguishing_attack_sees_the_calibrated_separation():
    """One site; subject 0 is one of two subjects whose clipped cumulants differ most. The likelihood-ratio
    statistic of the noisy release (in the coordinates its noise is iid in) has unit std in units of the
    recorded sigma, and the worlds sit ||Delta||_w / sigma apart, never more than Delta / sigma = 1 / z."""
    from dpneuro.cape import run_cape

    R, T, B = 2, 4, 0.8
    rng = np.random.default_rng(11)
    rest = [rng.standard_normal((R, T)) for _ in range(2)]
    subject = [np.tile(np.array([[3.0], [0.0]]), (1, T)), np.tile(np.array([[0.0], [0.1]]), (1, T))]
    worlds = [(np.hstack([s] + rest), [T] * 3) for s in subject]
    clean = []
    for w in worlds:
        alg = CapeCumulantICA(R, None, DELTA, clip=B)
        clean.append(pack_weighted(alg.site_compute(alg.site_init(0, w), 0, None)["K4"]))
    u = clean[1] - clean[0]
    n_draws, stats_ = 400, [[], []]
    for i in range(n_draws):
        for j, w in enumerate(worlds):
            res = run_cape(CapeCumulantICA(R, 2.0, DELTA, clip=B, seed=2 * i + j), [w], "conv")
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
