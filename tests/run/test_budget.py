"""The planner spends what the run spends: same releases, same calibration, same headline."""

from __future__ import annotations

import json
import math
import re
from dataclasses import replace
from pathlib import Path

import deploy_common as dc
import pytest

from dpneuro.cli import main
from dpneuro.datasets.synth import make_consortium
from dpneuro.privacy import PrivacyLedger
from dpneuro.run.planner import CUMULANT_PCA_SHARE, TEMPORAL_PCA_SHARE, plan_for_target, site_shapes, spend

DELTA = 1e-5


@pytest.fixture(scope="module")
def consortia(tmp_path_factory):
    root = tmp_path_factory.mktemp("budget")
    sym = dc.consortium(root / "sym")
    asym = make_consortium(root / "asym", n_sites=4, subjects_per_site=[3, 5, 2, 4], n_components=4,
                           n_timepoints=40, space="grid30", random_state=1)
    return {"sym": sym, "asym": asym}


CASES = {
    "default": ("sym", {}),
    "temporal ICA, second moments": ("sym", {"pca_contribution": "moment"}),
    "bias, sample clipping": ("sym", {"ica_bias": True, "ica_clip_unit": "sample", "clip_G": 20.0, "clip_h": 5.0}),
    "power mode": ("sym", {"reduction": "capepca-power", "pca_epsilon": 5000.0}),
    "conv": ("sym", {"plan": "conv"}),
    "classic calibration": ("sym", {"calibration": "classic", "ica_epsilon_i": 0.8}),
    "asymmetric sites": ("asym", {"ica_bias": True}),
    "asymmetric sites, no colluders": ("asym", {"n_colluding": 0}),
    "spatial ICA (the PCA alone)": ("asym", {"ica": "spatial"}),
    "spatial ICA, subject bound": ("asym", {"ica": "spatial", "pca_subject_bound": 0.4}),
    "spatial ICA, second moments": ("asym", {"ica": "spatial", "pca_contribution": "moment"}),
    "spatial ICA, subspaces in power mode": ("sym", {"ica": "spatial", "reduction": "capepca-power",
                                                      "pca_epsilon": 5000.0}),
    "brain states": ("asym", {"brain_states": 2, "states_epsilon": 3.0}),
    "brain states, conv": ("sym", {"brain_states": 3, "plan": "conv"}),
    "PD-SVD reduction (not private)": ("asym", {"reduction": "pdsvd", "pdsvd_iterations": 5}),
    "temporal ICA, cumulant unmixing": ("sym", {"ica_unmixing": "cumulant", "cumulant_epsilon": 3.0}),
    "cumulant unmixing, asymmetric sites, conv": ("asym", {"ica_unmixing": "cumulant", "plan": "conv"}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_planned_ledgers_equal_the_run(consortia, tmp_path, case):
    which, kw = CASES[case]
    cfg = dc.run_config(consortia[which], tmp_path / "run", ica_rounds=6, **kw)
    ref = dc.reference(cfg)
    # a run that stops early spends less than planned; spatial ICA runs no rounds, the cumulant unmixing two
    assert ref["rounds"] == (0 if cfg.ica == "spatial" else 2 if cfg.ica_unmixing == "cumulant" else cfg.ica_rounds)
    plan = spend(cfg, site_shapes(cfg), int(ref["basis"].shape[0]))
    stages = {r["stage"] for s in plan.privacy["sites"].values() for r in s["ledger"]["releases"]}
    assert ("dfnc-kmeans" in stages) == bool(cfg.brain_states)
    for name, led in ref["ledgers"].items():
        run = PrivacyLedger.from_dict(led)
        planned = PrivacyLedger.from_dict(plan.privacy["sites"][name]["ledger"])
        assert plan.epsilon[name] == pytest.approx(run.epsilon(DELTA, collusion=True), rel=1e-9, abs=1e-12)
        assert planned.mu_collusion == pytest.approx(run.mu_collusion, rel=1e-9)
        assert planned.mu == pytest.approx(run.mu, rel=1e-9)
        assert sorted((r.name, r.count, r.neighbour) for r in planned.releases) == \
            sorted((r.name, r.count, r.neighbour) for r in run.releases)
        # agn-m3's sensitivity adds 6 R sigma^2 / N_s for the sigma^2 the aggregator estimates from the noisy
        # M2 (post-processing, unknown before the run): more noise at the same noise multiplier, so the same
        # eps. The planner counts the sigma^2 = 0 part
        p_list, r_list = (sorted((r.stage, r.name, r.sensitivity) for r in x.releases) for x in (planned, run))
        assert [x[:2] for x in p_list] == [x[:2] for x in r_list]
        for (stage, _, p_sens), (_, _, r_sens) in zip(p_list, r_list):
            if stage == "agn-m3":
                assert r_sens >= p_sens * (1 - 1e-12)
            else:
                assert r_sens == pytest.approx(p_sens, rel=1e-12)
        assert planned.not_private == run.not_private
    if cfg.reduction == "pdsvd":  # no noise in the reduction: the run is not differentially private
        assert all(math.isinf(e) for e in plan.epsilon.values()) and plan.privacy["not_private"]
    elif cfg.plan == "cape":
        # the headline is the guarantee against the aggregator: never below a single release's
        assert all(s["epsilon"] > s["epsilon_single_release"] for s in plan.privacy["sites"].values())


def test_planned_target_is_what_the_run_spends(consortia, tmp_path):
    cfg = dc.run_config(consortia["asym"], tmp_path / "run", ica_rounds=6)
    shapes = site_shapes(cfg)
    plan = plan_for_target(cfg, shapes, 60, 8.0, pca_share=0.3)
    assert max(plan.epsilon.values()) == pytest.approx(8.0, rel=1e-6)
    ref = dc.reference(plan.config)
    spent = max(PrivacyLedger.from_dict(led).epsilon(DELTA, collusion=True) for led in ref["ledgers"].values())
    assert spent == pytest.approx(8.0, rel=1e-6)


def test_default_split_gives_a_temporal_pca_its_tuned_share(consortia, tmp_path):
    """Without pca_share a temporal run's PCA (its basis and its variance release) gets TEMPORAL_PCA_SHARE of
    mu^2, whatever the settings' ratio; the unmixing and the FNC share the rest."""
    from dpneuro.algorithms.pca import VARIANCE_SHARE

    cfg = dc.run_config(consortia["asym"], tmp_path / "run", ica_rounds=6)
    shapes = site_shapes(cfg)

    def ratio(p):
        s = max(p.privacy["sites"].values(), key=lambda x: x["mu"])["by_stage_mu"]
        reduce = math.hypot(s["capepca"], s["capepca-variances"])
        assert (s["capepca-variances"] / reduce) ** 2 == pytest.approx(VARIANCE_SHARE, rel=1e-9)
        return reduce / math.hypot(s["ica"], s["static-fnc"])

    for pca_epsilon in (2.0, 20.0):  # two settings' ratios, one planned split
        plan = plan_for_target(replace(cfg, pca_epsilon=pca_epsilon), shapes, 60, 5.0)
        assert ratio(plan) == pytest.approx((TEMPORAL_PCA_SHARE / (1 - TEMPORAL_PCA_SHARE)) ** 0.5, rel=1e-6)
        assert max(plan.epsilon.values()) == pytest.approx(5.0, rel=1e-6)
    shared = plan_for_target(cfg, shapes, 60, 5.0, pca_share=0.3)
    assert ratio(shared) == pytest.approx((0.3 / 0.7) ** 0.5, rel=1e-6)


def test_default_split_gives_the_cumulant_unmixing_its_share_and_is_spent(consortia, tmp_path):
    """With the cumulant unmixing the PCA gets CUMULANT_PCA_SHARE of mu^2, the unmixing's two releases the rest
    (at cumulant_epsilon, in the ratio REFINE_SHARE), and the run spends the target."""
    from dpneuro.algorithms.cumulant_ica import REFINE_SHARE

    cfg = dc.run_config(consortia["asym"], tmp_path / "run", ica_unmixing="cumulant")
    shapes = site_shapes(cfg)
    for cumulant_epsilon in (1.0, 9.0):
        plan = plan_for_target(replace(cfg, cumulant_epsilon=cumulant_epsilon), shapes, 60, 6.0)
        top = max(plan.privacy["sites"].values(), key=lambda x: x["mu"])
        s = top["by_stage_mu"]
        reduce = math.hypot(s["capepca"], s["capepca-variances"])
        later = math.hypot(s["cumulant-ica"], s["static-fnc"])  # the later stages share the rest
        assert (reduce / later) ** 2 == pytest.approx(CUMULANT_PCA_SHARE / (1 - CUMULANT_PCA_SHARE), rel=1e-6)
        mu2 = {r["name"]: (r["sensitivity"] / r["sigma"]) ** 2 for r in top["ledger"]["releases"]
               if r["stage"] == "cumulant-ica"}
        assert mu2["K4"] / (mu2["K4"] + mu2["S2"]) == pytest.approx(1 - REFINE_SHARE, rel=1e-9)
        assert max(plan.epsilon.values()) == pytest.approx(6.0, rel=1e-6)
    ref = dc.reference(plan.config)
    spent = max(PrivacyLedger.from_dict(led).epsilon(DELTA, collusion=True) for led in ref["ledgers"].values())
    assert spent == pytest.approx(6.0, rel=1e-6)


def test_default_split_without_ica_rounds_keeps_the_configurations_ratio(consortia, tmp_path):
    """Spatial ICA with brain states: the PCA and the states keep the ratio of their settings."""
    cfg = dc.run_config(consortia["asym"], tmp_path / "run", ica="spatial", brain_states=2, states_epsilon=2.0)
    shapes = site_shapes(cfg)
    base, plan = spend(cfg, shapes, 60), plan_for_target(cfg, shapes, 60, 7.0)

    def ratio(p):
        s = max(p.privacy["sites"].values(), key=lambda x: x["mu"])["by_stage_mu"]
        return s["capepca"] / math.sqrt(sum(s[k] ** 2 for k in ("dfnc-mean", "dfnc-kmeans", "dfnc-occupancy")))

    assert ratio(plan) == pytest.approx(ratio(base), rel=1e-6)
    assert max(plan.epsilon.values()) == pytest.approx(7.0, rel=1e-6)


def test_budget_cli_reads_the_run_configuration_and_refuses_what_run_refuses(consortia, tmp_path, capsys):
    man = consortia["sym"]
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{s["path"]}"\n' for s in man["sites"])
    toml = tmp_path / "run.toml"
    toml.write_text(f'out = "{tmp_path / "o"}"\nspace = "grid30"\nparcels = 60\nn_components = 4\n'
                    f'ica = "temporal"\nica_rounds = 6\n{sites}')
    assert main(["budget", str(toml), "--json"]) == 0
    import json

    out = json.loads(capsys.readouterr().out)
    assert out["sites"] == {s["site"]: [40] * 3 for s in man["sites"]}  # read from the file headers
    eps = max(out["epsilon"].values())
    assert main(["budget", str(toml), "--target-epsilon", "6"]) == 0
    assert "site-01 6.00" in capsys.readouterr().out
    # a total epsilon in run.toml is planned as `dpneuro run` plans it, not ignored
    with_total = tmp_path / "run_eps.toml"
    with_total.write_text(toml.read_text().replace("n_components = 4\n", "n_components = 4\nepsilon = 6.0\n"
                                                                       "allow_noise_maps = true\n"))
    assert main(["budget", str(with_total), "--json"]) == 0
    from dpneuro.config import RunConfig
    from dpneuro.run.planner import apply_target

    assert json.loads(capsys.readouterr().out)["epsilon"] == apply_target(RunConfig.read(with_total))[1].epsilon
    # the cumulant unmixing: its own setting, planned with its own share
    assert main(["budget", str(toml), "--unmixing", "cumulant", "--target-epsilon", "4", "--json"]) == 0
    planned = json.loads(capsys.readouterr().out)
    assert planned["ica_unmixing"] == "cumulant" and max(planned["epsilon"].values()) == pytest.approx(4.0, rel=1e-6)
    assert main(["budget", str(toml), "--unmixing", "cumulant", "--cumulant-epsilon", "3"]) == 0
    assert "cumulant_epsilon = 3 (at delta/2) for its two releases together" in capsys.readouterr().out
    # refuses what the run refuses, with the field named
    assert main(["budget", "--sites", "2", "--subjects", "40"]) == 2
    assert "CAPE needs at least 3 sites" in capsys.readouterr().err
    assert main(["budget", str(toml), "--target-epsilon", "0.01"]) == 2
    assert "ica_epsilon_i" in capsys.readouterr().err
    assert main(["budget", "--sites", "4"]) == 2
    assert eps > 0 and math.isfinite(eps)


def test_target_with_brain_states_keeps_every_stage_share_and_is_spent(consortia, tmp_path):
    cfg = dc.run_config(consortia["asym"], tmp_path / "run", ica_rounds=6, brain_states=2, states_epsilon=2.0)
    shapes = site_shapes(cfg)
    base = spend(cfg, shapes, 60)

    def mus(p):
        s = max(p.privacy["sites"].values(), key=lambda x: x["mu"])["by_stage_mu"]
        states = math.sqrt(sum(s[k] ** 2 for k in ("dfnc-mean", "dfnc-kmeans", "dfnc-occupancy")))
        return math.hypot(s["capepca"], s.get("capepca-variances", 0.0)), s["ica"], s["static-fnc"], states

    for target, share in ((5.0, None), (9.0, 0.5)):
        plan = plan_for_target(cfg, shapes, 60, target, pca_share=share)
        assert max(plan.epsilon.values()) == pytest.approx(target, rel=1e-6)
        pca, ica, fnc, states = mus(plan)
        b_pca, b_ica, b_fnc, b_states = mus(base)
        assert ica / states == pytest.approx(b_ica / b_states, rel=1e-6)  # the later stages keep their ratio
        assert fnc / states == pytest.approx(b_fnc / b_states, rel=1e-6)
        expect = TEMPORAL_PCA_SHARE if share is None else share
        assert pca**2 / (pca**2 + ica**2 + fnc**2 + states**2) == pytest.approx(expect, rel=1e-6)
    ref = dc.reference(plan.config)
    spent = max(PrivacyLedger.from_dict(led).epsilon(DELTA, collusion=True) for led in ref["ledgers"].values())
    assert spent == pytest.approx(9.0, rel=1e-6)


def test_planner_says_how_many_components_a_budget_supports(capsys):
    from dpneuro.run.expectations import REFERENCE_SPECTRUM, supported_components

    # more noise, fewer components; the reference speaks for region-level data only
    counts = [supported_components(norm, 120) for norm in (0.3, 0.03, 0.01, 0.005, 0.001)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == len(REFERENCE_SPECTRUM)
    assert supported_components(0.01, 29_000) is None
    # second moments, 4 x 100 subjects at eps 8: about 15 of 20 components, which the warning says; 4 x 500:
    # all of them
    moment = ["--contribution", "moment"]
    assert main(["budget", "--sites", "4", "--subjects", "100", "--target-epsilon", "8", *moment]) == 0
    out = capsys.readouterr()
    m = re.search(r"components this budget supports: about (\d+)", out.out)
    assert m and 12 <= int(m.group(1)) <= 17, out.out
    assert f"only about {m.group(1)} components stand above" in out.out + out.err
    assert main(["budget", "--sites", "4", "--subjects", "500", "--target-epsilon", "8", *moment]) == 0
    out = capsys.readouterr()
    assert "stand above" not in out.out + out.err and f"{len(REFERENCE_SPECTRUM)} or more" in out.out
    # subspace contributions (the default under spatial ICA) carry every one of the 20 at 4 x 100
    assert main(["budget", "--sites", "4", "--subjects", "100", "--target-epsilon", "8"]) == 0
    out = capsys.readouterr()
    m = re.search(r"components this budget supports: about (\d+)", out.out)
    assert "subject contribution 'subspace'" in out.out and m and int(m.group(1)) >= 20, out.out
    assert "stand above" not in out.err


def test_expected_covariance_noise_is_what_a_release_carries(tmp_path):
    """The planner's covariance noise (off-diagonal entry sd, spectral norm) against the noise of a capePCA run
    with the same ledgers: the entry sd by a chi-square test on 4,950 entries, the spectral norm within 10%
    (the semicircle edge, 2 sqrt(D) sd, is reached up to a few percent at D = 100)."""
    import numpy as np
    from scipy import stats

    from dpneuro.algorithms import cape_pca
    from dpneuro.config import RunConfig
    from dpneuro.run.expectations import expected_noise

    D, S, Ns = 100, 4, 300
    rng = np.random.default_rng(0)
    Xs = [rng.standard_normal((D, Ns)) for _ in range(S)]
    Xs = [X / np.linalg.norm(X, axis=0) for X in Xs]
    A = sum(X @ X.T for X in Xs) / (S * Ns)
    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(S)],
                               "out": str(tmp_path / "o")})
    for seed in range(3):
        res = cape_pca(Xs, 5, 2.0, DELTA, plan="cape", random_state=seed)
        privacy = {"sites": {f"s{i}": {"ledger": led.to_dict()} for i, led in enumerate(res.ledgers)}}
        noise = expected_noise(cfg, {f"s{i}": Ns for i in range(S)}, D, privacy)
        E = res.info["A_hat"] - A
        off = E[np.triu_indices(D, 1)]
        q = float(np.sum(off**2) / noise["covariance"] ** 2)
        assert stats.chi2.ppf(5e-4, off.size) < q < stats.chi2.ppf(1 - 5e-4, off.size)
        assert np.linalg.norm(E, 2) == pytest.approx(noise["covariance spectral norm"], rel=0.1)


