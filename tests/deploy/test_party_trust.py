"""No party writes as another; the aggregator refuses bad releases by name; faults end with every party told.

Each test plays one attack or fault from the threat model (docs/privacy.md, "Threat model").
"""

from __future__ import annotations

import errno
import json
import struct
import time

import deploy_common as dc
import numpy as np
import pytest
from cape_toys import Zeros

from dpneuro.config import ConfigError
from dpneuro.deploy import sharedfs
from dpneuro.protocol.cape import cape_protocol
from dpneuro.protocol.driver import Phase, RunOptions
from dpneuro.protocol.exchange import DirectoryExchange, InProcessExchange, MessageRejected, PartyFailed, Payload, codec
from dpneuro.protocol.exchange.directory import check_failure_notices, write_failure_notice
from dpneuro.protocol.exchange.keys import KeyFileError, PartyKeys, load_private_key, read_public_keys
from dpneuro.protocol.simulation import simulate

SITES = ["site-01", "site-02", "site-03"]


@pytest.fixture
def keys(tmp_path):
    keys_file, private = dc.party_keys(tmp_path / "keys", SITES)
    public = read_public_keys(keys_file)
    return {p: PartyKeys(p, load_private_key(path), public, SITES) for p, path in private.items()}


def _exchange(root, keys, party):
    return DirectoryExchange(root, 3, run_id="run", key=keys[party], site_names=SITES)


def test_a_site_cannot_sign_as_another(tmp_path, keys):
    ex = _exchange(tmp_path, keys, "site-01")
    with pytest.raises(PermissionError, match="site-01 holds only its own key and cannot write as site-02"):
        ex.send(1, 0, "release", Payload({"A": np.zeros(2)}))
    with pytest.raises(PermissionError, match="cannot write as aggregator"):
        ex.broadcast(0, "release", Payload({"A": np.zeros(2)}))


def _forge(keys, signer, sender, payload, *, round=0, topic="release"):
    """What a party can write with its own key for another's address: the body as the codec lays it out, signed."""
    honest = codec.encode_payload(payload, run_id="run", sender=sender, round=round, topic=topic,
                                  key=keys[SITES[sender] if sender >= 0 else "aggregator"])
    body = honest[:-64]
    return body + keys[signer].sign_named(body)


def test_a_release_written_as_another_site_is_rejected_naming_it(tmp_path, keys):
    """site-01 writes a 'site-02' release (its own data, signed with its own key) where site-02's would go."""
    agg = _exchange(tmp_path, keys, "aggregator")
    path = agg.message_path(1, 0, "release")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(_forge(keys, "site-01", 1, Payload({"A": np.ones(3)})))
    with pytest.raises(MessageRejected, match=r"site 'site-02'.*not written by the party it claims"):
        agg.gather(0, "release", [1], timeout=5)
    # and the broadcast a site forges as the aggregator, e.g. a noise plan
    site = _exchange(tmp_path, keys, "site-03")
    bpath = site.message_path(-1, 0, "cape-setup")
    bpath.parent.mkdir(parents=True, exist_ok=True)
    bpath.write_bytes(_forge(keys, "site-01", -1, Payload({"cape/g_var/A": np.full(3, 1e-16)}), topic="cape-setup"))
    with pytest.raises(MessageRejected, match="aggregator.*not written by the party it claims"):
        site.receive(2, 0, "cape-setup", timeout=5)


def test_a_message_tagged_with_a_shared_key_is_rejected_in_a_signed_run(tmp_path, keys):
    agg = _exchange(tmp_path, keys, "aggregator")
    blob = codec.encode_payload(Payload({"A": np.ones(3)}), run_id="run", sender=0, round=0, topic="release",
                                key=b"k" * 32)
    assert struct.unpack_from("<4sHI", blob)[1] == codec.VERSION
    path = agg.message_path(0, 0, "release")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(blob)
    with pytest.raises(MessageRejected, match="not signed by its sender's own key"):
        agg.gather(0, "release", [0], timeout=5)


