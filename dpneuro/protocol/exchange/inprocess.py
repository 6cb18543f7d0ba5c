"""In-process exchange: every party is a thread of one Python process.

Messages are still encoded and authenticated with :mod:`dpneuro.protocol.exchange.codec`,
so a simulation exercises the very checks (tag, address, dtype, size, spec) a
multi-process run does.
"""

from __future__ import annotations

import operator
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from dpneuro.protocol.exchange.base import (
    AGGREGATOR,
    Exchange,
    ExchangeError,
    MessageRejected,
    MessageSpec,
    Payload,
    SiteTimeout,
    describe,
    egress_record,
    party,
    validate,
)
from dpneuro.protocol.exchange.codec import check_name, decode_payload, encode_payload

DEFAULT_MAX_BYTES = 256 * 1024 * 1024


@dataclass
class ExchangeStats:
    """Traffic counters (first deliveries only; idempotent re-sends are not counted)."""

    messages: int = 0  # site -> aggregator
    bytes: int = 0
    broadcasts: int = 0  # aggregator -> sites
    broadcast_bytes: int = 0


def check_site(n_sites: int, site: int) -> int:
    """Return ``site`` if it is a valid site id for ``n_sites`` sites, else raise ``ValueError``."""
    if isinstance(site, bool) or not hasattr(site, "__index__"):
        raise ValueError(f"site id must be an integer, got {site!r}")
    site = operator.index(site)
    if not 0 <= site < n_sites:
        raise ValueError(f"site id {site} out of range for {n_sites} sites")
    return site


def check_round(round: int) -> int:
    """Return ``round`` as an int if it is a non-negative integer, else raise ``ValueError``."""
    if isinstance(round, bool) or not hasattr(round, "__index__") or operator.index(round) < 0:
        raise ValueError(f"round must be a non-negative integer, got {round!r}")
    return operator.index(round)


def decode_checked(ex, blob: bytes, sender: int, round: int, topic: str, expect: MessageSpec | None) -> Payload:
    """Decode and check a message read by exchange ``ex``; a rejection names the sender by its site name."""
    try:
        payload = decode_payload(blob, run_id=ex.run_id, sender=sender, round=round, topic=topic,
                                 key=ex._key, max_bytes=ex._limit(expect), binding=ex.binding)
        return validate(payload, expect, sender, round, topic)
    except MessageRejected as exc:
        if ex.site_names is None:
            raise
        # the codec names the sender by id; the reader knows the sites by name
        raise MessageRejected(str(exc).replace(describe(sender, round, topic),
                                               describe(sender, round, topic, ex.site_names), 1)) from exc


def check_site_names(n_sites: int, site_names: Sequence[str] | None) -> list[str] | None:
    """``site_names`` as a list if they are ``n_sites`` distinct valid names (not 'aggregator'), else ValueError."""
    if site_names is None:
        return None
    names = [check_name("site name", n) for n in site_names]
    if len(names) != int(n_sites) or len(set(names)) != len(names) or "aggregator" in names:
        raise ValueError(f"site_names must be {n_sites} distinct names (not 'aggregator'), got {names}")
    return names


def gather_timeout_message(round: int, topic: str, missing: Iterable[int], timeout: float | None,
                           who=None) -> str:
    """The aggregator's timeout: the sites that did not send are named, not the aggregator that waited.
    ``who(party)`` names a party (default :func:`~dpneuro.protocol.exchange.base.party`: ``site <id>``)."""
    who = who or party
    missing = sorted(missing)
    return (", ".join(who(s) for s in missing) + f" did not send round {round}, topic {topic!r} within {timeout} s "
            f"(reported by {who(AGGREGATOR)}, which waited for it)")


def receive_timeout_message(site: int, round: int, topic: str, timeout: float | None, who=None) -> str:
    """A site's timeout: the aggregator was slow; the site that waited only reports it."""
    who = who or party
    return (f"{who(AGGREGATOR)} did not broadcast round {round}, topic {topic!r} within {timeout} s "
            f"(reported by {who(site)}, which waited for it)")


