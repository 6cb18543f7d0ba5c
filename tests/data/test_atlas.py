"""A label atlas as the run's features: resampling to the grid, orthonormal region coefficients, every entry point."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from scipy.linalg import subspace_angles

from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.images import load_space
from dpneuro.data.load import preprocess
from dpneuro.data.parcellation import MapsBasis, Parcellation, atlas_basis, atlas_labels, atlas_maps
from dpneuro.run.features import features
from dpneuro.run.stages import reduce_inprocess

MASK, AFFINE = load_space("grid30")


def _blocks(step: int = 6, upsample: int = 1) -> nib.Nifti1Image:
    """Square regions of ``step`` x ``step`` voxels on the 30 x 30 grid (labels 1..25, 0 in the first row), written
    at ``upsample`` times the grid's resolution."""
    n = 30 * upsample
    i, j = np.meshgrid(np.arange(n) // upsample, np.arange(n) // upsample, indexing="ij")
    lab = (i // step) * (30 // step) + j // step + 1
    lab[i == 0] = 0  # voxels in no region
    aff = AFFINE.copy()
    aff[:3, :3] /= upsample
    aff[:2, 3] -= (upsample - 1) / (2 * upsample)  # the same field of view at a finer grid
    return nib.Nifti1Image(lab[..., None].astype(np.int16), aff)


def test_atlas_labels_are_resampled_by_nearest_neighbour_and_checked(tmp_path):
    labels, regions = atlas_labels(_blocks(), MASK, AFFINE)
    fine, fine_regions = atlas_labels(_blocks(upsample=2), MASK, AFFINE)
    assert regions == fine_regions == list(range(1, 26))
    np.testing.assert_array_equal(labels, fine)  # a 2x finer copy of the atlas gives the same regions
    assert np.sum(labels < 0) == 30 and np.bincount(labels[labels >= 0]).tolist() == [30] * 5 + [36] * 20
    img = _blocks()
    with pytest.raises(ValueError, match="integer region labels"):
        atlas_labels(nib.Nifti1Image(np.asarray(img.dataobj) + 0.5, img.affine), MASK, AFFINE)
    with pytest.raises(ValueError, match="probabilistic maps"):
        atlas_labels(nib.Nifti1Image(np.zeros((30, 30, 1, 3)), AFFINE), MASK, AFFINE)
    with pytest.raises(ValueError, match="no region covers"):
        atlas_labels(nib.Nifti1Image(np.zeros((30, 30, 1)), AFFINE), MASK, AFFINE)


def test_orthonormal_regions_keep_the_voxels_second_moment_on_region_constant_maps():
    """The features are coefficients on the unit-norm region indicators: F^T F = X^T P P^T X, and painting them back
    is the projection on region-constant maps (0 outside every region). Means would weigh every region alike."""
    labels, _ = atlas_labels(_blocks(), MASK, AFFINE)
    P = Parcellation(labels, weighting="orthonormal")
    X = np.random.default_rng(0).standard_normal((900, 50))
    F = P.reduce(X)
    B = np.zeros((900, P.n_parcels))
    B[np.flatnonzero(labels >= 0), labels[labels >= 0]] = 1
    B /= np.linalg.norm(B, axis=0)
    np.testing.assert_allclose(F, B.T @ X, atol=1e-12)
    np.testing.assert_allclose(P.expand(F), B @ B.T @ X, atol=1e-12)
    assert np.all(P.expand(F)[labels < 0] == 0)
    mean = Parcellation(labels).reduce(X)
    np.testing.assert_allclose(mean * np.sqrt(P.sizes)[:, None], F, atol=1e-12)


def test_on_region_constant_data_the_atlas_run_finds_the_voxel_runs_basis(tmp_path):
    """Sites whose signal is constant on the atlas's regions (as real data painted from it): the exact PCA on the
    orthonormal region features, painted back, spans what the PCA on the voxels spans; region means, which weigh a
    region of 6 voxels as much as one of 110, do not."""
    sizes = np.linspace(6, 110, 15).astype(int)
    sizes[-1] += 870 - sizes.sum()
    labels = np.r_[-np.ones(30, int), np.repeat(np.arange(15), sizes)]
    inside = labels >= 0
    rng = np.random.default_rng(1)
    A = rng.standard_normal((15, 4)) * np.linspace(3, 1, 4)
    sites_vox, lengths = [], []
    for _ in range(3):
        blocks = []
        for _ in range(4):
            R = A @ rng.standard_normal((4, 60)) + 0.3 * rng.standard_normal((15, 60))
            V = np.zeros((900, 60))
            V[inside] = R[labels[inside]]
            blocks.append(preprocess(V.astype(np.float32)))
        sites_vox.append(np.hstack(blocks))
        lengths.append([60] * 4)
    sites = [{"name": f"s{i}", "path": str(tmp_path)} for i in range(3)]
    cfg = RunConfig.from_dict({"sites": sites, "out": str(tmp_path / "o"), "space": "grid30", "parcels": 0,
                               "n_components": 4, "plan": "none", "reduction": "none", "pca_contribution": "moment",
                               "simulation": True, "seed": 0})
    vox = reduce_inprocess(cfg, sites_vox, lengths).basis
    angles = {}
    for weighting in ("orthonormal", "mean"):
        P = Parcellation(labels, weighting=weighting)
        red = reduce_inprocess(cfg, [P.reduce(X) for X in sites_vox], lengths).basis
        angles[weighting] = float(np.max(subspace_angles(P.expand(red), vox)))
    assert angles["orthonormal"] < 1e-4
    assert angles["mean"] > max(0.01, 100 * angles["orthonormal"])  # measured 0.025 against < 1e-5


def test_a_run_with_an_atlas_uses_its_regions_everywhere(tmp_path):
    """The config field reaches the run's space (features, maps at voxel resolution), the planner's D and the run
    manifest every deployed party checks (a different atlas is refused)."""
    from dpneuro.datasets.synth import make_consortium
    from dpneuro.deploy.party import ManifestMismatch, check_manifest, run_manifest
    from dpneuro.run.pipeline import stage_space

    man = make_consortium(tmp_path / "data", n_sites=3, subjects_per_site=3, n_components=4, n_timepoints=40,
                          space="grid30", random_state=3)
    atlas = tmp_path / "atlas.nii.gz"
    _blocks(upsample=2).to_filename(atlas)
    cfg = RunConfig.from_dict({"sites": [{"name": s["site"], "path": s["path"]} for s in man["sites"]],
                               "out": str(tmp_path / "out"), "space": "grid30", "atlas": str(atlas),
                               "n_components": 4, "plan": "none", "reduction": "none", "seed": 0,
                               "simulation": True}).validate()
    assert features(cfg) == 25
    cj = tmp_path / "cfg.json"
    cj.write_text(json.dumps(cfg.to_json()))
    space = json.loads(Path(stage_space(str(cj))).read_text())
    assert space["weighting"] == "orthonormal" and space["n_parcels"] == 25 and "atlas atlas.nii.gz" in \
        space["features"]

    import dpneuro

    ica = dpneuro.DecentralizedICA(n_components=4, plan="none", reduction="none", space="grid30",
                                   random_state=0, out=tmp_path / "run", atlas=str(atlas))
    ica.fit({s["site"]: s["path"] for s in man["sites"]})
    assert ica.basis_.shape == (25, 4) and ica.components_.shape == (4, 900)
    assert np.all(ica.components_[:, :30] == 0)  # the row in no region

    other = tmp_path / "other.nii.gz"
    _blocks(step=5).to_filename(other)
    manifest = run_manifest(cfg, "r1")
    check_manifest(cfg, manifest, party="site 'site-01'")
    with pytest.raises(ManifestMismatch, match="atlas_sha256"):
        check_manifest(replace(cfg, atlas=str(other)), manifest, party="site 'site-01'")
    with pytest.raises(ConfigError, match="'atlas'"):
        replace(cfg, atlas=str(tmp_path / "missing.nii.gz")).validate()


def _blobs(upsample: int = 2) -> nib.Nifti1Image:
    """Four overlapping Gaussian maps on the 30 x 30 grid (4-D, one volume per map), at ``upsample`` times its
    resolution."""
    n = 30 * upsample
    x, y = np.meshgrid(np.arange(n) / upsample, np.arange(n) / upsample, indexing="ij")
    centres = [(8, 8), (8, 20), (20, 14), (14, 14)]
    vol = np.stack([np.exp(-((x - a) ** 2 + (y - b) ** 2) / (2 * 4.0**2)) for a, b in centres], axis=-1)
    aff = AFFINE.copy()
    aff[:3, :3] /= upsample
    aff[:2, 3] -= (upsample - 1) / (2 * upsample)
    return nib.Nifti1Image(vol[:, :, None, :].astype(np.float32), aff)


@pytest.mark.filterwarnings("ignore:Resampling binary images")  # nilearn on the all-zero atlas below
def test_a_probabilistic_atlas_gives_the_least_squares_fit_of_its_maps():
    """Features Q^T x on an orthonormal basis of the maps' span: painting them back is the least-squares fit of the
    volume by the maps (what NiftiMapsMasker inverts), and the features' second moment is the voxels' in that span."""
    M = atlas_maps(_blobs(), MASK, AFFINE)
    assert M.shape == (900, 4)
    B = MapsBasis(atlas_basis(_blobs(), MASK, AFFINE))
    assert B.n_parcels == 4 and np.allclose(B.basis.T @ B.basis, np.eye(4))
    X = np.random.default_rng(2).standard_normal((900, 30))
    coef, *_ = np.linalg.lstsq(M, X, rcond=None)
    np.testing.assert_allclose(B.expand(B.reduce(X)), M @ coef, atol=1e-10)
    F = B.reduce(X)
    np.testing.assert_allclose(F.T @ F, X.T @ B.basis @ B.basis.T @ X, atol=1e-9)
    with pytest.raises(ValueError, match="no map covers"):
        atlas_maps(nib.Nifti1Image(np.zeros((30, 30, 1, 2), np.float32), AFFINE), MASK, AFFINE)


def test_a_run_with_a_probabilistic_atlas(tmp_path):
    """The 4-D atlas reaches the run's space (basis of 4 maps), the planner's D, the maps at voxel resolution and the
    run manifest."""
    import dpneuro
    from dpneuro.datasets.synth import make_consortium
    from dpneuro.deploy.party import ManifestMismatch, check_manifest, run_manifest

    man = make_consortium(tmp_path / "data", n_sites=3, subjects_per_site=3, n_components=3, n_timepoints=40,
                          space="grid30", random_state=4)
    atlas = tmp_path / "maps.nii.gz"
    _blobs().to_filename(atlas)
    ica = dpneuro.DecentralizedICA(n_components=3, plan="none", reduction="none", space="grid30", random_state=0,
                                   out=tmp_path / "run", atlas=str(atlas))
    ica.fit({s["site"]: s["path"] for s in man["sites"]})
    assert features(ica.config_) == 4 and ica.basis_.shape == (4, 3) and ica.components_.shape == (3, 900)
    # every map is a z-scored combination of the atlas's maps: in the span of the basis and a constant
    Q1 = np.linalg.qr(np.c_[atlas_basis(_blobs(), MASK, AFFINE), np.ones(900)])[0]
    C = ica.components_.T
    assert np.allclose(Q1 @ (Q1.T @ C), C, atol=1e-6)
    manifest = run_manifest(ica.config_, "r1")
    other = tmp_path / "other.nii.gz"
    _blobs(upsample=1).to_filename(other)
    with pytest.raises(ManifestMismatch, match="atlas_sha256"):
        check_manifest(replace(ica.config_, atlas=str(other)), manifest, party="site 'site-01'")
