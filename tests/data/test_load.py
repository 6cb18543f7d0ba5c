"""Tests for reading a site's data: NIfTI validation and loading (dpneuro.data.load), masks
(dpneuro.data.images), discovery (dpneuro.data.discovery) and site matrices (dpneuro.data.matrix)."""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nibabel.testing import data_path

from dpneuro._utils.errors import DataValidationError
from dpneuro.data.discovery import find_nifti, subject_id_from_path
from dpneuro.data.images import load_mask, mask_to_image
from dpneuro.data.load import load_site
from dpneuro.data.matrix import SiteData, open_site_data
from dpneuro.datasets.synth import make_consortium

FUNCTIONAL = Path(data_path) / "functional.nii"  # 17 x 21 x 3 x 20, TR 2 s
EXAMPLE4D = Path(data_path) / "example4d.nii.gz"  # 128 x 96 x 24 x 2


# ---------------------------------------------------------------------------
# helpers and fixtures
# ---------------------------------------------------------------------------

def write_img(path, data, affine=None, tr=2.0, units="sec"):
    """Save a float32 NIfTI with a given TR and time unit."""
    data = np.asarray(data, dtype=np.float32)
    img = nib.Nifti1Image(data, np.eye(4) if affine is None else affine)
    img.header.set_xyzt_units("mm", units)
    if data.ndim == 4:
        img.header.set_zooms(img.header.get_zooms()[:3] + (tr,))
    nib.save(img, str(path))
    return Path(path)


def raw_masked(path, mask):
    return np.asarray(nib.load(str(path)).dataobj)[mask].astype(np.float64)


def check_standardized(site: SiteData, atol=1e-4):
    for block in site.iter_subjects():
        b = np.asarray(block, dtype=np.float64)
        np.testing.assert_allclose(b.mean(axis=1), 0.0, atol=atol)
        var = b.var(axis=1)
        const = var == 0
        np.testing.assert_allclose(var[~const], 1.0, atol=atol)
        assert np.all(b[const] == 0)


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    man = make_consortium(out, 2, [2, 3], n_components=4, n_timepoints=30,
                          space="grid30", random_state=1)
    return man


@pytest.fixture(scope="module")
def mni6(tmp_path_factory):
    out = tmp_path_factory.mktemp("mni6")
    man = make_consortium(out, 1, 2, n_components=3, n_timepoints=12,
                          space="mni6mm", random_state=2, noise=0.0)
    return man


@pytest.fixture
def grid_files(tmp_path):
    """A small valid site: three 6 x 5 x 4 x 15 files plus a full mask."""
    rng = np.random.default_rng(0)
    site = tmp_path / "site"
    site.mkdir()
    for i in range(3):
        write_img(site / f"sub-{i + 1:02d}_bold.nii.gz", rng.standard_normal((6, 5, 4, 15)))
    mask = write_img(tmp_path / "mask.nii.gz", np.ones((6, 5, 4)))
    return site, mask


def assert_names(excinfo, path, *words):
    msg = str(excinfo.value)
    assert str(path) in msg or Path(path).name in msg, msg
    for w in words:
        assert w in msg, msg


# ---------------------------------------------------------------------------
# loading synthetic consortia
# ---------------------------------------------------------------------------

def test_load_grid_site_shapes_ids_boundaries(grid):
    site_entry = grid["sites"][1]
    site = load_site(site_entry["path"], grid["mask"])
    assert isinstance(site, SiteData)
    assert site.X.shape == (900, 90) and site.X.dtype == np.float32
    assert (site.n_features, site.n_samples, site.n_subjects) == (900, 90, 3)
    assert site.subject_ids == ["sub-0003", "sub-0004", "sub-0005"]
    assert site.boundaries == [(0, 30), (30, 60), (60, 90)]
    assert site.subject_slices == [slice(0, 30), slice(30, 60), slice(60, 90)]
    assert site.paths == [s["path"] for s in site_entry["subjects"]]
    assert site.tr == 2.0
    assert site.mask_path == grid["mask"]
    assert site.memmap_path is None
    blocks = list(site.iter_subjects())
    assert [b.shape for b in blocks] == [(900, 30)] * 3
    assert all(np.shares_memory(b, site.X) for b in blocks)  # views, not copies
    np.testing.assert_array_equal(site.subject_block(1), site.X[:, 30:60])
    check_standardized(site)


