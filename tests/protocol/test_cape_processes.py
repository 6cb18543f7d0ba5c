"""CAPE with every site in its own OS process over the directory exchange."""

import subprocess
import sys
import threading
from pathlib import Path

import cape_workers as cw
import numpy as np

from dpneuro.protocol.cape import cape_protocol, run_cape
from dpneuro.protocol.driver import RunOptions, run_aggregator
from dpneuro.protocol.exchange import DirectoryCheckpoint, DirectoryExchange

KEY = bytes(range(32))
WORKER = str(Path(__file__).resolve().parents[1] / "cape_workers.py")
DEADLINE = 90


def _run(tmp_path, n, die=None):
    """Aggregator in a thread here, sites as processes; ``die=(site, round)`` kills one and restarts it."""
    ex = DirectoryExchange(tmp_path / "shared", n, run_id="cape", key=KEY, poll_interval=0.005)
    out = {}

    def agg():
        try:
            out["state"] = run_aggregator(cape_protocol(cw.Drift(), "cape", n_sites=n), ex,
                                          checkpoint=DirectoryCheckpoint(tmp_path / "agg.npz"),
                                          options=RunOptions(timeout=60))
        except BaseException as exc:  # noqa: BLE001 - reported below
            out["error"] = exc

    def start(s, extra=()):
        args = [sys.executable, WORKER, "--root", str(tmp_path / "shared"), "--run-id", "cape", "--key", KEY.hex(),
                "--n-sites", str(n), "--site", str(s), "--checkpoint", str(tmp_path / f"site-{s}.npz"), *extra]
        return subprocess.Popen(args, stderr=open(tmp_path / f"site-{s}.err", "ab"), cwd=Path(__file__).resolve().parents[1])

    t = threading.Thread(target=agg, daemon=True)
    procs = []
    try:
        t.start()
        for s in range(n):
            extra = ("--die-at", str(die[1]), "--marker", str(tmp_path / "died")) if die and die[0] == s else ()
            procs.append(start(s, extra))
        if die:
            victim = procs[die[0]]
            assert victim.wait(timeout=DEADLINE) == cw.DIE_EXIT_CODE
            procs.append(start(die[0]))  # restart from its checkpoint
            procs[die[0]] = procs[-1]
        for p in procs[:n]:
            assert p.wait(timeout=DEADLINE) == 0, (tmp_path / "site-0.err").read_text()
        t.join(timeout=DEADLINE)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        ex.close()
    assert "error" not in out, out.get("error")
    return out["state"], ex


def _reference(n):
    return run_cape(cw.Drift(), cw.site_data(n), "cape", options=RunOptions(timeout=30))


def test_cape_over_processes_equals_inprocess(tmp_path):
    n = 3
    state, ex = _run(tmp_path, n)
    ref = _reference(n)
    assert len(state["means"]) == 4
    for a, b in zip(state["means"], ref.aggregator["means"], strict=True):
        np.testing.assert_array_equal(a, b)
    for s in range(n):
        assert [r["topic"] for r in ex.egress_log(s)].count("release") == 4


def test_killed_site_restarts_without_redrawing(tmp_path):
    n = 3
    state, ex = _run(tmp_path, n, die=(1, 2))
    assert (tmp_path / "died").exists()
    ref = _reference(n)
    # the very same noise as an uninterrupted run: nothing was drawn again after the restart
    for a, b in zip(state["means"], ref.aggregator["means"], strict=True):
        np.testing.assert_array_equal(a, b)
    led = DirectoryCheckpoint(tmp_path / "site-1.npz").load()["state"]["ledger"]
    assert led.releases[0].count == 4  # one release per round, none repeated
    assert led.draws == 8
    releases = [r for r in ex.egress_log(1) if r["topic"] == "release"]
    assert [r["round"] for r in releases] == [0, 1, 2, 3]
