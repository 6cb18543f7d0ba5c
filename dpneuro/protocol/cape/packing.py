"""Unique-entry packing for symmetric arrays, and the noise a symmetric release gets.

Noise for a symmetric matrix or 3-way tensor is drawn on its unique entries
(i <= j, or i <= j <= k), so the noisy release is symmetric as the quantity it
protects. How the draws become the array's noise is :data:`SYMMETRIC_NOISE`:

- "symmetrized" (default): a unique entry that stands for m entries of the
  full array (m = 2 off the diagonal of a matrix; 3 or 6 in a 3-way tensor)
  gets the draw divided by sqrt(m). This is the Gaussian mechanism on
  w(A) = sqrt(m) * u(A), whose L2 norm is exactly ||A||_F (the sensitivities
  are Frobenius bounds), unscaled afterwards; equivalently, iid noise on every
  entry of the full array, then averaged over the index orders
  (post-processing). The same guarantee as "mirrored" with half the noise
  variance off the diagonal of a matrix: the covariance noise's spectral
  norm falls by sqrt(2).
- "mirrored": every unique entry gets the full std and is copied to its
  mirror images (the papers' mechanism; kept to reproduce their figures).
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

import numpy as np

from dpneuro.privacy.noise import SYMMETRIC_NOISE, check_symmetric_noise  # noqa: F401 - the shapes' names, read here


@lru_cache(maxsize=32)
def unique_indices(n: int, order: int) -> tuple[np.ndarray, ...]:
    """Index arrays of the unique entries of a symmetric ``order``-way n^order array."""
    if order == 1:
        return (np.arange(n),)
    if order == 2:
        return np.triu_indices(n)
    if order == 3:
        i, j, k = np.meshgrid(np.arange(n), np.arange(n), np.arange(n), indexing="ij")
        keep = (i <= j) & (j <= k)
        return i[keep], j[keep], k[keep]
    raise ValueError(f"symmetric packing supports order 1-3, got {order}")


@lru_cache(maxsize=32)
def multiplicity(n: int, order: int) -> np.ndarray:
    """How many entries of the full n^order array each unique entry stands for (packing order)."""
    idx = unique_indices(n, order)
    if order == 1:
        return np.ones(n)
    # the indices are sorted, so their distinct values are 1 + the steps between neighbours
    distinct = 1 + sum((idx[a] != idx[a + 1]).astype(int) for a in range(order - 1))
    return np.asarray({2: (1.0, 2.0), 3: (1.0, 3.0, 6.0)}[order])[distinct - 1]


def pack_weighted(arr: np.ndarray) -> np.ndarray:
    """w(A): the unique entries of a symmetric array times sqrt(multiplicity); ||w(A)||_2 = ||A||_F.

    The vector the "symmetrized" noise is calibrated on (:func:`noise_array` inverts the weighting).
    """
    arr = np.asarray(arr)
    return pack(arr, True) * np.sqrt(multiplicity(arr.shape[0], arr.ndim))


def noise_array(vec: np.ndarray, shape: tuple[int, ...], symmetric: bool, how: str = "symmetrized") -> np.ndarray:
    """The noise array of ``shape`` from iid draws on its packed entries (module docstring)."""
    if symmetric and check_symmetric_noise(how) == "symmetrized":
        vec = vec / np.sqrt(multiplicity(shape[0], len(shape)))
    return unpack(vec, shape, symmetric)


def n_unique(shape: tuple[int, ...], symmetric: bool) -> int:
    if not symmetric:
        return int(np.prod(shape, dtype=np.int64))
    _check_cube(shape)
    return len(unique_indices(shape[0], len(shape))[0])


def unpack(vec: np.ndarray, shape: tuple[int, ...], symmetric: bool) -> np.ndarray:
    """Array of ``shape`` from its packed entries (mirrored when symmetric)."""
    if not symmetric:
        return vec.reshape(shape)
    _check_cube(shape)
    out = np.empty(shape, dtype=vec.dtype)
    idx = unique_indices(shape[0], len(shape))
    for perm in set(permutations(range(len(shape)))):
        out[tuple(idx[p] for p in perm)] = vec
    return out


def pack(arr: np.ndarray, symmetric: bool) -> np.ndarray:
    if not symmetric:
        return arr.reshape(-1)
    return arr[unique_indices(arr.shape[0], arr.ndim)]


def _check_cube(shape):
    if len(shape) < 2 or len(set(shape)) != 1:
        raise ValueError(f"a symmetric array must have equal axes, got shape {shape}")
