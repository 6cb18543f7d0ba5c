"""Tests for the exchange layer: codec, in-process and directory backends, checkpoints."""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import shutil
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dpneuro.protocol.driver import RunOptions, run_aggregator
from dpneuro.protocol.exchange import (
    AGGREGATOR,
    ArraySpec,
    DirectoryCheckpoint,
    DirectoryExchange,
    ExchangeError,
    InProcessExchange,
    MessageRejected,
    MessageSpec,
    Payload,
    SiteTimeout,
)
from dpneuro.protocol.exchange.codec import (
    ALLOWED_DTYPES,
    decode_payload,
    decode_state,
    encode_payload,
    encode_state,
    load_state_file,
    register_state_type,
    save_state_file,
)
from dpneuro.protocol.simulation import simulate

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import exchange_workers as ew  # noqa: E402

KEY = bytes(range(32))
ADDR = dict(run_id="run1", sender=2, round=3, topic="grad")
WHERE = "site 2, round 3, topic 'grad'"
DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float32", "float64"]
WORKER = str(Path(ew.__file__).resolve())
DEADLINE = 60.0  # hard ceiling for any subprocess test step


def _payload() -> Payload:
    return Payload(
        arrays={"g": np.arange(12, dtype=np.float64).reshape(3, 4), "b": np.array([1.5, -2.0], np.float32),
                "k": np.array(7, np.int64)},
        meta={"lr": 0.25, "names": ["a", "b"], "ok": True},
        carries={"g": "cape-noise", "b": "cape-noise", "k": "public"},
    )


def _blob(payload: Payload | None = None, **addr) -> bytes:
    return encode_payload(payload or _payload(), **{**ADDR, **addr}, key=KEY)


def _decode(blob: bytes, **kw) -> Payload:
    return decode_payload(blob, **{**ADDR, "key": KEY, **kw})


def _random_array(dtype: str, shape: tuple, rng: np.random.Generator) -> np.ndarray:
    dt = np.dtype(dtype)
    if dt.kind == "b":
        return rng.integers(0, 2, size=shape).astype(bool)
    if dt.kind in "iu":
        info = np.iinfo(dt)
        return rng.integers(info.min, info.max, size=shape, dtype=dt, endpoint=True)
    return rng.standard_normal(size=shape).astype(dt)


# ---------------------------------------------------------------------------
# codec: messages
# ---------------------------------------------------------------------------

def test_allowed_dtypes_are_exactly_the_documented_ones():
    assert ALLOWED_DTYPES == {np.dtype(d).newbyteorder("<").str for d in DTYPES}


@pytest.mark.parametrize("dtype", DTYPES)
def test_roundtrip_every_dtype_and_shape(dtype):
    rng = np.random.default_rng(0)
    shapes = {"scalar": (), "empty": (0,), "empty2": (3, 0), "vec": (5,), "cube": (2, 3, 4)}
    arrays = {name: _random_array(dtype, shape, rng) for name, shape in shapes.items()}
    payload = Payload(arrays, meta={"n": 1}, carries={"vec": "public"})
    out = _decode(_blob(payload))
    assert list(out.arrays) == list(arrays)
    for name, a in arrays.items():
        b = out.arrays[name]
        assert b.dtype == a.dtype and b.shape == a.shape, name
        np.testing.assert_array_equal(b, a)
    assert out.meta == {"n": 1} and out.carries == {"vec": "public"}


def test_roundtrip_big_endian_noncontiguous_and_copies():
    base = np.arange(24, dtype=">f8").reshape(4, 6)
    payload = Payload({"t": base.T, "s": base[::2, 1::3], "i": np.array([1, 2], dtype=">u2")})
    out = _decode(_blob(payload))
    np.testing.assert_array_equal(out.arrays["t"], base.T)
    np.testing.assert_array_equal(out.arrays["s"], base[::2, 1::3])
    assert out.arrays["t"].dtype == np.float64 and out.arrays["i"].dtype == np.uint16
    out.arrays["t"][0, 0] = 99.0  # decoded arrays are fresh, writable copies
    assert base[0, 0] == 0.0


def test_encoding_is_deterministic_and_meta_is_json():
    p = Payload({"a": np.ones(3)}, meta={"b": 1, "a": np.int64(2), "v": np.array([1.0, 2.0]), "t": (1, 2)})
    assert _blob(p) == _blob(p)
    assert _decode(_blob(p)).meta == {"a": 2, "b": 1, "v": [1.0, 2.0], "t": [1, 2]}


@pytest.mark.parametrize("arr", [np.ones(2, np.float16), np.ones(2, np.complex128), np.array(["x"]),
                                 np.array([object()], dtype=object)])
