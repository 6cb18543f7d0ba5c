"""The generic protocol driver.

A protocol is written once as explicit *phases*. In each phase every active
site computes a message from its private state and the aggregator's previous
broadcast (:attr:`Phase.site`), and the aggregator turns the gathered messages
into one broadcast (:attr:`Phase.aggregator`). A round is the protocol's list
of phases; rounds repeat until the aggregator's broadcast carries
``meta["stop"] = True`` or ``max_rounds`` is reached.

The same :func:`run_site` and :func:`run_aggregator` loops run in a simulation
(threads over an in-process exchange, :mod:`dpneuro.protocol.simulation`), in separate site processes (directory
exchange) and inside the COINSTAC entry point. Algorithms never see a backend.

Control flags in a broadcast's ``meta``:

``stop``      end the run after this phase.
``goto``      next phase index within the same round (used to redo a phase
              among survivors after a dropout).
``active``    list of site ids that take part from now on.

State is a plain dict. Keys starting with ``_`` are transient: the site's data
and anything derived from it. They are never checkpointed; ``site_init``
rebuilds them when a party restarts.

Suspending: an exchange whose messages move between invocations of a party
(``exchange.suspends``, e.g. COINSTAC's, where each iteration is one call)
raises :class:`~dpneuro.protocol.exchange.Suspend` from ``receive``/``gather`` when the
awaited message is not there yet. :func:`run_site` and :func:`run_aggregator`
let it propagate: their checkpoint already holds everything (state, position
and, for a site, the outgoing message written ahead of sending), so the next
call with the same checkpoint resumes at that very phase. Such an exchange
therefore requires a checkpoint.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any
from typing import Protocol as TypingProtocol

from dpneuro._utils.errors import DpneuroError
from dpneuro._utils.progressbar import progress_bar
from dpneuro.protocol.exchange.base import Exchange, MessageSpec, Payload, SiteTimeout

State = dict[str, Any]
SpecLike = MessageSpec | Callable[[State, int], MessageSpec] | None


@dataclass(frozen=True)
class Phase:
    """One message exchange: every active site -> aggregator -> every site."""

    topic: str
    site: Callable[[State, int, Payload | None], Payload]
    aggregator: Callable[[State, int, dict[int, Payload]], Payload]
    # what the aggregator accepts from a site, and what a site accepts back
    site_spec: SpecLike = None
    broadcast_spec: SpecLike = None
    # when True, sites that miss the timeout are dropped from ``state["active"]``
    # and the aggregator step runs on the survivors' messages
    allow_dropout: bool = False


class PhasedProtocol(TypingProtocol):
    """What the driver needs from an algorithm."""

    name: str
    max_rounds: int

    def phases(self, round: int) -> Sequence[Phase]: ...

    def site_init(self, site: int, data: Any) -> State: ...

    def aggregator_init(self) -> State: ...


class Checkpoint(TypingProtocol):
    """Durable store for one party's progress (see ``dpneuro.protocol.exchange``)."""

    def load(self) -> dict[str, Any] | None: ...

    def save(self, record: dict[str, Any]) -> None: ...


class SiteDropped(DpneuroError, RuntimeError):
    """The aggregator continued without this site (it missed a deadline)."""


@dataclass
class RunOptions:
    timeout: float | None = 600.0  # seconds to wait for any one message
    progress: bool = False
    description: str = ""
    on_dropout: Callable[[State, int, int, list[int], dict[int, Payload]], Payload] | None = None


def _address(topic: str, attempt: int) -> str:
    """Topic on the wire: a redone phase gets a fresh address, so it never meets its old messages."""
    return topic if attempt == 0 else f"{topic}.retry{attempt}"


def _advance(meta: dict, idx: int, attempt: int) -> tuple[int, int]:
    """Next phase index and attempt number after a broadcast."""
    if "goto" in meta:
        return int(meta["goto"]), attempt + 1
    return idx + 1, attempt


def _spec(spec: SpecLike, state: State, round: int) -> MessageSpec | None:
    return spec(state, round) if callable(spec) else spec


def _require_checkpoint(exchange: Exchange, checkpoint: Checkpoint | None, who: str) -> None:
    if getattr(exchange, "suspends", False) and checkpoint is None:
        raise ValueError(f"{type(exchange).__name__} suspends parties between invocations, so {who} "
                         "needs a checkpoint to resume from (pass checkpoint=...)")


