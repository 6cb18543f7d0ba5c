"""The COINSTAC computation: compspec, inputspec, image, the suspending exchange, a full run through real services."""

import asyncio
import html
import json
import re
import shutil
import socket
import time
from dataclasses import replace
from pathlib import Path

import cape_workers as cw
import deploy_common as dc
import nibabel as nib
import numpy as np
import pytest

from dpneuro.config import ConfigError, RunConfig
from dpneuro.deploy import coinstac as dcc
from dpneuro.deploy import coinstac_sim as sim
from dpneuro.deploy.party import ManifestMismatch
from dpneuro.protocol.cape import cape_protocol, run_cape
from dpneuro.protocol.driver import run_aggregator, run_site
from dpneuro.protocol.exchange import DirectoryCheckpoint, Suspend
from dpneuro.report.figures import read_timecourses
from dpneuro.run.factory import check_reduction_fits
from dpneuro.run.naming import read_component_table
from dpneuro.run.site_maps import site_note

COINSTAC = dc.TEMPLATES / "coinstac"
ALLOWED = {"cape-noise", "secagg-mask", "encrypted-share", "secagg-share", "public"}


def _load(name):
    return json.loads((COINSTAC / name).read_text())


def _temporal_spec():
    """The template inputspec with temporal ICA: these runs follow capeDJICA's private rounds."""
    return [{**site, "ica": {"value": "temporal"}} for site in _load("inputspec.json")]


# -- COINSTAC's validator rules (coinstac-common services/validator/schemas/computation.js, DESIGN 10) --

def _nonempty_str(x) -> bool:
    return isinstance(x, str) and x != ""  # Joi.string() refuses the empty string


def coinstac_problems(spec: dict) -> list[str]:
    """What COINSTAC's compspec validator (compspec version 2) would reject, as messages."""
    out = []
    if set(spec) - {"meta", "computation"}:
        out.append(f"unknown top-level keys {sorted(set(spec) - {'meta', 'computation'})}")
    meta = spec.get("meta")
    if not isinstance(meta, dict):
        return out + ["meta missing"]
    for k in ("id", "name", "description", "repository", "version"):
        if not _nonempty_str(meta.get(k)):
            out.append(f"meta.{k} must be a non-empty string")
    if meta.get("compspecVersion") != 2:
        out.append("meta.compspecVersion must be 2 (coinstac.start websocket runtime)")
    comp = spec.get("computation")
    if not isinstance(comp, dict):
        return out + ["computation missing"]
    allowed = {"type", "dockerImage", "command", "remote", "input", "output", "display"}
    if set(comp) - allowed:
        out.append(f"unknown keys in computation: {sorted(set(comp) - allowed)}")
    for k in ("type", "dockerImage", "command", "input", "output", "display"):
        if k not in comp:
            out.append(f"computation.{k} is required")

    def runner(d, where):
        if not _nonempty_str(d.get("type")) or not _nonempty_str(d.get("dockerImage")):
            out.append(f"{where}: type and dockerImage must be non-empty strings")
        cmd = d.get("command")
        if not (isinstance(cmd, list) and cmd and all(_nonempty_str(c) for c in cmd)):
            out.append(f"{where}.command must be a non-empty list of strings")

    runner(comp, "computation")
    if comp.get("type") != "docker":
        out.append("computation.type must be 'docker'")
    remote = comp.get("remote")
    if not isinstance(remote, dict):
        out.append("a decentralized computation needs computation.remote")
    else:
        if set(remote) - {"type", "dockerImage", "command"}:
            out.append(f"unknown keys in computation.remote: {sorted(set(remote) - {'type', 'dockerImage', 'command'})}")
        runner(remote, "computation.remote")
    types = {"number", "string", "boolean", "select", "files", "directory", "array", "object", "csv", "set",
             "range", "freesurfer", "users"}
    for name, var in (comp.get("input") or {}).items():
        if not (_nonempty_str(var.get("label")) and var.get("type") in types):
            out.append(f"input {name}: needs a label and a known type")
        if var.get("source") not in ("member", "owner"):
            out.append(f"input {name}: source must be 'member' or 'owner'")
        if var.get("source") == "owner" and "default" not in var:
            out.append(f"owner input {name}: give a default")
        if var.get("type") == "select" and var.get("default") not in var.get("values", []):
            out.append(f"input {name}: default not among its values")
    return out


