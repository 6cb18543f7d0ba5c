"""The consortium's components in network order, each named (:mod:`dpneuro.data.networks`).

The unmixing stage's aggregator orders and orients its result here, before
anything reads it: a component's row of W (and its offset b) moves to its
network's place and takes the sign that makes the map's heavier tail
positive. The maps, the time courses, the brain states and every site's own
files then share one order, and a deployment's sites receive it with W.
Everything here is a function of public results, so it costs no privacy.
"""

from __future__ import annotations

import csv
import functools
import os
from pathlib import Path

import numpy as np

from dpneuro.algorithms.djica import spatial_maps
from dpneuro.config import RunConfig, stage_fields
from dpneuro.data.networks import REGIONS, ComponentLabel, component_variances, name_components, network_order
from dpneuro.report.figures import zscore_columns
from dpneuro.run.features import reducer

__all__ = ["NOISE_NAME", "component_labels", "component_networks", "ordered_unmixing", "painted",
           "read_component_table", "write_component_table"]


@functools.lru_cache(maxsize=4)
def _features(space: tuple, mask_version: int):
    """The run's grid and features from its space settings (``space``: the space stage's fields and values;
    ``mask_version``: the mask file's modification time, so that a rewritten mask is read again)."""
    cfg = RunConfig(sites=[], out="", **dict(space))
    mask, affine = cfg.grid()
    return reducer(cfg, mask, affine), mask, affine


def _voxel_maps(cfg: RunConfig, basis, eigenvalues, W) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The maps on the run's grid, or None when the basis is not over the run's features (data a caller gave in
    memory with features of its own)."""
    red, mask, affine = _features(tuple((f, getattr(cfg, f)) for f in stage_fields("space")),
                                  os.stat(cfg.mask).st_mtime_ns if cfg.mask else 0)
    D = np.shape(basis)[0]
    if D != (red.n_parcels if red is not None else int(mask.sum())):
        return None
    return painted(red, spatial_maps(basis, eigenvalues, W)), mask, affine


def painted(parcels, A: np.ndarray) -> np.ndarray:
    """z-scored maps in voxels (voxels x R) from feature values ``A``: parcels painted back (``parcels`` None:
    voxels as they are), an atlas's voxels in no region left 0, outside the z-scoring. The maps the run names,
    orders and writes (components.nii.gz and its table) are these."""
    maps = parcels.expand(A) if parcels is not None else A
    covered = getattr(parcels, "covered", None)
    if covered is None or np.all(covered):
        return zscore_columns(maps)
    out = np.zeros(maps.shape)
    out[covered] = zscore_columns(maps[covered])
    return out


def component_labels(maps, mask, affine, eigenvalues, W) -> list[ComponentLabel]:
    """Every component's name, peak, noise fraction and share of the released spectrum, in W's order
    (``maps``: its voxel maps, mask voxels x components)."""
    return name_components(maps, mask, affine, component_variances(eigenvalues, W))


def ordered_unmixing(cfg: RunConfig, basis, eigenvalues, W, b) -> tuple[np.ndarray, np.ndarray]:
    """W's rows and b in network order, each signed so its map's heavier tail is positive (as they are when the
    basis is not over the run's features)."""
    W, b = np.asarray(W, np.float64), np.asarray(b, np.float64)
    on_grid = _voxel_maps(cfg, basis, eigenvalues, W)
    if on_grid is None:
        return W, b
    labels = component_labels(*on_grid, eigenvalues, W)
    order = network_order(labels)
    signs = np.array([labels[k].sign for k in order], np.float64)
    return W[order] * signs[:, None], b[order] * signs


def component_networks(cfg: RunConfig, basis, eigenvalues, W) -> tuple[str, ...] | None:
    """Each component's atlas network (:data:`dpneuro.data.networks.REGIONS`), :data:`NOISE_NAME` for one whose
    map lies mostly outside grey matter; None when the basis is not over the run's features. Every party computes
    it from the same public results (the released basis and the unmixing), so the sites and the aggregator agree
    on it without a message."""
    on_grid = _voxel_maps(cfg, basis, eigenvalues, W)
    if on_grid is None:
        return None
    return tuple(NOISE_NAME if lab.noise else lab.network for lab in component_labels(*on_grid, eigenvalues, W))


#: the columns of components.tsv, in order (one row per component, components.nii.gz's order)
TABLE_COLUMNS = ("component", "network", "network_name", "hemisphere", "peak_x", "peak_y", "peak_z",
                 "variance_share", "noise_fraction", "signal", "signal_share", "noise") + tuple(
    f"overlap_{r}" for r in REGIONS)
#: what components.tsv's network_name says of a component below the privacy noise (``network`` keeps the
#: atlas's nearest network, for the order)
NOISE_NAME = "noise"


def write_component_table(labels: list[ComponentLabel], path, signal: dict | None = None) -> Path:
    """``components.tsv``: each component's network, overlaps, peak (MNI mm), hemisphere, share of the released
    spectrum and noise fraction, rows in the maps' order; with ``signal``
    (:func:`dpneuro.run.expectations.signal_components`) whether it stands above the privacy noise.

    A component below the noise is named :data:`NOISE_NAME`, and ``noise`` is true for it as for a map that
    lies mostly outside grey matter."""
    path = Path(path)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=TABLE_COLUMNS, delimiter="\t", extrasaction="ignore")
        w.writeheader()
        for k, lab in enumerate(labels):
            above = True if signal is None else bool(signal["signal"][k])
            row = {**lab.to_row(), "component": f"IC{k + 1:02d}", "signal": above,
                   "signal_share": 1.0 if signal is None else float(signal["share"][k])}
            if not above:
                row.update(network_name=NOISE_NAME, noise=True)
            w.writerow({c: (f"{v:.4g}" if isinstance(v, float) else v) for c, v in row.items()})
    return path


def read_component_table(path) -> list[dict]:
    """The rows of a ``components.tsv`` (numbers as floats, ``noise`` and ``signal`` as bools); [] when there is
    none."""
    path = Path(path)
    if not path.exists():
        return []
    rows = []
    with open(path, newline="") as f:
        for row in csv.DictReader(f, delimiter="\t"):
            out: dict = {}
            for k, v in row.items():
                if k in ("noise", "signal"):
                    out[k] = v == "True"
                elif k.startswith(("peak_", "overlap_")) or k in ("variance_share", "noise_fraction", "signal_share"):
                    out[k] = float(v)
                else:
                    out[k] = v
            rows.append(out)
    return rows
