"""Atlases by name: nilearn's coordinate atlases as spheres on the grid (offline, for real) and its fetched atlases
(the fetchers replaced: nothing here downloads)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from nibabel.affines import apply_affine
from sklearn.utils import Bunch

import dpneuro.data.atlases as atlases
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.atlases import atlas_image, coordinates, sphere_labels
from dpneuro.data.images import load_space
from dpneuro.data.parcellation import atlas_labels, is_probabilistic
from dpneuro.run.features import features


@pytest.fixture(autouse=True)
def _fresh_fetch_cache():
    atlases._fetch.cache_clear()
    yield
    atlases._fetch.cache_clear()


def _cfg(tmp_path, **kw) -> RunConfig:
    return RunConfig.from_dict({"sites": [{"name": "a", "path": str(tmp_path)}], "out": str(tmp_path / "out"),
                                "space": "mni6mm", "n_components": 3, "plan": "none", "reduction": "none",
                                "seed": 0, "simulation": True, **kw})


def _in_mask(name, mask, affine):
    """Which centres of a coordinate atlas lie in the mask (their nearest grid voxel is a mask voxel)."""
    v = np.round(apply_affine(np.linalg.inv(affine), coordinates(name)[0])).astype(int)
    ok = np.all((v >= 0) & (v < mask.shape), axis=1)
    out = np.zeros(len(v), bool)
    out[ok] = mask[tuple(v[ok].T)]
    return out


# -- coordinate atlases: shipped with nilearn, for real --------------------------------------------

@pytest.mark.parametrize("name, n_rois", [("power_2011", 264), ("dosenbach_2010", 160), ("seitzman_2018", 300)])
def test_a_coordinate_atlas_is_one_label_per_roi_in_the_mask_on_the_demo_grid(name, n_rois):
    """On the demo's 6 mm grid (coarser than the 5 mm spheres) every ROI whose centre is in the mask keeps a
    region, and each region's voxels are the mask voxels nearest to its centre among those within reach."""
    mask, affine = load_space("mni6mm")
    centres, own, names = coordinates(name)
    assert len(centres) == len(names) == n_rois
    img = atlas_image(name, mask, affine)
    assert img.shape == mask.shape and np.allclose(img.affine, affine)
    labels, regions = atlas_labels(img, mask, affine)
    inside = _in_mask(name, mask, affine)
    assert inside.sum() >= 0.9 * n_rois
    assert set(regions) >= set(np.flatnonzero(inside) + 1)  # region k + 1 is ROI k
    xyz = apply_affine(affine, np.argwhere(mask))
    radius = own if own is not None else np.full(n_rois, 5.0)
    for lab in np.unique(labels[labels >= 0]):
        k = regions[lab] - 1
        d = np.linalg.norm(xyz[labels == lab] - centres[k], axis=1)
        assert np.all(d <= max(radius[k], 6 * np.sqrt(3) / 2) + 1e-6)  # the sphere, or the nearest voxel


def test_on_a_2mm_grid_spheres_are_full_balls_split_by_the_nearer_centre():
    from nilearn.datasets import load_mni152_brain_mask

    img = load_mni152_brain_mask(resolution=2)
    mask, affine = np.asarray(img.dataobj) > 0, img.affine
    assert np.allclose(np.abs(np.diag(affine)[:3]), 2)
    centres = coordinates("dosenbach_2010")[0]
    vol = atlas_image("dosenbach_2010", mask, affine).get_fdata().astype(int)
    counts = np.bincount(vol[mask], minlength=161)[1:]
    inside = _in_mask("dosenbach_2010", mask, affine)
    assert np.all(counts[inside] > 0) and counts.max() == 81  # a 5 mm ball holds 81 voxels of a 2 mm grid
    from scipy.spatial import cKDTree

    d, nearest = cKDTree(centres).query(apply_affine(affine, np.argwhere(mask)))
    within = d <= 5 + 1e-9
    np.testing.assert_array_equal(vol[mask] > 0, within)  # every voxel within 5 mm of a centre, and only those
    np.testing.assert_array_equal(vol[mask][within], nearest[within] + 1)  # ... goes to the nearest
    # a larger radius: the name's parameter
    big = atlas_image("dosenbach_2010:8mm", mask, affine).get_fdata().astype(int)
    assert np.bincount(big[mask], minlength=161)[1:].max() > 81


