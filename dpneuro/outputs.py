"""The consortium's outputs, written the same way by a simulation and by a deployed aggregator.

A simulated run (:mod:`dpneuro.pipeline`) and the aggregator of a deployed
run (:mod:`dpneuro.deploy.party`) both end with the same three things: the
spatial maps painted back to voxels, ``privacy.json`` composed from every
site's ledger, and the report's headline. They call these functions, so a
deployment and its simulation write the same files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from .analysis import SCALING_NOTE
from .config import RunConfig
from .privacy import PrivacyLedger

__all__ = ["component_maps", "consortium_privacy", "headline", "state_activation", "to_voxels", "write_maps",
           "write_states"]


def component_maps(space: dict, basis, eigenvalues, W) -> np.ndarray:
    """z-scored spatial maps in voxels (voxels x R): the ICA mixing in the released basis, parcels painted back."""
    from .algorithms.djica import spatial_maps
    from .maps import zscore_columns

    return zscore_columns(to_voxels(space, spatial_maps(basis, eigenvalues, W)))


def to_voxels(space: dict, A: np.ndarray) -> np.ndarray:
    """Feature values (rows) painted back to the mask's voxels: parcels expanded, voxels as they are."""
    from .parcellation import space_parcels

    parcels = space_parcels(space)
    return parcels.expand(A) if parcels is not None else A


def write_maps(space: dict, basis, eigenvalues, W, path) -> tuple[Path, np.ndarray]:
    """``components.nii.gz`` (one volume per component on the mask's grid) and the voxel maps written."""
    from .maps import write_components

    maps = component_maps(space, basis, eigenvalues, W)
    return write_components(maps, space["mask"], path), maps


def state_activation(W, b, centroids) -> np.ndarray:
    """Brain states in component units (R x K): the unmixing applied to the whitened centroids."""
    C = np.asarray(centroids, np.float64)
    return np.asarray(W, np.float64) @ C + np.asarray(b, np.float64).reshape(-1, 1)


def write_states(space: dict, basis, eigenvalues, centroids, path) -> tuple[Path, np.ndarray]:
    """``states.nii.gz``: each brain state's pattern in voxels (V Lambda^1/2 c_k, z-scored, sign kept)."""
    from .maps import write_components

    V, lam = np.asarray(basis, np.float64), np.asarray(eigenvalues, np.float64)
    P = to_voxels(space, (V * np.sqrt(lam)) @ np.asarray(centroids, np.float64))
    P = (P - P.mean(axis=0)) / np.maximum(P.std(axis=0), 1e-12)  # a state's sign is meaningful: not flipped
    return write_components(P, space["mask"], path), P


def consortium_privacy(cfg: RunConfig, ledgers: dict[str, PrivacyLedger], n_subjects: dict[str, int], *,
                       assumptions: tuple[str, ...] = ()) -> dict[str, Any]:
    """``privacy.json``: every site's ledger composed and summarised, with the run's assumptions in words."""
    from .privacy import privacy_report

    for name, led in ledgers.items():
        led.owner = name
    priv = privacy_report(ledgers, delta=cfg.delta, n_subjects=n_subjects, plan=cfg.plan,
                          n_colluding=cfg.n_colluding, seeded=cfg.seed is not None, scaling_note=SCALING_NOTE)
    priv["assumptions"] += list(assumptions)
    return priv


def headline(cfg: RunConfig, priv: dict, *, n_components: int, n_subjects: int, warnings: list[str],
             ica: str = "") -> list[str]:
    """The box at the top of the consortium's report: what ran, the privacy headline, the warnings."""
    from .report import report_headline

    what = (f"{n_components} components from {len(cfg.sites)} sites, {n_subjects} subjects; plan '{cfg.plan}'"
            + (f"; {ica}" if ica else "") + ".")
    return report_headline(what, priv, warnings)
