"""NIfTI images and masks: a run's or a mask's header, a mask as a boolean grid, values painted back onto it,
and the template spaces a run may name instead of a mask."""

from __future__ import annotations

import functools
import os
import warnings
from pathlib import Path

import nibabel as nib
import numpy as np

from dpneuro._utils.errors import DataValidationError

__all__ = ["SPACES", "load_image", "load_mask", "load_space", "mask_to_image"]


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
# template spaces
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