def test_a_voxel_in_two_spheres_goes_to_the_nearer_centre_ties_to_the_first():
    mask = np.ones((21, 9, 9), bool)
    affine = np.eye(4)
    centres = np.array([[7.0, 4, 4], [13.0, 4, 4]])  # 6 mm apart, 5 mm spheres overlap in x = 9..11
    vol = sphere_labels(centres, 5.0, mask, affine)
    line = vol[:, 4, 4]
    assert line[2:13].tolist() == [1] * 9 + [2] * 2  # x = 10 is equidistant: the first centre keeps it
    assert line[11:19].tolist() == [2] * 8 and line[1] == 0 and line[19] == 0
    assert vol[8, 4, 8] == 1 and vol[12, 4, 8] == 2  # off the axis too
    swapped = sphere_labels(centres[::-1], 5.0, mask, affine)
    assert swapped[10, 4, 4] == 1  # the tie goes to whichever centre comes first
    assert np.all(vol[9, ...][vol[9, ...] > 0] == 1) and np.all(vol[11, ...][vol[11, ...] > 0] == 2)


def test_a_sphere_between_coarse_voxels_still_gets_its_nearest_voxel_if_in_the_mask():
    """6 mm voxels and 2 mm spheres: a centre between voxels reaches none, and takes the voxel nearest to it, from
    another sphere if that one keeps a voxel; a centre outside the mask, or whose nearest voxel is another centre's
    only voxel, gets none."""
    mask = np.ones((6, 6, 6), bool)
    mask[5] = False
    affine = np.diag([6.0, 6, 6, 1])
    centres = np.array([
        [6 + 2.9, 6 + 2.9, 6 + 2.9],   # 0: between voxels, nearest (1, 1, 1)
        [24.0, 24, 12],                # 1: on voxel (4, 4, 2)
        [24 + 2.5, 24 + 2.5, 12],      # 2: nearest voxel (4, 4, 2): centre 1's only voxel -> none
        [30.0 + 1, 12, 12],            # 3: nearest voxel (5, 2, 2), outside the mask -> none
        [18.0, 18, 18],                # 4: on voxel (3, 3, 3) with radius 7 below: 7 voxels
        [18 + 3.2, 18, 18 + 2.9],      # 5: reaches no voxel; nearest (4, 3, 3), one of centre 4's 7
    ])
    radius = np.array([2.0, 2.0, 2.0, 2.0, 7.0, 2.0])
    vol = sphere_labels(centres, radius, mask, affine)
    assert vol[1, 1, 1] == 1 and np.sum(vol == 1) == 1
    assert vol[4, 4, 2] == 2 and np.sum(vol == 3) == 0 and np.sum(vol == 4) == 0
    assert vol[4, 3, 3] == 6 and np.sum(vol == 6) == 1 and np.sum(vol == 5) == 6
    # Power's ROIs on the 6 mm MNI grid with 2 mm spheres (at most one voxel each): every ROI in the mask keeps one
    m6, a6 = load_space("mni6mm")
    labels, regions = atlas_labels(atlas_image("power_2011:2mm", m6, a6), m6, a6)
    assert np.bincount(labels[labels >= 0]).max() == 1
    assert set(regions) == set(np.flatnonzero(_in_mask("power_2011", m6, a6)) + 1)


def test_a_coordinate_atlas_outside_the_grid_is_refused():
    mask, affine = load_space("grid30")  # not MNI space: no coordinate falls in it... except near the origin
    mask = mask.copy()
    mask[:, :] = False
    mask[29, 29] = True
    with pytest.raises(ValueError, match="none of its 160 MNI coordinates"):
        atlas_image("dosenbach_2010", mask, affine)