def test_encode_refuses_unsupported_dtypes(arr):
    with pytest.raises(ValueError, match="unsupported dtype"):
        _blob(Payload({"a": arr}))


def test_every_tampered_byte_is_rejected():
    blob = _blob()
    for i in range(len(blob)):
        bad = bytearray(blob)
        bad[i] ^= 0x01
        with pytest.raises(MessageRejected) as err:
            _decode(bytes(bad))
        assert WHERE in str(err.value), i


def test_wrong_key_is_rejected():
    with pytest.raises(MessageRejected, match="authentication failed"):
        _decode(_blob(), key=b"x" * 32)


@pytest.mark.parametrize("field,value", [("round", 4), ("sender", 1), ("sender", AGGREGATOR),
                                         ("topic", "other"), ("run_id", "run2")])
def test_replayed_or_misplaced_message_is_rejected(field, value):
    with pytest.raises(MessageRejected, match="address mismatch") as err:
        _decode(_blob(), **{field: value})
    assert "replayed" in str(err.value)


def test_truncated_and_malformed_messages_are_rejected():
    blob = _blob()
    for cut in [0, 1, 4, 9, 10, 41, 42, len(blob) // 2, len(blob) - 33, len(blob) - 1]:
        with pytest.raises(MessageRejected, match=WHERE):
            _decode(blob[:cut])
    with pytest.raises(MessageRejected, match="bad magic"):
        _decode(b"PKZX" + blob[4:])
    with pytest.raises(MessageRejected, match="version"):
        _decode(blob[:4] + struct.pack("<H", 99) + blob[6:])
    with pytest.raises(MessageRejected, match="authentication"):
        _decode(blob + b"\0")


def test_oversized_messages_are_rejected():
    payload = Payload({"a": np.zeros(1000)})
    blob = _blob(payload)
    assert _decode(blob, max_bytes=8000).arrays["a"].shape == (1000,)
    with pytest.raises(MessageRejected, match="oversized: 8000 bytes"):
        _decode(blob, max_bytes=7999)
    big = _blob(Payload({"a": np.zeros(300_000, np.uint8)}))
    with pytest.raises(MessageRejected, match="oversized"):  # caught before the HMAC pass
        _decode(big, max_bytes=10)


def _forge(header: dict | bytes, data: bytes = b"", key: bytes = KEY) -> bytes:
    """A correctly authenticated message with arbitrary content: what a buggy peer could send."""
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    body = b"DPNX" + struct.pack("<HI", 1, len(h)) + h + data
    return body + hmac.new(key, body, hashlib.sha256).digest()


def _header(arrays: list, **kw) -> dict:
    return {"run_id": "run1", "sender": 2, "round": 3, "topic": "grad", "meta": {}, "carries": {},
            "arrays": arrays, **kw}


def test_forged_valid_message_decodes():
    out = _decode(_forge(_header([["a", "<f8", [2], 0, 16]]), np.array([1.0, 2.0]).tobytes()))
    np.testing.assert_array_equal(out.arrays["a"], [1.0, 2.0])


@pytest.mark.parametrize("arrays,data,match", [
    ([["a", "|O", [1], 0, 8]], b"\0" * 8, "forbidden dtype"),
    ([["a", "<U1", [2], 0, 8]], b"\0" * 8, "forbidden dtype"),
    ([["a", "<c16", [1], 0, 16]], b"\0" * 16, "forbidden dtype"),
    ([["a", "<f2", [4], 0, 8]], b"\0" * 8, "forbidden dtype"),
    ([["a", ">f8", [1], 0, 8]], b"\0" * 8, "forbidden dtype"),
    ([["a", "<f8", [2], 0, 8]], b"\0" * 8, "do not match shape"),
    ([["a", "<f8", [-1], 0, -8]], b"", "invalid shape"),
    ([["a", "<f8", [1.0], 0, 8]], b"\0" * 8, "invalid shape"),
    ([["a", "<f8", [1], 0, 8], ["b", "<f8", [1], 0, 8]], b"\0" * 16, "overlap"),
    ([["a", "<f8", [1], 8, 8]], b"\0" * 16, "overlap or gap"),
    ([["a", "<f8", [1], 0, 8]], b"\0" * 9, "manifest describes 8 bytes"),
    ([["a", "<f8", [2], 0, 16]], b"\0" * 8, "manifest describes 16 bytes"),
    ([["a", "<f8", [1], 0, 8], ["a", "<f8", [1], 8, 8]], b"\0" * 16, "duplicate"),
    ([["a", "<f8", [1], 0]], b"\0" * 8, "malformed manifest entry"),
])
def test_inconsistent_manifest_is_rejected(arrays, data, match):
    with pytest.raises(MessageRejected, match=match) as err:
        _decode(_forge(_header(arrays), data))
    assert WHERE in str(err.value)


@pytest.mark.parametrize("header,match", [
    (b"{not json", "malformed header"),
    (b"[1, 2]", "not a JSON object"),
    (json.dumps(_header([], meta=None)).encode(), "must be present"),
    (json.dumps(_header([], carries={"a": 1})).encode(), "carries"),
])
def test_malformed_authenticated_header_is_rejected(header, match):
    with pytest.raises(MessageRejected, match=match):
        _decode(_forge(header))


def test_header_length_out_of_range_is_rejected():
    body = b"DPNX" + struct.pack("<HI", 1, 10_000) + b"{}"
    with pytest.raises(MessageRejected, match="header length"):
        _decode(body + hmac.new(KEY, body, hashlib.sha256).digest())


@settings(max_examples=40, deadline=None)
@given(
    arrays=st.dictionaries(
        st.text(min_size=1, max_size=8),
        st.sampled_from(DTYPES).flatmap(lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3,
                                                                                   min_side=0, max_side=4))),
        max_size=4),
    meta=st.dictionaries(st.text(max_size=5), st.one_of(st.integers(), st.text(max_size=5), st.booleans(),
                                                        st.floats(allow_nan=False)), max_size=4),
)
def test_roundtrip_property(arrays, meta):
    out = _decode(_blob(Payload(arrays, meta=meta)))
    assert out.meta == meta and list(out.arrays) == list(arrays)
    for name, a in arrays.items():
        assert out.arrays[name].dtype == a.dtype and out.arrays[name].shape == a.shape
        np.testing.assert_array_equal(out.arrays[name], a)


