"""The shipped functional atlas (offline, with its licence) and components named by its networks: planted
networks whose network is known, the cerebellum and subcortex by position, the noise flag, the spectrum share,
and the network order the unmixing stage applies."""

from __future__ import annotations

import tomllib
from pathlib import Path

import numpy as np
import pytest
from scipy import ndimage

import dpneuro.data.atlases as atlases
from dpneuro.config import RunConfig
from dpneuro.data.images import load_space
from dpneuro.data.networks import (
    NETWORKS,
    NOISE_FLAG,
    REGIONS,
    component_variances,
    name_components,
    network_order,
    voxel_regions,
)
from dpneuro.data.parcellation import atlas_labels, fill_uncovered
from dpneuro.run.features import feature_labels, features

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """No download possible and an empty nilearn data folder."""
    monkeypatch.setenv("NILEARN_DATA", str(tmp_path / "empty"))
    monkeypatch.delenv("NILEARN_SHARED_DATA", raising=False)

    def refuse(**kw):
        raise AssertionError("the shipped atlas must not be fetched")

    monkeypatch.setattr("nilearn.datasets.fetch_atlas_schaefer_2018", refuse)
    atlases._fetch.cache_clear()
    yield
    atlases._fetch.cache_clear()


def _cfg(tmp_path, **kw) -> RunConfig:
    return RunConfig.from_dict({"sites": [{"name": "a", "path": str(tmp_path)}], "out": str(tmp_path / "out"),
                                "space": "mni6mm", "n_components": 3, "plan": "none", "reduction": "none",
                                "seed": 0, "simulation": True, **kw})


# -- the shipped atlas --------------------------------------------------------------------------

def test_schaefer_200_works_with_nothing_downloaded(offline, tmp_path):
    mask, affine = load_space("mni6mm")
    path = atlases.atlas_image("schaefer_2018:200", mask, affine)
    assert Path(path).is_file() and Path(path).parent.parent.name == "atlas-files"
    labels, values = atlas_labels(path, mask, affine)
    assert values == list(range(1, 201))  # every parcel reaches the 6 mm mask
    assert 4500 < np.sum(labels >= 0) < 5300  # the cortex: about 4,895 of the 8,735 mask voxels
    cfg = _cfg(tmp_path, atlas="schaefer_2018:200").validate()
    assert features(cfg) == 200
    assert atlases.parse("schaefer_2018") == ("schaefer_2018", 200)  # the bare name is the shipped size


def test_the_rest_of_the_mask_becomes_parcels_of_its_own(offline, tmp_path):
    mask, affine = load_space("mni6mm")
    cfg = _cfg(tmp_path, atlas="schaefer_2018:200", atlas_fill=50).validate()
    assert features(cfg) == 250
    labels, weighting = feature_labels(cfg, mask, affine)
    assert weighting == "orthonormal" and np.all(labels >= 0)  # no mask voxel left out
    cortex = atlas_labels(atlases.fetch("schaefer_2018:200"), mask, affine)[0]
    assert np.array_equal(labels[cortex >= 0], cortex[cortex >= 0])  # the atlas's regions untouched
    assert set(np.unique(labels[cortex < 0])) == set(range(200, 250))
    # more parcels asked than voxels left: one per voxel; 0: the rest stays out
    small = np.zeros(len(cortex), np.int64) - 1
    small[:3] = 0
    filled = fill_uncovered(small, mask, 10 ** 6)
    assert filled.max() == int(mask.sum()) - 3
    assert np.array_equal(fill_uncovered(cortex, mask, 0), cortex)


def test_the_licence_travels_with_the_atlas_and_the_package_names_it():
    folder = ROOT / "dpneuro" / "data" / "atlas-files" / "schaefer2018_200_7networks"
    licence = (folder / "LICENSE").read_text()
    assert "MIT" in (folder / "README.md").read_text() and "Computational Brain Imaging Group" in licence
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "MIT" in project["project"]["license"]
    assert "dpneuro/data/atlas-files/*/LICENSE" in project["project"]["license-files"]
    assert "atlas-files/*/*" in project["tool"]["setuptools"]["package-data"]["dpneuro.data"]
    table = atlases.shipped_networks()
    assert len(table) == 200 and {n for _, n, _ in table.values()} == set(NETWORKS)
    assert table[1] == ("7Networks_LH_Vis_1", "Vis", "LH") and table[200][2] == "RH"


# -- naming ---------------------------------------------------------------------------------------

def _planted(region: np.ndarray, mask: np.ndarray, which: int, rng, *, side: np.ndarray | None = None,
             noise: float = 0.3) -> np.ndarray:
    """A smooth map over one region of the atlas (optionally one hemisphere), plus white noise."""
    inside = (region == which) if side is None else (region == which) & side
    vol = np.zeros(mask.shape)
    vol[mask] = inside
    return ndimage.gaussian_filter(vol, 0.7)[mask] + noise * rng.standard_normal(int(mask.sum())) * 0.1