def test_compspec_satisfies_coinstac_rules():
    spec = _load("compspec.json")
    assert coinstac_problems(spec) == []
    # the checks can fail: what COINSTAC rejects, they reject
    bad = json.loads(json.dumps(spec))
    bad["meta"]["repository"] = ""
    bad["computation"]["containerOptions"] = {}
    del bad["computation"]["remote"]["command"]
    probs = coinstac_problems(bad)
    assert any("repository" in p for p in probs) and any("containerOptions" in p for p in probs)
    assert any("remote.command" in p for p in probs)

    inputs = spec["computation"]["input"]
    member = {k for k, v in inputs.items() if v["source"] == "member"}
    assert member == {dcc.DATA_INPUT, dcc.PARTICIPANTS_INPUT, "signing_key"} and inputs["data"]["type"] == "files"
    owner = {k for k, v in inputs.items() if v["source"] == "owner"}
    assert owner == set(dcc.OWNER_INPUTS) | {"seed_policy", "seed", "max_stalled_iterations", "public_keys"}
    for k in ("n_components", "pca_epsilon", "ica_epsilon_i", "ica_rounds", "seed_policy"):
        assert k in owner
    # the owner's defaults are a valid run whose messages fit COINSTAC's limit
    settings = dcc.settings_from_inputs({k: v["default"] for k, v in inputs.items() if v["source"] == "owner"})
    assert settings["seed"] is None  # production default: noise from OS entropy
    cfg = dcc._config(settings, ["a", "b", "c"], Path("out")).validate(data_sites=[])
    check_reduction_fits(cfg, settings["parcels"], dcc.MAX_MESSAGE_BYTES)
    with pytest.raises(ConfigError, match="more than the exchange carries"):  # why parcels are needed
        check_reduction_fits(cfg, 1200, dcc.MAX_MESSAGE_BYTES)
    cumulant = replace(cfg, ica="temporal", ica_unmixing="cumulant")
    check_reduction_fits(cumulant, settings["parcels"], dcc.MAX_MESSAGE_BYTES)  # 20 components: 1.2 MB
    with pytest.raises(ConfigError, match="'n_components'.*R\\^2 x R\\^2"):  # 40 components: 20 MB
        check_reduction_fits(replace(cumulant, n_components=40), settings["parcels"], dcc.MAX_MESSAGE_BYTES)
    assert set(spec["computation"]["output"]) >= {"components", "privacy", "report", "epsilon"}


def test_compspec_selects_offer_exactly_what_the_configuration_accepts():
    """A select's values are a copy of the configuration's choices: they must not drift apart."""
    from dpneuro import config
    from dpneuro.algorithms.djica import OPTIMIZERS
    from dpneuro.data.images import SPACES
    from dpneuro.data.load import ON_BAD_SUBJECT

    accepted = {"space": SPACES, "reduction": config.REDUCTIONS, "ica": config.ICA_MODELS, "plan": config.PLANS,
                "pca_contribution": config.PCA_CONTRIBUTIONS, "optimizer": tuple(OPTIMIZERS),
                "calibration": config.CALIBRATIONS, "ica_clip_unit": config.UNITS,
                "site_maps_method": config.SITE_MAPS_METHODS, "ica_unmixing": config.UNMIXINGS,
                "on_bad_subject": ON_BAD_SUBJECT, "states_method": config.STATE_METHODS,
                "states_metric": config.STATE_METRICS}
    selects = {k: v["values"] for k, v in _load("compspec.json")["computation"]["input"].items()
               if v["type"] == "select" and k != "seed_policy"}  # seed_policy is the entry point's, not a field
    assert set(selects) == set(accepted)
    for name, values in selects.items():
        assert sorted(values) == sorted(accepted[name]), name


def test_compspec_is_the_projects_release_with_the_librarys_defaults():
    import tomllib

    import dpneuro

    spec = _load("compspec.json")
    pyproject = tomllib.loads((dc.REPO / "pyproject.toml").read_text())
    assert spec["meta"]["repository"] == pyproject["project"]["urls"]["Repository"]
    assert spec["meta"]["version"] == f"v{dpneuro.__version__}" and pyproject["project"]["version"] == dpneuro.__version__
    # COINSTAC pulls f"{dockerImage}:latest" from Docker Hub: a tag in the compspec would make "x:0.2.0:latest"
    comp = spec["computation"]
    image = comp["dockerImage"]
    assert re.fullmatch(r"[a-z0-9]+(?:[._-][a-z0-9]+)*/[a-z0-9]+(?:[._-][a-z0-9]+)*", image), image
    assert comp["remote"]["dockerImage"] == image
    docker = (COINSTAC / "Dockerfile").read_text()
    for tag in ("latest", dpneuro.__version__):
        assert f"-t {image}:{tag}" in docker and f"docker push {image}:{tag}" in docker
    assert f"-t {image}:latest -t {image}:{dpneuro.__version__}" in (dc.TEMPLATES / "README.md").read_text()
    # what the owner does not change runs with the library's defaults (the best measured settings), RunConfig's
    # in COINSTAC's terms (no null: -1 or 0 for "none"; text for tables and lists)
    defaults = RunConfig(sites=[], out="")
    inputs = comp["input"]
    want = dcc.compspec_defaults()
    for name in dcc.OWNER_INPUTS:
        got = inputs[name]["default"]
        assert got == want[name] and type(got) is type(want[name]), (name, got, want[name])
        if name not in dcc.TEXT_INPUTS and getattr(defaults, name) is not None:
            assert got == getattr(defaults, name), name
    assert dcc.settings_from_inputs({k: v["default"] for k, v in inputs.items() if v["source"] == "owner"}) == \
        {**{k: getattr(defaults, k) for k in dcc.OWNER_INPUTS}, "seed": None}
    # every cleaning setting, the runs read and the features are the owner's to set
    assert {"confounds", "confounds_options", "detrend", "high_pass", "low_pass", "smoothing_fwhm", "standardize",
            "bids", "atlas"} <= set(dcc.OWNER_INPUTS)


