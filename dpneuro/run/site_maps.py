"""Each site's own voxel maps: the consortium's components refined on the site's own voxels, with no release.

With parcels (the default), the consortium's maps are parcel values painted
back to voxels, no finer than a parcel. A site holds its subjects' voxels, and
after the run every subject's component time courses (the released basis and
unmixing applied to its own data). In one more pass over its files the site
computes, for every subject,

- the subject's maps: its voxel time series regressed on its time courses
  (the second stage of dual regression, FSL's ``dual_regression`` with
  normalised time courses), averaged over the site's subjects;
- the subject's top principal subspace over voxels (the same contribution the
  consortium's spatial PCA sums), summed over the site's subjects.

``site_maps_method = "guided_ica"`` (the default) then runs the spatial ICA
on the site's own principal subspace, started from the dual-regression maps
and paired with them one to one (group-information-guided ICA, as GIFT's
GIG-ICA back-reconstruction): the consortium fixes which network each map
is, the site's many voxels and subjects resolve its shape. Low-rank
subspaces average out the voxel noise that the subjects' regressions keep
(benchmarks/site_maps.py measures both against the truth).
``"dual_regression"`` keeps the averaged regression maps.

Everything is computed at the site from its own data and the shared
results: nothing is released, nothing leaves the site, no privacy is spent.
Like time courses, the maps are the site's own output: a deployed aggregator's
report shows none, a deployed site's report shows its own beside the
consortium's maps, and a simulation's report (one machine holds every site's
data) shows every site's.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np

from dpneuro._utils.blas import one_blas_thread
from dpneuro._utils.errors import DataValidationError
from dpneuro._utils.parallel import ordered_map, resolve_workers
from dpneuro._utils.progressbar import progress_bar
from dpneuro.algorithms.pca import subspace_factor
from dpneuro.algorithms.spatial_ica import GUIDED_ICA_MAX_ITER, guided_ica
from dpneuro.config import SITE_MAPS_METHODS as METHODS  # how a site makes its voxel maps
from dpneuro.data.images import load_mask
from dpneuro.data.load import decode_run, voxel_decoder
from dpneuro.data.matrix import scale_columns
from dpneuro.report.figures import write_components, zscore_columns

__all__ = ["CONSORTIUM_NOTE", "METHODS", "SIMULATION_NOTE", "SITE_NOTE", "SiteSubspace", "consortium_section",
           "convergence_note", "made", "site_note", "site_voxel_maps", "subject_map", "write_site_maps"]

#: what a deployed consortium's report says about them (it shows none: they are each site's own)
CONSORTIUM_NOTE = (
    "The maps above are the consortium's, at the resolution of its features ({features}; painted back to "
    "voxels). Each site "
    "also refines them on its own subjects' voxels ({how}): maps at the mask's voxel resolution, computed at the "
    "site from its own data, never sent, no privacy spent. Each site finds them in its own outputs "
    "(site_maps.nii.gz; site_maps/<site>.nii.gz in a simulation).")
#: what a simulation's report says above them (it shows every site's below each consortium map)
SIMULATION_NOTE = (
    "The consortium's maps are at the resolution of its features ({features}; painted back to voxels). Below "
    "each one: every "
    "site's own map of the component at the mask's voxel resolution ({how}), through the same slices, with its "
    "correlation r with the consortium's map. A site computes its maps from its own data: never sent, no privacy "
    "spent. This simulation holds every site's data, so its report shows them; in a deployment each site's maps "
    "appear only in its own report (here: site_maps/<site>.nii.gz).")
#: what a site's own report says above them
SITE_NOTE = (
    "Below each group map: this site's own map of the component at the mask's voxel resolution, the consortium's "
    "component refined on this site's subjects' voxels ({how}), through the same slices. Computed here from this "
    "site's data, never sent, no privacy spent (site_maps.nii.gz).")
#: the site's principal subspace has this many directions per component (``guided_ica``)
SUBSPACE_FACTOR = 2
_HOW = {"guided_ica": "spatial ICA of the site's principal subspace, guided by the dual-regression maps",
        "dual_regression": "dual regression on their time courses, averaged over the subjects"}


def site_note(method: str, ica: dict | None = None) -> str:
    """What a site's own report says above its voxel maps (``ica``: its guided ICA's record, if one ran)."""
    return SITE_NOTE.format(how=_HOW[method]) + convergence_note({"this site": ica})


def convergence_note(ica: dict[str, dict | None]) -> str:
    """Whether each site's guided ICA converged (records of :func:`site_voxel_maps`), for the reports."""
    ran = {site: r for site, r in ica.items() if r}
    if not ran:
        return ""
    limit = next(iter(ran.values()))["max_iter"]
    stopped = [f"{site} ({r['n_iter']} iterations)" for site, r in ran.items() if r["status"] != "converged"]
    if stopped:
        return (f" The guided ICA did not converge within {limit} FastICA iterations at {', '.join(stopped)}: "
                "those maps are its last iterate.")
    most = max(r["n_iter"] for r in ran.values())
    return f" The guided ICA converged ({'every site, ' if len(ran) > 1 else ''}at most {most} of {limit} FastICA " \
           "iterations)."


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


