"""fMRIPrep derivatives as they are: discovery, resampling, TRs, leaving a bad subject out, nilearn's cleaning."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nilearn import signal
from nilearn.image import resample_to_img
from nilearn.interfaces.fmriprep import load_confounds_strategy

from dpneuro._utils.errors import DataValidationError
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.cleaning import Cleaning
from dpneuro.data.images import load_mask
from dpneuro.data.load import describe_site_inputs, load_site, preprocess
from dpneuro.datasets.fmriprep import analysis_mask, write_fmriprep_site


@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    d = tmp_path_factory.mktemp("fmriprep")
    return write_fmriprep_site(d / "site", random_state=1), analysis_mask(d / "mask.nii.gz")


def _lengths(sd):
    return {sid: b - a for sid, (a, b) in zip(sd.subject_ids, sd.boundaries)}


def _why(sd) -> dict[str, str]:
    return {Path(f).name: why for f, why in sd.skipped}


def _raw(path, mask_path) -> np.ndarray:
    """A run resampled to the analysis grid by nilearn and masked (D x T), as the site must read it."""
    mask, _ = load_mask(mask_path)
    img = resample_to_img(nib.load(str(path)), nib.load(str(mask_path)), interpolation="continuous",
                          force_resample=True, copy_header=True)
    return np.asarray(img.dataobj)[mask]


def _assert_z_close(got, want, raw: np.ndarray, **clean) -> None:
    """A cleaned, z-scored run equals nilearn's up to float32 rounding: dpneuro resamples as nilearn does, as
    three matrix products (dpneuro.data.resample), to a few float32 units of each voxel's level; cleaning keeps
    that error and z-scoring divides it by the voxel's cleaned sd."""
    sd = signal.clean(raw.T, standardize=False, **clean).std(axis=0) if clean else raw.std(axis=1)
    tol = 16 * np.finfo(np.float32).eps * np.abs(raw).max(axis=1) / sd
    err = np.abs(np.asarray(got, np.float64) - want).max(axis=1)
    assert np.all(err <= tol), f"worst voxel: {float(np.max(err / tol)):.2f} x its float32 tolerance"


# -- discovery ----------------------------------------------------------------------------------

def test_what_is_read_and_what_is_listed(tree):
    site, mask = tree
    sd = load_site(site.root, mask)
    assert sd.subject_ids == ["sub-01", "sub-02", "sub-03"]
    # sub-01's three runs over two sessions are one person; sub-02's rest and motor runs too
    assert [len(r) for r in sd.runs] == [3, 2, 1]
    assert _lengths(sd) == {"sub-01": 240, "sub-02": 160, "sub-03": 80}
    assert all("_desc-preproc_bold" in p and "space-MNI152NLin2009cAsym" in p for p in sd.paths)
    why = _why(sd)
    assert "anat/" in why["sub-01_desc-preproc_T1w.nii.gz"]
    assert "figures/" in why["sub-02_task-rest_desc-carpetplot_bold.svg"]
    assert "surface" in why["sub-03_task-rest_hemi-L_space-fsaverage5_bold.func.gii"]
    assert "CIFTI" in why["sub-03_task-rest_space-fsLR_den-91k_bold.dtseries.nii"]
    aroma = "sub-01_ses-1_task-rest_run-2_space-MNI152NLin2009cAsym_res-2_desc-smoothAROMAnonaggr_bold.nii.gz"
    assert "desc=preproc" in why[aroma]
    assert "native space (space-T1w)" in why["sub-03_task-rest_space-T1w_desc-preproc_bold.nii.gz"]
    assert "boldref" in why["sub-03_task-rest_space-MNI152NLin2009cAsym_res-2_boldref.nii.gz"]
    assert "confounds = off" in why["sub-03_task-rest_desc-confounds_timeseries.tsv"]
    # nothing read is listed, and every file of the tree under sub-*/ is either read or listed
    assert not set(sd.paths) & {f for f, _ in sd.skipped}
    under_subjects = {str(f) for f in site.root.glob("sub-*/**/*") if f.is_file()}
    used = {v for r in sd.run_records for v in r["companions_used"].values()}
    assert under_subjects == set(sd.paths) | {f for f, _ in sd.skipped} | used
    # the run's brain mask and sidecar are used (coverage of the analysis mask, TR)
    rec = sd.run_records[0]
    assert set(rec["companions_used"]) == {"mask", "sidecar"} and 0.5 < rec["mask_coverage"] <= 1
    lines = describe_site_inputs({**sd.metadata(), "site": "s", "n_subjects": 3, "n_samples": sd.n_samples},
                                 files=True)
    assert any(aroma in line for line in lines)


