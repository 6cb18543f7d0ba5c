"""The shared folder's transport against someone who can write to it: replays from another run, planted symlinks and
special files, shared or exposed keys.

Each test plays one attack of the security review; each failed on the code before the fix.
"""

from __future__ import annotations

import json
import os
import shutil
import threading

import deploy_common as dc
import numpy as np
import pytest

from dpneuro.cli import main
from dpneuro.config import ConfigError
from dpneuro.deploy import sharedfs
from dpneuro.deploy.party import run_manifest
from dpneuro.protocol.exchange import (
    CoinstacExchange,
    DirectoryExchange,
    ExchangeError,
    MessageRejected,
    PartyFailed,
    Payload,
    codec,
    directory,
)
from dpneuro.protocol.exchange.keys import (
    KeyFileError,
    PartyKeys,
    generate_key,
    load_private_key,
    read_public_keys,
    write_public_keys,
)

SITES = ["site-01", "site-02", "site-03"]
KEY = b"k" * 32
PLANTED = "planted in the shared folder"


@pytest.fixture
def keys(tmp_path):
    keys_file, private = dc.party_keys(tmp_path / "keys", SITES)
    public = read_public_keys(keys_file)
    return {p: PartyKeys(p, load_private_key(path), public, SITES) for p, path in private.items()}


def _binding(run_id: str, **config) -> str:
    return codec.run_binding(run_id, {"run_id": run_id, "config": {"pca_epsilon": 20.0, **config}})


# -- 1. every signature binds the run ---------------------------------------------------------------------------

def test_the_binding_is_the_run_id_and_the_manifests_digest():
    b = _binding("r1")
    assert b.startswith("r1:") and len(b) == len("r1:") + 64
    assert _binding("r1") == codec.run_binding("r1", {"config": {"pca_epsilon": 20}, "run_id": "r1"})  # 20 is 20.0
    assert _binding("r2") != b and _binding("r1", pca_epsilon=10.0) != b


def test_a_message_bound_to_another_run_is_refused_as_replayed(tmp_path, keys):
    r1, r2 = _binding("r1"), _binding("r2")
    blob = codec.encode_payload(Payload({"A": np.ones(3)}), run_id="unmix", sender=-1, round=4, topic="update",
                                key=keys["aggregator"], binding=r1)
    addr = dict(run_id="unmix", sender=-1, round=4, topic="update", key=keys["site-01"])
    np.testing.assert_array_equal(codec.decode_payload(blob, **addr, binding=r1).arrays["A"], np.ones(3))
    with pytest.raises(MessageRejected, match=rf"replayed from another run or manifest: it was written for "
                                              rf"{r1[:15]}, this run is {r2[:15]}"):
        codec.decode_payload(blob, **addr, binding=r2)
    with pytest.raises(MessageRejected, match="replayed from another run or manifest"):
        codec.decode_payload(blob, **addr)  # an unbound reader
    # and through the exchange: a site of run r1 writes, the aggregator of run r2 reads the same address
    site = DirectoryExchange(tmp_path, 3, run_id="reduce", key=keys["site-02"], site_names=SITES, binding=r1)
    agg = DirectoryExchange(tmp_path, 3, run_id="reduce", key=keys["aggregator"], site_names=SITES, binding=r2)
    site.send(1, 0, "release", Payload({"A": np.ones(2)}))
    with pytest.raises(MessageRejected, match=r"from site 'site-02'.*replayed from another run or manifest"):
        agg.gather(0, "release", [1], timeout=5)


def test_a_failure_notice_from_another_run_does_not_say_its_party_failed_here(tmp_path, keys):
    r1, r2 = _binding("r1"), _binding("r2")
    directory.write_failure_notice(tmp_path, "site-02", "out of memory", keys["site-02"], binding=r1)
    with pytest.raises(PartyFailed, match="site 'site-02' stopped with an error: out of memory"):
        directory.check_failure_notices(tmp_path, "aggregator", keys["aggregator"], binding=r1)
    with pytest.raises(PartyFailed, match=rf"failure notice of site 'site-02' replayed from another run or manifest "
                                          rf".*written for {r1[:15]}, this run is {r2[:15]}.*does not say") as err:
        directory.check_failure_notices(tmp_path, "aggregator", keys["aggregator"], binding=r2)
    assert "stopped with an error" not in str(err.value)


