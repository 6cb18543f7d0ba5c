"""A toy protocol for the exchange tests, and a site process entry point.

Run as a script, this module is one site of the toy protocol over a
:class:`~dpneuro.protocol.exchange.DirectoryExchange`, with a checkpoint, optionally
crashing at a chosen point (``--crash ROUND:TOPIC:WHEN``) to test restarts.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import numpy as np

from dpneuro.protocol.driver import Phase, run_site
from dpneuro.protocol.exchange import ArraySpec, DirectoryCheckpoint, DirectoryExchange, MessageSpec, Payload

D = 4  # length of every toy array
SEED = 20240611
CRASH_EXIT_CODE = 17

SHARE_SPEC = MessageSpec({"x": ArraySpec("float64", (D,)), "n": ArraySpec("float64", (D,))})
NOISY_SPEC = MessageSpec({"y": ArraySpec("float64", (D,))})
SUM_SPEC = MessageSpec({"sum": ArraySpec("float64", (D,))})


def toy_data(n_sites: int) -> list[np.ndarray]:
    """Site ``s`` holds ``(s + 1) * [0, 1, ..., D - 1]``."""
    return [np.arange(D, dtype=np.float64) * (s + 1) for s in range(n_sites)]


def _sum(msgs: dict, name: str) -> np.ndarray:
    total = np.zeros(D)
    for s in sorted(msgs):  # fixed order: results must match bit for bit across backends
        total = total + msgs[s].arrays[name]
    return total


class ToyProtocol:
    """Two phases per round; every site draws noise from its own Generator in each phase.

    ``share``: site s sends ``x_s + round`` and a noise draw ``n``; the
    aggregator broadcasts ``sum_s (x_s + round)``.
    ``noisy``: site s sends ``sum / n_sites + noise``; the aggregator broadcasts
    the sum and stops after round ``stop_round``.
    Each draw is appended to ``draw_log/site-<s>.jsonl`` when a folder is given.
    """

    name = "toy"

    def __init__(self, n_sites: int, *, stop_round: int = 4, max_rounds: int = 10,
                 draw_log: str | os.PathLike[str] | None = None) -> None:
        self.n_sites = n_sites
        self.stop_round = stop_round
        self.max_rounds = max_rounds
        self.draw_log = Path(draw_log) if draw_log is not None else None

    def phases(self, round: int) -> list[Phase]:
        return [
            Phase("share", self.site_share, self.agg_share, site_spec=SHARE_SPEC, broadcast_spec=SUM_SPEC),
            Phase("noisy", self.site_noisy, self.agg_noisy, site_spec=NOISY_SPEC, broadcast_spec=SUM_SPEC),
        ]

    def site_init(self, site: int, data: np.ndarray) -> dict:
        return {"site": site, "rng": np.random.default_rng([SEED, site]), "_x": np.asarray(data, np.float64),
                "seen": []}

    def aggregator_init(self) -> dict:
        return {"sums": [], "noisy_sums": []}

    def _draw(self, state: dict, round: int, phase: str) -> np.ndarray:
        noise = state["rng"].normal(size=D)
        if self.draw_log is not None:
            self.draw_log.mkdir(parents=True, exist_ok=True)
            with open(self.draw_log / f"site-{state['site']}.jsonl", "a") as f:
                f.write(json.dumps({"round": round, "phase": phase, "noise": noise.tolist()}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        return noise

    def site_share(self, state: dict, round: int, incoming: Payload | None) -> Payload:
        noise = self._draw(state, round, "share")
        return Payload({"x": state["_x"] + round, "n": noise}, carries={"x": "public", "n": "test-noise"})

    def agg_share(self, state: dict, round: int, msgs: dict) -> Payload:
        total = _sum(msgs, "x")
        state["sums"].append(total)
        return Payload({"sum": total}, meta={"round": round})

    def site_noisy(self, state: dict, round: int, incoming: Payload) -> Payload:
        state["seen"].append(incoming.arrays["sum"])
        noise = self._draw(state, round, "noisy")
        return Payload({"y": incoming.arrays["sum"] / self.n_sites + noise}, carries={"y": "test-noise"})

    def agg_noisy(self, state: dict, round: int, msgs: dict) -> Payload:
        total = _sum(msgs, "y")
        state["noisy_sums"].append(total)
        return Payload({"sum": total}, meta={"stop": round >= self.stop_round})


def expected_toy(n_sites: int, rounds: int = 5) -> dict[str, list[np.ndarray]]:
    """What the toy protocol must produce, computed without any exchange."""
    rngs = [np.random.default_rng([SEED, s]) for s in range(n_sites)]
    xs = toy_data(n_sites)
    sums, noisy, draws = [], [], {s: [] for s in range(n_sites)}
    for r in range(rounds):
        for s in range(n_sites):
            draws[s].append(((r, "share"), rngs[s].normal(size=D)))
        total = np.zeros(D)
        for s in range(n_sites):
            total = total + (xs[s] + r)
        sums.append(total)
        ys = []
        for s in range(n_sites):
            n = rngs[s].normal(size=D)
            draws[s].append(((r, "noisy"), n))
            ys.append(total / n_sites + n)
        t2 = np.zeros(D)
        for y in ys:
            t2 = t2 + y
        noisy.append(t2)
    return {"sums": sums, "noisy_sums": noisy, "draws": draws}


# ---------------------------------------------------------------------------
# site process
# ---------------------------------------------------------------------------

def _crash() -> None:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(CRASH_EXIT_CODE)  # no cleanup: as abrupt as a kill


class CrashAfterSend(DirectoryExchange):
    """Dies right after delivering the message for ``(round, topic)``."""

    crash_at: tuple[int, str] = (-1, "")

    def send(self, site, round, topic, payload):
        super().send(site, round, topic, payload)
        if (round, topic) == self.crash_at:
            _crash()


class CrashAfterCheckpoint(DirectoryCheckpoint):
    """Dies right after the write-ahead checkpoint of the message for ``(round, phase)``, before sending."""

    crash_at: tuple[int, int] = (-1, -1)

    def save(self, record):
        super().save(record)
        if record.get("pending") is not None and (record["round"], record["phase"]) == self.crash_at:
            _crash()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--root", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--key", required=True, help="run key, hex")
    ap.add_argument("--n-sites", type=int, required=True)
    ap.add_argument("--site", type=int, required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--draw-log", default=None)
    ap.add_argument("--crash", default=None, help="ROUND:TOPIC:after_send or ROUND:PHASE:after_checkpoint")
    ap.add_argument("--timeout", type=float, default=30.0)
    args = ap.parse_args(argv)

    exchange_cls, checkpoint = DirectoryExchange, DirectoryCheckpoint(args.checkpoint)
    if args.crash:
        rnd, where, when = args.crash.split(":")
        if when == "after_send":
            exchange_cls = CrashAfterSend
            CrashAfterSend.crash_at = (int(rnd), where)
        elif when == "after_checkpoint":
            checkpoint = CrashAfterCheckpoint(args.checkpoint)
            checkpoint.crash_at = (int(rnd), int(where))
        else:
            raise SystemExit(f"unknown crash point {when!r}")

    exchange = exchange_cls(args.root, args.n_sites, run_id=args.run_id, key=bytes.fromhex(args.key),
                            poll_interval=0.005)
    protocol = ToyProtocol(args.n_sites, draw_log=args.draw_log)
    run_site(protocol, args.site, toy_data(args.n_sites)[args.site], exchange,
             checkpoint=checkpoint, timeout=args.timeout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