def test_cleaning_filters_and_atlas_inputs_become_the_runs_settings(tmp_path):
    """COINSTAC has no tables, lists or null: text and 0 stand for them, and come back as the RunConfig values
    a run.toml would give (so the manifest compares them like any other setting)."""
    inputs = {"confounds": {"value": "scrubbing"}, "confounds_options": {"value": '{"fd_threshold": 0.3}'},
              "detrend": {"value": True}, "high_pass": {"value": 0.01}, "low_pass": {"value": 0},
              "smoothing_fwhm": {"value": 6}, "bids": {"value": "task-rest, ses-2 res-2 desc-preproc"},
              "on_bad_subject": {"value": "skip"}, "atlas": {"value": ""}}
    settings = dcc.settings_from_inputs(inputs)
    assert settings["confounds"] == "scrubbing" and settings["confounds_options"] == {"fd_threshold": 0.3}
    assert settings["high_pass"] == 0.01 and settings["low_pass"] is None and settings["smoothing_fwhm"] == 6.0
    assert settings["bids"] == {"task": "rest", "session": "2", "res": "2", "desc": "preproc"}
    cfg = dcc._config(settings, ["a", "b", "c"], tmp_path).validate(data_sites=[])
    toml = RunConfig.from_dict({"sites": [{"name": n, "path": ""} for n in "abc"], "out": str(tmp_path),
                                "confounds": "scrubbing", "confounds_options": {"fd_threshold": 0.3}, "detrend": True,
                                "high_pass": 0.01, "smoothing_fwhm": 6.0, "on_bad_subject": "skip",
                                "bids": {"task": "rest", "session": "2", "res": "2", "desc": "preproc"}})
    assert cfg.cleaning() == toml.cleaning() and cfg.bids == toml.bids and cfg.on_bad_subject == "skip"
    assert dcc.settings_from_inputs({"confounds": {"value": "trans_x, rot_z csf"}})["confounds"] == \
        ["trans_x", "rot_z", "csf"]
    for name, text in (("bids", "task-rest ses-1"), ("confounds", "a, b"), ("confounds_options", '{"scrub": 5}')):
        parse, fmt = dcc.TEXT_INPUTS[name]
        assert fmt(parse(text)) == text  # what the owner typed is what the settings say
    with pytest.raises(ConfigError, match="'bids'.*got 'acq-x'"):
        dcc.settings_from_inputs({"bids": {"value": "task-rest acq-x"}})
    with pytest.raises(ConfigError, match="'confounds_options'.*JSON object"):
        dcc.settings_from_inputs({"confounds_options": {"value": "fd_threshold=0.3"}})
    with pytest.raises(ConfigError, match="'confounds_options'"):  # validated as a run.toml would be
        dcc._config(dcc.settings_from_inputs({"confounds": {"value": "simple"},
                                              "confounds_options": {"value": '{"scrub": 5}'}}),
                    ["a", "b", "c"], tmp_path).validate(data_sites=[])


def test_inputspec_is_a_4_site_run_on_the_synthetic_consortium(tmp_path):
    spec, inputs = _load("inputspec.json"), _load("compspec.json")["computation"]["input"]
    assert isinstance(spec, list) and len(spec) == 4
    settings = [dcc.settings_from_inputs(site) for site in spec]
    assert all(s == settings[0] for s in settings)
    for site in spec:
        assert set(site) <= set(inputs)
        for k, v in site.items():
            assert set(v) == {"value"}
            if inputs[k]["type"] == "select":
                assert v["value"] in inputs[k]["values"], k
    # the files are those `dpneuro synth` writes for the command in site_templates/README.md
    readme = (dc.TEMPLATES / "README.md").read_text()
    assert "--sites 4 --subjects 3 --components 4 --timepoints 60 --space grid30 --seed 0" in readme
    man = dc.consortium(tmp_path, n_timepoints=60)
    for site, s in zip(spec, man["sites"]):
        assert site["data"]["value"] == [Path(x["path"]).name for x in s["subjects"]]
    names = [f"site-{i + 1:02d}" for i in range(4)]
    RunConfig(sites=[], out="", **settings[0])  # every key is a RunConfig field
    cfg = dcc._config(settings[0], names, tmp_path).validate(data_sites=[])
    assert cfg.plan == "cape" and cfg.seed == 0