def test_a_key_file_that_does_not_match_the_pinned_key_is_refused(tmp_path, keys):
    keys_file, private = dc.party_keys(tmp_path / "other", SITES)
    with pytest.raises(KeyFileError, match="does not match the public key the consortium pinned for 'site-01'"):
        PartyKeys("site-01", load_private_key(private["site-01"]),
                  read_public_keys(tmp_path / "keys" / "consortium.keys"), SITES)
    with pytest.raises(KeyFileError, match=r"no entry for \['site-03'\]"):
        PartyKeys("site-01", load_private_key(private["site-01"]),
                  {k: v for k, v in read_public_keys(keys_file).items() if k != "site-03"}, SITES)


def test_a_forged_failure_notice_is_not_taken_as_its_partys(tmp_path, keys):
    write_failure_notice(tmp_path, "site-02", "out of memory", keys["site-02"])
    with pytest.raises(PartyFailed, match="site 'site-02' stopped with an error: out of memory"):
        check_failure_notices(tmp_path, "aggregator", keys["aggregator"])
    (tmp_path / "failed").rename(tmp_path / "old")
    write_failure_notice(tmp_path, "site-02", "aborting", keys["site-01"].__class__(
        "site-01", keys["site-01"]._private, {p: keys["site-01"]._hex[p] for p in keys["site-01"]._hex}, SITES))
    with pytest.raises(PartyFailed, match="not signed by site 'site-02'"):
        check_failure_notices(tmp_path, "aggregator", keys["aggregator"])


def test_a_production_run_without_pinned_keys_is_refused(tmp_path):
    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), seed=None, simulation=False)
    with pytest.raises(ConfigError, match="keys file"):
        sharedfs.aggregator_main(cfg)
    assert not list((tmp_path / "shared").rglob("*.msg"))


# -- the aggregator refuses bad releases, naming the site ----------------------------------------------

def _corrupting(proto, site, corrupt):
    rel = proto._round[-1]

    def site_step(state, rnd, incoming):
        out = rel.site(state, rnd, incoming)
        if state["site"] == site:
            out = Payload({k: corrupt(v) for k, v in out.arrays.items()}, out.meta, out.carries)
        return out

    proto._round[-1] = Phase(rel.topic, site_step, rel.aggregator, rel.site_spec, rel.broadcast_spec,
                             rel.allow_dropout)
    return proto


def _nan(a):
    a = np.array(a)
    a[0] = np.nan
    return a


@pytest.mark.parametrize("corrupt, why", [
    (_nan, "NaN or infinite"),
    (lambda a: np.zeros(7), r"shape \(7,\), expected \(50,\)"),
    (lambda a: a * 1e6, "exceeds the public bound"),
    (lambda a: a.astype(np.int64), "dtype int64"),
])
def test_the_aggregator_refuses_a_bad_release_naming_the_site(corrupt, why):
    class Bounded(Zeros):
        def site_releases(self, state):
            (name, spec), = super().site_releases(state).items()
            from dataclasses import replace
            return {name: replace(spec, bound=1.0)}

    proto = _corrupting(cape_protocol(Bounded(shape=(50,)), "cape", n_sites=3), 1, corrupt)
    with pytest.raises(MessageRejected, match=rf"from site 'site-02'.*{why}"):
        simulate(proto, [10] * 3, exchange=InProcessExchange(3, site_names=SITES),
                 options=RunOptions(timeout=10))


def test_honest_releases_stay_inside_their_bound():
    """1,000 honest releases of the declared noise (and a statistic at its bound) pass the norm check: the tail
    bound is e^-50 per release, so a false refusal never happens in practice."""
    from dpneuro.protocol.cape.phases import release_problem

    rng = np.random.default_rng(0)
    spec = {"shape": [40, 40], "symmetric": True, "bound": 1.0}
    from dpneuro.protocol.cape.packing import noise_array

    for _ in range(1000):
        f = np.eye(40) / np.sqrt(40)  # ||f||_F = 1
        noise = noise_array(rng.normal(0, 0.3, 820), (40, 40), True)
        assert release_problem(f + noise, spec, 0.09) is None
    assert release_problem(f + noise * 50, spec, 0.09) is not None


