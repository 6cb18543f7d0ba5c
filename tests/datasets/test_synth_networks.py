"""Tests for the realistic "networks" model of dpneuro.datasets.synth (and that the default blobs model is unchanged)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy import ndimage
from scipy.stats import kurtosis

from dpneuro.data.images import load_space
from dpneuro.data.load import preprocess
from dpneuro.data.matrix import scale_columns
from dpneuro.data.parcellation import Parcellation, coordinate_parcels
from dpneuro.datasets.synth import (
    MODELS,
    NETWORK_DEFAULTS,
    NetworkModel,
    _mirror_index,
    canonical_hrf,
    load_manifest,
    make_consortium,
    network_model,
)

R = 20
T = 150
TR = 2.0


@pytest.fixture(scope="module")
def net():
    """20 networks on the 6 mm grid, seed 0 (the benchmarks' set-up)."""
    return network_model("mni6mm", R, random_state=0)


@pytest.fixture(scope="module")
def subjects(net):
    """12 subjects x 150 volumes of `net`: (X, S) pairs."""
    return [net.subject(s, m, T, TR) for s in range(3) for m in range(4)]


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("networks")
    man = make_consortium(out, n_sites=2, subjects_per_site=[1, 2], n_components=5, n_timepoints=30,
                          space="mni6mm", random_state=4, tr=1.5, model="networks")
    return out, man


def world_coords(model: NetworkModel) -> np.ndarray:
    return np.argwhere(model.mask) @ model.affine[:3, :3].T + model.affine[:3, 3]


# ---------------------------------------------------------------------------
# determinism and the written consortium
# ---------------------------------------------------------------------------

def test_same_seed_same_model_and_subjects(net):
    again = network_model("mni6mm", R, random_state=0)
    np.testing.assert_array_equal(again.A, net.A)
    np.testing.assert_array_equal(again.correlation, net.correlation)
    np.testing.assert_array_equal(again.strength, net.strength)
    X1, S1 = net.subject(1, 2, 40, TR)
    X2, S2 = again.subject(1, 2, 40, TR)
    np.testing.assert_array_equal(X1, X2)
    np.testing.assert_array_equal(S1, S2)
    assert X1.dtype == np.float32 and S1.dtype == np.float32
    assert X1.shape == (net.n_voxels, 40) and S1.shape == (R, 40)
    # every subject its own stream; another seed other maps
    assert not np.allclose(net.subject(1, 3, 40, TR)[1], S1)
    assert not np.allclose(network_model("mni6mm", R, random_state=1).A, net.A)
    # subject-level parameters change no map (their own streams)
    np.testing.assert_array_equal(network_model("mni6mm", R, random_state=0, noise=0.1, physio_amplitude=0.0).A, net.A)


def test_subject_is_what_make_consortium_writes(written):
    out, man = written
    assert man["model"] == "networks" and man["noise"] == NETWORK_DEFAULTS["noise"]
    model = network_model("mni6mm", 5, random_state=4)
    mask = np.asarray(nib.load(man["mask"]).dataobj).astype(bool)
    np.testing.assert_array_equal(mask, model.mask)
    np.testing.assert_array_equal(np.load(man["truth"]["A"]), model.A)
    maps = np.asarray(nib.load(man["truth"]["maps"]).dataobj)[mask]
    np.testing.assert_array_equal(maps, model.A)
    for s_idx, site in enumerate(man["sites"]):
        for m_idx, sub in enumerate(site["subjects"]):
            X, S = model.subject(s_idx, m_idx, 30, 1.5)
            img = nib.load(sub["path"])
            assert img.header.get_zooms()[3] == pytest.approx(1.5)
            # float32 on disk: equal up to float32 rounding (in practice bit for bit)
            np.testing.assert_allclose(np.asarray(img.dataobj)[mask], X, rtol=0, atol=1e-6 * np.abs(X).max())
            np.testing.assert_array_equal(np.load(sub["sources"]), S)
    truth = man["truth"]
    assert "garch" not in truth and "n_states" not in truth
    nets = truth["networks"]
    assert set(NETWORK_DEFAULTS) <= set(nets)
    assert np.allclose(nets["correlation"], model.correlation)
    assert len(nets["regions"]) == 5 and all(2 <= len(r) <= 4 for r in nets["regions"])
    # the manifest on disk: relative paths, re-read by load_manifest
    on_disk = json.loads((out / "manifest.json").read_text())
    assert on_disk["model"] == "networks" and not Path(on_disk["mask"]).is_absolute()
    assert load_manifest(out)["truth"]["A"] == man["truth"]["A"]


def test_noise_default_depends_on_the_model(tmp_path):
    blobs = make_consortium(tmp_path / "b", 1, 1, n_components=2, n_timepoints=5, space="grid30")
    nets = make_consortium(tmp_path / "n", 1, 1, n_components=2, n_timepoints=5, space="grid30", model="networks")
    low = make_consortium(tmp_path / "l", 1, 1, n_components=2, n_timepoints=5, space="grid30", model="networks",
                          noise=0.1)
    assert blobs["noise"] == 0.5 and "model" not in blobs
    assert nets["noise"] == NETWORK_DEFAULTS["noise"] == 0.8
    assert low["noise"] == 0.1 and low["truth"]["networks"]["noise"] == 0.1


# ---------------------------------------------------------------------------
# maps
# ---------------------------------------------------------------------------

def test_maps_are_distributed_bilateral_and_sparse(net):
    A = net.A.astype(np.float64)
    assert A.shape == (net.n_voxels, R)
    np.testing.assert_allclose(np.abs(A).max(axis=0), 1.0, rtol=1e-6)
    mirror = _mirror_index(world_coords(net), 0.0)
    pieces, mirror_r = [], []
    for r in range(R):
        vol = np.zeros(net.mask.shape, dtype=bool)
        vol[net.mask] = A[:, r] != 0
        pieces.append(ndimage.label(vol, structure=np.ones((3, 3, 3)))[1])
        mirror_r.append(np.corrcoef(A[:, r], A[mirror, r])[0, 1])
    # every network has >= 2 separate regions (26-connectivity)
    assert min(pieces) >= 2, pieces
    # many networks are (nearly) symmetric across the midline, but not all of them
    mirror_r = np.array(mirror_r)
    assert 0.3 <= np.mean(mirror_r > 0.8) <= 0.9, np.round(mirror_r, 2)
    # sparse and super-Gaussian: spatial excess kurtosis far above 0 for every map
    assert kurtosis(A, axis=0).min() > 10
    assert 0.01 < np.mean(A != 0) < 0.15
    # networks overlap partly, and some have an anticorrelated (negative) region
    support = A != 0
    overlap = support.T.astype(int) @ support.astype(int)
    assert (overlap[np.triu_indices(R, 1)] > 0).any()
    assert (A.min(axis=0) < -0.3).any()


def test_mirror_of_a_bilateral_region_is_across_the_midline(net):
    coords = world_coords(net)
    mirror = _mirror_index(coords, 0.0)
    # the snapped mirror is within half a voxel diagonal of the exact mirror image
    exact = coords * np.array([-1.0, 1.0, 1.0])
    assert np.linalg.norm(coords[mirror] - exact, axis=1).max() <= np.sqrt(3) * 6
    assert np.median(np.linalg.norm(coords[mirror] - exact, axis=1)) <= 3.0
    for regions in net.regions:
        for reg in regions:
            assert 5.0 <= reg["sigma_mm"] <= 9.0 and reg["sign"] in (-1, 1)


def test_grid30_mirrors_across_its_middle_column():
    grid = network_model("grid30", 6, random_state=3)
    assert grid.A.shape == (900, 6) and grid.params["midline_x_mm"] == 14.5
    coords = world_coords(grid)
    mirror = _mirror_index(coords, 14.5)
    np.testing.assert_array_equal(coords[mirror, 0], 29 - coords[:, 0])
    np.testing.assert_array_equal(coords[mirror, 1], coords[:, 1])
    X, S = grid.subject(0, 0, 20, TR)
    assert X.shape == (900, 20) and np.isfinite(X).all()


# ---------------------------------------------------------------------------
# time courses and noise
# ---------------------------------------------------------------------------

def test_hrf_is_the_canonical_double_gamma():
    fine = canonical_hrf(0.1)
    t = (np.arange(fine.size) + 0.5) * 0.1
    assert fine.sum() == pytest.approx(1.0)
    assert t[np.argmax(fine)] == pytest.approx(5.0, abs=0.2)  # peak ~5 s
    assert t[np.argmin(fine)] == pytest.approx(15.0, abs=1.0)  # undershoot ~15 s
    assert fine.min() < 0
    assert canonical_hrf(2.0).size == 16


def test_time_courses_slow_correlated_gaussian(net, subjects):
    f = np.fft.rfftfreq(T, TR)
    iu = np.triu_indices(R, 1)
    low, corr, kurt, mean_corr = [], [], [], 0.0
    for _, S in subjects:
        S = S.astype(np.float64)
        P = np.abs(np.fft.rfft(S - S.mean(axis=1, keepdims=True), axis=1)) ** 2
        low.append(P[:, f < 0.1].sum(axis=1) / P.sum(axis=1))
        C = np.corrcoef(S)
        corr.append(np.abs(C[iu]).mean())
        mean_corr = mean_corr + C / len(subjects)
        kurt.append(kurtosis(S, axis=1).mean())
        assert np.abs(S.mean(axis=1)).max() < 1e-4 * np.abs(S).max()
    assert np.mean(low) > 0.8 and np.min(low) > 0.6  # BOLD: power below 0.1 Hz at TR 2 s
    assert 0.05 <= np.mean(corr) <= 0.5
    # the correlation is the group's, not chance (slow series correlate by chance too: ~0.06 after
    # averaging 12 independent subjects, against ~0.2 here, with a pattern that follows C)
    assert np.abs(mean_corr[iu]).mean() > 0.12
    assert np.corrcoef(mean_corr[iu], net.correlation[iu])[0, 1] > 0.7
    assert abs(np.mean(kurt)) < 1.0  # near-Gaussian, not heavy-tailed


def test_group_correlation_is_positive_definite(net):
    C = net.correlation
    np.testing.assert_allclose(np.diag(C), 1.0)
    np.testing.assert_allclose(C, C.T)
    assert np.linalg.eigvalsh(C).min() > 0.05
    assert 0.1 <= np.abs(C[np.triu_indices(R, 1)]).mean() <= 0.4


def test_noise_terms():
    bare = network_model("mni6mm", 8, random_state=2, noise=0.0, global_amplitude=0.0, physio_amplitude=0.0)
    X, S = bare.subject(0, 1, 60, TR)
    np.testing.assert_allclose(X, bare.A @ S, rtol=0, atol=1e-6)
    white = network_model("mni6mm", 8, random_state=2, noise=0.5, global_amplitude=0.0, physio_amplitude=0.0)
    Xw, Sw = white.subject(0, 1, 60, TR)
    np.testing.assert_array_equal(Sw, S)  # noise levels change no time course
    assert np.std(Xw - white.A @ Sw) == pytest.approx(0.5, rel=0.02)
    full = network_model("mni6mm", 8, random_state=2)
    Xf, Sf = full.subject(0, 1, 60, TR)
    resid = (Xf - full.A @ Sf).astype(np.float64)
    # global signal + smooth structured noise: more than the white noise, and spatially correlated
    assert np.std(resid) > 0.8 * 1.05
    assert np.mean(resid, axis=0).std() > 0.1


def test_second_moments_look_like_real_data(net, subjects):
    """At the analysis' level (z-scored voxels, 100 parcels, unit time points): real-data-like moments."""
    parcels = Parcellation(coordinate_parcels(net.mask, 100, seed=0))
    frob, mean = [], 0.0
    for X, _ in subjects:
        Z = scale_columns(parcels.reduce(preprocess(X))).astype(np.float64)
        P = Z @ Z.T / T
        frob.append(np.linalg.norm(P))
        mean = mean + P / len(subjects)
    assert 0.25 <= np.mean(frob) <= 0.5, np.mean(frob)
    lam = np.linalg.eigvalsh(mean)[::-1]
    assert lam.sum() == pytest.approx(1.0)
    # one dominant (global) direction, then a decay; real parcel data: 0.24, ..., 20th ~0.008
    assert 0.15 <= lam[0] <= 0.4
    assert 0.003 <= lam[19] <= 0.02
    assert lam[4] > 2 * lam[19]


# ---------------------------------------------------------------------------
# the blobs model is unchanged
# ---------------------------------------------------------------------------

def _digest(root: Path) -> str:
    """SHA-256 over every written file: decoded arrays for NIfTI/.npy (robust to gzip), raw bytes otherwise."""
    h = hashlib.sha256()
    for p in sorted(Path(root).rglob("*")):
        if not p.is_file():
            continue
        h.update(p.relative_to(root).as_posix().encode())
        if p.name.endswith(".nii.gz"):
            img = nib.load(p)
            a = np.asarray(img.dataobj)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(np.ascontiguousarray(a).tobytes())
            h.update(np.asarray(img.affine, dtype=np.float64).tobytes())
        elif p.suffix == ".npy":
            a = np.load(p)
            h.update(str((a.dtype.str, a.shape)).encode())
            h.update(np.ascontiguousarray(a).tobytes())
        else:
            h.update(p.read_bytes())
    return h.hexdigest()


#: digests of the blobs model's output recorded with dpneuro/datasets/synth.py as it was before the networks model (the
#: states' when they became planted dFNC connectivity states)
BLOBS_DIGESTS = {
    "plain": ("c23e88369e277d79262ac20d1bccc6f5e3af437ac5ba026f48485d185293027a",
              dict(n_sites=2, subjects_per_site=[1, 2], n_components=4, n_timepoints=15, space="grid30",
                   random_state=11, noise=0.3, tr=1.5)),
    # (re-recorded when the generator moved to dpneuro.datasets.states: the manifest names it; the data are the same)
    "states": ("2ace6742a7c1e2d03facdc04d17b25da450ccd5dfac0d2fdc9e51b43037358b3",
               dict(n_sites=2, subjects_per_site=[2, 1], n_components=4, n_timepoints=15, space="grid30",
                    random_state=2, states=2)),
}


@pytest.mark.parametrize("name", sorted(BLOBS_DIGESTS))
def test_blobs_output_unchanged(tmp_path, name):
    expected, kw = BLOBS_DIGESTS[name]
    make_consortium(tmp_path / "default", **kw)
    make_consortium(tmp_path / "explicit", **kw, model="blobs")
    files = sorted(p.relative_to(tmp_path / "default") for p in (tmp_path / "default").rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(tmp_path / "explicit") for p in (tmp_path / "explicit").rglob("*")
                           if p.is_file())
    for f in files:  # byte for byte, gzip included
        assert (tmp_path / "default" / f).read_bytes() == (tmp_path / "explicit" / f).read_bytes(), f
    assert _digest(tmp_path / "default") == expected
    man = json.loads((tmp_path / "default" / "manifest.json").read_text())
    assert "model" not in man and "garch" in man["truth"] and "networks" not in man["truth"]


# ---------------------------------------------------------------------------
# bad arguments
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("kw, match", [
    (dict(model="nets"), "blobs.*networks"),
    (dict(model="networks", states=2), "states"),
    (dict(network_params={"noise": 0.1}), "network_params"),
    (dict(model="networks", network_params={"bogus": 1}), "bogus"),
    (dict(model="networks", network_params={"subject_mix": 1.0}), "subject_mix"),
    (dict(model="networks", noise=-1.0), "noise"),
    (dict(model="networks", network_params={"global_amplitude": float("nan")}), "global_amplitude"),
])
def test_bad_consortium_arguments(tmp_path, kw, match):
    out = tmp_path / "out"
    with pytest.raises(ValueError, match=match):
        make_consortium(out, 1, 1, n_components=2, n_timepoints=5, space="grid30", **kw)
    assert not out.exists()  # refused before touching the disk


def test_bad_model_arguments(net):
    assert MODELS == ("blobs", "networks")
    with pytest.raises(ValueError, match="unknown space"):
        network_model("mni5mm", 3)
    with pytest.raises(ValueError, match="unknown network-model parameter"):
        network_model("grid30", 3, wiggle=1)
    with pytest.raises(ValueError, match="n_components"):
        network_model("grid30", 0)
    with pytest.raises(ValueError, match="n_components"):
        network_model("grid30", 901)
    with pytest.raises(ValueError, match="3-D mask"):
        network_model((np.ones((4, 4), dtype=bool), np.eye(4)), 2)
    with pytest.raises(ValueError, match="space_or_mask"):
        network_model(42, 2)
    with pytest.raises(ValueError, match="n_physio"):
        network_model("grid30", 2, n_physio=1.5)
    with pytest.raises(ValueError, match="site_index"):
        net.subject(-1, 0, 10, TR)
    with pytest.raises(ValueError, match="n_timepoints"):
        net.subject(0, 0, 2, TR)
    with pytest.raises(ValueError, match="tr"):
        net.subject(0, 0, 10, 0.0)


def test_custom_mask_and_affine():
    mask, affine = load_space("mni6mm")
    custom = network_model((mask, affine), 4, random_state=0)
    named = network_model("mni6mm", 4, random_state=0)
    np.testing.assert_array_equal(custom.A, named.A)  # same grid, same seed: same maps
    assert custom.space is None and named.space == "mni6mm"
