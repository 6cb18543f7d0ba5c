"""The COINSTAC exchange: messages as files that COINSTAC moves between iterations.

COINSTAC runs a computation one iteration at a time: each party writes files
to its transfer folder and reads what the others sent from its input folder.
A party that must wait for a message the current iteration has not brought
raises :class:`~dpneuro.protocol.exchange.base.Suspend`; the computation
(:mod:`dpneuro.deploy.coinstac`) returns control to COINSTAC and resumes at
the next iteration from the state it keeps in files.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from dpneuro.protocol.exchange.base import (
    AGGREGATOR,
    Exchange,
    ExchangeError,
    MessageSpec,
    Payload,
    Suspend,
    describe,
    egress_record,
    validate,
)
from dpneuro.protocol.exchange.codec import authenticator, blob_limit, check_name, decode_payload, encode_payload

__all__ = ["MAX_MESSAGE_BYTES", "SUFFIX", "CoinstacExchange", "message_name"]

#: COINSTAC moves files between iterations; keep each message below this
MAX_MESSAGE_BYTES = 10 * 1024 * 1024
SUFFIX = ".dpnx"


def _party(sender: int) -> str:
    return "aggregator" if sender == AGGREGATOR else f"site-{sender:03d}"


def message_name(run_id: str, round: int, topic: str, sender: int) -> str:
    """File name of a message: readable, flat (COINSTAC moves files, not folders) and unique per address."""
    party = _party(sender)
    h = hashlib.sha256(f"{run_id}\0{round}\0{topic}\0{party}".encode()).hexdigest()[:12]
    return f"{run_id}.r{round:06d}.{topic}.{party}.{h}{SUFFIX}"


def _put(path: Path, blob: bytes) -> None:
    """Write ``blob`` to ``path`` atomically (COINSTAC may move the folder's files at any time)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    tmp.write_bytes(blob)
    tmp.replace(path)


class CoinstacExchange(Exchange):
    """An :class:`~dpneuro.protocol.exchange.Exchange` over COINSTAC's transfer and base directories.

    Parameters
    ----------
    run_id : str
        The stage (``"reduce"``, ``"unmix"``, ``"summary"``); part of every address.
    key : PartyKeys or bytes
        This party's signing key and every party's public key (:mod:`dpneuro.protocol.exchange.keys`), or an HMAC key
        the parties share (tests).
    n_sites : int
    base_dir, transfer_dir : path
        The party's ``state.baseDirectory`` and ``state.transferDirectory``.
    state_dir : path
        Private folder of this party for the egress log and the record of
        what was sent (files moved away by COINSTAC leave no trace otherwise).
    site : int, optional
        For a site: its id. Omit for the remote.
    site_dirs : list of str, optional
        For the remote: the folder (``clientId``) of each site id under ``base_dir``.
    max_bytes : int
        Largest encoded message (COINSTAC: < 10 MB).
    binding : str, optional
        The run every message is bound to (:func:`~dpneuro.protocol.exchange.codec.run_binding` of the run
        manifest): a message of another run is refused as replayed. None: no binding (tests without a manifest).

    Notes
    -----
    ``receive``/``gather`` never wait: a missing message raises
    :class:`~dpneuro.protocol.exchange.Suspend` (``suspends = True``).
    """

    suspends = True

    def __init__(self, *, run_id: str, key, n_sites: int, base_dir, transfer_dir, state_dir,
                 site: int | None = None, site_dirs: Iterable[str] | None = None,
                 max_bytes: int = MAX_MESSAGE_BYTES, binding: str | None = None) -> None:
        authenticator(key)  # bytes of >= 16 or PartyKeys, else ValueError
        self.run_id = check_name("run id", run_id)
        self.binding = binding
        self.n_sites = int(n_sites)
        self.base_dir, self.transfer_dir, self.state_dir = Path(base_dir), Path(transfer_dir), Path(state_dir)
        self.site = site
        self.site_dirs = list(site_dirs) if site_dirs is not None else None
        if self.site_dirs is not None and len(self.site_dirs) != self.n_sites:
            raise ValueError(f"{len(self.site_dirs)} site folders for {self.n_sites} sites")
        self.max_bytes = int(max_bytes)
        self._key = bytes(key) if isinstance(key, (bytes, bytearray)) else key
        self._lock = threading.Lock()
        for sub in ("sent", "egress"):
            (self.state_dir / sub).mkdir(parents=True, exist_ok=True)

    # -- helpers ---------------------------------------------------------------------------
    def _inbox(self, sender: int) -> Path:
        if sender == AGGREGATOR:
            return self.base_dir
        if self.site_dirs is None:
            raise ExchangeError("only the remote reads the sites' messages")
        return self.base_dir / self.site_dirs[sender]

    def _egress_path(self, sender: int) -> Path:
        return self.state_dir / "egress" / f"{_party(sender)}.jsonl"

    def _deliver(self, sender: int, round: int, topic: str, payload: Payload) -> None:
        topic = check_name("topic", topic)
        name = message_name(self.run_id, round, topic, sender)
        blob = encode_payload(payload, run_id=self.run_id, sender=sender, round=round, topic=topic, key=self._key,
                              binding=self.binding)
        if len(blob) > self.max_bytes:
            raise ExchangeError(f"message from {describe(sender, round, topic)} is {len(blob) / 2**20:.1f} MB; "
                                f"COINSTAC messages must stay below {self.max_bytes / 2**20:.0f} MB (use parcels or "
                                "reduction = 'capepca-power' to shrink the PCA release)")
        marker = self.state_dir / "sent" / name
        with self._lock:
            if not marker.exists():
                # egress log first (write-ahead): a message can never leave unlogged
                line = json.dumps(egress_record(self.run_id, sender, round, topic, payload), sort_keys=True)
                with open(self._egress_path(sender), "a", encoding="utf-8") as f:
                    f.write(line + "\n")
            _put(self.transfer_dir / name, blob)
            _put(marker, blob)  # the bytes themselves: a message COINSTAC loses can be sent again unchanged

    def resend(self, sender: int, round: int, topic: str) -> bool:
        """Put an already sent message into the transfer folder again (the same bytes: no new release).

        Returns False if ``sender`` never sent it (then there is nothing to resend).
        """
        name = message_name(self.run_id, round, check_name("topic", topic), sender)
        marker = self.state_dir / "sent" / name
        if not marker.is_file() or marker.stat().st_size == 0:
            return False
        _put(self.transfer_dir / name, marker.read_bytes())
        return True

    def _read(self, sender: int, round: int, topic: str, expect: MessageSpec | None) -> Payload | None:
        path = self._inbox(sender) / message_name(self.run_id, round, topic, sender)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return None
        limit = min(self.max_bytes, expect.max_bytes) if expect is not None else self.max_bytes
        if size > blob_limit(limit):
            raise ExchangeError(f"rejected message from {describe(sender, round, topic)}: {size} bytes")
        payload = decode_payload(path.read_bytes(), run_id=self.run_id, sender=sender, round=round, topic=topic,
                                 key=self._key, max_bytes=limit, binding=self.binding)
        return validate(payload, expect, sender, round, topic)

    # -- site side -------------------------------------------------------------------------
    def send(self, site: int, round: int, topic: str, payload: Payload) -> None:
        self._deliver(site, round, topic, payload)

    def receive(self, site: int, round: int, topic: str, *, timeout: float | None = None,
                expect: MessageSpec | None = None) -> Payload:
        got = self._read(AGGREGATOR, round, topic, expect)
        if got is None:
            raise Suspend(f"site {site} waits for the aggregator's {topic!r} of round {round}",
                          round=round, topic=topic, run_id=self.run_id)
        return got

    def has_sent(self, site: int, round: int, topic: str) -> bool:
        return (self.state_dir / "sent" / message_name(self.run_id, round, topic, site)).exists()

    # -- aggregator side -------------------------------------------------------------------
    def gather(self, round: int, topic: str, sites: Iterable[int], *, timeout: float | None = None,
               expect: MessageSpec | None = None) -> dict[int, Payload]:
        got, missing = {}, []
        for s in sorted(set(sites)):
            p = self._read(s, round, topic, expect)
            if p is None:
                missing.append(s)
            else:
                got[s] = p
        if missing:
            names = [self.site_dirs[m] for m in missing] if self.site_dirs else missing
            raise Suspend(f"the aggregator waits for {topic!r} of round {round} (stage {self.run_id!r}) from "
                          f"sites {names}", round=round, topic=topic, run_id=self.run_id, missing=missing)
        return got

    def broadcast(self, round: int, topic: str, payload: Payload) -> None:
        self._deliver(AGGREGATOR, round, topic, payload)

    def has_broadcast(self, round: int, topic: str) -> bool:
        return (self.state_dir / "sent" / message_name(self.run_id, round, topic, AGGREGATOR)).exists()

    # -- liveness and audit ----------------------------------------------------------------
    def alive(self) -> set[int]:
        return set(range(self.n_sites))  # COINSTAC keeps the sites in lock-step

    def egress_log(self, site: int) -> list[dict[str, Any]]:
        path = self._egress_path(site)
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# -- inputs, state folders, the manifest key --------------------------------------------------
