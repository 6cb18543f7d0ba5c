"""Pickle-free serialisation of messages and checkpoints.

Messages
--------
:func:`encode_payload` turns a :class:`~dpneuro.protocol.exchange.base.Payload` into one
authenticated byte string::

    b"DPNX" | version (uint16 LE) | header length (uint32 LE)
    | JSON header | raw array bytes (C order, little endian) | tag

The tag is the sending party's Ed25519 signature (format version 2, keys of
:mod:`dpneuro.protocol.exchange.keys`: no party can write as another) or, for parties
inside one process, an HMAC-SHA256 with a key they share (version 1).

The JSON header holds the message's address (``run_id``, ``sender``,
``round``, ``topic``), the run's ``binding`` when it has one (the run id and a
digest of its run manifest, :func:`run_binding`: what ties the message to one
deployed run), its ``meta`` and ``carries`` and a manifest with one
``[name, dtype, shape, offset, nbytes]`` entry per array; offsets are relative
to the start of the array bytes, arrays are packed back to back in manifest
order. The tag is computed with the run's key over everything before it.

:func:`decode_payload` checks, in this order: length and magic (malformed),
the tag (tampered, or the wrong key), that the authenticated binding is the
reader's (a message replayed from another run or manifest), that the
authenticated address is the one the message was read from (a replayed or
misplaced message), the dtype whitelist, the manifest's consistency, and the
size limit. Any failure raises
:class:`~dpneuro.protocol.exchange.base.MessageRejected` naming the message.

Checkpoints
-----------
:func:`encode_state` / :func:`decode_state` map a party's state (nested
containers of arrays, numpy scalars, plain Python values, bytes,
``numpy.random.Generator``, payloads and registered classes) to a JSON object
plus a dict of arrays, exactly and without pickle. :func:`save_state_file` and
:func:`load_state_file` store a checkpoint record as one ``.npz`` file, written
atomically.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import math
import os
import re
import struct
import tempfile
from collections.abc import Mapping
from typing import Any

import numpy as np

from dpneuro.protocol.exchange.base import MessageRejected, Payload, describe

__all__ = [
    "ALLOWED_DTYPES",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "VERSION",
    "blob_limit",
    "canonical_json",
    "check_name",
    "decode_payload",
    "decode_state",
    "encode_payload",
    "encode_state",
    "load_state_file",
    "register_state_type",
    "run_binding",
    "save_state_file",
]

MAGIC = b"DPNX"
VERSION = 1  # tagged with an HMAC every party shares (one process)
SIGNED_VERSION = 2  # signed by the sending party's own Ed25519 key (dpneuro.protocol.exchange.keys)
_PREFIX = struct.Struct("<4sHI")  # magic, version, header length
_TAG_BYTES = 32  # HMAC-SHA256
MAX_HEADER_BYTES = 1 << 20  # meta is meant to be small; this bounds the JSON parse

#: dtypes a message may carry (canonical little-endian forms)
ALLOWED_DTYPES = frozenset(
    np.dtype(t).newbyteorder("<").str
    for t in ("bool", "int8", "int16", "int32", "int64",
              "uint8", "uint16", "uint32", "uint64", "float32", "float64")
)

_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.\-]{0,127}$")


def _canonical(obj: Any) -> Any:
    if isinstance(obj, bool) or obj is None or isinstance(obj, str):
        return obj
    if isinstance(obj, (int, float, np.integer, np.floating)):
        x = float(obj)  # what a JavaScript number holds: ints beyond 2**53 round, 20.0 and 20 are one value
        if not math.isfinite(x):
            raise ValueError(f"{obj!r} has no JSON form")
        return 0.0 if x == 0 else x  # -0.0 is written as 0 by JavaScript
    if isinstance(obj, Mapping):
        return {str(k): _canonical(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_canonical(v) for v in obj]
    raise TypeError(f"no canonical JSON form for {type(obj).__name__}")


def canonical_json(obj: Any) -> str:
    """JSON text of ``obj`` that a round trip through another JSON implementation cannot change.

    COINSTAC carries every message between the parties through Node.js,
    whose JSON writes integral floats as integers (20.0 -> 20), -0.0 as 0,
    rounds integers beyond 2**53 and may reorder keys. Keys, digests and
    comparisons of anything that travelled that way are taken over this form:
    every number as a float64, keys sorted, no insignificant white space.
    """
    return json.dumps(_canonical(obj), sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def run_binding(run_id: str, manifest: Mapping[str, Any]) -> str:
    """``<run_id>:<sha256 of the run manifest>``: what every signature of a deployed run covers.

    A message or failure notice signed for one run is refused in another (another run id, or the same run id
    with other settings), even where the same keys sign both. The digest is taken over :func:`canonical_json`, so
    parties whose manifests differ only in how JSON wrote a number (4 or 4.0) agree on it.
    """
    return f"{check_name('run id', run_id)}:{hashlib.sha256(canonical_json(manifest).encode()).hexdigest()}"


def short_binding(binding: str | None) -> str:
    """A binding as messages show it: the run id and the digest's first 12 hex digits."""
    if binding is None:
        return "no run (unbound)"
    run_id, sep, digest = str(binding).rpartition(":")
    return f"{run_id}:{digest[:12]}" if sep else repr(str(binding)[:40])