class InProcessExchange(Exchange):
    """Threads and condition variables; messages live in memory as encoded bytes.

    Parameters
    ----------
    n_sites : int
        Number of sites (ids ``0 .. n_sites - 1``).
    run_id : str, optional
        Defaults to a fresh ``uuid4().hex``.
    key : bytes, optional
        HMAC key for the run; defaults to 32 random bytes.
    max_bytes : int
        Largest array payload accepted on receipt.
    liveness_timeout : float
        Seconds after which a silent site is no longer reported by :meth:`alive`.
    site_names : sequence of str, optional
        The sites' names, by id: errors then name a site ``site 'site-02'`` instead of by its 0-based id.

    Notes
    -----
    A receive that times out raises :class:`SiteTimeout` with
    ``missing == [AGGREGATOR]``. After :meth:`close` every blocked or later
    call raises ``ExchangeError("exchange closed")``; the egress logs stay
    readable.
    """

    #: parties in one process share no run manifest: messages are not bound to one (codec.run_binding)
    binding: str | None = None

    def __init__(
        self, n_sites: int, *, run_id: str | None = None, key: bytes | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES, liveness_timeout: float = 60.0,
        site_names: Sequence[str] | None = None,
    ) -> None:
        if int(n_sites) < 1:
            raise ValueError(f"n_sites must be >= 1, got {n_sites}")
        self.n_sites = int(n_sites)
        self.site_names = check_site_names(self.n_sites, site_names)
        self.run_id = check_name("run id", run_id if run_id is not None else uuid.uuid4().hex)
        self._key = bytes(key) if key is not None else os.urandom(32)
        if len(self._key) < 16:
            raise ValueError("the run key must be bytes of length >= 16")
        self.max_bytes = int(max_bytes)
        self.liveness_timeout = float(liveness_timeout)
        self.stats = ExchangeStats()
        self._cond = threading.Condition()
        self._sent: dict[tuple[int, str, int], bytes] = {}  # (round, topic, site)
        self._broadcasts: dict[tuple[int, str], bytes] = {}  # (round, topic)
        self._egress: dict[int, list[dict[str, Any]]] = {s: [] for s in range(self.n_sites)}
        self._egress[AGGREGATOR] = []
        self._last_seen: dict[int, float] = {}
        self._closed = False

    # -- helpers -----------------------------------------------------------------
    def who(self, sender: int) -> str:
        """The party as errors name it: ``the aggregator``, ``site 'site-02'`` with site names, else ``site 1``."""
        return party(sender, self.site_names)

    def _check_open(self) -> None:
        if self._closed:
            raise ExchangeError("exchange closed")

    def _seen(self, site: int) -> None:
        self._last_seen[site] = time.monotonic()

    def _limit(self, expect: MessageSpec | None) -> int:
        return min(self.max_bytes, expect.max_bytes) if expect is not None else self.max_bytes

    def _decode(self, blob: bytes, sender: int, round: int, topic: str, expect: MessageSpec | None) -> Payload:
        return decode_checked(self, blob, sender, round, topic, expect)

    def _store(self, table: dict, addr: tuple, blob: bytes, sender: int, round: int, topic: str) -> bool:
        """Store ``blob`` at ``addr`` (lock held); False if the same bytes were already there."""
        old = table.get(addr)
        if old is not None:
            if old == blob:
                return False
            raise ExchangeError(f"{describe(sender, round, topic, self.site_names)} already sent a different "
                                "message for this address; a party must never send two different messages")
        table[addr] = blob
        return True

    # -- site side ---------------------------------------------------------------
    def send(self, site: int, round: int, topic: str, payload: Payload) -> None:
        site, round, topic = check_site(self.n_sites, site), check_round(round), check_name("topic", topic)
        blob = encode_payload(payload, run_id=self.run_id, sender=site, round=round, topic=topic, key=self._key)
        with self._cond:
            self._check_open()
            self._seen(site)
            if self._store(self._sent, (round, topic, site), blob, site, round, topic):
                self._egress[site].append(egress_record(self.run_id, site, round, topic, payload))
                self.stats.messages += 1
                self.stats.bytes += len(blob)
                self._cond.notify_all()

    def receive(
        self, site: int, round: int, topic: str, *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> Payload:
        site, round, topic = check_site(self.n_sites, site), check_round(round), check_name("topic", topic)
        addr = (round, topic)
        with self._cond:
            self._seen(site)
            ok = self._cond.wait_for(lambda: self._closed or addr in self._broadcasts, timeout)
            self._check_open()
            if not ok:
                raise SiteTimeout(receive_timeout_message(site, round, topic, timeout, self.who),
                                  missing=[AGGREGATOR], received={})
            self._seen(site)
            blob = self._broadcasts[addr]
        return self._decode(blob, AGGREGATOR, round, topic, expect)

    def has_sent(self, site: int, round: int, topic: str) -> bool:
        with self._cond:
            return (int(round), topic, int(site)) in self._sent

    # -- aggregator side ---------------------------------------------------------
    def gather(
        self, round: int, topic: str, sites: Iterable[int], *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> dict[int, Payload]:
        round, topic = check_round(round), check_name("topic", topic)
        wanted = sorted({check_site(self.n_sites, s) for s in sites})
        with self._cond:
            self._cond.wait_for(
                lambda: self._closed or all((round, topic, s) in self._sent for s in wanted), timeout)
            self._check_open()
            blobs = {s: self._sent[(round, topic, s)] for s in wanted if (round, topic, s) in self._sent}
        received = {s: self._decode(b, s, round, topic, expect) for s, b in blobs.items()}
        missing = [s for s in wanted if s not in received]
        if missing:
            raise SiteTimeout(gather_timeout_message(round, topic, missing, timeout, self.who),
                              missing=missing, received=received)
        return received

    def broadcast(self, round: int, topic: str, payload: Payload) -> None:
        round, topic = check_round(round), check_name("topic", topic)
        blob = encode_payload(payload, run_id=self.run_id, sender=AGGREGATOR, round=round, topic=topic,
                              key=self._key)
        with self._cond:
            self._check_open()
            if self._store(self._broadcasts, (round, topic), blob, AGGREGATOR, round, topic):
                self._egress[AGGREGATOR].append(egress_record(self.run_id, AGGREGATOR, round, topic, payload))
                self.stats.broadcasts += 1
                self.stats.broadcast_bytes += len(blob)
                self._cond.notify_all()

    def has_broadcast(self, round: int, topic: str) -> bool:
        with self._cond:
            return (int(round), topic) in self._broadcasts

    # -- liveness and audit ------------------------------------------------------
    def heartbeat(self, site: int) -> None:
        site = check_site(self.n_sites, site)
        with self._cond:
            self._seen(site)

    def alive(self) -> set[int]:
        now = time.monotonic()
        with self._cond:
            return {s for s, t in self._last_seen.items() if now - t <= self.liveness_timeout}

    def egress_log(self, site: int) -> list[dict[str, Any]]:
        """Records of every message ``site`` sent, oldest first (``AGGREGATOR``: the broadcasts)."""
        if site != AGGREGATOR:
            site = check_site(self.n_sites, site)
        with self._cond:
            return [dict(r) for r in self._egress[site]]

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    @property
    def closed(self) -> bool:
        return self._closed