def test_entry_point_dockerfile_and_ci():
    entry = (COINSTAC / "entry.py").read_text()
    assert "from dpneuro.deploy.coinstac import local, remote" in entry
    assert "coinstac.start(local, remote)" in entry
    docker = (COINSTAC / "Dockerfile").read_text()
    assert re.search(r"^FROM python:3\.11-slim$", docker, re.M)
    assert 'pip install ".[coinstac]"' in docker
    assert "COPY site_templates/coinstac/entry.py /computation/entry.py" in docker
    spec = _load("compspec.json")["computation"]
    assert f"CMD {json.dumps(spec['command'])}" in docker and spec["remote"]["command"] == spec["command"]
    for path in ("dpneuro", "workflows", "pyproject.toml", "README.md"):
        assert (dc.REPO / path).exists() and path in docker
    pyproject = (dc.REPO / "pyproject.toml").read_text()
    assert 'coinstac = ["coinstac==0.3.4", "websockets<14"]' in pyproject and '"dpneuro.deploy"' in pyproject
    assert '.[test,bench,coinstac,cluster,lint]' in (dc.REPO / ".ci" / "run").read_text()


# -- the suspending exchange and the driver hook, without COINSTAC ------------------------------

def _move(src: Path, *dsts: Path):
    """COINSTAC's transfer: every file a party wrote goes to each destination, then leaves the source."""
    for f in src.glob("*.dpnx"):
        for dst in dsts:
            dst.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(f, dst / f.name)
        f.unlink()


def test_suspending_exchange_resumes_one_phase_per_call(tmp_path):
    n, key = 3, bytes(range(32))
    d = {p: {k: tmp_path / k / p for k in ("base", "transfer", "state")} for p in [f"c{s}" for s in range(n)] + ["r"]}

    def ex(party, **kw):
        return dcc.CoinstacExchange(run_id="drift", key=key, n_sites=n, base_dir=d[party]["base"],
                                    transfer_dir=d[party]["transfer"], state_dir=d[party]["state"], **kw)

    proto = lambda: cape_protocol(cw.Drift(), "cape", n_sites=n)  # noqa: E731 - fresh each call, as a new process
    with pytest.raises(ValueError, match="needs a checkpoint"):
        run_site(proto(), 0, cw.site_data(n)[0], ex("c0", site=0))
    with pytest.raises(ValueError, match="needs a checkpoint"):
        run_aggregator(proto(), ex("r", site_dirs=["c0", "c1", "c2"]))

    done, agg, calls = {}, None, 0
    while agg is None:
        calls += 1
        assert calls < 40
        for s in range(n):
            if s not in done:
                try:
                    done[s] = run_site(proto(), s, cw.site_data(n)[s], ex(f"c{s}", site=s),
                                       checkpoint=DirectoryCheckpoint(tmp_path / f"site{s}.npz"))
                except Suspend as exc:
                    assert exc.topic is not None
            _move(d[f"c{s}"]["transfer"], d["r"]["base"] / f"c{s}")
        try:
            agg = run_aggregator(proto(), ex("r", site_dirs=["c0", "c1", "c2"]),
                                 checkpoint=DirectoryCheckpoint(tmp_path / "agg.npz"))
        except Suspend:
            pass
        _move(d["r"]["transfer"], *(d[f"c{s}"]["base"] for s in range(n)))
    # one phase per call: set-up (6 phases in round 0) + 3 phases in each of rounds 1..3
    assert calls == 6 + 3 * 3
    ref = run_cape(cw.Drift(), cw.site_data(n), "cape")
    for a, b in zip(agg["means"], ref.aggregator["means"], strict=True):
        np.testing.assert_array_equal(a, b)  # bitwise: the rounding generator is checkpointed too
    for s in range(n):
        log = ex(f"c{s}", site=s).egress_log(s)
        assert [r["round"] for r in log if r["topic"] == "release"] == [0, 1, 2, 3]
        assert all(a["carries"] in ALLOWED for r in log for a in r["arrays"].values())


