"""A stage that fails is never a cached result: `dpneuro run` says which stage failed (and at which site), the
error, where the traceback is and what to do; the same command then runs the failed stage again and finishes.

Both ways a stage fails: it raises (the error travels through the workflow as a value), or its worker process
dies (killed for memory, a crash outside Python), which Pydra 0.25 used to wait a minute for and whose errored
result then made the rerun report "workflow failed" after it had computed everything."""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import pytest

from dpneuro.cli import main
from dpneuro.datasets.synth import make_consortium
from dpneuro.run import pipeline


@pytest.fixture(scope="module")
def consortium(tmp_path_factory):
    root = tmp_path_factory.mktemp("failed-stage")
    return make_consortium(root / "data", n_sites=3, subjects_per_site=3, n_components=4, n_timepoints=40,
                           space="grid30", random_state=4)


def _toml(tmp_path: Path, man: dict) -> Path:
    sites = "".join(f'[[sites]]\nname = "{s["site"]}"\npath = "{s["path"]}"\n' for s in man["sites"])
    toml = tmp_path / "run.toml"
    toml.write_text(f'out = "{tmp_path / "out"}"\nmask = "{man["mask"]}"\nn_components = 4\nseed = 0\n'
                    f'simulation = true\nparcels = 30\nica = "spatial"\n{sites}')
    return toml


def _fail_once(monkeypatch, name: str, stage: str, site: str, how):
    """Make ``pipeline.<name>`` fail (``how()``) the first time it runs ``stage`` (at ``site``); returns the calls
    of that stage (at that site), as a list of process ids."""
    calls: list[int] = []
    real = getattr(pipeline, name)

    def flaky(cfg_json, *args):
        if (stage == "load" and args[0] == site) or (stage != "load" and stage in args):
            calls.append(os.getpid())
            if len(calls) == 1:
                how()
        return real(cfg_json, *args)

    monkeypatch.setattr(pipeline, name, flaky)
    return calls


@pytest.mark.parametrize(("name", "stage", "site", "says"), [
    ("stage_release", "unmix", "", "stage 'unmix' failed: "),
    ("stage_load", "load", "site-02", "stage 'load' at site 'site-02' failed: "),
])
def test_a_stage_that_raised_is_run_again_by_the_same_command(consortium, tmp_path, capsys, monkeypatch, name,
                                                              stage, site, says):
    def boom():
        raise RuntimeError("a transient failure")

    calls = _fail_once(monkeypatch, name, stage, site, boom)
    cmd = ["run", str(_toml(tmp_path, consortium)), "-q", "--plugin", "serial"]  # the stages in this process
    assert main(cmd) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith(f"dpneuro run: error: {says}a transient failure (traceback: "), err
    crash = Path(re.search(r"traceback: (\S+)\)", err).group(1))
    assert "RuntimeError: a transient failure" in crash.read_text()
    assert crash.name == f"error-{stage}{'-' + site if site else ''}.txt"  # each stage and site its own file
    assert "not cached" in err and "run the same command again" in err
    assert len(calls) == 1
    assert main(cmd) == 0  # the failure was not kept as the stage's result: it runs again, and the run finishes
    assert len(calls) == 2
    assert (tmp_path / "out" / "dpneuro" / "report.html").exists()


def test_a_stage_whose_worker_died_stops_the_run_at_once_and_runs_again(consortium, tmp_path, capsys, monkeypatch):
    """Pydra's concurrent worker: the process running the unmixing is killed (as the system's out-of-memory killer
    would). The run stops at once naming the stage, and the same command then finishes."""
    parent, marker = os.getpid(), tmp_path / "killed"

    def kill():
        if os.getpid() == parent:  # never this test's own process: the stage must run in a worker
            raise AssertionError("the stage ran in the test's process")
        marker.write_text("")
        os.kill(os.getpid(), signal.SIGKILL)

    def once():  # each worker process counts its own calls: the marker says whether one was killed already
        if not marker.exists():
            kill()

    _fail_once(monkeypatch, "stage_release", "unmix", "", once)
    cmd = ["run", str(_toml(tmp_path, consortium)), "-q"]
    first = main(cmd)
    err = capsys.readouterr().err.strip()
    second = main(cmd)  # Pydra 0.25 computed every stage again here, then reported the old failure
    assert (first, second) == (2, 0), capsys.readouterr().err
    assert marker.exists() and (tmp_path / "out" / "dpneuro" / "report.html").exists()
    assert err.startswith("dpneuro run: error: the run failed while running stage unmix (spatial ICA): its worker "
                          "process ended abruptly"), err
    assert len(err.splitlines()) == 1 and "not cached" in err and "run the same command again" in err
    crash = Path(re.search(r"traceback: (\S+)\)", err).group(1))
    assert "BrokenProcessPool" in crash.read_text()


def test_a_failure_left_in_pydras_cache_is_not_taken_for_the_stages_result(consortium, tmp_path, capsys,
                                                                            monkeypatch):
    """A run that died before it removed Pydra's cache (killed just after a stage failed) leaves the stage's error
    there as the task's result: the next run computes the stage again rather than failing the same way."""
    def boom():
        raise RuntimeError("a transient failure")

    calls = _fail_once(monkeypatch, "stage_release", "unmix", "", boom)
    cmd = ["run", str(_toml(tmp_path, consortium)), "-q", "--plugin", "serial"]
    with monkeypatch.context() as m:
        m.setattr(shutil, "rmtree", lambda *args, **kwargs: None)  # the clean-up never happens
        assert main(cmd) == 2
    first = capsys.readouterr().err
    assert main(cmd) == 0, capsys.readouterr().err  # before: the cached error, "failed" again at once
    assert len(calls) == 2 and (tmp_path / "out" / "dpneuro" / "report.html").exists()
    assert "stage 'unmix' failed" in first