class SiteSubspace:
    """The top principal subspace of the sum of the site's subjects' projectors, accumulated subject by subject.

    Each subject adds U_m U_m^T, U_m its top-``k`` left singular vectors over
    voxels (time points scaled to unit norm, as the consortium's PCA does). The
    sum is C C^T with C = [U_1 ... U_M]; its leading eigenvectors are C's
    leading left singular vectors. To keep memory at a few times D k whatever
    the number of subjects, the columns are merged into their top ``keep``
    singular directions (default 2k; from the small Gram matrix) whenever
    they pile up (MIGP-style, Smith et al. 2014): exact while the sum's rank
    is within ``keep``, and otherwise the discarded tail is at most the
    (keep+1)-th eigenvalue per merge, far below the top k.
    """

    def __init__(self, k: int, *, keep: int | None = None):
        if k < 1:
            raise ValueError(f"k must be >= 1, got {k}")
        self.k = int(k)
        self.keep = int(keep) if keep is not None else 2 * self.k
        if self.keep < self.k:
            raise ValueError(f"keep ({self.keep}) must be >= k ({self.k})")
        self._parts: list[np.ndarray] = []
        self._width = 0
        self.n_subjects = 0

    def add(self, Y: np.ndarray) -> None:
        """Add one subject's voxel time series ``Y`` (voxels x T)."""
        B = scale_columns(np.asarray(Y, np.float64), "unit")
        U = B @ subspace_factor(B, self.k)
        self._parts.append(U)
        self._width += U.shape[1]
        self.n_subjects += 1
        if self._width > self.keep + 4 * self.k:
            self._merge(self.keep)

    def _merge(self, keep: int) -> None:
        C = np.concatenate(self._parts, axis=1)
        # C L = U with L = E / s from the small Gram matrix (an SVD of the tall C is ~100x slower: 30 s at
        # 29,398 x 320); U s = C E = C L / ||L||, since E's columns are unit vectors
        L = subspace_factor(C, keep)
        self._parts = [C @ (L / np.linalg.norm(L, axis=0))]
        self._width = self._parts[0].shape[1]

    def basis(self) -> tuple[np.ndarray, np.ndarray]:
        """(U, w): at most ``k`` orthonormal columns and their eigenvalues of the summed projectors / subjects."""
        if not self._parts:
            raise ValueError("no subject was added")
        self._merge(self.k)
        U = self._parts[0]
        s = np.linalg.norm(U, axis=0)
        return U / s, s**2 / self.n_subjects


