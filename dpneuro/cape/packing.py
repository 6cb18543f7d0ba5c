"""Unique-entry packing for symmetric arrays.

Noise for a symmetric matrix or 3-way tensor is drawn on its unique entries
(i <= j, or i <= j <= k) and mirrored, so the noisy release is symmetric as
the quantity it protects and each unique entry has the planned variance.
"""

from __future__ import annotations

from functools import lru_cache
from itertools import permutations

import numpy as np


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
