"""Issue 45: the collusion assumption reaches the noise plan and is refused beyond CAPE's theorem; a total epsilon
is planned in a deployed run from the counts the sites announce."""

import json
import math
import threading
from dataclasses import replace
from pathlib import Path

import deploy_common as dc
import numpy as np
import pytest
from test_deploy_sharedfs import _run_all, write_config

from dpneuro._utils.errors import UnsafeRelease
from dpneuro.cli import main
from dpneuro.config import ConfigError, RunConfig, SiteEntry
from dpneuro.deploy import coinstac as dcc
from dpneuro.deploy.party import ManifestMismatch, SiteContext, _site_plan, check_manifest, run_manifest
from dpneuro.deploy.sharedfs import load_party_config
from dpneuro.protocol.exchange.base import Payload
from dpneuro.protocol.exchange.codec import load_state_file
from dpneuro.protocol.exchange.inprocess import InProcessExchange
from dpneuro.run import roles
from dpneuro.run.planner import apply_target, planned_settings, site_shapes
from dpneuro.run.stages import reduce_inprocess

BEYOND = "config field 'n_colluding'.*ceil\\(S/3\\) - 1 = 0 colluding sites when S = 3"


def _three_site_toml(tmp_path: Path, **fields) -> Path:
    """A run of 3 sites whose data folders exist (empty: nothing is read before the refusal)."""
    lines = [f'out = "{tmp_path / "out"}"', f'exchange_dir = "{tmp_path / "shared"}"', 'space = "grid30"']
    lines += [f"{k} = {json.dumps(v)}" for k, v in fields.items()]
    for i in range(3):
        (tmp_path / f"s{i}").mkdir(exist_ok=True)
        lines += ["[[sites]]", f'name = "site-0{i + 1}"', f'path = "{tmp_path / f"s{i}"}"']
    path = tmp_path / "run.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


# -- case 4: n_colluding ------------------------------------------------------------------------