def site_voxel_maps(runs: Sequence[Sequence[str]], boundaries: Sequence[Sequence[int]], S: np.ndarray, mask, *,
                    method: str = "guided_ica", standardize: bool = True, detrend: bool = False,
                    workers: int | None = None, progress: bool = False, decode=None,
                    record: dict | None = None) -> np.ndarray:
    """The site's voxel maps (voxels x R), z-scored as the consortium's maps, in the order of ``S``'s rows.

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
    method : {"guided_ica", "dual_regression"}
        Guided spatial ICA of the site's principal subspace, or the averaged dual-regression maps (module notes).
    standardize, detrend : how the site prepared its data for the run (the same here).
    workers : int, optional
        Runs decoded at the same time, in threads (default: the usable cores).
    progress : bool
        A tqdm progress bar over the runs.
    decode : callable, optional
        ``decode(path)`` -> the run's voxels x volumes as the site's matrix has them
        (:func:`dpneuro.data.load.voxel_decoder`: resampled, cleaned, scrubbed); default: read on the mask's grid.
    record : dict, optional
        Given, ``record["site_maps_ica"]`` is set to how the guided ICA ended: ``{"status": "converged" or
        "not converged", "n_iter", "max_iter", "restarted_from"}`` (the seeds FastICA restarted from after a
        collapse, usually none), or None when none ran (``"dual_regression"``, or too little data for R directions).

    The products here are small (a subject's voxels x its volumes, by R or 2R) and run beside the decoding
    threads, so they use one BLAS thread: with two, one site of the demo took 1.0-39 s on a shared 2-core
    machine (the more its other load, the longer), with one 0.8-1.6 s.
    """

    if method not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {method!r}")
    S = np.asarray(S, np.float64)
    if len(runs) != len(boundaries) or not runs:
        raise ValueError(f"{len(runs)} subjects' runs for {len(boundaries)} column ranges")
    R = S.shape[0]
    files = [str(f) for fs in runs for f in fs]
    owner = [i for i, fs in enumerate(runs) for _ in fs]
    decode = decode or functools.partial(decode_run, mask=np.asarray(mask, bool), standardize=standardize,
                                         detrend=detrend)
    blocks = ordered_map(decode, files, workers=resolve_workers(workers))
    total = np.zeros((int(np.count_nonzero(mask)), R))
    # twice the components: the site's other structure gets components of its own, so they do not bend the
    # group's (more directions helped in a measurement, which benchmarks/site_maps.py does not repeat)
    subspace = SiteSubspace(SUBSPACE_FACTOR * R) if method == "guided_ica" else None
    pending: list[np.ndarray] = []
    if record is not None:
        record["site_maps_ica"] = None
    with one_blas_thread():  # small products beside the decoding threads, which they would only slow
        try:
            for k, block in enumerate(progress_bar(blocks, total=len(files), desc="voxel maps", unit="run",
                                                   enabled=progress)):
                pending.append(block)
                i = owner[k]
                if k + 1 < len(files) and owner[k + 1] == i:
                    continue  # the subject's next run
                a, b = boundaries[i]
                Y = pending[0] if len(pending) == 1 else np.concatenate(pending, axis=1)
                pending = []
                if Y.shape[1] != b - a:  # the file changed since the site loaded it
                    raise DataValidationError(
                        f"{runs[i][0]}: subject {i + 1}'s runs now have {Y.shape[1]} volumes but had {b - a} when "
                        "the site loaded them; the data changed during the run: run it again")
                total += subject_map(Y, S[:, a:b])
                if subspace is not None:
                    subspace.add(Y)
        except BaseException:
            blocks.close()  # cancels the decoding not yet started
            raise
        regression = zscore_columns(total / len(runs))
        if subspace is None:
            return regression
        basis, _ = subspace.basis()
        if basis.shape[1] < R or basis.shape[0] <= basis.shape[1] or np.any(regression.std(axis=0) <= 0):
            return regression  # too little data for R directions (or a component silent at the site): nothing to refine
        result = guided_ica(basis, regression)
    if record is not None:
        record["site_maps_ica"] = {"status": result.status, "n_iter": result.n_iter, "max_iter": GUIDED_ICA_MAX_ITER,
                                   "restarted_from": list(result.restarts)}  # seeds, if FastICA collapsed
    return result.maps


def made(cfg, space: dict) -> bool:
    """Whether the sites of this run write their own voxel maps (with parcels, unless turned off)."""
    return bool(cfg.site_voxel_maps and space.get("parcels"))


def consortium_section(cfg, space: dict, *, simulated: bool = False, ica: dict | None = None) -> dict | None:
    """The consortium report's note on the sites' own voxel maps, or None when none are made.

    ``simulated``: the report shows every site's maps (a simulation holds them all); otherwise none.
    ``ica``: each site's guided ICA record, where this report knows them (a simulation).
    """
    if not made(cfg, space):
        return None
    return {"note": (SIMULATION_NOTE if simulated else CONSORTIUM_NOTE).format(
        how=_HOW[cfg.site_maps_method], features=space.get("features", "parcels")) + convergence_note(ica or {})}


def write_site_maps(cfg, site: dict, space: dict, S: np.ndarray, path, *, progress: bool = False,
                    record: dict | None = None):
    """A site's ``voxel maps`` NIfTI at ``path`` from its loader record (``runs``, ``boundaries``) and time courses.

    Returns ``(path, maps)``, or None when the run asks for none: without
    parcels the consortium's maps are at voxel resolution already, and
    ``cfg.site_voxel_maps = false`` turns them off. ``record`` (a dict)
    gets ``record["site_maps_ica"]``, whether the site's guided ICA
    converged (:func:`site_voxel_maps`).
    """
    if not made(cfg, space):
        return None
    mask, _ = load_mask(space["mask"])
    maps = site_voxel_maps(site["runs"], site["boundaries"], S, mask, method=cfg.site_maps_method,
                           standardize=cfg.standardize, progress=progress,
                           decode=voxel_decoder(site, space["mask"], cfg.cleaning(), standardize=cfg.standardize),
                           record=record)
    return write_components(maps, space["mask"], path), maps
