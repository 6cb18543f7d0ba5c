"""A site's data matrix: D features x N time points, subjects concatenated in time, in memory or as a
column-major ``.npy`` read and written column block by column block; its subjects' column ranges and column
scaling."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np

from dpneuro._utils.errors import DataValidationError

__all__ = [
    "ColumnWriter",
    "NpyColumns",
    "SiteData",
    "column_blocks",
    "column_norms",
    "open_site_data",
    "scale_columns",
    "scale_factors",
    "site_matrix",
    "subject_ranges",
]


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