def test_subspace_reference_spectra_are_what_consistent_subspaces_give():
    from dpneuro.run.expectations import REFERENCE_SUBSPACE_SPECTRA, reference_spectrum, supported_components

    for k, spec in REFERENCE_SUBSPACE_SPECTRA.items():
        # k lam_j of averaged projectors: in (0, 1], decreasing, summing to at most k over the top k
        assert all(0 < v <= 1 for v in spec) and list(spec) == sorted(spec, reverse=True)
        assert sum(spec[:k]) <= k and len(spec) == min(2 * k, 40)
    assert reference_spectrum("subspace", 20) == tuple(v / 20 for v in REFERENCE_SUBSPACE_SPECTRA[20])
    assert reference_spectrum("subspace", 12) == tuple(v / 10 for v in REFERENCE_SUBSPACE_SPECTRA[10])
    counts = [supported_components(n, 120, "subspace", 20) for n in (0.1, 0.02, 0.01, 0.001)]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 40


def test_subject_contribution_follows_the_ica_model_and_whitening_gets_variances(tmp_path):
    from dpneuro.config import ConfigError, RunConfig

    def cfg(**kw):
        return RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(4)],
                                    "out": str(tmp_path / "o"), **kw})

    # (contribution, variance release) per model: the measured best; whitening needs variances
    assert (cfg().contribution, cfg().pca_variances) == ("subspace", False)
    assert (cfg(ica="temporal").contribution, cfg(ica="temporal").pca_variances) == ("subspace", True)
    assert (cfg(brain_states=2).contribution, cfg(brain_states=2).pca_variances) == ("subspace", False)
    assert cfg(reduction="pdsvd").contribution == "moment"
    assert (cfg(ica="temporal", pca_contribution="moment").pca_variances, cfg(pca_contribution="moment").contribution) \
        == (False, "moment")
    states = cfg(pca_contribution="subspace", brain_states=2)
    states.validate(data_sites=[])
    assert not states.pca_variances  # the states read the components' time courses: nothing whitens by variance
    with pytest.raises(ConfigError, match="pca_contribution"):
        cfg(pca_contribution="subspace", reduction="pdsvd").validate(data_sites=[])
    with pytest.raises(ConfigError, match="pca_contribution"):
        cfg(pca_contribution="projector").validate(data_sites=[])
    # the run uses what the field resolves to
    from dpneuro.run.factory import pca_algorithm

    spatial, temporal = pca_algorithm(cfg(parcels=100), dim=100), pca_algorithm(cfg(ica="temporal", parcels=100), dim=100)
    assert (spatial.contribution, spatial.variances, spatial.max_rounds) == ("subspace", False, 1)
    assert (temporal.contribution, temporal.variances, temporal.max_rounds) == ("subspace", True, 2)
    # the streamed PCA without noise cannot stop on convergence before a planned variance round
    streamed = pca_algorithm(cfg(ica="temporal", parcels=0, reduction="none", max_memory_gb=1e-6), dim=5000)
    assert (streamed.mode, streamed.tol, streamed.variances) == ("power", None, True)


