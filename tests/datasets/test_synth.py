"""Tests for dpneuro.datasets.synth (synthetic multi-site consortium)."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy.stats import kurtosis

from dpneuro.data.images import load_space
from dpneuro.datasets.synth import garch_sources, load_manifest, make_consortium


def masked(path, mask):
    """D x T float array of a 4-D file inside the boolean mask."""
    return np.asarray(nib.load(path).dataobj)[mask]


def all_subjects(man):
    return [sub for site in man["sites"] for sub in site["subjects"]]


@pytest.fixture(scope="module")
def grid(tmp_path_factory):
    out = tmp_path_factory.mktemp("grid")
    man = make_consortium(
        out, n_sites=2, subjects_per_site=[2, 3], n_components=5,
        n_timepoints=40, space="grid30", random_state=7, noise=0.5, tr=1.5,
    )
    return out, man


@pytest.fixture(scope="module")
def mni6(tmp_path_factory):
    out = tmp_path_factory.mktemp("mni6")
    man = make_consortium(
        out, n_sites=1, subjects_per_site=2, n_components=4,
        n_timepoints=12, space="mni6mm", random_state=3, noise=0.0,
    )
    return out, man


# ---------------------------------------------------------------------------
# layout, shapes, headers
# ---------------------------------------------------------------------------

def test_grid30_files_shapes_and_headers(grid):
    out, man = grid
    assert man["space"] == "grid30"
    assert man["n_components"] == 5 and man["n_timepoints"] == 40
    assert man["tr"] == 1.5 and man["seed"] == 7
    assert Path(man["manifest_path"]) == out / "manifest.json"
    assert [s["site"] for s in man["sites"]] == ["site-01", "site-02"]
    ids = [sub["id"] for sub in all_subjects(man)]
    assert ids == ["sub-0001", "sub-0002", "sub-0003", "sub-0004", "sub-0005"]
    assert Path(man["sites"][1]["subjects"][0]["path"]) == out / "site-02" / "sub-0003_bold.nii.gz"

    mask_img = nib.load(man["mask"])
    assert mask_img.shape == (30, 30, 1)
    assert np.asarray(mask_img.dataobj).all()  # the whole grid is in the mask
    np.testing.assert_array_equal(mask_img.affine, np.eye(4))

    for sub in all_subjects(man):
        img = nib.load(sub["path"])
        assert img.shape == (30, 30, 1, 40)
        assert img.get_data_dtype() == np.float32
        np.testing.assert_array_equal(img.affine, np.eye(4))
        assert img.header.get_zooms() == pytest.approx((1.0, 1.0, 1.0, 1.5))
        assert img.header.get_xyzt_units() == ("mm", "sec")
        S = np.load(sub["sources"])
        assert S.shape == (5, 40) and S.dtype == np.float32

    A = np.load(man["truth"]["A"])
    assert A.shape == (900, 5) and A.dtype == np.float32
    maps = nib.load(man["truth"]["maps"])
    assert maps.shape == (30, 30, 1, 5)
    np.testing.assert_array_equal(np.asarray(maps.dataobj).reshape(900, 5), A)


def test_manifest_json_is_relative_and_round_trips(grid):
    out, man = grid
    raw = json.loads((out / "manifest.json").read_text())
    assert raw["mask"] == "mask.nii.gz"
    assert raw["sites"][0]["subjects"][0]["path"] == "site-01/sub-0001_bold.nii.gz"
    assert "manifest_path" not in raw
    assert load_manifest(out) == man
    assert load_manifest(out / "manifest.json") == man


def test_mni6mm_mask_affine_and_noiseless_ground_truth(mni6):
    out, man = mni6
    mask_img = nib.load(man["mask"])
    mask = np.asarray(mask_img.dataobj) > 0
    assert mask.shape == (34, 40, 33)
    assert mask.sum() == 8735 == man["n_voxels"]
    np.testing.assert_allclose(np.diag(mask_img.affine)[:3], 6.0)
    ref_mask, ref_aff = load_space("mni6mm")
    np.testing.assert_array_equal(mask, ref_mask)
    np.testing.assert_allclose(mask_img.affine, ref_aff)

    A = np.load(man["truth"]["A"]).astype(np.float64)
    assert A.shape == (8735, 4)
    for sub in all_subjects(man):
        img = nib.load(sub["path"])
        assert img.shape == (34, 40, 33, 12)
        np.testing.assert_allclose(img.affine, ref_aff)
        data = np.asarray(img.dataobj)
        assert not data[~mask].any()  # nothing outside the brain
        S = np.load(sub["sources"]).astype(np.float64)
        np.testing.assert_allclose(data[mask], A @ S, rtol=1e-5, atol=1e-5)


def test_noise_level_matches_argument(grid):
    _, man = grid
    A = np.load(man["truth"]["A"]).astype(np.float64)
    mask = np.ones((30, 30, 1), bool)
    resid = [
        masked(sub["path"], mask) - A @ np.load(sub["sources"])
        for sub in all_subjects(man)
    ]
    assert np.std(np.concatenate(resid, axis=1)) == pytest.approx(0.5, rel=0.03)


def test_unequal_subjects_per_site(tmp_path):
    man = make_consortium(tmp_path, 3, [1, 3, 2], n_components=2,
                          n_timepoints=5, space="grid30")
    assert [len(s["subjects"]) for s in man["sites"]] == [1, 3, 2]
    ids = [sub["id"] for sub in all_subjects(man)]
    assert len(set(ids)) == 6 == man["n_subjects"]
    site3 = sorted(p.name for p in (tmp_path / "site-03").iterdir())
    assert site3 == ["sub-0005_bold.nii.gz", "sub-0006_bold.nii.gz"]


# ---------------------------------------------------------------------------
# determinism
# ---------------------------------------------------------------------------

def _bytes(man):
    return [Path(sub["path"]).read_bytes() for sub in all_subjects(man)]


def test_same_seed_same_bytes_different_seed_differs(grid, tmp_path):
    _, man = grid
    kw = dict(n_sites=2, subjects_per_site=[2, 3], n_components=5,
              n_timepoints=40, space="grid30", noise=0.5, tr=1.5)
    again = make_consortium(tmp_path / "a", random_state=7, **kw)
    assert _bytes(again) == _bytes(man)
    assert Path(again["mask"]).read_bytes() == Path(man["mask"]).read_bytes()
    np.testing.assert_array_equal(np.load(again["truth"]["A"]), np.load(man["truth"]["A"]))

    other = make_consortium(tmp_path / "b", random_state=8, **kw)
    assert not np.array_equal(np.load(other["truth"]["A"]), np.load(man["truth"]["A"]))
    for a, b in zip(_bytes(other), _bytes(man)):
        assert a != b


def test_adding_sites_or_subjects_keeps_existing_data(tmp_path):
    kw = dict(n_components=3, n_timepoints=10, space="grid30", random_state=1)
    small = make_consortium(tmp_path / "s", 2, [2, 2], **kw)
    big = make_consortium(tmp_path / "b", 3, [3, 2, 2], **kw)
    np.testing.assert_array_equal(np.load(small["truth"]["A"]), np.load(big["truth"]["A"]))
    mask = np.ones((30, 30, 1), bool)
    for s_small, s_big in zip(small["sites"], big["sites"]):
        # subject numbers shift, the data of the m-th subject at a site does not
        for a, b in zip(s_small["subjects"], s_big["subjects"]):
            np.testing.assert_array_equal(masked(a["path"], mask), masked(b["path"], mask))
    assert big["sites"][1]["subjects"][0]["id"] == "sub-0004"


def test_rerun_removes_stale_subjects(tmp_path):
    kw = dict(n_components=2, n_timepoints=5, space="grid30")
    make_consortium(tmp_path, 2, 3, **kw)
    man = make_consortium(tmp_path, 1, 2, **kw)
    assert sorted(p.name for p in (tmp_path / "site-01").iterdir()) == [
        "sub-0001_bold.nii.gz", "sub-0002_bold.nii.gz"]
    assert not list((tmp_path / "site-02").glob("*.nii.gz"))
    assert len(list((tmp_path / "truth").glob("S_*.npy"))) == 2
    assert man["n_subjects"] == 2


def test_foreign_files_in_site_folder_warn(tmp_path):
    (tmp_path / "site-01").mkdir()
    (tmp_path / "site-01" / "other.nii.gz").write_bytes(b"")
    with pytest.warns(RuntimeWarning, match="other.nii.gz"):
        make_consortium(tmp_path, 1, 1, n_components=2, n_timepoints=5, space="grid30")


# ---------------------------------------------------------------------------
# sources and maps
# ---------------------------------------------------------------------------

def test_sources_standardised_and_heavy_tailed(tmp_path):
    man = make_consortium(tmp_path, 1, 2, n_components=20, n_timepoints=400,
                          space="grid30", random_state=0)
    S = np.concatenate([np.load(s["sources"]) for s in all_subjects(man)], axis=0)
    S = S.astype(np.float64)
    np.testing.assert_allclose(S.mean(axis=1), 0, atol=1e-5)
    np.testing.assert_allclose(S.std(axis=1), 1, atol=1e-5)
    k = kurtosis(S, axis=1, fisher=False)
    assert k.mean() > 3.5  # Gaussian would be 3
    # independent components: sample correlations small
    C = np.corrcoef(S[:20])
    assert np.abs(C[np.triu_indices(20, 1)]).max() < 0.3
    g = man["truth"]["garch"]
    a, b = np.array(g["alpha"]), np.array(g["beta"])
    assert np.all((a >= 0.2) & (a <= 0.3)) and np.all((a + b >= 0.8) & (a + b <= 0.9))
    # finite fourth moment, theoretical kurtosis >= 3.8 for every source
    p = a + b
    assert np.all(p**2 + 2 * a**2 < 1)
    assert np.all(3 * (1 - p**2) / (1 - p**2 - 2 * a**2) >= 3.8)


def test_garch_sources_direct():
    rng = np.random.default_rng(0)
    R = 10
    S = garch_sources(3000, np.full(R, 0.18), np.full(R, 0.78), rng)
    assert S.shape == (R, 3000)
    np.testing.assert_allclose(S.std(axis=1), 1)
    # theoretical kurtosis 3(1-(a+b)^2)/(1-(a+b)^2-2a^2) = 5.1 for these values
    assert kurtosis(S, axis=1, fisher=False).mean() > 4
    with pytest.raises(ValueError, match="stationary"):
        garch_sources(10, [0.5], [0.6], rng)


def test_maps_unit_max_overlap_partly_but_differ(grid, mni6):
    for _, man in (grid, mni6):
        A = np.load(man["truth"]["A"]).astype(np.float64)
        R = A.shape[1]
        np.testing.assert_allclose(A.max(axis=0), 1.0)
        assert A.min() >= 0
        support = A > 0
        # sparse blobs, not whole-brain maps
        assert np.all(support.mean(axis=0) < 0.6)
        overlap = support.T.astype(int) @ support.astype(int)
        off = overlap[~np.eye(R, dtype=bool)]
        assert off.max() > 0  # some maps share voxels ...
        C = np.corrcoef(A.T)[~np.eye(R, dtype=bool)]
        assert C.max() < 0.9  # ... but none is a copy of another
        assert np.linalg.matrix_rank(A) == R


# ---------------------------------------------------------------------------
# arguments, progress, CLI
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(n_sites=0, subjects_per_site=2), "n_sites"),
        (dict(n_sites=1.5, subjects_per_site=2), "n_sites"),
        (dict(n_sites=True, subjects_per_site=2), "n_sites"),
        (dict(n_sites=2, subjects_per_site=[1, 2, 3]), "lists 3 sites"),
        (dict(n_sites=2, subjects_per_site=[1, 0]), "subjects_per_site must be >= 1"),
        (dict(n_sites=2, subjects_per_site=1, n_timepoints=[40]), "n_timepoints lists 1 sites"),
        (dict(n_sites=2, subjects_per_site=1, n_timepoints=[40, 2]), "n_timepoints must be >= 3"),
        (dict(n_sites=1, subjects_per_site=1, space="mni1mm"), "unknown space"),
        (dict(n_sites=1, subjects_per_site=1, noise=-1.0), "noise"),
        (dict(n_sites=1, subjects_per_site=1, tr=0.0), "tr"),
        (dict(n_sites=1, subjects_per_site=1, n_timepoints=1), "n_timepoints"),
        (dict(n_sites=1, subjects_per_site=1, n_components=901), "exceeds"),
        (dict(n_sites=1, subjects_per_site=1, random_state=-1), "random_state"),
    ],
)
def test_bad_arguments(tmp_path, kwargs, msg):
    kwargs.setdefault("space", "grid30")
    with pytest.raises(ValueError, match=msg):
        make_consortium(tmp_path / "x", **kwargs)
    assert not (tmp_path / "x").exists()  # nothing written on bad input


def test_progress_bar(tmp_path, terminal, capsys):
    make_consortium(tmp_path, 1, 2, n_components=2, n_timepoints=5, space="grid30", progress=True)
    assert capsys.readouterr().err == ""  # a log (stderr is not a terminal): asked for, and still silent
    term = terminal()
    make_consortium(tmp_path, 1, 2, n_components=2, n_timepoints=5, space="grid30", progress=True)
    assert "2/2" in term.getvalue()
    before = term.getvalue()
    make_consortium(tmp_path, 1, 2, n_components=2, n_timepoints=5, space="grid30")
    assert term.getvalue() == before


def test_load_manifest_errors(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        load_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="not a dpneuro"):
        load_manifest(tmp_path)


def test_cli_synth(tmp_path, capsys):
    from dpneuro.cli import main

    out = tmp_path / "cons"
    rc = main(["synth", "--out", str(out), "--sites", "2", "--subjects", "2,3",
               "--space", "grid30", "--timepoints", "20", "-q"])
    assert rc == 0
    assert capsys.readouterr().out == ""
    man = load_manifest(out)
    assert [len(s["subjects"]) for s in man["sites"]] == [2, 3]
    from dpneuro.config import SYNTHETIC_CONSORTIUM

    assert man["n_components"] == SYNTHETIC_CONSORTIUM["components"] and man["n_timepoints"] == 20
    for sub in all_subjects(man):
        img = nib.load(sub["path"])
        assert img.shape == (30, 30, 1, 20) and img.get_data_dtype() == np.int16  # the default storage
    assert (out / "truth" / "A.npy").is_file()

    rc = main(["synth", "--out", str(tmp_path / "bad"), "--sites", "0",
               "--space", "grid30", "-q"])
    assert rc == 2
    assert "n_sites" in capsys.readouterr().err

    # the realistic model: what the library's network_model gives for the same seed
    from dpneuro.datasets.synth import network_model

    net = tmp_path / "net"
    assert main(["synth", "--out", str(net), "--sites", "1", "--subjects", "1", "--space", "grid30",
                 "--components", "4", "--timepoints", "20", "--model", "networks", "--dtype", "float32", "-q"]) == 0
    man = load_manifest(net)
    assert man["model"] == "networks"
    np.testing.assert_array_equal(np.load(man["truth"]["A"]), network_model("grid30", 4, random_state=0).A)


def test_int16_storage_keeps_the_data_to_its_quantisation_step(tmp_path):
    a = make_consortium(tmp_path / "f", n_sites=1, subjects_per_site=1, n_components=3, n_timepoints=30,
                        space="grid30", random_state=5)
    b = make_consortium(tmp_path / "i", n_sites=1, subjects_per_site=1, n_components=3, n_timepoints=30,
                        space="grid30", random_state=5, dtype="int16")
    x = np.asarray(nib.load(all_subjects(a)[0]["path"]).dataobj, dtype=np.float64)
    y = np.asarray(nib.load(all_subjects(b)[0]["path"]).dataobj, dtype=np.float64)
    step = np.ptp(x) / 65535
    assert np.abs(x - y).max() <= step and np.abs(x - y).max() > 0
    assert nib.load(all_subjects(b)[0]["path"]).get_data_dtype() == np.int16
    with pytest.raises(ValueError, match="dtype"):
        make_consortium(tmp_path / "z", n_sites=1, subjects_per_site=1, space="grid30", dtype="float16")


# ---------------------------------------------------------------------------
# parallel workers, compression, the 3 mm grid
# ---------------------------------------------------------------------------

def _sha256s(root: Path) -> dict[str, str]:
    import hashlib

    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("kw", [
    dict(model="blobs", space="grid30", n_components=4),
    dict(model="blobs", space="mni6mm", n_components=4, states=2, dtype="int16"),
    dict(model="networks", space="mni6mm", n_components=4),
    dict(model="networks", space="grid30", n_components=3, dtype="int16", compress=False),
], ids=["blobs", "blobs-states-int16", "networks", "networks-int16-nii"])
def test_workers_do_not_change_a_byte(tmp_path, kw):
    kw = dict(n_sites=2, subjects_per_site=[2, 3], n_timepoints=12, random_state=6, **kw)
    make_consortium(tmp_path / "w1", workers=1, **kw)
    make_consortium(tmp_path / "w2", workers=2, **kw)
    one, two = _sha256s(tmp_path / "w1"), _sha256s(tmp_path / "w2")
    assert len(one) >= 1 + 2 + 2 * 5 + 1  # manifest, mask, maps, A, 5 subjects x (BOLD, sources)
    assert one == two  # every file, the manifest and gzip streams included


def test_uncompressed_nii_same_data_and_found_by_the_loaders(tmp_path):
    from dpneuro.data.discovery import find_subjects

    kw = dict(n_sites=2, subjects_per_site=[1, 2], n_components=3, n_timepoints=10, space="mni6mm", random_state=2,
              dtype="int16")
    gz = make_consortium(tmp_path / "gz", **kw)
    nii = make_consortium(tmp_path / "nii", **kw, compress=False)
    raw = json.loads((tmp_path / "nii" / "manifest.json").read_text())
    assert raw["sites"][0]["subjects"][0]["path"] == "site-01/sub-0001_bold.nii"
    assert load_manifest(tmp_path / "nii") == nii
    import gzip

    for a, b in zip(all_subjects(gz), all_subjects(nii)):
        assert a["path"].endswith(".nii.gz") and b["path"].endswith("_bold.nii")
        # the .nii is exactly the .nii.gz decompressed: header, scaling and data
        assert gzip.decompress(Path(a["path"]).read_bytes()) == Path(b["path"]).read_bytes()
    for site in nii["sites"]:
        found = find_subjects(site["path"]).subjects
        assert [sid for sid, _ in found] == [s["id"] for s in site["subjects"]]
        assert [str(f) for _, files in found for f in files] == [s["path"] for s in site["subjects"]]
    # a compressed re-run into the same folder replaces the .nii files (they are in the old manifest)
    make_consortium(tmp_path / "nii", **kw)
    assert sorted(p.name for p in (tmp_path / "nii" / "site-02").iterdir()) == [
        "sub-0002_bold.nii.gz", "sub-0003_bold.nii.gz"]


@pytest.mark.parametrize("space", ["mni6mm", "grid30"])
@pytest.mark.parametrize("dtype", ["float32", "int16"])
@pytest.mark.parametrize("offset", [0.0, 5.0])
def test_bold_encoding_is_what_nib_save_writes(tmp_path, space, dtype, offset):
    """The writer never builds the float volume; its bytes must still be nib.save's (header, scaling, data).

    offset 5: all in-mask values positive, so the zeros outside the mask (mni6mm; grid30 has none) set the
    int16 range.
    """
    from dpneuro.datasets.synth import _nifti, _SubjectWriter, _to_volume

    mask, affine = load_space(space)
    X = (np.random.default_rng(0).standard_normal((int(mask.sum()), 7)) + offset).astype(np.float32)
    head, data = _SubjectWriter(None, mask, affine, space, 2.5, dtype, False)._encode(X)
    img = _nifti(_to_volume(X, mask), affine, space, 2.5)
    if dtype == "int16":
        img.set_data_dtype(np.int16)
    nib.save(img, tmp_path / "ref.nii")
    assert head + data.tobytes() == (tmp_path / "ref.nii").read_bytes()


@pytest.mark.parametrize("space", ["mni6mm", "grid30"])
def test_bold_gzip_is_what_nib_save_writes(tmp_path, monkeypatch, space):
    """The .nii.gz files are nib.save's at gzip level 1, header included: the files did not change."""
    monkeypatch.setattr(nib.openers.Opener, "default_compresslevel", 1)
    from dpneuro.datasets.synth import _nifti, _to_volume

    man = make_consortium(tmp_path / "c", 1, 2, n_components=3, n_timepoints=6, space=space, random_state=4, workers=2)
    mask, affine = load_space(space)
    for sub in all_subjects(man):
        X = np.asarray(nib.load(sub["path"]).dataobj)[mask]  # float32: exactly the generated data
        nib.save(_nifti(_to_volume(X, mask), affine, space, 2.0), tmp_path / "ref.nii.gz")
        assert Path(sub["path"]).read_bytes() == (tmp_path / "ref.nii.gz").read_bytes()


