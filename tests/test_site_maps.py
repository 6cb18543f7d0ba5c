"""Each site's own voxel maps: dual regression on its own data, at voxel resolution, with no release."""

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.config import RunConfig
from dpneuro.io import DataValidationError, decode_run
from dpneuro.maps import zscore_columns
from dpneuro.metrics import match_components
from dpneuro.pipeline import prepare, run_stages
from dpneuro.site_maps import site_voxel_maps, subject_map
from dpneuro.synth import make_consortium

R = 4


def test_subject_map_is_the_least_squares_fit_on_normalised_time_courses():
    rng = np.random.default_rng(0)
    T, V = 120, 300
    S = rng.standard_normal((R, T)) * np.array([[1.0], [3.0], [0.5], [2.0]]) + 4.0  # offsets and scales
    Sn = (S - S.mean(1, keepdims=True)) / S.std(1, keepdims=True)
    A = rng.standard_normal((V, R))
    np.testing.assert_allclose(subject_map(A @ Sn, S), A, atol=1e-10)
    # with noise: the normal equations' solution
    Y = A @ Sn + rng.standard_normal((V, T))
    np.testing.assert_allclose(subject_map(Y, S), Y @ Sn.T @ np.linalg.inv(Sn @ Sn.T), atol=1e-10)


def test_a_component_constant_over_a_subject_gets_a_zero_map():
    rng = np.random.default_rng(1)
    S = rng.standard_normal((R, 50))
    S[2] = 7.0
    B = subject_map(rng.standard_normal((40, 50)), S)
    assert np.all(np.isfinite(B)) and np.all(B[:, 2] == 0) and np.all(np.abs(B[:, [0, 1, 3]]).sum(0) > 0)


def _write_runs(folder: Path, blocks: list[np.ndarray], mask: np.ndarray) -> list[str]:
    paths = []
    for k, blk in enumerate(blocks):
        vol = np.zeros(mask.shape + (blk.shape[1],), np.float32)
        vol[mask] = blk
        p = folder / f"run{k}.nii.gz"
        nib.Nifti1Image(vol, np.eye(4)).to_filename(p)
        paths.append(str(p))
    return paths


def test_site_maps_average_the_subjects_fits_over_all_their_runs(tmp_path):
    """Three subjects, the second with two runs: decoded as the loader does, one fit per subject, averaged."""
    rng = np.random.default_rng(2)
    mask = np.zeros((6, 5, 4), bool)
    mask[1:5, 1:4, :] = True
    V = int(mask.sum())
    lengths = [30, 25, 20, 35]  # runs; subject 2 has runs 1 and 2
    blocks = [rng.standard_normal((V, n)) * 3 + 10 for n in lengths]
    files = _write_runs(tmp_path, blocks, mask)
    runs = [[files[0]], [files[1], files[2]], [files[3]]]
    boundaries = [(0, 30), (30, 75), (75, 110)]
    S = rng.standard_normal((R, 110))
    got = site_voxel_maps(runs, boundaries, S, mask, workers=2)

    fits = []
    for rs, (a, b) in zip(runs, boundaries):
        Y = np.concatenate([decode_run(f, mask=mask, standardize=True, detrend=False) for f in rs], axis=1)
        fits.append(subject_map(Y, S[:, a:b]))
    np.testing.assert_allclose(got, zscore_columns(np.mean(fits, axis=0)), atol=1e-10)
    # a subject is one person however many runs: fitting the runs apart gives other maps
    split = [fits[0], subject_map(decode_run(files[1], mask=mask, standardize=True, detrend=False), S[:, 30:55]),
             fits[2]]
    assert np.abs(got - zscore_columns(np.mean(split, axis=0))).max() > 0.05


def test_a_file_that_changed_since_the_load_is_refused(tmp_path):
    rng = np.random.default_rng(3)
    mask = np.ones((4, 4, 3), bool)
    files = _write_runs(tmp_path, [rng.standard_normal((48, 30)), rng.standard_normal((48, 28))], mask)
    with pytest.raises(DataValidationError, match="run1.nii.gz.*28 volumes but had 30"):
        site_voxel_maps([[files[0]], [files[1]]], [(0, 30), (30, 60)], rng.standard_normal((R, 60)), mask)


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("site_maps")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=6, n_components=R, n_timepoints=80,
                          space="grid30", seed=7)
    return root, man


def _run(root: Path, man: dict, name: str, **kw) -> dict:
    sites = [{"name": s["site"], "path": s["path"]} for s in man["sites"]]
    cfg = RunConfig.from_dict({**dict(sites=sites, out=str(root / name), mask=man["mask"], n_components=R, seed=3,
                                      truth=str(root / "data"), parcels=36, ica="spatial", pca_epsilon=20.0), **kw})
    out = run_stages(prepare(cfg)[0])
    return {k: json.loads(Path(out[k]).read_text()) if k in ("maps", "reduce") else out[k] for k in out}


def test_site_maps_resolve_what_the_parcels_blur_and_cost_no_privacy(consortium):
    """With voxel-level truth each site's own maps beat the painted parcels; privacy and group maps unchanged."""
    root, man = consortium
    on = _run(root, man, "on")
    off = _run(root, man, "off", site_voxel_maps=False)
    m_on, m_off = on["maps"]["truth"]["metrics"], off["maps"]["truth"]["metrics"]
    site_r = m_on["site voxel maps: mean |r| with truth"]
    # parcels of 25 voxels blur blobs of a few voxels; 6 subjects' own voxels do not
    assert site_r > m_on["mean |r| with truth"] + 0.1, m_on
    assert "site voxel maps: mean |r| with truth" not in m_off and off["maps"]["site_maps"] == {}
    # the same release, the same group maps: the site maps spent nothing and changed nothing
    assert Path(on["maps"]["privacy"]).read_bytes() == Path(off["maps"]["privacy"]).read_bytes()
    np.testing.assert_array_equal(np.asarray(nib.load(on["maps"]["components"]).dataobj),
                                  np.asarray(nib.load(off["maps"]["components"]).dataobj))
    out = Path(root / "on")
    mask = np.asarray(nib.load(man["mask"]).dataobj) > 0
    truth = np.asarray(nib.load(man["truth"]["maps"]).dataobj)[mask]
    for s in man["sites"]:
        img = nib.load(out / "site_maps" / f"{s['site']}.nii.gz")
        maps = np.asarray(img.dataobj)[mask]
        assert img.shape == mask.shape + (R,)
        assert np.mean(np.abs(match_components(maps, truth)[1])) > m_on["mean |r| with truth"]
    html = (out / "report.html").read_text()
    assert "Voxel maps of each site" in html and "never sent" in html


def test_no_site_maps_at_voxel_resolution(consortium):
    root, man = consortium
    vox = _run(root, man, "vox", parcels=0)
    assert vox["maps"]["site_maps"] == {} and not (root / "vox" / "site_maps").exists()
    assert "Voxel maps of each site" not in (root / "vox" / "report.html").read_text()
