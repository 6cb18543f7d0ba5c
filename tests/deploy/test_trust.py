"""Deployments never use a fixed noise seed; the headline is the guarantee against the aggregator."""

from __future__ import annotations

import json
import math

import deploy_common as dc
import numpy as np
import pytest

from dpneuro.config import ConfigError
from dpneuro.deploy import coinstac as dcc
from dpneuro.deploy.sharedfs import load_party_config
from dpneuro.privacy import PrivacyLedger, cape_mu_z, gdp_epsilon
from dpneuro.privacy.summary import headline_lines, privacy_report, privacy_warnings
from dpneuro.protocol.cape import cape_protocol
from dpneuro.run.factory import pca_algorithm, reduce_plan, stage_seed


@pytest.fixture(scope="module")
def man(tmp_path_factory):
    return dc.consortium(tmp_path_factory.mktemp("trust"))


def _write(path, man, tmp_path, **fields):
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"))
    lines = [f"out = {json.dumps(str(tmp_path / 'out'))}", f"exchange_dir = {json.dumps(str(tmp_path / 'x'))}",
             'space = "grid30"', "parcels = 60", "n_components = 4"]
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    for s in cfg.sites:
        lines += ["[[sites]]", f"name = {json.dumps(s.name)}", f"path = {json.dumps(s.path)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_deployed_parties_refuse_a_fixed_seed_unless_it_is_a_simulation(man, tmp_path, capsys):
    seeded = _write(tmp_path / "seeded.toml", man, tmp_path, seed=3)
    for site in ("site-01", None):
        with pytest.raises(ConfigError, match="config field 'seed'.*simulation = true"):
            load_party_config(seeded, site=site)
    from dpneuro.cli import main

    assert main(["site", str(seeded), "--site", "site-01", "-q"]) == 2
    assert "config field 'seed'" in capsys.readouterr().err
    test = _write(tmp_path / "test.toml", man, tmp_path, seed=3, simulation=True)
    assert load_party_config(test, site="site-01").seed == 3
    assert load_party_config(_write(tmp_path / "prod.toml", man, tmp_path), site="site-01").seed is None


def test_coinstac_refuses_a_fixed_seed_unless_it_is_a_simulation():
    with pytest.raises(ConfigError, match="seed_policy"):
        dcc.settings_from_inputs({"seed_policy": "fixed", "seed": 4})
    assert dcc.settings_from_inputs({"seed_policy": "fixed", "seed": 4, "simulation": True})["seed"] == 4
    assert dcc.settings_from_inputs({})["seed"] is None


def test_unseeded_parties_draw_fresh_noise_from_os_entropy(man, tmp_path):
    cfg = dc.run_config(man, tmp_path / "out", seed=None, simulation=False)
    assert stage_seed(cfg, 1) is None and stage_seed(cfg, 2) is None
    proto = cape_protocol(pca_algorithm(cfg, 60), reduce_plan(cfg), n_sites=4)
    X = np.linalg.qr(np.random.default_rng(0).standard_normal((60, 60)))[0][:, :30]
    from dpneuro.algorithms.pca import as_source

    draws = [proto.site_init(0, as_source(X, [10, 10, 10]))["rng"].standard_normal(4) for _ in range(2)]
    assert not np.allclose(draws[0], draws[1])  # two runs, two noises


def test_headline_is_the_guarantee_against_the_aggregator():
    """Even with no colluders the aggregator's mu^2 is 2S/(S+1) times one release's (symmetric plan)."""
    S, tau, sens = 4, 2.0, 0.1
    for n_c in (0, 1):
        mu_agg = math.sqrt(2 * cape_mu_z(tau, sens, S, n_c))
        led = PrivacyLedger("site-01")
        led.record("A", sens, tau, 10, mu_collusion=mu_agg)
        priv = privacy_report({"site-01": led}, delta=1e-5, n_subjects={"site-01": 10}, plan="cape",
                              n_colluding=n_c)
        s = priv["sites"]["site-01"]
        if n_c == 0:
            assert s["mu"] ** 2 == pytest.approx(s["mu_single_release"] ** 2 * 2 * S / (S + 1), rel=1e-12)
        assert s["epsilon"] == pytest.approx(gdp_epsilon(1e-5, math.sqrt(10) * mu_agg), rel=1e-12)
        assert priv["epsilon"]["site-01"] == s["epsilon"] > s["epsilon_single_release"]
        assert f"site-01 {s['epsilon']:.2f}" in headline_lines(priv)[0]
        assert "aggregator" in priv["threat_model"] and priv["neighbour"] == "replace"


def test_weak_guarantees_are_called_weak():
    led = PrivacyLedger("a")
    led.record("A", 1.0, 0.05)
    priv = privacy_report({"a": led}, delta=1e-5, n_subjects={"a": 3}, plan="conv")
    assert priv["strength"] == "weak" and privacy_warnings(priv)
    assert "factor e^eps" in priv["reading"]
    led2 = PrivacyLedger("a")
    led2.record("A", 1.0, 20.0)
    priv2 = privacy_report({"a": led2}, delta=1e-5, n_subjects={"a": 3}, plan="conv")
    assert priv2["strength"] == "strong" and not privacy_warnings(priv2)