# ---------------------------------------------------------------------------
# codec: checkpoint state
# ---------------------------------------------------------------------------

@register_state_type
class _Ledger:
    def __init__(self, entries):
        self.entries = list(entries)

    def to_dict(self):
        return {"entries": self.entries}

    @classmethod
    def from_dict(cls, d):
        return cls(d["entries"])


class _Unregistered:
    pass


def _assert_same(a, b, path="state"):
    assert type(a) is type(b), path
    if isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, path
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, np.generic):
        assert a.dtype == b.dtype and (a == b or (a != a and b != b)), path
    elif isinstance(a, dict):
        assert list(a) == list(b), path
        for k in a:
            _assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            _assert_same(x, y, f"{path}[{i}]")
    elif isinstance(a, Payload):
        _assert_same(dict(a.arrays), dict(b.arrays), path + ".arrays")
        _assert_same(dict(a.meta), dict(b.meta), path + ".meta")
        _assert_same(dict(a.carries), dict(b.carries), path + ".carries")
    elif isinstance(a, float) and a != a:
        assert b != b, path
    else:
        assert a == b, path


def _rich_state() -> dict:
    return {
        "_data": np.ones((1000, 10)),  # transient: never stored
        "_cache": object(),
        "W": np.eye(3, dtype=np.float32),
        "zero_d": np.array(2.5),
        "empty": np.zeros((0, 3), np.int16),
        "scalars": [np.float64(1.25), np.int32(-7), np.bool_(True), np.uint64(2**64 - 1), np.float32(np.nan)],
        "plain": {"none": None, "t": True, "f": False, "big": 2**200, "neg": -3, "x": 0.1, "inf": float("inf"),
                  "nan": float("nan"), "s": "héllo"},
        "by_site": {0: (1, 2.0), 3: ("a", [np.arange(3)])},
        "tuple_keys": {(1, "a"): "v"},
        "nested": {"_kept": 1, "dollar": {"$map": 1}},
        "blob": b"\x00\xffsecret",
        "msg": _payload(),
        "ledger": _Ledger([{"eps": 0.5, "sigma": np.float64(2.0)}]),
        "history": [],
    }


def test_encode_state_roundtrip_is_exact_and_json_safe():
    state = _rich_state()
    json_obj, arrays = encode_state(state)
    text = json.dumps(json_obj)  # must be plain JSON
    assert "_data" not in json.loads(text)["$map"] and "_cache" not in json.loads(text)["$map"]
    out = decode_state(json.loads(text), arrays)
    assert isinstance(out["ledger"], _Ledger) and out["ledger"].entries[0]["sigma"] == np.float64(2.0)
    assert out["nested"]["_kept"] == 1  # only top-level keys are transient
    expected = {k: v for k, v in state.items() if not k.startswith("_") and k != "ledger"}
    _assert_same(expected, {k: v for k, v in out.items() if k != "ledger"})