def check_name(kind: str, name: str) -> str:
    """Return ``name`` if it is safe as a path component, else raise ``ValueError``.

    Topics and run ids become directory names in the directory backend, so
    every backend applies the same rule: letters, digits, ``_ . -``, starting
    with a letter or digit, at most 128 characters.
    """
    if not isinstance(name, str) or not _NAME_RE.match(name):
        raise ValueError(
            f"invalid {kind} {name!r}: use letters, digits, '_', '.', '-' "
            "(starting with a letter or digit, at most 128 characters)"
        )
    return name


def blob_limit(max_bytes: int) -> int:
    """Largest encoded message that can hold at most ``max_bytes`` of array data."""
    return _PREFIX.size + MAX_HEADER_BYTES + int(max_bytes) + 64  # the longer tag: an Ed25519 signature


def _check_key(key: bytes) -> bytes:
    if not isinstance(key, (bytes, bytearray)) or len(key) < 16:
        raise ValueError("the run key must be bytes of length >= 16")
    return bytes(key)


class _Hmac:
    """One key shared by every party: for parties inside one process only (anyone holding it can write as anyone)."""

    version, tag_bytes = VERSION, _TAG_BYTES

    def __init__(self, key: bytes):
        self._key = _check_key(key)

    def sign(self, sender: int, body: bytes) -> bytes:
        return hmac.new(self._key, body, hashlib.sha256).digest()

    def verify(self, sender: int, body: bytes, tag: bytes) -> bool:
        return hmac.compare_digest(self.sign(sender, body), tag)


def authenticator(key: Any) -> Any:
    """What signs and checks messages: ``bytes`` (an HMAC key every party shares) or a
    :class:`~dpneuro.protocol.exchange.keys.PartyKeys` (each party signs with its own Ed25519 key)."""
    if isinstance(key, (bytes, bytearray)):
        return _Hmac(bytes(key))
    if all(callable(getattr(key, m, None)) for m in ("sign", "verify")) and hasattr(key, "version"):
        return key
    raise ValueError("the run key must be bytes of length >= 16 or the parties' signing keys (PartyKeys)")


def _json_default(obj: Any) -> Any:
    # meta is JSON; let numpy scalars and small arrays through as plain values
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, tuple):
        return list(obj)
    raise TypeError(f"meta value of type {type(obj).__name__} is not JSON serialisable")


def _wire_array(name: str, arr: Any, where: str) -> np.ndarray:
    a = np.asarray(arr)
    dt = a.dtype.newbyteorder("<")  # the wire is little endian whatever the host
    if dt.str not in ALLOWED_DTYPES:
        raise ValueError(f"cannot send {where}: array {name!r} has unsupported dtype {a.dtype}")
    return np.asarray(a, dtype=dt, order="C")  # not ascontiguousarray: it turns 0-d into 1-d


