"""The main job: Pydra workflow end to end, caching, report, CLI errors."""

import json
import re
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.cli import main
from dpneuro.config import ConfigError, RunConfig
from dpneuro.datasets.synth import make_consortium
from dpneuro.report.figures import read_timecourses
from dpneuro.workflows import run_workflow

R = 4


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("consortium")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=3, n_components=R, n_timepoints=80,
                          space="grid30", random_state=3)
    return root, man


def _config(root: Path, man: dict, out: str, **kw) -> RunConfig:
    """Temporal ICA unless ``ica`` is given: the end-to-end test follows capeDJICA's rounds and their re-run."""
    d = dict(sites=[{"name": s["site"], "path": s["path"]} for s in man["sites"]], out=str(root / out),
             mask=man["mask"], n_components=R, truth=str(root / "data"), ica="temporal", pca_epsilon=50.0,
             ica_epsilon_i=50.0,
             ica_rounds=15, clip_G=5.0, clip_h=5.0, seed=1, plan="cape")
    d.update(kw)
    return RunConfig.from_dict(d).validate()


def _work_dirs(cfg: RunConfig, stage: str) -> list[Path]:
    return sorted((Path(cfg.out) / "work").glob(f"{stage}-*"))


@pytest.mark.slow  # heavy: CI runs it with --runslow -m slow
def test_workflow_end_to_end_cache_and_rerun(consortium):
    root, man = consortium
    cfg = _config(root, man, "run")
    res = run_workflow(cfg)
    out, work = cfg.run_dir, Path(cfg.out) / "work"
    assert out == Path(cfg.out) / "dpneuro"  # the default run id
    comp = nib.load(out / "components.nii.gz")
    assert comp.shape == (30, 30, 1, R)
    priv = json.loads((out / "privacy.json").read_text())
    assert set(priv["sites"]) == {"site-01", "site-02", "site-03"}
    for s in priv["sites"].values():
        stages = {r["stage"] for r in s["ledger"]["releases"]}
        # capePCA's basis and variances (temporal ICA whitens with them), capeDJICA's releases and the FNC composed
        assert stages == {"capepca", "capepca-variances", "ica", "static-fnc"}
        assert s["epsilon_single_release"] > 0 and s["epsilon"] > s["epsilon_single_release"]
        assert s["neighbours"] == ["replace"]
    assert priv["neighbour"] == "replace" and priv["epsilon"] == {n: s["epsilon"] for n, s in priv["sites"].items()}
    html = Path(res["report"]).read_text()
    assert len(re.findall(r'<img alt="IC\d\d[" ]', html)) == R  # one image per component
    assert len(re.findall(r'<img alt="truth IC\d\d[" ]', html)) == R
    assert "Total privacy spent by every site" in html and "site-03" in html
    run = json.loads((out / "run.json").read_text())
    assert run["config"]["pca_epsilon"] == 50.0 and run["versions"]["pydra"] == "0.25"
    assert run["seed_policy"].startswith("fixed seed 1") and run["ica_rounds_run"] >= 1
    for tsv in (out / "timecourses").glob("site-??.tsv"):  # beside them each site's subjects' FNC
        subjects, tc = read_timecourses(tsv)
        assert tc.shape[0] == R and len(set(subjects)) == 3 and subjects[0].startswith("sub-")
        rows = [ln.split("\t") for ln in tsv.read_text().splitlines()]
        assert rows[0][:6] == ["subject", "session", "task", "run", "volume", "onset"] and rows[0][6] == "IC01"
        tr = json.loads(tsv.with_suffix(".json").read_text())["RepetitionTime"]
        assert [float(r[5]) for r in rows[1:4]] == [0.0, tr, 2 * tr]

    # same cache: nothing runs again
    before = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file() and "pydra" not in str(p)}
    report_mtime = Path(res["report"]).stat().st_mtime_ns
    run_workflow(cfg)
    assert Path(res["report"]).stat().st_mtime_ns == report_mtime
    after = {p: p.stat().st_mtime_ns for p in work.rglob("*") if p.is_file() and "pydra" not in str(p)}
    assert {p: t for p, t in after.items() if p in before} == before

    # a new ICA budget re-runs only what depends on it
    cfg2 = _config(root, man, "run", ica_epsilon_i=20.0)
    run_workflow(cfg2)
    assert len(_work_dirs(cfg2, "reduce")) == 1 and len(_work_dirs(cfg2, "load-site-01")) == 1
    assert len(_work_dirs(cfg2, "unmix")) == 2 and len(_work_dirs(cfg2, "maps")) == 2
    assert Path(res["report"]).stat().st_mtime_ns != report_mtime