def test_unequal_scan_lengths_and_subject_counts_run_under_cape_as_planned(tmp_path):
    """Sites of 15 / 30 / 60 subjects scanned for 100 / 120 / 150 volumes: the default CAPE plan runs (the papers'
    plan cannot exist here), the planner predicts every site's eps by name, the site with the longest scans spends
    exactly what an equal consortium spends at the same settings (or the target), and the others less."""
    from dpneuro import DecentralizedICA
    from dpneuro.run.planner import SiteShape

    man = make_consortium(tmp_path / "data", n_sites=3, subjects_per_site=[15, 30, 60], n_components=4,
                          n_timepoints=[100, 120, 150], space="grid30", random_state=2)
    files = {s["site"]: [sub["path"] for sub in s["subjects"]] for s in man["sites"]}
    for target in (None, 4.0):
        ica = DecentralizedICA(n_components=4, epsilon=target, pca_epsilon=6.0, mask=man["mask"], parcels=60,
                               random_state=0, out=tmp_path / f"run-{target}").fit(files)
        spent = ica.privacy_.epsilon
        cfg = ica.config_
        shapes = site_shapes(cfg)
        assert [s.lengths for s in shapes] == [(100,) * 15, (120,) * 30, (150,) * 60]
        planned = spend(cfg, shapes, 60)
        equal = spend(cfg, [SiteShape(s.name, (150,) * 30) for s in shapes], 60)
        for name in files:
            assert spent[name] == pytest.approx(planned.epsilon[name], rel=1e-9)
        assert spent["site-03"] == pytest.approx(target or equal.epsilon["site-03"], rel=1e-6)
        assert spent["site-01"] < spent["site-02"] < 0.9 * spent["site-03"]
        # one site's releases alone are part of the coalition's view: never a larger figure than the headline
        assert all(s["epsilon_single_release"] <= s["epsilon"] for s in ica.privacy_.report["sites"].values())
        # the run says why the sites' eps differ, and which one binds
        assert any(a.startswith("Sites differ in subjects or scan lengths") and "site-03, whose subjects" in a
                   for a in ica.privacy_.report["assumptions"])


