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

from .algorithms.djica import spatial_maps
from .analysis import SCALING_NOTE
from .config import RunConfig
from .maps import render_components, states_figure, write_components, zscore_columns
from .parcellation import space_parcels
from .privacy import PrivacyLedger, privacy_report
from .report import report_headline

__all__ = ["component_maps", "consortium_privacy", "headline", "states_section", "to_voxels", "write_maps",
           "write_states"]


def component_maps(space: dict, basis, eigenvalues, W) -> np.ndarray:
    """z-scored spatial maps in voxels (voxels x R): the ICA mixing in the released basis, parcels painted back."""
    maps = to_voxels(space, spatial_maps(basis, eigenvalues, W))
    parcels = space_parcels(space)
    covered = None if parcels is None else parcels.covered
    if covered is None or np.all(covered):
        return zscore_columns(maps)
    # an atlas's voxels in no region stay 0, outside the z-scoring
    out = np.zeros(maps.shape)
    out[covered] = zscore_columns(maps[covered])
    return out


def to_voxels(space: dict, A: np.ndarray) -> np.ndarray:
    """Feature values (rows) painted back to the mask's voxels: parcels expanded, voxels as they are."""
    parcels = space_parcels(space)
    return parcels.expand(A) if parcels is not None else A


def write_maps(space: dict, basis, eigenvalues, W, path) -> tuple[Path, np.ndarray]:
    """``components.nii.gz`` (one volume per component on the mask's grid) and the voxel maps written."""
    maps = component_maps(space, basis, eigenvalues, W)
    return write_components(maps, space["mask"], path), maps


def write_states(space: dict, basis, eigenvalues, W, b, centroids, folder) -> tuple[dict[str, str], np.ndarray]:
    """The brain states' files in ``folder``: ``states.nii.gz`` and ``state_activation.npy``.

    The patterns are V Lambda^1/2 c_k painted to voxels, z-scored with their
    sign kept (a state's sign is meaningful); the activation is W c_k + b, each
    state in component units (R x K). Returns the two paths and the voxel patterns.
    """
    folder = Path(folder)
    V, lam = np.asarray(basis, np.float64), np.asarray(eigenvalues, np.float64)
    C = np.asarray(centroids, np.float64)
    P = to_voxels(space, (V * np.sqrt(lam)) @ C)
    P = (P - P.mean(axis=0)) / np.maximum(P.std(axis=0), 1e-12)
    np.save(folder / "state_activation.npy", np.asarray(W, np.float64) @ C + np.asarray(b, np.float64).reshape(-1, 1))
    paths = {"patterns": str(write_components(P, space["mask"], folder / "states.nii.gz")),
             "activation": str(folder / "state_activation.npy")}
    return paths, P


def states_section(states: dict, mask: str, figs: Path, problem) -> dict:
    """The report's brain-states section: ``states`` has the paths of :func:`write_states`, the consortium's
    ``occupancy`` and optionally ``truth`` (matched correlations with a synthetic truth)."""
    entries, note, _ = render_components(states["patterns"], mask, figs, problem=problem, kind="state")
    truth = states.get("truth")
    if truth:
        for j, k in enumerate(truth["perm"]):
            entries[k]["corr"] = truth["corr"][j]
    return {"entries": entries, "note": note, "occupancy": states["occupancy"], "truth": truth,
            "figure": str(states_figure(np.load(states["activation"]), states["occupancy"], figs / "states.png"))}


def consortium_privacy(cfg: RunConfig, ledgers: dict[str, PrivacyLedger], n_subjects: dict[str, int], *,
                       assumptions: tuple[str, ...] = ()) -> dict[str, Any]:
    """``privacy.json``: every site's ledger composed and summarised, with the run's assumptions in words."""
    for name, led in ledgers.items():
        led.owner = name
    priv = privacy_report(ledgers, delta=cfg.delta, n_subjects=n_subjects, plan=cfg.plan,
                          n_colluding=cfg.n_colluding, seeded=cfg.seed is not None, scaling_note=SCALING_NOTE)
    priv["assumptions"] += list(assumptions)
    return priv


def headline(cfg: RunConfig, priv: dict, *, n_components: int, n_subjects: int, warnings: list[str],
             ica: str = "") -> list[str]:
    """The box at the top of the consortium's report: what ran, the privacy headline, the warnings."""
    what = (f"{n_components} components from {len(cfg.sites)} sites, {n_subjects} subjects; plan '{cfg.plan}'"
            + (f"; {ica}" if ica else "") + ".")
    return report_headline(what, priv, warnings)
