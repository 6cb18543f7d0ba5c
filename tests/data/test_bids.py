"""Subjects are people: BIDS layouts, filters, subject mappings, and the privacy unit they give."""

from __future__ import annotations

import json
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro._utils.errors import DataValidationError
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.discovery import find_subjects
from dpneuro.data.load import load_site
from dpneuro.run.stages import reduce_inprocess

SHAPE = (5, 4, 3)
AFF = np.diag([3.0, 3.0, 3.0, 1.0])


def _img(path: Path, n_vols: int | None, seed: int) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    shape = SHAPE if n_vols is None else SHAPE + (n_vols,)
    img = nib.Nifti1Image(rng.standard_normal(shape).astype(np.float32), AFF)
    if n_vols is not None:
        img.header.set_zooms((3.0, 3.0, 3.0, 2.0))
        img.header.set_xyzt_units("mm", "sec")
    img.to_filename(path)
    return path


@pytest.fixture
def bids(tmp_path):
    """A BIDS root: sub-01 has two sessions' runs and a T1w; sub-02 two tasks and an sbref."""
    root = tmp_path / "bids"
    root.mkdir()
    (root / "dataset_description.json").write_text(json.dumps({"Name": "t", "BIDSVersion": "1.8.0"}))
    f = root / "sub-01" / "ses-1" / "func"
    _img(f / "sub-01_ses-1_task-rest_run-1_bold.nii.gz", 15, 1)
    _img(f / "sub-01_ses-1_task-rest_run-2_bold.nii.gz", 12, 2)
    _img(root / "sub-01" / "ses-2" / "func" / "sub-01_ses-2_task-rest_run-1_bold.nii.gz", 11, 3)
    _img(root / "sub-01" / "ses-1" / "anat" / "sub-01_ses-1_T1w.nii.gz", None, 4)  # 3-D: must not be read
    f = root / "sub-02" / "func"
    _img(f / "sub-02_task-rest_bold.nii.gz", 20, 5)
    _img(f / "sub-02_task-motor_bold.nii.gz", 16, 6)
    _img(f / "sub-02_task-rest_sbref.nii.gz", None, 7)
    mask = tmp_path / "mask.nii.gz"
    nib.Nifti1Image(np.ones(SHAPE, np.uint8), AFF).to_filename(mask)
    return root, mask


def _lengths(sd):
    return {sid: b - a for sid, (a, b) in zip(sd.subject_ids, sd.boundaries)}


def test_bids_runs_and_sessions_of_one_subject_are_one_unit(bids):
    root, mask = bids
    sd = load_site(root, mask)
    assert sd.subject_ids == ["sub-01", "sub-02"]
    assert _lengths(sd) == {"sub-01": 15 + 12 + 11, "sub-02": 20 + 16}
    assert [len(r) for r in sd.runs] == [3, 2]
    skipped = {Path(p).name: why for p, why in sd.skipped}
    assert "outside" in skipped["sub-01_ses-1_T1w.nii.gz"]
    assert "BOLD" in skipped["sub-02_task-rest_sbref.nii.gz"]
    # every run is standardised on its own: each voxel has mean 0 within each run
    a = 0
    for n in (15, 12, 11):
        assert np.allclose(np.asarray(sd.X[:, a:a + n]).mean(axis=1), 0, atol=1e-5)
        a += n
    # a plain site folder of sub-*/ (no dataset_description.json) is read the same way
    (root / "dataset_description.json").unlink()
    assert _lengths(load_site(root, mask)) == _lengths(sd)


@pytest.mark.parametrize("filters,expected", [
    ({"task": "rest"}, {"sub-01": 38, "sub-02": 20}),
    ({"task": "rest", "run": 2}, {"sub-01": 12}),
    ({"session": "2"}, {"sub-01": 11}),
    ({"task": "motor"}, {"sub-02": 16}),
])
def test_bids_filters(bids, filters, expected):
    root, mask = bids
    sd = load_site(root, mask, bids=filters)
    assert _lengths(sd) == expected
    assert any("BIDS filter" in why for _, why in sd.skipped)


def test_bids_filter_errors(bids):
    root, mask = bids
    with pytest.raises(DataValidationError, match="no file matches"):
        load_site(root, mask, bids={"task": "nback"})
    with pytest.raises(DataValidationError, match="unknown BIDS filter"):
        find_subjects(root, filters={"acq": "x"})


def test_subject_mapping_groups_files_of_a_non_bids_folder(tmp_path, bids):
    _, mask = bids
    site = tmp_path / "flat"
    for i, n in enumerate((12, 13, 14)):
        _img(site / f"scan{i}.nii.gz", n, 10 + i)
    assert load_site(site, mask).n_subjects == 3  # one file = one subject by default
    tsv = tmp_path / "subjects.tsv"
    tsv.write_text("file\tsubject\nscan0.nii.gz\tP1\nscan1.nii.gz\tP1\nscan2.nii.gz\tP2\n")
    sd = load_site(site, mask, subjects_tsv=tsv)
    assert _lengths(sd) == {"P1": 25, "P2": 14}
    tsv.write_text("file\tsubject\nscan0.nii.gz\tP1\n")
    with pytest.raises(DataValidationError, match="not listed in the subject mapping"):
        load_site(site, mask, subjects_tsv=tsv)


def test_ledger_sensitivity_is_that_of_the_grouped_person(bids, tmp_path):
    root, mask = bids
    sd = load_site(root, mask, bids={"task": "rest"})
    lengths = [b - a for a, b in sd.boundaries]
    cfg = RunConfig.from_dict({"sites": [{"name": n, "path": str(root)} for n in "abc"], "out": str(tmp_path),
                               "mask": str(mask), "n_components": 2, "pca_epsilon": 4.0, "seed": 0})
    res = reduce_inprocess(cfg, [sd.X] * 3, [lengths] * 3)
    rel = res.ledgers[0].releases[0]
    # one person (38 of the site's 58 volumes) under the PCA's subject bound
    assert rel.sensitivity == pytest.approx(cfg.pca_subject_bound * math.sqrt(2) * 38 / 58, rel=1e-12)
    assert rel.neighbour == "replace" and rel.unit == "subject"


def test_config_bids_fields(tmp_path, bids):
    root, mask = bids
    base = {"sites": [{"name": "a", "path": str(root), "subjects_tsv": "missing.tsv"}], "out": str(tmp_path),
            "mask": str(mask), "plan": "conv"}
    with pytest.raises(ConfigError, match="subjects_tsv"):
        RunConfig.from_dict(base).validate()
    with pytest.raises(ConfigError, match="'bids'"):
        RunConfig.from_dict({**base, "sites": [{"name": "a", "path": str(root)}], "bids": {"acq": "x"}}).validate()
    cfg = RunConfig.from_dict({**base, "sites": [{"name": "a", "path": str(root)}], "bids": {"task": "rest"}})
    assert cfg.validate().bids == {"task": "rest"}