@pytest.mark.parametrize("bitgen", ["PCG64", "PCG64DXSM", "MT19937", "Philox", "SFC64"])
def test_generator_continues_the_same_stream(bitgen):
    gen = np.random.Generator(getattr(np.random, bitgen)(np.random.SeedSequence(42, spawn_key=(3,))))
    gen.normal(size=17)
    gen.integers(0, 10, size=3)  # leaves a buffered uint32 in some bit generators
    json_obj, arrays = encode_state({"rng": gen})
    copy = decode_state(json.loads(json.dumps(json_obj)), arrays)["rng"]
    np.testing.assert_array_equal(copy.normal(size=50), gen.normal(size=50))
    np.testing.assert_array_equal(copy.integers(0, 2**40, size=20), gen.integers(0, 2**40, size=20))
    assert copy.spawn(1)[0].random() == gen.spawn(1)[0].random()


def test_unsupported_state_type_names_its_place():
    with pytest.raises(TypeError, match=r"state\['a'\]\[1\]\['b'\].*_Unregistered"):
        encode_state({"a": [1, {"b": _Unregistered()}]})
    with pytest.raises(TypeError, match="object arrays"):
        encode_state({"a": np.array([None])})
    encode_state({"_a": _Unregistered()})  # transient: fine


def test_save_and_load_state_file(tmp_path):
    path = tmp_path / "ck" / "site-000.npz"
    state = _rich_state()
    record = {"state": state, "round": 3, "phase": 1, "pending": _payload(), "incoming": None, "done": False}
    save_state_file(path, record)
    save_state_file(path, record)  # overwrite in place
    assert sorted(p.name for p in path.parent.iterdir()) == ["site-000.npz"]  # no temp files left
    out = load_state_file(path)
    assert out["round"] == 3 and out["phase"] == 1 and out["incoming"] is None and out["done"] is False
    _assert_same(record["pending"], out["pending"])
    assert "_data" not in out["state"]
    np.testing.assert_array_equal(out["state"]["W"], state["W"])
    ck = DirectoryCheckpoint(tmp_path / "none.npz")
    assert ck.load() is None
    ck.save({"state": {"a": 1}, "round": 0, "phase": 0})
    assert ck.load() == {"state": {"a": 1}, "round": 0, "phase": 0}
    (tmp_path / "junk.npz").write_bytes(b"not a checkpoint")
    with pytest.raises(Exception):
        load_state_file(tmp_path / "junk.npz")


# ---------------------------------------------------------------------------
# backends: shared behaviour
# ---------------------------------------------------------------------------

@pytest.fixture(params=["inprocess", "directory"])
def make_exchange(request, tmp_path):
    made = []

    def make(n_sites: int, **kw):
        if request.param == "inprocess":
            ex = InProcessExchange(n_sites, run_id="r1", key=KEY, **kw)
        else:
            ex = DirectoryExchange(tmp_path / "shared", n_sites, run_id="r1", key=KEY, poll_interval=0.002, **kw)
        made.append(ex)
        return ex

    yield make
    for ex in made:
        ex.close()


def _msg(value: float = 1.0) -> Payload:
    return Payload({"v": np.full(3, value)}, carries={"v": "public"})


def test_send_gather_broadcast_receive(make_exchange):
    ex = make_exchange(3)
    for s in range(3):
        assert not ex.has_sent(s, 0, "t")
        ex.send(s, 0, "t", _msg(s))
        assert ex.has_sent(s, 0, "t")
    got = ex.gather(0, "t", [2, 0, 1], timeout=1)
    assert sorted(got) == [0, 1, 2] and got[2].arrays["v"][0] == 2.0
    assert not ex.has_broadcast(0, "t")
    ex.broadcast(0, "t", Payload({"sum": np.ones(1)}, meta={"stop": True}))
    assert ex.has_broadcast(0, "t")
    assert ex.receive(1, 0, "t", timeout=1).meta == {"stop": True}
    assert ex.alive() == {0, 1, 2}


def test_resend_identical_is_noop_and_different_is_error(make_exchange):
    ex = make_exchange(2)
    ex.send(0, 0, "t", _msg(1))
    ex.send(0, 0, "t", _msg(1))
    with pytest.raises(ExchangeError, match="site 0, round 0, topic 't'.*different message"):
        ex.send(0, 0, "t", _msg(2))
    ex.broadcast(0, "t", _msg(5))
    ex.broadcast(0, "t", _msg(5))
    with pytest.raises(ExchangeError, match="aggregator.*different message"):
        ex.broadcast(0, "t", _msg(6))
    assert len(ex.egress_log(0)) == 1
    assert ex.gather(0, "t", [0], timeout=1)[0].arrays["v"][0] == 1.0


