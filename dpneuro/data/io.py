"""NIfTI discovery, validation and masking into per-site data matrices.

A site's data become one D x N float32 matrix (features = mask voxels in
``mask[mask]`` order, columns = time points, subjects concatenated in time),
read one subject at a time and optionally written straight into a
memory-mapped ``.npy`` file so that no more than one subject's 4-D image is
ever in memory.

Every input file is checked from its header *before* any image data is read
(existence, readability, gzip integrity, 4-D, grid and affine equal to the
mask's, enough volumes, consistent TR); problems raise
:class:`DataValidationError` naming the file and the problem. Non-finite
values and runs without signal (every mask voxel 0, or constant in time) can
only be found while reading and are reported the same way.
"""

from __future__ import annotations

import contextlib
import csv
import functools
import gzip
import json
import logging
import os
import struct
import threading
import warnings
import zlib
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import nibabel as nib
import numpy as np

from dpneuro._utils.blas import one_blas_thread
from dpneuro._utils.errors import DpneuroError
from dpneuro._utils.progressbar import progress_bar
from dpneuro.data.bids import NIFTI_SUFFIXES, VERSION_KEYS, bids_entities, confounds_name, split_name
from dpneuro.data.cleaning import CleaningError, clean_block, run_confounds
from dpneuro.data.resample import separable_operator

__all__ = [
    "DataValidationError",
    "SiteData",
    "load_site",
    "open_site_data",
    "load_mask",
    "mask_to_image",
    "find_nifti",
    "subject_id_from_path",
    "NpyColumns",
    "column_blocks",
]

_log = logging.getLogger(__name__)

_AFFINE_ATOL = 1e-3
_TR_RTOL = 1e-3
_TIME_UNIT_SECONDS = {"sec": 1.0, "msec": 1e-3, "usec": 1e-6}


class DataValidationError(DpneuroError, ValueError):
    """An input file is missing, unreadable or does not fit the analysis."""


# ---------------------------------------------------------------------------
# result container
# ---------------------------------------------------------------------------

@dataclass
class SiteData:
    """One site's masked, concatenated data matrix and its bookkeeping.

    Attributes
    ----------
    X : ndarray, shape (D, N), float32
        Voxels x time points, subjects concatenated along the columns. A
        read-only ``numpy.memmap`` when loaded with ``memmap_path``.
    subject_ids : list of str
        One id per subject (person), from the file names (``sub-01_bold.nii.gz``
        -> ``sub-01``) or a subject mapping.
    boundaries : list of (int, int)
        ``(start, stop)`` column range of each subject in `X`: all of one
        person's runs and sessions, concatenated.
    paths : list of str
        The source files, in column order.
    runs : list of list of str
        Each subject's files (its runs and sessions), in column order.
    skipped : list of [path, why]
        Files found but not used (outside ``func/``, not BOLD, filtered out,
        fMRIPrep companions the cleaning does not read, left-out subjects).
    excluded : list of [subject, why]
        Subjects left out: by the configuration (``exclude``) or, with
        ``on_bad_subject = "skip"``, for bad data (the reason names the file).
    cleaning : dict or None
        The cleaning applied (:class:`dpneuro.data.cleaning.Cleaning` as JSON, with a
        ``description`` sentence); None when only ``standardize``/``detrend`` applied.
    run_records : list of dict
        Per run read: path, subject, TR, volumes, columns kept, the grid it
        was resampled from (or None), brain-mask coverage, companions used.
    filters : dict
        The BIDS filters applied, defaults included.
    tr : float or None
        Repetition time in seconds, common to all subjects (None if the
        headers leave it unset, i.e. 0).
    mask_path : str or None
        The mask file, if the mask was given as (or loaded from) a file.
    standardize, detrend : bool
        The per-subject preprocessing applied.
    memmap_path : str or None
        The ``.npy`` file backing `X`, if any.
    voxels_path : str or None
        The site's voxel-level matrix (``load_site(voxels_path=...)``), when it was kept.
    """

    X: np.ndarray
    subject_ids: list[str]
    boundaries: list[tuple[int, int]]
    paths: list[str]
    tr: float | None = None
    mask_path: str | None = None
    standardize: bool = True
    detrend: bool = False
    memmap_path: str | None = None
    runs: list[list[str]] | None = None
    skipped: list[list[str]] | None = None
    excluded: list[list[str]] | None = None
    cleaning: dict | None = None
    run_records: list[dict] | None = None
    filters: dict | None = None
    voxels_path: str | None = None

    def __post_init__(self):
        if self.runs is None:
            self.runs = [[p] for p in self.paths] if self.paths else [[] for _ in self.subject_ids]
        if self.skipped is None:
            self.skipped = []
        if self.excluded is None:
            self.excluded = []

    @classmethod
    def from_array(cls, X, subjects=None, subject_ids: list[str] | None = None) -> SiteData:
        """A site's data from a D x N array: ``subjects`` is a count M (equal lengths), the subjects'
        lengths or their (start, stop) column ranges (default: every column its own unit)."""
        X = np.asarray(X)
        if X.ndim != 2:
            raise ValueError(f"a site's data matrix must be D x N, got shape {X.shape}")
        ranges = subject_ranges(subjects if subjects is not None else X.shape[1], X.shape[1])
        ids = list(subject_ids) if subject_ids is not None else [f"sub-{i + 1:04d}" for i in range(len(ranges))]
        if len(ids) != len(ranges):
            raise ValueError(f"{len(ids)} subject ids for {len(ranges)} subjects")
        return cls(X=X, subject_ids=ids, boundaries=[(int(a), int(b)) for a, b in ranges], paths=[])

    @property
    def lengths(self) -> list[int]:
        """Time points of each subject (public metadata)."""
        return [b - a for a, b in self.boundaries]

    @property
    def n_subjects(self) -> int:
        """Number of subjects M."""
        return len(self.subject_ids)

    @property
    def n_features(self) -> int:
        """Number of features D (mask voxels)."""
        return int(self.X.shape[0])

    @property
    def n_samples(self) -> int:
        """Number of columns N (time points of all subjects)."""
        return int(self.X.shape[1])

    @property
    def subject_slices(self) -> list[slice]:
        """Column slice of each subject in `X`."""
        return [slice(a, b) for a, b in self.boundaries]

    def subject_block(self, i: int) -> np.ndarray:
        """D x N_i view of subject `i`'s columns."""
        a, b = self.boundaries[i]
        return self.X[:, a:b]

    def iter_subjects(self) -> Iterator[np.ndarray]:
        """Yield each subject's D x N_m block of `X` (views, no copies)."""
        for a, b in self.boundaries:
            yield self.X[:, a:b]

    def metadata(self) -> dict:
        """JSON-serialisable description of everything but `X`."""
        return {
            "subject_ids": list(self.subject_ids),
            "boundaries": [list(b) for b in self.boundaries],
            "paths": list(self.paths),
            "runs": [list(r) for r in self.runs],
            "skipped": [list(x) for x in self.skipped],
            "excluded": [list(x) for x in self.excluded],
            "cleaning": self.cleaning,
            "run_records": self.run_records,
            "filters": self.filters,
            "tr": self.tr,
            "mask_path": self.mask_path,
            "standardize": self.standardize,
            "detrend": self.detrend,
            "voxels_path": self.voxels_path,
            "shape": [self.n_features, self.n_samples],
        }


# ---------------------------------------------------------------------------
# subjects and scaling of a site's data matrix
# ---------------------------------------------------------------------------

def subject_ranges(spec, n: int) -> list[tuple[int, int]]:
    """Column ranges of the subjects from an int (equal split), ranges, or lengths."""
    if isinstance(spec, (int, np.integer)) and not isinstance(spec, bool):
        m = int(spec)
        if m < 1:
            raise ValueError(f"number of subjects must be >= 1, got {m}")
        if n % m:
            raise ValueError(f"{n} columns cannot be split into {m} subjects of equal length; "
                             "give the subjects' column ranges instead")
        L = n // m
        return [(i * L, (i + 1) * L) for i in range(m)]
    items = list(spec)
    if not items:
        raise ValueError("subjects: empty list")
    if all(isinstance(x, (int, np.integer)) and not isinstance(x, bool) for x in items):
        lengths = [int(x) for x in items]
        if min(lengths) < 1:
            raise ValueError(f"subject lengths must be positive, got {lengths}")
        if sum(lengths) != n:
            raise ValueError(f"subject lengths {lengths} add up to {sum(lengths)} but the data have {n} columns")
        stops = np.cumsum(lengths)
        return [(int(stop - length), int(stop)) for length, stop in zip(lengths, stops)]
    ranges = [tuple(int(v) for v in r) for r in items]
    if any(len(r) != 2 for r in ranges):
        raise ValueError("subjects: give an int, a list of lengths, or a list of (start, stop) column ranges")
    ranges.sort()
    pos = 0
    for a, b in ranges:
        if a != pos or b <= a:
            raise ValueError(f"subject column ranges must tile 0..{n} without gaps or overlaps; "
                             f"got {ranges}")
        pos = b
    if pos != n:
        raise ValueError(f"subject column ranges end at column {pos}, but the site has {n} columns")
    return ranges


