"""`dpneuro site` / `dpneuro aggregator`: one OS process per party over a shared folder; site templates."""

import json
import os
import re
import shutil
import subprocess
import sys
import time
import tomllib
from dataclasses import fields
from pathlib import Path

import deploy_common as dc
import nibabel as nib
import numpy as np
import pytest

from dpneuro.cli import main
from dpneuro.config import ConfigError, RunConfig, toml_value
from dpneuro.deploy.party import CONSORTIUM_FIELDS, ManifestMismatch, run_manifest
from dpneuro.deploy.sharedfs import load_party_config, site_main
from dpneuro.report.figures import read_timecourses

DEADLINE = 90  # seconds for any one process
ALLOWED = {"cape-noise", "secagg-mask", "encrypted-share", "secagg-share", "public"}


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("sharedfs")
    man = dc.consortium(root / "data")
    return man, dc.reference(dc.run_config(man, root / "ref"))


def write_config(path: Path, man: dict, *, out: Path, exchange: Path, site_paths=None, sites_override=None,
                 **kw) -> Path:
    """A TOML run config for the consortium (``site_paths``: which sites' data this copy names)."""
    cfg = dc.run_config(man, out, exchange_dir=str(exchange), **kw)
    if sites_override is not None:
        from dpneuro.config import SiteEntry

        cfg.sites = [SiteEntry(s["name"], s["path"]) for s in sites_override]
    lines = [f"{f.name} = {toml_value(getattr(cfg, f.name))}" for f in fields(cfg)
             if f.name != "sites" and getattr(cfg, f.name) not in (None, {})]
    for s in cfg.sites:
        p = s.path if site_paths is None or s.name in site_paths else ""
        lines += ["[[sites]]", f"name = {toml_value(s.name)}", f"path = {toml_value(p)}"]
    path.write_text("\n".join(lines) + "\n")
    return path