@pytest.mark.parametrize("filters,expected", [
    ({"task": "rest"}, {"sub-01": 240, "sub-02": 80, "sub-03": 80}),
    ({"session": "2"}, {"sub-01": 80}),
    ({"task": "rest", "run": 2}, {"sub-01": 80}),
    ({"space": "MNI152NLin2009cAsym", "task": "motor"}, {"sub-02": 80}),
    ({"desc": "smoothAROMAnonaggr", "task": "rest"}, {"sub-01": 240, "sub-02": 80, "sub-03": 80}),
])
def test_filters(tree, filters, expected):
    site, mask = tree
    sd = load_site(site.root, mask, bids=filters)
    assert _lengths(sd) == expected
    want = filters.get("desc", "preproc")
    assert all(f"desc-{want}_bold" in p for p in sd.paths)


def test_res_filter_and_the_same_run_twice(tmp_path):
    site = write_fmriprep_site(tmp_path / "site", n_subjects=2, multi_run=False, extra_res=True, random_state=2)
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    with pytest.raises(DataValidationError, match="same run as .*res-2.*res"):
        load_site(site.root, mask)
    sd2 = load_site(site.root, mask, bids={"res": "2", "task": "rest"})
    sd3 = load_site(site.root, mask, bids={"res": 3, "task": "rest"})
    assert all("_res-2_" in p for p in sd2.paths) and all("_res-3_" in p for p in sd3.paths)
    assert sd3.run_records[0]["resampled_from"].startswith("grid (10, 12, 10)")
    assert "BIDS filter res=2" in _why(sd2)[Path(sd3.paths[0]).name]


def test_native_space_is_refused_by_name(tree, tmp_path):
    site, mask = tree
    with pytest.raises(DataValidationError, match=r"space-T1w_desc-preproc_bold.nii.gz: native space \(space-T1w\)"):
        load_site(site.root, mask, bids={"space": "T1w"})
    # a run fMRIPrep wrote only in T1w space cannot be left out quietly
    root = tmp_path / "t1only"
    shutil.copytree(site.root / "sub-03", root / "sub-03")
    for f in (root / "sub-03" / "func").glob("*space-MNI*"):
        f.unlink()
    with pytest.raises(DataValidationError, match="sub-03_task-rest_space-T1w_desc-preproc_bold.nii.gz: native"):
        load_site(root, mask)


# -- resampling ---------------------------------------------------------------------------------

def test_runs_on_another_grid_are_resampled_once_by_nilearn(tree):
    site, mask = tree
    sd = load_site(site.root, mask, bids={"task": "rest"})
    m, _ = load_mask(mask)
    assert sd.n_features == int(m.sum()) and nib.load(str(sd.paths[0])).shape[:3] == (20, 24, 20)
    assert all(r["resampled_from"] == "grid (20, 24, 20) at (2, 2, 2) mm" for r in sd.run_records)
    for i, path in enumerate(sd.paths):
        a = sum(r["columns"] for r in sd.run_records[:i])
        raw = _raw(path, mask)
        _assert_z_close(sd.X[:, a:a + 80], preprocess(raw, standardize=True), raw)



@pytest.mark.parametrize("dtype,scaled", [(np.float32, False), (np.int16, True)])
def test_resampling_in_chunks_equals_the_whole_run_at_once(tmp_path, dtype, scaled):
    """Chunks of volumes give what nilearn gives on the whole run (resampled, smoothed) to float32 rounding, in
    float32 (which holds float32 and 16-bit values exactly), and the whole run's non-finite voxels are counted."""
    from nilearn.image import smooth_img

    from dpneuro.data.load import resampled_block

    mask_path = analysis_mask(tmp_path / "mask.nii.gz")
    m, _ = load_mask(mask_path)
    rng = np.random.default_rng(3)
    data = (100 + 20 * rng.standard_normal((20, 24, 20, 23))).astype(dtype)
    img = nib.Nifti1Image(data, np.array([[2.0, 0, 0, -20], [0, 2, 0, -24], [0, 0, 2, -20], [0, 0, 0, 1]]))
    if scaled:
        img.header.set_slope_inter(0.5, 3.0)
    path = tmp_path / "run.nii.gz"
    img.to_filename(path)
    target = nib.load(str(mask_path))
    whole = resample_to_img(nib.load(str(path)), target, interpolation="continuous", force_resample=True,
                            copy_header=True)
    for fwhm in (None, 6.0):
        want = np.asarray((smooth_img(whole, fwhm) if fwhm else whole).dataobj)[m]
        for chunk in (5, 7, 23, None):
            got = resampled_block(path, m, target=target, smoothing_fwhm=fwhm, chunk=chunk)
            assert got.dtype == np.float32
            np.testing.assert_allclose(got, want, rtol=0, atol=8 * np.finfo(np.float32).eps * np.abs(want).max())
    if dtype == np.float32:
        data[3, 4, 5, 2] = np.nan  # in the first chunk
        data[6, 7, 8, 20] = np.inf  # in the last one
        nib.Nifti1Image(data, img.affine).to_filename(path)
        with pytest.raises(Exception, match="non-finite values.* in 2 voxel"):
            resampled_block(path, m, target=target, chunk=5)