def column_norms(blk: np.ndarray) -> np.ndarray:
    b = np.asarray(blk, dtype=np.float64) if blk.dtype != np.float64 and blk.dtype != np.float32 else blk
    return np.sqrt(np.einsum("ij,ij->j", b, b, dtype=np.float64))


def scale_factors(norms: np.ndarray, scale) -> np.ndarray:
    """Per-column multipliers that bring every column to norm <= 1 under ``scale``."""
    if scale is None or scale == "clip":
        return 1.0 / np.maximum(1.0, norms)
    if scale == "unit":
        out = np.zeros_like(norms)
        nz = norms > 0
        out[nz] = 1.0 / norms[nz]
        return out
    c = float(scale)
    return (1.0 / c) / np.maximum(1.0, norms / c)


def scale_columns(X, scale="unit") -> np.ndarray:
    """``X`` (float32) with every column brought to norm <= 1 under ``scale`` (``"unit"``: exactly 1; 0 stays 0)."""
    X = np.asarray(X)
    return (X * scale_factors(column_norms(X), scale)).astype(np.float32)


# ---------------------------------------------------------------------------
# site matrices on disk: column-major .npy, read and written column block by column block
# ---------------------------------------------------------------------------

def resolve_workers(workers: int | None = None) -> int:
    """The number of parallel workers: ``workers``, or the cores this process may use."""
    if workers is None:
        try:
            return max(1, len(os.sched_getaffinity(0)))
        except AttributeError:  # pragma: no cover - not Linux
            return max(1, os.cpu_count() or 1)
    if isinstance(workers, bool) or not isinstance(workers, (int, np.integer)) or workers < 1:
        raise ValueError(f"workers must be a positive integer, got {workers!r}")
    return int(workers)


def ordered_map(fn, items, *, workers: int = 1):
    """Yield ``fn(item)`` in the order of ``items``, computed by ``workers`` threads.

    At most ``2 * workers`` results wait to be consumed, so memory stays bounded
    when ``fn`` returns large arrays. Closing the generator cancels the work not
    yet started.
    """
    items = list(items)
    if workers <= 1:
        for x in items:
            yield fn(x)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="dpneuro") as pool:
        pending: deque = deque()
        todo = iter(items)
        try:
            for x in todo:
                pending.append(pool.submit(fn, x))
                if len(pending) >= 2 * workers:
                    break
            while pending:
                result = pending.popleft().result()
                nxt = next(todo, pending)  # the deque itself marks the end
                if nxt is not pending:
                    pending.append(pool.submit(fn, nxt))
                yield result
                del result
        finally:
            for f in pending:
                f.cancel()


