"""Data-independent dimension reduction: parcels from voxel coordinates, or an atlas's regions or maps.

Subject-level privacy makes noise scale with the number of features, so the
consortium may agree to reduce voxels to regions first. A parcellation computed
from the mask's coordinates alone (k-means on voxel positions) or a label atlas
the consortium supplies never looks at anybody's data and so costs no privacy.
Maps are painted back to voxels at the end.

Coordinate parcels are averaged. An atlas's regions are the coefficients of
each volume on the unit-norm region indicators (the region's sum over
sqrt(its voxels)): the features' second moment is then the voxels' second
moment restricted to maps constant on each region, so a region weighs as
much as its voxels do in a voxel-level analysis (CanICA, MELODIC) and the
maps come back as they would from the voxels when the signal is constant on
regions. On real fMRI painted from the MIST 122 atlas, the coefficients'
maps agree with CanICA's (unthresholded) at 0.86, region averages at 0.73
(benchmarks/canica_agreement.py; the averages in a prototype). A
probabilistic atlas (4-D maps) gives the coordinates on an orthonormal basis
of its maps' span, the same geometry for overlapping, graded maps.
"""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
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


def fill_uncovered(labels: np.ndarray, mask: np.ndarray, n_fill: int, *, seed: int = 0) -> np.ndarray:
    """Whole-brain labels from an atlas's (mask order, -1: in no region): the voxels no region covers (the
    cerebellum and subcortex for a cortical atlas) become up to ``n_fill`` coordinate parcels of their own,
    numbered after the atlas's regions. ``n_fill = 0`` leaves them out."""
    labels = np.asarray(labels, dtype=np.int64)
    rest = np.zeros(mask.shape, bool)
    rest[mask] = labels < 0
    n_rest = int(rest.sum())
    if n_fill <= 0 or n_rest == 0:
        return labels
    out = labels.copy()
    out[labels < 0] = int(labels.max()) + 1 + coordinate_parcels(rest, min(n_fill, n_rest), seed=seed)
    return out


def _atlas_image(atlas):
    img = nib.load(str(atlas)) if isinstance(atlas, (str, Path)) else atlas
    if len(img.shape) not in (3, 4):
        raise ValueError(f"atlas {atlas}: a 3-D label image or 4-D probabilistic maps are needed, got shape "
                         f"{img.shape}")
    if len(img.shape) == 4 and img.shape[3] == 1:
        img = nib.Nifti1Image(np.asarray(img.dataobj)[..., 0], img.affine, img.header)
    return img


def is_probabilistic(atlas) -> bool:
    """Whether ``atlas`` holds probabilistic maps (4-D, one volume per map) rather than labels (3-D)."""
    return len(_atlas_image(atlas).shape) == 4


def atlas_labels(atlas, mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, list[int]]:
    """The region of every in-mask voxel (mask order; -1: in no region) and the atlas values of the regions.

    ``atlas``: a 3-D label image (path or Niimg) at any resolution, put on the
    analysis grid by nilearn's nearest-neighbour resampling (labels are not
    interpolated). Regions that cover no voxel of the mask are dropped.
    """
    from nilearn.image import resample_img  # deferred: nilearn is slow to load

    img = _atlas_image(atlas)
    if len(img.shape) == 4:
        raise ValueError(f"atlas {atlas}: probabilistic maps (4-D), not labels; see atlas_basis")
    on_grid = resample_img(img, target_affine=affine, target_shape=mask.shape, interpolation="nearest",
                           force_resample=True, copy_header=True)
    values = np.asarray(on_grid.dataobj)[mask]
    if not np.all(np.isfinite(values)) or not np.allclose(values, np.round(values)):
        raise ValueError(f"atlas {atlas}: a label image holds integer region labels, got non-integer values")
    values = np.round(values).astype(np.int64)
    regions = sorted(int(v) for v in np.unique(values) if v != 0)
    if not regions:
        raise ValueError(f"atlas {atlas}: no region covers the analysis mask")
    labels = np.searchsorted(regions, values)
    labels[values == 0] = -1
    return labels.astype(np.int64), regions