def test_resampling_in_chunks_bounds_memory(tmp_path):
    import tracemalloc

    from dpneuro.data.load import resampled_block

    mask_path = analysis_mask(tmp_path / "mask.nii.gz")
    m, _ = load_mask(mask_path)
    data = np.random.default_rng(0).standard_normal((20, 24, 20, 100)).astype(np.float32)
    nib.Nifti1Image(data, np.array([[2.0, 0, 0, -20], [0, 2, 0, -24], [0, 0, 2, -20], [0, 0, 0, 1]])
                    ).to_filename(tmp_path / "run.nii.gz")
    del data
    target = nib.load(str(mask_path))
    resampled_block(tmp_path / "run.nii.gz", m, target=target, chunk=10)  # imports nilearn outside the trace
    peaks = {}
    for chunk in (None, 10):
        tracemalloc.start()
        resampled_block(tmp_path / "run.nii.gz", m, target=target, chunk=chunk)
        peaks[chunk] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    assert peaks[None] > 3.8e6  # at least the whole run's 3.84 MB of float32
    assert peaks[10] < peaks[None] / 4

# -- TRs ----------------------------------------------------------------------------------------

def test_each_site_filters_with_its_own_tr(tmp_path):
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    cleaning = Cleaning(detrend=True, high_pass=0.01, low_pass=0.2)
    for tr in (2.0, 0.8):
        site = write_fmriprep_site(tmp_path / f"tr{tr}", n_subjects=1, multi_run=False, tr=tr, random_state=3)
        sd = load_site(site.root, mask, cleaning=cleaning)
        assert sd.tr == tr and sd.run_records[0]["tr"] == tr
        raw, clean = _raw(sd.paths[0], mask), {"detrend": True, "high_pass": 0.01, "low_pass": 0.2, "t_r": tr}
        want = signal.clean(raw.T, standardize="zscore_sample", **clean).T
        _assert_z_close(sd.X, want, raw, **clean)


def test_mixed_tr_within_a_site_is_refused_by_run(tmp_path):
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=2, multi_run=False, trs={"sub-02": 1.5}, random_state=4)
    with pytest.raises(DataValidationError, match=r"sub-02_task-rest_space.*TR 1.5 s differs from 2 s"):
        load_site(site.root, mask, bids={"task": "rest"})
    # the sidecar's RepetitionTime is the run's TR; one that contradicts the header is refused by name
    side = Path(str(site.runs["sub-01"][0]).replace(".nii.gz", ".json"))
    side.write_text(json.dumps({"RepetitionTime": 3.0}))
    with pytest.raises(DataValidationError, match="sub-01_task-rest.*TR 2 s disagrees with RepetitionTime 3 s"):
        load_site(site.root, mask, bids={"task": "rest"})


# -- a bad subject ------------------------------------------------------------------------------

def test_a_corrupt_subject_stops_the_site_or_is_left_out(tmp_path):
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=3, multi_run=False, corrupt=("sub-02",), random_state=5)
    bad = site.runs["sub-02"][0]
    with pytest.raises(DataValidationError, match=f"{bad.name}: (corrupted|truncated)"):
        load_site(site.root, mask, bids={"task": "rest"})
    sd = load_site(site.root, mask, bids={"task": "rest"}, on_bad_subject="skip")
    assert sd.subject_ids == ["sub-01", "sub-03"]
    assert sd.excluded[0][0] == "sub-02" and bad.name in sd.excluded[0][1]
    assert "left out" in _why(sd)[bad.name]
    named = load_site(site.root, mask, bids={"task": "rest"}, exclude=["sub-02"])
    assert named.subject_ids == ["sub-01", "sub-03"] and named.excluded == [["sub-02", "left out by the "
                                                                              "configuration (exclude)"]]
    np.testing.assert_array_equal(np.asarray(named.X), np.asarray(sd.X))
    with pytest.raises(DataValidationError, match="exclude names .*sub-99"):
        load_site(site.root, mask, exclude=["sub-99"])


