"""Which components stand above the privacy noise: the released spectrum against the noise's edge."""

import numpy as np
import pytest
from scipy.stats import ortho_group

from dpneuro.privacy.rmt import noise_edge, wigner_edge
from dpneuro.run.expectations import signal_components, signal_sentence


def _wigner(rng, D: int, sigma: float) -> np.ndarray:
    """A symmetric Gaussian matrix with off-diagonal std sigma (the released matrix's noise)."""
    G = rng.normal(scale=sigma, size=(D, D))
    return (G + G.T) / np.sqrt(2)


def _released(rng, D: int, K: int, sigma: float, spikes) -> np.ndarray:
    """The top K eigenvalues of a spiked release A + E (A: the spikes on random directions)."""
    U = np.linalg.qr(rng.normal(size=(D, len(spikes))))[0] if len(spikes) else np.zeros((D, 0))
    A = (U * np.asarray(spikes, float)) @ U.T
    return np.sort(np.linalg.eigvalsh(A + _wigner(rng, D, sigma)))[::-1][:K]


def test_pure_noise_rarely_shows_a_component_above_the_edge():
    """At the bare edge 2 sigma sqrt(D) about one pure-noise release in six shows an eigenvalue above it (the
    Tracy-Widom fluctuation); the noise edge keeps that near 1 %. 300 releases: binomial sd ~0.6 %."""
    rng = np.random.default_rng(0)
    D, sigma, n = 150, 0.01, 300
    top = np.array([_released(rng, D, 1, sigma, [])[0] for _ in range(n)])
    assert 0.06 < np.mean(top > wigner_edge(sigma, D)) < 0.35  # the bare edge is not enough
    assert np.mean(top > noise_edge(sigma, D)) <= 0.035
    W = np.eye(1)
    assert sum(signal_components([x], W, sigma, D)["n_signal"] for x in top) <= 0.035 * n


@pytest.mark.parametrize("seed", range(5))
def test_the_components_of_the_spikes_above_the_noise_are_the_signal(seed):
    """4 spikes well above the detection threshold sigma sqrt(D) among 10 components: the 4 components whose
    maps live in the spikes' directions are the signal, whatever the rotation within each block."""
    rng = np.random.default_rng(seed)
    D, K, sigma = 200, 10, 0.01
    thr = sigma * np.sqrt(D)
    lam = _released(rng, D, K, sigma, [6 * thr, 5 * thr, 4 * thr, 3 * thr])
    Q = np.zeros((K, K))
    Q[:4, :4], Q[4:, 4:] = ortho_group.rvs(4, random_state=seed), ortho_group.rvs(6, random_state=seed)
    perm = rng.permutation(K)
    W = Q[perm]  # rows: components; W^-1 = W^T, column k mixes the eigen-directions
    got = signal_components(lam, W, sigma, D)
    assert got["n_signal"] == 4
    assert np.array_equal(np.array(got["signal"]), perm < 4)
    assert np.allclose(got["share"], (perm < 4).astype(float))
    assert np.isclose(sum(got["share"]), 4.0)


def test_a_mixed_component_counts_by_its_share():
    """A W that mixes signal and noise directions: the m components with the largest shares are the signal."""
    lam = np.array([5.0, 4.0, 0.1, 0.1])
    c, s = np.cos(0.3), np.sin(0.3)
    W = np.array([[c, 0, s, 0], [0, 1, 0, 0], [-s, 0, c, 0], [0, 0, 0, 1]])  # rows 0 and 2 mix direction 0 and 2
    got = signal_components(lam, W, sigma := 0.01, 100)
    assert got["edge"] == pytest.approx(noise_edge(sigma, 100))
    assert got["signal"] == [True, True, False, False]
    assert got["share"] == pytest.approx([c**2, 1.0, s**2, 0.0])


def test_without_noise_every_component_is_signal_and_one_sentence_says_it():
    got = signal_components([3.0, 2.0, 1.0], np.eye(3), None, 50)
    assert got["signal"] == [True] * 3 and got["edge"] is None
    assert signal_sentence(got).startswith("All 3 components carry signal")
    noisy = signal_components([3.0, 0.01, 0.01], np.eye(3), 0.01, 50)
    text = signal_sentence(noisy, expected=2)
    assert text.startswith("1 of 3 components carry signal: 1 released eigenvalue stands above")
    assert "The other 2 are marked as noise" in text and "expected about 2" in text
    assert "expected about 3 on" in signal_sentence(noisy, expected=40)  # at most the components asked for