def test_remote_and_local_refuse_disagreeing_settings(tmp_path):
    spec = _load("inputspec.json")
    hello = {f"local{i}": dcc.local({"input": spec[i], "cache": {}, "state": _state(tmp_path, f"local{i}")})["output"]
             for i in range(4)}
    assert all(h["dpneuro"]["phase"] == "hello" for h in hello.values())
    hello = node(hello)  # COINSTAC carries every output through Node.js
    odd = node(hello)
    odd["local2"]["dpneuro"]["settings"]["ica_epsilon_i"] = 8.0
    with pytest.raises(ConfigError, match="config field 'ica_epsilon_i': site 'local2'"):
        dcc.remote({"input": odd, "cache": {}, "state": _state(tmp_path, "remote")})
    out = node(dcc.remote({"input": hello, "cache": {}, "state": _state(tmp_path, "remote2")})["output"])
    manifest = out["dpneuro"]["manifest"]
    assert manifest["sites"] == ["local0", "local1", "local2", "local3"]
    # a site whose settings differ from the manifest refuses, naming the field, before loading anything
    forged = node(manifest)
    forged["config"]["n_colluding"] = 0
    for f in spec[1]["data"]["value"]:
        (tmp_path / "input" / "local1" / f).touch()  # the site's files (only their existence is checked first)
    with pytest.raises(ManifestMismatch, match="config field 'n_colluding'"):
        dcc.local({"input": {"dpneuro": {"manifest": forged}}, "cache": {}, "state": _state(tmp_path, "local1")})


def node(obj):
    """A JSON round trip through Node.js, as COINSTAC makes every message take (Node is required)."""
    assert shutil.which("node"), "Node.js is needed: COINSTAC's messages are Node's JSON"
    return sim.node_json_roundtrip(obj)


def test_everything_derived_from_a_message_survives_nodes_json(tmp_path):
    """Node writes 20.0 as 20 and -0.0 as 0, rounds ints beyond 2**53 and may reorder keys."""
    from dpneuro.protocol.exchange.codec import canonical_json

    cfg = dc.run_config(dc.consortium(tmp_path / "c"), tmp_path / "o", simulation=True)
    manifest = dcc.run_manifest(cfg, "coinstac")
    assert any(isinstance(v, float) and v.is_integer() for row in manifest["grid"]["affine"] for v in row)
    after = node(manifest)
    assert json.dumps(after, sort_keys=True) != json.dumps(manifest, sort_keys=True)  # Node did rewrite it
    assert canonical_json(after) == canonical_json(manifest)  # what a comparison or digest is taken over
    odd = {"b": [20.0, -0.0, 2**60 + 1, 1e-05, {"z": 1.5, "a": True, "n": None}], "a": "x"}
    assert canonical_json(node(odd)) == canonical_json(odd)
    assert canonical_json({"a": 1}) != canonical_json({"a": 1.5})
    dcc.check_manifest(cfg, after, party="test")  # comparisons of settings agree too


def test_a_one_request_service_stops_listening_once_its_request_arrives(tmp_path):
    # COINSTAC's container manager scans ports from 8101 upwards by connecting to them; a port whose service
    # still listens while its process exits resets that probe and the run fails ("connect ECONNRESET")
    pytest.importorskip("coinstac")
    entry = tmp_path / "entry.py"
    entry.write_text("import coinstac\ncoinstac.start(lambda d: {'local': d}, lambda d: {'remote': d})\n")
    svc = sim.CoinstacService(entry, max_requests=1, log=tmp_path / "service.log").start()
    try:
        with socket.create_connection(("127.0.0.1", svc.port), timeout=5):  # a bare probe is not a request
            pass
        assert asyncio.run(sim._call(svc.url, "remote", {"x": 1}, 30)) == {"remote": {"x": 1}}
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", svc.port), timeout=5).close()
        assert svc.proc.wait(timeout=30) == 0
    finally:
        svc.stop()


def _state(root: Path, cid: str) -> dict:
    d = {k: root / k / cid for k in ("input", "output", "transfer", "cache")}
    for p in d.values():
        p.mkdir(parents=True, exist_ok=True)
    return {"baseDirectory": str(d["input"]), "outputDirectory": str(d["output"]),
            "transferDirectory": str(d["transfer"]), "cacheDirectory": str(d["cache"]), "clientId": cid,
            "iteration": 1}


# -- a full run through real coinstac services ----------------------------------------------------