def test_bad_data_found_while_decoding_is_left_out_too(tmp_path):
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=3, multi_run=False, random_state=6)
    path = site.runs["sub-01"][0]
    img = nib.load(str(path))
    data = np.asarray(img.dataobj).copy()
    data[10, 12, 10, 5] = np.nan  # only visible once the data are read
    nib.Nifti1Image(data, img.affine, img.header).to_filename(path)
    sd = load_site(site.root, mask, bids={"task": "rest"}, on_bad_subject="skip", workers=1)
    assert sd.subject_ids == ["sub-02", "sub-03"] and "non-finite" in sd.excluded[0][1]


def test_the_load_stage_records_and_reports_it(tmp_path):
    from dpneuro.report.html import data_section
    from dpneuro.run.pipeline import stage_load, stage_space

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=3, multi_run=False, corrupt=("sub-03",), random_state=7)
    cfg = RunConfig.from_dict({"sites": [{"name": "site-01", "path": str(site.root), "exclude": ["sub-02"]}],
                               "out": str(tmp_path / "out"), "mask": str(mask), "parcels": 0, "plan": "conv",
                               "bids": {"task": "rest"}, "confounds": "simple", "on_bad_subject": "skip"}).validate()
    cfg_json = tmp_path / "cfg.json"
    cfg_json.write_text(json.dumps(cfg.to_json()))
    rec = json.loads(Path(stage_load(str(cfg_json), "site-01", stage_space(str(cfg_json)))).read_text())
    assert rec["subject_ids"] == ["sub-01"]
    assert [x[0] for x in rec["excluded"]] == ["sub-02", "sub-03"]
    assert rec["cleaning"]["confounds"] == "simple" and "simple" in rec["cleaning"]["description"]
    assert rec["run_records"][0]["companions_used"]["confounds"].endswith("desc-confounds_timeseries.tsv")
    html = data_section({"cleaning": cfg.cleaning().describe(), "sites": [rec]})
    assert "sub-03" in html and "left out" in html and "smoothAROMAnonaggr" in html


# -- cleaning -----------------------------------------------------------------------------------

@pytest.mark.parametrize("confounds", ["simple", "scrubbing", "compcor", "ica_aroma", ("trans_x", "rot_z", "csf")])
def test_cleaning_is_nilearn_signal_clean(tree, confounds):
    site, mask = tree
    cleaning = Cleaning(confounds=confounds, detrend=True, high_pass=0.01, low_pass=0.1)
    sd = load_site(site.root, mask, bids={"task": "rest"}, cleaning=cleaning)
    # ICA-AROMA's strategy cleans the AROMA-denoised copies (nilearn refuses any other run for it)
    desc = "desc-smoothAROMAnonaggr_bold" if confounds == "ica_aroma" else "desc-preproc_bold"
    assert len(sd.paths) == 5 and all(desc in p for p in sd.paths)
    for i, path in enumerate(sd.paths):
        if isinstance(confounds, str):
            conf, sample_mask = load_confounds_strategy(path, denoise_strategy=confounds)
        else:
            import pandas as pd

            table = pd.read_csv(path.split("_space-")[0] + "_desc-confounds_timeseries.tsv", sep="\t")
            conf, sample_mask = table[list(confounds)].bfill(limit=1), None
        raw = _raw(path, mask)
        clean = {"detrend": True, "confounds": conf, "sample_mask": sample_mask, "high_pass": 0.01, "low_pass": 0.1,
                 "t_r": 2.0}
        want = signal.clean(raw.T, standardize="zscore_sample", **clean).T
        a = sum(r["columns"] for r in sd.run_records[:i])
        assert sd.run_records[i]["columns"] == want.shape[1]
        _assert_z_close(sd.X[:, a:a + want.shape[1]], want, raw, **clean)
    if confounds == "scrubbing":  # the generator's motion exceeds fd_threshold = 0.5 mm in places
        assert sum(r["volumes"] - r["columns"] for r in sd.run_records) > 0


