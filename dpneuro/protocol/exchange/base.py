"""The exchange interface: how protocol messages move between sites and the aggregator.

A run has ``n_sites`` sites (numbered ``0 .. n_sites - 1``) and one aggregator.
Messages are addressed by ``(run_id, round, topic, sender)``. Sites *send* to the
aggregator, the aggregator *gathers* one message per site and *broadcasts* one
reply that every site *receives*. Backends move bytes; they never contain
algorithm logic.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpneuro._utils.errors import DpneuroError

AGGREGATOR = -1  # sender id of the aggregator


class ExchangeError(DpneuroError, RuntimeError):
    """A message could not be delivered, or was rejected on receipt."""


class MessageRejected(ExchangeError):
    """A message failed authentication or its declared shape/dtype/size check."""


class Suspend(Exception):
    """The message a party waits for is not there yet, and this backend cannot wait for it.

    Raised by exchanges whose messages move *between* invocations of a party
    (COINSTAC: files a party writes now are delivered before its next
    iteration). It is not an :class:`ExchangeError`: nothing went wrong. The
    driver lets it propagate; by then :func:`dpneuro.protocol.driver.run_site` and
    :func:`~dpneuro.protocol.driver.run_aggregator` have written everything to their
    checkpoint (a site's outgoing message is written ahead of sending), so
    calling them again with the same checkpoint resumes exactly where they
    stopped, without recomputing or redrawing anything.
    """

    def __init__(self, message: str, *, round: int | None = None, topic: str | None = None,
                 run_id: str | None = None, missing: list[int] | None = None):
        super().__init__(message)
        self.round = round
        self.topic = topic
        self.run_id = run_id  # the exchange's run (a stage of a deployed run)
        self.missing = list(missing) if missing is not None else None  # aggregator: the sites not heard from


class PartyFailed(ExchangeError):
    """Another party of the run stopped with an error (the message names it and says why)."""


class SiteTimeout(ExchangeError):
    """Some sites did not deliver before the timeout.

    ``received`` holds what did arrive, so the caller can continue with survivors.
    """

    def __init__(self, message: str, missing: Iterable[int], received: Mapping[int, "Payload"]):
        super().__init__(message)
        self.missing = sorted(missing)
        self.received = dict(received)


@dataclass(frozen=True)
class Payload:
    """One message: named numpy arrays plus small JSON-safe metadata.

    ``carries`` says, per array, what protects it on the way out of a site
    (for example ``"cape-noise"``, ``"secagg-mask"``, ``"public"``); it is what
    the egress log records and what the egress audit checks.
    """

    arrays: Mapping[str, np.ndarray] = field(default_factory=dict)
    meta: Mapping[str, Any] = field(default_factory=dict)
    carries: Mapping[str, str] = field(default_factory=dict)

    def nbytes(self) -> int:
        return int(sum(np.asarray(a).nbytes for a in self.arrays.values()))


@dataclass(frozen=True)
class ArraySpec:
    """What a protocol step declares about one array it expects.

    ``shape`` entries of ``None`` match any length along that axis.
    """

    dtype: str
    shape: tuple[int | None, ...]

    def check(self, name: str, arr: np.ndarray) -> str | None:
        if np.dtype(arr.dtype) != np.dtype(self.dtype):
            return f"array {name!r} has dtype {arr.dtype}, expected {np.dtype(self.dtype)}"
        if len(arr.shape) != len(self.shape) or any(
            want is not None and want != got for want, got in zip(self.shape, arr.shape)
        ):
            return f"array {name!r} has shape {arr.shape}, expected {self.shape}"
        return None


@dataclass(frozen=True)
class MessageSpec:
    """Declared contents of a message: required arrays and a size ceiling."""

    arrays: Mapping[str, ArraySpec] = field(default_factory=dict)
    max_bytes: int = 256 * 1024 * 1024
    allow_extra: bool = False

    def problems(self, payload: Payload) -> list[str]:
        out = []
        if payload.nbytes() > self.max_bytes:
            out.append(f"payload is {payload.nbytes()} bytes, limit {self.max_bytes}")
        for name, spec in self.arrays.items():
            if name not in payload.arrays:
                out.append(f"array {name!r} missing")
                continue
            msg = spec.check(name, np.asarray(payload.arrays[name]))
            if msg:
                out.append(msg)
        if not self.allow_extra:
            extra = set(payload.arrays) - set(self.arrays)
            if extra:
                out.append(f"unexpected arrays {sorted(extra)}")
        return out


def party(sender: int, names: Sequence[str] | None = None) -> str:
    """A party as errors name it: ``the aggregator``; a site by its name when the names are known
    (``site 'site-02'``), else by its 0-based id (``site 1``)."""
    if sender == AGGREGATOR:
        return "the aggregator"
    return f"site {names[sender]!r}" if names is not None else f"site {sender}"


def describe(sender: int, round: int, topic: str, names: Sequence[str] | None = None) -> str:
    """``sender``'s message of ``(round, topic)`` in words; ``names``: the sites' names, by id."""
    who = "aggregator" if sender == AGGREGATOR else party(sender, names)
    return f"{who}, round {round}, topic {topic!r}"


def validate(payload: Payload, spec: MessageSpec | None, sender: int, round: int, topic: str) -> Payload:
    """Raise :class:`MessageRejected` naming the message if ``payload`` breaks ``spec``."""
    if spec is None:
        return payload
    problems = spec.problems(payload)
    if problems:
        raise MessageRejected(f"rejected message from {describe(sender, round, topic)}: " + "; ".join(problems))
    return payload


class Exchange(ABC):
    """Moves :class:`Payload` messages for one run.

    Site side: :meth:`send` then :meth:`receive`. Aggregator side: :meth:`gather`
    then :meth:`broadcast`. ``expect`` declares what the receiving step will
    accept; anything else is rejected with :class:`MessageRejected`.
    """

    run_id: str
    n_sites: int
    #: True for backends that raise :class:`Suspend` instead of waiting; the
    #: driver then refuses to run a party without a checkpoint to resume from
    suspends: bool = False

    # -- site side ---------------------------------------------------------------
    @abstractmethod
    def send(self, site: int, round: int, topic: str, payload: Payload) -> None:
        """Deliver ``payload`` from ``site`` to the aggregator (idempotent per address)."""

    @abstractmethod
    def receive(
        self, site: int, round: int, topic: str, *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> Payload:
        """Block until the aggregator's broadcast for ``(round, topic)`` arrives."""

    @abstractmethod
    def has_sent(self, site: int, round: int, topic: str) -> bool:
        """Whether ``site`` already delivered a message for ``(round, topic)``."""

    # -- aggregator side ---------------------------------------------------------
    @abstractmethod
    def gather(
        self, round: int, topic: str, sites: Iterable[int], *, timeout: float | None = None,
        expect: MessageSpec | None = None,
    ) -> dict[int, Payload]:
        """Collect one message per site in ``sites``; :class:`SiteTimeout` if some never come."""

    @abstractmethod
    def broadcast(self, round: int, topic: str, payload: Payload) -> None:
        """Deliver ``payload`` to every site (idempotent per address)."""

    @abstractmethod
    def has_broadcast(self, round: int, topic: str) -> bool:
        """Whether the aggregator already broadcast for ``(round, topic)``."""

    # -- liveness and audit ------------------------------------------------------
    @abstractmethod
    def alive(self) -> set[int]:
        """Sites that have shown a sign of life recently (heartbeat or message)."""

    def heartbeat(self, site: int) -> None:  # noqa: B027 - optional for backends
        """Record that ``site`` is alive."""

    @abstractmethod
    def egress_log(self, site: int) -> list[dict[str, Any]]:
        """Every message ``site`` sent: run, round, topic, array shapes, what each carries."""

    def close(self) -> None:  # noqa: B027
        """Release resources (threads, files)."""


def egress_record(run_id: str, site: int, round: int, topic: str, payload: Payload) -> dict[str, Any]:
    """The egress-log line for one outgoing site message."""
    return {
        "run": run_id,
        "site": site,
        "round": round,
        "topic": topic,
        "arrays": {
            name: {
                "shape": list(np.shape(a)),
                "dtype": str(np.asarray(a).dtype),
                "carries": payload.carries.get(name, ""),
            }
            for name, a in payload.arrays.items()
        },
    }
