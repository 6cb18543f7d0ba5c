"""Each site's own voxel maps: guided ICA or dual regression on its own data, at voxel resolution, with no release."""

import html
import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro._utils.errors import DataValidationError
from dpneuro.algorithms.metrics import match_components
from dpneuro.algorithms.spatial_ica import guided_ica
from dpneuro.config import ConfigError, RunConfig
from dpneuro.data.load import decode_run
from dpneuro.data.matrix import scale_columns
from dpneuro.datasets.synth import make_consortium
from dpneuro.report.figures import zscore_columns
from dpneuro.run.pipeline import prepare, run_stages
from dpneuro.run.site_maps import _HOW, SUBSPACE_FACTOR, SiteSubspace, site_voxel_maps, subject_map

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


def _projector(U):
    return U @ U.T


def test_site_subspace_is_the_top_of_the_summed_subject_projectors_through_merges():
    """Subjects in a common 8-dim space: merging down to 8 directions loses nothing, so it is exact."""
    rng = np.random.default_rng(4)
    V, T, k = 120, 25, 3
    common = np.linalg.qr(rng.standard_normal((V, 8)))[0]
    acc = SiteSubspace(k, keep=8)  # merges whenever more than 8 + 12 columns pile up
    P = np.zeros((V, V))
    for m in range(11):
        Y = common @ (rng.standard_normal((8, T)) * rng.uniform(0.5, 3.0, (8, 1)))
        acc.add(Y)
        B = scale_columns(Y, "unit")
        U = np.linalg.svd(B, full_matrices=False)[0][:, :k]
        P += _projector(U)
    basis, w = acc.basis()
    ev, E = np.linalg.eigh(P / 11)
    assert acc.n_subjects == 11 and basis.shape == (V, k)
    np.testing.assert_allclose(basis.T @ basis, np.eye(k), atol=1e-10)
    np.testing.assert_allclose(w, ev[::-1][:k], rtol=1e-7)
    np.testing.assert_allclose(_projector(basis), _projector(E[:, ::-1][:, :k]), atol=1e-7)


def test_site_subspace_refusals():
    with pytest.raises(ValueError, match="k must be"):
        SiteSubspace(0)
    with pytest.raises(ValueError, match="keep"):
        SiteSubspace(5, keep=3)
    with pytest.raises(ValueError, match="no subject"):
        SiteSubspace(2).basis()


def _planted(rng, D=4000, R=4, K=7):
    """R sparse independent maps and K - R Gaussian directions, mixed by a random rotation into a K-dim basis."""
    S = rng.laplace(size=(D, R)) ** 3  # heavy tails: the networks
    G = rng.standard_normal((D, K - R))
    mixed = np.concatenate([S, G], axis=1) @ np.linalg.qr(rng.standard_normal((K, K)))[0]
    basis = np.linalg.qr(mixed - mixed.mean(0))[0]
    return S, basis


def test_guided_ica_finds_the_planted_maps_in_the_references_order_and_sign():
    for seed in range(3):
        rng = np.random.default_rng(10 + seed)
        S, basis = _planted(rng)
        R = S.shape[1]
        order, signs = rng.permutation(R), rng.choice([-1.0, 1.0], R)
        # references: each planted map seen through heavy noise (|r| ~ 0.3-0.5), shuffled and sign-flipped
        noisy = S / S.std(0) + 2.0 * rng.standard_normal(S.shape)
        ref = noisy[:, order] * signs
        res = guided_ica(basis, ref)
        r_ref = np.abs(match_components(ref, S)[1])
        got = np.array([np.corrcoef(res.maps[:, j], S[:, order[j]] * signs[j])[0, 1] for j in range(R)])
        assert np.all(got > 0.99), (seed, got, r_ref)  # the right map, in the reference's place and sign
        assert r_ref.max() < 0.6
        np.testing.assert_allclose(res.maps.mean(0), 0, atol=1e-10)
        np.testing.assert_allclose(res.maps.std(0), 1, atol=1e-10)
        np.testing.assert_allclose(res.agreement, [abs(np.corrcoef(res.maps[:, j], ref[:, j])[0, 1])
                                                   for j in range(R)], atol=1e-10)


def test_guided_ica_refuses_what_it_cannot_pair():
    rng = np.random.default_rng(5)
    _, basis = _planted(rng, D=500, R=2, K=3)
    with pytest.raises(ValueError, match="R <= K"):
        guided_ica(basis, rng.standard_normal((500, 4)))
    ref = rng.standard_normal((500, 2))
    ref[:, 1] = 3.0
    with pytest.raises(ValueError, match="not constant"):
        guided_ica(basis, ref)


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
    got = site_voxel_maps(runs, boundaries, S, mask, method="dual_regression", workers=2)

    fits = []
    for rs, (a, b) in zip(runs, boundaries):
        Y = np.concatenate([decode_run(f, mask=mask, standardize=True, detrend=False) for f in rs], axis=1)
        fits.append(subject_map(Y, S[:, a:b]))
    np.testing.assert_allclose(got, zscore_columns(np.mean(fits, axis=0)), atol=1e-10)
    # a subject is one person however many runs: fitting the runs apart gives other maps
    split = [fits[0], subject_map(decode_run(files[1], mask=mask, standardize=True, detrend=False), S[:, 30:55]),
             fits[2]]
    assert np.abs(got - zscore_columns(np.mean(split, axis=0))).max() > 0.05