def test_gather_timeout_lists_missing_sites(make_exchange):
    ex = make_exchange(4)
    ex.send(0, 2, "grad", _msg())
    ex.send(2, 2, "grad", _msg())
    t0 = time.monotonic()
    with pytest.raises(SiteTimeout) as err:
        ex.gather(2, "grad", range(4), timeout=0.2)
    assert 0.15 < time.monotonic() - t0 < 5
    assert err.value.missing == [1, 3] and sorted(err.value.received) == [0, 2]
    msg = str(err.value)
    assert "site 1" in msg and "site 3" in msg and "round 2" in msg and "'grad'" in msg and "site 0" not in msg


def test_receive_timeout(make_exchange):
    ex = make_exchange(1)
    # the slow party is the aggregator; the site that waited only reports it
    with pytest.raises(SiteTimeout, match=r"^the aggregator did not broadcast round 5, topic 't' within 0.1 s "
                                          r"\(reported by site 0, which waited for it\)$") as err:
        ex.receive(0, 5, "t", timeout=0.1)
    assert err.value.missing == [AGGREGATOR]


def test_inprocess_errors_name_sites_by_name():
    names = ["site-01", "site-02", "site-03"]
    ex = InProcessExchange(3, run_id="r1", key=KEY, site_names=names)
    with pytest.raises(SiteTimeout) as err:
        ex.receive(1, 4, "grad", timeout=0.05)
    msg = str(err.value)
    assert msg.startswith("the aggregator did not broadcast round 4, topic 'grad' within 0.05 s"), msg
    assert "reported by site 'site-02'" in msg and "site 1" not in msg
    ex.send(0, 0, "t", _msg())
    ex.send(2, 0, "t", _msg())
    with pytest.raises(SiteTimeout) as err:
        ex.gather(0, "t", range(3), timeout=0.05)
    msg = str(err.value)
    assert msg.startswith("site 'site-02' did not send round 0, topic 't'") and "the aggregator, which waited" in msg
    assert "site 1" not in msg and err.value.missing == [1]
    with pytest.raises(ExchangeError, match="site 'site-03', round 0, topic 't'.*different message"):
        ex.send(2, 0, "t", _msg(2))
    # rejected on receipt, by the declared spec and by the codec (a message moved to another site's slot)
    ex.send(1, 1, "u", Payload({"v": np.zeros(3, np.int64)}))
    with pytest.raises(MessageRejected, match="from site 'site-02', round 1, topic 'u'.*dtype int64"):
        ex.gather(1, "u", [1], timeout=1, expect=MessageSpec({"v": ArraySpec("float64", (3,))}))
    ex._sent[(1, "u", 0)] = ex._sent[(1, "u", 1)]
    with pytest.raises(MessageRejected, match="from site 'site-01', round 1, topic 'u'.*address mismatch"):
        ex.gather(1, "u", [0], timeout=1)
    with pytest.raises(ValueError, match="site_names must be 2 distinct names"):
        InProcessExchange(2, site_names=["site-01"])


def test_close_unblocks_waiters(make_exchange):
    ex = make_exchange(2)
    errors = []

    def wait(fn):
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=wait, args=(lambda: ex.receive(0, 0, "t", timeout=30),), daemon=True),
               threading.Thread(target=wait, args=(lambda: ex.gather(0, "t", [0, 1], timeout=30),), daemon=True)]
    for t in threads:
        t.start()
    time.sleep(0.1)
    t0 = time.monotonic()
    ex.close()
    for t in threads:
        t.join(timeout=5)
    assert not any(t.is_alive() for t in threads)
    assert time.monotonic() - t0 < 2
    assert len(errors) == 2 and all(type(e) is ExchangeError and "exchange closed" in str(e) for e in errors)
    with pytest.raises(ExchangeError, match="closed"):
        ex.send(0, 0, "t", _msg())


def test_spec_violations_are_rejected(make_exchange):
    ex = make_exchange(4)
    spec = MessageSpec({"v": ArraySpec("float64", (3,)), "w": ArraySpec("int64", (None, 2))})
    good = {"v": np.zeros(3), "w": np.zeros((5, 2), np.int64)}
    ex.send(0, 0, "t", Payload({**good, "v": np.zeros(3, np.float32)}))
    ex.send(1, 0, "t", Payload({**good, "w": np.zeros((5, 3), np.int64)}))
    ex.send(2, 0, "t", Payload({"v": good["v"]}))
    ex.send(3, 0, "t", Payload({**good, "x": np.zeros(1)}))
    for s, match in [(0, "dtype float32"), (1, r"shape \(5, 3\)"), (2, "'w' missing"), (3, "unexpected arrays")]:
        with pytest.raises(MessageRejected, match=match) as err:
            ex.gather(0, "t", [s], timeout=1, expect=spec)
        assert f"site {s}, round 0, topic 't'" in str(err.value)
    with pytest.raises(MessageRejected, match="24 bytes.*limit 10"):
        ex.gather(0, "t", [2], timeout=1, expect=MessageSpec({"v": ArraySpec("float64", (3,))}, max_bytes=10))
    ex.broadcast(0, "t", Payload({"v": np.zeros(4)}))
    with pytest.raises(MessageRejected, match="aggregator, round 0"):
        ex.receive(0, 0, "t", timeout=1, expect=MessageSpec({"v": ArraySpec("float64", (3,))}))