def test_ica_aroma_reads_the_aroma_runs_or_is_refused_with_the_reason(tree, tmp_path):
    site, mask = tree
    aroma = Cleaning(confounds="ica_aroma")
    assert aroma.desc == "smoothAROMAnonaggr"
    # an explicit list of desc-preproc runs (no folder to pick the AROMA copies from): refused by run
    preproc = [str(p) for p in site.runs["sub-03"]]
    with pytest.raises(DataValidationError, match="sub-03_task-rest.*desc-preproc_bold.*'ica_aroma' cleans the "
                                                  "ICA-AROMA denoised copy.*not a desc-preproc run"):
        load_site(preproc, mask, cleaning=aroma)
    listed = [p.replace("desc-preproc", "desc-smoothAROMAnonaggr") for p in preproc]
    assert load_site(listed, mask, cleaning=aroma).paths == listed
    # settings nilearn would ignore are refused before anything runs, with the reason
    base = {"sites": [{"name": n, "path": str(tmp_path)} for n in "abc"], "out": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match="'confounds_options'.*always uses ICA-AROMA's non-aggressive"):
        RunConfig.from_dict({**base, "confounds": "ica_aroma", "confounds_options": {"ica_aroma": "basic"}}).validate()
    with pytest.raises(ConfigError, match="'bids.desc'.*desc-smoothAROMAnonaggr"):
        RunConfig.from_dict({**base, "confounds": "ica_aroma", "bids": {"desc": "preproc"}}).validate()
    with pytest.raises(ConfigError, match=r"'confounds_options'.*\['fd_threshold'\].*'simple'"):
        RunConfig.from_dict({**base, "confounds": "simple", "confounds_options": {"fd_threshold": 0.3}}).validate()
    RunConfig.from_dict({**base, "confounds": "ica_aroma", "confounds_options": {"wm_csf": "full"},
                         "bids": {"desc": "smoothAROMAnonaggr"}}).validate()


def test_confounds_asked_for_but_missing_are_refused_by_run(tmp_path):
    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=2, multi_run=False, random_state=8)
    (site.root / "sub-02" / "func" / "sub-02_task-rest_desc-confounds_timeseries.tsv").unlink()
    with pytest.raises(DataValidationError, match="sub-02_task-rest_space.*no fMRIPrep confounds table"):
        load_site(site.root, mask, bids={"task": "rest"}, cleaning=Cleaning(confounds="simple"))
    with pytest.raises(DataValidationError, match=r"no column\(s\) \['nope'\]"):
        load_site(site.root, mask, bids={"task": "rest"}, cleaning=Cleaning(confounds=("nope",)))
    # no confounds asked for: a run without a table is read as before
    assert load_site(site.root, mask, bids={"task": "rest"}, cleaning=Cleaning()).n_subjects == 2


def _leading_tc_corr(X: np.ndarray, tc: np.ndarray, k: int) -> float:
    """Largest |correlation| between the artefact's time course and the data's k leading principal components."""
    _, _, vt = np.linalg.svd(np.asarray(X, np.float64), full_matrices=False)
    return max(abs(np.corrcoef(vt[i], tc)[0, 1]) for i in range(k))


def test_a_planted_motion_artefact_is_removed_by_simple(tree):
    site, mask = tree
    raw = load_site(site.root, mask, bids={"task": "rest"})
    art = np.concatenate([site.artefact[p] for p in raw.paths])
    # without cleaning the artefact leads the data
    assert _leading_tc_corr(raw.X, art, 2) > 0.9
    clean = load_site(site.root, mask, bids={"task": "rest"}, cleaning=Cleaning(confounds="simple"))
    assert clean.paths == raw.paths
    assert _leading_tc_corr(clean.X, art, 5) < 0.1


def test_smoothing_is_nilearn_smooth_img_on_the_analysis_grid(tree):
    from nilearn.image import smooth_img

    site, mask = tree
    sd = load_site(site.root, mask, bids={"task": "rest", "session": "2"}, cleaning=Cleaning(smoothing_fwhm=6.0))
    m, _ = load_mask(mask)
    img = resample_to_img(nib.load(sd.paths[0]), nib.load(str(mask)), interpolation="continuous",
                          force_resample=True, copy_header=True)
    raw = np.asarray(smooth_img(img, 6.0).dataobj)[m]
    _assert_z_close(sd.X, preprocess(raw, standardize=True), raw)


# -- configuration ------------------------------------------------------------------------------