STAGE_CASES = {
    "temporal ICA": ({"ica": "temporal"}, {"reduce": "pca_epsilon", "unmix": "ica_epsilon_i", "fnc": "fnc_epsilon"}),
    "classic calibration": ({"ica": "temporal", "calibration": "classic", "ica_epsilon_i": 0.8},
                            {"reduce": "pca_epsilon", "unmix": "ica_epsilon_i", "fnc": "fnc_epsilon"}),
    "cumulant unmixing": ({"ica": "temporal", "ica_unmixing": "cumulant"},
                          {"reduce": "pca_epsilon", "unmix": "cumulant_epsilon", "fnc": "fnc_epsilon"}),
    "brain states, power mode": ({"brain_states": 2, "reduction": "capepca-power", "pca_epsilon": 500.0},
                                 {"reduce": "pca_epsilon", "fnc": "fnc_epsilon", "states": "states_epsilon"}),
    "no FNC": ({"fnc": False}, {"reduce": "pca_epsilon"}),
}


@pytest.mark.parametrize("case", list(STAGE_CASES))
def test_each_stage_reports_the_budget_and_ledger_names_the_planner_rescales(tmp_path, case):
    """The planner finds a target through what a stage's algorithms report: the setting's eps, delta and
    calibration, and the ledger's names of their releases; every release a run records belongs to one stage."""
    from dpneuro.config import RunConfig
    from dpneuro.run.factory import epsilon_field
    from dpneuro.run.planner import SiteShape, releases_in
    from dpneuro.run.stages import release

    kw, fields = STAGE_CASES[case]
    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(4)],
                               "out": str(tmp_path / "o"), "parcels": 100, **kw})
    shapes = [SiteShape(f"s{i}", (150 + 10 * i,) * (20 + 5 * i)) for i in range(4)]
    recorded = {r["stage"] for s in spend(cfg, shapes, 100).privacy["sites"].values() for r in s["ledger"]["releases"]}
    active = [st for st in ("reduce", "unmix", "fnc", "states") if releases_in(cfg, st)]
    assert {st: epsilon_field(cfg, st) for st in active} == fields
    named = {}
    for st in active:
        algs = release(st).algorithms(cfg, 100)
        assert len({a.budget for a in algs}) == 1  # one setting per stage
        b = algs[0].budget
        delta = cfg.ica_delta_i if fields[st] == "ica_epsilon_i" else cfg.pca_delta
        calibration = cfg.calibration if fields[st] == "ica_epsilon_i" else "analytic"
        assert (b.epsilon, b.delta, b.calibration) == (getattr(cfg, fields[st]), delta, calibration)
        assert b.epsilon_for(b.noise_multiplier) == pytest.approx(b.epsilon, rel=1e-9)
        named[st] = {n for a in algs for n in a.ledger_stages}
    assert sum(len(v) for v in named.values()) == len(set().union(*named.values()))  # no name in two stages
    assert recorded and recorded <= set().union(*named.values())