@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_coinstac_services_run_the_template_like_the_simulation(tmp_path):
    pytest.importorskip("coinstac")
    pytest.importorskip("websockets")

    spec = _temporal_spec()
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    tables = [[t] if (t := Path(s["path"]) / "participants.tsv").exists() else [] for s in man["sites"]]
    sim.prepare_inputs(tmp_path / "sim", [[x["path"] for x in s["subjects"]] + t for s, t in zip(man["sites"], tables)])
    settings = dcc.settings_from_inputs(spec[0])
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **settings))

    entry = COINSTAC / "entry.py"
    services = [sim.CoinstacService(entry, log=tmp_path / "sites.log"),
                sim.CoinstacService(entry, log=tmp_path / "remote.log")]
    restarts = []

    def restart_midway(it: int):
        # new service processes mid-run: nothing may live in process memory
        if it == 20:
            for svc in services:
                svc.stop()
                svc.launch()
            for svc in services:
                svc.wait_ready()
            restarts.append(it)

    try:
        for svc in services:
            svc.launch()
        for svc in services:
            svc.wait_ready()
        t0 = time.perf_counter()
        run = sim.run_computation(spec, tmp_path / "sim", local_url=services[0].url, remote_url=services[1].url,
                                  call_timeout=60, deadline=120, between_iterations=restart_midway)
        seconds = time.perf_counter() - t0
    finally:
        for svc in services:
            svc.stop()
    assert restarts == [20]
    out = run.output_dir("remote")
    assert run.output["ica_rounds"] == settings["ica_rounds"] == ref["rounds"]
    np.testing.assert_array_equal(np.load(out / run.output["W"]), ref["W"])
    # the service processes run BLAS with more threads than a simulated site (one), so the second moments
    # can differ in the last bit; everything after the noisy release agrees to rounding
    np.testing.assert_allclose(np.load(out / run.output["basis"]), ref["basis"], rtol=1e-9, atol=1e-12)
    # COINSTAC's output says which components carry signal, as the remote's components.tsv does
    table = read_component_table(out / run.output["component_table"])
    assert run.output["signal_components"] == [r["signal"] for r in table] and run.output["signal"]
    priv = json.loads((out / run.output["privacy"]).read_text())
    for i, cid in enumerate(run.clients):
        assert dc.same_releases(priv["sites"][cid]["ledger"], ref["ledgers"][f"site-{i + 1:02d}"]), cid
        assert run.site_outputs[cid][-1]["dpneuro"]["phase"] == "done"
        site_out = run.output_dir(cid)
        subjects, tc = read_timecourses(site_out / "timecourses.tsv")
        assert tc.shape == (4, 3 * 60) and len(set(subjects)) == 3
        assert (site_out / "components.nii.gz").exists() and (site_out / "privacy.json").exists()
        logs = list((tmp_path / "sim" / "cache" / cid).rglob("egress/site-*.jsonl"))
        # the releases, the unmixing the FNC's time courses need, and the closing summary
        assert sorted(log.parent.parent.name for log in logs) == ["fnc", "fnc-reads", "reduce", "summary", "unmix"]
        for log in logs:
            for rec in map(json.loads, log.read_text().splitlines()):
                assert all(a["carries"] in ALLOWED for a in rec["arrays"].values()), rec
    assert (out / run.output["report"]).exists() and (out / run.output["components"]).exists()
    rounds = 1 + run.output["ica_rounds"]  # one capePCA round, then the ICA rounds
    print(f"\nCOINSTAC-driven run: {run.iterations} iterations, {run.messages} message files, {seconds:.1f} s "
          f"wall ({run.iterations / seconds:.1f} iterations/s, {rounds / seconds:.2f} protocol rounds/s)")


