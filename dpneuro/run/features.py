"""The run's grid and its features: what the analysis sees of a voxel (an atlas's region or map, a
coordinate parcel, or the voxel itself) and how many features D that makes.

The space stage reduces the data with :func:`feature_labels`; the budget planner, the reduction's
refusals and the estimators count D with :func:`features`, without reading any data.
"""

from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import numpy as np

from dpneuro.config import RunConfig
from dpneuro.data.atlases import atlas_image, is_atlas_name
from dpneuro.data.parcellation import (
    MapsBasis,
    Parcellation,
    atlas_basis,
    atlas_labels,
    coordinate_parcels,
    fill_uncovered,
    is_probabilistic,
)


class FeatureSet(NamedTuple):
    """The run's features on its grid: ``labels`` (or a basis), how voxels become them (``weighting``) and a
    sentence saying what they are (run.json, the report)."""

    labels: np.ndarray | None
    weighting: str
    description: str


def _atlas_features(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> FeatureSet:
    atlas = atlas_image(cfg.atlas, mask, affine)
    name = cfg.atlas if is_atlas_name(cfg.atlas) else Path(cfg.atlas).name
    if is_probabilistic(atlas):
        basis = atlas_basis(atlas, mask, affine)
        return FeatureSet(basis, "basis", f"atlas {name}: {basis.shape[1]} probabilistic maps (their span)")
    regions = atlas_labels(atlas, mask, affine)[0]
    labels = fill_uncovered(regions, mask, cfg.atlas_fill)
    n_regions, n_all, left = int(regions.max()) + 1, int(labels.max()) + 1, int(np.sum(regions < 0))
    text = f"atlas {name}: {n_regions} regions"
    if n_all > n_regions:
        text += f" and {n_all - n_regions} coordinate parcels of the {left} mask voxels it leaves out"
    elif left:
        text += f", {left} mask voxels in none (left out)"
    return FeatureSet(labels, "orthonormal", text)


def feature_set(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> FeatureSet:
    """The run's features on its grid: a label atlas's regions (labels, "orthonormal"; with ``atlas_fill``, plus
    coordinate parcels of the voxels it leaves out), a probabilistic atlas's maps (an orthonormal basis of their
    span, "basis"), coordinate parcels (labels, "mean"), or voxels (None)."""
    if cfg.atlas:
        return _atlas_features(cfg, mask, affine)
    if cfg.parcels:
        labels = coordinate_parcels(mask, cfg.parcels, seed=0)
        return FeatureSet(labels, "mean", f"{int(labels.max()) + 1} coordinate parcels")
    return FeatureSet(None, "", f"{int(mask.sum())} voxels")


def feature_labels(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> tuple[np.ndarray | None, str]:
    """The labels (or basis) and weighting of :func:`feature_set`."""
    found = feature_set(cfg, mask, affine)
    return found.labels, found.weighting


def features(cfg: RunConfig, given: int | None = None) -> int:
    """Features D after reduction: ``given``, else the atlas's regions, the parcels or the voxels of the run's grid."""
    if given is not None:
        return int(given)
    mask, affine = cfg.grid()
    if cfg.atlas:
        found, weighting, _ = _atlas_features(cfg, mask, affine)
        # a basis has a column per direction; labels number the regions 0..n-1 (-1: in none)
        return int(found.shape[1]) if weighting == "basis" else int(found.max()) + 1
    n_vox = int(mask.sum())
    return min(cfg.parcels, n_vox) if cfg.parcels else n_vox


def reducer(cfg: RunConfig, mask: np.ndarray, affine: np.ndarray) -> Parcellation | MapsBasis | None:
    """The run's features as an object that reduces voxels and paints features back (None: voxels)."""
    found, weighting = feature_labels(cfg, mask, affine)
    if found is None:
        return None
    return MapsBasis(found) if weighting == "basis" else Parcellation(found, weighting=weighting)