def test_every_space_has_its_model_parameters():
    from dpneuro.data.images import SPACES
    from dpneuro.datasets.synth import _BLOB_SIGMA, _NET_GLOBAL_SMOOTH, _NET_PHYSIO_SMOOTH, _NET_SIGMA

    for table in (_BLOB_SIGMA, _NET_SIGMA, _NET_PHYSIO_SMOOTH, _NET_GLOBAL_SMOOTH):
        assert set(table) == set(SPACES)
    for space in SPACES:
        if space.startswith("mni"):  # the same anatomy in millimetres on every MNI grid
            vox = float(space[3])
            assert tuple(v * vox for v in _BLOB_SIGMA[space]) == pytest.approx((8.0, 14.0))
            assert _NET_SIGMA[space] == (5.0, 9.0) and _NET_PHYSIO_SMOOTH[space] == (2.0, 8.0)
            assert _NET_GLOBAL_SMOOTH[space] == 25.0


@pytest.mark.parametrize("model", ["blobs", "networks"])
def test_mni3mm_consortium(tmp_path, model):
    man = make_consortium(tmp_path, 1, 2, n_components=3, n_timepoints=4, space="mni3mm", random_state=0, model=model,
                          dtype="int16")
    mask, affine = load_space("mni3mm")
    assert man["space"] == "mni3mm" and man["n_voxels"] == int(mask.sum()) == 69_765
    np.testing.assert_array_equal(np.asarray(nib.load(man["mask"]).dataobj) > 0, mask)
    A = np.load(man["truth"]["A"])
    assert A.shape == (69_765, 3) and np.abs(A).max(axis=0) == pytest.approx(1.0)
    for sub in all_subjects(man):
        img = nib.load(sub["path"])
        assert img.shape == mask.shape + (4,)
        np.testing.assert_allclose(img.affine, affine)
        assert img.header.get_zooms() == pytest.approx((3.0, 3.0, 3.0, 2.0))
        data = np.asarray(img.dataobj)
        step = np.ptp(data) / 65535
        assert np.abs(data[~mask]).max() <= step  # int16: the out-of-brain zeros up to one quantisation step
        assert np.isfinite(data[mask]).all() and data[mask].std() > 0.1
    if model == "networks":
        assert man["truth"]["networks"]["region_sigma_mm"] == [5.0, 9.0]


