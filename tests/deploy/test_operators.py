"""`dpneuro run` as an operator meets it: stopped with Ctrl-C or SIGTERM, then run again (issue 45).

Each test starts the command in a session of its own, so that whatever it forks can be found (and always
killed at the end) by that session's id.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dpneuro.datasets.synth import make_consortium

pytestmark = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads processes from /proc")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    """A run.toml on 4 small grid30 sites, with enough volumes that loading takes a moment."""
    root = tmp_path_factory.mktemp("operators")
    man = make_consortium(root / "data", n_sites=4, subjects_per_site=8, n_components=4, n_timepoints=200,
                          space="grid30", random_state=0)
    lines = ['space = "grid30"', "parcels = 60", "n_components = 4", 'ica = "temporal"', "pca_epsilon = 20.0",
             "ica_epsilon_i = 4.0", "ica_delta_i = 0.01", "ica_rounds = 12", "clip_G = 5.0", "clip_h = 5.0",
             "seed = 3", "simulation = true", 'plan = "cape"', "timeout = 60.0"]
    for s in man["sites"]:
        lines += ["[[sites]]", f'name = "{s["site"]}"', f'path = "{s["path"]}"']
    return _with_out(root, lines)


def _with_out(root: Path, lines: list[str]) -> Path:
    cfg = root / "run.toml"
    cfg.write_text("\n".join([f'out = "{root / "out"}"', *lines]) + "\n")
    return cfg


def _fresh(config: Path, name: str) -> Path:
    """The same sites with an output folder of the test's own."""
    root = config.parent / name
    root.mkdir()
    return _with_out(root, config.read_text().splitlines()[1:])


def _start(cfg: Path) -> subprocess.Popen:
    env = dict(os.environ, NO_ET="1", MPLBACKEND="Agg")
    return subprocess.Popen([sys.executable, "-m", "dpneuro.cli", "run", "-q", str(cfg)], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)


def _wait_for_loading(cfg: Path, proc: subprocess.Popen, timeout: float = 60.0) -> None:
    """Until a site's load stage has its folder (loading has begun)."""
    work = cfg.parent / "out" / "work"
    deadline = time.monotonic() + timeout
    while not any(work.glob("load-*")):
        assert proc.poll() is None, f"the run ended before loading: {proc.communicate()}"
        assert time.monotonic() < deadline, "the run never started loading"
        time.sleep(0.01)


def _session(sid: int) -> list[str]:
    """The processes still alive (zombies aside) in session ``sid``: pid, parent and command line."""
    alive = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()  # after the command name: state, ppid, pgrp, sid
            if int(fields[3]) == sid and fields[0] != "Z":
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                alive.append(f"{stat.parent.name} (parent {fields[1]}): {cmd}")
        except (OSError, ValueError, IndexError):
            continue  # the process ended while being read
    return alive


def _kill_session(proc: subprocess.Popen) -> None:
    """Whatever the test started, gone: the run and everything in its session."""
    for line in _session(proc.pid):
        try:
            os.kill(int(line.split()[0]), signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=30)


def test_ctrl_c_while_loading_then_the_same_command_resumes(config):
    cfg = _fresh(config, "ctrl-c")
    proc = _start(cfg)
    try:
        _wait_for_loading(cfg, proc)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C does: the whole foreground group gets it
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 130, err
        assert "Traceback" not in err and "pending" not in err, err
        message = err.strip().splitlines()[-1]
        assert "interrupted by SIGINT" in message and "run the same command again" in message, err

        again = subprocess.run([sys.executable, "-m", "dpneuro.cli", "run", "-q", str(cfg)], capture_output=True,
                               text=True, timeout=120, env=dict(os.environ, NO_ET="1", MPLBACKEND="Agg"))
        assert again.returncode == 0, again.stderr
        assert (cfg.parent / "out" / "dpneuro" / "report.html").exists()
        work = cfg.parent / "out" / "work"
        assert not [p for p in work.rglob("*.npy") if p.stat().st_size == 0]
        assert not list(work.rglob(".*.part"))  # half-written matrices of the interrupted run are gone
    finally:
        _kill_session(proc)


def test_sigterm_stops_every_worker(config):
    cfg = _fresh(config, "sigterm")
    proc = _start(cfg)
    try:
        _wait_for_loading(cfg, proc)
        assert len(_session(proc.pid)) > 1, "no worker to orphan: the run must use the cf plugin's processes"
        os.kill(proc.pid, signal.SIGTERM)  # the parent alone, as a scheduler or `kill` sends it
        proc.wait(timeout=30)
        deadline = time.monotonic() + 5
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _session(proc.pid) == []
        _, err = proc.communicate(timeout=10)
        assert proc.returncode == 143, err
        assert "Traceback" not in err and "interrupted by SIGTERM" in err, err
    finally:
        _kill_session(proc)
