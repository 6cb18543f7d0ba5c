"""The stage table (dpneuro.run.stages.RELEASES) drives every entry point: a stage added there, and nowhere else,
runs in the simulation, the Pydra workflow and a deployment (shared folder, one thread per party)."""

import json
import threading
from dataclasses import replace
from pathlib import Path

import deploy_common as dc
import numpy as np
import pytest

from dpneuro.deploy.sharedfs import aggregator_main, site_main
from dpneuro.deploy.workflow import run_workflow
from dpneuro.privacy import noise_multiplier
from dpneuro.protocol.cape import ReleaseSpec, cape_protocol
from dpneuro.protocol.driver import run_aggregator, run_site
from dpneuro.protocol.exchange import Payload
from dpneuro.run import pipeline, roles, stages


class _Mean:
    """A toy release: every site's mean whitened time point, noised under CAPE (sensitivity 2/N_s)."""

    name = "toy-mean"
    max_rounds = 1

    def __init__(self, R: int):
        self.R = R

    def site_init(self, site, data):
        Z = np.asarray(data, np.float64)
        return {"_mean": Z.mean(axis=1), "_n": Z.shape[1]}

    def site_releases(self, state):
        return {"toy": ReleaseSpec((self.R,), sensitivity=2.0 * np.sqrt(self.R) / state["_n"],
                                   noise_multiplier=noise_multiplier(8.0, 1e-6), stage="toy")}

    def site_weight(self, state):
        return float(state["_n"])

    def site_compute(self, state, round, broadcast):
        return {"toy": state["_mean"]}

    def aggregator_init(self):
        return {}

    def aggregator_first(self, state):
        return Payload()

    def aggregator_update(self, state, round, combined):
        state["mean"] = combined["toy"]
        return Payload(meta={"stop": True})


def _toy_site(cfg, step, site, Z, lengths, exchange, *, n_sites, dim, previous, checkpoint, timeout, budget):
    proto = cape_protocol(_Mean(cfg.n_components), cfg.plan, n_sites=n_sites, budget=budget)
    return {"ledger": run_site(proto, site, Z, exchange, checkpoint=checkpoint, timeout=timeout)["ledger"]}


def _toy_aggregator(cfg, step, exchange, *, n_sites, dim, public, previous, checkpoint, options):
    assert public["unmix"]["W"].shape == (cfg.n_components, cfg.n_components)  # it reads the stages before
    proto = cape_protocol(_Mean(cfg.n_components), cfg.plan, n_sites=n_sites)
    return {"mean": np.asarray(run_aggregator(proto, exchange, checkpoint=checkpoint, options=options)["mean"])}


TOY = stages.ReleasingStage("toy", lambda cfg: ("toy",),
                     lambda cfg, site, public: roles.site_whiten(site["X"], public["reduce"]["basis"],
                                                                    public["reduce"]["eigenvalues"]),
                     _toy_site, _toy_aggregator)


@pytest.fixture()
def with_toy(monkeypatch):
    monkeypatch.setattr(stages, "RELEASES", (*stages.RELEASES, TOY))


@pytest.fixture(scope="module")
def man(tmp_path_factory):
    return dc.consortium(tmp_path_factory.mktemp("toy") / "data")


def _toy_releases(priv: dict, site: str) -> list[dict]:
    ledger = priv["sites"][site]["ledger"] if "sites" in priv else priv["ledger"]
    return [r for r in ledger["releases"] if r.get("stage") == "toy"]


def test_a_stage_added_to_the_table_runs_in_the_simulation_and_the_workflow(with_toy, man, tmp_path):
    cfg, _ = pipeline.prepare(dc.run_config(man, tmp_path / "sim", ica="spatial"))
    assert pipeline.run_order()[-3:] == ("toy", "maps", "report")
    out = pipeline.run_stages(cfg)
    rec = json.loads(Path(out["toy"]).read_text())
    assert np.load(rec["public"]["arrays"]["mean"]).shape == (cfg.n_components,)
    priv = json.loads((cfg.run_dir / "privacy.json").read_text())
    for s in cfg.sites:  # its release is in every site's ledger, hence in the headline epsilon
        assert len(_toy_releases(priv, s.name)) == 1
    assert json.loads(Path(out["maps"]).read_text())["chain"]["toy"] == out["toy"]

    wf_cfg, _ = pipeline.prepare(dc.run_config(man, tmp_path / "wf", ica="spatial"))
    got = run_workflow(wf_cfg, plugin="serial")
    wf_rec = json.loads(Path(got["toy"]).read_text())
    assert wf_rec["ledgers"].keys() == rec["ledgers"].keys()
    wf_priv = json.loads((wf_cfg.run_dir / "privacy.json").read_text())
    assert all(len(_toy_releases(wf_priv, s.name)) == 1 for s in cfg.sites)


def test_a_stage_added_to_the_table_runs_in_a_deployment(with_toy, man, tmp_path):
    cfg = replace(dc.run_config(man, tmp_path / "dep", ica="spatial", exchange_dir=str(tmp_path / "exchange")),
                  timeout=60.0)
    results, errors = {}, []

    def site(name):
        try:
            results[name] = site_main(cfg, name)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=site, args=(s.name,), daemon=True) for s in cfg.sites]
    for t in threads:
        t.start()
    agg = aggregator_main(cfg)
    for t in threads:
        t.join(timeout=60)
    assert not errors, errors
    priv = json.loads(Path(agg["privacy"]).read_text())
    for s in cfg.sites:
        assert len(_toy_releases(priv, s.name)) == 1  # declared by the site, composed by the aggregator
        own = json.loads(Path(results[s.name]["privacy"]).read_text())
        assert len(_toy_releases(own, s.name)) == 1
    work = cfg.resolved().out
    assert list(Path(work).rglob("toy.result.npz"))  # each party kept its step's result to resume from


def test_stage_names_come_from_one_table():
    """The run's order, the planner's releasing stages and the configuration's stage names are the stage table's:
    a stage added to RELEASES appears in each (the configuration, a lower layer, lists the names; they must agree)."""
    from dpneuro.config import STAGES
    from dpneuro.run.planner import RELEASING_STAGES

    names = tuple(r.name for r in stages.RELEASES)
    assert RELEASING_STAGES == names
    assert pipeline.run_order() == ("space", "load", *names, "maps", "report")
    assert pipeline.run_order()[:-1] == STAGES