def _start(args, log: Path) -> subprocess.Popen:
    env = {**os.environ, "NO_ET": "1", "MPLBACKEND": "Agg"}
    with open(log, "ab") as f:
        return subprocess.Popen([sys.executable, "-m", "dpneuro.cli", *map(str, args)], stdout=f,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _wait_all(procs, logs):
    for p, log in zip(procs, logs):
        assert p.wait(timeout=DEADLINE) == 0, log.read_text()[-3000:]


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            p.kill()
            p.wait(timeout=10)


def _run_all(cfg: Path, man: dict, tmp_path: Path) -> None:
    """The aggregator and every site as processes on ``cfg``, to the end (logs in ``tmp_path``), each signing with
    its own key from `dpneuro keygen`, every public key pinned in one keys file."""
    logs = [tmp_path / "aggregator.log"] + [tmp_path / f"{s['site']}.log" for s in man["sites"]]
    parties = ["aggregator"] + [s["site"] for s in man["sites"]]
    keys = tmp_path / "keys"
    keys.mkdir(exist_ok=True)
    lines = []
    for p in parties:
        if not (keys / f"{p}.key").exists():
            r = subprocess.run([sys.executable, "-m", "dpneuro.cli", "keygen", str(keys / f"{p}.key"), "--party", p],
                               capture_output=True, text=True, timeout=60, env={**os.environ, "NO_ET": "1"})
            assert r.returncode == 0, r.stderr
            lines.append(r.stdout.strip().splitlines()[-1])
    if lines:
        (keys / "consortium.keys").write_text("\n".join(lines) + "\n")
    pin = ["--keys", keys / "consortium.keys"]
    procs = []
    try:
        procs.append(_start(["aggregator", cfg, "-q", "--key-file", keys / "aggregator.key", *pin], logs[0]))
        for s, log in zip(man["sites"], logs[1:]):
            procs.append(_start(["site", cfg, "--site", s["site"], "-q", "--key-file", keys / f"{s['site']}.key",
                                 *pin], log))
        _wait_all(procs, logs)
    finally:
        _kill_all(procs)


def _egress_ok(shared: Path, n_sites: int) -> dict[int, list]:
    """Every array any site sent carries noise, a mask, an encryption or is public; returns the logs."""
    logs = {}
    for s in range(n_sites):
        recs = []
        for stage in ("reduce", "unmix", "summary"):
            path = shared / "dpneuro" / stage / "egress" / f"site-{s + 1:02d}.jsonl"  # logs carry site names
            recs += [{**json.loads(line), "stage": stage} for line in path.read_text().splitlines() if line]
        for r in recs:
            for name, arr in r["arrays"].items():
                assert arr["carries"] in ALLOWED, (s, r["stage"], r["topic"], name, arr["carries"])
                if arr["carries"] == "cape-noise":
                    assert r["topic"] == "release"
        logs[s] = recs
    return logs


def _check_timings(out: Path, man: dict, unmixing: str) -> None:
    """Every party's report times each stage it ran, named as the simulation names it (resumed parties too)."""
    shared = ["reduce (capePCA)", f"unmix ({unmixing})", "static FNC", "summary (ledgers in, unmixing out)",
              "maps and privacy record", "report (figures, HTML)"]
    page = (out / "report.html").read_text()
    assert all(f"<td>{name}</td>" in page for name in shared), page.split("<h2>Timings</h2>")[-1][:2000]
    for s in man["sites"]:
        name = s["site"]
        page = (out / name / "report.html").read_text()
        for stage in shared + [f"load {name}", f"time courses {name}", f"site voxel maps {name}"]:
            assert f"<td>{stage}</td>" in page, (name, stage)


def _check_outputs(out: Path, man: dict, ref: dict, unmixing: str = "capeDJICA"):
    np.testing.assert_array_equal(np.load(out / "W.npy"), ref["W"])
    np.testing.assert_array_equal(np.load(out / "basis.npy"), ref["basis"])
    # the consortium's FNC, as the simulation released it, and every component named
    from dpneuro.run.outputs import fnc_matrix, read_fnc

    np.testing.assert_allclose(read_fnc(out / "components.nii.gz"), fnc_matrix(ref["fnc"]), rtol=1e-5, atol=1e-6)
    assert len((out / "components.tsv").read_text().splitlines()) == 1 + len(ref["W"])
    priv = json.loads((out / "privacy.json").read_text())
    for s in man["sites"]:
        name = s["site"]
        assert dc.same_releases(priv["sites"][name]["ledger"], ref["ledgers"][name]), name
        own = json.loads((out / name / "privacy.json").read_text())
        assert dc.same_releases(own["ledger"], ref["ledgers"][name])
        assert own["epsilon"] == pytest.approx(priv["sites"][name]["epsilon"], rel=1e-12)
        page = (out / name / "report.html").read_text()
        assert 'alt="time courses"' in page  # the site's own report, its components named as the consortium's
        assert all(f"<td>{row.split(chr(9))[0]}</td><td>{row.split(chr(9))[2]}</td>" in page
                   for row in (out / "components.tsv").read_text().splitlines()[1:])
        subjects, tc = read_timecourses(out / name / "timecourses.tsv")
        assert tc.shape == (4, 3 * 40) and subjects == [x["id"] for x in s["subjects"] for _ in range(40)]
        head = (out / name / "timecourses.tsv").read_text().splitlines()[:3]
        assert head[0].startswith("subject\tsession\ttask\trun\tvolume\tonset\tIC01")
        fnc_rows = (out / name / "fnc_subjects.tsv").read_text().splitlines()  # each subject's FNC, kept here
        assert [r.split("\t")[0] for r in fnc_rows[1:]] == [x["id"] for x in s["subjects"]]
        tr = json.loads((out / name / "timecourses.json").read_text())["RepetitionTime"]
        assert [float(x.split("\t")[5]) for x in head[1:]] == [0.0, tr]
    assert "report.html" in os.listdir(out)
    _check_timings(out, man, unmixing)


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_site_and_aggregator_processes_equal_inprocess(consortium, tmp_path):
    man, ref = consortium
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared")
    _run_all(cfg, man, tmp_path)
    _check_outputs(tmp_path / "out" / "dpneuro", man, ref)  # <out>/<run id>, the default run id
    egress = _egress_ok(tmp_path / "shared", 4)
    assert [r["round"] for r in egress[0] if r["stage"] == "unmix" and r["topic"] == "release"] == list(range(12))
    assert (tmp_path / "keys" / "site-01.key").stat().st_mode & 0o777 == 0o600
    assert not list((tmp_path / "shared").rglob("*.key"))  # nothing secret in the shared folder


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_cumulant_unmixing_in_processes_equals_inprocess(consortium, tmp_path):
    """The cumulant unmixing's two releases cross the shared folder like capeDJICA's rounds: same W, same ledgers,
    every array a site sends noised, masked or public."""
    man, _ = consortium
    ref = dc.reference(dc.run_config(man, tmp_path / "ref", ica_unmixing="cumulant", cumulant_epsilon=4.0))
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared",
                       ica_unmixing="cumulant", cumulant_epsilon=4.0)
    _run_all(cfg, man, tmp_path)
    _check_outputs(tmp_path / "out" / "dpneuro", man, ref, unmixing="cumulant ICA")
    egress = _egress_ok(tmp_path / "shared", 4)
    releases = [r for r in egress[0] if r["stage"] == "unmix" and r["topic"] == "release"]
    assert [(r["round"], sorted(r["arrays"])) for r in releases] == [(0, ["S2"]), (1, ["K4"])]


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_killed_site_resumes_without_releasing_twice(consortium, tmp_path):
    man, ref = consortium
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared")
    names = [s["site"] for s in man["sites"]]
    logs = [tmp_path / "aggregator.log"] + [tmp_path / f"{n}.log" for n in names]
    procs = []
    try:
        procs.append(_start(["aggregator", cfg, "-q"], logs[0]))
        procs += [_start(["site", cfg, "--site", n, "-q"], log) for n, log in zip(names, logs[1:])]
        # kill site-02 (id 1) mid-ICA: once its egress log shows the release of round 3
        egress = tmp_path / "shared" / "dpneuro" / "unmix" / "egress" / "site-02.jsonl"
        deadline = time.monotonic() + DEADLINE
        while not (egress.exists() and '"round": 3, "run": "unmix", "site": 1, "topic": "release"'
                   in egress.read_text()):
            assert time.monotonic() < deadline and procs[2].poll() is None, "site-02 finished before the kill"
            time.sleep(0.005)
        procs[2].kill()
        assert procs[2].wait(timeout=10) != 0
        procs.append(_start(["site", cfg, "--site", names[1], "-q"], logs[2]))  # restart it
        procs[2] = procs.pop()
        _wait_all(procs, logs)
    finally:
        _kill_all(procs)
    _check_outputs(tmp_path / "out" / "dpneuro", man, ref)  # same W, same ledgers: nothing released twice
    released = [r["round"] for r in _egress_ok(tmp_path / "shared", 4)[1]
                if r["stage"] == "unmix" and r["topic"] == "release"]
    assert released == list(range(12))