def test_a_coinstac_message_from_another_run_is_refused_as_replayed(tmp_path):
    r1, r2 = _binding("coinstac"), _binding("coinstac", pca_epsilon=10.0)
    site = CoinstacExchange(run_id="reduce", key=KEY, n_sites=1, base_dir=tmp_path / "s-base",
                            transfer_dir=tmp_path / "s-out", state_dir=tmp_path / "s-state", site=0, binding=r1)
    site.send(0, 0, "release", Payload({"A": np.ones(2)}))
    shutil.copytree(tmp_path / "s-out", tmp_path / "r-base" / "c0")  # what COINSTAC delivers to the remote

    def remote(binding):
        return CoinstacExchange(run_id="reduce", key=KEY, n_sites=1, base_dir=tmp_path / "r-base",
                                transfer_dir=tmp_path / "r-out", state_dir=tmp_path / "r-state", site_dirs=["c0"],
                                binding=binding)

    assert remote(r1).gather(0, "release", [0])[0].arrays["A"].tolist() == [1.0, 1.0]
    with pytest.raises(MessageRejected, match="replayed from another run or manifest"):
        remote(r2).gather(0, "release", [0])


def test_an_aggregator_broadcast_copied_from_another_run_is_refused_as_replayed(tmp_path):
    """Run r1 ends; run r2 of the same consortium (same keys, same settings) starts, and someone copies r1's
    broadcasts into r2's folder before r2's aggregator writes its own: r2's site refuses the first it reads."""
    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), ica="spatial", timeout=30)
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    out: dict = {}
    for t in dc.start_parties(cfg, keys_file, private, out, "r1"):
        t.join(timeout=110)
    assert isinstance(out["aggregator"], dict), out["aggregator"]
    r1, r2 = tmp_path / "shared" / "r1", tmp_path / "shared" / "r2"
    r2.mkdir()
    (r2 / "manifest.json").write_text(json.dumps(run_manifest(cfg.resolved(), "r2"), indent=1, sort_keys=True))
    copied = 0
    for msg in r1.rglob("aggregator.msg"):
        (r2 / msg.relative_to(r1)).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(msg, r2 / msg.relative_to(r1))
        copied += 1
    assert copied
    with pytest.raises(MessageRejected, match=r"from aggregator, round .*replayed from another run or manifest: it was "
                                              r"written for r1:[0-9a-f]{12}, this run is r2:[0-9a-f]{12}"):
        sharedfs.site_main(cfg, "site-01", run_id="r2", key_file=private["site-01"], keys_file=keys_file)


# -- 2. the shared folder holds nothing a party follows ------------------------------------------------------------

@pytest.fixture
def victim(tmp_path):
    """A file of the party's own, outside the shared folder, that a planted symlink points to."""
    path = tmp_path / "victim.txt"
    path.write_text("precious")
    os.utime(path, (1e9, 1e9))
    return path


def _untouched(path) -> bool:
    return path.read_text() == "precious" and path.stat().st_mtime == 1e9


def test_a_symlink_at_the_reserved_notice_path_is_refused_and_its_target_untouched(tmp_path, victim):
    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), timeout=3)
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    reserved = directory._reserve_path(tmp_path / "shared" / "dpneuro", "site-01")
    reserved.parent.mkdir(parents=True)
    reserved.symlink_to(victim)
    with pytest.raises(ExchangeError, match=rf"{reserved.name} is a symlink, {PLANTED}"):
        sharedfs.site_main(cfg, "site-01", key_file=private["site-01"], keys_file=keys_file)
    with pytest.raises(ExchangeError, match=rf"{reserved.name} is a symlink, {PLANTED}"):
        directory.write_failure_notice(tmp_path / "shared" / "dpneuro", "site-01", "out of memory")
    assert _untouched(victim)


def test_a_symlink_at_a_message_path_is_refused_by_reader_and_writer(tmp_path, victim):
    shared = tmp_path / "shared"
    agg = DirectoryExchange(shared, 2, run_id="run", key=KEY)
    site = DirectoryExchange(shared, 2, run_id="run", key=KEY)
    path = agg.message_path(0, 0, "release")
    path.parent.mkdir(parents=True)
    path.symlink_to(victim)
    with pytest.raises(ExchangeError, match=rf"site-000.msg is a symlink, {PLANTED}"):
        agg.gather(0, "release", [0], timeout=5)
    with pytest.raises(ExchangeError, match=rf"site-000.msg is a symlink, {PLANTED}"):
        site.send(0, 0, "release", Payload({"A": np.ones(2)}))
    assert _untouched(victim)


@pytest.mark.parametrize("where", ["egress/site-000.jsonl", "alive/site-000"])
def test_a_symlink_at_a_sites_log_or_heartbeat_is_refused_and_its_target_untouched(tmp_path, victim, where):
    ex = DirectoryExchange(tmp_path / "shared", 1, run_id="run", key=KEY)
    (tmp_path / "shared" / "run" / where).symlink_to(victim)
    with pytest.raises(ExchangeError, match=rf"{where.split('/')[1]} is a symlink, {PLANTED}"):
        ex.send(0, 0, "release", Payload({"A": np.ones(2)}))
    with pytest.raises(ExchangeError, match=PLANTED):  # and when it is read or touched again
        if where.startswith("alive"):
            ex.heartbeat(0)
        else:
            ex.egress_log(0)
    assert _untouched(victim)