def test_a_run_with_dosenbach_coordinates_end_to_end(tmp_path):
    """The name passes validation and keeps being a name (not made a path), gives the planner's D, the run's space
    and the features of a whole run, and the manifest tells a 5 mm run from an 8 mm one."""
    import dpneuro
    from dpneuro.datasets.synth import make_consortium
    from dpneuro.deploy.party import ManifestMismatch, check_manifest, run_manifest
    from dpneuro.run.pipeline import stage_space

    man = make_consortium(tmp_path / "data", n_sites=3, subjects_per_site=2, n_components=3, n_timepoints=30,
                          space="mni6mm", random_state=5)
    mask, affine = load_space("mni6mm")
    n_regions = len(atlas_labels(atlas_image("dosenbach_2010", mask, affine), mask, affine)[1])
    assert n_regions >= 150
    cfg = RunConfig.from_dict({"sites": [{"name": s["site"], "path": s["path"]} for s in man["sites"]],
                               "out": "out", "space": "mni6mm", "atlas": "dosenbach_2010", "n_components": 3,
                               "plan": "none", "reduction": "none", "seed": 0, "simulation": True})
    cfg = cfg.resolved(tmp_path).validate()
    assert cfg.atlas == "dosenbach_2010" and cfg.out == str(tmp_path / "out")
    assert features(cfg) == n_regions
    cj = tmp_path / "cfg.json"
    cj.write_text(json.dumps(cfg.to_json()))
    space = json.loads(Path(stage_space(str(cj))).read_text())
    assert space["weighting"] == "orthonormal" and space["n_parcels"] == n_regions
    assert "atlas dosenbach_2010" in space["features"]

    ica = dpneuro.DecentralizedICA(n_components=3, plan="none", reduction="none", space="mni6mm", random_state=0,
                                   out=tmp_path / "run", atlas="dosenbach_2010")
    ica.fit({s["site"]: s["path"] for s in man["sites"]})
    assert ica.config_.atlas == "dosenbach_2010"
    assert ica.basis_.shape == (n_regions, 3) and ica.components_.shape == (3, int(mask.sum()))
    in_region = atlas_labels(atlas_image("dosenbach_2010", mask, affine), mask, affine)[0] >= 0
    assert np.all(ica.components_[:, ~in_region] == 0) and np.all(np.abs(ica.components_[:, in_region]).sum(0) > 0)

    manifest = run_manifest(cfg, "r1")
    assert manifest["grid"]["atlas_sha256"]
    check_manifest(cfg, manifest, party="site 'site-01'")
    with pytest.raises(ManifestMismatch, match="atlas_sha256"):
        check_manifest(replace(cfg, atlas="dosenbach_2010:8mm"), manifest, party="site 'site-01'")


def test_validate_accepts_names_and_refuses_unknown_ones_and_bad_parameters(tmp_path, monkeypatch):
    def offline(**kw):
        raise AssertionError("validate must not fetch")

    monkeypatch.setattr("nilearn.datasets.fetch_atlas_schaefer_2018", offline)
    for ok in ("power_2011", "seitzman_2018:4mm", "schaefer_2018:200", "difumo:1024", "msdl",
               "harvard_oxford:sub-maxprob-thr25-2mm", "smith_2009:rsn20", "Schaefer_2018:100"):
        _cfg(tmp_path, atlas=ok).validate()
    with pytest.raises(ConfigError, match=r"config field 'atlas'.*schaefer_2019:100 does not exist.*atlas name: "
                                          r"power_2011\[:<radius>mm\], dosenbach_2010.*schaefer_2018:100\|200"):
        _cfg(tmp_path, atlas="schaefer_2019:100").validate()
    with pytest.raises(ConfigError, match=r"config field 'atlas'.*schaefer_2018 takes one of 100, 200"):
        _cfg(tmp_path, atlas="schaefer_2018:150").validate()
    with pytest.raises(ConfigError, match=r"config field 'atlas'.*radius in mm"):
        _cfg(tmp_path, atlas="power_2011:big").validate()
    with pytest.raises(ConfigError, match=r"config field 'atlas'.*msdl takes no parameter"):
        _cfg(tmp_path, atlas="msdl:39").validate()
    with pytest.raises(ConfigError, match=r"config field 'atlas'.*missing\.nii\.gz does not exist"):
        _cfg(tmp_path, atlas=str(tmp_path / "missing.nii.gz")).validate()
    # a relative path still becomes absolute, in a config file or in code; a name does not
    assert _cfg(tmp_path, atlas="atlas/x.nii.gz").resolved(tmp_path).atlas == str(tmp_path / "atlas/x.nii.gz")
    assert _cfg(tmp_path, atlas="difumo:64").resolved(tmp_path).atlas == "difumo:64"
    for atlas, expected in (("dosenbach_2010", "dosenbach_2010"), ("atlas/x.nii.gz", str(tmp_path / "atlas/x.nii.gz"))):
        (tmp_path / "run.toml").write_text(f'out = "out"\natlas = "{atlas}"\n[[sites]]\nname = "a"\npath = "."\n')
        assert RunConfig.read(tmp_path / "run.toml").atlas == expected


