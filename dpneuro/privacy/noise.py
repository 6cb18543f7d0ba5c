"""The one place where privacy noise is drawn.

Every Gaussian array a party adds for privacy comes from :func:`gaussian`, which
counts the draw in the party's ledger, and every release is recorded with
:meth:`PrivacyLedger.record`. Production runs seed their generator from OS
entropy (:func:`default_rng`); fixed seeds are for tests and simulations.
"""

from __future__ import annotations

import numpy as np

from dpneuro.privacy.ledger import PrivacyLedger

#: how a symmetric release's noise is shaped from draws on its unique entries (:mod:`dpneuro.protocol.cape.packing`)
SYMMETRIC_NOISE = ("symmetrized", "mirrored")


def check_symmetric_noise(how: str) -> str:
    if how not in SYMMETRIC_NOISE:
        raise ValueError(f"symmetric_noise must be one of {SYMMETRIC_NOISE}, got {how!r}")
    return how


def default_rng(random_state=None) -> np.random.Generator:
    """A Generator from ``random_state``: OS entropy for None, seeded by an int, a Generator as it is."""
    return np.random.default_rng(random_state)


def resolve_random_state(random_state=None, *, fresh: bool = False):
    """One integer seed (or None: OS entropy) from scikit-learn's ``random_state`` (None, an int or a Generator).

    A Generator is turned into a seed by one draw, so the run's noise still
    comes from per-site generators seeded from (seed, site). ``fresh=True``
    turns None into a new seed from OS entropy, for a generator of synthetic
    data that records its seed.
    """
    x = random_state
    if x is None and fresh:
        return int(np.random.SeedSequence().entropy)  # type: ignore[arg-type]  # an int when drawn from the OS
    if x is None or isinstance(x, np.random.SeedSequence):
        return x
    if isinstance(x, np.random.Generator):
        return int(x.integers(2**62))
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < 0:
        raise ValueError(f"random_state must be an int >= 0, a numpy Generator or None, got {x!r}")
    return int(x)


def gaussian(
    rng: np.random.Generator, shape, std: float, ledger: PrivacyLedger, *,
    symmetric: bool = False, symmetric_noise: str = "symmetrized", dtype=np.float64,
) -> np.ndarray:
    """Draw N(0, std^2) noise of ``shape`` and count the draw in ``ledger``.

    ``symmetric=True`` draws only the unique entries of a symmetric matrix
    (upper triangle incl. diagonal), so the noise matrix is symmetric as the
    quantity it protects. ``symmetric_noise`` says how
    (:data:`dpneuro.protocol.cape.packing.SYMMETRIC_NOISE`): "symmetrized" gives the
    off-diagonal entries std / sqrt(2) (the Gaussian mechanism on the whole
    matrix, then symmetrized), "mirrored" gives every unique entry std.
    """
    if not (std >= 0) or not np.isfinite(std):
        raise ValueError(f"noise std must be finite and >= 0, got {std}")
    shape = tuple(np.atleast_1d(shape)) if not isinstance(shape, tuple) else shape
    if not symmetric:
        ledger.draws += 1
        return (rng.standard_normal(shape) * std).astype(dtype, copy=False)
    check_symmetric_noise(symmetric_noise)
    if len(shape) < 2 or shape[-1] != shape[-2]:
        raise ValueError(f"symmetric noise needs a square trailing shape, got {shape}")
    ledger.draws += 1
    n = shape[-1]
    iu = np.triu_indices(n)
    batch = shape[:-2]
    vals = rng.standard_normal(batch + (len(iu[0]),)) * std
    # an entry off the diagonal stands for 2 (dpneuro.protocol.cape.packing.multiplicity)
    if symmetric_noise == "symmetrized":
        vals /= np.sqrt(np.where(iu[0] == iu[1], 1.0, 2.0))
    out = np.zeros(shape, dtype=np.float64)
    out[..., iu[0], iu[1]] = vals
    out[..., iu[1], iu[0]] = vals
    return out.astype(dtype, copy=False)


def vector_laplace(rng: np.random.Generator, dim: int, beta: float, ledger: PrivacyLedger) -> np.ndarray:
    """Draw b in R^dim from the density proportional to exp(-beta ||b||_2); count it in ``ledger``.

    The norm-based ("vector Laplace", K-norm) mechanism of Chaudhuri et al.
    (2011) used by AVN ([DP-OTD]): with beta = eps / Delta_2 it is pure eps-DP.
    Sampled exactly: the direction is uniform on the sphere S^{dim-1} and,
    since the density of r = ||b|| is proportional to r^{dim-1} exp(-beta r),
    the norm is Gamma(shape=dim, scale=1/beta). The release itself is pure
    eps-DP, which the Gaussian-only ledger cannot compose: the caller records
    it with :meth:`PrivacyLedger.note` and reports its eps separately.
    """
    if int(dim) != dim or dim < 1:
        raise ValueError(f"dim must be a positive integer, got {dim}")
    if not (beta > 0) or not np.isfinite(beta):
        raise ValueError(f"beta must be finite and > 0, got {beta}")
    ledger.draws += 1
    direction = rng.standard_normal(int(dim))
    direction /= np.linalg.norm(direction)
    return direction * rng.gamma(shape=float(dim), scale=1.0 / beta)