@pytest.mark.parametrize("extra,field", [
    ({"confounds": "aggressive"}, "confounds"),
    ({"confounds": []}, "confounds"),
    ({"confounds_options": {"fd_threshold": 0.3}}, "confounds_options"),
    ({"confounds": "scrubbing", "confounds_options": {"fd_treshold": 0.3}}, "confounds_options"),
    ({"high_pass": 0.1, "low_pass": 0.05}, "low_pass"),
    ({"smoothing_fwhm": -6}, "smoothing_fwhm"),
    ({"on_bad_subject": "ignore"}, "on_bad_subject"),
    ({"detrend": "yes"}, "detrend"),
])
def test_config_validates_cleaning(tmp_path, extra, field):
    base = {"sites": [{"name": n, "path": str(tmp_path)} for n in "abc"], "out": str(tmp_path / "o")}
    with pytest.raises(ConfigError, match=f"'{field}'"):
        RunConfig.from_dict({**base, **extra}).validate()
    ok = RunConfig.from_dict({**base, "confounds": "scrubbing", "confounds_options": {"fd_threshold": 0.3},
                              "high_pass": 0.01, "low_pass": 0.1, "smoothing_fwhm": 6, "on_bad_subject": "skip",
                              "sites": [{"name": n, "path": str(tmp_path), "exclude": ["sub-07"]} for n in "abc"]})
    assert ok.validate().cleaning().strategy == "scrubbing" and ok.sites[0].exclude == ["sub-07"]


def test_cleaning_is_a_consortium_setting(tmp_path):
    from dpneuro.deploy.party import CONSORTIUM_FIELDS, ManifestMismatch, check_manifest, run_manifest

    base = {"sites": [{"name": n, "path": str(tmp_path)} for n in "abc"], "out": str(tmp_path / "o"),
            "space": "grid30"}
    for name in ("confounds", "confounds_options", "detrend", "high_pass", "low_pass", "smoothing_fwhm"):
        assert name in CONSORTIUM_FIELDS
    mine = RunConfig.from_dict({**base, "confounds": "simple"})
    theirs = run_manifest(RunConfig.from_dict(base), "run-1")
    with pytest.raises(ManifestMismatch, match="'confounds'"):
        check_manifest(mine, theirs, party="site 'a'")


def test_the_planner_counts_what_the_site_reads(tmp_path):
    """Planner = run for an fMRIPrep site: the default desc, a subject left out by exclude, and the volumes
    scrubbing keeps (from the confounds tables alone) give the lengths the load stage writes."""
    from dpneuro.run.planner import site_shapes

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=3, random_state=7)
    cfg = RunConfig.from_dict({"sites": [{"name": "site-01", "path": str(site.root), "exclude": ["sub-02"]}],
                               "out": str(tmp_path / "out"), "mask": str(mask), "parcels": 0, "plan": "conv",
                               "bids": {"task": "rest"}, "confounds": "scrubbing"}).validate()
    sd = load_site(site.root, mask, bids=cfg.bids, cleaning=cfg.cleaning(), exclude=cfg.sites[0].exclude)
    (shape,) = site_shapes(cfg)
    assert shape.lengths == tuple(b - a for a, b in sd.boundaries)
    assert sum(r["volumes"] - r["columns"] for r in sd.run_records) > 0  # scrubbing removed some volumes
    assert len(shape.lengths) == 2  # sub-02 left out


# -- the real-data template ------------------------------------------------------------------------

def _template_config():
    import tomllib

    from dpneuro.deploy.sharedfs import load_party_config  # noqa: F401  (the template is a party's config)

    path = Path(__file__).resolve().parents[2] / "site_templates" / "fmriprep.toml"
    return path, tomllib.loads(path.read_text())


def test_the_fmriprep_template_sets_the_real_data_settings_and_nothing_else():
    from dataclasses import fields

    from dpneuro.config import REAL_DATA_SETTINGS

    path, raw = _template_config()
    cfg = RunConfig.from_dict(raw, base=path.parent)
    cfg.validate(data_sites=[])  # offline: a named atlas is checked, not fetched
    for name, value in REAL_DATA_SETTINGS.items():
        assert getattr(cfg, name) == value, name
    where = {"sites", "out", "exchange_dir", "bids", "epsilon"}  # the deployment, the data's layout, the budget
    for f in fields(RunConfig):
        if f.name not in where and f.name not in REAL_DATA_SETTINGS:
            assert f.name not in raw, f"fmriprep.toml sets {f.name}: it keeps every analysis default"
    assert set(raw) - {f.name for f in fields(RunConfig)} == set()