# -- faults: a full disk, a read-only output folder ----------------------------------------------------

def test_a_full_disk_at_a_site_stops_every_party_naming_it(tmp_path, monkeypatch):
    from dpneuro.protocol.exchange import directory

    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), ica="spatial", timeout=120)
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    real = directory.publish_once

    def full(path, blob, **kw):  # site-01's disk fills up when it first sends
        if path.name == "site-01.msg":
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, blob, **kw)

    monkeypatch.setattr(directory, "publish_once", full)
    out: dict = {}
    t0 = time.monotonic()
    for t in dc.start_parties(cfg, keys_file, private, out):
        t.join(timeout=110)
    assert time.monotonic() - t0 < 100  # told at once, not at the 120 s timeout
    assert isinstance(out["site-01"], OSError) and "is full" in str(out["site-01"])
    assert isinstance(out["aggregator"], PartyFailed)
    assert "site 'site-01' stopped with an error: the disk holding" in str(out["aggregator"])
    notice = json.loads(next((tmp_path / "shared" / "dpneuro" / "failed").glob("site-01-*.json")).read_text())
    assert notice["signature"] and "full" in notice["error"]


def test_a_notice_fits_in_its_reserved_space_when_the_disk_is_full(tmp_path, keys):
    """The notice overwrites bytes reserved at start: a file system with no block left still takes it. Checked on
    a 1 MB tmpfs filled to the last byte where this machine allows mounting one."""
    import shutil
    import subprocess

    from dpneuro.protocol.exchange.directory import reserve_failure_notice

    mnt = tmp_path / "tiny"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True).returncode:
        pytest.skip("cannot mount a tmpfs here")
    try:
        reserve_failure_notice(mnt, "site-02")
        with pytest.raises(OSError):
            with open(mnt / "filler", "wb", buffering=0) as f:
                while True:
                    f.write(b"x" * 4096)
        assert shutil.disk_usage(mnt).free < 4096
        write_failure_notice(mnt, "site-02", "the disk is full", keys["site-02"])
        with pytest.raises(PartyFailed, match="site 'site-02' stopped with an error: the disk is full"):
            check_failure_notices(mnt, "aggregator", keys["aggregator"])
    finally:
        subprocess.run(["umount", str(mnt)], capture_output=True)


def test_an_unwritable_output_folder_is_refused_before_anything_is_written(tmp_path):
    man = dc.consortium(tmp_path / "data")
    (tmp_path / "out").write_text("a file where the output folder should be")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"))
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])
    with pytest.raises(ConfigError, match="the aggregator's output folder .* cannot be written"):
        sharedfs.aggregator_main(cfg, key_file=private["aggregator"], keys_file=keys_file)
    assert not (tmp_path / "shared" / "dpneuro" / "manifest.json").exists()
    notices = list((tmp_path / "shared" / "dpneuro" / "failed").glob("*.json"))
    assert len(notices) == 1 and "cannot be written" in notices[0].read_text()


# -- operators: what a deployed party says, and what a stopped site keeps --------------------------------

def test_a_waiting_party_says_whom_it_waits_for(tmp_path, keys):
    told = []
    site = DirectoryExchange(tmp_path, 3, run_id="run", key=keys["site-02"], site_names=SITES, notify=told.append,
                             notify_interval=0.05)
    with pytest.raises(Exception, match="the aggregator did not broadcast"):
        site.receive(1, 3, "release", timeout=0.3)
    assert told and all("site-02: waiting" in t and "the aggregator's broadcast" in t and "round 3" in t
                        for t in told)
    told.clear()
    agg = DirectoryExchange(tmp_path, 3, run_id="run", key=keys["aggregator"], site_names=SITES,
                            notify=told.append, notify_interval=0.05)
    with pytest.raises(Exception, match="did not send"):
        agg.gather(0, "release", [0, 2], timeout=0.3)
    assert told and "aggregator: waiting" in told[-1] and "site 'site-01', site 'site-03'" in told[-1]


