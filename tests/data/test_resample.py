"""The separable resampler equals nilearn's resampling and smoothing, and steps aside where it cannot."""

from __future__ import annotations

import nibabel as nib
import numpy as np
import pytest
from nilearn.image import resample_to_img, smooth_img

from dpneuro.data.load import resampled_block
from dpneuro.data.resample import separable_operator

EPS32 = np.finfo(np.float32).eps


def _affine(zoom, origin) -> np.ndarray:
    a = np.diag([*np.broadcast_to(zoom, 3), 1.0]).astype(float)
    a[:3, 3] = origin
    return a


def _mask(shape, rng) -> np.ndarray:
    """A brain-like blob inside the grid (its bounding box is what the operator computes)."""
    idx = np.indices(shape).astype(float)
    r = sum(((i - (n - 1) / 2) / (0.35 * n)) ** 2 for i, n in zip(idx, shape))
    return (r < 1) & (rng.random(shape) < 0.95)


def _run(shape, t, rng, dtype=np.float32) -> np.ndarray:
    """fMRI-like values: a level near 1000 with 1 % fluctuations, smooth in space."""
    level = 1000 + 100 * np.sin(np.indices(shape).sum(axis=0) / 5.0)
    return (level[..., None] * (1 + 0.01 * rng.standard_normal((*shape, t)))).astype(dtype)


def _nilearn(data, src, mask, tgt, fwhm) -> np.ndarray:
    img = nib.Nifti1Image(data, src)
    out = resample_to_img(img, nib.Nifti1Image(mask.astype(np.uint8), tgt), interpolation="continuous",
                          force_resample=True, copy_header=True, clip=False)
    if fwhm:
        out = smooth_img(out, fwhm)
    return np.asarray(out.dataobj)[mask]


GRIDS = {  # source (zoom, origin, shape) -> target (zoom, origin, shape)
    "2 mm to 6 mm, shifted": ((2, (-40, -48, -30), (40, 48, 36)), (6, (-38, -50, -28), (14, 16, 12))),
    "2 mm to 3 mm": ((2, (-40, -48, -30), (40, 48, 36)), (3, (-39, -47, -29), (26, 32, 24))),
    "3 mm to 2 mm": ((3, (-39, -48, -30), (26, 32, 24)), (2, (-36, -44, -26), (34, 42, 30))),
    "target larger than the run": ((2, (-20, -24, -16), (20, 24, 16)), (4, (-40, -48, -32), (20, 24, 16))),
    "same grid (smoothing alone)": ((2, (-40, -48, -30), (40, 48, 36)), (2, (-40, -48, -30), (40, 48, 36))),
}


@pytest.mark.parametrize("grids", GRIDS.values(), ids=GRIDS.keys())
@pytest.mark.parametrize("fwhm", [None, 6.0])
def test_equals_nilearn_to_float32_rounding(grids, fwhm):
    (sz, so, sshape), (tz, to, tshape) = grids
    rng = np.random.default_rng(0)
    src, tgt, mask = _affine(sz, so), _affine(tz, to), _mask(tshape, rng)
    data = _run(sshape, 7, rng)
    want = _nilearn(data, src, mask, tgt, fwhm)
    op = separable_operator(src, sshape, tgt, mask, fwhm)
    got = op.apply(op.read(np.asfortranarray(data), 0, 7))
    assert got.dtype == np.float32 and got.shape == want.shape
    # a few float32 units of the level (nilearn's own result is float32); the fluctuations are 1e-2 of it
    np.testing.assert_allclose(got, want, rtol=0, atol=4 * EPS32 * np.abs(want).max())
    # in float64 the two agree to float64 rounding, so the operator is nilearn's, not an approximation of it
    want64 = _nilearn(data.astype(np.float64), src, mask, tgt, fwhm)
    got64 = op.apply(op.read(data.astype(np.float64), 0, 7))
    assert got64.dtype == np.float64
    np.testing.assert_allclose(got64, want64, rtol=0, atol=1e-9 * np.abs(want64).max())


def test_rotated_grids_are_left_to_nilearn(tmp_path):
    rng = np.random.default_rng(1)
    c, s = np.cos(0.1), np.sin(0.1)
    src = _affine(2, (-40, -48, -30)) @ np.array([[c, -s, 0, 0], [s, c, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]])
    tgt, mask = _affine(6, (-38, -50, -28)), _mask((14, 16, 12), rng)
    assert separable_operator(src, (40, 48, 36), tgt, mask, 6.0) is None
    data = _run((40, 48, 36), 5, rng)
    nib.Nifti1Image(data, src).to_filename(tmp_path / "run.nii.gz")
    target = nib.Nifti1Image(mask.astype(np.uint8), tgt)
    got = resampled_block(tmp_path / "run.nii.gz", mask, target=target, smoothing_fwhm=6.0)
    want = _nilearn(data, src, mask, tgt, 6.0)
    np.testing.assert_allclose(got, want, rtol=0, atol=2 * EPS32 * np.abs(want).max())


def test_the_result_does_not_depend_on_blas_threads():
    from threadpoolctl import threadpool_limits

    (sz, so, sshape), (tz, to, tshape) = GRIDS["2 mm to 6 mm, shifted"]
    rng = np.random.default_rng(2)
    mask = _mask(tshape, rng)
    op = separable_operator(_affine(sz, so), sshape, _affine(tz, to), mask, 6.0)
    block = op.read(np.asfortranarray(_run(sshape, 40, rng)), 0, 40)
    results = []
    for n in (1, 2):
        with threadpool_limits(limits=n, user_api="blas"):
            results.append(op.apply(block))
    np.testing.assert_array_equal(*results)