def _services_run(tmp_path, spec, man, *, new_process_every_iteration=False, **kw):
    entry = COINSTAC / "entry.py"
    services = [sim.CoinstacService(entry, log=tmp_path / "sites.log"),
                sim.CoinstacService(entry, log=tmp_path / "remote.log")]
    tables = [[t] if (t := Path(s["path"]) / "participants.tsv").exists() else [] for s in man["sites"]]
    sim.prepare_inputs(tmp_path / "sim", [[x["path"] for x in s["subjects"]] + t for s, t in zip(man["sites"], tables)])

    def restart(it: int):  # COINSTAC may start fresh containers every iteration
        for svc in services:
            svc.stop()
            svc.launch()
        for svc in services:
            svc.wait_ready()

    try:
        for svc in services:
            svc.launch()
        for svc in services:
            svc.wait_ready()
        return sim.run_computation(spec, tmp_path / "sim", local_url=services[0].url, remote_url=services[1].url,
                                   call_timeout=60, deadline=300,
                                   between_iterations=restart if new_process_every_iteration else None, **kw)
    finally:
        for svc in services:
            svc.stop()


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_lost_messages_are_sent_again_and_a_lost_cause_ends_the_run(tmp_path):
    pytest.importorskip("coinstac")
    spec = [{**site, "ica_rounds": {"value": 5}} for site in _temporal_spec()]
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **dcc.settings_from_inputs(spec[0])))
    lost = []

    def once(it, party, name):
        # COINSTAC loses site local2's release of ICA round 2 and the remote's broadcast of round 3, once each
        hit = (party == "local2" and "unmix.r000002.release.site-002" in name) or \
              (party == "remote" and "unmix.r000003.release.aggregator" in name)
        if hit and name not in lost:
            lost.append(name)
            return True
        return False

    run = _services_run(tmp_path / "a", spec, man, drop=once)
    assert len(lost) == 2
    out = run.output_dir("remote")
    np.testing.assert_array_equal(np.load(out / run.output["W"]), ref["W"])
    priv = json.loads((out / run.output["privacy"]).read_text())
    for i, cid in enumerate(run.clients):  # a re-send is the same message: no new release, no new noise
        assert dc.same_releases(priv["sites"][cid]["ledger"], ref["ledgers"][f"site-{i + 1:02d}"]), cid

    spec = [{**site, "max_stalled_iterations": {"value": 3}} for site in spec]
    with pytest.raises(sim.ComputationError) as err:
        _services_run(tmp_path / "b", spec, man,
                      drop=lambda it, party, name: party in ("local1", "local3") and name.startswith("unmix.r000001.release."))
    msg = str(err.value)
    assert "no progress for 3 COINSTAC iterations" in msg and "'release' of round 1" in msg
    assert "local1" in msg and "local3" in msg