def test_the_fmriprep_template_runs_on_fmriprep_outputs(tmp_path, monkeypatch):
    """The template, with its sites pointed at fMRIPrep trees, runs as written and offline: the shipped atlas is
    read from the package (no fetcher may be called) and the voxels it leaves out become parcels of their own."""
    import dpneuro
    from dpneuro.data import atlases

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    m, affine = load_mask(mask)

    def offline(**kw):
        raise AssertionError("fmriprep.toml must run offline")

    monkeypatch.setattr("nilearn.datasets.fetch_atlas_schaefer_2018", offline)
    monkeypatch.setenv("NILEARN_DATA", str(tmp_path / "empty"))
    atlases._fetch.cache_clear()
    path, raw = _template_config()
    for i, s in enumerate(raw["sites"]):
        s["path"] = str(write_fmriprep_site(tmp_path / s["name"], n_subjects=3, multi_run=False, random_state=20 + i).root)
    # 12 subjects buy no component at the template's epsilon: run anyway, the template's reading is tested
    raw.update(out=str(tmp_path / "out"), mask=str(mask), n_components=4, simulation=True, seed=0,
               allow_noise_maps=True)
    cfg = RunConfig.from_dict(raw, base=tmp_path).validate()
    ica = dpneuro.DecentralizedICA.from_config(cfg).fit()
    assert ica.components_.shape == (4, int(m.sum()))
    assert np.all(np.abs(ica.components_).sum(axis=0) > 0)  # every mask voxel in a feature: none left out
    run = json.loads((Path(ica.output_dir_) / "run.json").read_text())
    assert run["cleaning"]["confounds"] == "simple" and run["cleaning"]["smoothing_fwhm"] == 6.0
    # each site's voxel maps read its runs as the loader did: resampled from 2 mm, smoothed, cleaned
    site_maps = sorted((Path(ica.output_dir_) / "site_maps").glob("*.nii.gz"))
    assert len(site_maps) == 4 and nib.load(str(site_maps[0])).shape[:3] == m.shape
    eps = json.loads((Path(ica.output_dir_) / "privacy.json").read_text())
    assert all(abs(s["epsilon"] - 4.0) < 0.05 for s in eps["sites"].values()), eps["sites"]


# -- time courses -------------------------------------------------------------------------------

def test_time_courses_name_each_runs_session_run_volume_and_onset(tmp_path):
    """sub-01 has two runs in ses-1 and one in ses-2, sub-02 a rest and a motor run, sub-03 one run; scrubbing
    removes volumes: every column of the table names its run and the volume's index and onset in it."""
    import csv

    from dpneuro.report.figures import TIMECOURSE_INDEX, read_timecourses, write_timecourses

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    site = write_fmriprep_site(tmp_path / "s", n_subjects=3, n_volumes=40, tr=1.5, random_state=2)
    sd = load_site(site.root, mask, cleaning=Cleaning(confounds="scrubbing"))
    rec = sd.metadata()
    S = np.vstack([np.arange(sd.n_samples), -np.arange(sd.n_samples)]).astype(float)
    path = write_timecourses(S, tmp_path / "timecourses.tsv", rec)
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f, delimiter="\t"))
    assert list(rows[0]) == [*TIMECOURSE_INDEX, "IC01", "IC02"]
    assert len(rows) == sd.n_samples
    runs = [(r["subject"], r["session"], r["task"], r["run"]) for r in rows]
    assert list(dict.fromkeys(runs)) == [("sub-01", "1", "rest", "1"), ("sub-01", "1", "rest", "2"),
                                         ("sub-01", "2", "rest", "1"), ("sub-02", "n/a", "motor", "n/a"),
                                         ("sub-02", "n/a", "rest", "n/a"), ("sub-03", "n/a", "rest", "n/a")]
    scrubbed = 0
    for r_rec in sd.run_records:
        ent = Path(r_rec["path"]).name
        mine = [r for r in rows if r["subject"] == r_rec["subject"] and f"task-{r['task']}_" in ent
                and (r["session"] == "n/a" or f"ses-{r['session']}_" in ent)
                and (r["run"] == "n/a" or f"run-{r['run']}_" in ent)]
        vols = [int(r["volume"]) for r in mine]
        assert len(vols) == r_rec["columns"] and vols == sorted(vols) and vols[-1] <= 39
        assert vols == (r_rec["kept_volumes"] or list(range(40)))
        scrubbed += 40 - len(vols)
        assert [float(r["onset"]) for r in mine] == [1.5 * v for v in vols]
    assert scrubbed > 0  # the generator's motion spikes were censored, and the indices skip them
    assert [float(r["IC02"]) for r in rows] == list(-S[0])
    side = json.loads(path.with_suffix(".json").read_text())
    assert side["RepetitionTime"] == 1.5 and side["onset"]["Units"] == "s"
    subjects, back = read_timecourses(path)
    np.testing.assert_array_equal(back, S)
    assert subjects == [r["subject"] for r in rows]
    # a matrix given in memory: one run per subject, onsets from the site's TR
    write_timecourses(S[:, :5], tmp_path / "mem.tsv", {"subject_ids": ["a", "b"], "boundaries": [(0, 2), (2, 5)],
                                                       "tr": 2.0})
    lines = [ln.split("\t") for ln in (tmp_path / "mem.tsv").read_text().splitlines()[1:]]
    assert [ln[:6] for ln in lines][2] == ["b", "n/a", "n/a", "n/a", "0", "0.0"]
    assert json.loads((tmp_path / "mem.json").read_text())["RepetitionTime"] == 2.0
    with pytest.raises(ValueError, match="5 time points but the site's runs index 4"):
        write_timecourses(S[:, :5], tmp_path / "bad.tsv", {"subject_ids": ["a"], "boundaries": [(0, 4)]})