def test_subjects_needed_is_the_fewest_that_keep_every_component_above_the_noise(tmp_path):
    """At the answer every component stands above the planned covariance noise, one subject fewer it does not;
    a larger budget needs fewer subjects; unequal sites are planned from counts alone."""
    from dpneuro.config import ConfigError, RunConfig
    from dpneuro.run.planner import components_supported, subjects_needed

    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(4)],
                               "out": str(tmp_path / "o"), "parcels": 100, "n_components": 20})

    def supported(n, eps):
        return components_supported(plan_for_target(cfg, site_shapes(cfg, subjects=n), 100, eps))

    needed = {eps: subjects_needed(cfg, 100, eps) for eps in (1.0, 2.0, 4.0)}
    for eps, n in needed.items():
        assert supported(n, eps) >= 20 > supported(n - 1, eps)
    assert needed[1.0] > needed[2.0] > needed[4.0] > 1
    assert subjects_needed(cfg, 1000, 4.0) is None  # outside the reference spectrum's 50-400 features
    shapes = site_shapes(cfg, subjects=[30, 60, 90, 120], timepoints=[150, 150, 200, 200])
    assert [len(s.lengths) for s in shapes] == [30, 60, 90, 120] and shapes[3].n_samples == 120 * 200
    with pytest.raises(ConfigError, match="--subjects: 3 numbers for 4 sites"):
        site_shapes(cfg, subjects=[30, 60, 90])