def encode_payload(payload: Payload, *, run_id: str, sender: int, round: int, topic: str, key: bytes,
                   binding: str | None = None) -> bytes:
    """Serialise and authenticate one message.

    Parameters
    ----------
    payload : Payload
        Arrays (any whitelisted dtype, any shape including 0-d and empty),
        JSON-safe ``meta`` and per-array ``carries``.
    run_id, sender, round, topic
        The address the message is written to; it is authenticated with it.
    key : bytes or PartyKeys
        The parties' signing keys (the sender signs with its own), or an HMAC key (at least 16 bytes) that
        parties inside one process share.
    binding : str, optional
        The deployed run the message belongs to (:func:`run_binding`), authenticated with it; None only where
        there is no run manifest (parties in one process).

    Returns
    -------
    bytes
        The encoded message. Encoding is deterministic: the same payload and
        address always give the same bytes.
    """
    auth = authenticator(key)
    where = describe(sender, round, topic)
    manifest, chunks, offset = [], [], 0
    for name, arr in payload.arrays.items():
        if not isinstance(name, str):
            raise ValueError(f"cannot send {where}: array name {name!r} is not a string")
        a = _wire_array(name, arr, where)
        manifest.append([name, a.dtype.str, list(a.shape), offset, int(a.nbytes)])
        chunks.append(a.tobytes(order="C"))
        offset += a.nbytes
    header = {
        "run_id": run_id,
        "sender": int(sender),
        "round": int(round),
        "topic": topic,
        **({"binding": str(binding)} if binding is not None else {}),  # unbound messages keep their old bytes
        "meta": dict(payload.meta),
        "carries": {str(k): str(v) for k, v in payload.carries.items()},
        "arrays": manifest,
    }
    try:
        hjson = json.dumps(header, sort_keys=True, separators=(",", ":"), default=_json_default).encode()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"cannot send {where}: {exc}") from exc
    if len(hjson) > MAX_HEADER_BYTES:
        raise ValueError(f"cannot send {where}: header is {len(hjson)} bytes, limit {MAX_HEADER_BYTES} (meta too big?)")
    body = b"".join([_PREFIX.pack(MAGIC, auth.version, len(hjson)), hjson, *chunks])
    return body + auth.sign(sender, body)


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def decode_payload(
    blob: bytes, *, run_id: str, sender: int, round: int, topic: str, key: bytes,
    max_bytes: int | None = None, binding: str | None = None,
) -> Payload:
    """Check and deserialise a message read from address ``(run_id, sender, round, topic)``.

    Parameters
    ----------
    blob : bytes
        What was read.
    run_id, sender, round, topic
        Where it was read from; the authenticated address must match.
    key : bytes or PartyKeys
        As for :func:`encode_payload`: a signature is checked with the public key of ``sender``.
    max_bytes : int, optional
        Limit on the total array bytes.
    binding : str, optional
        The reader's run (:func:`run_binding`); the message's authenticated binding must be the same.

    Returns
    -------
    Payload
        With freshly allocated (writable, native little-endian) arrays.

    Raises
    ------
    MessageRejected
        If the message is malformed, tampered with, authenticated with another
        key, replayed from another run or manifest, addressed elsewhere, uses a forbidden dtype, has an inconsistent
        manifest or is too large. The error names the sender, round and topic.
    """
    auth = authenticator(key)
    where = describe(sender, round, topic)

    def reject(why: str) -> MessageRejected:
        return MessageRejected(f"rejected message from {where}: {why}")

    blob = bytes(blob)
    if len(blob) < _PREFIX.size + auth.tag_bytes:
        raise reject(f"malformed: only {len(blob)} bytes")
    magic, version, hlen = _PREFIX.unpack_from(blob, 0)
    if magic != MAGIC:
        raise reject("malformed: not a dpneuro message (bad magic)")
    if version not in (VERSION, SIGNED_VERSION):
        raise reject(f"malformed: unsupported format version {version}")
    if version != auth.version:
        raise reject("not signed by its sender's own key, which this run requires" if version == VERSION
                     else "signed with a party key, but this run uses a shared key")
    if max_bytes is not None and len(blob) > blob_limit(max_bytes):
        raise reject(f"oversized: {len(blob)} bytes, limit {max_bytes} bytes of array data")

    body, tag = blob[:-auth.tag_bytes], blob[-auth.tag_bytes:]
    if not auth.verify(sender, body, tag):
        raise reject("authentication failed (tampered with, or not written by the party it claims: "
                     "wrong run key or signature)")

    # authenticated from here on: what follows guards against a buggy or
    # compromised party holding the key, not against the network
    if hlen > MAX_HEADER_BYTES or _PREFIX.size + hlen > len(body):
        raise reject(f"malformed: header length {hlen} out of range")
    try:
        header = json.loads(body[_PREFIX.size:_PREFIX.size + hlen].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise reject(f"malformed header: {exc}") from None
    if not isinstance(header, dict):
        raise reject("malformed header: not a JSON object")

    if header.get("binding") != binding:  # before the address: a stage of another run has the same address
        theirs, mine = short_binding(header.get("binding")), short_binding(binding)
        raise reject(f"replayed from another run or manifest: it was written for {theirs}, this run is {mine}")
    got = (header.get("run_id"), header.get("sender"), header.get("round"), header.get("topic"))
    if got != (run_id, sender, round, topic):
        raise reject(
            f"address mismatch (replayed or misplaced message): it was written for run "
            f"{got[0]!r}, sender {got[1]!r}, round {got[2]!r}, topic {got[3]!r}"
        )

    meta, carries, manifest = header.get("meta"), header.get("carries"), header.get("arrays")
    if not isinstance(meta, dict) or not isinstance(carries, dict) or not isinstance(manifest, list):
        raise reject("malformed header: meta, carries and arrays must be present")
    if not all(isinstance(v, str) for v in carries.values()):
        raise reject("malformed header: carries must map names to strings")

    data = memoryview(body)[_PREFIX.size + hlen:]
    entries, expected_offset = [], 0
    for entry in manifest:
        if not (isinstance(entry, list) and len(entry) == 5):
            raise reject(f"malformed manifest entry {entry!r}")
        name, dtype_str, shape, offset, nbytes = entry
        if not isinstance(name, str) or not isinstance(dtype_str, str):
            raise reject(f"malformed manifest entry {entry!r}")
        if dtype_str not in ALLOWED_DTYPES:
            raise reject(f"array {name!r} has forbidden dtype {dtype_str!r}")
        dt = np.dtype(dtype_str)
        if not (isinstance(shape, list) and all(_is_int(n) and n >= 0 for n in shape)):
            raise reject(f"array {name!r} has invalid shape {shape!r}")
        if not (_is_int(offset) and _is_int(nbytes)):
            raise reject(f"array {name!r} has invalid offset/size")
        if nbytes != int(np.prod(shape, dtype=object)) * dt.itemsize:
            raise reject(f"array {name!r}: {nbytes} bytes do not match shape {tuple(shape)} of {dt}")
        if offset != expected_offset:
            raise reject(f"array {name!r}: offset {offset}, expected {expected_offset} (overlap or gap)")
        expected_offset += nbytes
        entries.append((name, dt, tuple(shape), offset, nbytes))
    if len({e[0] for e in entries}) != len(entries):
        raise reject("malformed manifest: duplicate array names")
    if expected_offset != len(data):
        raise reject(f"malformed: manifest describes {expected_offset} bytes of arrays, message has {len(data)}")
    if max_bytes is not None and expected_offset > max_bytes:
        raise reject(f"oversized: {expected_offset} bytes of array data, limit {max_bytes}")

    arrays = {
        name: np.frombuffer(data, dtype=dt, count=nbytes // dt.itemsize, offset=offset).reshape(shape).copy()
        for name, dt, shape, offset, nbytes in entries
    }
    return Payload(arrays=arrays, meta=meta, carries=carries)


# ---------------------------------------------------------------------------
# checkpoint state
# ---------------------------------------------------------------------------

_STATE_TYPES: dict[str, type] = {}


def _type_name(cls: type) -> str:
    return getattr(cls, "state_type_name", None) or f"{cls.__module__}.{cls.__qualname__}"


def register_state_type(cls: type) -> type:
    """Allow instances of ``cls`` in checkpointed state.

    ``cls`` must provide ``to_dict()`` (returning a value :func:`encode_state`
    can store) and a classmethod ``from_dict(d)``. The stored name is
    ``cls.state_type_name`` if set, else ``module.QualName``. Usable as a
    class decorator; returns ``cls``.
    """
    if not (callable(getattr(cls, "to_dict", None)) and callable(getattr(cls, "from_dict", None))):
        raise TypeError(f"{cls.__name__} needs to_dict() and a classmethod from_dict() to be checkpointed")
    _STATE_TYPES[_type_name(cls)] = cls
    return cls


class _Encoder:
    """Maps a value to JSON; arrays go to ``self.arrays`` under generated names.

    Every JSON object produced has exactly one key, starting with ``$``, that
    says what it encodes; JSON lists are Python lists; plain scalars are
    themselves.
    """

    def __init__(self) -> None:
        self.arrays: dict[str, np.ndarray] = {}

    def _array(self, a: np.ndarray, path: str) -> str:
        if a.dtype.hasobject:
            raise TypeError(f"cannot checkpoint {path}: object arrays are not allowed")
        name = f"a{len(self.arrays)}"
        self.arrays[name] = a
        return name

    def encode(self, obj: Any, path: str = "state") -> Any:
        if obj is None or isinstance(obj, (bool, str)):
            return obj
        if isinstance(obj, np.generic):  # before int/float: np.float64 is a float
            return {"$scalar": self._array(np.asarray(obj), path)}
        if isinstance(obj, (int, float)):
            return obj if type(obj) in (int, float) else (int(obj) if isinstance(obj, int) else float(obj))
        if isinstance(obj, np.ndarray):
            return {"$array": self._array(np.asarray(obj), path)}
        if isinstance(obj, (bytes, bytearray)):
            return {"$bytes": base64.b64encode(bytes(obj)).decode("ascii")}
        if isinstance(obj, list):
            return [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
        if isinstance(obj, tuple):
            return {"$tuple": [self.encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, Mapping):
            if all(isinstance(k, str) for k in obj):
                return {"$map": {k: self.encode(v, f"{path}[{k!r}]") for k, v in obj.items()}}
            return {"$dict": [[self.encode(k, f"{path}.key"), self.encode(v, f"{path}[{k!r}]")]
                              for k, v in obj.items()]}
        if isinstance(obj, np.random.Generator):
            return {"$generator": self._generator(obj, path)}
        if isinstance(obj, Payload):
            return {"$payload": {
                "arrays": self.encode(dict(obj.arrays), f"{path}.arrays"),
                "meta": self.encode(dict(obj.meta), f"{path}.meta"),
                "carries": self.encode(dict(obj.carries), f"{path}.carries"),
            }}
        name = _type_name(type(obj))
        if name in _STATE_TYPES:
            return {"$object": {"type": name, "data": self.encode(obj.to_dict(), f"{path}.to_dict()")}}
        raise TypeError(
            f"cannot checkpoint {path}: type {type(obj).__module__}.{type(obj).__qualname__} is not supported "
            "(make the key transient with a leading '_' or register the type with register_state_type)"
        )

    def _generator(self, gen: np.random.Generator, path: str) -> dict[str, Any]:
        bg = gen.bit_generator
        out: dict[str, Any] = {"bit_generator": type(bg).__name__,
                               "state": self.encode(bg.state, f"{path}.state")}
        # keep the seed sequence too, so that Generator.spawn() stays reproducible
        ss = getattr(bg, "seed_seq", None)
        if isinstance(ss, np.random.SeedSequence):
            out["seed_seq"] = self.encode({
                "entropy": ss.entropy, "spawn_key": tuple(ss.spawn_key),
                "pool_size": ss.pool_size, "n_children_spawned": ss.n_children_spawned,
            }, f"{path}.seed_seq")
        return out


def _decode(obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    if isinstance(obj, list):
        return [_decode(v, arrays) for v in obj]
    if not (isinstance(obj, dict) and len(obj) == 1):
        raise ValueError(f"corrupt checkpoint: unexpected JSON value {obj!r:.80}")
    (tag, val), = obj.items()
    if tag == "$map":
        return {k: _decode(v, arrays) for k, v in val.items()}
    if tag == "$dict":
        return {_decode(k, arrays): _decode(v, arrays) for k, v in val}
    if tag == "$tuple":
        return tuple(_decode(v, arrays) for v in val)
    if tag == "$array":
        return np.asarray(arrays[val])
    if tag == "$scalar":
        return np.asarray(arrays[val])[()]
    if tag == "$bytes":
        return base64.b64decode(val)
    if tag == "$generator":
        bg_cls = getattr(np.random, val["bit_generator"], None)
        if not (isinstance(bg_cls, type) and issubclass(bg_cls, np.random.BitGenerator)):
            raise ValueError(f"corrupt checkpoint: unknown bit generator {val['bit_generator']!r}")
        if "seed_seq" in val:
            ss = _decode(val["seed_seq"], arrays)
            bg = bg_cls(np.random.SeedSequence(ss["entropy"], spawn_key=ss["spawn_key"],
                                               pool_size=ss["pool_size"],
                                               n_children_spawned=ss["n_children_spawned"]))
        else:
            bg = bg_cls()
        bg.state = _decode(val["state"], arrays)
        return np.random.Generator(bg)
    if tag == "$payload":
        return Payload(arrays=_decode(val["arrays"], arrays), meta=_decode(val["meta"], arrays),
                       carries=_decode(val["carries"], arrays))
    if tag == "$object":
        cls = _STATE_TYPES.get(val["type"])
        if cls is None:
            raise ValueError(f"checkpoint holds a {val['type']!r}, which is not registered "
                             "(import the module that registers it)")
        return cls.from_dict(_decode(val["data"], arrays))
    raise ValueError(f"corrupt checkpoint: unknown tag {tag!r}")


def _drop_transient(obj: Any) -> Any:
    if isinstance(obj, Mapping):
        return {k: v for k, v in obj.items() if not (isinstance(k, str) and k.startswith("_"))}
    return obj


def encode_state(obj: Any) -> tuple[Any, dict[str, np.ndarray]]:
    """Split a party's state into a JSON-serialisable object and named arrays.

    Parameters
    ----------
    obj : Any
        Usually the state dict. Its top-level keys starting with ``_`` are
        transient (the site's data and what is derived from it) and are
        skipped; nested keys are kept as they are. Supported values: numpy
        arrays (not object dtype) and scalars, ``None``, ``bool``, ``int``,
        ``float``, ``str``, ``bytes``, lists, tuples, dicts (any keys of these
        types), ``numpy.random.Generator``, :class:`Payload` and types
        registered with :func:`register_state_type`.

    Returns
    -------
    json_obj : Any
        Pass to ``json.dumps``.
    arrays : dict of str to numpy.ndarray
        The arrays, referenced by name from ``json_obj``.

    Raises
    ------
    TypeError
        For an unsupported value, naming where it is in the state.
    """
    enc = _Encoder()
    json_obj = enc.encode(_drop_transient(obj))
    return json_obj, enc.arrays


def decode_state(json_obj: Any, arrays: Mapping[str, np.ndarray]) -> Any:
    """Inverse of :func:`encode_state`.

    A restored ``Generator`` continues the same stream of draws as the one
    that was saved.
    """
    return _decode(json_obj, arrays)


_RECORD_KEY = "__record__"


def fsync_dir(path) -> None:
    """fsync a folder so a rename into it survives a crash (best effort)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not every file system lets a directory be fsynced
    finally:
        os.close(fd)


def save_state_file(path: str | os.PathLike[str], record: Mapping[str, Any]) -> None:
    """Write a checkpoint record to ``path`` (one ``.npz``) atomically.

    ``record["state"]`` loses its transient (``_``-prefixed) top-level keys;
    the rest of the record (round, phase, pending and incoming payloads, ...)
    is stored as is. The file is written to a temporary name in the same
    directory, fsynced and renamed over ``path``, so a crash leaves either the
    old or the new checkpoint, never a mix.
    """
    enc = _Encoder()
    rec_json = {}
    for k, v in record.items():
        if not isinstance(k, str):
            raise TypeError(f"checkpoint record keys must be strings, got {k!r}")
        rec_json[k] = enc.encode(_drop_transient(v) if k == "state" else v, k)
    blob = json.dumps({"format": "dpneuro-checkpoint", "version": 1, "record": rec_json},
                      separators=(",", ":")).encode()
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **{_RECORD_KEY: np.frombuffer(blob, dtype=np.uint8)}, **enc.arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


def load_state_file(path: str | os.PathLike[str]) -> dict[str, Any]:
    """Read a checkpoint record written by :func:`save_state_file`.

    Raises
    ------
    FileNotFoundError
        If there is no checkpoint at ``path``.
    ValueError
        If the file is not a dpneuro checkpoint.
    """
    with np.load(os.fspath(path), allow_pickle=False) as npz:
        if _RECORD_KEY not in npz.files:
            raise ValueError(f"{os.fspath(path)} is not a dpneuro checkpoint")
        head = json.loads(npz[_RECORD_KEY].tobytes().decode("utf-8"))
        if head.get("format") != "dpneuro-checkpoint":
            raise ValueError(f"{os.fspath(path)} is not a dpneuro checkpoint")
        arrays = {k: npz[k] for k in npz.files if k != _RECORD_KEY}
    return {k: _decode(v, arrays) for k, v in head["record"].items()}