def run_site(
    protocol: PhasedProtocol,
    site: int,
    data: Any,
    exchange: Exchange,
    *,
    checkpoint: Checkpoint | None = None,
    timeout: float | None = 600.0,
) -> State:
    """Run one site's side of ``protocol`` to completion; return its final state.

    With a ``checkpoint`` the site writes its state and the outgoing message
    *before* sending (write-ahead), so a restarted site re-sends the very same
    message instead of computing (and drawing noise for) it again.

    Raises
    ------
    Suspend
        From a suspending exchange when the broadcast is not there yet; call
        again with the same checkpoint to continue (see the module notes).
    """
    _require_checkpoint(exchange, checkpoint, f"site {site}")
    record = checkpoint.load() if checkpoint is not None else None
    attempt = 0  # how often the current round has been sent back (``goto``)
    if record is None:
        state = protocol.site_init(site, data)
        rnd, idx, pending, incoming = 0, 0, None, None
    else:
        # transient keys ("_"-prefixed: data and what is derived from it) are
        # never checkpointed, so rebuild them and lay the saved state on top
        state = protocol.site_init(site, data)
        state.update(record["state"])
        rnd, idx, attempt = record["round"], record["phase"], record.get("attempt", 0)
        pending, incoming = record.get("pending"), record.get("incoming")
        if record.get("done"):
            state["final"] = incoming
            return state
    names = getattr(exchange, "site_names", None)
    if names:  # a site's refusals name it as the consortium knows it
        state.setdefault("site_name", f"site {names[site]!r}")

    while rnd < protocol.max_rounds:
        phases = protocol.phases(rnd)
        while idx < len(phases):
            ph = phases[idx]
            topic = _address(ph.topic, attempt)
            if pending is None:
                pending = ph.site(state, rnd, incoming)
                if checkpoint is not None:
                    checkpoint.save({"state": state, "round": rnd, "phase": idx, "attempt": attempt,
                                     "pending": pending, "incoming": incoming})
            if not exchange.has_sent(site, rnd, topic):
                exchange.send(site, rnd, topic, pending)
            incoming = exchange.receive(site, rnd, topic, timeout=timeout,
                                        expect=_spec(ph.broadcast_spec, state, rnd))
            pending = None
            meta = incoming.meta
            if meta.get("stop"):
                if checkpoint is not None:
                    checkpoint.save({"state": state, "round": rnd, "phase": idx, "done": True,
                                     "pending": None, "incoming": incoming})
                state["final"] = incoming
                return state
            if "active" in meta and site not in meta["active"]:
                raise SiteDropped(f"site {site} was dropped from the run at round {rnd}, topic {topic!r}")
            idx, attempt = _advance(meta, idx, attempt)
            if checkpoint is not None:
                nxt = (rnd, idx, attempt) if idx < len(phases) else (rnd + 1, 0, 0)
                checkpoint.save({"state": state, "round": nxt[0], "phase": nxt[1], "attempt": nxt[2],
                                 "pending": None, "incoming": incoming})
        rnd, idx, attempt = rnd + 1, 0, 0
    state["final"] = incoming
    return state


def run_aggregator(
    protocol: PhasedProtocol,
    exchange: Exchange,
    *,
    checkpoint: Checkpoint | None = None,
    options: RunOptions | None = None,
) -> State:
    """Run the aggregator's side of ``protocol``; return its final state.

    A restarted aggregator resumes from its checkpoint and re-broadcasts a
    reply it had already computed rather than recomputing it.

    Raises
    ------
    Suspend
        From a suspending exchange when some site's message is not there yet;
        call again with the same checkpoint to continue.
    """
    _require_checkpoint(exchange, checkpoint, "the aggregator")
    opts = options or RunOptions()
    record = checkpoint.load() if checkpoint is not None else None
    if record is None:
        state = protocol.aggregator_init()
        state.setdefault("active", list(range(exchange.n_sites)))
        state.setdefault("site_names", getattr(exchange, "site_names", None))  # to name a site that is refused
        rnd, idx, attempt, pending = 0, 0, 0, None
    else:
        state = protocol.aggregator_init()
        state.update(record["state"])
        rnd, idx, pending = record["round"], record["phase"], record.get("pending")
        attempt = record.get("attempt", 0)
        if record.get("done"):
            return state

    bar = progress_bar(total=protocol.max_rounds, initial=rnd, enabled=opts.progress,
               desc=opts.description or protocol.name, unit="round", leave=False)
    try:
        while rnd < protocol.max_rounds:
            phases = protocol.phases(rnd)
            while idx < len(phases):
                ph = phases[idx]
                topic = _address(ph.topic, attempt)
                if pending is None:
                    try:
                        msgs = exchange.gather(rnd, topic, state["active"], timeout=opts.timeout,
                                               expect=_spec(ph.site_spec, state, rnd))
                        pending = ph.aggregator(state, rnd, msgs)
                    except SiteTimeout as exc:
                        if ph.allow_dropout:
                            state["active"] = [s for s in state["active"] if s not in exc.missing]
                            state.setdefault("dropped", []).extend(exc.missing)
                            pending = ph.aggregator(state, rnd, exc.received)
                        elif opts.on_dropout is not None:
                            pending = opts.on_dropout(state, rnd, idx, exc.missing, exc.received)
                        else:
                            raise
                    if checkpoint is not None:
                        checkpoint.save({"state": state, "round": rnd, "phase": idx, "attempt": attempt,
                                         "pending": pending})
                if not exchange.has_broadcast(rnd, topic):
                    exchange.broadcast(rnd, topic, pending)
                meta = pending.meta
                pending = None
                if meta.get("stop"):
                    state["rounds"] = rnd + 1
                    if checkpoint is not None:
                        checkpoint.save({"state": state, "round": rnd, "phase": idx, "done": True, "pending": None})
                    return state
                idx, attempt = _advance(meta, idx, attempt)
                if checkpoint is not None:
                    nxt = (rnd, idx, attempt) if idx < len(phases) else (rnd + 1, 0, 0)
                    checkpoint.save({"state": state, "round": nxt[0], "phase": nxt[1], "attempt": nxt[2],
                                     "pending": None})
            rnd, idx, attempt = rnd + 1, 0, 0
            bar.update(1)
    finally:
        bar.close()
    state["rounds"] = rnd
    return state