def test_subjects_for_maps_is_the_fewest_whose_last_eigenvector_keeps_its_overlap(tmp_path):
    """criterion="maps": at the answer the last component's expected squared overlap reaches MAPS_OVERLAP, one
    subject fewer it does not; it asks more than every component above the edge, and less at a larger budget."""
    from dpneuro.config import RunConfig
    from dpneuro.run.planner import MAPS_OVERLAP, maps_overlap, subjects_needed

    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(4)],
                               "out": str(tmp_path / "o"), "parcels": 100, "n_components": 20})

    def overlap(n, eps):
        return maps_overlap(plan_for_target(cfg, site_shapes(cfg, subjects=n), 100, eps))

    needed = {eps: subjects_needed(cfg, 100, eps, criterion="maps") for eps in (1.0, 2.0, 4.0)}
    for eps, n in needed.items():
        assert overlap(n, eps) >= MAPS_OVERLAP > overlap(n - 1, eps)
        assert n > subjects_needed(cfg, 100, eps)
    assert needed[1.0] > needed[2.0] > needed[4.0]
    assert subjects_needed(cfg, 1000, 4.0, criterion="maps") is None  # outside the reference's 50-400 features
    with pytest.raises(ValueError, match="criterion must be one of"):
        subjects_needed(cfg, 100, 4.0, criterion="pretty maps")


