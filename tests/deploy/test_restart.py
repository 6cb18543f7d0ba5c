"""A deployed party stopped, then started again (issue 58): the real aggregator and sites in threads over a shared
folder.

A site stopped by its operator (Ctrl-C) is waited for: started again alone, it resumes and the run completes. After
a run stopped on an error, a party started again says at once who stopped, when and what every party must run, and
every party started again with the same run id, in any order, resumes and completes the run.
"""

from __future__ import annotations

import threading
import time
from dataclasses import replace

import deploy_common as dc
import pytest

from dpneuro.deploy import sharedfs
from dpneuro.protocol.exchange import DirectoryExchange, PartyFailed, SiteTimeout

STAGE, ROUND = "unmix", 3  # where a site stops: right after its capeDJICA release of this round
LIMIT = 120.0  # seconds any one party thread may take


@pytest.fixture
def run(tmp_path):
    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), timeout=60.0)
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    return cfg, keys_file, private


def _stop_once(monkeypatch, site: str, exc: BaseException) -> threading.Event:
    """``site`` raises ``exc`` once, right after it sent its release of round ROUND (as Ctrl-C or a crash would)."""
    real, done = DirectoryExchange.send, threading.Event()

    def send(self, s, round, topic, payload):
        real(self, s, round, topic, payload)
        if (self.run_id, self._party(s), round, topic) == (STAGE, site, ROUND, "release") and not done.is_set():
            done.set()
            raise exc

    monkeypatch.setattr(DirectoryExchange, "send", send)
    return done


def _start(name: str, fn, out: dict) -> threading.Thread:
    def target():
        try:
            out[name] = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the test
            out[name] = e

    t = threading.Thread(target=target, daemon=True)
    t.start()
    return t


def _site(cfg, keys_file, private, name):
    return lambda: sharedfs.site_main(cfg, name, key_file=private[name], keys_file=keys_file)


def _aggregator(cfg, keys_file, private):
    return lambda: sharedfs.aggregator_main(cfg, key_file=private["aggregator"], keys_file=keys_file)


def _join(threads) -> None:
    deadline = time.monotonic() + LIMIT
    for t in threads:
        t.join(timeout=max(0.0, deadline - time.monotonic()))
    assert not any(t.is_alive() for t in threads), "a party still runs: it hangs"


def _wait_for(cond, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _released_once(cfg, site: str) -> None:
    """Every capeDJICA round released by ``site`` once, in order (its egress log in the shared folder)."""
    log = sharedfs.run_folder(cfg, cfg.run_id) / STAGE / "egress" / f"{site}.jsonl"
    rounds = [r["round"] for r in DirectoryExchange._parse_log(log.read_bytes()) if r["topic"] == "release"]
    assert rounds == list(range(cfg.ica_rounds)), rounds


def test_a_site_stopped_by_its_operator_is_started_again_alone_and_the_run_completes(run, monkeypatch, capsys):
    cfg, keys_file, private = run
    _stop_once(monkeypatch, "site-02", KeyboardInterrupt())
    out: dict = {}
    threads = dc.start_parties(cfg, keys_file, private, out)
    _wait_for(lambda: "site-02" in out, LIMIT, "site-02 was never stopped")
    assert isinstance(out["site-02"], KeyboardInterrupt)
    time.sleep(2.0)  # long enough for the others to see its notice (they poll every few ms)
    assert set(out) == {"site-02"}, out  # the aggregator and the other sites wait for it rather than stop
    err = capsys.readouterr().err
    assert "site 'site-02': stopped by its operator; the other parties of run 'dpneuro' wait for it (up to 60 s" in err
    assert f"`dpneuro site CONFIG --site site-02 --run-id dpneuro --key-file {private['site-02']} --keys {keys_file}`" \
        in err, err
    threads.append(_start("site-02", _site(cfg, keys_file, private, "site-02"), out))  # started again alone
    _join(threads)
    assert all(isinstance(r, dict) for r in out.values()), out
    _released_once(cfg, "site-02")  # it resumed from its checkpoint: nothing released twice
    assert not list((sharedfs.run_folder(cfg, cfg.run_id) / "failed").glob("*.json"))


def test_after_a_run_stopped_a_party_started_again_says_so_at_once_and_every_party_resumes(run, monkeypatch, capsys):
    cfg, keys_file, private = run
    _stop_once(monkeypatch, "site-03", RuntimeError("the site's disk went away"))
    out: dict = {}
    _join(dc.start_parties(cfg, keys_file, private, out))
    assert isinstance(out["site-03"], RuntimeError)
    hint = ("start every party again with run id 'dpneuro' (each resumes from its checkpoint; nothing is released "
            "twice): the aggregator with `dpneuro aggregator CONFIG --run-id dpneuro --key-file KEY --keys KEYS` and "
            "each site (site-01, site-02, site-03, site-04) with `dpneuro site CONFIG --site NAME --run-id dpneuro "
            "--key-file KEY --keys KEYS`")
    for name in ("aggregator", "site-01", "site-02", "site-04"):  # stopped at once, each saying what to run
        assert isinstance(out[name], PartyFailed) and "site 'site-03' stopped with an error" in str(out[name])
        assert hint in str(out[name]), str(out[name])
    assert hint in capsys.readouterr().err  # so does the site that failed

    # site-01 alone, started again while the aggregator has exited: it says so at once, and stops at its timeout
    t0, again = time.monotonic(), {}
    lone = _start("site-01", _site(replace(cfg, timeout=5.0), keys_file, private, "site-01"), again)
    said = ""

    def told() -> bool:
        nonlocal said
        said += capsys.readouterr().err
        return "run 'dpneuro' was stopped" in said

    _wait_for(told, 4.0, "the site started again did not say at once that the run was stopped")
    assert "site 'site-03' stopped with an error at 20" in said and "the site's disk went away" in said, said
    assert "the aggregator stopped at 20" in said and "because site 'site-03' stopped with an error" in said, said
    assert hint in said and "Site 'site-01' takes part again and waits for the others (up to 5 s" in said, said
    _join([lone])
    assert time.monotonic() - t0 < 30 and isinstance(again["site-01"], SiteTimeout), again

    # every party started again with the same run id, the aggregator first and the failed site last: it completes
    out.clear()
    threads = [_start("aggregator", _aggregator(cfg, keys_file, private), out)]
    time.sleep(1.0)  # the aggregator waits for the sites, rather than stopping on their old notices
    threads += [_start(n, _site(cfg, keys_file, private, n), out) for n in ("site-01", "site-02", "site-04")]
    time.sleep(1.0)
    assert not out, out
    threads.append(_start("site-03", _site(cfg, keys_file, private, "site-03"), out))
    _join(threads)
    assert all(isinstance(r, dict) for r in out.values()) and len(out) == 5, out
    for s in cfg.sites:
        _released_once(cfg, s.name)