def test_a_failing_site_stops_every_party_within_seconds_naming_it(consortium, tmp_path):
    man, _ = consortium
    bad = tmp_path / "bad"
    shutil.copytree(man["sites"][2]["path"], bad)
    victim = sorted(bad.glob("*.nii.gz"))[1]
    victim.write_bytes(victim.read_bytes()[: 2000])  # truncated: refused while loading, before any message
    sites = [dict(name=s["site"], path=str(bad) if i == 2 else s["path"]) for i, s in enumerate(man["sites"])]
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared",
                       timeout=600.0, sites_override=sites)
    logs = [tmp_path / "aggregator.log"] + [tmp_path / f"{s['name']}.log" for s in sites]
    procs = []
    t0 = time.monotonic()
    try:
        procs.append(_start(["aggregator", cfg, "-q"], logs[0]))
        procs += [_start(["site", cfg, "--site", s["name"], "-q"], log) for s, log in zip(sites, logs[1:])]
        codes = [p.wait(timeout=120) for p in procs]
    finally:
        _kill_all(procs)
    seconds = time.monotonic() - t0
    assert all(c != 0 for c in codes), codes
    assert seconds < 60, seconds  # not the 600 s message timeout
    assert victim.name in logs[3].read_text()  # the failing site names its file
    for log in [logs[0], logs[1], logs[2], logs[4]]:
        text = log.read_text()
        assert "site 'site-03' stopped with an error" in text and victim.name in text, text[-2000:]


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_a_new_run_id_does_not_reuse_an_old_runs_state(consortium, tmp_path):
    man, ref = consortium
    cfg = write_config(tmp_path / "run.toml", man, out=tmp_path / "out", exchange=tmp_path / "shared")
    names = [s["site"] for s in man["sites"]]
    for run_id in ("first", "second"):
        logs = [tmp_path / f"aggregator-{run_id}.log"] + [tmp_path / f"{n}-{run_id}.log" for n in names]
        procs = []
        try:
            procs.append(_start(["aggregator", cfg, "--run-id", run_id, "-q"], logs[0]))
            procs += [_start(["site", cfg, "--site", n, "--run-id", run_id, "-q"], log)
                      for n, log in zip(names, logs[1:])]
            _wait_all(procs, logs)
        finally:
            _kill_all(procs)
        # the second run exchanged its own messages (a reused state would finish without any)
        rel = tmp_path / "shared" / run_id / "unmix" / "egress" / "site-01.jsonl"
        assert len([x for x in rel.read_text().splitlines() if '"topic": "release"' in x]) == 12
        assert (tmp_path / "out" / ".dpneuro" / run_id / "site-01").is_dir()
        if run_id == "first":
            kept = {p: p.read_bytes() for p in (tmp_path / "out" / "first").rglob("*") if p.is_file()}
    # each run's outputs in its own folder: the second left the first's as they were
    _check_outputs(tmp_path / "out" / "second", man, ref)
    assert {p: p.read_bytes() for p in (tmp_path / "out" / "first").rglob("*") if p.is_file()} == kept
    assert (tmp_path / "out" / "first" / "site-01" / "timecourses.tsv") in kept