def test_the_maps_criterion_separates_the_measured_real_data_frontier(tmp_path):
    """benchmarks/real_frontier.py's default cells (4 sites, 122 regions, 20 components, 50-1000 subjects, eps
    1-16): the planner's expected overlap reaches MAPS_OVERLAP exactly where the measured maps agree at >= 0.8,
    and the size it asks for at eps 1, 2 and 4 lies between the largest measured size below 0.8 and the
    smallest at or above it."""
    import csv

    from dpneuro.config import RunConfig
    from dpneuro.run.planner import MAPS_OVERLAP, maps_overlap, subjects_needed

    path = Path(__file__).resolve().parents[2] / "benchmarks" / "results" / "real_frontier.csv"
    rows = [r for r in csv.DictReader(path.read_text().splitlines()) if r["ica"] == "spatial"
            and r["contribution"] == "subspace" and r["sites"] == "equal" and r["epsilon"] != "none"]
    # the benchmark planned the maps' release alone (benchmarks/frontier.py: fnc = false)
    cfg = RunConfig.from_dict({"sites": [{"name": f"s{i}", "path": str(tmp_path)} for i in range(4)],
                               "out": str(tmp_path / "o"), "parcels": 0, "n_components": 20, "fnc": False})
    D = 122
    assert len(rows) >= 30
    for r in rows:
        m, eps, agree = int(r["subjects"]), float(r["epsilon"]), float(r["r_median"])
        overlap = maps_overlap(plan_for_target(cfg, site_shapes(cfg, subjects=m), D, eps))
        assert (overlap >= MAPS_OVERLAP) == (agree >= 0.8), (m, eps, overlap, agree)
    for eps in (1.0, 2.0, 4.0):
        cells = {int(r["subjects"]): float(r["r_median"]) for r in rows if float(r["epsilon"]) == eps}
        below = max(m for m, v in cells.items() if v < 0.8)
        good = min(m for m, v in cells.items() if v >= 0.8 and m > below)
        assert below < subjects_needed(cfg, D, eps, criterion="maps") <= good