def test_transform_reads_new_subjects_as_the_fit_read_its_sites(tmp_path):
    """transform applies the fitted run's BIDS filters, cleaning and smoothing: a site given again gives the time
    courses the fit wrote for it (without the task filter sub-02's motor run would be read too)."""
    import dpneuro

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    sites = {f"site-0{i}": write_fmriprep_site(tmp_path / f"s{i}", n_subjects=3, n_volumes=40, random_state=i).root
             for i in (1, 2, 3)}
    ica = dpneuro.DecentralizedICA(n_components=3, mask=str(mask), parcels=0, plan="none", random_state=0,
                                   site_voxel_maps=False, out=tmp_path / "out", bids={"task": "rest"},
                                   confounds="simple", high_pass=0.01, smoothing_fwhm=6.0)
    ica.fit({name: str(root) for name, root in sites.items()})
    got = ica.transform(str(sites["site-02"]))
    want = ica.timecourses_["site-02"]
    assert [g.shape for g in got] == [want[s].shape for s in ("sub-01", "sub-02", "sub-03")]
    assert got[1].shape[0] == 40  # sub-02's rest run only
    for g, s in zip(got, ("sub-01", "sub-02", "sub-03")):
        np.testing.assert_allclose(g, want[s], rtol=1e-4, atol=1e-4)


def test_a_costly_site_keeps_its_voxels_once_for_its_voxel_maps(tmp_path):
    """Resampled and smoothed runs are decoded once: the voxel maps read the voxels the loader kept, which are
    the runs as a fresh decode gives them (column for column)."""
    from dpneuro.data.load import voxel_decoder
    from dpneuro.data.parcellation import Parcellation, coordinate_parcels

    mask = analysis_mask(tmp_path / "mask.nii.gz")
    m, _ = load_mask(mask)
    site = write_fmriprep_site(tmp_path / "s", n_subjects=2, random_state=4)
    cleaning = RunConfig.from_dict({"sites": [{"name": "a", "path": "."}], "out": "o", "confounds": "simple",
                                    "smoothing_fwhm": 6.0}).cleaning()
    pc = Parcellation(coordinate_parcels(m, 12, seed=0))
    sd = load_site(site.root, mask, parcels=pc, bids={"task": "rest"}, cleaning=cleaning,
                   voxels_path=tmp_path / "V.npy", memmap_path=tmp_path / "X.npy")
    assert sd.voxels_path == str(tmp_path / "V.npy")
    V = np.load(sd.voxels_path, mmap_mode="r")
    assert V.shape == (int(m.sum()), sd.n_samples)
    np.testing.assert_allclose(pc.reduce(np.asarray(V)), sd.X, rtol=1e-5, atol=1e-6)  # the same decode, reduced
    record = {"run_records": sd.run_records, "voxels": sd.voxels_path}
    kept, fresh = voxel_decoder(record, mask, cleaning), voxel_decoder({"run_records": sd.run_records}, mask,
                                                                       cleaning)
    for path in sd.paths:
        np.testing.assert_allclose(kept(path), fresh(path), rtol=1e-5, atol=1e-5)
    # runs on the analysis grid without cleaning: nothing kept, reading them again is as cheap
    grid = nib.load(str(mask))
    rng = np.random.default_rng(0)
    (tmp_path / "plain").mkdir()
    for i in range(2):
        nib.Nifti1Image(rng.standard_normal(grid.shape + (20,)).astype(np.float32), grid.affine).to_filename(
            tmp_path / "plain" / f"sub-{i + 1:02d}_bold.nii.gz")
    plain = load_site(tmp_path / "plain", mask, parcels=pc, voxels_path=tmp_path / "W.npy")
    assert plain.voxels_path is None and not (tmp_path / "W.npy").exists()