def test_brain_states_node_equals_the_stages_and_reruns_alone(consortium):
    """The Pydra workflow's brain-states node: the numbers of run_stages; a new states budget re-runs it alone."""
    from dpneuro.run import pipeline

    root, man = consortium
    cfg = _config(root, man, "states-wf", ica="spatial", brain_states=2, states_epsilon=30.0)
    res = run_workflow(cfg)
    ref_cfg, _ = pipeline.prepare(_config(root, man, "states-stages", ica="spatial", brain_states=2,
                                          states_epsilon=30.0))
    ref = pipeline.run_stages(ref_cfg)
    got, want = (json.loads(Path(r["states"]).read_text()) for r in (res, ref))
    np.testing.assert_array_equal(np.load(got["public"]["arrays"]["vectors"]),
                                  np.load(want["public"]["arrays"]["vectors"]))
    assert got["ledgers"] == want["ledgers"]
    out = cfg.run_dir
    assert np.load(out / "states.npy").shape == (2, R, R)
    assert len(list((out / "timecourses").glob("*_states.tsv"))) == 3
    assert 'alt="brain states"' in Path(res["report"]).read_text()
    run_workflow(_config(root, man, "states-wf", ica="spatial", brain_states=2, states_epsilon=20.0))
    assert len(_work_dirs(cfg, "reduce")) == 1 and len(_work_dirs(cfg, "unmix")) == 1
    assert len(_work_dirs(cfg, "states")) == 2 and len(_work_dirs(cfg, "maps")) == 2


def test_runs_with_other_run_ids_keep_their_own_outputs(tmp_path, consortium):
    """Two runs into one out: each run id's outputs in <out>/<run_id>/, the first's untouched by the second; the
    stages' cache in <out>/work is shared (the second loads nothing again)."""
    from dpneuro.run import pipeline

    root, man = consortium
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{s["path"]}"\n' for s in man["sites"])
    toml = tmp_path / "run.toml"
    toml.write_text(f'out = "{tmp_path / "o"}"\nmask = "{man["mask"]}"\nn_components = {R}\nseed = 0\n'
                    f'simulation = true\nparcels = 30\nrun_id = "first"\n{sites}')
    cfg, _ = pipeline.prepare(RunConfig.read(toml))
    pipeline.run_stages(cfg)
    first = {p.relative_to(tmp_path / "o" / "first"): p.read_bytes()
             for p in (tmp_path / "o" / "first").rglob("*") if p.is_file()}
    assert {Path("report.html"), Path("privacy.json"), Path("components.nii.gz"), Path("run.json"),
            Path("timecourses/site-01.tsv"), Path("timecourses/site-01.json")} <= set(first)
    loads = sorted((tmp_path / "o" / "work").glob("load-*"))
    toml.write_text(toml.read_text().replace("seed = 0", "seed = 0\npca_epsilon = 3.0"))
    assert main(["run", str(toml), "--run-id", "second", "-q"]) == 0  # the command line's id wins
    assert sorted((tmp_path / "o" / "work").glob("load-*")) == loads
    assert {p.relative_to(tmp_path / "o" / "first"): p.read_bytes()
            for p in (tmp_path / "o" / "first").rglob("*") if p.is_file()} == first
    eps = [json.loads((tmp_path / "o" / r / "privacy.json").read_text())["epsilon"] for r in ("first", "second")]
    assert eps[0] != eps[1]  # each folder holds its own run
    assert json.loads((tmp_path / "o" / "second" / "run.json").read_text())["config"]["run_id"] == "second"
    assert not (tmp_path / "o" / "report.html").exists()
    assert main(["run", str(toml), "--run-id", "../up", "-q"]) == 2


def test_relative_paths_are_taken_against_the_working_folder(tmp_path, consortium, monkeypatch):
    """A config built in Python with relative paths runs from wherever the caller stands."""
    import shutil

    root, man = consortium
    shutil.copytree(root / "data", tmp_path / "data")
    monkeypatch.chdir(tmp_path)
    d = dict(sites=[{"name": s["site"], "path": str(Path("data") / s["site"])} for s in man["sites"]],
             out="rel_out", mask="data/mask.nii.gz", n_components=R, pca_epsilon=50.0, ica_epsilon_i=50.0,
             ica_rounds=5, seed=1)
    res = run_workflow(RunConfig.from_dict(d))
    assert Path(res["report"]) == tmp_path / "rel_out" / "dpneuro" / "report.html" and Path(res["report"]).exists()