def test_invalid_addresses_are_refused(make_exchange):
    ex = make_exchange(2)
    for topic in ["../escape", "a/b", "", ".hidden", "x" * 200, "sp ace", "nul\0"]:
        with pytest.raises(ValueError, match="invalid topic"):
            ex.send(0, 0, topic, _msg())
    with pytest.raises(ValueError, match="out of range"):
        ex.send(2, 0, "t", _msg())
    with pytest.raises(ValueError, match="round"):
        ex.send(0, -1, "t", _msg())


def _run_toy(exchange, n_sites: int, timeout: float = 20.0):
    return simulate(ew.ToyProtocol(n_sites), ew.toy_data(n_sites), exchange=exchange,
                    options=RunOptions(timeout=timeout))


def _check_toy(agg: dict, n_sites: int) -> None:
    want = ew.expected_toy(n_sites)
    assert agg["rounds"] == 5 and len(agg["sums"]) == 5
    for r in range(5):
        np.testing.assert_array_equal(agg["sums"][r], want["sums"][r])
        np.testing.assert_allclose(agg["noisy_sums"][r], want["noisy_sums"][r], rtol=0, atol=1e-12)


def _check_egress(log: list[dict], n_rounds: int = 5) -> None:
    assert [(r["round"], r["topic"]) for r in log] == [(r, t) for r in range(n_rounds) for t in ("share", "noisy")]
    for rec in log:
        if rec["topic"] == "share":
            assert rec["arrays"] == {"x": {"shape": [ew.D], "dtype": "float64", "carries": "public"},
                                     "n": {"shape": [ew.D], "dtype": "float64", "carries": "test-noise"}}
        else:
            assert rec["arrays"] == {"y": {"shape": [ew.D], "dtype": "float64", "carries": "test-noise"}}


def test_toy_protocol_over_each_backend(make_exchange):
    """simulate() with threads: expected sums, and each site's egress log lists exactly its messages."""
    ex = make_exchange(3)
    res = _run_toy(ex, 3)
    _check_toy(res.aggregator, 3)
    for s in range(3):
        _check_egress(ex.egress_log(s))
        assert all(r["site"] == s and r["run"] == "r1" for r in ex.egress_log(s))
        np.testing.assert_array_equal(res.sites[s]["seen"][4], ew.expected_toy(3)["sums"][4])
    assert [(r["round"], r["topic"]) for r in ex.egress_log(AGGREGATOR)][-1] == (4, "noisy")
    assert ex.stats.messages == 30 and ex.stats.broadcasts == 10


def test_site_error_in_simulation_is_raised_not_hung():
    class Broken(ew.ToyProtocol):
        def site_noisy(self, state, round, incoming):
            if state["site"] == 1 and round == 2:
                raise ZeroDivisionError("site 1 broke")
            return super().site_noisy(state, round, incoming)

    t0 = time.monotonic()
    with pytest.raises(ZeroDivisionError, match="site 1 broke"):
        simulate(Broken(3), ew.toy_data(3), options=RunOptions(timeout=20))
    assert time.monotonic() - t0 < 10


# ---------------------------------------------------------------------------
# directory backend
# ---------------------------------------------------------------------------