def test_guided_site_maps_are_the_guided_ica_of_the_site_subspace_started_from_dual_regression(tmp_path):
    rng = np.random.default_rng(6)
    mask = np.zeros((9, 8, 6), bool)
    mask[1:8, 1:7, 1:5] = True
    V = int(mask.sum())
    A = rng.laplace(size=(V, R)) ** 3
    blocks, tcs = [], []
    for m in range(5):
        S_m = rng.standard_normal((R, 40))
        blocks.append(A @ S_m + rng.standard_normal((V, 40)))
        tcs.append(S_m + 0.5 * rng.standard_normal(S_m.shape))
    files = _write_runs(tmp_path, blocks, mask)
    S = np.concatenate(tcs, axis=1)
    boundaries = [(40 * m, 40 * (m + 1)) for m in range(5)]
    got = site_voxel_maps([[f] for f in files], boundaries, S, mask)

    acc = SiteSubspace(SUBSPACE_FACTOR * R)
    dr = 0
    for f, (a, b) in zip(files, boundaries):
        Y = decode_run(f, mask=mask, standardize=True, detrend=False)
        acc.add(Y)
        dr = dr + subject_map(Y, S[:, a:b])
    np.testing.assert_allclose(got, guided_ica(acc.basis()[0], zscore_columns(dr / 5)).maps, atol=1e-8)
    with pytest.raises(ValueError, match="method must be"):
        site_voxel_maps([[f] for f in files], boundaries, S, mask, method="melodic")


def test_a_site_with_fewer_directions_than_components_keeps_its_regression_maps(tmp_path):
    rng = np.random.default_rng(8)
    mask = np.ones((5, 4, 3), bool)
    files = _write_runs(tmp_path, [rng.standard_normal((60, 3)) * 2 + 5], mask)  # 3 volumes: rank 3 < R
    S = rng.standard_normal((R, 3))
    got = site_voxel_maps([files], [(0, 3)], S, mask)
    np.testing.assert_array_equal(got, site_voxel_maps([files], [(0, 3)], S, mask, method="dual_regression"))


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
                          space="grid30", random_state=7)
    return root, man


def _run(root: Path, man: dict, name: str, **kw) -> dict:
    sites = [{"name": s["site"], "path": s["path"]} for s in man["sites"]]
    # one out, a run id per run: the outputs in root/<name>, the stages' cache shared
    cfg = RunConfig.from_dict({**dict(sites=sites, out=str(root), run_id=name, mask=man["mask"], n_components=R, seed=3,
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


def test_guided_ica_beats_dual_regression_at_every_site(consortium):
    """Same run, same time courses: the guided maps agree better with the truth than the regressions they start from."""
    root, man = consortium
    gi = _run(root, man, "on")["maps"]  # the default
    dr = _run(root, man, "dr", site_maps_method="dual_regression")["maps"]
    assert Path(gi["privacy"]).read_bytes() == Path(dr["privacy"]).read_bytes()
    reports = {m: (root / name / "report.html").read_text() for m, name in (("guided_ica", "on"),
                                                                              ("dual_regression", "dr"))}
    for m, page in reports.items():  # the consortium's report says how the sites made theirs
        assert html.escape(_HOW[m]) in page and all(html.escape(_HOW[o]) not in page for o in reports if o != m)
    for site, r in dr["truth"]["site_r"].items():  # 0.874 against 0.896 on average when written
        assert gi["truth"]["site_r"][site] > r + 0.01, (site, gi["truth"]["site_r"], dr["truth"]["site_r"])
    # run.json says whether each site's guided ICA converged; dual regression has none to report
    runs = {name: json.loads((root / name / "run.json").read_text()) for name in ("on", "dr")}
    assert sorted(runs["on"]["site_maps_ica"]) == sorted(s["site"] for s in man["sites"])
    for rec in runs["on"]["site_maps_ica"].values():
        assert rec["status"] == "converged" and 0 < rec["n_iter"] < rec["max_iter"], rec
    assert runs["dr"]["site_maps_ica"] == {}
    most = max(rec["n_iter"] for rec in runs["on"]["site_maps_ica"].values())  # and the report says so
    assert f"The guided ICA converged (every site, at most {most} of 2000 FastICA iterations)." in reports["guided_ica"]
    assert "guided ICA" not in reports["dual_regression"].replace(html.escape(_HOW["guided_ica"]), "")


def test_the_reports_name_the_sites_whose_guided_ica_did_not_converge():
    from dpneuro.run.site_maps import convergence_note

    ok = {"status": "converged", "n_iter": 40, "max_iter": 2000}
    assert convergence_note({"a": ok, "b": {**ok, "n_iter": 900}, "c": None}) == \
        " The guided ICA converged (every site, at most 900 of 2000 FastICA iterations)."
    note = convergence_note({"a": ok, "b": {"status": "not converged", "n_iter": 2000, "max_iter": 2000}})
    assert "did not converge within 2000 FastICA iterations at b (2000 iterations)" in note and " a " not in note
    assert convergence_note({"a": None}) == convergence_note({}) == ""


def test_an_unknown_method_is_refused(consortium):
    root, man = consortium
    with pytest.raises(ConfigError, match="site_maps_method.*one of"):
        _run(root, man, "bad", site_maps_method="melodic")


def test_no_site_maps_at_voxel_resolution(consortium):
    root, man = consortium
    vox = _run(root, man, "vox", parcels=0)
    assert vox["maps"]["site_maps"] == {} and not (root / "vox" / "site_maps").exists()
    assert "Voxel maps of each site" not in (root / "vox" / "report.html").read_text()