def test_standardize_and_raw_values(grid):
    sub = grid["sites"][0]["subjects"][0]
    mask, _ = load_mask(grid["mask"])
    raw = raw_masked(sub["path"], mask)
    site = load_site([sub["path"]], grid["mask"], standardize=False)
    np.testing.assert_array_equal(site.X, raw.astype(np.float32))
    std = load_site([sub["path"]], grid["mask"])
    expected = (raw - raw.mean(axis=1, keepdims=True)) / raw.std(axis=1, keepdims=True)
    np.testing.assert_allclose(std.X, expected, atol=1e-5)


def test_memmap_equals_in_memory_and_reopens(grid, tmp_path):
    folder, mask = grid["sites"][0]["path"], grid["mask"]
    mem = load_site(folder, mask)
    npy = tmp_path / "out" / "site-01.npy"
    mm = load_site(folder, mask, memmap_path=npy)
    assert isinstance(mm.X, np.memmap) and not mm.X.flags.writeable
    assert mm.memmap_path == str(npy)
    np.testing.assert_array_equal(np.asarray(mm.X), mem.X)
    np.testing.assert_array_equal(np.load(npy), mem.X)
    meta = json.loads(npy.with_suffix(".json").read_text())
    assert meta["subject_ids"] == mem.subject_ids and meta["shape"] == [900, 60]

    again = open_site_data(npy)
    assert again.subject_ids == mem.subject_ids
    assert again.boundaries == mem.boundaries
    assert again.tr == mem.tr and again.standardize
    np.testing.assert_array_equal(np.asarray(again.X), mem.X)
    with pytest.raises(DataValidationError, match="not found"):
        open_site_data(tmp_path / "nope.npy")


def test_mni6mm_noiseless_site_matches_ground_truth(mni6):
    site = load_site(mni6["sites"][0]["path"], mni6["mask"], standardize=False)
    assert site.X.shape == (8735, 24)
    A = np.load(mni6["truth"]["A"]).astype(np.float64)
    for block, sub in zip(site.iter_subjects(), mni6["sites"][0]["subjects"]):
        S = np.load(sub["sources"]).astype(np.float64)
        np.testing.assert_allclose(block, A @ S, rtol=1e-5, atol=1e-5)
    # standardised: voxels outside every blob are constant 0 -> stay 0
    std = load_site(mni6["sites"][0]["path"], mni6["mask"])
    check_standardized(std)
    assert np.all(np.asarray(std.X)[(A == 0).all(axis=1)] == 0)


def test_list_input_keeps_order_and_single_file(grid):
    subs = grid["sites"][1]["subjects"]
    paths = [subs[2]["path"], subs[0]["path"]]
    site = load_site(paths, grid["mask"])
    assert site.subject_ids == ["sub-0005", "sub-0003"]
    one = load_site(subs[1]["path"], grid["mask"])
    assert one.subject_ids == ["sub-0004"] and one.X.shape == (900, 30)


def test_progress_bar(grid, terminal):
    term = terminal()
    load_site(grid["sites"][0]["path"], grid["mask"], progress=True)
    assert "2/2" in term.getvalue()


def test_progress_bar_stays_out_of_a_log(grid, capsys):
    load_site(grid["sites"][0]["path"], grid["mask"], progress=True)  # stderr is not a terminal here
    assert "\r" not in capsys.readouterr().err


