"""Each site's own voxel-resolution maps: dual regression of its subjects' voxels on their time courses.

With parcels (the default), the consortium's maps are parcel values painted
back to voxels, no finer than a parcel. A site holds its subjects' voxels, and
after the run every subject's component time courses (the released basis and
unmixing applied to its own data). Regressing each subject's voxel time series
on its time courses (the second stage of dual regression, FSL's
``dual_regression`` with normalised time courses) and averaging over the
site's subjects gives maps at the mask's resolution. They are computed at the
site from its own data and the shared results: nothing is released, nothing
leaves the site, no privacy is spent. Like time courses, they are the site's
own output and never appear in the consortium's report.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

__all__ = ["CONSORTIUM_NOTE", "SITE_NOTE", "consortium_section", "made", "site_voxel_maps", "subject_map",
           "write_site_maps"]

#: what the consortium's report says about them (it shows none: they are each site's own)
CONSORTIUM_NOTE = (
    "The maps above are the consortium's, at parcel resolution (parcel values painted back to voxels). Each site "
    "also regresses its own subjects' voxels on their time courses (dual regression) and averages the subjects' "
    "maps: maps at the mask's voxel resolution, computed at the site from its own data, never sent, no privacy "
    "spent. Each site finds them in its own outputs (site_maps.nii.gz; site_maps/<site>.nii.gz in a simulation).")
#: what a site's own report says above them
SITE_NOTE = (
    "This site's own maps at the mask's voxel resolution: its subjects' voxels regressed on their time courses "
    "(dual regression), averaged over its subjects. Computed here from this site's data, never sent, no privacy "
    "spent (site_maps.nii.gz).")


def subject_map(Y: np.ndarray, S: np.ndarray) -> np.ndarray:
    """One subject's maps (voxels x R): least squares of its voxel time series ``Y`` (voxels x T) on ``S`` (R x T).

    The time courses are centred and scaled to unit variance first, so every
    subject's map is in the same units (the data's per unit of component
    activity). A component constant over the subject's volumes explains
    nothing and gets a zero map.
    """
    S = np.asarray(S, np.float64)
    S = S - S.mean(axis=1, keepdims=True)
    sd = S.std(axis=1, keepdims=True)
    S = np.divide(S, sd, out=np.zeros_like(S), where=sd > 1e-12)
    # the pseudo-inverse of the small T x R design (SVD) keeps collinear time courses finite (the minimum-norm
    # split between them); one product with it is ~13x faster than lstsq over every voxel (29,398 voxels)
    return np.asarray(Y, np.float64) @ np.linalg.pinv(S.T).T


def site_voxel_maps(runs: Sequence[Sequence[str]], boundaries: Sequence[Sequence[int]], S: np.ndarray, mask, *,
                    standardize: bool = True, detrend: bool = False, workers: int | None = None,
                    progress: bool = False) -> np.ndarray:
    """The site's voxel maps (voxels x R): the mean of its subjects' maps, z-scored as the consortium's maps.

    Parameters
    ----------
    runs : list of lists of paths
        Every subject's runs, as the site loaded them (``SiteData.runs``).
    boundaries : list of (start, stop)
        Every subject's columns of ``S`` (``SiteData.boundaries``).
    S : ndarray, shape (R, N)
        The site's component time courses (``time_courses``), subjects' volumes in load order.
    mask : ndarray of bool
        The consortium mask (3-D); the maps are over its voxels.
    standardize, detrend : how the site prepared its data for the run (the same here).
    workers : int, optional
        Runs decoded at the same time, in threads (default: the usable cores).
    progress : bool
        A tqdm progress bar over the runs.
    """
    from tqdm.auto import tqdm

    from .io import DataValidationError, decode_run, ordered_map, resolve_workers
    from .maps import zscore_columns

    S = np.asarray(S, np.float64)
    if len(runs) != len(boundaries) or not runs:
        raise ValueError(f"{len(runs)} subjects' runs for {len(boundaries)} column ranges")
    files = [str(f) for fs in runs for f in fs]
    owner = [i for i, fs in enumerate(runs) for _ in fs]
    blocks = ordered_map(
        functools.partial(decode_run, mask=np.asarray(mask, bool), standardize=standardize, detrend=detrend),
        files, workers=resolve_workers(workers))
    total = np.zeros((int(np.count_nonzero(mask)), S.shape[0]))
    pending: list[np.ndarray] = []
    try:
        for k, block in enumerate(tqdm(blocks, total=len(files), desc="voxel maps", unit="run",
                                       disable=not progress)):
            pending.append(block)
            i = owner[k]
            if k + 1 < len(files) and owner[k + 1] == i:
                continue  # the subject's next run
            a, b = boundaries[i]
            Y = pending[0] if len(pending) == 1 else np.concatenate(pending, axis=1)
            pending = []
            if Y.shape[1] != b - a:  # the file changed since the site loaded it
                raise DataValidationError(
                    f"{runs[i][0]}: subject {i + 1}'s runs now have {Y.shape[1]} volumes but had {b - a} when the "
                    "site loaded them; the data changed during the run: run it again")
            total += subject_map(Y, S[:, a:b])
    except BaseException:
        blocks.close()  # cancels the decoding not yet started
        raise
    return zscore_columns(total / len(runs))


def made(cfg, space: dict) -> bool:
    """Whether the sites of this run write their own voxel maps (with parcels, unless turned off)."""
    return bool(cfg.site_voxel_maps and space.get("parcels"))


def consortium_section(cfg, space: dict) -> dict | None:
    """The consortium report's note on the sites' own voxel maps (it shows none), or None when none are made."""
    return {"note": CONSORTIUM_NOTE} if made(cfg, space) else None


def write_site_maps(cfg, site: dict, space: dict, S: np.ndarray, path, *, progress: bool = False):
    """A site's ``voxel maps`` NIfTI at ``path`` from its loader record (``runs``, ``boundaries``) and time courses.

    Returns ``(path, maps)``, or None when the run asks for none: without
    parcels the consortium's maps are at voxel resolution already, and
    ``cfg.site_voxel_maps = false`` turns them off.
    """
    from .io import load_mask
    from .maps import write_components

    if not made(cfg, space):
        return None
    mask, _ = load_mask(space["mask"])
    maps = site_voxel_maps(site["runs"], site["boundaries"], S, mask, standardize=cfg.standardize,
                           progress=progress)
    return write_components(maps, space["mask"], path), maps
