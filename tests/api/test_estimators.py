"""The notebook API: estimators, the budget in the user's terms, and agreement with the CLI and the workflow."""

import copy
import html
import inspect
import json
import math
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest
from sklearn.base import clone
from sklearn.exceptions import NotFittedError
from sklearn.utils.validation import check_is_fitted

import dpneuro
from dpneuro.cli import main
from dpneuro.config import ConfigError, RunConfig
from dpneuro.datasets.synth import make_consortium
from dpneuro.run.site_maps import site_note

R = 4
#: a small private run that still converges on the synthetic data (seeded: a simulation)
SETTINGS = dict(parcels=0, pca_epsilon=50.0, ica_epsilon_i=50.0, ica_rounds=15, clip_G=5.0, clip_h=5.0)


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("estimators")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=3, n_components=R, n_timepoints=80,
                          space="grid30", random_state=5)
    files = {s["site"]: sorted(str(p) for p in Path(s["path"]).glob("*.nii.gz")) for s in man["sites"]}
    return root, man, files


@pytest.fixture(scope="module")
def fitted(consortium):
    root, man, files = consortium
    ica = dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], ica="temporal", random_state=1,
                                   out=root / "est", truth=str(root / "data"), **SETTINGS)
    return ica.fit(files)


def test_five_lines_from_nifti_lists_to_maps_privacy_and_report(fitted, consortium, tmp_path):
    root, man, files = consortium
    ica = fitted
    assert ica.components_img_.shape == (30, 30, 1, R)
    n_vox = int(np.asarray(nib.load(man["mask"]).dataobj).astype(bool).sum())
    assert ica.components_.shape == (R, n_vox) and ica.unmixing_.shape == (R, R)
    assert ica.basis_.shape == (n_vox, R) and np.all(np.diff(ica.eigenvalues_) <= 0)
    # the maps in the array and in the image are the same numbers
    mask = np.asarray(ica.mask_img_.dataobj).astype(bool)
    np.testing.assert_array_equal(np.asarray(ica.components_img_.dataobj)[mask].T, ica.components_)
    assert set(ica.timecourses_) == set(files)
    for site, subjects in ica.timecourses_.items():
        assert len(subjects) == 3 and all(tc.shape == (80, R) for tc in subjects.values())
    assert set(ica.privacy_.epsilon) == set(files) and all(e > 0 for e in ica.privacy_.epsilon.values())
    table = ica.privacy_.table()
    assert list(table.index) == sorted(files) and (table["subjects"] == 3).all()
    np.testing.assert_allclose(table["epsilon"].to_numpy(), [ica.privacy_.epsilon[n] for n in table.index])
    assert "against the aggregator" in str(ica.privacy_)
    saved = ica.report_.save_as_html(tmp_path / "r.html")
    assert saved.read_text() == ica.report_.html and "<iframe srcdoc=" in ica.report_._repr_html_()
    assert {"mean |r| with truth", "qNGI"} <= set(ica.metrics_)


def test_non_private_reference_recovers_the_truth(consortium, tmp_path):
    root, man, files = consortium
    ica = dpneuro.DecentralizedICA(n_components=R, plan="none", reduction="none", mask=man["mask"], parcels=0,
                                   truth=str(root / "data"), out=tmp_path / "np").fit(files)
    assert ica.metrics_["mean |r| with truth"] > 0.8
    assert ica.privacy_.epsilon == {n: float("inf") for n in files}
    # the blob maps are independent over voxels: spatial ICA of the same basis finds them too
    sica = dpneuro.DecentralizedICA(n_components=R, plan="none", reduction="none", mask=man["mask"], parcels=0,
                                    ica="spatial", truth=str(root / "data"), out=tmp_path / "np-s").fit(files)
    assert sica.metrics_["mean |r| with truth"] > 0.85, sica.metrics_
    np.testing.assert_array_equal(sica.basis_, ica.basis_)