def test_the_planner_refuses_more_colluders_than_cape_allows(tmp_path, capsys):
    assert main(["budget", "--sites", "3", "--subjects", "20", "--n-colluding", "5"]) == 2
    assert "config field 'n_colluding'" in capsys.readouterr().err
    assert main(["budget", str(_three_site_toml(tmp_path, n_colluding=5)), "--subjects", "20"]) == 2
    err = capsys.readouterr().err
    assert "config field 'n_colluding'" in err and "5 were assumed" in err
    assert main(["budget", "--sites", "3", "--subjects", "20", "--n-colluding", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["privacy"]["n_colluding"] == 0


def test_run_aggregator_and_site_refuse_more_colluders_than_cape_allows(tmp_path, capsys):
    cfg = _three_site_toml(tmp_path, n_colluding=5)
    assert main(["run", str(cfg)]) == 2
    assert "config field 'n_colluding'" in capsys.readouterr().err
    for site in (None, "site-02"):
        with pytest.raises(ConfigError, match=BEYOND):
            load_party_config(cfg, site=site)
    assert main(["site", str(cfg), "--site", "site-02", "-q"]) == 2
    assert "config field 'n_colluding'" in capsys.readouterr().err
    assert main(["aggregator", str(cfg), "-q"]) == 2
    assert "config field 'n_colluding'" in capsys.readouterr().err
    assert not (tmp_path / "shared").exists()  # refused before anything ran
    with pytest.raises(ConfigError, match=BEYOND):
        RunConfig.read(cfg).validate()
    ok = RunConfig.read(_three_site_toml(tmp_path, n_colluding=0)).validate()  # within the bound: accepted
    assert ok.n_colluding == 0


def test_coinstac_settings_refuse_more_colluders_than_cape_allows():
    with pytest.raises(ConfigError, match=BEYOND):
        dcc.settings_from_inputs({"n_colluding": 5}, n_sites=3)
    with pytest.raises(ConfigError, match="COINSTAC input 'n_colluding'"):
        dcc.settings_from_inputs({"n_colluding": -2})  # only -1 means "the most CAPE allows"
    assert dcc.settings_from_inputs({"n_colluding": -1}, n_sites=3)["n_colluding"] is None
    assert dcc.settings_from_inputs({"n_colluding": 1}, n_sites=4)["n_colluding"] == 1
    # the remote's set-up builds the run's configuration from the settings: refused there too
    settings = dcc.settings_from_inputs({"n_colluding": 5})
    with pytest.raises(ConfigError, match=BEYOND):
        RunConfig(sites=[SiteEntry(f"local{i}", "") for i in range(3)], out="", **settings).validate(data_sites=())


def test_the_configured_collusion_reaches_the_ledgers():
    """4 sites: n_colluding = 0 records a smaller mu_collusion than the default (ceil(4/3) - 1 = 1)."""
    rng = np.random.default_rng(0)
    X = [rng.standard_normal((12, 30)) for _ in range(4)]
    lengths = [[10, 10, 10]] * 4
    base = RunConfig(sites=[SiteEntry(f"s{i}", "") for i in range(4)], out="", pca_epsilon=4.0, n_components=3,
                     seed=1, simulation=True)
    mu = {}
    for nc in (None, 0):
        res = reduce_inprocess(replace(base, n_colluding=nc), X, lengths)
        mu[nc] = [r.mu_collusion for r in res.ledgers[0].releases]
    assert len(mu[0]) == len(mu[None]) >= 1
    assert all(a < b for a, b in zip(mu[0], mu[None])), mu


# -- case 8: a total epsilon in a deployed run ---------------------------------------------------

def _counts_parties(cfg: RunConfig, forged: dict, settings: dict, tmp_path: Path):
    """Every site announces its counts; the aggregator answers with ``forged`` counts. Returns each site's
    outcome of :func:`_site_plan` (its plan, or the exception it raised)."""
    ex = InProcessExchange(n_sites=len(cfg.sites))
    outcome: dict[int, object] = {}

    def site(i: int) -> None:
        ctx = SiteContext(cfg=cfg, site=cfg.sites[i].name, work=tmp_path / str(i), out=tmp_path, exchange=lambda t: ex,
                          timeout=20)
        try:
            outcome[i] = _site_plan(ctx, [40, 40, 40], 60)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            outcome[i] = exc

    threads = [threading.Thread(target=site, args=(i,)) for i in range(len(cfg.sites))]
    for t in threads:
        t.start()
    roles.summary_aggregator(Payload(meta={"counts": forged, "settings": settings}), ex)
    for t in threads:
        t.join(30)
    return outcome


def test_a_site_refuses_a_broadcast_that_changed_its_counts(tmp_path):
    cfg = RunConfig(sites=[SiteEntry(f"site-0{i + 1}", "") for i in range(4)], out="", space="grid30", parcels=60,
                    n_components=4, epsilon=4.0, seed=1, simulation=True, allow_noise_maps=True)
    counts = {s.name: [40, 40, 40] for s in cfg.sites}
    settings = planned_settings(apply_target(cfg, shapes=site_shapes(cfg, subjects=3, timepoints=40), dim=60)[0])
    honest = _counts_parties(cfg, counts, settings, tmp_path / "honest")
    for r in honest.values():
        assert r["settings"] == pytest.approx(settings, rel=1e-9) and r["epsilon"]["site-01"] <= 4.0 * (1 + 1e-9)
    forged = {**counts, "site-02": [40, 40, 40, 40, 40, 40]}  # more subjects: less noise for site-02
    out = _counts_parties(cfg, forged, settings, tmp_path / "forged")
    assert isinstance(out[1], UnsafeRelease)
    assert str(out[1]).startswith("site 'site-02' refuses: the broadcast counts give it 6 subjects"), out[1]
    # the other sites' own counts are right, and this split (the PCA alone) does not depend on site-02's
    assert out[0]["settings"] == pytest.approx(settings, rel=1e-9)
    more = {k: 2 * v for k, v in settings.items()}  # a split that spends twice the total
    out = _counts_parties(cfg, counts, more, tmp_path / "more")
    assert all(isinstance(r, UnsafeRelease) and "the aggregator planned" in str(r) for r in out.values()), out
    assert str(out[2]).startswith("site 'site-03' refuses")


def test_the_real_data_template_deploys_as_shipped():
    """site_templates/fmriprep.toml sets a total epsilon: the aggregator accepts it (a site too, but for its data
    path, which the template cannot know)."""
    cfg = load_party_config(dc.TEMPLATES / "fmriprep.toml")
    assert cfg.epsilon == 4.0


def test_every_party_must_share_the_total_epsilon():
    cfg = RunConfig(sites=[SiteEntry(f"site-0{i + 1}", "") for i in range(4)], out="", space="grid30", epsilon=4.0)
    with pytest.raises(ManifestMismatch, match="config field 'epsilon' = 8.0 disagrees.*the privacy budget"):
        check_manifest(replace(cfg, epsilon=8.0), run_manifest(cfg, "r"), party="site 'site-01'")


@pytest.mark.parametrize("ica", ["spatial", pytest.param("temporal", marks=pytest.mark.slow)])  # slow: 12 rounds
def test_a_deployed_run_plans_a_total_epsilon_from_the_announced_counts(tmp_path, ica):
    """The aggregator and 4 sites as processes over a shared folder, with a total epsilon and no per-stage
    setting of their own: every party plans the same split, the one the simulation plans, and no site spends
    more than the total."""
    man = dc.consortium(tmp_path / "data")
    total = 4.0
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared",
                       ica=ica, epsilon=total, allow_noise_maps=True)  # a small consortium: the split is tested
    _run_all(cfg, man, tmp_path)
    run = tmp_path / "out" / "dpneuro"
    parties = ["aggregator"] + [s["site"] for s in man["sites"]]
    plans = {p: load_state_file(tmp_path / "out" / ".dpneuro" / "dpneuro" / p / "counts.result.npz")["result"]
             for p in parties}
    expected = planned_settings(apply_target(RunConfig.read(cfg))[0])  # the simulation's split, from the headers
    for p, plan in plans.items():
        assert plan["settings"] == pytest.approx(expected, rel=1e-12), p
        assert plan["counts"] == plans["aggregator"]["counts"], p
    # planned, not the file's values (pca_epsilon 20, ica_epsilon_i 4)
    assert set(expected) == ({"pca_epsilon", "fnc_epsilon"} if ica == "spatial"
                             else {"pca_epsilon", "ica_epsilon_i", "fnc_epsilon"})
    assert expected["pca_epsilon"] != 20.0 and expected.get("ica_epsilon_i") != 4.0
    for s in man["sites"]:  # what the counts step sent: public metadata, no arrays
        sent = [json.loads(x) for x in (tmp_path / "shared" / "dpneuro" / "counts" / "egress" /
                                        f"{s['site']}.jsonl").read_text().splitlines() if x]
        assert len(sent) == 1 and sent[0]["arrays"] == {}, sent
    consortium = json.loads((run / "privacy.json").read_text())
    for s in man["sites"]:
        own = json.loads((run / s["site"] / "privacy.json").read_text())
        assert own["epsilon"] <= total * (1 + 1e-9) and math.isclose(own["epsilon"], total, rel_tol=1e-6)
        assert consortium["sites"][s["site"]]["epsilon"] == pytest.approx(own["epsilon"], rel=1e-12)