def test_budget_command_plans_unequal_sites_and_says_what_a_budget_needs(capsys, tmp_path):
    from dpneuro.config import RunConfig
    from dpneuro.run.planner import subjects_needed

    assert main(["budget", "--subjects", "30,60,90,120", "--target-epsilon", "2", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert sorted(s["n_subjects"] for s in plan["privacy"]["sites"].values()) == [30, 60, 90, 120]
    cfg = RunConfig.from_dict({"sites": [{"name": f"site-{i:02d}", "path": ""} for i in range(1, 5)], "out": ""})
    assert plan["subjects_needed"] == subjects_needed(cfg, 100, 2.0) > 120  # default features: 100 parcels
    assert main(["budget", "--subjects", "30,60,90,120", "--target-epsilon", "2"]) == 0
    out = capsys.readouterr().out
    assert f"needs for all 20 components above the noise: {plan['subjects_needed']} " in out
    assert plan["subjects_for_maps"] == subjects_needed(cfg, 100, 2.0, criterion="maps") > plan["subjects_needed"]
    assert out.rstrip().endswith(f"calibrated on real fMRI): {plan['subjects_for_maps']}")
    with pytest.raises(SystemExit):
        main(["budget", "--subjects", "30,x"])


def test_budget_overrides_take_the_fields_types(capsys):
    """--brain-states (an integer other than 1) is parsed as the field's integer, as --components is."""
    from dpneuro.cli import main

    template = Path(__file__).resolve().parents[2] / "site_templates" / "run.toml"
    assert main(["budget", str(template), "--subjects", "60", "--components", "12", "--brain-states", "3"]) == 0
    assert "brain states K = 3" in capsys.readouterr().out
    assert main(["budget", str(template), "--subjects", "60", "--brain-states", "1"]) == 2
    assert "config field 'brain_states'" in capsys.readouterr().err