@pytest.mark.slow  # ~2 minutes: 25 iterations, each with new service processes (CI runs it explicitly)
def test_a_new_run_in_the_same_folders_starts_afresh_with_new_processes_every_iteration(tmp_path):
    pytest.importorskip("coinstac")
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    base = _temporal_spec()
    first = _services_run(tmp_path, [{**s, "ica_rounds": {"value": 3}} for s in base], man)
    spec = [{**s, "ica_rounds": {"value": 4}} for s in base]
    again = _services_run(tmp_path, spec, man, new_process_every_iteration=True)  # same simulator folders
    assert first.output["ica_rounds"] == 3 and again.output["ica_rounds"] == 4
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **dcc.settings_from_inputs(spec[0])))
    out = again.output_dir("remote")
    np.testing.assert_array_equal(np.load(out / again.output["W"]), ref["W"])
    priv = json.loads((out / again.output["privacy"]).read_text())
    assert "COINSTAC" in priv["transport"] and "signed" in priv["transport"]
    for cid in again.clients:  # every member's own report: maps, its privacy, its time courses, its voxel maps
        page = (again.output_dir(cid) / "report.html").read_text()
        assert 'alt="time courses"' in page and "privacybox" in page and html.escape(site_note("guided_ica")) in page
        assert "The guided ICA converged (at most" in page  # the site's own guided ICA, as it ended
        # the group's 4 maps, each with this site's own voxel map below it
        assert page.count('<img alt="IC') == 4 and page.count("voxel map &mdash;") == 4, re.findall(r'<img alt="IC[^"]*"', page)
        assert nib.load(again.output_dir(cid) / "site_maps.nii.gz").shape[-1] == 4


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_spatial_ica_through_coinstac_services_releases_only_the_pca(tmp_path):
    pytest.importorskip("coinstac")
    spec = [{**site, "ica": {"value": "spatial"}} for site in _load("inputspec.json")]
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    cfg = dc.run_config(man, tmp_path / "ref", **dcc.settings_from_inputs(spec[0]))
    ref = dc.reference(cfg)
    run = _services_run(tmp_path / "a", spec, man)
    out = run.output_dir("remote")
    # the basis may differ from the reference in the last bit (BLAS threads), and on a noise-dominated basis
    # FastICA's answer moves with it: W must be the spatial ICA of the basis this run released, in network order
    from dpneuro.algorithms.spatial_ica import spatial_ica
    from dpneuro.run.naming import ordered_unmixing

    basis, lam = np.load(out / run.output["basis"]), np.load(out / "eigenvalues.npy")
    np.testing.assert_allclose(basis, ref["basis"], rtol=1e-9, atol=1e-12)
    W = spatial_ica(basis, lam).W
    np.testing.assert_array_equal(np.load(out / run.output["W"]), ordered_unmixing(cfg, basis, lam, W, np.zeros(len(W)))[0])
    priv = json.loads((out / run.output["privacy"]).read_text())
    for i, cid in enumerate(run.clients):
        led = priv["sites"][cid]["ledger"]
        assert dc.same_releases(led, ref["ledgers"][f"site-{i + 1:02d}"]), cid
        assert {r["stage"] for r in led["releases"]} == {"capepca", "static-fnc"}  # the unmixing releases nothing
        assert (run.output_dir(cid) / "timecourses.tsv").exists()
    # set-up, one PCA round, the unmixing sent and the FNC's round, the summary
    assert run.output["ica_rounds"] == 0 and run.iterations < 18


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_pdsvd_and_brain_states_through_coinstac_services(tmp_path):
    """reduction = "pdsvd" and brain states through the COINSTAC computation: the simulation's numbers."""
    pytest.importorskip("coinstac")
    spec = [{**site, "ica": {"value": "spatial"}, "reduction": {"value": "pdsvd"}, "pdsvd_iterations": {"value": 6},
             "brain_states": {"value": 2}, "states_epsilon": {"value": 30.0}} for site in _load("inputspec.json")]
    man = dc.consortium(tmp_path / "data", n_timepoints=60)
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **dcc.settings_from_inputs(spec[0])))
    run = _services_run(tmp_path / "a", spec, man)
    out = run.output_dir("remote")
    # PD-SVD's blinding factors are fresh every run and move the fixed-point rounding of its secure sums
    basis = np.load(out / run.output["basis"])
    np.testing.assert_allclose(np.abs(basis.T @ ref["basis"]), np.eye(basis.shape[1]), atol=1e-6)
    assert (out / run.output["states"]).exists()
    priv = json.loads((out / run.output["privacy"]).read_text())
    assert all(eps == float("inf") for eps in priv["epsilon"].values())  # PD-SVD is not differentially private
    assert priv["not_private"] and "PD-SVD" in priv["not_private"][0]
    for i, cid in enumerate(run.clients):
        led = priv["sites"][cid]["ledger"]
        assert dc.same_releases(led, ref["ledgers"][f"site-{i + 1:02d}"], rtol=1e-6), cid
        assert {r["stage"] for r in led["releases"]} == {"static-fnc", "dfnc-mean", "dfnc-kmeans", "dfnc-occupancy"}
        site_out = run.output_dir(cid)
        assert (site_out / "states.tsv").exists() and (site_out / "states.npy").exists()
        logs = list((tmp_path / "a" / "sim" / "cache" / cid).rglob("egress/site-*.jsonl"))
        # the sites receive the unmixing once (before the FNC, which reads it first), then the FNC's release and
        # the states' five
        topics = {log.parent.parent.name for log in logs}
        assert topics >= {"reduce", "fnc-reads", "fnc", "states-mean", "states-init", "states-refine",
                          "states-final", "states-occupancy", "summary"} and "states-reads" not in topics
        for log in logs:
            for rec in map(json.loads, log.read_text().splitlines()):
                assert all(a["carries"] in ALLOWED for a in rec["arrays"].values()), rec


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_group_statistics_through_coinstac_services(tmp_path):
    """A design through the COINSTAC computation: each site reads participants.tsv from its data folder, releases
    the model's statistics once, and the remote writes group_effects.tsv; the ledgers are the simulation's."""
    pytest.importorskip("coinstac")
    from dpneuro.datasets.synth import make_consortium
    from dpneuro.run.outputs import read_group_effects

    covariates = {"group": ["control", "patient"], "age": [20, 70]}
    spec = [{**site, "ica": {"value": "spatial"}, "design": {"value": "group + age"},
             "covariates": {"value": json.dumps(covariates)}, "glm_measures": {"value": "amplitude"},
             "glm_epsilon": {"value": 8.0}} for site in _load("inputspec.json")]
    man = make_consortium(tmp_path / "data", n_sites=4, subjects_per_site=3, n_components=4, n_timepoints=60,
                          space="grid30", random_state=0, effects={"patients": 0.5})
    settings = dcc.settings_from_inputs(spec[0])
    assert settings["covariates"] == covariates and settings["glm_measures"] == ["amplitude"]
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", **settings))
    run = _services_run(tmp_path / "a", spec, man)
    out = run.output_dir("remote")
    rows = read_group_effects(out / run.output["group_effects"])
    assert len(rows) == 2 * 4 and {r["contrast"] for r in rows} == {"group: patient vs control", "age (per unit)"}
    priv = json.loads((out / run.output["privacy"]).read_text())
    for i, cid in enumerate(run.clients):
        led = priv["sites"][cid]["ledger"]
        assert dc.same_releases(led, ref["ledgers"][f"site-{i + 1:02d}"]), cid
        assert {r["stage"] for r in led["releases"]} == {"capepca", "static-fnc", "group-glm"}
        for log in (tmp_path / "a" / "sim" / "cache" / cid).rglob("egress/site-*.jsonl"):
            for rec in map(json.loads, log.read_text().splitlines()):
                assert all(a["carries"] in ALLOWED for a in rec["arrays"].values()), rec
