"""A run put on the analysis grid and smoothed as nilearn does it, at the cost of three small matrix products.

nilearn resamples a run volume by volume (``resample_to_img``, cubic splines:
``scipy.ndimage.affine_transform`` with ``order=3``) and then smooths it
(``smooth_img``: ``gaussian_filter1d`` along each axis). When the run's grid
and the analysis grid differ only by a zoom and a shift along each axis (MNI
outputs of fMRIPrep against a template grid), both operations act on each axis
alone: scipy's spline prefilter and its spline weights are products over the
axes, and so is the Gaussian. The whole operation is then the tensor product
of three small matrices, one per axis, each found by running the same scipy
call on the identity. Applying them is three matrix products per block of
volumes, about 30 times faster than resampling every volume, and equal to
nilearn's result up to float32 rounding (``tests/data/test_resample.py``).

Grids that are rotated or sheared against each other are not separable:
:func:`separable_operator` returns None and the caller uses nilearn.
"""

from __future__ import annotations

import numpy as np
from scipy.ndimage import affine_transform, gaussian_filter1d

from dpneuro._utils.blas import one_blas_thread

__all__ = ["SeparableOperator", "separable_operator"]

#: input columns whose weights are all below this (relative to the largest) are left out of the products: the
#: cubic spline's prefilter gives every input voxel some weight, decaying by 0.27 per voxel, so this only drops
#: what float32 could not represent anyway
_NEGLIGIBLE = 1e-9


def _spline_matrix(n_in: int, n_out: int, zoom: float, shift: float) -> np.ndarray:
    """The 1-D cubic-spline resampling scipy applies along one axis (n_out x n_in): output i reads input
    coordinate zoom * i + shift. Built by resampling the identity, with nilearn's settings."""
    eye = np.eye(n_in)
    # the second axis holds one delta per column and is read at its own integer points: the spline reproduces it
    return affine_transform(eye, np.array([zoom, 1.0]), offset=np.array([shift, 0.0]), output_shape=(n_out, n_in),
                            order=3, cval=0.0)


def _gaussian_matrix(n: int, sigma: float) -> np.ndarray:
    """nilearn's smoothing along one axis (``gaussian_filter1d``, its default mode and truncation), n x n."""
    if sigma <= 0:
        return np.eye(n)
    return gaussian_filter1d(np.eye(n), sigma, axis=0)


class SeparableOperator:
    """Resampling and smoothing of a run as one matrix per axis, restricted to the mask's bounding box.

    ``apply(block)`` takes volumes on the run's grid (X x Y x Z x t) and returns the mask's voxels (D x t).
    """

    def __init__(self, matrices, inputs, mask):
        self.matrices = tuple(matrices)  # (box length x input range) per axis, float64
        self._float32 = tuple(m.astype(np.float32) for m in self.matrices)
        self.inputs = tuple(inputs)  # the input voxels the matrices read, per axis
        self._voxels = np.nonzero(mask)  # the mask (within its bounding box) in its own C order, as mask[mask]

    def read(self, dataobj, start: int, stop: int) -> np.ndarray:
        """Volumes ``start:stop`` of a nibabel data object (X x Y x Z x t, one contiguous read): float32 when
        that holds the stored values exactly (float32, 8- and 16-bit integers, scaled or not), float64
        otherwise."""
        stored = np.dtype(dataobj.dtype)
        exact = stored == np.float32 or (stored.kind in "iub" and stored.itemsize <= 2)
        return np.asanyarray(dataobj[..., start:stop]).astype(np.float32 if exact else np.float64, copy=False)

    def apply(self, block: np.ndarray) -> np.ndarray:
        """The mask's voxels (D x t) of volumes ``block`` (X x Y x Z x t) resampled and smoothed, in float32
        for float32 blocks and float64 otherwise."""
        with one_blas_thread():  # the same sums, so the same float32 result, whatever the thread count
            return self._apply(block[self.inputs])

    def _apply(self, block: np.ndarray) -> np.ndarray:
        if block.dtype != np.float32:
            return self._products(np.asfortranarray(block), self.matrices)
        # fMRI values sit far from 0 and vary little: the float32 products carry the variation around the
        # first volume, whose part is computed in float64, so their rounding is the variation's, not the level's
        first = block[..., :1]
        level = self._products(np.asfortranarray(first, dtype=np.float64), self.matrices).astype(np.float32)
        variation = np.empty(block.shape, np.float32, order="F")  # the products' input, in one pass
        np.subtract(block, first, out=variation)
        out = self._products(variation, self._float32)
        out += level
        return out

    def _products(self, block: np.ndarray, matrices) -> np.ndarray:
        ax, ay, az = matrices
        t, (nx, ny, nz) = block.shape[3], (m.shape[0] for m in (ax, ay, az))
        # a block in Fortran order (as NIfTI stores it): its transpose (t, Z, Y, X) is C-contiguous, so every
        # product runs over contiguous memory; one product per axis, not one per slice (thousands of small
        # products are slow, and slower still with BLAS threads)
        v = block.T
        v = v.reshape(-1, v.shape[3]) @ ax.T                                                    # t*Z*Y, x
        v = v.reshape(-1, block.shape[1], nx).transpose(0, 2, 1).reshape(-1, block.shape[1]) @ ay.T  # t*Z*x, y
        v = (az @ v.reshape(t, block.shape[2], -1)).reshape(t, nz, nx, ny)                      # t, z, x, y
        x, y, z = self._voxels
        return np.ascontiguousarray(v[:, z, x, y].T)


def _box(mask: np.ndarray) -> tuple[slice, ...]:
    idx = np.nonzero(mask)
    return tuple(slice(int(i.min()), int(i.max()) + 1) for i in idx)


def separable_operator(src_affine, src_shape, tgt_affine, mask: np.ndarray,
                       smoothing_fwhm: float | None = None) -> SeparableOperator | None:
    """The per-axis operator of nilearn's resampling of a run (grid ``src_affine``, ``src_shape``) to the mask's
    grid (``tgt_affine``) followed by smoothing by ``smoothing_fwhm`` mm there; None when the grids are not
    aligned axis by axis (then nilearn resamples)."""
    src_affine, tgt_affine = np.asarray(src_affine, float), np.asarray(tgt_affine, float)
    transform = np.linalg.solve(src_affine, tgt_affine)  # target voxel -> source voxel, as nilearn computes it
    A, b = transform[:3, :3], transform[:3, 3]
    if not np.all(A == np.diag(np.diag(A))) or np.any(np.diag(A) == 0):
        return None
    sigma = np.zeros(3)
    if smoothing_fwhm:  # nilearn's smooth_img on the resampled image, whose affine is the target's
        sigma = smoothing_fwhm / (np.sqrt(8 * np.log(2)) * np.sqrt((tgt_affine[:3, :3] ** 2).sum(axis=0)))
    box = _box(mask)
    mats, inputs = [], []
    for axis in range(3):
        full = _gaussian_matrix(mask.shape[axis], sigma[axis]) @ _spline_matrix(
            int(src_shape[axis]), mask.shape[axis], float(A[axis, axis]), float(b[axis]))
        rows = full[box[axis]]
        used = np.flatnonzero(np.abs(rows).max(axis=0) > _NEGLIGIBLE * np.abs(rows).max())
        if used.size == 0:  # the mask's box lies outside the run's field of view on this axis
            used = np.arange(1)
        cols = slice(int(used[0]), int(used[-1]) + 1)
        mats.append(np.ascontiguousarray(rows[:, cols]))
        inputs.append(cols)
    return SeparableOperator(tuple(mats), tuple(inputs), np.ascontiguousarray(mask[box]))