def test_a_folder_swapped_for_a_symlink_is_refused_and_nothing_lands_behind_it(tmp_path):
    ex = DirectoryExchange(tmp_path / "shared", 1, run_id="run", key=KEY)
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "shared" / "run" / "round-000000").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ExchangeError, match=rf"round-000000 is a symlink, {PLANTED}"):
        ex.send(0, 0, "release", Payload({"A": np.ones(2)}))
    assert not list(outside.iterdir())
    # and the run folder itself, below the shared folder's root
    shutil.rmtree(tmp_path / "shared" / "run")
    (tmp_path / "shared" / "run").symlink_to(outside, target_is_directory=True)
    with pytest.raises(ExchangeError, match=rf"run is a symlink, {PLANTED}"):
        DirectoryExchange(tmp_path / "shared", 1, run_id="run", key=KEY)
    assert not list(outside.iterdir())


def test_a_fifo_planted_at_a_message_path_is_refused_without_hanging(tmp_path):
    agg = DirectoryExchange(tmp_path / "shared", 1, run_id="run", key=KEY)
    path = agg.message_path(0, 0, "release")
    path.parent.mkdir(parents=True)
    os.mkfifo(path)
    out: dict = {}

    def gather():
        try:
            agg.gather(0, "release", [0], timeout=5)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out["error"] = exc

    t = threading.Thread(target=gather, daemon=True)
    t.start()
    t.join(timeout=10)
    assert not t.is_alive(), "a reader blocked on a planted FIFO"
    assert isinstance(out["error"], ExchangeError) and "a FIFO, not a regular file" in str(out["error"])


def test_private_files_inside_the_shared_folder_are_refused_at_start(tmp_path):
    man = dc.consortium(tmp_path / "data")
    shared = tmp_path / "shared"
    keys_file, private = dc.party_keys(tmp_path / "keys", [s["site"] for s in man["sites"]])
    cfg = dc.run_config(man, shared / "out", exchange_dir=str(shared), timeout=3)
    with pytest.raises(ConfigError, match=r"config field 'out' .* is inside config field 'exchange_dir'"):
        sharedfs.aggregator_main(cfg, key_file=private["aggregator"], keys_file=keys_file)
    assert not (shared / "out").exists()
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(shared), timeout=3)
    exposed = shared / "keys" / "site-01.key"
    exposed.parent.mkdir(parents=True)
    shutil.copy2(private["site-01"], exposed)
    with pytest.raises(ConfigError, match=r"--key-file .*site-01.key is inside config field 'exchange_dir'"):
        sharedfs.site_main(cfg, "site-01", key_file=exposed, keys_file=keys_file)


# -- 3. keys ----------------------------------------------------------------------------------------------------

def test_two_parties_with_one_public_key_are_refused_naming_both(tmp_path):
    keys_file, private = dc.party_keys(tmp_path, SITES)
    public = read_public_keys(keys_file)
    public["site-02"] = public["site-01"]
    with pytest.raises(KeyFileError, match=r"'site-01' and 'site-02' have the same public key"):
        read_public_keys(write_public_keys(tmp_path / "shared.keys", public))
    with pytest.raises(KeyFileError, match=r"'site-01' and 'site-02' have the same public key"):
        PartyKeys("site-01", load_private_key(private["site-01"]), public, SITES)


@pytest.mark.skipif(os.name != "posix", reason="file permissions as ssh reads them")
def test_a_private_key_others_may_read_or_write_is_refused(tmp_path, capsys):
    path = tmp_path / "site-01.key"
    assert main(["keygen", str(path), "--party", "site-01"]) == 0
    assert path.stat().st_mode & 0o777 == 0o600
    load_private_key(path)
    for mode in (0o640, 0o604, 0o620, 0o602, 0o644):
        path.chmod(mode)
        with pytest.raises(KeyFileError, match=rf"site-01.key: its permissions {mode:04o} .*chmod 600"):
            load_private_key(path)
    path.chmod(0o400)  # read-only for its owner is fine
    load_private_key(path)
    _, private = dc.party_keys(tmp_path / "consortium", SITES)  # the tests' keys are made 0600 too
    assert all(p.stat().st_mode & 0o777 == 0o600 for p in private.values())
    generate_key(tmp_path / "more.key")
    assert (tmp_path / "more.key").stat().st_mode & 0o777 == 0o600

