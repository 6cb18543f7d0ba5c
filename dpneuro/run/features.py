"""The run's grid and its features: what the analysis sees of a voxel (an atlas's region or map, a
coordinate parcel, or the voxel itself) and how many features D that makes.

The space stage reduces the data with :func:`feature_labels`; the budget planner, the reduction's
refusals and the estimators count D with :func:`features`, without reading any data.
"""

from __future__ import annotations

import numpy as np

from dpneuro.config import RunConfig
from dpneuro.data.atlases import atlas_image
from dpneuro.data.parcellation import atlas_basis, atlas_labels, coordinate_parcels, is_probabilistic


def _atlas_features(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray, str]:
    atlas = atlas_image(cfg.atlas, mask, affine)
    if is_probabilistic(atlas):
        return atlas_basis(atlas, mask, affine), "basis"
    return atlas_labels(atlas, mask, affine)[0], "orthonormal"


def feature_labels(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray | None, str]:
    """The run's features on its grid and how voxels become them: a label atlas's regions (labels,
    "orthonormal"), a probabilistic atlas's maps (an orthonormal basis of their span, "basis"), coordinate parcels
    (labels, "mean"), or voxels (None)."""
    if cfg.atlas:
        return _atlas_features(cfg, mask, affine)
    if cfg.parcels:
        return coordinate_parcels(mask, cfg.parcels, seed=0), "mean"
    return None, ""


def features(cfg: RunConfig, given: int | None = None) -> int:
    """Features D after reduction: ``given``, else the atlas's regions, the parcels or the voxels of the run's grid."""
    if given is not None:
        return int(given)
    mask, affine = cfg.grid()
    if cfg.atlas:
        found, weighting = _atlas_features(cfg, mask, affine)
        # a basis has a column per direction; labels number the regions 0..n-1 (-1: in none)
        return int(found.shape[1]) if weighting == "basis" else int(found.max()) + 1
    n_vox = int(mask.sum())
    return min(cfg.parcels, n_vox) if cfg.parcels else n_vox
