"""Per-round cost of one secure sum (dpneuro.protocol.secagg) over the in-process exchange.

For S sites and a float payload of D values, the protocol runs the secure
aggregation setup once (round 0, not timed) and then one secure sum per
round. The time of a round is the wall time between the aggregator's results
of consecutive rounds, i.e. both phases (masked input collection and
unmasking) including the sites' work, message encoding and authentication.
CPU time is the process CPU (all parties' threads) per round, which is
less sensitive to other load on the machine than wall time. The baseline runs the same rounds with a plain (insecure) sum: every site
sends its float64 array and the aggregator adds them. Overhead = secure -
plain, both medians over the timed rounds.

Usage::

    python benchmarks/secagg_overhead.py [--reps 7] [--out benchmarks/results/secagg_overhead.csv] [--quick]
"""

from __future__ import annotations

import argparse
import csv
import os
import platform
import statistics
import time
from dataclasses import replace
from pathlib import Path

import numpy as np

from dpneuro.protocol.driver import Phase, RunOptions
from dpneuro.protocol.exchange import InProcessExchange, Payload
from dpneuro.protocol.secagg import SecAggConfig, setup_phases, sum_phases
from dpneuro.protocol.simulation import simulate

PAYLOADS = {"420": (420,), "900x900": (900, 900)}
SITES = (4, 16)


class _Bench:
    """Setup once, then one sum per round; the aggregator stamps the time of every result."""

    name = "secagg-bench"

    def __init__(self, n_sites: int, rounds: int, secure: bool):
        self.cfg = SecAggConfig(n_sites)
        self.max_rounds = rounds
        self.secure = secure
        self.stamps: list[tuple[float, float]] = []  # (wall, process CPU of all threads)

    def phases(self, round):
        if self.secure:
            phases = setup_phases(self.cfg) if round == 0 else []
            masked, unmask = sum_phases(self.cfg, "sum", "_in", self._on_sum)
            return phases + [replace(masked, site=self._with_input(masked.site)), unmask]
        return [Phase("plain", self._plain_site, self._plain_agg)]

    def site_init(self, site, data):
        return {"site": site, "_x": data}

    def aggregator_init(self):
        return {}

    @staticmethod
    def _with_input(step):
        def site(state, round, incoming):
            state["_in"] = state["_x"]  # the protocol's own step puts the sum's input where the sum takes it
            return step(state, round, incoming)
        return site

    def _on_sum(self, agg_state, round, total):
        self.stamps.append((time.perf_counter(), time.process_time()))
        return Payload(arrays={"total": total}, meta={"stop": round == self.max_rounds - 1},
                       carries={"total": "public"})

    @staticmethod
    def _plain_site(state, round, incoming):
        return Payload(arrays={"x": state["_x"]}, carries={"x": "public"})

    def _plain_agg(self, agg_state, round, msgs):
        total = sum(p.arrays["x"] for p in msgs.values())
        return self._on_sum(agg_state, round, total)


def _upload_bytes(exchange: InProcessExchange, site: int, round: int) -> int:
    """Bytes of array data ``site`` sent in ``round`` (from its egress log)."""
    total = 0
    for rec in exchange.egress_log(site):
        if rec["round"] == round:
            for arr in rec["arrays"].values():
                total += int(np.prod(arr["shape"])) * np.dtype(arr["dtype"]).itemsize
    return total


def measure(n_sites: int, shape: tuple[int, ...], reps: int, secure: bool
            ) -> tuple[list[float], list[float], int]:
    """Wall and CPU times (s) of ``reps`` timed rounds, and one site's upload bytes per round."""
    rng = np.random.default_rng(0)
    data = [rng.normal(size=shape) for _ in range(n_sites)]
    bench = _Bench(n_sites, reps + 1, secure)
    ex = InProcessExchange(n_sites)
    simulate(bench, data, exchange=ex, options=RunOptions(timeout=600))
    # round 0 (with setup) only serves as the start mark
    wall, cpu = (list(np.diff([stamp[i] for stamp in bench.stamps])) for i in (0, 1))
    return wall, cpu, _upload_bytes(ex, 0, 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=7, help="timed rounds per configuration")
    ap.add_argument("--out", default=None, help="default benchmarks/results/secagg_overhead[_quick].csv")
    ap.add_argument("--quick", action="store_true", help="smoke run: 2 timed rounds, written to *_quick.csv")
    args = ap.parse_args()
    if args.quick:
        args.reps = 2
    if args.out is None:
        args.out = str(Path(__file__).parent / "results" / f"secagg_overhead{'_quick' if args.quick else ''}.csv")

    rows = []
    for n_sites in SITES:
        for label, shape in PAYLOADS.items():
            sec, sec_cpu, sec_bytes = measure(n_sites, shape, args.reps, secure=True)
            plain, plain_cpu, plain_bytes = measure(n_sites, shape, args.reps, secure=False)
            row = {
                "n_sites": n_sites, "payload": label, "n_values": int(np.prod(shape)), "reps": args.reps,
                "secure_round_s_median": round(statistics.median(sec), 4),
                "secure_round_s_min": round(min(sec), 4),
                "plain_round_s_median": round(statistics.median(plain), 4),
                "overhead_s_median": round(statistics.median(sec) - statistics.median(plain), 4),
                "secure_cpu_s_median": round(statistics.median(sec_cpu), 4),
                "plain_cpu_s_median": round(statistics.median(plain_cpu), 4),
                "site_upload_bytes_secure": sec_bytes, "site_upload_bytes_plain": plain_bytes,
            }
            rows.append(row)
            print(f"S={n_sites:3d} payload={label:8s} secure {row['secure_round_s_median']:.4f} s  "
                  f"plain {row['plain_round_s_median']:.4f} s  overhead {row['overhead_s_median']:.4f} s  "
                  f"(CPU {row['secure_cpu_s_median']:.3f} vs {row['plain_cpu_s_median']:.3f} s)  "
                  f"upload/site/round {sec_bytes} B vs {plain_bytes} B", flush=True)

    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w", newline="") as f:
        f.write(f"# dpneuro secagg overhead; InProcessExchange; {platform.processor() or platform.machine()}, "
                f"{os.cpu_count()} cpus; load average {os.getloadavg()[0]:.1f} at the end; "
                f"median of {args.reps} rounds after setup\n")
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