def test_each_party_writes_under_its_run_id(consortium, tmp_path, monkeypatch):
    """Outputs go to <out>/<run id>/ (a site's to <out>/<run id>/<site>/): the run id given, else the
    configuration's, else the default; two run ids never share an output folder."""
    from dpneuro.deploy import sharedfs

    man, _ = consortium
    seen = []
    monkeypatch.setattr(sharedfs, "run_aggregator_analysis", lambda ctx: seen.append(("aggregator", ctx)) or {})
    monkeypatch.setattr(sharedfs, "run_site_analysis", lambda ctx: seen.append(("site", ctx)) or {})
    out, shared = tmp_path / "out", tmp_path / "shared"
    cfg = dc.run_config(man, out, backend="directory", exchange_dir=str(shared))
    keys, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    for run_id in (None, "second"):
        sharedfs.aggregator_main(cfg, run_id=run_id, key_file=private["aggregator"], keys_file=keys)
        sharedfs.site_main(cfg, "site-02", run_id=run_id, key_file=private["site-02"], keys_file=keys)
    named = dc.run_config(man, out, backend="directory", exchange_dir=str(shared), run_id="third")
    sharedfs.aggregator_main(named, key_file=private["aggregator"], keys_file=keys)
    sharedfs.site_main(named, "site-02", key_file=private["site-02"], keys_file=keys)
    got = [(role, ctx.out, ctx.work) for role, ctx in seen]
    assert got == [
        ("aggregator", out / "dpneuro", out / ".dpneuro" / "dpneuro" / "aggregator"),
        ("site", out / "dpneuro" / "site-02", out / ".dpneuro" / "dpneuro" / "site-02"),
        ("aggregator", out / "second", out / ".dpneuro" / "second" / "aggregator"),
        ("site", out / "second" / "site-02", out / ".dpneuro" / "second" / "site-02"),
        ("aggregator", out / "third", out / ".dpneuro" / "third" / "aggregator"),
        ("site", out / "third" / "site-02", out / ".dpneuro" / "third" / "site-02")]
    assert all((shared / r / "manifest.json").is_file() for r in ("dpneuro", "second", "third"))
    with pytest.raises(ValueError, match="invalid run id"):
        sharedfs.aggregator_main(cfg, run_id="../up")
    with pytest.raises(ConfigError, match="'run_id'"):
        dc.run_config(man, out, run_id="a/b")


