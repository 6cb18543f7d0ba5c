"""Directory exchange: parties share a folder (local disk or a shared file system).

Each site and the aggregator may be a separate OS process, or a separate
machine mounting the same folder. Layout under ``root``::

    <run_id>/run.json                               n_sites and a key check
    <run_id>/round-000012/<topic>/site-003.msg       site 3 -> aggregator
    <run_id>/round-000012/<topic>/aggregator.msg     aggregator -> every site
    <run_id>/egress/site-003.jsonl                   site 3's egress log
    <run_id>/alive/site-003                          site 3's heartbeat (mtime)
    failed/site-003-<hash>.json                      site 3 stopped, how and why (signed; shared by every run_id)

A message is written to a temporary file in its final directory, fsynced and
then hard-linked to its name, so readers only ever see complete files and the
first writer of an address wins; a second, different message for the same
address is an error. Readers poll.

A party's notice says how it stopped (:data:`NOTICE_KINDS`): with an error
(every other party stops at once), by its operator (the others wait for it to be
started again, as for any late message) or because another party stopped. A
restarted party withdraws its own notice; the notices of an earlier attempt
that it passes as ``notices_before`` do not stop it (it waits for those parties
to be started again too).

In a deployed run every message and failure notice is signed over the run's
``binding`` (its run id and a digest of its run manifest,
:func:`~dpneuro.protocol.exchange.codec.run_binding`), so one copied from
another run's folder is refused as replayed. Whoever can write to the folder
may still plant symlinks, FIFOs or devices in it: every file is reached through
:mod:`~dpneuro.protocol.exchange.safefs`, which never reads, writes or removes
anything through a symlink or a non-regular file below the shared folder's root
(``base``) and refuses such a file by name.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpneuro.protocol.exchange import safefs
from dpneuro.protocol.exchange.base import (
    AGGREGATOR,
    Exchange,
    ExchangeError,
    MessageRejected,
    MessageSpec,
    PartyFailed,
    Payload,
    SiteTimeout,
    describe,
    egress_record,
)
from dpneuro.protocol.exchange.codec import (
    authenticator,
    blob_limit,
    check_name,
    encode_payload,
    load_state_file,
    save_state_file,
    short_binding,
)
from dpneuro.protocol.exchange.inprocess import (
    DEFAULT_MAX_BYTES,
    ExchangeStats,
    check_round,
    check_site,
    decode_checked,
    gather_timeout_message,
    receive_timeout_message,
)

_KEY_CHECK = b"dpneuro directory exchange: key check"


def publish_once(path: Path, blob: bytes, *, base=None) -> bool:
    """Atomically create ``path`` holding ``blob``.

    ``base``: the shared folder's root (default ``path``'s folder); no folder from it down to ``path``, nor
    ``path`` itself, may be a symlink or other than a real folder / regular file
    (:class:`~dpneuro.protocol.exchange.safefs.PlantedFile`).

    Returns
    -------
    bool
        True if this call created the file, False if it already existed (its
        content is left untouched).
    """
    path = Path(path)
    return safefs.create_once(path.parent if base is None else base, path, blob)


def _notice_path(root, party: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", party)[:100] or "party"
    return Path(root) / "failed" / f"{safe}-{hashlib.sha256(party.encode()).hexdigest()[:8]}.json"


#: bytes a party sets aside for its failure notice when it starts, so that a full disk can still carry it
NOTICE_BYTES = 4096


def _reserve_path(root, party: str) -> Path:
    path = _notice_path(root, party)
    return path.with_name(f".{path.stem}.reserved")


def _base(root, base) -> Path:
    return Path(root if base is None else base)


def reserve_failure_notice(root, party: str, *, base=None) -> None:
    """Set aside the space of ``party``'s failure notice now, while the disk has room (see :data:`NOTICE_BYTES`).

    ``base``: the shared folder's root (default ``root``), below which nothing is written through a symlink.
    """
    path = _reserve_path(root, party)
    have = safefs.status(_base(root, base), path)
    if have is None or have.st_size < NOTICE_BYTES:
        safefs.write_over(_base(root, base), path, b" " * NOTICE_BYTES)


#: how a notice's party stopped: with an error (every other party stops at once), by its operator (the others wait
#: for it to be started again, up to their message timeout), or because another party's notice stopped it
FAILED, INTERRUPTED, STOPPED = "failed", "interrupted", "stopped"
NOTICE_KINDS = (FAILED, INTERRUPTED, STOPPED)


@dataclass(frozen=True)
class Notice:
    """One party's notice as found in the shared folder (unauthenticated: read it as what the notice says)."""

    name: str  # its file's name
    party: str
    kind: str  # one of NOTICE_KINDS
    error: str
    at: str  # when it was written (UTC), "" if not said
    raw: bytes  # its bytes, to tell a notice written later from this one

    @property
    def who(self) -> str:
        return "the aggregator" if self.party == "aggregator" else f"site {self.party!r}"

    def describe(self) -> str:
        """The notice in words: who stopped, when, how."""
        when = f" at {self.at}" if self.at else ""
        if self.kind == INTERRUPTED:
            return f"{self.who} was stopped by its operator{when}"
        if self.kind == STOPPED:
            return f"{self.who} stopped{when} because {self.error}"
        return f"{self.who} stopped with an error{when}: {self.error}"