def test_a_site_stopped_in_its_own_maps_keeps_the_consortiums_outputs(tmp_path, monkeypatch):
    """The consortium's maps and the site's privacy.json are written as soon as the protocol ends; a site
    stopped while it computes its own time courses and voxel maps (minutes at 2 mm) still has them."""
    from dpneuro.deploy import party

    man = dc.consortium(tmp_path / "data")
    cfg = dc.run_config(man, tmp_path / "out", exchange_dir=str(tmp_path / "shared"), ica="spatial", timeout=120)
    keys_file, private = dc.party_keys(tmp_path / "keys", [s.name for s in cfg.sites])

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(party, "write_site_outputs", stopped)
    out: dict = {}
    for t in dc.start_parties(cfg, keys_file, private, out):
        t.join(timeout=110)
    assert isinstance(out["aggregator"], dict)  # the consortium's run completed
    for s in cfg.sites:
        assert isinstance(out[s.name], KeyboardInterrupt)
        own = tmp_path / "out" / "dpneuro" / s.name
        assert (own / "components.nii.gz").is_file() and (own / "privacy.json").is_file()
        assert not (own / "report.html").exists()


def test_coinstac_parties_sign_with_their_own_keys_and_check_the_manifests_pin(tmp_path):
    from dpneuro.deploy import coinstac as dcc
    from dpneuro.protocol.exchange import CoinstacExchange
    from dpneuro.protocol.exchange.keys import public_hex

    mine, other = dcc._signing_key(tmp_path / "a"), dcc._signing_key(tmp_path / "b")
    assert public_hex(dcc._signing_key(tmp_path / "a")) == public_hex(mine)  # kept for the run
    agg, third = dcc._signing_key(tmp_path / "c"), dcc._signing_key(tmp_path / "d")  # every party its own key
    manifest = {"sites": SITES, "public_keys": {"aggregator": public_hex(agg), "site-01": public_hex(other),
                                                "site-02": public_hex(mine), "site-03": public_hex(third)}}
    with pytest.raises(ConfigError, match="pins another public key for 'site-01'"):
        dcc._party_keys(manifest, "site-01", mine)
    keys = dcc._party_keys(manifest, "site-02", mine)
    ex = CoinstacExchange(run_id="reduce", key=keys, n_sites=3, base_dir=tmp_path / "base",
                          transfer_dir=tmp_path / "transfer", state_dir=tmp_path / "state", site=1)
    with pytest.raises(PermissionError, match="cannot write as site-01"):
        ex.send(0, 0, "release", Payload({"A": np.zeros(2)}))
    ex.send(1, 0, "release", Payload({"A": np.zeros(2)}))


def test_the_estimators_deployed_roles_take_the_partys_keys(tmp_path, monkeypatch):
    """DecentralizedICA(role="aggregator", key_file=..., keys=...) hands both to the party, as the CLI does."""
    from dpneuro import estimators

    seen = {}

    def fake_aggregator(cfg, **kw):
        seen.update(kw)
        raise RuntimeError("stop here")

    monkeypatch.setattr(estimators, "aggregator_main", fake_aggregator)
    man = dc.consortium(tmp_path / "data")
    ica = estimators.DecentralizedICA(4, role="aggregator", exchange_dir=str(tmp_path / "x"), out=str(tmp_path / "o"),
                                      key_file="agg.key", keys="consortium.keys", space="grid30", parcels=60,
                                      simulation=True, random_state=1)
    with pytest.raises(RuntimeError, match="stop here"):
        ica.fit({s["site"]: None for s in man["sites"]})
    assert seen["key_file"] == "agg.key" and seen["keys_file"] == "consortium.keys"