def test_transform_is_the_sites_own_time_courses(fitted, consortium):
    """transform() on a site's own subjects reproduces the time courses the fit gave (site-local, no release)."""
    _, _, files = consortium
    site = "site-02"
    tcs = fitted.transform(files[site][:2])
    ids = sorted(fitted.timecourses_[site])[:2]
    assert len(tcs) == 2
    for tc, sid in zip(tcs, ids):
        np.testing.assert_allclose(tc, fitted.timecourses_[site][sid], rtol=0, atol=1e-4)
    imgs = [nib.load(f) for f in files[site][:1]]  # in-memory images work too
    # float32 time points (as loaded) in products of another size: rounding ~1e-6 of unit-variance courses
    np.testing.assert_allclose(fitted.transform(imgs)[0], tcs[0], atol=1e-5)


def test_estimator_cli_and_workflow_give_identical_numbers(fitted, consortium, tmp_path):
    root, man, files = consortium
    cfg = fitted.config_
    toml = ["[[sites]]\n" + f'name = "{s.name}"\nfiles = {json.dumps(s.files)}\n' for s in cfg.sites]
    fields = {"out": str(tmp_path / "cli"), "mask": man["mask"], "n_components": R, "seed": 1, "ica": cfg.ica,
              "truth": str(root / "data"), **SETTINGS}
    head = "".join(f"{k} = {json.dumps(v)}\n" for k, v in fields.items())
    (tmp_path / "run.toml").write_text(head + "\n".join(toml))
    assert main(["run", str(tmp_path / "run.toml"), "-q"]) == 0  # the Pydra workflow
    W_cli = np.load(tmp_path / "cli" / "dpneuro" / "W.npy")  # <out>/<run_id>, the default run id
    np.testing.assert_array_equal(W_cli, fitted.unmixing_)
    cli_maps = np.asarray(nib.load(tmp_path / "cli" / "dpneuro" / "components.nii.gz").dataobj)
    np.testing.assert_array_equal(cli_maps, np.asarray(fitted.components_img_.dataobj))
    cli_priv = json.loads((tmp_path / "cli" / "dpneuro" / "privacy.json").read_text())
    assert cli_priv["epsilon"] == fitted.privacy_.epsilon

    pyd = dpneuro.DecentralizedICA.from_config(fitted.config_, out=tmp_path / "pydra", engine="pydra").fit()
    np.testing.assert_array_equal(pyd.unmixing_, fitted.unmixing_)


def test_total_epsilon_is_split_by_the_planner_and_spent(consortium, tmp_path):
    root, man, files = consortium
    ica = dpneuro.DecentralizedICA(n_components=R, epsilon=6.0, mask=man["mask"], random_state=2,
                                   out=tmp_path / "e", parcels=0, ica_rounds=5, clip_G=5.0, clip_h=5.0,
                                   allow_noise_maps=True)  # a tiny consortium: the split is what is tested
    ica.fit(files)
    eps = ica.privacy_.epsilon
    assert max(eps.values()) == pytest.approx(6.0, rel=1e-6)  # the run spends exactly what the plan printed
    plan = dpneuro.plan_budget(6.0, sites=files, n_components=R, mask=man["mask"], parcels=0, ica_rounds=5,
                               clip_G=5.0, clip_h=5.0)
    assert ica.config_.pca_epsilon == pytest.approx(plan.config.pca_epsilon)
    assert ica.config_.ica_epsilon_i == pytest.approx(plan.config.ica_epsilon_i)
    assert max(plan.epsilon.values()) == pytest.approx(6.0, rel=1e-6) and "eps = 6" in str(plan)
    # without data: counts in the user's terms
    p2 = dpneuro.plan_budget(6.0, sites=3, subjects=3, timepoints=80, n_components=R, mask=man["mask"], parcels=0,
                             ica_rounds=5, clip_G=5.0, clip_h=5.0)
    assert p2.config.pca_epsilon == pytest.approx(plan.config.pca_epsilon)


