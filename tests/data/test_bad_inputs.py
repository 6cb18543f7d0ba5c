"""Bad inputs a site may hold (issue 45): a 3-D image among the runs, a subject whose data are all zero, a
subject with no signal (every voxel constant in time). Each is refused naming the file and the problem, or left
out by name under ``on_bad_subject = "skip"``; the planner reads the same headers and refuses the same 3-D file."""

from __future__ import annotations

from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro._utils.errors import ConfigError, DataValidationError
from dpneuro.config import RunConfig
from dpneuro.data.images import load_image
from dpneuro.data.load import describe_site_inputs, load_site
from dpneuro.run.planner import site_shapes

SHAPE = (4, 3, 2)  # a tiny grid: 24 voxels, all in the mask
T = 12


def write_img(path, data, tr=2.0) -> Path:
    img = nib.Nifti1Image(np.asarray(data, dtype=np.float32), np.eye(4))
    img.header.set_xyzt_units("mm", "sec")
    if img.ndim == 4:
        img.header.set_zooms(img.header.get_zooms()[:3] + (tr,))
    nib.save(img, str(path))
    return Path(path)


def make_site(tmp_path, bad) -> tuple[Path, Path, Path]:
    """sub-01 and sub-03 good; sub-02 is ``bad`` (an array). Returns (site folder, mask, sub-02's file)."""
    rng = np.random.default_rng(0)
    site = tmp_path / "site"
    site.mkdir()
    for i in (1, 3):
        write_img(site / f"sub-{i:02d}_bold.nii.gz", 100 + rng.standard_normal(SHAPE + (T,)))
    bad_file = write_img(site / "sub-02_bold.nii.gz", bad)
    mask = write_img(tmp_path / "mask.nii.gz", np.ones(SHAPE))
    return site, mask, bad_file


def constant_in_time() -> np.ndarray:
    # every voxel its own value, the same in every volume: no signal once masked
    return np.repeat((100 + np.arange(np.prod(SHAPE), dtype=np.float32)).reshape(SHAPE)[..., None], T, axis=3)


BAD = {
    "3-D": (lambda: np.ones(SHAPE), ["is 3-D", "expected a 4-D time series"]),
    "all zero": (lambda: np.zeros(SHAPE + (T,)), ["no signal", "every mask voxel is 0 in every volume"]),
    "constant": (constant_in_time, ["no signal", f"every mask voxel is constant over its {T} volumes"]),
}


def assert_names(msg: str, path: Path, words) -> None:
    assert str(path) in msg, msg
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("kind", list(BAD))
@pytest.mark.parametrize("workers", [1, 2])
def test_bad_subject_is_refused_naming_the_file(tmp_path, kind, workers):
    data, words = BAD[kind]
    site, mask, bad = make_site(tmp_path, data())
    out = tmp_path / "X.npy"
    with pytest.raises(DataValidationError) as ei:
        load_site(site, mask, workers=workers, memmap_path=out)
    assert_names(str(ei.value), bad, words)
    assert not out.exists()  # nothing half-written is left for a later stage to release


@pytest.mark.parametrize("kind", list(BAD))
def test_bad_subject_is_skipped_by_name(tmp_path, kind):
    data, words = BAD[kind]
    site, mask, bad = make_site(tmp_path, data())
    sd = load_site(site, mask, on_bad_subject="skip", workers=2)
    assert sd.subject_ids == ["sub-01", "sub-03"] and sd.X.shape == (24, 2 * T)
    assert [sid for sid, _ in sd.excluded] == ["sub-02"]
    assert_names(sd.excluded[0][1], bad, ["on_bad_subject = 'skip'", *words])
    assert [str(bad), "subject sub-02 left out: bad data"] in sd.skipped
    # the site's console (and report) list it with its reason
    rec = {**sd.metadata(), "site": "site-01", "n_subjects": sd.n_subjects, "n_samples": sd.n_samples}
    lines = describe_site_inputs(rec)
    assert any(line.startswith("site-01: subject sub-02 left out") and words[-1] in line for line in lines), lines


def test_the_planner_refuses_a_3d_run_as_the_loader_does(tmp_path):
    site, mask, bad = make_site(tmp_path, np.ones(SHAPE))
    with pytest.raises(DataValidationError) as ei:
        load_image(bad)  # the header reader both use
    assert_names(str(ei.value), bad, BAD["3-D"][1])
    cfg = RunConfig.from_dict({"sites": [{"name": "site-01", "path": str(site)}], "out": str(tmp_path / "out"),
                               "mask": str(mask)})
    with pytest.raises(ConfigError) as ei:
        site_shapes(cfg)
    assert_names(str(ei.value), bad, ["site 'site-01'", *BAD["3-D"][1]])
    load_image(mask, "mask file", series=False)  # a 3-D mask is what a mask should be


def test_runs_with_signal_are_kept(tmp_path):
    # constant voxels, or one voxel that varies, or a single changed volume, are data (the voxels become 0)
    data = constant_in_time()
    data[0, 0, 0, 5] += 1.0
    site, mask, _ = make_site(tmp_path, data)
    sd = load_site(site, mask)
    assert sd.subject_ids == ["sub-01", "sub-02", "sub-03"] and not sd.excluded
    b = np.asarray(sd.subject_block(1))
    assert np.abs(b[0]).max() > 0 and not b[1:].any()