def _notice_body(party: str, error: str, binding: str | None, kind: str = FAILED, at: str | None = None) -> bytes:
    """What a notice's signature covers: who, why, how, when and, in a deployed run, which run (codec.run_binding)."""
    body: dict[str, Any] = {"party": party, "error": error}
    if binding is not None:  # unbound notices keep their old signed bytes
        body["binding"] = binding
    if kind != FAILED:  # so do failure notices without a time
        body["kind"] = kind
    if at is not None:
        body["at"] = at
    return json.dumps(body, sort_keys=True).encode()


def write_failure_notice(root, party: str, error: str, keys=None, *, binding: str | None = None,
                         base=None, kind: str = FAILED) -> None:
    """``<root>/failed/<party>-<hash>.json``: ``party`` stopped with ``error``, the way ``kind`` says
    (:data:`NOTICE_KINDS`; a failure ends the other parties' waits), and when.

    Signed with ``party``'s own key when ``keys`` (:class:`~dpneuro.protocol.exchange.keys.PartyKeys`) is given,
    over the run's ``binding`` too (:func:`~dpneuro.protocol.exchange.codec.run_binding`), so that a notice copied
    from another run is not taken for this run's. Written into the space :func:`reserve_failure_notice` set aside
    when there is one: overwriting allocated bytes and a rename need no free space, so a party that stops because
    the disk is full can still say so. ``base``: as for :func:`reserve_failure_notice`.
    """
    if kind not in NOTICE_KINDS:
        raise ValueError(f"kind must be one of {NOTICE_KINDS}, got {kind!r}")
    base = _base(root, base)
    path = _notice_path(root, party)
    error = str(error)[:600]  # escaped, signed and wrapped, still within NOTICE_BYTES
    at = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    notice: dict[str, Any] = {"party": party, "error": error, "at": at}
    if kind != FAILED:
        notice["kind"] = kind
    if binding is not None:
        notice["binding"] = binding
    if keys is not None:
        notice["signature"] = keys.sign_named(_notice_body(party, error, binding, kind, at)).hex()
    blob = json.dumps(notice).encode()
    blob = blob + b" " * max(0, NOTICE_BYTES - len(blob))  # JSON ignores trailing white space
    reserved = _reserve_path(root, party)
    tmp = reserved if safefs.is_file(base, reserved) else path.with_name(f".{path.stem}.{os.getpid()}.tmp")
    safefs.write_over(base, tmp, blob)
    safefs.replace(base, tmp, path)


def clear_failure_notice(root, party: str, *, base=None) -> None:
    """A restarted party withdraws its old notice."""
    safefs.unlink(_base(root, base), _notice_path(root, party))


def read_notices(root, *, base=None) -> list[Notice]:
    """Every party's notice under ``root``, by file name (as they say; :func:`check_failure_notices` checks
    signatures). ``base``: as for :func:`reserve_failure_notice`; a notice that is a symlink or not a regular file
    is refused (:class:`PlantedFile`)."""
    base = _base(root, base)
    d = Path(root) / "failed"
    out = []
    for name in sorted(safefs.names(base, d)):
        if not name.endswith(".json") or name.startswith("."):
            continue
        try:
            raw = safefs.read(base, d / name) or b""
            info = json.loads(raw)
        except (OSError, ValueError):
            continue  # being replaced: seen on the next poll
        if not isinstance(info, dict):
            continue
        kind = info.get("kind", FAILED)
        out.append(Notice(name=name, party=str(info.get("party")), kind=kind if kind in NOTICE_KINDS else FAILED,
                          error=str(info.get("error")), at=str(info.get("at") or ""), raw=raw))
    return out