class NpyColumns:
    """A D x N ``.npy`` file read column block by column block with plain file reads.

    The site matrices are stored column-major, so one subject's time points are
    one contiguous read and the process holds only the block it asked for (a
    memory map would keep every page it touched resident). A row-major file is
    read through a memory map instead.
    """

    ndim = 2

    def __init__(self, path):
        self.path = Path(path)
        try:
            with open(self.path, "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, self.fortran_order, self.dtype = read(f)
                self.offset = f.tell()
        except FileNotFoundError:
            raise DataValidationError(f"{self.path}: file not found") from None
        except ValueError as exc:
            raise DataValidationError(f"{self.path}: not a .npy file ({exc})") from None
        if len(shape) != 2:
            raise DataValidationError(f"{self.path}: a site matrix must be D x N, got shape {shape}")
        self.shape = tuple(int(n) for n in shape)

    def __repr__(self) -> str:
        return f"NpyColumns({str(self.path)!r}, shape={self.shape}, dtype={self.dtype})"

    def columns(self, a: int, b: int) -> np.ndarray:
        """Columns a..b-1 as a fresh D x (b - a) array."""
        D, N = self.shape
        if not 0 <= a <= b <= N:
            raise IndexError(f"columns {a}:{b} outside 0:{N}")
        if not self.fortran_order:
            return np.array(np.load(self.path, mmap_mode="r")[:, a:b])
        out = np.empty((b - a, D), dtype=self.dtype)
        with open(self.path, "rb") as f:
            f.seek(self.offset + a * D * self.dtype.itemsize)
            got = f.readinto(memoryview(out).cast("B"))
        if got != out.nbytes:
            raise DataValidationError(f"{self.path}: truncated ({got} of {out.nbytes} bytes of columns {a}:{b})")
        return out.T


class ColumnWriter:
    """Write a D x N float32 ``.npy`` (column-major) from consecutive column blocks.

    The file is complete only when exactly N columns were written; otherwise
    leaving the ``with`` block raises and removes it. The columns go to a
    hidden ``.<name>.<pid>.part`` beside it, renamed to ``path`` only when
    complete: a process killed mid-write never leaves a partial ``path``.
    """

    def __init__(self, path, shape: tuple[int, int]):
        self.path, self.shape, self.written = Path(path), (int(shape[0]), int(shape[1])), 0
        self.part = self.path.with_name(f".{self.path.name}.{os.getpid()}.part")

    def __enter__(self) -> ColumnWriter:
        self.path.unlink(missing_ok=True)  # an older matrix must not pass for this one if writing fails
        self._f = open(self.part, "wb")
        np.lib.format.write_array_header_1_0(
            self._f, {"descr": np.lib.format.dtype_to_descr(np.dtype("<f4")), "fortran_order": True,
                      "shape": self.shape})
        return self

    def write(self, block: np.ndarray) -> None:
        if block.ndim != 2 or block.shape[0] != self.shape[0]:
            raise ValueError(f"a block must have {self.shape[0]} rows, got shape {block.shape}")
        if self.written + block.shape[1] > self.shape[1]:
            raise ValueError(f"more than the {self.shape[1]} columns of {self.path}")
        np.ascontiguousarray(block.T, dtype="<f4").tofile(self._f)
        self.written += block.shape[1]

    def __exit__(self, exc_type, exc, tb) -> None:
        self._f.close()
        if exc_type is None and self.written == self.shape[1]:
            os.replace(self.part, self.path)
            return
        self.part.unlink(missing_ok=True)
        if exc_type is None:
            raise RuntimeError(f"{self.path}: {self.written} of {self.shape[1]} columns written")


def site_matrix(X):
    """A site's D x N matrix for block reading: a ``.npy`` path becomes :class:`NpyColumns`; arrays stay."""
    if isinstance(X, (str, os.PathLike)):
        return NpyColumns(X)
    return X


def column_blocks(X, ranges=None, *, block_bytes: int = 1 << 26) -> Iterator[tuple[int, int, np.ndarray]]:
    """Yield ``(start, stop, block)`` over the columns of a site matrix (array, path or :class:`NpyColumns`).

    ``ranges``: the (start, stop) column ranges to read (e.g. the subjects);
    default: consecutive blocks of about ``block_bytes``.
    """
    X = site_matrix(X)
    D, N = X.shape
    if ranges is None:
        width = max(1, block_bytes // (4 * max(1, D)))
        ranges = [(a, min(a + width, N)) for a in range(0, N, width)]
    read = X.columns if isinstance(X, NpyColumns) else (lambda a, b: X[:, a:b])
    for a, b in ranges:
        yield a, b, read(a, b)


# ---------------------------------------------------------------------------
# mask helpers
# ---------------------------------------------------------------------------

def load_image(path: Path, what: str = "file", *, series: bool = True):
    """A NIfTI's header (nibabel image, data not read); ``series``: it must be a 4-D time series (a run).

    Raises :class:`DataValidationError` naming the file: not found, a folder, unreadable, or (``series``)
    not 4-D. The planner reads runs through it too, so both refuse a 3-D run alike.
    """
    if not path.exists():
        raise DataValidationError(f"{path}: {what} not found")
    if path.is_dir():
        raise DataValidationError(f"{path}: is a folder, expected a NIfTI {what}")
    try:
        img = nib.load(str(path))
    except Exception as exc:  # nibabel raises many types for bad files
        raise DataValidationError(
            f"{path}: unreadable or corrupted NIfTI ({type(exc).__name__}: {exc})"
        ) from exc
    if series and len(img.shape) != 4:
        shape = tuple(int(n) for n in img.shape)
        raise DataValidationError(f"{path}: is {len(shape)}-D with shape {shape}, expected a 4-D time series")
    return img


def load_mask(mask) -> tuple[np.ndarray, np.ndarray]:
    """Load a mask as a boolean 3-D array and its affine.

    Parameters
    ----------
    mask : str, Path or nibabel image
        Mask image; voxels with a value > 0 are in the mask. A 4-D image
        with a single volume is accepted.

    Returns
    -------
    mask_bool : ndarray of bool, 3-D
    affine : ndarray, shape (4, 4)

    Raises
    ------
    DataValidationError
        If the file is missing or unreadable, the image is not 3-D, or the
        mask is empty.
    """
    if isinstance(mask, (str, os.PathLike)):
        name = str(mask)
        img = load_image(Path(mask), "mask file", series=False)
    elif hasattr(mask, "dataobj") and hasattr(mask, "affine"):
        img = mask
        name = img.get_filename() or "mask image"
    else:
        raise TypeError(f"mask must be a path or a nibabel image, got {type(mask).__name__}")
    try:
        data = np.asanyarray(img.dataobj)
    except Exception as exc:
        raise DataValidationError(
            f"{name}: unreadable or corrupted mask ({type(exc).__name__}: {exc})"
        ) from exc
    if data.ndim == 4 and data.shape[3] == 1:
        data = data[..., 0]
    if data.ndim != 3:
        raise DataValidationError(f"{name}: mask must be 3-D, got shape {data.shape}")
    with np.errstate(invalid="ignore"):
        mask_bool = np.asarray(data > 0)  # NaN counts as outside
    if not mask_bool.any():
        raise DataValidationError(f"{name}: mask is empty (no voxel > 0)")
    return mask_bool, np.asarray(img.affine, dtype=np.float64)


def mask_to_image(values, mask) -> nib.Nifti1Image:
    """Paint mask-voxel values back into a 3-D or 4-D NIfTI image.

    Parameters
    ----------
    values : array_like, shape (D,) or (D, K)
        One value per mask voxel (``mask[mask]`` order), or K maps as columns.
    mask : str, Path or nibabel image
        The mask the values were extracted with.

    Returns
    -------
    nibabel.Nifti1Image
        float32 image on the mask's grid, 0 outside the mask; 3-D for a
        vector, 4-D (one volume per column) for a matrix.
    """
    if isinstance(mask, (str, os.PathLike)):
        mask = load_image(Path(mask), "mask file", series=False)
    mask_bool, affine = load_mask(mask)
    vals = np.asarray(values)
    D = int(mask_bool.sum())
    if vals.ndim not in (1, 2):
        raise ValueError(f"values must be a D-vector or a D x K matrix, got shape {vals.shape}")
    if vals.shape[0] != D:
        raise ValueError(f"values have {vals.shape[0]} rows but the mask has {D} voxels")
    vol = np.zeros(mask_bool.shape + vals.shape[1:], dtype=np.float32, order="F")
    vol[mask_bool] = vals
    img = nib.Nifti1Image(vol, affine)
    src = getattr(mask, "header", None)
    if isinstance(src, nib.Nifti1Header):  # keep the mask's space codes (e.g. MNI)
        img.header.set_sform(affine, code=int(src["sform_code"]) or "aligned")
        img.header.set_qform(affine, code=int(src["qform_code"]) or "aligned")
        img.header.set_xyzt_units(*src.get_xyzt_units())
    return img


# ---------------------------------------------------------------------------
# discovery and header validation
# ---------------------------------------------------------------------------

#: the template grids a run may name instead of a mask (RunConfig.space)
SPACES = ("mni3mm", "mni4mm", "mni6mm", "grid30")

#: expected in-mask voxel counts; used as a sanity check
_EXPECTED_VOXELS = {"mni3mm": 69_765, "mni4mm": 29_398, "mni6mm": 8_735, "grid30": 900}


def load_space(space: str) -> tuple[np.ndarray, np.ndarray]:
    """Boolean 3-D mask and affine of an analysis space.

    Parameters
    ----------
    space : {"mni3mm", "mni4mm", "mni6mm", "grid30"}
        ``"mni3mm"`` / ``"mni4mm"`` / ``"mni6mm"``: nilearn's shipped MNI152
        brain mask at 3 / 4 / 6 mm isotropic (69,765 / 29,398 / 8,735 voxels;
        no download needed).
        ``"grid30"``: the papers' 30 x 30 2-D grid as a 30 x 30 x 1 volume
        with an identity affine and every voxel in the mask (D = 900).

    Returns
    -------
    mask : ndarray of bool, 3-D
    affine : ndarray, shape (4, 4)
    """
    mask, affine = _load_space_cached(space)
    return mask.copy(), affine.copy()


@functools.lru_cache(maxsize=None)
def _load_space_cached(space: str) -> tuple[np.ndarray, np.ndarray]:
    # nilearn's import and the mask read take ~2 s: do them once per process
    if space == "grid30":
        return np.ones((30, 30, 1), dtype=bool), np.eye(4)
    if space not in SPACES:
        raise ValueError(f"unknown space {space!r}; choose one of {', '.join(SPACES)}")
    res = int(space[3])
    from nilearn import datasets, image  # deferred: nilearn is slow to load and only the templates need it

    img = datasets.load_mni152_brain_mask(resolution=res)
    if not np.allclose(img.header.get_zooms()[:3], res):
        # older nilearn versions ignore `resolution`: resample ourselves
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            img = image.resample_img(
                img,
                target_affine=np.diag([res] * 3),
                interpolation="nearest",
                force_resample=True,
                copy_header=True,
            )
    mask = np.asarray(img.dataobj) > 0
    n_vox = int(mask.sum())
    expected = _EXPECTED_VOXELS[space]
    if abs(n_vox - expected) > 0.02 * expected:  # pragma: no cover - nilearn change
        warnings.warn(
            f"{space} mask has {n_vox} voxels, expected about {expected}",
            RuntimeWarning,
            stacklevel=2,
        )
    return mask, np.asarray(img.affine, dtype=np.float64)


def _is_nifti(p: Path) -> bool:
    return p.is_file() and not p.name.startswith(".") and p.name.endswith(NIFTI_SUFFIXES)


def find_nifti(paths_or_dir) -> list[Path]:
    """Resolve a folder, a file or a list of files to a list of NIfTI paths.

    A folder is searched for ``*.nii`` / ``*.nii.gz`` (hidden files skipped),
    sorted by name; a BIDS folder (``sub-*`` sub-folders) for the BOLD runs in
    ``sub-*/[ses-*/]func/``. Listed paths are kept in the given order and are
    checked later, when validated. :func:`find_subjects` groups them by person.
    """
    return [f for _, files in find_subjects(paths_or_dir).subjects for f in files]


#: BIDS entities a site may filter its runs by (config ``[bids]``); ``res`` and ``desc`` for fMRIPrep outputs
BIDS_FILTERS = ("task", "space", "session", "run", "res", "desc")
_BIDS_KEYS = {"task": "task", "space": "space", "session": "ses", "run": "run", "res": "res", "desc": "desc"}

_SURFACE_SUFFIXES = (".func.gii", ".surf.gii", ".shape.gii", ".dtseries.nii", ".dscalar.nii", ".ptseries.nii")


def is_mni_space(space: str) -> bool:
    """Whether a BIDS ``space`` label names an MNI template (MNI152NLin2009cAsym, MNI152NLin6Asym, ...)."""
    return space.upper().startswith("MNI")


def companion_names(bold) -> dict[str, str]:
    """The files fMRIPrep writes beside a run, by role: its brain mask, boldref, JSON sidecar, confounds table."""
    parts, _, ext = split_name(bold)
    nodesc = [x for x in parts if not x.startswith("desc-")]
    stem = Path(bold).name[: -len(ext)]
    return {"mask": "_".join(nodesc + ["desc-brain", "mask"]) + ext, "boldref": "_".join(nodesc + ["boldref"]) + ext,
            "sidecar": stem + ".json", "confounds": confounds_name(bold),
            "confounds_json": confounds_name(bold)[: -len(".tsv")] + ".json",
            "confounds_old": confounds_name(bold, "regressors"),
            "confounds_old_json": confounds_name(bold, "regressors")[: -len(".tsv")] + ".json"}


def _run_identity(path) -> tuple[str, ...]:
    parts, suffix, _ = split_name(path)
    return tuple(x for x in parts if x.partition("-")[0] not in VERSION_KEYS) + (suffix,)


def _outside_func_reason(f: Path, rel: Path) -> str:
    where = next((d for d in ("anat", "figures", "fmap", "dwi", "log") if d in rel.parts[:-1]), None)
    kind = {"anat": "anatomical output", "figures": "report figure", "fmap": "field map", "dwi": "diffusion data",
            "log": "log"}.get(where)
    return f"not a functional run (outside sub-*/[ses-*/]func/{': ' + where + '/, ' + kind if where else ''})"


def _same_label(have: str | None, want: str) -> bool:
    if have is None:
        return False
    if have.isdigit() and str(want).isdigit():
        return int(have) == int(want)  # run-01 and run-1 are the same run
    return have == str(want)


@dataclass
class SubjectDiscovery:
    """The subjects of a site: each person's files (runs and sessions, in order), and what was skipped."""

    subjects: list[tuple[str, list[Path]]]
    skipped: list[tuple[str, str]]  # (path, why)
    #: files fMRIPrep wrote beside each kept run, by role (mask, boldref, sidecar, confounds, confounds_json)
    companions: dict[str, dict[str, str]] = None
    #: subjects left out on purpose (``exclude``): (subject, why)
    excluded: list[tuple[str, str]] = None
    #: the filters applied, defaults included (e.g. desc=preproc in an fMRIPrep tree)
    filters: dict[str, str] = None


def _is_bids_folder(p: Path) -> bool:
    return any(c.is_dir() and c.name.startswith("sub-") for c in p.iterdir())


def _read_subject_map(path) -> dict[str, str]:
    """file -> subject id from a TSV with columns ``file`` and ``subject``."""
    path = Path(path)
    if not path.is_file():
        raise DataValidationError(f"{path}: subject mapping file not found")
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    if not rows or not {"file", "subject"} <= set(rows[0]):
        raise DataValidationError(f"{path}: a subject mapping needs a header with the columns 'file' and 'subject'")
    out = {}
    for i, r in enumerate(rows, start=2):
        if not r["file"] or not r["subject"]:
            raise DataValidationError(f"{path}, line {i}: empty file or subject")
        out[r["file"]] = r["subject"]
    return out


def find_subjects(source, *, filters: dict | None = None, subjects_tsv=None, exclude=(),
                  default_desc: str | None = "preproc") -> SubjectDiscovery:
    """The subjects (people) of a site and the files of each: the privacy unit is the person.

    ``source`` is a folder, a file or a list of files. In a BIDS folder (a BIDS
    root, an fMRIPrep derivatives root, or a site folder of
    ``sub-*/[ses-*/]func/*_bold.nii[.gz]``) every run and session of one
    ``sub-`` label forms one subject. Every other file under ``sub-*/`` is
    skipped and listed with the reason: ``anat/``, ``figures/``, surface and
    CIFTI outputs, non-BOLD files, and the files fMRIPrep writes beside a run
    (brain mask, boldref, JSON sidecar, confounds table), which are returned
    in ``companions`` for the runs that are read and listed as skipped for the
    others. ``filters`` keeps only runs whose BIDS entities match (``task``,
    ``space``, ``session``, ``run``, ``res``, ``desc``); when it names no
    ``desc`` and runs carry one (fMRIPrep), only ``desc-<default_desc>`` runs
    are read. Runs in a native space (``space-T1w``, any space not MNI) are
    left out and listed when the same run is kept in an MNI space, and refused
    otherwise; the same run kept twice (two spaces, resolutions or descs) is
    refused. ``exclude``: subject ids to leave out (listed in ``excluded``).
    Elsewhere, files named ``sub-<label>_...`` belong to subject
    ``sub-<label>``; other files are one subject each, unless ``subjects_tsv``
    (columns ``file``, ``subject``; paths relative to the folder) maps files to
    subjects.
    """
    filters = {k: v for k, v in (filters or {}).items() if v not in (None, "")}
    unknown = set(filters) - set(BIDS_FILTERS)
    if unknown:
        raise DataValidationError(f"unknown BIDS filter(s) {sorted(unknown)}; use {list(BIDS_FILTERS)}")
    explicit = dict(filters)
    skipped: list[tuple[str, str]] = []
    others: list[Path] = []  # files in func/ that are not runs: companions of a kept run, or skipped
    base: Path | None = None
    if isinstance(source, (str, os.PathLike)):
        p = Path(source)
        if p.is_dir():
            base = p
            if _is_bids_folder(p):
                files = []
                for f in sorted(p.rglob("*")):
                    rel = f.relative_to(p)
                    if not f.is_file() or any(part.startswith(".") for part in rel.parts):
                        continue
                    if len(rel.parts) < 2 or not rel.parts[0].startswith("sub-"):
                        continue  # dataset_description.json, sub-01.html, logs/: not a subject's data
                    if f.name.endswith(_SURFACE_SUFFIXES):
                        kind = "CIFTI" if f.name.endswith(".nii") else "surface (GIFTI)"
                        skipped.append((str(f), f"{kind} output: not a volume on the analysis grid"))
                    elif f.parent.name != "func":
                        skipped.append((str(f), _outside_func_reason(f, rel)))
                    elif (f.name.endswith(NIFTI_SUFFIXES) and bids_entities(f)
                          and f.name.split(".")[0].endswith("_bold")):
                        files.append(f)
                    else:
                        others.append(f)
            else:
                files = sorted(f for f in p.iterdir() if _is_nifti(f))
            if not files:
                raise DataValidationError(f"{p}: no NIfTI files (*.nii, *.nii.gz) found"
                                          + (f"; skipped {len(skipped)} file(s), e.g. {skipped[0][0]}: "
                                             f"{skipped[0][1]}" if skipped else ""))
        elif not p.exists():
            raise DataValidationError(f"{p}: file or folder not found")
        else:
            files = [p]
    else:
        files = [Path(f) for f in source]
        if not files:
            raise DataValidationError("no input files given")
        seen: set[Path] = set()
        for f in files:
            if f.absolute() in seen:
                raise DataValidationError(f"{f}: listed twice")
            seen.add(f.absolute())

    # fMRIPrep writes several versions of a run (desc-preproc, desc-smoothAROMAnonaggr): read one of them
    why_default: dict[str, str] = {}
    if "desc" not in filters and default_desc and base is not None and any("desc" in bids_entities(f) for f in files):
        filters["desc"] = default_desc
        why_default["desc"] = " (the default for fMRIPrep outputs)"
    kept = []
    for f in files:
        ent = bids_entities(f)
        miss = [k for k, v in filters.items() if not _same_label(ent.get(_BIDS_KEYS[k]), v)]
        if miss:
            skipped.append((str(f), "BIDS filter " + ", ".join(f"{k}={filters[k]}{why_default.get(k, '')}"
                                                               for k in miss)))
        else:
            kept.append(f)
    if not kept:
        raise DataValidationError(f"{source}: no file matches the BIDS filters {filters}")

    # native space: the consortium grid is an MNI template; a T1w-space run cannot be resampled onto it
    mni = {_run_identity(f) for f in kept if is_mni_space(bids_entities(f).get("space", ""))}
    out = []
    for f in kept:
        space = bids_entities(f).get("space")
        if space is None or is_mni_space(space):
            out.append(f)
        elif "space" not in explicit and _run_identity(f) in mni:
            skipped.append((str(f), f"native space (space-{space}): not on the MNI analysis grid; the run's MNI "
                                    "version is read"))
        else:
            raise DataValidationError(
                f"{f}: native space (space-{space}) cannot be put on the consortium's MNI analysis grid; read the "
                "run's MNI-space output (fMRIPrep --output-spaces MNI152NLin2009cAsym, config bids.space)")
    kept = out
    # the same run twice (two spaces, resolutions or descs) would count one person's data twice
    by_run: dict[tuple, Path] = {}
    for f in kept:
        key = (str(f.parent), _run_identity(f))
        if key in by_run:
            raise DataValidationError(
                f"{f}: the same run as {by_run[key].name} in another space, resolution or desc; choose one with "
                "the config's bids filters (space, res, desc)")
        by_run[key] = f

    mapping = _read_subject_map(subjects_tsv) if subjects_tsv else None
    groups: dict[str, list[Path]] = {}
    for f in kept:
        if mapping is not None:
            names = [str(f), f.name] + ([str(f.relative_to(base))] if base and f.is_relative_to(base) else [])
            key = next((k for k in names if k in mapping), None)
            if key is None:
                raise DataValidationError(f"{f}: not listed in the subject mapping {subjects_tsv}")
            sid = mapping[key]
        else:
            sid = subject_id_from_path(f)
        groups.setdefault(sid, []).append(f)

    excluded = []
    unknown_ex = [x for x in exclude if x not in groups]
    if unknown_ex:
        raise DataValidationError(f"{source}: exclude names {unknown_ex}, not subject(s) of this site "
                                  f"(subjects: {sorted(groups)})")
    for sid in exclude:
        for f in groups.pop(sid):
            skipped.append((str(f), f"subject {sid} left out by the configuration (exclude)"))
        excluded.append((sid, "left out by the configuration (exclude)"))
    if not groups:
        raise DataValidationError(f"{source}: every subject is excluded")

    # the files fMRIPrep wrote beside each run that is read; the rest of func/ is listed as not used
    by_name = {(f.parent, f.name): f for f in others}
    companions: dict[str, dict[str, str]] = {}
    claimed: set[Path] = set()
    for fs in groups.values():
        for f in fs:
            comp = {}
            for role, name in companion_names(f).items():
                c = by_name.get((f.parent, name))
                if c is not None:
                    comp[role.replace("_old", "")] = str(c)
                    claimed.add(c)
            companions[str(f)] = comp
    for f in others:
        if f in claimed:
            continue
        n = f.name
        why = ("brain mask of a run not read" if n.endswith(("_mask.nii.gz", "_mask.nii"))
               else "boldref of a run not read" if "_boldref." in n
               else "confounds of a run not read" if "_desc-confounds_" in n
               else "sidecar of a run not read" if n.endswith("_bold.json")
               else "not a BOLD run (*_bold.nii[.gz])")
        skipped.append((str(f), why))
    return SubjectDiscovery(list(groups.items()), skipped, companions, excluded, filters)



def subject_lengths(source, cleaning, *, filters: dict | None = None, subjects_tsv=None, exclude=()) -> list[int]:
    """Each subject's number of time points at a site, as its loader will count them, from headers alone.

    The same discovery as :func:`find_subjects` (BIDS filters, fMRIPrep's default desc, ``exclude``); each
    run's volumes from its header (a 3-D image refused by :func:`load_image`) and, when ``cleaning`` scrubs,
    the volumes its confounds table keeps. No image data are read.
    """
    def columns(f) -> int:
        n = int(load_image(f).shape[3])
        if not cleaning.confounds:
            return n
        _, kept = run_confounds(f, cleaning, n)
        return n if kept is None else len(kept)

    found = find_subjects(source, filters=filters, subjects_tsv=subjects_tsv, exclude=tuple(exclude),
                          default_desc=cleaning.desc)
    return [sum(columns(f) for f in files) for _, files in found.subjects]


def subject_id_from_path(path) -> str:
    """The person a file belongs to: ``sub-<label>`` for BIDS names, else the name without ``_bold``."""
    ent = bids_entities(path)
    if "sub" in ent and Path(path).name.startswith("sub-"):
        return f"sub-{ent['sub']}"
    name = Path(path).name
    for suffix in (".nii.gz", ".nii"):
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    if name.endswith("_bold") and len(name) > len("_bold"):
        name = name[: -len("_bold")]
    return name


def _expected_bytes(img) -> int | None:
    """Uncompressed size (header + data) a single-file NIfTI must have."""
    try:
        # the array proxy holds the offset actually used for reading (the
        # header field can read 0 after nibabel loads a file)
        offset = int(img.dataobj.offset)
        n = int(np.prod(img.shape, dtype=np.int64)) * img.header.get_data_dtype().itemsize
    except Exception:  # unusual header: skip the size check
        return None
    return offset + n


def _check_complete(path: Path, img) -> None:
    """Detect truncated files cheaply, before the data are read.

    For ``.nii`` compare the file size with what the header needs. For
    ``.nii.gz`` compare the gzip trailer's uncompressed size (ISIZE, mod
    2**32) with it; only if they differ (truncation, or a legitimate
    multi-member / padded gzip) decompress the file to decide.
    """
    expected = _expected_bytes(img)
    if expected is None:
        return
    if not path.name.endswith(".gz"):
        size = path.stat().st_size
        if size < expected:
            raise DataValidationError(
                f"{path}: truncated file ({size} bytes, the header needs {expected})"
            )
        return
    with open(path, "rb") as f:
        f.seek(0, os.SEEK_END)
        if f.tell() < 18:
            raise DataValidationError(f"{path}: corrupted gzip file (too short)")
        f.seek(-4, os.SEEK_END)
        isize = struct.unpack("<I", f.read(4))[0]
    if isize == expected % 2**32:
        return
    n = 0
    try:
        with gzip.open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                n += len(chunk)
    except (EOFError, OSError, zlib.error) as exc:
        raise DataValidationError(
            f"{path}: corrupted or truncated gzip file ({type(exc).__name__}: {exc})"
        ) from exc
    if n < expected:
        raise DataValidationError(
            f"{path}: truncated data ({n} bytes uncompressed, the header needs {expected})"
        )


def _tr_seconds(img) -> float:
    zooms = img.header.get_zooms()
    tr = float(zooms[3]) if len(zooms) > 3 else 0.0
    try:
        unit = img.header.get_xyzt_units()[1]
    except Exception:
        unit = "unknown"
    return tr * _TIME_UNIT_SECONDS.get(unit, 1.0)


def _declares_mni(path: Path, img) -> bool:
    """Whether a run says it is in an MNI space: its ``space-`` entity, else its header's sform/qform code."""
    space = bids_entities(path).get("space")
    if space is not None:
        return is_mni_space(space)
    try:
        return 4 in (int(img.header["sform_code"]), int(img.header["qform_code"]))  # NIFTI_XFORM_MNI_152
    except (KeyError, ValueError, TypeError):
        return False


def _inspect(path: Path, mask_shape, mask_affine, min_volumes: int) -> tuple[int, float, str | None]:
    """Header-level checks of one subject file; returns (n_volumes, tr, resample_from).

    A run in an MNI space (its name or header says so) on another grid is resampled to the analysis grid:
    ``resample_from`` describes its grid; None when it is on the analysis grid already.
    """
    img = load_image(path)  # refuses a run that is not 4-D
    shape = tuple(int(s) for s in img.shape)
    dtype = img.header.get_data_dtype()
    if dtype.fields is not None or not np.issubdtype(dtype, np.number) or np.issubdtype(
        dtype, np.complexfloating
    ):
        raise DataValidationError(f"{path}: unsupported data type {dtype}")
    resample_from = None
    same_grid = shape[:3] == tuple(mask_shape)
    diff = np.abs(np.asarray(img.affine) - mask_affine).max() if same_grid else np.inf
    if not (same_grid and diff <= _AFFINE_ATOL):
        if _declares_mni(path, img):
            zooms = ", ".join(f"{z:g}" for z in img.header.get_zooms()[:3])
            resample_from = f"grid {shape[:3]} at ({zooms}) mm"
        elif not same_grid:
            raise DataValidationError(
                f"{path}: grid mismatch: image grid {shape[:3]} differs from the mask grid "
                f"{tuple(mask_shape)} (a run named space-MNI... or with an MNI header is resampled to it)"
            )
        else:
            raise DataValidationError(
                f"{path}: affine mismatch: the image affine differs from the mask's by up to "
                f"{diff:.4g} (tolerance {_AFFINE_ATOL}); resample it to the mask grid first"
            )
    if shape[3] < min_volumes:
        raise DataValidationError(
            f"{path}: only {shape[3]} volumes, fewer than min_volumes={min_volumes}"
        )
    _check_complete(path, img)
    return shape[3], _tr_seconds(img), resample_from


def _sidecar_tr(path: Path, header_tr: float, sidecar: str | None) -> float:
    """The run's TR: the JSON sidecar's ``RepetitionTime`` when there is one (it must agree with the header's)."""
    if not sidecar:
        return header_tr
    try:
        rt = json.loads(Path(sidecar).read_text()).get("RepetitionTime")
    except (OSError, ValueError) as exc:
        raise DataValidationError(f"{sidecar}: unreadable JSON sidecar of {path.name} ({exc})") from exc
    if rt is None:
        return header_tr
    if isinstance(rt, bool) or not isinstance(rt, (int, float)) or not rt > 0:
        raise DataValidationError(f"{sidecar}: RepetitionTime {rt!r} is not a positive number of seconds")
    if header_tr > 0 and not np.isclose(header_tr, rt, rtol=_TR_RTOL, atol=1e-6):
        raise DataValidationError(f"{path}: the header's TR {header_tr:g} s disagrees with RepetitionTime "
                                  f"{rt:g} s of its sidecar {Path(sidecar).name}")
    return float(rt)


@dataclass
class RunPlan:
    """What the header pass learned of one run, and how it is decoded."""

    path: Path
    subject: str
    n_volumes: int
    tr: float
    resample_from: str | None = None
    confounds: np.ndarray | None = None
    sample_mask: np.ndarray | None = None
    companions: dict | None = None
    coverage: float | None = None

    @property
    def n_columns(self) -> int:
        """Columns the run adds to the site matrix (volumes kept after scrubbing)."""
        return self.n_volumes if self.sample_mask is None else int(len(self.sample_mask))

    def record(self, cleaning) -> dict:
        """The run's entry in the site's record (public to the site's report; no data)."""
        comp = self.companions or {}
        used = {"sidecar": comp.get("sidecar"), "mask": comp.get("mask")}
        if cleaning is not None and cleaning.confounds:
            used["confounds"] = comp.get("confounds")
            if cleaning.strategy:
                used["confounds_json"] = comp.get("confounds_json")
        return {"path": str(self.path), "subject": self.subject, "tr": self.tr, "volumes": self.n_volumes,
                "columns": self.n_columns, "resampled_from": self.resample_from, "mask_coverage": self.coverage,
                "companions_used": {k: v for k, v in used.items() if v},
                # which volumes the columns are (scrubbing keeps some): the time courses index them
                "kept_volumes": None if self.sample_mask is None else [int(v) for v in self.sample_mask]}


def _mask_coverage(run_mask: str, mask: np.ndarray, target) -> float:
    """Fraction of the analysis mask's voxels inside a run's own brain mask (fMRIPrep ``desc-brain_mask``)."""
    img = load_image(Path(run_mask), "brain mask", series=False)
    if img.shape[:3] != mask.shape or np.abs(img.affine - target.affine).max() > _AFFINE_ATOL:
        from nilearn.image import resample_to_img  # deferred: nilearn is slow to load, only resampling needs it

        img = resample_to_img(img, target, interpolation="nearest", force_resample=True, copy_header=True)
    return float((np.asarray(img.dataobj).reshape(mask.shape)[mask] > 0).mean())


# ---------------------------------------------------------------------------
# per-subject reading
# ---------------------------------------------------------------------------

class _NonFinite(Exception):
    pass


#: volumes resampled (and smoothed) at a time: a 2 mm run's memory is a chunk's, whatever its length
RESAMPLE_CHUNK = 50


def resampled_block(path, mask: np.ndarray, *, target=None, smoothing_fwhm: float | None = None,
                    chunk: int | None = RESAMPLE_CHUNK) -> np.ndarray:
    """A run resampled to ``target`` (nilearn, continuous) and/or smoothed (nilearn), masked: D x T.

    Volumes are read, resampled and smoothed ``chunk`` at a time (None: all at once); both act on each
    volume alone, so the block is the same as the whole run's. When the run's grid and the target's differ by
    a zoom and a shift per axis, both steps are three matrix products per chunk
    (:mod:`dpneuro.data.resample`, equal to nilearn's up to float32 rounding), in float32 for float32 and 8- or
    16-bit data (which it holds exactly) and float64 otherwise; otherwise nilearn resamples each volume,
    float32 data in float32 and others in float64.
    """
    img = nib.load(str(path), keep_file_open=True)  # a .nii.gz is then decompressed once, chunk after chunk
    affine = img.affine if target is None else target.affine
    op = separable_operator(img.affine, img.shape[:3], affine, mask, smoothing_fwhm)
    n = img.shape[3]
    step = n if chunk is None else max(int(chunk), 1)
    block, bad = None, None
    for a in range(0, n, step):
        data = op.read(img.dataobj, a, a + step) if op is not None else np.asanyarray(img.dataobj[..., a:a + step])
        if data.dtype.kind == "f":  # resampling would spread (or hide) a NaN: refuse it before, as the fast path
            b = ~np.isfinite(data).all(axis=-1)
            bad = b if bad is None else bad | b
            if bad.any():
                continue  # only count the voxels from here on
        m = op.apply(data) if op is not None else _nilearn_resampled(data, img, target, smoothing_fwhm, mask)
        if block is None:
            block = np.empty((m.shape[0], n), np.float32 if m.dtype == np.float32 else np.float64)
        block[:, a:a + m.shape[1]] = m
    if bad is not None and bad.any():
        raise _NonFinite(f"{path}: non-finite values (NaN/inf) in {int(bad.sum())} voxel(s) of the run")
    return block


def _nilearn_resampled(data: np.ndarray, img, target, smoothing_fwhm: float | None, mask: np.ndarray) -> np.ndarray:
    """Volumes resampled to ``target`` (continuous) and smoothed by nilearn, at the mask's voxels."""
    from nilearn.image import resample_to_img, smooth_img  # deferred: nilearn is slow to load

    part = nib.Nifti1Image(data, img.affine, img.header)
    if target is not None:
        part = resample_to_img(part, target, interpolation="continuous", force_resample=True, copy_header=True,
                               clip=False)
    if smoothing_fwhm:  # after resampling: smoothed on the analysis grid, as nilearn's maskers do
        part = smooth_img(part, smoothing_fwhm)
    return np.asarray(part.dataobj)[mask]


def _read_subject(path: Path, mask: np.ndarray, standardize: bool, detrend: bool, *, target=None,
                  smoothing_fwhm: float | None = None, cleaning=None, tr: float | None = None, confounds=None,
                  sample_mask=None) -> np.ndarray:
    """Masked D x T float32 block of one subject, preprocessed.

    ``target`` (the analysis grid as an image): resample the run to it first (nilearn, continuous
    interpolation); ``smoothing_fwhm``: then smooth it (nilearn). ``cleaning`` with temporal steps: clean the
    masked block with ``nilearn.signal.clean``; otherwise z-score / detrend it (:func:`preprocess`).
    """
    try:
        if target is not None or smoothing_fwhm:
            block = resampled_block(path, mask, target=target, smoothing_fwhm=smoothing_fwhm,
                                    chunk=RESAMPLE_CHUNK)
        else:
            proxy = nib.load(str(path)).dataobj
            # the stored values, masked first: scaling only the mask's voxels, in float32, avoids a float64
            # copy of the whole grid
            block = np.asarray(proxy.get_unscaled())[mask]
            slope, inter = float(proxy.slope), float(proxy.inter)  # nibabel: 1 and 0 when the header has none
            # float32 holds every 8- and 16-bit integer and float32 value exactly; wider types keep float64
            block = block.astype(np.float32 if block.dtype.itemsize <= 2 or block.dtype == np.float32
                                 else np.float64, copy=False)
            if slope != 1.0:
                block = block * block.dtype.type(slope)
            if inter != 0.0:
                block += block.dtype.type(inter)
    except _NonFinite as exc:
        raise DataValidationError(str(exc)) from None
    except Exception as exc:
        raise DataValidationError(
            f"{path}: unreadable or corrupted data ({type(exc).__name__}: {exc})"
        ) from exc
    finite = np.isfinite(block)
    if not finite.all():
        n_bad = int((~finite.all(axis=1)).sum())
        raise DataValidationError(
            f"{path}: non-finite values (NaN/inf) in {n_bad} mask voxel(s)"
        )
    why = _no_signal(block)
    if why:  # it would enter the site's matrix as zeros (or a constant) and count as a subject
        raise DataValidationError(f"{path}: no signal inside the mask: {why}")
    if cleaning is not None and cleaning.temporal:
        try:
            return clean_block(block, tr=tr, cleaning=cleaning, confounds=confounds, sample_mask=sample_mask)
        except CleaningError as exc:
            raise DataValidationError(f"{path}: {exc}") from exc
    return preprocess(block, standardize=standardize, detrend=detrend)


def _no_signal(block: np.ndarray) -> str | None:
    """Why a run's masked D x T block carries no signal (every voxel 0, or every voxel constant in time), or None.

    A real run differs from its first volume at once, so this reads one or two columns of the block, not all.
    """
    first = np.asarray(block[:, 0], dtype=np.float64)
    if block.shape[1] > 1:
        tol = 10 * np.finfo(np.float32).eps * np.maximum(np.abs(first), 1.0)  # float32 precision, as preprocess
        if any((np.abs(block[:, j] - first) > tol).any() for j in range(1, block.shape[1])):
            return None
    if not first.any():
        return "every mask voxel is 0 in every volume"
    if block.shape[1] > 1:
        return f"every mask voxel is constant over its {block.shape[1]} volumes"
    return None


def decode_run(path, *, mask: np.ndarray, standardize: bool, detrend: bool, parcels=None, plan: RunPlan | None = None,
               target=None, cleaning=None) -> np.ndarray:
    """One run's D x T block as it enters the site matrix: (resampled, smoothed,) masked, cleaned, parcel-averaged.

    ``plan`` (from the header pass) carries the run's TR, confounds and whether it is resampled to ``target``.
    """
    kw = {}
    if plan is not None:
        kw = dict(target=target if plan.resample_from else None, tr=plan.tr or None, confounds=plan.confounds,
                  sample_mask=plan.sample_mask)
    if cleaning is not None:
        kw.update(cleaning=cleaning, smoothing_fwhm=cleaning.smoothing_fwhm)
        standardize, detrend = cleaning.standardize, cleaning.detrend
    try:
        block = _read_subject(Path(path), mask, standardize, detrend, **kw)
    except DataValidationError as exc:
        exc.run_path = str(path)  # which subject to leave out under on_bad_subject = "skip"
        raise
    return block if parcels is None else parcels.reduce(block)



def voxel_decoder(site: dict, mask_path, cleaning, *, standardize: bool = True):
    """``decode(path)``: a run of a loader record (``run_records``) at the mask's voxels, decoded as the loader
    decoded it (resampled, smoothed, cleaned, scrubbed), so a later pass over the site's voxels lines up with
    the columns of its matrix and time courses."""
    mask, affine = load_mask(mask_path)
    target = nib.Nifti1Image(mask.astype(np.uint8), affine)
    records = {r["path"]: r for r in site.get("run_records") or []}
    if site.get("voxels"):  # the loader kept them: read each run's columns, decode nothing again
        V = np.load(site["voxels"], mmap_mode="r")
        stops = np.cumsum([r["columns"] for r in site["run_records"]])
        cols = {r["path"]: (int(b - r["columns"]), int(b)) for r, b in zip(site["run_records"], stops)}
        return lambda path: np.array(V[:, slice(*cols[str(path)])])

    def decode(path) -> np.ndarray:
        rec = records.get(str(path), {})
        companions = {k: v for k, v in (rec.get("companions_used") or {}).items() if k != "mask"}  # no coverage
        plan = _plan_run(Path(path), rec.get("subject", ""), companions, mask, affine, target, 1, cleaning)
        return decode_run(path, mask=mask, standardize=standardize, detrend=False, plan=plan, target=target,
                          cleaning=cleaning)

    return decode

def preprocess(block: np.ndarray, *, standardize: bool = True, detrend: bool = False) -> np.ndarray:
    """A subject's D x T block as a site prepares it (the run: z-scored voxels, no detrending), float32.

    A voxel constant to float32 precision carries no signal and becomes 0.
    """
    if not (standardize or detrend):
        return np.asarray(block).astype(np.float32, copy=False)
    y = np.asarray(block).astype(np.float64)
    if detrend:
        from scipy.signal import detrend as _detrend  # deferred: scipy.signal takes about 0.3 s to load

        y = _detrend(y, axis=1, type="linear")
    if standardize:
        mean = y.mean(axis=1, keepdims=True)
        y -= mean
        std = y.std(axis=1, keepdims=True)
        # constant to float32 precision: no signal to scale, set to 0
        const = std <= 10 * np.finfo(np.float32).eps * np.maximum(np.abs(mean), 1.0)
        std[const] = 1.0
        y /= std
        y[const[:, 0]] = 0.0
    return y.astype(np.float32)


def load_site(
    paths_or_dir,
    mask,
    *,
    standardize: bool = True,
    detrend: bool = False,
    min_volumes: int = 10,
    memmap_path=None,
    progress: bool = False,
    parcels=None,
    bids: dict | None = None,
    subjects_tsv=None,
    workers: int | None = None,
    decoder=None,
    cleaning=None,
    exclude=(),
    on_bad_subject: str = "stop",
    voxels_path=None,
) -> SiteData:
    """Validate, mask and concatenate one site's 4-D fMRI files.

    Parameters
    ----------
    paths_or_dir : str, Path or sequence of paths
        A folder (its ``*.nii`` / ``*.nii.gz`` files, sorted by name; or a BIDS
        folder), one file, or a list of files (kept in the given order).
        Files are grouped into subjects (people) by :func:`find_subjects`.
    mask : str, Path or nibabel image
        Consortium mask (voxels > 0); every file must be on its grid.
    standardize : bool, default True
        Per subject, scale each voxel time course to zero mean and unit
        variance (population variance); constant voxels become 0.
    detrend : bool, default False
        Per subject, remove a linear trend (and the mean) from each voxel
        time course, before standardising.
    min_volumes : int, default 10
        Files with fewer volumes are rejected.
    memmap_path : str or Path, optional
        Write `X` into this ``.npy`` file (column-major, so that a subject's
        columns are contiguous on disk; written subject by subject) and
        return it memory-mapped read-only; a ``.json`` sidecar with the same
        stem records the metadata (see :func:`open_site_data`). Later stages
        read it block by block (:class:`NpyColumns`) and never decode the
        NIfTI files again. Default: `X` is an in-memory array.
    progress : bool, default False
        Show a tqdm progress bar while reading.
    parcels : dpneuro.data.parcellation.Parcellation, optional
        Average each subject's (preprocessed) voxels into these parcels as it
        is read, so `X` has one row per parcel; data-independent, so it costs
        no privacy.
    bids : dict, optional
        BIDS filters (``task``, ``space``, ``session``, ``run``, ``res``, ``desc``). In an
        fMRIPrep tree without a ``desc`` filter only ``desc-preproc`` runs are read
        (``desc-smoothAROMAnonaggr`` for ``confounds = "ica_aroma"``).
    subjects_tsv : str or Path, optional
        TSV mapping files to subjects (columns ``file``, ``subject``).
    workers : int, optional
        Runs decoded at the same time, in threads (gzip, nibabel and numpy
        release the GIL); default: the usable cores (:func:`resolve_workers`).
        The result does not depend on it.
    voxels_path : str or Path, optional
        With ``parcels``, also keep the decoded voxels (same columns, ``.npy``) here when decoding is costly
        (a run resampled, smoothing or temporal cleaning), for a later pass over the site's voxels (its voxel
        maps) that would otherwise decode every run again; ``SiteData.voxels_path`` says whether it was kept.
    decoder : callable, optional
        Decodes the runs elsewhere, e.g. on the site's cluster
        (:func:`dpneuro.deploy.cluster.cluster_decoder`): called with the
        subjects' runs (a list of lists of paths, after validation) and
        returns an iterator of the runs' blocks in that order, each as
        :func:`decode_run` gives it. Default: threads in this process.

    cleaning : dpneuro.data.cleaning.Cleaning, optional
        The consortium's cleaning (confounds, detrending, standardisation,
        filters, smoothing), carried out by nilearn per run with the run's
        own TR; it replaces ``standardize`` / ``detrend``. Runs in an MNI
        space on another grid are resampled to the mask's grid (nilearn,
        continuous interpolation) either way.
    exclude : sequence of str
        Subjects to leave out (listed in ``SiteData.excluded``).
    on_bad_subject : {"stop", "skip"}
        "skip": a subject whose data fail validation or decoding (a 3-D
        image, NaNs, no signal, ...) is left out and listed with the reason
        (``SiteData.excluded``), instead of stopping the site.

    Returns
    -------
    SiteData

    Raises
    ------
    DataValidationError
        Naming the file and the problem: not found, unreadable/corrupted
        (incl. truncated gzip), not 4-D, grid or affine different from the
        mask's (affine tolerance 1e-3) for a run that is not in an MNI space, fewer than `min_volumes` volumes,
        TR different from the first file's, a file listed twice,
        non-finite values inside the mask, or no signal inside it (every
        mask voxel 0, or constant in time) (both found while reading; a
        partly written `memmap_path` is then removed).
    """
    if (
        isinstance(min_volumes, bool)
        or not isinstance(min_volumes, (int, np.integer))
        or min_volumes < 1
    ):
        raise ValueError(f"min_volumes must be a positive integer, got {min_volumes!r}")
    if on_bad_subject not in ON_BAD_SUBJECT:
        raise ValueError(f"on_bad_subject must be one of {ON_BAD_SUBJECT}, got {on_bad_subject!r}")
    mask_bool, mask_affine = load_mask(mask)
    if isinstance(mask, (str, os.PathLike)):
        mask_path = str(Path(mask).absolute())
    else:
        mask_path = mask.get_filename() if hasattr(mask, "get_filename") else None
    target = nib.Nifti1Image(mask_bool.astype(np.uint8), mask_affine)  # the analysis grid, for nilearn
    found = find_subjects(paths_or_dir, filters=bids, subjects_tsv=subjects_tsv, exclude=tuple(exclude),
                          default_desc=cleaning.desc if cleaning is not None else "preproc")
    skipped = [list(x) for x in found.skipped]
    excluded = [list(x) for x in found.excluded]

    # ---- pass 1: headers (and confounds tables) only; a bad subject stops the site or is left out
    subjects: list[tuple[str, list[RunPlan]]] = []
    first: RunPlan | None = None
    for sid, runs in found.subjects:
        try:
            plans = [_plan_run(path, sid, found.companions.get(str(path), {}), mask_bool, mask_affine, target,
                               min_volumes, cleaning) for path in runs]
            ref = first or plans[0]
            for pl in plans:
                if not np.isclose(pl.tr, ref.tr, rtol=_TR_RTOL, atol=1e-6):
                    raise DataValidationError(
                        f"{pl.path}: TR {pl.tr:g} s differs from {ref.tr:g} s of {ref.path}; a site's runs are "
                        "concatenated in time and must share one TR (sites may differ)")
        except DataValidationError as exc:
            if on_bad_subject != "skip":
                raise
            _leave_out(sid, runs, exc, excluded, skipped)
            continue
        first = first or plans[0]
        subjects.append((sid, plans))
    if not subjects:
        raise DataValidationError(f"{paths_or_dir}: no subject left to read; left out: {excluded}")

    if decoder is not None and _costly(subjects, cleaning):
        raise DataValidationError("a cluster decoder reads runs on the analysis grid without cleaning; "
                                  "resampling, confounds, filters and smoothing run in this process only "
                                  "(leave 'cluster' out)")
    while True:
        try:
            keep = voxels_path if parcels is not None and decoder is None and _costly(subjects, cleaning) else None
            site = _decode_site(subjects, mask_bool, target, parcels, memmap_path, progress, workers, decoder,
                                cleaning, standardize, detrend, keep)
            break
        except DataValidationError as exc:
            sid = next((sid for sid, ps in subjects for pl in ps if str(pl.path) == getattr(exc, "run_path", None)),
                       None)
            if on_bad_subject != "skip" or sid is None:
                raise
            _leave_out(sid, [pl.path for pl in dict(subjects)[sid]], exc, excluded, skipped)
            subjects = [(s, ps) for s, ps in subjects if s != sid]
            if not subjects:
                raise DataValidationError(f"{paths_or_dir}: no subject left to read; left out: {excluded}") from exc

    X, ids, boundaries = site
    plans = [pl for _, ps in subjects for pl in ps]
    for pl in plans:  # what fMRIPrep wrote beside a run and the cleaning does not use
        used = set(pl.record(cleaning)["companions_used"].values())
        for role, f in (pl.companions or {}).items():
            if f not in used:
                why = {"boldref": "boldref: not used", "confounds": "confounds table not used (confounds = off)",
                       "confounds_json": "confounds sidecar not used"}.get(role, f"{role}: not used")
                skipped.append([f, why])
    tr = first.tr
    site = SiteData(
        X=X,
        subject_ids=ids,
        boundaries=boundaries,
        paths=[str(pl.path) for pl in plans],
        runs=[[str(pl.path) for pl in ps] for _, ps in subjects],
        skipped=skipped,
        tr=tr if tr > 0 else None,
        mask_path=mask_path,
        standardize=cleaning.standardize if cleaning is not None else standardize,
        detrend=cleaning.detrend if cleaning is not None else detrend,
        memmap_path=str(memmap_path) if memmap_path is not None else None,
        excluded=excluded,
        cleaning=({**cleaning.to_json(), "description": cleaning.describe()} if cleaning is not None else None),
        run_records=[pl.record(cleaning) for pl in plans],
        filters=dict(found.filters),
        voxels_path=str(keep) if keep is not None else None,
    )
    for f, why in skipped:
        _log.info("not used: %s (%s)", f, why)
    if memmap_path is not None:
        memmap_path = Path(memmap_path)
        site.X = np.load(memmap_path, mmap_mode="r")
        with open(memmap_path.with_suffix(".json"), "w") as f:
            json.dump(site.metadata(), f, indent=1, default=_json_default)
    return site


#: what a site does with a subject whose files are bad: stop (default) or leave it out and go on
ON_BAD_SUBJECT = ("stop", "skip")


def _leave_out(sid: str, runs, exc: Exception, excluded: list, skipped: list) -> None:
    reason = f"left out (on_bad_subject = 'skip'): {exc}"
    _log.warning("subject %s %s", sid, reason)
    excluded.append([sid, reason])
    skipped.extend([str(f), f"subject {sid} left out: bad data"] for f in runs)


def _plan_run(path: Path, sid: str, companions: dict, mask: np.ndarray, mask_affine, target, min_volumes: int,
              cleaning) -> RunPlan:
    """Header pass over one run: checks, its TR, whether it is resampled, its confounds and scrubbing mask."""
    n, header_tr, resample_from = _inspect(path, mask.shape, mask_affine, min_volumes)
    pl = RunPlan(path=path, subject=sid, n_volumes=n, tr=_sidecar_tr(path, header_tr, companions.get("sidecar")),
                 resample_from=resample_from, companions=companions)
    if cleaning is not None:
        try:
            pl.confounds, pl.sample_mask = run_confounds(path, cleaning, n)
        except CleaningError as exc:
            raise DataValidationError(str(exc)) from exc
        if (cleaning.high_pass or cleaning.low_pass) and not pl.tr > 0:
            raise DataValidationError(f"{path}: no TR in its header or JSON sidecar; high_pass / low_pass need it")
    if companions.get("mask"):
        pl.coverage = _mask_coverage(companions["mask"], mask, target)
    return pl


def _costly(subjects, cleaning) -> bool:
    """Whether decoding resamples or cleans: work only this process does, and more than reading a run again."""
    return any(pl.resample_from for _, ps in subjects for pl in ps) or (
        cleaning is not None and bool(cleaning.temporal or cleaning.smoothing_fwhm))


def _decode_site(subjects, mask_bool, target, parcels, memmap_path, progress, workers, decoder, cleaning,
                 standardize, detrend, voxels_path=None):
    """Pass 2: decode the runs in parallel and write them in column order (each run preprocessed on its own);
    with ``voxels_path`` the voxels too, before the parcels reduce them."""
    plans = [pl for _, ps in subjects for pl in ps]
    ids = [sid for sid, _ in subjects]
    n_cols = [sum(pl.n_columns for pl in ps) for _, ps in subjects]
    stops = np.cumsum(n_cols)
    boundaries = [(int(b - n), int(b)) for b, n in zip(stops, n_cols)]
    D, N = int(mask_bool.sum()), int(stops[-1])
    if parcels is not None:
        if parcels.n_voxels != D:
            raise DataValidationError(f"the parcellation has {parcels.n_voxels} voxels but the mask has {D}")
        D = parcels.n_parcels
    if memmap_path is not None:
        memmap_path = Path(memmap_path)
        memmap_path.parent.mkdir(parents=True, exist_ok=True)
        X = None
    else:
        X = np.empty((D, N), dtype=np.float32, order="F")

    if decoder is not None:
        blocks = decoder([[str(pl.path) for pl in ps] for _, ps in subjects])
    else:
        def decode(pl: RunPlan) -> np.ndarray:
            return decode_run(pl.path, mask=mask_bool, standardize=standardize, detrend=detrend,
                              parcels=None if voxels_path else parcels, plan=pl, target=target, cleaning=cleaning)

        blocks = ordered_map(decode, plans, workers=resolve_workers(workers))
    # the decoding threads fill the cores; BLAS threads on their small products would only contend with them
    limits = one_blas_thread() if decoder is None else contextlib.nullcontext()
    try:
        with limits, \
                (ColumnWriter(memmap_path, (D, N)) if memmap_path is not None else contextlib.nullcontext()) as out, \
                (ColumnWriter(voxels_path, (int(mask_bool.sum()), N)) if voxels_path else contextlib.nullcontext()) \
                as vox:
            a = 0
            # the blocks first: zip then runs a decoder to its end (which cleans up after itself)
            bar = progress_bar(blocks, total=len(plans), desc="load", unit="run", enabled=progress)
            for block, pl in zip(bar, plans):
                if vox is not None:
                    vox.write(block)
                    block = parcels.reduce(block)
                if block.shape != (D, pl.n_columns):
                    raise RuntimeError(f"{pl.path}: decoded to shape {block.shape}, expected {(D, pl.n_columns)}")
                if out is None:
                    X[:, a:a + block.shape[1]] = block
                else:
                    out.write(block)
                a += block.shape[1]
    except BaseException:
        getattr(blocks, "close", lambda: None)()
        for path in (memmap_path, voxels_path):
            if path is not None:
                Path(path).unlink(missing_ok=True)
        raise
    return X, ids, boundaries


def open_site_data(npy_path) -> SiteData:
    """Reopen a site matrix written by ``load_site(..., memmap_path=...)``.

    Parameters
    ----------
    npy_path : str or Path
        The ``.npy`` file; its ``.json`` sidecar must sit next to it.

    Returns
    -------
    SiteData
        With `X` memory-mapped read-only.
    """
    npy_path = Path(npy_path)
    meta_path = npy_path.with_suffix(".json")
    for p in (npy_path, meta_path):
        if not p.is_file():
            raise DataValidationError(f"{p}: file not found")
    with open(meta_path) as f:
        meta = json.load(f)
    X = np.load(npy_path, mmap_mode="r")
    if list(X.shape) != meta["shape"]:
        raise DataValidationError(
            f"{npy_path}: shape {X.shape} does not match its sidecar {meta['shape']}"
        )
    return SiteData(
        X=X,
        subject_ids=meta["subject_ids"],
        boundaries=[tuple(b) for b in meta["boundaries"]],
        paths=meta["paths"],
        runs=meta.get("runs"),
        skipped=meta.get("skipped"),
        excluded=meta.get("excluded"),
        cleaning=meta.get("cleaning"),
        run_records=meta.get("run_records"),
        filters=meta.get("filters"),
        voxels_path=meta.get("voxels_path"),
        tr=meta["tr"],
        mask_path=meta["mask_path"],
        standardize=meta["standardize"],
        detrend=meta["detrend"],
        memmap_path=str(npy_path),
    )


def private_dir(path) -> Path:
    """A folder only its owner can enter (0700), created if needed: for a site's un-noised intermediate data,
    which no other user of the machine may read."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(0o700)
    return path


def write_json(path, obj) -> Path:
    """Write JSON atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=_json_default))
    tmp.replace(path)
    return path