def test_detrend_removes_linear_trend(tmp_path):
    t = np.arange(20, dtype=np.float64)
    rng = np.random.default_rng(0)
    wiggle = rng.standard_normal((2, 2, 1, 20))
    data = 100 + 3.0 * t + wiggle  # strong linear drift on every voxel
    data[0, 0, 0] = 7.0  # one constant voxel
    f = write_img(tmp_path / "s.nii", data)
    mask = nib.Nifti1Image(np.ones((2, 2, 1), np.uint8), np.eye(4))
    site = load_site([f], mask, detrend=True, standardize=False)
    X = np.asarray(site.X, dtype=np.float64)
    # residual after removing a + b t from each voxel
    basis = np.column_stack([np.ones(20), t])
    w = wiggle.reshape(4, 20)
    resid = w - (basis @ np.linalg.lstsq(basis, w.T, rcond=None)[0]).T
    np.testing.assert_allclose(X[1:], resid[1:], atol=1e-3)
    np.testing.assert_allclose(X[0], 0, atol=1e-3)
    both = load_site([f], mask, detrend=True)
    check_standardized(both)
    assert np.all(np.asarray(both.X)[0] == 0)  # constant voxel -> 0, not NaN


# ---------------------------------------------------------------------------
# real tiny fMRI from nibabel's test data
# ---------------------------------------------------------------------------

def test_nibabel_functional_all_ones_and_thresholded_masks():
    img = nib.load(str(FUNCTIONAL))
    ones = nib.Nifti1Image(np.ones(img.shape[:3], np.uint8), img.affine)
    site = load_site(FUNCTIONAL, ones)
    assert site.X.shape == (17 * 21 * 3, 20)
    assert site.subject_ids == ["functional"] and site.tr == 2.0
    assert site.mask_path is None
    check_standardized(site)

    mean = img.get_fdata().mean(axis=3)
    brain = nib.Nifti1Image((mean > np.percentile(mean, 50)).astype(np.uint8), img.affine)
    site = load_site([FUNCTIONAL], brain, standardize=False)
    assert site.X.shape == (int((mean > np.percentile(mean, 50)).sum()), 20)
    np.testing.assert_allclose(site.X, raw_masked(FUNCTIONAL, np.asarray(brain.dataobj) > 0),
                               rtol=1e-6)


def test_nibabel_example4d_two_volumes(tmp_path):
    img = nib.load(str(EXAMPLE4D))
    mean = img.get_fdata().mean(axis=3)
    mask = nib.Nifti1Image((mean > 100).astype(np.uint8), img.affine)
    with pytest.raises(DataValidationError) as ei:
        load_site(EXAMPLE4D, mask)
    assert_names(ei, EXAMPLE4D, "2 volumes", "min_volumes=10")
    site = load_site(EXAMPLE4D, mask, min_volumes=2)
    assert site.X.shape == (int((mean > 100).sum()), 2)
    assert site.subject_ids == ["example4d"]
    # two samples standardised are -1/+1 (or 0 where the voxel is constant)
    assert set(np.unique(np.round(np.abs(site.X), 5))) <= {0.0, 1.0}
    # the same two files loaded together with the real functional file: grids differ
    mask_path = tmp_path / "m.nii.gz"
    nib.save(mask, str(mask_path))
    with pytest.raises(DataValidationError) as ei:
        load_site([EXAMPLE4D, FUNCTIONAL], mask_path, min_volumes=2)
    assert_names(ei, FUNCTIONAL, "grid mismatch")


# ---------------------------------------------------------------------------
# validation errors
# ---------------------------------------------------------------------------

def test_file_and_folder_not_found(grid_files, tmp_path):
    site, mask = grid_files
    missing = site / "sub-99_bold.nii.gz"
    with pytest.raises(DataValidationError) as ei:
        load_site([*sorted(site.iterdir()), missing], mask)
    assert_names(ei, missing, "not found")
    with pytest.raises(DataValidationError, match="not found"):
        load_site(tmp_path / "no_such_dir", mask)
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(DataValidationError, match="no NIfTI files"):
        load_site(empty, mask)
    with pytest.raises(DataValidationError, match="no input files"):
        load_site([], mask)
    assert issubclass(DataValidationError, ValueError)