# -- fetched atlases: nilearn's fetchers replaced ----------------------------------------------------

def _label_file(path: Path, n: int, shift: int = 0) -> str:
    """``n`` slabs of labels along x across the 6 mm MNI mask (written at 3 mm: a fetched atlas has its own
    resolution); ``shift`` moves their borders."""
    mask, affine = load_space("mni6mm")
    fine = np.diag([3.0, 3, 3, 1])
    fine[:3, 3] = affine[:3, 3]
    xs = np.flatnonzero(mask.any(axis=(1, 2)))
    shape = tuple(2 * s for s in mask.shape)
    x = np.arange(shape[0])[:, None, None] // 2 * np.ones(shape, int) - xs[0]
    vol = ((x + shift) * n // len(xs) + 1).clip(1, n).astype(np.int16)
    nib.Nifti1Image(vol, fine).to_filename(path)
    return str(path)


def test_a_fetched_atlas_resolves_once_with_nilearns_data_folder_and_reaches_the_run(tmp_path, monkeypatch):
    monkeypatch.setenv("NILEARN_DATA", str(tmp_path / "nilearn"))
    calls = []
    labels_file = _label_file(tmp_path / "schaefer.nii.gz", 12)

    def fake(**kw):
        calls.append(kw)
        return Bunch(maps=labels_file, labels=[f"r{i}" for i in range(12)])

    monkeypatch.setattr("nilearn.datasets.fetch_atlas_schaefer_2018", fake)
    cfg = _cfg(tmp_path, atlas="schaefer_2018:400").validate()  # 200 ships with dpneuro: 400 is fetched
    assert calls == []  # validating fetches nothing
    mask, affine = cfg.grid()
    assert atlas_image(cfg.atlas, mask, affine) == labels_file
    assert calls == [{"data_dir": None, "verbose": 0, "n_rois": 400, "yeo_networks": 7, "resolution_mm": 2}]
    assert features(cfg) == 12
    from dpneuro.deploy.party import ManifestMismatch, check_manifest, run_manifest
    from dpneuro.run.features import feature_labels

    labels, weighting = feature_labels(cfg, mask, affine)
    assert weighting == "orthonormal" and labels.max() + 1 == 12
    manifest = run_manifest(cfg, "r1")
    assert len(calls) == 1  # once per party: every later reader uses the resolved atlas
    # the manifest hashes what the name resolves to: the same as giving the file
    assert manifest["grid"]["atlas_sha256"] == run_manifest(replace(cfg, atlas=labels_file), "r1")["grid"][
        "atlas_sha256"]
    # another site whose cache holds another version of the atlas under the same name is caught
    atlases._fetch.cache_clear()
    other = _label_file(tmp_path / "schaefer_v2.nii.gz", 12, shift=3)
    monkeypatch.setattr("nilearn.datasets.fetch_atlas_schaefer_2018", lambda **kw: Bunch(maps=other))
    with pytest.raises(ManifestMismatch, match="atlas_sha256"):
        check_manifest(cfg, manifest, party="site 'site-02'")


@pytest.mark.parametrize("atlas, fetcher, expected", [
    ("difumo", "fetch_atlas_difumo", {"dimension": 64, "resolution_mm": 2}),
    ("difumo:128", "fetch_atlas_difumo", {"dimension": 128, "resolution_mm": 2}),
    ("basc_multiscale_2015:122", "fetch_atlas_basc_multiscale_2015", {"resolution": 122, "version": "sym"}),
    ("msdl", "fetch_atlas_msdl", {}),
    ("harvard_oxford:cort-maxprob-thr25-2mm", "fetch_atlas_harvard_oxford", {"atlas_name": "cort-maxprob-thr25-2mm"}),
    ("smith_2009:rsn20", "fetch_atlas_smith_2009", {"dimension": 20, "resting": True}),
    ("smith_2009:bm70", "fetch_atlas_smith_2009", {"dimension": 70, "resting": False}),
    ("allen_rsn_2011", "fetch_atlas_allen_2011", {}),
])
def test_each_name_calls_its_fetcher_with_its_parameters(tmp_path, monkeypatch, atlas, fetcher, expected):
    """Probabilistic maps come back as maps (4-D), in memory or as a file, from the bunch entry the atlas keeps
    them in (Allen's 28 networks are "rsn28")."""
    mask, affine = load_space("mni6mm")
    maps = np.random.default_rng(0).random(mask.shape + (5,)).astype(np.float32)
    img = nib.Nifti1Image(maps, affine)
    calls = []

    def fake(**kw):
        calls.append(kw)
        return Bunch(maps=img, rsn28=img) if fetcher == "fetch_atlas_allen_2011" else Bunch(maps=img)

    monkeypatch.setattr(f"nilearn.datasets.{fetcher}", fake)
    got = atlas_image(atlas, mask, affine)
    assert got is img and is_probabilistic(got)
    assert calls == [{"data_dir": None, "verbose": 0, **expected}]
    assert features(_cfg(tmp_path, atlas=atlas)) == 5


def test_offline_without_a_cache_the_run_is_refused_saying_how_to_provide_the_atlas(tmp_path, monkeypatch):
    import requests

    monkeypatch.delenv("NILEARN_SHARED_DATA", raising=False)
    monkeypatch.setenv("NILEARN_DATA", str(tmp_path / "cache"))

    def offline(**kw):
        raise requests.exceptions.ConnectionError("Max retries exceeded with url: /download (Name resolution)")

    monkeypatch.setattr("nilearn.datasets.fetch_atlas_difumo", offline)
    cfg = _cfg(tmp_path, atlas="difumo:256").validate()
    with pytest.raises(ConfigError) as err:
        features(cfg)
    msg = str(err.value)
    assert msg.startswith("config field 'atlas': 'difumo:256': nilearn could not fetch it (ConnectionError")
    assert str(tmp_path / "cache" / "difumo_atlases") in msg
    assert "python -m dpneuro.data.atlases difumo:256" in msg and "NIfTI file" in msg
    assert atlases.cache_folder("difumo") == tmp_path / "cache" / "difumo_atlases"
    # a failure is not remembered: once the cache is there, the same process reads it
    monkeypatch.setattr("nilearn.datasets.fetch_atlas_difumo", lambda **kw: Bunch(maps=_label_file(
        tmp_path / "d.nii.gz", 4)))
    assert features(cfg) == 4


def test_the_fetch_command_fetches_named_atlases(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr("nilearn.datasets.fetch_atlas_msdl", lambda **kw: Bunch(maps=str(tmp_path / "msdl.nii")))
    assert atlases.main(["msdl", "power_2011"]) == 0
    out = capsys.readouterr().out
    assert f"msdl: {tmp_path / 'msdl.nii'}" in out and "power_2011: shipped with nilearn" in out
    assert atlases.main([]) == 2