def _json_default(o):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    raise TypeError(type(o).__name__)


# ---------------------------------------------------------------------------
# what a site read, for its console, its record and the report
# ---------------------------------------------------------------------------

def site_data_summary(record: dict) -> dict:
    """The data side of a site's record (``site.json`` of the load stage) in brief: counts, TRs, resampling,
    subjects left out and the number of files not used (each listed in the record)."""
    runs = record.get("run_records") or []
    resampled = sorted({r["resampled_from"] for r in runs if r.get("resampled_from")})
    return {"subjects": record["n_subjects"], "runs": sum(len(r) for r in record.get("runs", [])),
            "tr": record.get("tr"), "time_points": record.get("n_samples"),
            "resampled_runs": sum(1 for r in runs if r.get("resampled_from")), "resampled_from": resampled,
            "scrubbed_volumes": sum(r["volumes"] - r["columns"] for r in runs),
            "excluded": [list(x) for x in record.get("excluded") or []],
            "files_not_used": len(record.get("skipped") or []), "filters": record.get("filters") or {}}


def describe_site_inputs(record: dict, *, files: bool = False) -> list[str]:
    """Lines for a site's console (and report): what was read, resampled and left out; with ``files`` every
    file not used, grouped by reason."""
    s = site_data_summary(record)
    name = record.get("site", "site")
    out = [f"{name}: {s['subjects']} subjects, {s['runs']} runs, {s['time_points']} time points"
           + (f", TR {s['tr']:g} s" if s["tr"] else "")
           + (f"; filters {s['filters']}" if s["filters"] else "")]
    if record.get("cleaning"):
        out.append(f"{name}: cleaning: {record['cleaning']['description']}")
    if s["resampled_runs"]:
        out.append(f"{name}: {s['resampled_runs']} run(s) resampled to the analysis grid (as nilearn's "
                   f"resample_to_img, continuous interpolation) from {', '.join(s['resampled_from'])}")
    if s["scrubbed_volumes"]:
        out.append(f"{name}: {s['scrubbed_volumes']} volume(s) censored by scrubbing")
    for sid, why in s["excluded"]:
        out.append(f"{name}: subject {sid} {why}")
    skipped = record.get("skipped") or []
    if skipped:
        out.append(f"{name}: {len(skipped)} file(s) not used" + (":" if files else " (listed in the site's record)"))
    if files:
        by_reason: dict[str, list[str]] = {}
        for f, why in skipped:
            by_reason.setdefault(why, []).append(f)
        for why, fs in by_reason.items():
            out.append(f"  {why}:")
            out.extend(f"    {f}" for f in fs)
    return out