@pytest.mark.parametrize("workers", [1, 2])
def test_progress_bar_with_workers(tmp_path, terminal, workers):
    term = terminal()
    make_consortium(tmp_path, 2, 3, n_components=2, n_timepoints=5, space="grid30", progress=True, workers=workers)
    assert "6/6" in term.getvalue()


def test_a_failing_subject_stops_the_run(tmp_path, monkeypatch):
    import dpneuro.datasets.synth as synth

    real = synth._subject_data

    def flaky(model, s_idx, m_idx, *args):
        if (s_idx, m_idx) == (1, 0):
            raise RuntimeError("disk on fire")
        return real(model, s_idx, m_idx, *args)

    monkeypatch.setattr(synth, "_subject_data", flaky)
    with pytest.raises(RuntimeError, match="disk on fire"):
        make_consortium(tmp_path, 2, 2, n_components=2, n_timepoints=5, space="grid30", workers=2)
    assert not (tmp_path / "manifest.json").exists()


@pytest.mark.parametrize("kwargs, msg", [
    (dict(workers=0), "workers"),
    (dict(workers=1.5), "workers"),
    (dict(workers=True), "workers"),
    (dict(compress="yes"), "compress"),
])
def test_bad_parallel_arguments(tmp_path, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_consortium(tmp_path / "x", 1, 1, space="grid30", **kwargs)
    assert not (tmp_path / "x").exists()


def test_cli_synth_workers_and_no_compress(tmp_path):
    from dpneuro.cli import main

    out = tmp_path / "cons"
    assert main(["synth", "--out", str(out), "--sites", "1", "--subjects", "3", "--space", "grid30",
                 "--timepoints", "6", "--workers", "2", "--no-compress", "-q"]) == 0
    man = load_manifest(out)
    assert [Path(s["path"]).name for s in all_subjects(man)] == [
        "sub-0001_bold.nii", "sub-0002_bold.nii", "sub-0003_bold.nii"]
    assert nib.load(all_subjects(man)[0]["path"]).shape == (30, 30, 1, 6)
    assert main(["synth", "--out", str(tmp_path / "bad"), "--space", "grid30", "--workers", "0", "-q"]) == 2