def check_failure_notices(root, me: str, keys=None, *, binding: str | None = None, base=None,
                          before: Mapping[str, bytes] | None = None) -> list[Notice]:
    """Raise :class:`PartyFailed` if another party than ``me`` left a failure notice under ``root``; return the
    notices of the parties stopped by their operators (the run waits for them).

    With ``keys``, a notice whose signature is not its party's for this run (``binding``) still stops the run
    (any party may abort it), but is reported as unauthenticated, or as replayed from another run, instead of
    blaming the party it names. A notice that stops no one (an operator's stop, a party stopped by another) needs
    no trust. ``before``: notices of an earlier attempt of the run (file name -> bytes), as this party found them
    when it was started again: they do not stop it, the same file written again does. ``base``: as for
    :func:`reserve_failure_notice`; a notice that is a symlink or not a regular file is refused (:class:`PlantedFile`).
    """
    base = _base(root, base)
    mine = _notice_path(root, me).name
    waiting = []
    for notice in read_notices(root, base=base):
        if notice.name == mine or (before is not None and before.get(notice.name) == notice.raw):
            continue
        if notice.kind == INTERRUPTED:
            waiting.append(notice)
        if notice.kind != FAILED:
            continue
        info = json.loads(notice.raw)
        party, error, at = notice.party, notice.error, info.get("at")
        who = notice.who
        if keys is not None:
            sig, claimed = info.get("signature"), info.get("binding")

            def signed(bound) -> bool:
                try:
                    return isinstance(sig, str) and keys.verify_named(party, _notice_body(party, error, bound, at=at),
                                                                      bytes.fromhex(sig))
                except (ValueError, KeyError):
                    return False

            if not signed(binding):
                if claimed != binding and isinstance(claimed, str) and signed(claimed):
                    raise PartyFailed(
                        f"the run was stopped by a failure notice of {who} replayed from another run or manifest "
                        f"({notice.name}: written for {short_binding(claimed)}, this run is {short_binding(binding)}); "
                        f"it does not say that {who} failed in this run: {error}")
                raise PartyFailed(f"the run was stopped by a failure notice not signed by {who}, whom it names "
                                  f"({notice.name}): {error}")
        raise PartyFailed(f"{who} stopped with an error: {error}")
    return waiting