def test_decentralized_pca(consortium, tmp_path):
    root, man, files = consortium
    pca = dpneuro.DecentralizedPCA(n_components=R, epsilon=4.0, mask=man["mask"], parcels=0, random_state=3,
                                   out=tmp_path / "pca", allow_noise_maps=True).fit(files)
    assert pca.components_.shape[0] == R and np.all(np.diff(pca.explained_variance_) <= 0)
    assert max(pca.privacy_.epsilon.values()) == pytest.approx(4.0, rel=1e-6)
    stages = {r.stage for led in pca.privacy_.ledgers.values() for r in led.releases}
    assert stages == {"capepca"}  # one release per site, no ICA
    exact = dpneuro.DecentralizedPCA(n_components=R, plan="none", mask=man["mask"], parcels=30,
                                     out=tmp_path / "pca0").fit(files)
    loose = dpneuro.DecentralizedPCA(n_components=R, epsilon=1e5, mask=man["mask"], parcels=30, random_state=3,
                                     out=tmp_path / "pca1").fit(files)
    pca = dpneuro.DecentralizedPCA(n_components=R, epsilon=4.0, mask=man["mask"], parcels=30, random_state=3,
                                   out=tmp_path / "pca2", allow_noise_maps=True).fit(files)
    # 9 subjects at eps 4 leave mostly noise; a loose budget gives the pooled subspace back
    cosines = np.linalg.svd(exact.basis_.T @ loose.basis_, compute_uv=False)
    assert cosines.min() > 0.9 > np.linalg.svd(exact.basis_.T @ pca.basis_, compute_uv=False).min()


def test_bad_input_is_refused_clearly(consortium, fitted):
    root, man, files = consortium
    with pytest.raises(TypeError, match="ica_epsilon"):  # refused when made, not at fit
        dpneuro.DecentralizedICA(n_components=R, ica_epsilon=3)
    with pytest.raises(ValueError, match="mapping"):
        dpneuro.DecentralizedICA().fit(["a.nii.gz"])
    with pytest.raises(NotFittedError):
        dpneuro.DecentralizedICA().transform(files["site-01"])
    with pytest.raises(ValueError, match="exchange_dir"):
        dpneuro.DecentralizedICA(role="site", site="site-01").fit({"site-01": files["site-01"]})
    with pytest.raises(ConfigError, match="epsilon"):
        dpneuro.DecentralizedICA(epsilon=-1, mask=man["mask"]).fit(files)
    params = fitted.get_params()
    assert params["n_components"] == R and params["ica_rounds"] == 15
    assert "n_components=4" in repr(fitted)


def _site_party(name: str, data: dict, common: dict, out: str) -> None:
    """One site's process: fit as role "site", keep what the parent checks."""
    est = dpneuro.DecentralizedICA(role="site", site=name, out=out, **common).fit(data)
    occ = (getattr(est, "state_occupancy_", None) or {}).get(name, {})
    own = {"site_maps": np.asarray(est.site_maps_imgs_[name].dataobj),
           "site_maps_shown": html.escape(site_note("guided_ica")) in est.report_.html} if est.site_maps_imgs_ else {}
    np.savez(Path(out) / "check.npz", eps=est.privacy_.epsilon[name],
             **{f"tc_{sid}": tc for sid, tc in est.timecourses_[name].items()},
             **{f"occ_{sid}": o for sid, o in occ.items()}, **own)


@pytest.fixture(scope="module")
def fitted_spatial(consortium):
    root, man, files = consortium
    ica = dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], ica="spatial", random_state=1,
                                   out=root / "est-spatial", truth=str(root / "data"), **SETTINGS)
    return ica.fit(files)


#: deployed runs compared with their simulation: each a model and what rides on it
DEPLOYED = {
    "temporal": {"ica": "temporal"},
    # spatial (here and below): at pca_epsilon 50 the 9 subjects' private basis is noise, on which FastICA does not
    # converge and its stopping point would follow the last bits of the basis; with subspace contributions it
    # converges in ~10 iterations at 200
    "spatial": {"ica": "spatial", "pca_epsilon": 200.0},
    # the states read the spatial ICA's unmixing, which only the aggregator holds: the sites receive it first
    "brain states": {"ica": "spatial", "pca_epsilon": 200.0, "brain_states": 2, "states_epsilon": 50.0},
    # temporal: the spatial ICA's rotation would carry PD-SVD's run-to-run rounding (fresh blinding) into the maps
    "pdsvd": {"reduction": "pdsvd", "pdsvd_iterations": 8, "ica": "temporal"},
    # parcels: each site's own voxel maps, computed at the site from its data and the shared results
    "site voxel maps": {"ica": "temporal", "parcels": 30},
}