def test_data_errors_reach_the_user_as_one_line(tmp_path, consortium, capsys):
    import shutil

    root, man = consortium
    bad = tmp_path / "bad"
    shutil.copytree(man["sites"][1]["path"], bad)
    victim = sorted(bad.glob("*.nii.gz"))[0]
    intact = victim.read_bytes()
    victim.write_bytes(intact[:1500])
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{bad if i == 1 else s["path"]}"\n'
                    for i, s in enumerate(man["sites"]))
    cfg = tmp_path / "bad.toml"
    cfg.write_text(f'out = "{tmp_path / "o"}"\nmask = "{man["mask"]}"\nn_components = {R}\nseed = 0\n{sites}')
    assert main(["run", str(cfg), "-q"]) == 2  # Pydra's concurrent worker (the default) ends, it does not spin
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and victim.name in err and not err.startswith("dpneuro run: error: (")
    crash = Path(re.search(r"traceback: (\S+)\)", err).group(1))
    assert "DataValidationError" in crash.read_text()  # the whole traceback is kept
    # the error was not cached as the stage's result: with the file mended, the same command runs through
    victim.write_bytes(intact)
    assert main(["run", str(cfg), "-q"]) == 0
    assert (tmp_path / "o" / "dpneuro" / "report.html").exists()


def test_a_quiet_run_prints_no_site_console(tmp_path, consortium, capsys):
    """``-q`` prints nothing but errors and warnings: each site's account of what it read is in its record."""
    root, man = consortium
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{s["path"]}"\n' for s in man["sites"])
    for quiet in (True, False):
        cfg = tmp_path / f"q{quiet}.toml"
        cfg.write_text(f'out = "{tmp_path / f"o{quiet}"}"\nmask = "{man["mask"]}"\nn_components = {R}\nseed = 0\n'
                       f'simulation = true\nparcels = 30\n{sites}')
        assert main(["run", str(cfg), "--plugin", "serial", *(["-q"] if quiet else [])]) == 0
        err = capsys.readouterr().err
        assert ("time points, TR" in err) is not quiet, err
    record = json.loads(next((tmp_path / "oTrue" / "work").glob("load-site-01-*/site.json")).read_text())
    assert record["n_subjects"] == len(man["sites"][0]["subjects"])


def test_config_errors_name_the_field(tmp_path, consortium):
    root, man = consortium
    good = {"sites": [{"name": "a", "path": man["sites"][0]["path"]}], "out": str(tmp_path / "o"), "plan": "conv"}
    RunConfig.from_dict(good).validate()
    with pytest.raises(ConfigError, match="unknown config field"):
        RunConfig.from_dict({**good, "epsilonn": 1.0})
    with pytest.raises(ConfigError, match=r"sites\[0\]"):
        RunConfig.from_dict({**good, "sites": [{"name": "a", "path": str(tmp_path / "nope")}]}).validate()
    with pytest.raises(ConfigError, match="'plan'.*at least 3 sites"):
        RunConfig.from_dict({**good, "plan": "cape"}).validate()
    with pytest.raises(ConfigError, match="ica_epsilon_i"):
        RunConfig.from_dict({**good, "ica_epsilon_i": -1}).validate()
    with pytest.raises(ConfigError, match="classic"):
        RunConfig.from_dict({**good, "ica_epsilon_i": 2.0, "calibration": "classic"}).validate()


def test_cli_run_rejects_broken_config_and_mismatched_grid(tmp_path, consortium, capsys):
    root, man = consortium
    bad = tmp_path / "bad.toml"
    bad.write_text('out = "o"\nplan = "cape"\n[[sites]]\nname = "a"\npath = "missing"\n')
    assert main(["run", str(bad), "-q"]) == 2
    err = capsys.readouterr().err
    assert "sites[0]" in err and "missing" in err

    # a site whose images sit on another grid is refused, naming the file
    odd = tmp_path / "odd"
    odd.mkdir()
    img = nib.load(man["sites"][2]["subjects"][0]["path"])
    nib.Nifti1Image(np.asarray(img.dataobj), img.affine * np.diag([2, 2, 2, 1])).to_filename(odd / "sub-9999_bold.nii.gz")
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{s["path"]}"\n' for s in man["sites"][:2])
    cfg = tmp_path / "grid.toml"
    cfg.write_text(f'out = "{tmp_path / "o2"}"\nmask = "{man["mask"]}"\nn_components = {R}\nseed = 0\n'
                   f'{sites}[[sites]]\nname = "odd"\npath = "{odd}"\n')
    assert main(["run", str(cfg), "-q"]) != 0
    err = capsys.readouterr().err
    assert "sub-9999_bold.nii.gz" in err and "affine" in err


def test_every_option_of_every_command_is_documented():
    import argparse

    from dpneuro.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, p in sub.choices.items():
        for action in p._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"dpneuro {name} {'/'.join(action.option_strings) or action.dest}: no help"


def test_quiet_is_quiet_after_a_verbose_call(monkeypatch, capsys):
    import os

    monkeypatch.delenv("DPNEURO_PROGRESS", raising=False)
    assert main(["budget", "--sites", "3", "--subjects", "10"]) == 0
    assert "DPNEURO_PROGRESS" not in os.environ  # nothing leaks into the next call
    capsys.readouterr()