class DirectoryExchange(Exchange):
    """An :class:`Exchange` over a shared folder.

    Parameters
    ----------
    root : path-like
        The shared folder; the run lives in ``root / run_id``.
    n_sites : int
        Number of sites. Must agree with the run's ``run.json`` if another
        party created it first.
    run_id : str
        Identifies the run (letters, digits, ``_ . -``).
    key : bytes
        The run's HMAC key (at least 16 bytes); every party must use the same.
    poll_interval : float
        Seconds between looks at the folder while waiting.
    max_bytes : int
        Largest array payload accepted on receipt.
    liveness_timeout : float
        Seconds after which a silent site is no longer reported by :meth:`alive`.
    heartbeat_interval : float
        While a site waits in :meth:`receive` its heartbeat is refreshed this often.
    notify : callable, optional
        Told, every ``notify_interval`` seconds of waiting, whom this party waits for and for what.
    binding : str, optional
        The deployed run every message and failure notice is bound to
        (:func:`~dpneuro.protocol.exchange.codec.run_binding`: run id and run manifest digest); a message
        written for another run is refused as replayed. None: no binding (no run manifest).
    base : path-like, optional
        The shared folder's root (default ``root``): nothing from it down is read, written or removed through a
        symlink or a non-regular file (:class:`~dpneuro.protocol.exchange.safefs.PlantedFile`).
    notices_before : mapping, optional
        The other parties' notices of an earlier attempt of the run, as a restarted party found them (file name ->
        bytes, :func:`read_notices`): they do not stop this party (see :func:`check_failure_notices`).

    Notes
    -----
    The egress log line is written *before* the message is published and at
    most once per address, so a crash can never leave a sent message out of
    the log (at worst the log lists a message whose sender crashed before
    publishing it, and which it re-sends on restart).

    A receive that times out raises :class:`SiteTimeout` with
    ``missing == [AGGREGATOR]``. :meth:`close` only affects this process.
    """

    def __init__(
        self, root: str | os.PathLike[str], n_sites: int, *, run_id: str, key: bytes,
        poll_interval: float = 0.01, max_bytes: int = DEFAULT_MAX_BYTES,
        liveness_timeout: float = 60.0, heartbeat_interval: float = 1.0,
        site_names: Sequence[str] | None = None, notify: Callable[[str], None] | None = None,
        notify_interval: float = 30.0, binding: str | None = None, base: str | os.PathLike[str] | None = None,
        notices_before: Mapping[str, bytes] | None = None,
    ) -> None:
        if int(n_sites) < 1:
            raise ValueError(f"n_sites must be >= 1, got {n_sites}")
        if site_names is not None:
            site_names = [check_name("site name", n) for n in site_names]
            if len(site_names) != int(n_sites) or len(set(site_names)) != len(site_names) \
                    or "aggregator" in site_names:
                raise ValueError(f"site_names must be {n_sites} distinct names (not 'aggregator'), got {site_names}")
        self.site_names = list(site_names) if site_names is not None else None
        authenticator(key)  # bytes of >= 16 or PartyKeys, else ValueError
        self.n_sites = int(n_sites)
        self.run_id = check_name("run id", run_id)
        self.root = Path(root)
        self.base = Path(base) if base is not None else self.root
        self.run_dir = self.root / self.run_id
        self.binding = binding
        self.poll_interval = float(poll_interval)
        self.max_bytes = int(max_bytes)
        self.liveness_timeout = float(liveness_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.stats = ExchangeStats()
        self.notify, self.notify_interval = notify, float(notify_interval)
        self.notices_before = dict(notices_before) if notices_before is not None else None
        self._told: set[bytes] = set()  # operators' stops already told
        self._key = bytes(key) if isinstance(key, (bytes, bytearray)) else key
        self._closed = threading.Event()
        self._lock = threading.Lock()  # several parties may share one instance (threads)
        self._logged: dict[int, set[tuple[int, str]]] = {}
        self._log_needs_newline: dict[int, bool] = {}
        for sub in ("egress", "alive"):
            safefs.make_folder(self.base, self.run_dir / sub)
        # failure notices are shared by every exchange under root (the stages of one deployed run)
        self.failed_dir = self.root / "failed"
        self._check_run_file()

    # -- paths -------------------------------------------------------------------
    def _party(self, sender: int) -> str:
        """The party's name in files and messages: its site name when known."""
        if sender == AGGREGATOR:
            return "aggregator"
        return self.site_names[sender] if self.site_names is not None else f"site-{sender:03d}"

    def who(self, sender: int) -> str:
        """The party as messages name it: ``site 'site-02'`` with site names, else ``site 1``."""
        if sender == AGGREGATOR:
            return "the aggregator"
        return f"site {self._party(sender)!r}" if self.site_names is not None else f"site {sender}"

    # -- failures ----------------------------------------------------------------
    def _check_failures(self, me: int) -> None:
        waiting = check_failure_notices(self.root, self._party(me), None if isinstance(self._key, bytes) else self._key,
                                        binding=self.binding, base=self.base, before=self.notices_before)
        for notice in waiting:
            if notice.raw not in self._told and self.notify is not None:
                self.notify(f"{self._party(me)}: {notice.describe()}; waiting for it to be started again with the "
                            "same run id (it resumes from its checkpoint)")
            self._told.add(notice.raw)

    def message_path(self, sender: int, round: int, topic: str) -> Path:
        """Where the message from ``sender`` (a site id or ``AGGREGATOR``) for ``(round, topic)`` lives."""
        return self.run_dir / f"round-{round:06d}" / check_name("topic", topic) / f"{self._party(sender)}.msg"

    def _egress_path(self, sender: int) -> Path:
        return self.run_dir / "egress" / f"{self._party(sender)}.jsonl"

    def _alive_path(self, site: int) -> Path:
        return self.run_dir / "alive" / self._party(site)

    def _check_run_file(self) -> None:
        if isinstance(self._key, bytes):
            check = hmac.new(self._key, _KEY_CHECK + self.run_id.encode(), hashlib.sha256).hexdigest()
        else:  # the pinned public keys: a party holding another keys file would reject every message
            check = "ed25519:" + self._key.digest()
        info = {"format": 1, "run_id": self.run_id, "n_sites": self.n_sites, "key_check": check}
        path = self.run_dir / "run.json"
        publish_once(path, json.dumps(info, sort_keys=True).encode(), base=self.base)
        try:
            have = json.loads(safefs.read(self.base, path) or b"")
        except ValueError:
            have = {}
        if not isinstance(have, dict):
            have = {}
        if have.get("n_sites") != self.n_sites:
            raise ExchangeError(f"run {self.run_id!r} in {self.run_dir} has {have.get('n_sites')} sites, "
                                f"not {self.n_sites}")
        if not hmac.compare_digest(str(have.get("key_check")), check):
            raise ExchangeError(f"the key does not match run {self.run_id!r} in {self.run_dir}: every party must "
                                "hold the same consortium keys file (or, in one process, the same run key)")

    # -- helpers -----------------------------------------------------------------
    def _check_open(self) -> None:
        if self._closed.is_set():
            raise ExchangeError("exchange closed")

    def _limit(self, expect: MessageSpec | None) -> int:
        return min(self.max_bytes, expect.max_bytes) if expect is not None else self.max_bytes

    def _read(self, path: Path, sender: int, round: int, topic: str, limit: int) -> bytes | None:
        """The bytes at ``path``, or None if nothing was published there yet."""
        f = safefs.open_read(self.base, path)
        if f is None:
            return None
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > blob_limit(limit):  # don't read a huge file into memory
                raise MessageRejected(f"rejected message from {describe(sender, round, topic)}: "
                                      f"oversized: {size} bytes, limit {limit} bytes of array data")
            return f.read()

    def _decode(self, blob: bytes, sender: int, round: int, topic: str, expect: MessageSpec | None) -> Payload:
        return decode_checked(self, blob, sender, round, topic, expect)

    def _waiting(self, since: float, told: float, me: int, whom: str, round: int, topic: str) -> float:
        """Tell ``notify`` that ``me`` still waits for ``whom`` (at most every ``notify_interval`` s); when told."""
        now = time.monotonic()
        if self.notify is None or now - told < self.notify_interval:
            return told
        self.notify(f"{self._party(me)}: waiting {now - since:.0f} s for {whom} (stage {self.run_id!r}, round "
                    f"{round}, {topic!r})")
        return now

    def _wait(self, deadline: float | None) -> None:
        delay = self.poll_interval
        if deadline is not None:
            delay = max(0.0, min(delay, deadline - time.monotonic()))
        self._closed.wait(delay)  # close() cuts the sleep short

    def _logged_set(self, sender: int) -> set[tuple[int, str]]:
        """(round, topic) pairs already in ``sender``'s egress log (lock held)."""
        if sender not in self._logged:
            raw = safefs.read(self.base, self._egress_path(sender)) or b""
            self._logged[sender] = {(r["round"], r["topic"]) for r in self._parse_log(raw)}
            # a crash mid-append may leave a torn last line: start on a fresh one
            self._log_needs_newline[sender] = bool(raw) and not raw.endswith(b"\n")
        return self._logged[sender]

    @staticmethod
    def _parse_log(raw: bytes) -> list[dict[str, Any]]:
        out = []
        for line in raw.splitlines():
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # torn line from a crash: that append never completed
        return out

    def _log_egress(self, sender: int, round: int, topic: str, payload: Payload) -> None:
        with self._lock:
            logged = self._logged_set(sender)
            if (round, topic) in logged:
                return
            line = json.dumps(egress_record(self.run_id, sender, round, topic, payload), sort_keys=True) + "\n"
            if self._log_needs_newline[sender]:
                line = "\n" + line
            safefs.append(self.base, self._egress_path(sender), line.encode("utf-8"))
            self._log_needs_newline[sender] = False
            logged.add((round, topic))

    def _deliver(self, sender: int, round: int, topic: str, payload: Payload) -> bool:
        """Publish a message; False if the identical message was already there."""
        self._check_open()
        blob = encode_payload(payload, run_id=self.run_id, sender=sender, round=round, topic=topic, key=self._key,
                              binding=self.binding)
        path = self.message_path(sender, round, topic)
        created = False
        if not safefs.is_file(self.base, path):
            self._log_egress(sender, round, topic, payload)  # write-ahead: see class notes
            created = publish_once(path, blob, base=self.base)
        if not created and safefs.read(self.base, path) != blob:
            raise ExchangeError(f"{describe(sender, round, topic)} already sent a different message "
                                "for this address; a party must never send two different messages")
        if created:
            with self._lock:
                if sender == AGGREGATOR:
                    self.stats.broadcasts += 1
                    self.stats.broadcast_bytes += len(blob)
                else:
                    self.stats.messages += 1
                    self.stats.bytes += len(blob)
        return created

    # -- site side ---------------------------------------------------------------
    def send(self, site: int, round: int, topic: str, payload: Payload) -> None:
        site, round, topic = check_site(self.n_sites, site), check_round(round), check_name("topic", topic)
        self._deliver(site, round, topic, payload)
        self.heartbeat(site)

    def receive(
        self, site: int, round: int, topic: str, *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> Payload:
        site, round, topic = check_site(self.n_sites, site), check_round(round), check_name("topic", topic)
        deadline = None if timeout is None else time.monotonic() + timeout
        path = self.message_path(AGGREGATOR, round, topic)
        limit = self._limit(expect)
        self.heartbeat(site)
        last_beat = since = told = time.monotonic()
        while True:
            self._check_open()
            self._check_failures(site)
            blob = self._read(path, AGGREGATOR, round, topic, limit)
            if blob is not None:
                return self._decode(blob, AGGREGATOR, round, topic, expect)
            told = self._waiting(since, told, site, "the aggregator's broadcast", round, topic)
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise SiteTimeout(receive_timeout_message(site, round, topic, timeout, self.who),
                                  missing=[AGGREGATOR], received={})
            if now - last_beat >= self.heartbeat_interval:
                self.heartbeat(site)
                last_beat = now
            self._wait(deadline)

    def has_sent(self, site: int, round: int, topic: str) -> bool:
        return safefs.is_file(self.base, self.message_path(check_site(self.n_sites, site), check_round(round), topic))

    # -- aggregator side ---------------------------------------------------------
    def gather(
        self, round: int, topic: str, sites: Iterable[int], *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> dict[int, Payload]:
        round, topic = check_round(round), check_name("topic", topic)
        waiting = sorted({check_site(self.n_sites, s) for s in sites})
        deadline = None if timeout is None else time.monotonic() + timeout
        limit = self._limit(expect)
        received: dict[int, Payload] = {}
        since = told = time.monotonic()
        while True:
            self._check_open()
            self._check_failures(AGGREGATOR)
            if waiting:
                told = self._waiting(since, told, AGGREGATOR, ", ".join(self.who(s) for s in waiting), round, topic)
            for s in list(waiting):
                blob = self._read(self.message_path(s, round, topic), s, round, topic, limit)
                if blob is not None:
                    received[s] = self._decode(blob, s, round, topic, expect)
                    waiting.remove(s)
            if not waiting:
                return dict(sorted(received.items()))
            if deadline is not None and time.monotonic() >= deadline:
                raise SiteTimeout(gather_timeout_message(round, topic, waiting, timeout, self.who),
                                  missing=waiting, received=received)
            self._wait(deadline)

    def broadcast(self, round: int, topic: str, payload: Payload) -> None:
        self._deliver(AGGREGATOR, check_round(round), check_name("topic", topic), payload)

    def has_broadcast(self, round: int, topic: str) -> bool:
        return safefs.is_file(self.base, self.message_path(AGGREGATOR, check_round(round), topic))

    # -- liveness and audit ------------------------------------------------------
    def heartbeat(self, site: int) -> None:
        safefs.touch(self.base, self._alive_path(check_site(self.n_sites, site)))

    def alive(self) -> set[int]:
        """Sites whose heartbeat (refreshed on every send and while waiting) is recent.

        Compares file modification times with this machine's clock, so parties
        on different machines need roughly synchronised clocks.
        """
        now, out = time.time(), set()
        for s in range(self.n_sites):
            st = safefs.status(self.base, self._alive_path(s))
            if st is not None and now - st.st_mtime <= self.liveness_timeout:
                out.add(s)
        return out

    def egress_log(self, site: int) -> list[dict[str, Any]]:
        """Records of every message ``site`` sent, oldest first (``AGGREGATOR``: the broadcasts)."""
        if site != AGGREGATOR:
            site = check_site(self.n_sites, site)
        return self._parse_log(safefs.read(self.base, self._egress_path(site)) or b"")

    def close(self) -> None:
        self._closed.set()

    @property
    def closed(self) -> bool:
        return self._closed.is_set()


class DirectoryCheckpoint:
    """A party's checkpoint as one ``.npz`` file (see :func:`~dpneuro.protocol.exchange.codec.save_state_file`).

    Parameters
    ----------
    path : path-like
        The checkpoint file; its folder is created on the first save.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)

    def load(self) -> dict[str, Any] | None:
        """The last saved record, or None if nothing was saved yet."""
        if not self.path.exists():
            return None
        return load_state_file(self.path)

    def save(self, record: dict[str, Any]) -> None:
        """Replace the checkpoint with ``record`` atomically."""
        save_state_file(self.path, record)

    def __repr__(self) -> str:
        return f"DirectoryCheckpoint({str(self.path)!r})"