@pytest.mark.parametrize("space", ["mni6mm", "mni4mm"])
def test_planted_networks_are_named_by_their_network(space):
    """A map over each network of the atlas, the deep nuclei and the cerebellum, in random order and sign,
    comes back named by it (its overlap a clear majority)."""
    mask, affine = load_space(space)
    region, coverage, _ = voxel_regions(mask, affine)
    assert coverage > 0.5
    rng = np.random.default_rng(0)
    planted = list(range(len(NETWORKS))) + [REGIONS.index("Subcortical"), REGIONS.index("Cerebellum")]
    perm = rng.permutation(len(planted))
    signs = rng.choice([-1.0, 1.0], len(planted))
    maps = np.column_stack([signs[j] * _planted(region, mask, planted[p], rng) for j, p in enumerate(perm)])
    labels = name_components(maps, mask, affine)
    for j, p in enumerate(perm):
        assert labels[j].network == REGIONS[planted[p]]
        assert labels[j].overlap[REGIONS[planted[p]]] > 0.7
        assert labels[j].sign == signs[j]  # the heavier tail made positive
        assert not labels[j].noise


def test_hemisphere_peak_and_the_noise_flag():
    mask, affine = load_space("mni6mm")
    region, _, noisy = voxel_regions(mask, affine)
    from nibabel.affines import apply_affine

    x = apply_affine(affine, np.argwhere(mask))[:, 0]
    rng = np.random.default_rng(1)
    left = _planted(region, mask, NETWORKS.index("SomMot"), rng, side=x < 0)
    edge = np.zeros(int(mask.sum()))
    edge[noisy] = 1.0
    edge += 0.01 * rng.standard_normal(edge.size)
    lab_left, lab_edge = name_components(np.column_stack([left, edge]), mask, affine)
    assert lab_left.hemisphere == "left" and lab_left.network == "SomMot" and lab_left.peak_mm[0] < 0
    assert lab_left.noise_fraction < NOISE_FLAG < lab_edge.noise_fraction and lab_edge.noise
    assert np.isclose(sum(lab_left.overlap.values()), 1.0)


def test_off_mni_grids_are_unnamed():
    mask, affine = load_space("grid30")
    maps = np.random.default_rng(0).standard_normal((int(mask.sum()), 3))
    assert {lab.network for lab in name_components(maps, mask, affine)} == {"unnamed"}


def test_spectrum_shares_and_the_network_order():
    rng = np.random.default_rng(2)
    lam = np.array([5.0, 3.0, 1.0, -0.5])
    Q, _ = np.linalg.qr(rng.standard_normal((4, 4)))
    shares = component_variances(lam, Q)
    assert np.isclose(shares.sum(), 1.0)
    assert np.allclose(shares, (np.maximum(lam, 0) @ Q.T ** 2) / 9.0)  # W orthogonal: W^-1 = W^T
    assert np.allclose(component_variances(lam, np.eye(4)), [5 / 9, 3 / 9, 1 / 9, 0])
    # a row of W scaled leaves its map's direction and share alone up to its scale's inverse square
    mask, affine = load_space("mni6mm")
    region, _, _ = voxel_regions(mask, affine)
    maps = np.column_stack([_planted(region, mask, REGIONS.index(n), rng)
                            for n in ("Default", "Cerebellum", "Vis", "Default")])
    labels = name_components(maps, mask, affine, variance_share=np.array([0.1, 0.2, 0.3, 0.4]))
    assert [int(k) for k in network_order(labels)] == [2, 3, 0, 1]  # Vis; Default by share; Cerebellum


def test_the_unmixing_stage_orders_and_orients_the_components(tmp_path):
    """W's rows reordered and re-signed change the maps only by that permutation and sign, b follows, and a
    second pass changes nothing."""
    from dpneuro.algorithms.djica import spatial_maps
    from dpneuro.run.naming import ordered_unmixing

    cfg = _cfg(tmp_path, parcels=100).validate()
    rng = np.random.default_rng(3)
    V, _ = np.linalg.qr(rng.standard_normal((100, 5)))
    lam = np.array([9.0, 7.0, 5.0, 3.0, 2.0])
    W, b = rng.standard_normal((5, 5)), rng.standard_normal(5)
    W2, b2 = ordered_unmixing(cfg, V, lam, W, b)
    A, A2 = spatial_maps(V, lam, W), spatial_maps(V, lam, W2)
    match = np.abs(np.corrcoef(A.T, A2.T)[:5, 5:])
    perm = match.argmax(axis=0)
    assert np.allclose(match.max(axis=0), 1.0) and sorted(perm) == list(range(5))
    signs = np.sign(np.sum(A[:, perm] * A2, axis=0))
    assert np.allclose(A2, A[:, perm] * signs) and np.allclose(b2, b[perm] * signs)
    assert np.allclose(W2, W[perm] * signs[:, None])
    W3, b3 = ordered_unmixing(cfg, V, lam, W2, b2)
    assert np.allclose(W3, W2) and np.allclose(b3, b2)