def atlas_maps(atlas, mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """Probabilistic atlas maps on the analysis grid: in-mask voxels x maps (continuous resampling by nilearn);
    maps that vanish on the mask are dropped."""
    from nilearn.image import resample_img  # deferred: nilearn is slow to load

    img = _atlas_image(atlas)
    if len(img.shape) != 4:
        raise ValueError(f"atlas {atlas}: a label image (3-D), not probabilistic maps; see atlas_labels")
    on_grid = resample_img(img, target_affine=affine, target_shape=mask.shape, interpolation="continuous",
                           force_resample=True, copy_header=True)
    M = np.asarray(on_grid.dataobj, dtype=np.float64)[mask]
    if not np.all(np.isfinite(M)):
        raise ValueError(f"atlas {atlas}: non-finite values in its maps")
    M = M[:, np.abs(M).max(axis=0) > 0]
    if M.shape[1] == 0:
        raise ValueError(f"atlas {atlas}: no map covers the analysis mask")
    return M


def atlas_basis(atlas, mask: np.ndarray, affine: np.ndarray) -> np.ndarray:
    """An orthonormal basis (in-mask voxels x R) of the span of a probabilistic atlas's maps on the grid.

    The projection Q Q^T x is the least-squares fit of a volume by the maps
    (what nilearn's ``NiftiMapsMasker`` inverts), so the features Q^T x carry
    what the maps' coefficients carry; being orthonormal, their second moment is
    the voxels' restricted to the maps' span, as for a label atlas's regions.
    Directions the maps do not span independently (relative singular value
    below 1e-8) are dropped.
    """
    U, sv, _ = np.linalg.svd(atlas_maps(atlas, mask, affine), full_matrices=False)
    return np.ascontiguousarray(U[:, sv > sv[0] * 1e-8])


def space_parcels(space: dict) -> Parcellation | MapsBasis | None:
    """The feature reduction a run's space (``space.json`` of the pipeline) names, or None when it keeps voxels."""
    if not space.get("parcels"):
        return None
    if space.get("weighting") == "basis":
        return MapsBasis(np.load(space["parcels"]))
    return Parcellation(np.load(space["parcels"]), weighting=space.get("weighting", "mean"))


#: how a region's voxels become its feature: their mean (coordinate parcels) or their sum over sqrt(voxels), the
#: coefficient on the unit-norm indicator (an atlas's regions; module docstring)
WEIGHTINGS = ("mean", "orthonormal")


class Parcellation:
    """Reducing voxels to parcels and painting parcel values back to voxels.

    ``labels``: the parcel of every voxel (mask order), -1 for a voxel in no
    parcel (outside the atlas: left out of the features, 0 in the maps).
    """

    @property
    def n_voxels(self) -> int:
        return len(self.labels)

    @property
    def covered(self) -> np.ndarray:
        """Voxels in a parcel (the maps are 0 elsewhere)."""
        return self.labels >= 0

    def __init__(self, labels: np.ndarray, weighting: str = "mean"):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"weighting must be one of {WEIGHTINGS}, got {weighting!r}")
        self.labels = np.asarray(labels, dtype=np.int64)
        self.weighting = weighting
        inside = self.labels >= 0
        self.n_parcels = int(self.labels.max()) + 1
        self.sizes = np.bincount(self.labels[inside], minlength=self.n_parcels).astype(np.float64)
        if np.any(self.sizes == 0):
            raise ValueError(f"parcel(s) {np.flatnonzero(self.sizes == 0).tolist()} have no voxel")
        self._order = np.argsort(self.labels, kind="stable")[int(np.sum(~inside)):]  # voxels of parcels, by parcel
        self._starts = np.r_[0, np.cumsum(self.sizes).astype(np.int64)[:-1]]
        self._scale = self.sizes if weighting == "mean" else np.sqrt(self.sizes)

    def reduce(self, X: np.ndarray) -> np.ndarray:
        """Parcel features of a voxels x time matrix (D_voxels x N -> D_parcels x N)."""
        X = np.asarray(X)
        if X.shape[0] != len(self.labels):
            raise ValueError(f"data have {X.shape[0]} voxels, parcellation has {len(self.labels)}")
        sums = np.add.reduceat(X[self._order], self._starts, axis=0)
        return (sums / self._scale.reshape((-1,) + (1,) * (X.ndim - 1))).astype(X.dtype, copy=False)

    def expand(self, values: np.ndarray) -> np.ndarray:
        """Voxel values from parcel values (D_parcels [x K] -> D_voxels [x K]): painted, or for orthonormal
        features the combination of the unit-norm indicators they are the coefficients of; 0 outside every parcel."""
        values = np.asarray(values)
        if values.shape[0] != self.n_parcels:
            raise ValueError(f"values have {values.shape[0]} rows, parcellation has {self.n_parcels} parcels")
        if self.weighting == "orthonormal":
            values = values / np.sqrt(self.sizes).reshape((-1,) + (1,) * (values.ndim - 1))
        out = values[np.maximum(self.labels, 0)]
        out[self.labels < 0] = 0
        return out


class MapsBasis:
    """A probabilistic atlas's features: coordinates on an orthonormal basis Q of its maps' span (:func:`atlas_basis`).

    Same interface as :class:`Parcellation`: ``reduce`` gives Q^T x, ``expand``
    paints Q c back to voxels.
    """

    def __init__(self, basis: np.ndarray):
        self.basis = np.asarray(basis, dtype=np.float64)
        self.n_parcels = int(self.basis.shape[1])

    @property
    def n_voxels(self) -> int:
        return int(self.basis.shape[0])

    @property
    def covered(self) -> np.ndarray:
        """Voxels some map reaches (the maps are 0 elsewhere)."""
        return np.abs(self.basis).max(axis=1) > 0

    def reduce(self, X: np.ndarray) -> np.ndarray:
        """Coordinates of a voxels x time matrix on the basis (D_voxels x N -> R x N)."""
        X = np.asarray(X)
        if X.shape[0] != self.n_voxels:
            raise ValueError(f"data have {X.shape[0]} voxels, the atlas basis has {self.n_voxels}")
        return (self.basis.T @ X).astype(X.dtype, copy=False)

    def expand(self, values: np.ndarray) -> np.ndarray:
        """Voxel values of basis coordinates (R [x K] -> D_voxels [x K])."""
        values = np.asarray(values)
        if values.shape[0] != self.n_parcels:
            raise ValueError(f"values have {values.shape[0]} rows, the atlas basis has {self.n_parcels}")
        return self.basis @ values
