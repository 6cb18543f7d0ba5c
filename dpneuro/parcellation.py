"""Data-independent dimension reduction: parcels from voxel coordinates only.

Subject-level privacy makes noise scale with the number of features, so the
consortium may agree to average voxels within parcels first. A parcellation
computed from the mask's coordinates alone (k-means on voxel positions, or an
atlas the consortium supplies) never looks at anybody's data and so costs no
privacy. Maps are painted back to voxels at the end.
"""

from __future__ import annotations

import numpy as np
from scipy.cluster.vq import kmeans2


def coordinate_parcels(mask: np.ndarray, n_parcels: int, *, seed: int = 0) -> np.ndarray:
    """Label every in-mask voxel (mask order) with one of ``n_parcels`` compact parcels.

    k-means on voxel indices with a fixed seed: deterministic, data-independent.
    Empty clusters are dropped, so labels are ``0 .. n - 1`` with n <= n_parcels.
    """
    coords = np.argwhere(mask).astype(np.float64)
    if not 1 <= n_parcels <= len(coords):
        raise ValueError(f"n_parcels must be in 1..{len(coords)} (mask voxels), got {n_parcels}")
    if n_parcels == len(coords):
        return np.arange(len(coords))
    rng = np.random.default_rng(seed)
    init = coords[rng.choice(len(coords), n_parcels, replace=False)]
    _, labels = kmeans2(coords, init, iter=30, minit="matrix", seed=seed)
    _, labels = np.unique(labels, return_inverse=True)  # drop empty clusters
    return labels.astype(np.int64)


def space_parcels(space: dict) -> Parcellation | None:
    """The parcellation a run's space (``space.json`` of the pipeline) names, or None when it keeps voxels."""
    return Parcellation(np.load(space["parcels"])) if space.get("parcels") else None


class Parcellation:
    """Averaging voxels into parcels and painting parcel values back to voxels."""

    def __init__(self, labels: np.ndarray):
        self.labels = np.asarray(labels, dtype=np.int64)
        self.n_parcels = int(self.labels.max()) + 1
        self.sizes = np.bincount(self.labels, minlength=self.n_parcels).astype(np.float64)
        order = np.argsort(self.labels, kind="stable")
        self._order = order
        self._starts = np.r_[0, np.cumsum(self.sizes).astype(np.int64)[:-1]]

    def reduce(self, X: np.ndarray) -> np.ndarray:
        """Parcel means of a voxels x time matrix (D_voxels x N -> D_parcels x N)."""
        X = np.asarray(X)
        if X.shape[0] != len(self.labels):
            raise ValueError(f"data have {X.shape[0]} voxels, parcellation has {len(self.labels)}")
        sums = np.add.reduceat(X[self._order], self._starts, axis=0)
        return (sums / self.sizes.reshape((-1,) + (1,) * (X.ndim - 1))).astype(X.dtype, copy=False)

    def expand(self, values: np.ndarray) -> np.ndarray:
        """Voxel values from parcel values (D_parcels [x K] -> D_voxels [x K])."""
        values = np.asarray(values)
        if values.shape[0] != self.n_parcels:
            raise ValueError(f"values have {values.shape[0]} rows, parcellation has {self.n_parcels} parcels")
        return values[self.labels]
