"""Random-matrix facts about capePCA's released matrix: post-processing of released values and public noise.

capePCA's averaged release is A_hat = A + E with E symmetric Gaussian: off-diagonal
entries of std sigma, a std that is public (the ledgers hold every release's
sensitivity and noise std, the counts are public; :func:`dpneuro.run.expectations.expected_noise`
computes it). E is a scaled Wigner matrix, so its spectrum is known:

- its eigenvalues fill the semicircle on [-2 sigma sqrt(D), 2 sigma sqrt(D)]
  (:func:`wigner_edge`), the largest one within a few percent of the edge at D ~ 100s;
- a spike theta of A (an eigenvalue standing apart from the rest) leaves the
  bulk only when theta > sigma sqrt(D) (the BBP transition, :func:`detection_threshold`),
  and then appears at lambda = theta + sigma^2 D / theta, pushed up by the noise
  (:func:`debias_eigenvalues` inverts this), with its eigenvector at squared
  overlap 1 - sigma^2 D / theta^2 with the true one (:func:`eigenvector_overlap`).

Every function here takes released eigenvalues (or planned spikes), the public
noise std and D, and nothing else: any function of released values and public
facts is post-processing and costs no privacy (docs/privacy.md). A real fMRI
spectrum is not a few spikes on zero (its small eigenvalues form a bulk of
their own), so these are approximations for its top eigenvalues;
benchmarks/stable_ica.py measures how well they hold.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["TW1_99", "components_above_edge", "debias_eigenvalues", "detection_threshold", "eigenvector_overlap",
           "noise_edge", "wigner_edge"]

#: the 99th percentile of the Tracy-Widom (GOE) law of the largest eigenvalue's fluctuation (Tracy and Widom,
#: "On orthogonal and symplectic matrix ensembles", 1996; tabulated by Bejan, 2005: 2.0234)
TW1_99 = 2.0234


def _check(noise_std, dim) -> tuple[float, int]:
    s, d = float(noise_std), int(dim)
    if not (s >= 0 and math.isfinite(s)):
        raise ValueError(f"noise_std must be finite and >= 0, got {noise_std!r}")
    if d < 1 or d != dim:
        raise ValueError(f"dim must be a positive integer, got {dim!r}")
    return s, d


def wigner_edge(noise_std: float, dim: int) -> float:
    """2 sigma sqrt(D): the largest eigenvalue of a D x D symmetric noise matrix with off-diagonal std sigma."""
    s, d = _check(noise_std, dim)
    return 2.0 * s * math.sqrt(d)


def noise_edge(noise_std: float, dim: int) -> float:
    """Where the noise's own largest eigenvalue stays in 99 % of releases: the edge 2 sigma sqrt(D) plus the
    Tracy-Widom fluctuation's 99th percentile on its scale sigma D^(-1/6). At the bare edge a pure-noise release
    would show an eigenvalue above it about one time in six."""
    s, d = _check(noise_std, dim)
    return 2.0 * s * math.sqrt(d) + TW1_99 * s * d ** (-1.0 / 6.0)


def detection_threshold(noise_std: float, dim: int) -> float:
    """sigma sqrt(D): a spike of A above it leaves the noise's bulk (BBP); below it no eigenvector sees it."""
    s, d = _check(noise_std, dim)
    return s * math.sqrt(d)


def components_above_edge(eigenvalues, noise_std: float, dim: int) -> int:
    """How many released eigenvalues stand above the noise's edge: the components the noise allows."""
    lam = np.asarray(eigenvalues, np.float64)
    return int(np.sum(lam > wigner_edge(noise_std, dim)))


def debias_eigenvalues(eigenvalues, noise_std: float, dim: int) -> np.ndarray:
    """The spikes theta behind released eigenvalues lambda = theta + sigma^2 D / theta (the larger root).

    An eigenvalue at or below the edge 2 sigma sqrt(D) carries no detectable spike: it is mapped to the
    detection threshold sigma sqrt(D) (where the larger root meets the edge), so the map is continuous and
    non-decreasing.
    """
    lam = np.asarray(eigenvalues, np.float64)
    s, d = _check(noise_std, dim)
    c = s * s * d
    disc = np.maximum(lam * lam - 4.0 * c, 0.0)
    return np.where(lam > 2.0 * math.sqrt(c), (lam + np.sqrt(disc)) / 2.0, math.sqrt(c))


def eigenvector_overlap(spikes, noise_std: float, dim: int) -> np.ndarray:
    """Squared overlap |<v_hat, v>|^2 = 1 - sigma^2 D / theta^2 of each spike's noisy eigenvector (0 below
    the detection threshold)."""
    theta = np.asarray(spikes, np.float64)
    s, d = _check(noise_std, dim)
    with np.errstate(divide="ignore"):
        return np.where(theta > s * math.sqrt(d), 1.0 - s * s * d / np.maximum(theta, 1e-300) ** 2, 0.0)