@pytest.fixture(scope="module")
def simulations(consortium, fitted):
    root, man, files = consortium
    done = {"temporal": fitted}

    def get(case: str):
        if case not in done:
            est = dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], random_state=1,
                                           out=root / f"est-{case.replace(' ', '-')}",
                                           **{**SETTINGS, **DEPLOYED[case]})
            done[case] = est.fit(files)
        return done[case]

    return get


@pytest.mark.parametrize("case", list(DEPLOYED))
def test_deployed_parties_through_the_estimator(consortium, simulations, tmp_path, case):
    """role="site" / "aggregator" over a shared folder: the numbers of the simulation (same seed)."""
    import multiprocessing as mp

    root, man, files = consortium
    sim = simulations(case)
    common = dict(n_components=R, mask=man["mask"], random_state=1, simulation=True,
                  exchange_dir=tmp_path / "shared", timeout=120.0, **{**SETTINGS, **DEPLOYED[case]})
    # every party knows every site's name; a site has only its own data (figures need a process each)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=_site_party, args=(n, {m: (files[m] if m == n else None) for m in files}, common,
                                                   str(tmp_path / n)), daemon=True) for n in files]
    for p in procs:
        p.start()
    try:
        agg = dpneuro.DecentralizedICA(role="aggregator", out=tmp_path / "agg", **common)
        agg.fit({n: None for n in files})
    finally:
        for p in procs:
            p.join(120)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    # the images hold float32: maps equal to ~1e-12 may round to neighbouring float32 values (one unit in the
    # last place, < 1e-6 for z-scores below 8); PD-SVD's fresh blinding factors move its fixed-point rounding.
    # A converged spatial ICA stops within an angle of 1e-6 (tol 1e-12) of the sites' BLAS rounding in separate
    # processes (bases equal to 1e-15): maps equal to a few 1e-6; any difference in what was released (noise,
    # data) moves them by more than 0.1
    atol = 1e-6 if DEPLOYED[case]["ica"] == "temporal" and DEPLOYED[case].get("reduction") != "pdsvd" else 1e-5
    np.testing.assert_allclose(np.asarray(agg.components_img_.dataobj),
                               np.asarray(sim.components_img_.dataobj), rtol=0, atol=atol)
    assert agg.privacy_.epsilon == pytest.approx(sim.privacy_.epsilon)
    for n in files:
        got = np.load(tmp_path / n / "check.npz")
        assert float(got["eps"]) == pytest.approx(sim.privacy_.epsilon[n])
        for sid, tc in sim.timecourses_[n].items():
            np.testing.assert_allclose(got[f"tc_{sid}"], tc, atol=1e-4)
        if sim.state_occupancy_ is not None:  # each site's own subjects, computed at the site
            for sid, occ in sim.state_occupancy_[n].items():
                np.testing.assert_allclose(got[f"occ_{sid}"], occ, atol=1e-12)
        assert ("site_maps" in got) == bool(DEPLOYED[case].get("parcels"))
        if "site_maps" in got:  # each site's own voxel maps, shown only in its own report
            np.testing.assert_allclose(got["site_maps"], np.asarray(sim.site_maps_imgs_[n].dataobj), atol=1e-4)
            assert bool(got["site_maps_shown"])
        # the aggregator's report says where they are, and shows none
        assert ("Voxel maps of each site" in agg.report_.html) == ("site_maps" in got)
    assert html.escape(site_note("guided_ica")) not in agg.report_.html
    if sim.states_ is not None:  # from time courses equal to ~1e-5: the same windows, assignments and noise
        np.testing.assert_allclose(np.load(agg.output_dir_ / "states.npy"), sim.states_, rtol=0, atol=1e-4)
        assert "Brain states (dFNC)" in agg.report_.html
    unmix_egress = list((tmp_path / "shared").rglob("unmix/egress/*.jsonl"))
    if sim.config_.ica == "spatial":  # nothing is exchanged for the unmixing: the PCA was the only release
        assert not [ln for f in unmix_egress for ln in f.read_text().splitlines() if ln.strip()]
    else:
        assert {f.name for f in unmix_egress} >= {f"{n}.jsonl" for n in files}
    states_egress = list((tmp_path / "shared").rglob("states-final/egress/*.jsonl"))
    assert bool(states_egress) == bool(DEPLOYED[case].get("brain_states"))