def test_directory_rejects_copied_and_tampered_files(tmp_path):
    ex = DirectoryExchange(tmp_path, 2, run_id="r1", key=KEY, poll_interval=0.002)
    ex.send(1, 3, "grad", _msg())
    src = ex.message_path(1, 3, "grad")
    assert src == tmp_path / "r1" / "round-000003" / "grad" / "site-001.msg"
    # replay: last round's message copied into this round's slot
    dst = ex.message_path(1, 4, "grad")
    dst.parent.mkdir(parents=True)
    shutil.copy(src, dst)
    with pytest.raises(MessageRejected, match="site 1, round 4, topic 'grad'.*replayed"):
        ex.gather(4, "grad", [1], timeout=1)
    # impersonation: site 1's message copied into site 0's slot
    shutil.copy(src, ex.message_path(0, 3, "grad"))
    with pytest.raises(MessageRejected, match="site 0, round 3.*address mismatch"):
        ex.gather(3, "grad", [0], timeout=1)
    # tampering
    blob = bytearray(src.read_bytes())
    blob[len(blob) // 2] ^= 0x40
    src.write_bytes(bytes(blob))
    with pytest.raises(MessageRejected, match="site 1, round 3.*authentication failed"):
        ex.gather(3, "grad", [1], timeout=1)
    # oversized file: refused before it is read
    big = ex.message_path(1, 5, "grad")
    big.parent.mkdir(parents=True)
    big.write_bytes(b"DPNX" + b"\0" * (2 << 20))  # beyond limit + the 1 MiB header allowance
    with pytest.raises(MessageRejected, match="oversized"):
        ex.gather(5, "grad", [1], timeout=1, expect=MessageSpec(max_bytes=100))


def test_directory_run_file_checks_key_and_size(tmp_path):
    DirectoryExchange(tmp_path, 3, run_id="r1", key=KEY)
    DirectoryExchange(tmp_path, 3, run_id="r1", key=KEY)  # a second party joins
    with pytest.raises(ExchangeError, match="key does not match"):
        DirectoryExchange(tmp_path, 3, run_id="r1", key=b"y" * 32)
    with pytest.raises(ExchangeError, match="has 3 sites, not 4"):
        DirectoryExchange(tmp_path, 4, run_id="r1", key=KEY)
    with pytest.raises(ValueError, match="invalid run id"):
        DirectoryExchange(tmp_path, 3, run_id="../r1", key=KEY)


def test_directory_egress_log_survives_restart_and_torn_line(tmp_path):
    ex = DirectoryExchange(tmp_path, 1, run_id="r1", key=KEY)
    ex.send(0, 0, "a", _msg())
    with open(ex.run_dir / "egress" / "site-000.jsonl", "a") as f:
        f.write('{"torn": ')  # a crash in the middle of an append
    again = DirectoryExchange(tmp_path, 1, run_id="r1", key=KEY)  # the restarted site
    again.send(0, 0, "a", _msg())  # re-send after restart: no-op, not logged twice
    again.send(0, 1, "a", _msg())
    assert [(r["round"], r["topic"]) for r in again.egress_log(0)] == [(0, "a"), (1, "a")]


def test_directory_alive_uses_heartbeats(tmp_path):
    ex = DirectoryExchange(tmp_path, 3, run_id="r1", key=KEY, liveness_timeout=30)
    ex.heartbeat(2)
    ex.send(0, 0, "t", _msg())
    assert ex.alive() == {0, 2}
    old = time.time() - 60
    os.utime(ex.run_dir / "alive" / "site-002", (old, old))
    assert ex.alive() == {0}


# -- separate site processes -----------------------------------------------------

@contextmanager
def _site_processes(tmp_path: Path, run_id: str, n_sites: int):
    """Yields ``start(site, crash=None) -> Popen``; every child is killed on the way out."""
    procs: list[subprocess.Popen] = []
    logs = []

    def start(site: int, crash: str | None = None) -> subprocess.Popen:
        args = [sys.executable, WORKER, "--root", str(tmp_path / "shared"), "--run-id", run_id,
                "--key", KEY.hex(), "--n-sites", str(n_sites), "--site", str(site),
                "--checkpoint", str(tmp_path / "ckpt" / f"site-{site:03d}.npz"),
                "--draw-log", str(tmp_path / "draws"), "--timeout", "30"]
        if crash:
            args += ["--crash", crash]
        err = open(tmp_path / f"site-{site}-{len(procs)}.err", "wb")
        logs.append(err)
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=err)
        procs.append(proc)
        return proc

    try:
        yield start
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        for f in logs:
            f.close()


def _stderr(tmp_path: Path) -> str:
    return "\n".join(f"{p.name}:\n{p.read_text()}" for p in sorted(tmp_path.glob("site-*.err")))


class _AggregatorThread(threading.Thread):
    def __init__(self, protocol, exchange, checkpoint=None):
        super().__init__(daemon=True, name="aggregator")
        self.protocol, self.exchange, self.checkpoint = protocol, exchange, checkpoint
        self.result, self.error = None, None

    def run(self):
        try:
            self.result = run_aggregator(self.protocol, self.exchange, checkpoint=self.checkpoint,
                                         options=RunOptions(timeout=30))
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc


def _finish(agg: _AggregatorThread, procs: list[subprocess.Popen], tmp_path: Path) -> dict:
    agg.join(timeout=DEADLINE)
    if agg.is_alive():
        agg.exchange.close()
        agg.join(timeout=5)
        pytest.fail(f"aggregator did not finish\n{_stderr(tmp_path)}")
    if agg.error is not None:
        raise AssertionError(f"aggregator failed: {agg.error!r}\n{_stderr(tmp_path)}") from agg.error
    for p in procs:
        assert p.wait(timeout=DEADLINE) == 0, _stderr(tmp_path)
    return agg.result