def test_truncated_gzip_detected_from_header_pass(grid_files):
    site, mask = grid_files
    victim = site / "sub-02_bold.nii.gz"
    raw = victim.read_bytes()
    victim.write_bytes(raw[: len(raw) // 2])
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, victim, "truncated")
    # found in the header pass: reported before a later file's header problem
    write_img(site / "sub-03_bold.nii.gz", np.zeros((6, 5, 4)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, victim, "truncated")
    (site / "sub-03_bold.nii.gz").unlink()
    # cut inside the header: nibabel cannot even read it
    victim.write_bytes(raw[:60])
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, victim, "corrupted")
    # not gzip at all
    victim.write_bytes(b"this is not a NIfTI file at all" * 20)
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, victim, "unreadable or corrupted")


def test_valid_gzip_needs_no_full_decompression(grid, monkeypatch):
    # the header pass must rely on the gzip trailer for complete files, not
    # decompress every subject twice
    import dpneuro.data.load as dload

    def fail(*args, **kwargs):
        raise AssertionError("header pass decompressed a complete file")

    monkeypatch.setattr(dload.gzip, "open", fail)
    assert load_site(grid["sites"][0]["path"], grid["mask"]).n_subjects == 2


def test_truncated_uncompressed_nii(tmp_path):
    f = tmp_path / "functional.nii"
    shutil.copy(FUNCTIONAL, f)
    with open(f, "r+b") as fh:
        fh.truncate(f.stat().st_size - 1000)
    img = nib.load(str(FUNCTIONAL))
    mask = nib.Nifti1Image(np.ones(img.shape[:3], np.uint8), img.affine)
    with pytest.raises(DataValidationError) as ei:
        load_site([f], mask)
    assert_names(ei, f, "truncated file")


def test_multi_member_gzip_is_accepted(grid_files, tmp_path):
    # legitimate gzip with two members: the trailer size check fails but a
    # full decompression shows the file is complete
    site, mask = grid_files
    src = site / "sub-01_bold.nii.gz"
    raw = gzip.decompress(src.read_bytes())
    dst = tmp_path / "multi" / "sub-01_bold.nii.gz"
    dst.parent.mkdir()
    dst.write_bytes(gzip.compress(raw[:1000]) + gzip.compress(raw[1000:]))
    a = load_site([src], mask)
    b = load_site([dst], mask)
    np.testing.assert_array_equal(a.X, b.X)


def test_3d_file_rejected(grid_files):
    site, mask = grid_files
    f = write_img(site / "sub-04_bold.nii.gz", np.zeros((6, 5, 4)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f, "3-D", "4-D")


def test_nan_found_while_reading_and_memmap_removed(grid_files, tmp_path):
    site, mask = grid_files
    data = np.random.default_rng(1).standard_normal((6, 5, 4, 15))
    data[2, 2, 2, 3] = np.nan
    data[1, 1, 1, 0] = np.inf
    f = write_img(site / "sub-02_bold.nii.gz", data)
    npy = tmp_path / "site.npy"
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask, memmap_path=npy)
    assert_names(ei, f, "non-finite", "2 mask voxel")
    assert not npy.exists()
    # NaN outside the mask does not matter
    m = np.ones((6, 5, 4))
    m[2, 2, 2] = m[1, 1, 1] = 0
    part = write_img(tmp_path / "part.nii.gz", m)
    assert load_site(site, part).X.shape == (118, 45)


