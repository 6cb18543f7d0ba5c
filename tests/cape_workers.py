"""A CAPE site process for the multi-process tests.

Run as a script: one site of a small CAPE run over a DirectoryExchange with a
checkpoint; ``--die-at ROUND`` makes the process exit abruptly when it starts
computing that round (after everything before it was released), once.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import numpy as np

from dpneuro.protocol.cape import ReleaseSpec, cape_protocol
from dpneuro.protocol.driver import run_site
from dpneuro.protocol.exchange import DirectoryCheckpoint, DirectoryExchange, Payload

DIE_EXIT_CODE = 23


class Drift:
    """Each round a site releases its data mean plus the round number; the aggregator keeps averages."""

    name = "drift"

    def __init__(self, rounds=4, seed=11, die_at=None, marker=None):
        self.max_rounds, self.seed, self.die_at, self.marker = rounds, seed, die_at, marker

    def site_init(self, site, data):
        return {"rng": np.random.default_rng([self.seed, site]), "_x": np.asarray(data, float)}

    def site_releases(self, state):
        return {"m": ReleaseSpec((16,), sensitivity=0.1, noise_multiplier=3.0)}

    def site_weight(self, state):
        return 50.0

    def site_compute(self, state, round, broadcast):
        if self.die_at == round and self.marker and not Path(self.marker).exists():
            Path(self.marker).write_text("died")
            os._exit(DIE_EXIT_CODE)
        return {"m": state["_x"] + round}

    def aggregator_init(self):
        return {"means": []}

    def aggregator_first(self, state):
        return Payload()

    def aggregator_update(self, state, round, combined):
        state["means"].append(combined["m"])
        return Payload(meta={"stop": round == self.max_rounds - 1})


def site_data(n_sites):
    return [np.linspace(0, 1, 16) * (s + 1) for s in range(n_sites)]


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--root", required=True)
    ap.add_argument("--run-id", required=True)
    ap.add_argument("--key", required=True)
    ap.add_argument("--n-sites", type=int, required=True)
    ap.add_argument("--site", type=int, required=True)
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--die-at", type=int, default=None)
    ap.add_argument("--marker", default=None)
    a = ap.parse_args(argv)
    ex = DirectoryExchange(a.root, a.n_sites, run_id=a.run_id, key=bytes.fromhex(a.key), poll_interval=0.005)
    proto = cape_protocol(Drift(die_at=a.die_at, marker=a.marker), "cape", n_sites=a.n_sites)
    run_site(proto, a.site, site_data(a.n_sites)[a.site], ex, checkpoint=DirectoryCheckpoint(a.checkpoint),
             timeout=60)
    return 0


if __name__ == "__main__":
    sys.exit(main())