def test_spatial_ica_spends_only_the_pca_and_recovers_the_maps(consortium, fitted, fitted_spatial):
    root, man, files = consortium
    for led in fitted_spatial.privacy_.ledgers.values():  # the unmixing releases nothing; the FNC is its own stage
        stages = {r.stage for r in led.releases}
        assert stages == {"capepca", "static-fnc"}, stages
    # both runs' subjects contribute their subspaces (min(subject bound, 1/sqrt(k)) at k = 4); the temporal run
    # splits the same PCA budget between that basis and the variances its whitening needs
    from dpneuro.algorithms.pca import VARIANCE_SHARE

    assert (fitted_spatial.config_.contribution, fitted.config_.contribution) == ("subspace", "subspace")
    for n in files:
        assert fitted_spatial.privacy_.epsilon[n] < fitted.privacy_.epsilon[n]
        spatial = [r for r in fitted_spatial.privacy_.ledgers[n].releases if r.stage.startswith("capepca")]
        temporal = [r for r in fitted.privacy_.ledgers[n].releases if r.stage.startswith("capepca")]
        assert [(r.stage, r.count) for r in spatial] == [("capepca", 1)]
        assert [(r.stage, r.count) for r in temporal] == [("capepca", 1), ("capepca-variances", 1)]
        assert temporal[0].sensitivity == pytest.approx(spatial[0].sensitivity, rel=1e-12)
        assert temporal[0].noise_multiplier == pytest.approx(spatial[0].noise_multiplier
                                                             / math.sqrt(1 - VARIANCE_SHARE), rel=1e-12)
        assert temporal[1].noise_multiplier == pytest.approx(spatial[0].noise_multiplier
                                                             / math.sqrt(VARIANCE_SHARE), rel=1e-12)
    assert not np.allclose(np.abs(fitted_spatial.basis_), np.abs(fitted.basis_), atol=1e-3)
    assert "qNGI" not in fitted_spatial.metrics_  # the truth's sources are temporal: no qNGI for spatial maps
    report = fitted_spatial.report_.path.read_text()
    assert "spatial ICA of the released basis" in report and 'alt="convergence"' not in report
    # a total budget goes to the PCA and the FNC
    plan = dpneuro.plan_budget(6.0, sites=files, n_components=R, ica="spatial", parcels=0, mask=man["mask"])
    assert max(plan.epsilon.values()) == pytest.approx(6.0, rel=1e-6)
    assert "spatial ICA" in str(plan)


def test_one_set_of_defaults_everywhere():
    """The library, the configuration, the estimator and the template share the tuned settings."""
    from dataclasses import fields

    from dpneuro.algorithms.djica import OPTIMIZERS, PRESETS, CapeDJICA
    from dpneuro.algorithms.pca import CapePCA
    from dpneuro.config import RunConfig

    rc = {f.name: f.default for f in fields(RunConfig)}
    rec = PRESETS["recommended"]
    as_config = {"clip_G": "clip_G", "clip_h": "clip_h", "rounds": "ica_rounds", "optimizer": "optimizer",
                 "calibration": "calibration", "clip_unit": "ica_clip_unit", "bias": "ica_bias"}
    assert {k: rc[c] for k, c in as_config.items()} == rec
    alg = CapeDJICA(R=3, epsilon_i=1.0, delta_i=1e-2)
    assert (alg.clip_G, alg.rounds, alg.calibration, alg.clip_unit, alg.bias) == (
        rec["clip_G"], rec["rounds"], rec["calibration"], rec["clip_unit"], rec["bias"])
    assert alg.optimizer == OPTIMIZERS[rec["optimizer"]]
    assert PRESETS["paper"]["calibration"] == "classic" and PRESETS["paper"]["clip_unit"] == "sample"
    assert CapePCA(2, 1.0, 1e-5).z == pytest.approx(CapePCA(2, 1.0, 1e-5, calibration="analytic").z)
    cfg = dpneuro.DecentralizedICA().to_config({"a": "x", "b": "y", "c": "z"})
    for name in ("space", "parcels", "pca_epsilon", "ica_epsilon_i", "n_components", "delta", "plan", "reduction",
                 *as_config.values()):
        assert getattr(cfg, name) == rc[name], name


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_example_script_runs_as_a_notebook_would(tmp_path):
    import subprocess
    import sys

    script = Path(__file__).resolve().parents[2] / "examples" / "decentralized_ica.py"
    res = subprocess.run([sys.executable, str(script), str(tmp_path / "ex"), "--small"], capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "proposal for eps = 8" in res.stdout and "time courses (120, 6)" in res.stdout
    assert (tmp_path / "ex" / "report.html").stat().st_size > 10_000 and (tmp_path / "ex" / "IC01.png").exists()
    priv = json.loads((tmp_path / "ex" / "run" / "dpneuro" / "privacy.json").read_text())
    assert max(priv["epsilon"].values()) == pytest.approx(8.0, rel=1e-6)


def test_a_fit_without_out_leaves_no_unnoised_data_and_cleans_up(consortium):
    """Without out the run goes to a private temporary folder (0700): the sites' un-noised matrices are gone
    when fit returns, the results stay readable while the estimator lives, and the folder goes with it."""
    import gc
    import stat

    root, man, files = consortium
    ica = dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], plan="none", random_state=0, parcels=0)
    params = copy.deepcopy(ica.get_params())
    ica.fit(files)
    assert ica.get_params() == params  # as scikit-learn's check_estimators_overwrite_params
    out = Path(ica.config_.out)
    assert ica.output_dir_ == out / "dpneuro"
    assert stat.S_IMODE(out.stat().st_mode) == 0o700 and stat.S_IMODE((out / "work").stat().st_mode) == 0o700
    assert not list(out.rglob("X.npy")) and not list((out / "work").glob("load-*"))
    assert "<html" in ica.report_.html.lower() and ica.components_.shape[0] == R
    assert len(ica.transform(files["site-01"][:1])) == 1  # what transform reads is still there
    del ica
    gc.collect()
    assert not out.exists()