def test_headers_checked_before_any_data_is_read(grid_files):
    # sub-01 has NaNs (found only when reading), sub-03 is 3-D (header):
    # the header problem of the later file is reported first
    site, mask = grid_files
    bad = np.full((6, 5, 4, 15), np.nan)
    write_img(site / "sub-01_bold.nii.gz", bad)
    f3 = write_img(site / "sub-03_bold.nii.gz", np.zeros((6, 5, 4)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f3, "3-D")


def test_affine_mismatch_and_tolerance(grid_files):
    site, mask = grid_files
    data = np.random.default_rng(2).standard_normal((6, 5, 4, 15))
    shifted = np.eye(4)
    shifted[:3, 3] = [2.0, 0.0, 0.0]
    f = write_img(site / "sub-02_bold.nii.gz", data, affine=shifted)
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f, "affine mismatch")
    nearly = np.eye(4)
    nearly[0, 3] = 1e-4  # below the 1e-3 tolerance
    write_img(site / "sub-02_bold.nii.gz", data, affine=nearly)
    assert load_site(site, mask).n_subjects == 3


def test_grid_mismatch(grid_files):
    site, mask = grid_files
    f = write_img(site / "sub-02_bold.nii.gz", np.zeros((6, 5, 3, 15)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f, "grid mismatch", "(6, 5, 3)", "(6, 5, 4)")


def test_too_few_volumes(grid_files):
    site, mask = grid_files
    f = write_img(site / "sub-02_bold.nii.gz", np.random.default_rng(1).standard_normal((6, 5, 4, 9)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f, "9 volumes", "min_volumes=10")
    assert load_site(site, mask, min_volumes=9).n_samples == 15 + 9 + 15
    with pytest.raises(ValueError, match="min_volumes"):
        load_site(site, mask, min_volumes=0)


def test_inconsistent_tr_and_time_units(grid_files):
    site, mask = grid_files
    data = np.random.default_rng(3).standard_normal((6, 5, 4, 15))
    f = write_img(site / "sub-03_bold.nii.gz", data, tr=3.0)
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask)
    assert_names(ei, f, "TR 3 s", "2 s")
    # the same TR stored in milliseconds is consistent
    write_img(site / "sub-03_bold.nii.gz", data, tr=2000.0, units="msec")
    assert load_site(site, mask).tr == pytest.approx(2.0)


def test_files_of_one_subject_label_are_one_person(grid_files):
    site, mask = grid_files
    before = load_site(site, mask)
    shutil.copy(site / "sub-01_bold.nii.gz", site / "sub-01.nii.gz")
    after = load_site(site, mask)
    assert after.n_subjects == before.n_subjects
    i = after.subject_ids.index("sub-01")
    a, b = after.boundaries[i]
    assert b - a == 2 * (before.boundaries[i][1] - before.boundaries[i][0])
    with pytest.raises(DataValidationError, match="listed twice"):
        load_site([site / "sub-01.nii.gz", site / "sub-01.nii.gz"], mask)


def test_mask_errors(grid_files, tmp_path):
    site, _ = grid_files
    with pytest.raises(DataValidationError, match="mask file not found"):
        load_site(site, tmp_path / "nomask.nii.gz")
    empty = write_img(tmp_path / "empty.nii.gz", np.zeros((6, 5, 4)))
    with pytest.raises(DataValidationError) as ei:
        load_site(site, empty)
    assert_names(ei, empty, "empty")
    four = write_img(tmp_path / "four.nii.gz", np.ones((6, 5, 4, 2)))
    with pytest.raises(DataValidationError, match="3-D"):
        load_mask(four)
    single = write_img(tmp_path / "single.nii.gz", np.ones((6, 5, 4, 1)))
    m, aff = load_mask(single)
    assert m.shape == (6, 5, 4) and m.dtype == bool and m.all()
    with pytest.raises(TypeError):
        load_mask(np.ones((2, 2, 2)))


# ---------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------

def test_mask_to_image_round_trip(mni6):
    mask, affine = load_mask(mni6["mask"])
    D = int(mask.sum())
    v = np.arange(D, dtype=np.float64)
    img3 = mask_to_image(v, mni6["mask"])
    assert img3.shape == mask.shape and img3.get_data_dtype() == np.float32
    np.testing.assert_allclose(img3.affine, affine)
    data = np.asarray(img3.dataobj)
    np.testing.assert_array_equal(data[mask], v)
    assert not data[~mask].any()
    assert int(img3.header["sform_code"]) == 4  # MNI space code kept

    A = np.load(mni6["truth"]["A"])
    img4 = mask_to_image(A, nib.load(mni6["mask"]))
    assert img4.shape == mask.shape + (3,)
    np.testing.assert_array_equal(
        np.asarray(img4.dataobj), np.asarray(nib.load(mni6["truth"]["maps"]).dataobj)
    )
    with pytest.raises(ValueError, match="rows but the mask has"):
        mask_to_image(v[:-1], mni6["mask"])
    with pytest.raises(ValueError, match="D-vector"):
        mask_to_image(np.zeros((D, 2, 2)), mni6["mask"])


def test_find_nifti_and_subject_ids(tmp_path):
    (tmp_path / "b.nii.gz").write_bytes(b"")
    (tmp_path / "a.nii").write_bytes(b"")
    (tmp_path / ".hidden.nii").write_bytes(b"")
    (tmp_path / "notes.txt").write_text("x")
    assert [p.name for p in find_nifti(tmp_path)] == ["a.nii", "b.nii.gz"]
    bids = tmp_path / "bids"
    (bids / "sub-02" / "func").mkdir(parents=True)
    (bids / "sub-01" / "func").mkdir(parents=True)
    for s in ("sub-01", "sub-02"):
        (bids / s / "func" / f"{s}_task-rest_bold.nii.gz").write_bytes(b"")
    assert [p.name for p in find_nifti(bids)] == [
        "sub-01_task-rest_bold.nii.gz", "sub-02_task-rest_bold.nii.gz"]
    assert subject_id_from_path("x/sub-0001_bold.nii.gz") == "sub-0001"
    assert subject_id_from_path("sub-01_task-rest_bold.nii") == "sub-01"
    assert subject_id_from_path("sub-01_ses-2_task-rest_run-3_bold.nii.gz") == "sub-01"
    assert subject_id_from_path(os.path.join("d", "functional.nii")) == "functional"
    assert subject_id_from_path("_bold.nii") == "_bold"


def test_one_site_data_type_feeds_every_stage():
    """A SiteData from an array carries its subjects to capePCA and capeDJICA; one scaling for both."""
    from dpneuro.algorithms.djica import cape_djica
    from dpneuro.algorithms.pca import as_source, second_moment
    from dpneuro.data.matrix import SiteData, scale_columns

    rng = np.random.default_rng(0)
    X = rng.standard_normal((6, 40))
    sd = SiteData.from_array(X, [10, 30])
    assert sd.lengths == [10, 30] and sd.boundaries == [(0, 10), (10, 40)] and sd.n_subjects == 2
    U = scale_columns(sd.X, "unit")
    np.testing.assert_allclose(np.linalg.norm(U, axis=0), 1.0, rtol=1e-6)
    # capePCA's unit scaling is the same computation
    src = as_source(sd).validate("test")
    np.testing.assert_allclose(second_moment(src, "unit"), U.astype(np.float64) @ U.T / 40, rtol=1e-5)
    with pytest.raises(ValueError, match="add up"):
        SiteData.from_array(X, [10, 20])
    sites = [SiteData.from_array(rng.laplace(size=(3, 60)), 3) for _ in range(3)]
    a = cape_djica(sites, plan="none", clip_G=None, clip_h=None, rounds=5, random_state=1)
    b = cape_djica([s.X for s in sites], 3, plan="none", clip_G=None, clip_h=None, rounds=5, random_state=1)
    np.testing.assert_array_equal(a.W, b.W)
    with pytest.raises(ValueError, match="subjects_per_site"):
        cape_djica([s.X for s in sites], plan="none", rounds=2)
