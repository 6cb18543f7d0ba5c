"""A toy CAPE algorithm the protocol tests run: every site releases zeros, so a release is its noise alone."""

import numpy as np

from dpneuro.protocol.cape import ReleaseSpec
from dpneuro.protocol.exchange import Payload


class Zeros:
    """Each site releases f = 0 (so a release is pure noise) for ``rounds`` rounds."""

    name = "zeros"

    def __init__(self, shape=(4000,), taus=None, symmetric=False, rounds=1, seed=0, symmetric_noise="symmetrized"):
        self.shape, self.taus, self.symmetric, self.max_rounds, self.seed = shape, taus, symmetric, rounds, seed
        self.symmetric_noise = symmetric_noise

    def site_init(self, site, data):
        return {"rng": np.random.default_rng([self.seed, site]), "_n": data}

    def site_releases(self, state):
        tau = 1.0 if self.taus is None else self.taus[state["site"]]
        return {"f": ReleaseSpec(self.shape, sensitivity=0.5, noise_multiplier=2 * tau, symmetric=self.symmetric,
                                 symmetric_noise=self.symmetric_noise)}

    def site_weight(self, state):
        return state["_n"]

    def site_compute(self, state, round, broadcast):
        return {"f": np.zeros(self.shape)}

    def aggregator_init(self):
        return {"combined": []}

    def aggregator_first(self, state):
        return Payload()

    def aggregator_update(self, state, round, combined):
        state["combined"].append(combined["f"])
        return Payload(meta={"stop": round == self.max_rounds - 1})