def _check_draws(tmp_path: Path, n_sites: int) -> None:
    """Each site drew noise exactly once per (round, phase), and the values are the reference ones."""
    want = ew.expected_toy(n_sites)["draws"]
    for s in range(n_sites):
        lines = [json.loads(x) for x in (tmp_path / "draws" / f"site-{s}.jsonl").read_text().splitlines()]
        counts = Counter((d["round"], d["phase"]) for d in lines)
        assert counts == Counter({k: 1 for k, _ in want[s]}), f"site {s}: {counts}"
        for d, (k, noise) in zip(lines, want[s]):
            assert (d["round"], d["phase"]) == k
            np.testing.assert_array_equal(d["noise"], noise)


def _site_checkpoint(tmp_path: Path, site: int) -> dict:
    return DirectoryCheckpoint(tmp_path / "ckpt" / f"site-{site:03d}.npz").load()


def test_site_processes_match_inprocess(tmp_path):
    n = 3
    ref = simulate(ew.ToyProtocol(n), ew.toy_data(n), exchange=InProcessExchange(n, key=KEY),
                   options=RunOptions(timeout=20))
    ex = DirectoryExchange(tmp_path / "shared", n, run_id="procs", key=KEY, poll_interval=0.005)
    agg = _AggregatorThread(ew.ToyProtocol(n), ex, DirectoryCheckpoint(tmp_path / "ckpt" / "aggregator.npz"))
    with _site_processes(tmp_path, "procs", n) as start:
        procs = [start(s) for s in range(n)]
        agg.start()
        result = _finish(agg, procs, tmp_path)
    for key in ("sums", "noisy_sums"):
        for a, b in zip(result[key], ref.aggregator[key], strict=True):
            np.testing.assert_array_equal(a, b)
    _check_draws(tmp_path, n)
    for s in range(n):
        _check_egress(ex.egress_log(s))
        rec = _site_checkpoint(tmp_path, s)
        assert rec["done"] and "_x" not in rec["state"]
        for a, b in zip(rec["state"]["seen"], ref.sites[s]["seen"], strict=True):
            np.testing.assert_array_equal(a, b)
        # the generator was checkpointed mid-stream and continues where the reference one is
        assert rec["state"]["rng"].random() == ref.sites[s]["rng"].random()
    assert _stderr(tmp_path).count("Traceback") == 0


@pytest.mark.parametrize("crash", ["2:noisy:after_send", "2:1:after_checkpoint"])
def test_killed_site_resumes_from_checkpoint_without_redrawing(tmp_path, crash):
    """Site 1 dies abruptly in round 2 (after its checkpoint; after or before sending), is restarted."""
    n = 3
    ex = DirectoryExchange(tmp_path / "shared", n, run_id="crash", key=KEY, poll_interval=0.005)
    agg = _AggregatorThread(ew.ToyProtocol(n), ex)
    with _site_processes(tmp_path, "crash", n) as start:
        procs = [start(0), start(2)]
        agg.start()
        victim = start(1, crash=crash)
        assert victim.wait(timeout=DEADLINE) == ew.CRASH_EXIT_CODE, _stderr(tmp_path)
        assert _site_checkpoint(tmp_path, 1)["round"] == 2
        assert ex.has_sent(1, 2, "noisy") == crash.endswith("after_send")
        assert agg.is_alive()  # waiting for site 1
        procs.append(start(1))
        result = _finish(agg, procs, tmp_path)
    _check_toy(result, n)
    _check_draws(tmp_path, n)
    for s in range(n):
        _check_egress(ex.egress_log(s))  # the restarted site's messages are logged once


def test_failure_notices_name_the_party_whatever_its_name(tmp_path):
    from dpneuro.protocol.exchange import PartyFailed
    from dpneuro.protocol.exchange.directory import check_failure_notices, clear_failure_notice, write_failure_notice

    write_failure_notice(tmp_path, "Site A (Lyon)", "sub-03_bold.nii.gz: truncated")
    check_failure_notices(tmp_path, "Site A (Lyon)")  # a party never stops on its own notice
    with pytest.raises(PartyFailed, match=r"site 'Site A \(Lyon\)' stopped with an error: sub-03_bold"):
        check_failure_notices(tmp_path, "aggregator")
    clear_failure_notice(tmp_path, "Site A (Lyon)")  # restarted: alive again
    check_failure_notices(tmp_path, "aggregator")