def test_a_runs_work_folder_is_private_to_its_owner(fitted):
    import stat

    work = Path(fitted.config_.out) / "work"
    assert stat.S_IMODE(work.stat().st_mode) == 0o700
    assert list(work.glob("load-*"))  # asked for: kept


def test_planning_from_in_memory_images_leaves_nothing_behind(consortium, monkeypatch, tmp_path):
    """plan_budget reads only the images' headers: the copies it writes for that are removed when it returns."""
    import nibabel as nib

    root, man, files = consortium
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # take TMPDIR again
    imgs = {site: [nib.load(f) for f in fs] for site, fs in files.items()}
    plan = dpneuro.plan_budget(6.0, sites=imgs, n_components=R, ica="spatial", parcels=0, mask=man["mask"])
    assert max(plan.epsilon.values()) == pytest.approx(6.0, rel=1e-6)
    assert not list(tmp_path.iterdir())


# -- scikit-learn conventions ------------------------------------------------------------------------

ESTIMATORS = (dpneuro.DecentralizedICA, dpneuro.DecentralizedPCA)
#: the parameters that are not settings of the run: how and where this process takes part
OWN = {"role": "simulation", "site": None, "key_file": None, "keys": None, "engine": "serial", "verbose": 0}


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_parameters_are_the_run_config_fields(cls):
    """One parameter per RunConfig field but the data, under the field's name (the seed under scikit-learn's),
    with the field's default (None where that is mutable or missing), then the estimator's own."""
    from dataclasses import MISSING, fields

    params = inspect.signature(cls).parameters
    expect = {}
    for f in fields(RunConfig):
        if f.name != "sites":
            expect["random_state" if f.name == "seed" else f.name] = None if f.default is MISSING else f.default
    assert {k: p.default for k, p in params.items()} == {**expect, **OWN}
    assert list(params)[-len(OWN):] == list(OWN)
    assert next(iter(params)) == "n_components" and cls(7).n_components == 7  # as PCA(n_components)
    assert all(p.kind == p.KEYWORD_ONLY for p in list(params.values())[1:])
    assert sorted(cls().get_params()) == sorted(params)
    doc = " ".join(dpneuro.DecentralizedICA.__doc__.split())
    for name in params:  # the docstring documents each, in the field's words
        assert f" {name} : " in doc, name
    for f in fields(RunConfig):
        if f.name != "sites":  # fit's data, not a parameter
            assert " ".join(f.metadata.get("doc", "").split()) in doc, f.name


