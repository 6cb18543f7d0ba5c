"""Reading a site's runs into its data matrix: every run checked from its header before any image data is read,
then decoded (resampled, masked, cleaned) one at a time into the matrix; and the console summaries of a load."""

from __future__ import annotations

import contextlib
import gzip
import json
import logging
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path

import nibabel as nib
import numpy as np

from dpneuro._utils.blas import one_blas_thread
from dpneuro._utils.errors import DataValidationError
from dpneuro._utils.files import write_json
from dpneuro._utils.parallel import ordered_map, resolve_workers
from dpneuro._utils.progressbar import progress_bar
from dpneuro.data.bids import bids_entities
from dpneuro.data.cleaning import CleaningError, clean_block, run_confounds
from dpneuro.data.discovery import find_subjects, is_mni_space
from dpneuro.data.images import load_image, load_mask
from dpneuro.data.matrix import ColumnWriter, SiteData
from dpneuro.data.resample import separable_operator

__all__ = [
    "ON_BAD_SUBJECT",
    "RESAMPLE_CHUNK",
    "RunPlan",
    "decode_run",
    "describe_site_inputs",
    "load_site",
    "preprocess",
    "resampled_block",
    "site_data_summary",
    "voxel_decoder",
]

_log = logging.getLogger(__name__)

_AFFINE_ATOL = 1e-3
_TR_RTOL = 1e-3
_TIME_UNIT_SECONDS = {"sec": 1.0, "msec": 1e-3, "usec": 1e-6}


# ---------------------------------------------------------------------------
# header validation
# ---------------------------------------------------------------------------

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
        stem records the metadata (see :func:`dpneuro.data.matrix.open_site_data`). Later stages
        read it block by block (:class:`dpneuro.data.matrix.NpyColumns`) and never decode the
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
        write_json(memmap_path.with_suffix(".json"), site.metadata())
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