def test_site_refuses_to_start_when_the_manifest_disagrees(consortium, tmp_path, capsys):
    man, _ = consortium
    shared = tmp_path / "shared"
    agg = dc.run_config(man, tmp_path / "agg", exchange_dir=str(shared))
    (shared / "dpneuro").mkdir(parents=True)
    (shared / "dpneuro" / "manifest.json").write_text(json.dumps(run_manifest(agg, "dpneuro")))
    for field, value in (("pca_epsilon", 8.0), ("n_colluding", 0), ("ica_rounds", 13), ("parcels", 61)):
        site = dc.run_config(man, tmp_path / "site", exchange_dir=str(shared), **{field: value})
        with pytest.raises(ManifestMismatch, match=rf"config field '{field}'"):
            site_main(site, "site-02")
    other = np.ones((30, 30, 1), np.uint8)
    other[0, 0, 0] = 0  # same shape and affine, one voxel less
    nib.Nifti1Image(other, np.eye(4)).to_filename(tmp_path / "mask.nii.gz")
    site = dc.run_config(man, tmp_path / "site", exchange_dir=str(shared), mask=str(tmp_path / "mask.nii.gz"))
    with pytest.raises(ManifestMismatch, match="data grid"):
        site_main(site, "site-02")
    # the command says the same and exits with an error, before anything is loaded or sent
    cfg = write_config(tmp_path / "site.toml", man, out=tmp_path / "site", exchange=shared, site_paths=["site-02"],
                       delta=1e-6)
    assert main(["site", str(cfg), "--site", "site-02", "-q"]) == 2
    assert "config field 'delta'" in capsys.readouterr().err
    assert not (tmp_path / "site" / ".dpneuro").exists()


def test_party_configs_need_only_their_own_data(consortium, tmp_path):
    man, _ = consortium
    cfg = write_config(tmp_path / "site.toml", man, out=tmp_path / "o", exchange=tmp_path / "x",
                       site_paths=["site-03"])
    assert load_party_config(cfg, site="site-03").sites[2].path.endswith("site-03")
    assert load_party_config(cfg).sites[0].path == ""  # the aggregator holds no data
    with pytest.raises(ConfigError, match=r"sites\[0\]"):
        load_party_config(cfg, site="site-01")  # its own data are not named here
    with pytest.raises(ConfigError, match="no site named"):
        load_party_config(cfg, site="site-09")
    with pytest.raises(ConfigError, match=r"sites\[0\]"):
        RunConfig.load(cfg)  # `dpneuro run` still needs every site's data


def test_templates_cover_every_field_and_agree():
    text = (dc.TEMPLATES / "run.toml").read_text()
    lines = text.splitlines()
    for f in fields(RunConfig):
        if f.name == "sites":
            assert "[[sites]]" in text
            continue
        at = [i for i, ln in enumerate(lines) if re.match(rf"^#? ?{f.name} = ", ln)]
        assert at, f"run.toml does not mention {f.name}"
        above = lines[at[0] - 1]
        assert above.startswith("#") or (at[0] > 1 and lines[at[0] - 2].startswith("#")), f"{f.name} uncommented"
    run = RunConfig.from_dict(tomllib.loads(text), base=dc.TEMPLATES)
    for name, value in RunConfig.recommended().items():  # the template carries the library's tuned defaults
        assert getattr(run, name) == value, name
    assert run.n_components == RunConfig.__dataclass_fields__["n_components"].default
    site = RunConfig.from_dict(tomllib.loads((dc.TEMPLATES / "site.toml").read_text()), base=dc.TEMPLATES)
    site.validate(data_sites=[])
    for name in CONSORTIUM_FIELDS + ("space", "mask"):
        assert getattr(site, name) == getattr(run, name), name  # a site copies the coordinator's settings
    assert [s.name for s in site.sites] == [s.name for s in run.sites]
    readme = (dc.TEMPLATES / "README.md").read_text()
    for needle in ("privacy.json", "sites.<name>.epsilon`", "epsilon_single_release", "What leaves your site", "dpneuro keygen",
                   "--key-file", "timecourses.tsv"):
        assert needle in readme


def test_a_site_started_before_its_aggregator_says_what_it_waits_for(consortium, tmp_path, capsys):
    from dpneuro.deploy.sharedfs import WaitTimeout

    man, _ = consortium
    cfg = dc.run_config(man, tmp_path / "out", backend="directory", exchange_dir=str(tmp_path / "x"), timeout=0.3)
    with pytest.raises(WaitTimeout, match="is the aggregator running"):
        site_main(cfg, "site-01")
    err = capsys.readouterr().err
    assert "site-01: waiting for up to 0.3 s for the aggregator's run manifest" in err
    assert "start `dpneuro aggregator`" in err and err.count("waiting") == 1