@pytest.mark.parametrize("cls", ESTIMATORS)
def test_unknown_parameters_are_refused_when_made(cls):
    with pytest.raises(TypeError, match="bogus"):
        cls(bogus=1)
    with pytest.raises(TypeError, match="positional"):
        cls(4, 5)
    with pytest.raises(ValueError, match="bogus"):
        cls().set_params(bogus=1)
    with pytest.raises(TypeError, match="bogus"):
        dpneuro.plan_budget(sites=3, subjects=3, bogus=1)
    cls(n_components=-3.5, epsilon="x", role="nobody")  # values are checked at fit, as scikit-learn does


def _sklearn_checks():
    from sklearn.utils import estimator_checks as ec

    # the checks that do not fit on arrays: the estimators fit on site -> data mappings
    return [ec.check_estimator_cloneable, ec.check_estimator_repr, ec.check_no_attributes_set_in_init,
            ec.check_parameters_default_constructible, ec.check_get_params_invariance, ec.check_set_params,
            ec.check_do_not_raise_errors_in_init_or_set_params, ec.check_transformers_unfitted,
            ec.check_mixin_order, ec.check_valid_tag_types, ec.check_estimator_tags_renamed]


@pytest.mark.filterwarnings("error::UserWarning")  # check_set_params warns when set_params validates
@pytest.mark.parametrize("check", _sklearn_checks(), ids=lambda c: c.__name__)
@pytest.mark.parametrize("cls", ESTIMATORS, ids=lambda c: c.__name__)
def test_scikit_learn_estimator_checks(cls, check):
    check(cls.__name__, cls(n_components=5, brain_states=2, out="o", bids={"task": "rest"}))


def test_clone_repr_and_the_configuration_a_fit_runs(fitted):
    est = dpneuro.DecentralizedICA(n_components=5, brain_states=2, random_state=3, out="o", exchange_dir="x",
                                   bids={"task": "rest"})
    assert " ".join(repr(est).split()) == ("DecentralizedICA(bids={'task': 'rest'}, brain_states=2, exchange_dir='x', "
                         "n_components=5, out='o', random_state=3)")
    twin = clone(est)
    assert twin is not est and twin.get_params() == est.get_params() and twin.bids is not est.bids
    cfg = est.to_config({"a": "x", "b": "y", "c": "z"})
    assert (cfg.n_components, cfg.brain_states, cfg.seed, cfg.bids) == (5, 2, 3, {"task": "rest"})
    assert cfg.out == str(Path.cwd() / "o") and cfg.exchange_dir == str(Path.cwd() / "x")
    assert (cfg.cluster, cfg.confounds_options) == ({}, {})  # None: the field's default
    # every field passes through an estimator: a configuration, its estimator's and its clone's are one
    est = dpneuro.DecentralizedICA.from_config(fitted.config_)
    assert est.to_config() == fitted.config_ and clone(est).to_config() == fitted.config_


def test_fitted_state_is_what_check_is_fitted_reads(fitted):
    check_is_fitted(fitted)
    with pytest.raises(NotFittedError):
        check_is_fitted(dpneuro.DecentralizedICA(n_components=R))
    assert not [k for k in vars(dpneuro.DecentralizedICA()) if k.endswith("_")]
    assert {"components_img_", "unmixing_", "privacy_", "config_", "output_dir_"} <= set(vars(fitted))


def test_a_configurations_relative_out_is_the_working_folder_at_fit(tmp_path, monkeypatch):
    """from_config("run.toml"): the inputs the file names are beside it, its outputs where the user works."""
    template = Path(__file__).resolve().parents[2] / "site_templates" / "run.toml"
    monkeypatch.chdir(tmp_path)
    cfg = dpneuro.DecentralizedICA.from_config(template).to_config()
    assert cfg.out == str(tmp_path / "run")
    assert cfg.sites[0].path == str(template.parent / "data" / "site-01")
    # a RunConfig keeps its own paths (dpneuro run reads them against the file's folder)
    assert dpneuro.DecentralizedICA.from_config(RunConfig.read(template)).to_config().out == str(
        template.parent / "run")


def test_the_pca_refuses_brain_states():
    with pytest.raises(ConfigError, match="brain_states"):
        dpneuro.DecentralizedPCA(brain_states=2).to_config({"a": "x", "b": "y", "c": "z"})
