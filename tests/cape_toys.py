"""A toy CAPE algorithm the protocol tests run (every site releases zeros, so a release is its noise alone), and
the distinguishing attack the release tests run against a four-site consortium."""

import math

import numpy as np

from dpneuro.protocol.cape import ReleaseSpec, ledgers, run_cape
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


def coalition_statistic(res, diff, colluder=3):
    """The likelihood-ratio statistic of the aggregator with ``colluder``'s draws for 'site 0 holds the neighbour'
    (site 0's releases shifted by ``diff``), and the separation it has by construction."""
    S, honest = 4, [0, 1, 2]
    esum_all = res.exchange.receive(0, 0, "zs-unmask").arrays["cape/esum"]
    rel = res.exchange.gather(0, "release", list(range(S)), timeout=1)
    plan = res.sites[0]["cape"]["plan"]
    w = plan["cape/weights"]
    num, var, off = 0.0, 0.0, 0
    for name in diff:  # every release of the round, in the order the protocol stacks their noise
        d = diff[name].ravel()
        esum = esum_all[off:off + d.size]
        off += d.size
        e_var, g_var = plan[f"cape/e_var/{name}"], plan[f"cape/g_var/{name}"]
        e_hat_c = res.sites[colluder]["_last_noise"][name][0] + esum / (w[colluder] * S)
        obs = np.stack([rel[s].arrays[name].ravel() + esum / (w[s] * S) for s in honest]
                       + [esum - w[colluder] * e_hat_c])
        cov = np.diag(np.r_[e_var[honest] + g_var[honest], np.sum(w[honest] ** 2 * e_var[honest])])
        cov[-1, :-1] = cov[:-1, -1] = w[honest] * e_var[honest]
        u = np.linalg.solve(cov, np.eye(4)[0])
        num += d @ (u @ obs)
        var += (d @ d) * u[0]
    return num / math.sqrt(var), math.sqrt(var)


def check_attack_separation(make_algorithm, worlds, diff, *, at_least: float, runs: int = 150):
    """The aggregator with site 3's draws tests 'world 1' (site 0's releases shifted by ``diff``) against 'world 0'
    on ``runs`` protocol runs per world (``make_algorithm(seed)``, fresh noise each): its statistic has unit
    spread, shifts by the separation the neighbour allows, and that separation is at most the ledger's mu and
    more than ``at_least`` of it."""
    stats, sep, mu = [[], []], None, None
    for world in (0, 1):
        for rep in range(runs):
            res = run_cape(make_algorithm(1000 * world + rep), worlds[world], "cape")
            t, sep = coalition_statistic(res, diff)
            stats[world].append(t)
        mu = ledgers(res)[0].mu_collusion
    a, b = np.array(stats[0]), np.array(stats[1])
    se = math.sqrt(2 / runs)
    assert 0.75 < a.std() < 1.3 and 0.75 < b.std() < 1.3
    assert abs((b.mean() - a.mean()) - sep) < 4 * se, (b.mean() - a.mean(), sep)
    assert sep <= mu + 1e-9 and sep > at_least * mu, (sep, mu)
