"""CAPE: variance plans, the protocol over the driver, dropouts, refusals."""

import math
from itertools import permutations

import numpy as np
import pytest
from cape_toys import Zeros
from scipy import stats

from dpneuro.privacy import cape_release_mu
from dpneuro.protocol.cape import (
    NoisePlan,
    ReleaseSpec,
    asymmetric_plan,
    cape_protocol,
    ledgers,
    n_unique,
    run_cape,
    symmetric_plan,
)
from dpneuro.protocol.cape.packing import multiplicity, noise_array, pack, pack_weighted
from dpneuro.protocol.cape.plans import ZERO_SUM_VARIANCE, guarantee_plan, plan_variances, symmetric_guarantee
from dpneuro.protocol.driver import Phase, RunOptions
from dpneuro.protocol.exchange import InProcessExchange, Payload
from dpneuro.protocol.simulation import SimulatedDropout


def _releases(result, round=0, topic="release"):
    ex = result.exchange
    return ex.gather(round, topic, sorted(result.aggregator["active"]), timeout=1)


def _chi2_var_ok(x, var, alpha=1e-3):
    """Two-sided chi-square test that zero-mean ``x`` has variance ``var``."""
    n = x.size
    q = float(np.sum(x**2) / var)
    lo, hi = stats.chi2.ppf([alpha / 2, 1 - alpha / 2], n)
    return lo < q < hi


# -- plans ---------------------------------------------------------------------------------

@pytest.mark.parametrize("S", [3, 4, 10])
def test_symmetric_plan_constraints(S):
    v = symmetric_plan(0.7, S)
    assert np.allclose(v.release_variance(), 0.49)
    assert v.combined_variance() == pytest.approx(0.49 / S**2)
    assert np.allclose(v.e_hat, 0.49) and np.allclose(v.g, 0.49 / S)


def test_asymmetric_plan_meets_both_constraints():
    taus = np.array([0.5, 0.6, 0.8, 1.0, 0.7])
    w = np.array([0.3, 0.25, 0.2, 0.1, 0.15])
    v = asymmetric_plan(taus, w, tau_pool=0.12)
    assert np.allclose(v.release_variance(), taus**2, rtol=1e-10)
    assert v.combined_variance() == pytest.approx(0.12**2, rel=1e-10)
    assert np.all(v.e_hat > 0)


def test_asymmetric_plan_reduces_to_symmetric_and_rejects_infeasible():
    S = 6
    v = asymmetric_plan(np.full(S, 0.3), np.full(S, 1 / S))
    s = symmetric_plan(0.3, S)
    assert np.allclose(v.e_hat, s.e_hat) and np.allclose(v.g, s.g)
    # a tiny weight forces a local variance above that site's whole budget
    w = np.array([0.01, 0.33, 0.33, 0.33])
    with pytest.raises(ValueError, match="site 0"):
        asymmetric_plan(np.full(4, 0.3), w / w.sum(), tau_pool=0.3 / 4)


def _unequal_sites(lengths, subjects, z=1.0):
    """Aggregation weights N_s / N and release stds z Delta_s of a PCA-like release, Delta_s = sqrt(2) n_max / N_s."""
    N = np.asarray(lengths, float) * np.asarray(subjects, float)
    return N / N.sum(), z * np.sqrt(2) * np.asarray(lengths, float) / N


@pytest.mark.parametrize("S", [3, 4, 7])
def test_guarantee_plan_meets_every_sites_target_with_near_least_noise(S):
    """Every site's exact guarantee against the aggregator and its colluders is at most what an equal consortium
    gets at the same noise multiplier (the binding site exactly), each release alone carries at least tau_s^2, and
    the average carries within 1.5 % of the noise any zero-sum + local plan needs to meet the binding site's target
    (S / (S - S_C) max_s (mu_s tau_s / m)^2, even with infinitely large zero-sum draws)."""
    rng = np.random.default_rng(S)
    plan = NoisePlan()
    S_C = plan.colluders(S)
    m = symmetric_guarantee(S, S_C, ZERO_SUM_VARIANCE)
    for _ in range(3):
        w, taus = _unequal_sites(rng.integers(80, 200, S), rng.integers(5, 80, S), z=rng.uniform(0.5, 3))
        v = plan_variances(plan, taus, w)
        mus = np.array([cape_release_mu(1.0, v.e_hat, v.g, w, s, S_C) for s in range(S)]) * taus / m
        assert np.all(mus <= 1 + 1e-9) and mus.max() == pytest.approx(1.0, abs=1e-9)
        assert np.all(v.release_variance() >= taus**2)
        lower = S / (S - S_C) * np.max((w * taus / m) ** 2)
        assert lower <= v.combined_variance() <= 1.015 * lower
    # equal sites: the symmetric plan, its zero-sum draws scaled
    eq = guarantee_plan(np.full(S, 0.3), np.full(S, 1 / S), S_C)
    sym = symmetric_plan(0.3, S)
    assert np.allclose(eq.g, sym.g) and np.allclose(eq.e_hat, ZERO_SUM_VARIANCE * sym.e_hat)


def test_guarantee_plan_exists_where_the_papers_plan_is_infeasible():
    """Scans of 100 / 120 / 150 volumes: [capeDJICA]'s system needs a negative zero-sum variance at the first site;
    the default plan exists and the papers' refusal names the site and the setting that plans such sites."""
    w, taus = _unequal_sites([100, 120, 150], [15, 30, 60])
    with pytest.raises(ValueError, match=r"site 0 would need a negative zero-sum variance.*unequal='guarantee'"):
        plan_variances(NoisePlan(unequal="papers"), taus, w)
    v = plan_variances(NoisePlan(), taus, w)
    assert np.all(v.e_hat > 0) and np.all(v.g > 0)
    with pytest.raises(ValueError, match="site 1: release std must be a finite number > 0"):
        guarantee_plan([0.1, 0.0, 0.2], [0.3, 0.3, 0.4], 0)
    with pytest.raises(ValueError, match="unknown plan for unequal sites"):
        NoisePlan(unequal="pooled")


class _Shift:
    """Every site releases zeros, except ``target``, which releases its whole sensitivity in every entry: each of
    the ``size`` entries is an independent replicate of the worst-case neighbouring pair."""

    name, max_rounds = "shift", 1

    def __init__(self, weights, sens, target=None, size=40_000, seed=0):
        self.weights, self.sens, self.target, self.size, self.seed = weights, sens, target, size, seed

    def site_init(self, site, data):
        return {"rng": np.random.default_rng([self.seed, site])}

    def site_releases(self, state):
        return {"f": ReleaseSpec((self.size,), float(self.sens[state["site"]]), 1.0)}

    def site_weight(self, state):
        return float(self.weights[state["site"]])

    def site_compute(self, state, round, broadcast):
        return {"f": np.full(self.size, self.sens[state["site"]] if state["site"] == self.target else 0.0)}

    def aggregator_init(self):
        return {}

    def aggregator_first(self, state):
        return Payload()

    def aggregator_update(self, state, round, combined):
        return Payload(meta={"stop": True})


def _coalition_view(result, colluders):
    """What the aggregator and ``colluders`` see, per entry: each honest release with the broadcast zero-sum total's
    known part added back (f_h + e_hat_h + g_h), and the honest sites' part of that total."""
    S = len(result.sites)
    esum = result.exchange.receive(0, 0, "zs-unmask").arrays["cape/esum"]
    rel = _releases(result)
    w = result.sites[0]["cape"]["plan"]["cape/weights"]
    rows = [rel[h].arrays["f"] + esum / (S * w[h]) for h in range(S) if h not in colluders]
    known = sum(w[c] * (result.sites[c]["_last_noise"]["f"][0] + esum / (S * w[c])) for c in colluders)
    return np.stack(rows + [esum - known])


def test_unequal_consortium_distinguishing_attack_sees_the_ledgers_guarantee():
    """4 sites of 15 / 30 / 60 / 45 subjects scanned for 100 / 120 / 150 / 150 volumes, through the protocol with
    secure aggregation. The coalition's best test between neighbouring datasets at a site (the Gaussian
    likelihood ratio, from the empirical covariance of 40,000 replicates) separates them by exactly the mu the
    ledger records, for every choice of colluder (one, the most CAPE allows for 4 sites). The longest scans bind: at
    the symmetric target; a shorter-scan site below it. [capeDJICA]'s plan gives the binding site 14 % more."""
    w, sens = _unequal_sites([100, 120, 150, 150], [15, 30, 60, 45])
    target = symmetric_guarantee(4, 1, ZERO_SUM_VARIANCE)  # at noise multiplier 1
    claimed = {}
    for unequal in ("guarantee", "papers"):
        plan = NoisePlan(unequal=unequal)
        base = run_cape(_Shift(w, sens, seed=1), [0] * 4, plan)
        for site in (0, 2):
            shifted = run_cape(_Shift(w, sens, site, seed=2), [0] * 4, plan)
            mu = ledgers(shifted)[site].releases[0].mu_collusion
            claimed[unequal, site] = mu
            seps = []
            for c in (x for x in range(4) if x != site):
                a, b = _coalition_view(base, [c]), _coalition_view(shifted, [c])
                shift = b.mean(1) - a.mean(1)
                seps.append(math.sqrt(shift @ np.linalg.solve(np.cov(a), shift)))
            # the estimate's standard error is about sqrt(2 / 40,000) = 0.007, plus a small upward bias
            assert max(seps) == pytest.approx(mu, abs=0.03), (unequal, site, seps)
    assert claimed["guarantee", 2] == pytest.approx(target, rel=1e-9)
    assert claimed["guarantee", 0] < 0.7 * target
    assert claimed["papers", 2] > 1.1 * target


def test_plan_refuses_outside_assumptions():
    with pytest.raises(ValueError, match="at least 3 sites"):
        cape_protocol(Zeros(), "cape", n_sites=2)
    with pytest.raises(ValueError, match="colluding"):
        cape_protocol(Zeros(), NoisePlan("cape", n_colluding=2), n_sites=6)
    with pytest.raises(ValueError, match="unknown noise plan"):
        NoisePlan("pooled")
    cape_protocol(Zeros(), "conv", n_sites=2)  # conv has no collusion assumption


# -- the protocol -------------------------------------------------------------------------

PAPERS = NoisePlan("cape", zero_sum_variance=1.0)


@pytest.mark.parametrize("S", [3, 4])
@pytest.mark.parametrize("c", [1.0, ZERO_SUM_VARIANCE])
def test_cape_release_variances_and_zero_sum(S, c):
    """var(e_hat) = c tau^2: one release alone carries (c (1 - 1/S) + 1/S) tau^2 >= tau^2, the average tau^2 / S^2
    whatever c, and the aggregator's view of a site shrinks to the pooled average's as c grows."""
    n = 20_000
    res = run_cape(Zeros(shape=(n,)), [100] * S, NoisePlan("cape", zero_sum_variance=c))
    tau2 = 1.0  # noise multiplier 2 * sensitivity 0.5
    rel = _releases(res)
    for s, msg in rel.items():
        assert _chi2_var_ok(msg.arrays["f"], (c * (1 - 1 / S) + 1 / S) * tau2), f"site {s} release variance"
    # zero-sum part cancels to float precision (fixed-point quantisation of the secure sum)
    e = np.stack([res.sites[s]["_last_noise"]["f"][0] for s in range(S)])
    assert np.abs(e.mean(axis=0)).max() < 1e-8
    assert _chi2_var_ok(e[0], c * (1 - 1 / S) * tau2)
    # the aggregator's average carries the pooled variance tau^2 / S^2, not conv's tau^2 / S
    comb = res.aggregator["combined"][0]
    assert _chi2_var_ok(comb, tau2 / S**2)
    assert not _chi2_var_ok(comb, tau2 / S)
    # every site's ledger holds one release at its calibrated std tau_s (a lower bound on the release's when
    # c > 1), and what it is worth to the aggregator colluding with ceil(S/3) - 1 sites:
    # mu^2 = 2 mu_z = S (S_H + c S) / (S_H (c S + 1)) (Delta/tau)^2, S (S + S_H) / ((S + 1) S_H) at c = 1
    S_H = S - (-(-S // 3) - 1)
    for led in ledgers(res):
        (r,) = led.releases
        assert (r.sensitivity, r.sigma, r.count) == (0.5, pytest.approx(1.0), 1)
        assert r.mu_collusion**2 == pytest.approx(S * (S_H + c * S) / (S_H * (c * S + 1)) * 0.25, rel=1e-6)
        assert led.epsilon(1e-5, collusion=True) > led.epsilon(1e-5)
        if c > 1:  # within 1 % of the limit S / S_H (Delta/tau)^2
            assert r.mu_collusion**2 == pytest.approx(S / S_H * 0.25, rel=1e-2)


class Shifted(Zeros):
    """Zeros, except that site 0 releases ``shift`` on every coordinate (its neighbouring dataset)."""

    def __init__(self, shift, **kw):
        super().__init__(**kw)
        self.shift = shift

    def site_compute(self, state, round, broadcast):
        return {"f": np.full(self.shape, self.shift if state["site"] == 0 else 0.0)}


@pytest.mark.parametrize("c", [1.0, ZERO_SUM_VARIANCE])
def test_the_aggregator_and_a_colluder_separate_neighbours_by_the_recorded_mu(c):
    """The adversary of the headline: the aggregator (every release and the zero-sum total) with site 3 handing
    over its draws. Site 0 releases 0 or Delta (its sensitivity) on each of n coordinates, n independent trials.
    The likelihood-ratio statistic built from the protocol's own messages is N(0, 1) in one world and shifted by
    the ledger's mu_collusion in the other: the recorded guarantee is what the best attack achieves."""
    S, n, delta_f, colluder = 4, 20_000, 0.5, 3
    honest = [0, 1, 2]
    stats_, mus = [], []
    for world, shift in enumerate((0.0, delta_f)):
        res = run_cape(Shifted(shift, shape=(n,), seed=10 + world), [100] * S, NoisePlan("cape", zero_sum_variance=c))
        ex = res.exchange
        esum = ex.receive(0, 0, "zs-unmask").arrays["cape/esum"]
        rel = _releases(res)
        plan = res.sites[0]["cape"]["plan"]
        w, e_var, g_var = plan["cape/weights"], plan["cape/e_var/f"], plan["cape/g_var/f"]
        e_c = res.sites[colluder]["_last_noise"]["f"][0]
        e_hat_c = e_c + esum / (w[colluder] * S)
        # y_s = f_s + e_hat_s + g_s for the honest sites, and their part of the zero-sum total
        obs = np.stack([rel[s].arrays["f"] + esum / (w[s] * S) for s in honest] + [esum - w[colluder] * e_hat_c])
        cov = np.diag(np.r_[e_var[honest] + g_var[honest], np.sum(w[honest] ** 2 * e_var[honest])])
        cov[-1, :-1] = cov[:-1, -1] = w[honest] * e_var[honest]
        v = np.zeros(len(honest) + 1)
        v[0] = delta_f
        u = np.linalg.solve(cov, v)
        stats_.append(u @ obs / np.sqrt(v @ u))
        mus.append(ledgers(res)[0].releases[0].mu_collusion)
    assert mus[0] == pytest.approx(mus[1], rel=1e-12)
    se = np.sqrt(2 / n)
    assert abs(np.std(stats_[0]) - 1) < 4 * se / np.sqrt(2) and abs(np.std(stats_[1]) - 1) < 4 * se / np.sqrt(2)
    assert abs(stats_[1].mean() - stats_[0].mean() - mus[0]) < 4 * se
    if c > 1:  # against the papers' plan: 1.366 Delta / tau at c = 1, 1.158 here
        assert mus[0] < 0.86 * np.sqrt(S * (S + 3) / ((S + 1) * 3)) * 0.5


def test_zero_sum_variance_below_one_or_not_a_number_is_refused():
    for bad in (0.5, float("nan"), float("inf"), True, "100"):
        with pytest.raises(ValueError, match="zero_sum_variance"):
            NoisePlan("cape", zero_sum_variance=bad)


def test_conv_and_none_plans_use_the_same_path():
    S, n = 3, 20_000
    conv = run_cape(Zeros(shape=(n,)), [10] * S, "conv")
    assert _chi2_var_ok(conv.aggregator["combined"][0], 1.0 / S)
    none = run_cape(Zeros(shape=(n,)), [10] * S, "none")
    assert np.all(none.aggregator["combined"][0] == 0)
    assert all(not led.releases and led.notes for led in ledgers(none))


def test_asymmetric_cape_through_protocol():
    # unequal site sizes: sensitivity ~ 1/N_s, so tau_s ~ 1/N_s and mu_s tau_s is the same
    weights = [100, 300, 200, 400]
    taus = [100 / n for n in weights]
    res = run_cape(Zeros(shape=(20_000,), taus=taus), weights, "cape")
    w = np.array(weights) / sum(weights)
    release_var = plan_variances("cape", taus, w).release_variance()
    assert np.all(release_var > 10 * np.square(taus))  # each release alone: far more than its std tau_s
    rel = _releases(res)
    for s, msg in rel.items():
        assert _chi2_var_ok(msg.arrays["f"], release_var[s]), f"site {s}"
    e = np.stack([res.sites[s]["_last_noise"]["f"][0] for s in range(4)])
    assert np.abs(w @ e).max() < 1e-8
    # the combined noise is the weighted local part only
    g_var = sum(w[s] ** 2 * np.var(res.sites[s]["_last_noise"]["f"][1]) for s in range(4))
    assert np.var(res.aggregator["combined"][0]) == pytest.approx(g_var, rel=0.05)


@pytest.mark.parametrize("how", ["symmetrized", "mirrored"])
def test_symmetric_matrix_release_is_symmetric_with_planned_variance(how):
    """tau = 1: diagonal entries have variance 1; off-diagonal 1/2 when symmetrized (1 when mirrored)."""
    D, S = 60, 3
    res = run_cape(Zeros(shape=(D, D), symmetric=True, symmetric_noise=how), [5] * S, PAPERS)
    off = 0.5 if how == "symmetrized" else 1.0
    for msg in _releases(res).values():
        a = msg.arrays["f"]
        assert np.array_equal(a, a.T)
        assert _chi2_var_ok(np.diag(a), 1.0)
        assert _chi2_var_ok(a[np.triu_indices(D, 1)], off)
    assert n_unique((D, D), True) == D * (D + 1) // 2
    # the zero-sum parts still cancel in the weighted average
    e = sum(noise_array(res.sites[s]["_last_noise"]["f"][0], (D, D), True, how) for s in range(S)) / S
    assert np.abs(e).max() < 1e-8  # up to the fixed-point rounding of secure aggregation


def test_symmetric_tensor_release_divides_each_entry_by_the_root_of_its_copies():
    """3-way tensor, tau = 1: entries (i, i, i) variance 1, (i, i, j) 1/3, (i, j, k) distinct 1/6."""
    D, S = 12, 3
    res = run_cape(Zeros(shape=(D, D, D), symmetric=True), [5] * S, PAPERS)
    i, j, k = np.meshgrid(*[np.arange(D)] * 3, indexing="ij")
    distinct = 1 + (i != j).astype(int) + (j != k).astype(int)  # distinct indices where i <= j <= k
    for msg in _releases(res).values():
        t = msg.arrays["f"]
        assert np.array_equal(t, t.transpose(1, 0, 2)) and np.array_equal(t, t.transpose(0, 2, 1))
        for n_distinct, var in ((1, 1.0), (2, 1 / 3), (3, 1 / 6)):
            sel = (distinct == n_distinct) & (i <= j) & (j <= k)
            assert _chi2_var_ok(t[sel], var), n_distinct


@pytest.mark.parametrize("shape", [(7, 7), (5, 5, 5)])
def test_weighted_packing_has_the_frobenius_norm_and_inverts(shape):
    """||w(A)|| = ||A||_F exactly, so a Frobenius sensitivity is the L2 sensitivity of w; the noise
    array of w(A) is A again (noise_array divides by sqrt(multiplicity) and mirrors)."""
    rng = np.random.default_rng(3)
    A = rng.standard_normal(shape)
    A = np.mean([A.transpose(p) for p in permutations(range(len(shape)))], axis=0)
    n, order = shape[0], len(shape)
    assert multiplicity(n, order).sum() == n**order
    assert np.linalg.norm(pack_weighted(A)) == pytest.approx(np.linalg.norm(A), rel=1e-12)
    assert np.linalg.norm(pack(A, True)) < np.linalg.norm(A)  # the papers' vector: a looser bound
    assert np.allclose(noise_array(pack_weighted(A), shape, True), A, atol=1e-13)
    assert np.allclose(noise_array(pack(A, True), shape, True, "mirrored"), A, atol=1e-13)
    with pytest.raises(ValueError, match="symmetric_noise must be one of"):
        ReleaseSpec(shape, 1.0, 1.0, symmetric=True, symmetric_noise="upper")


def test_noise_is_fresh_every_round_and_ledger_counts_rounds():
    res = run_cape(Zeros(shape=(500,), rounds=3), [10] * 3, "cape")
    c = res.aggregator["combined"]
    assert not np.allclose(c[0], c[1]) and not np.allclose(c[1], c[2])
    for led in ledgers(res):
        assert led.releases[0].count == 3
        assert led.draws == 6  # one zero-sum and one local draw per round


def _dropping(proto, phase_index, site=4, rnd=0):
    """``proto`` whose ``site`` drops out in phase ``phase_index`` of round ``rnd``."""
    ph = proto._round[phase_index]

    def flaky_site(state, r, incoming):
        if state["site"] == site and r == rnd:
            raise SimulatedDropout
        return ph.site(state, r, incoming)

    proto._round[phase_index] = Phase(ph.topic, flaky_site, ph.aggregator, ph.site_spec, ph.broadcast_spec,
                                      ph.allow_dropout)
    return proto


def test_dropout_before_release_redoes_round_among_survivors():
    """5 sites (one colluder assumed), one drops in the zero-sum step: the 4 survivors redo the round with fresh
    draws and more local noise, so each keeps the guarantee the 5-site consortium promised (not the weaker one
    4 sites would give at the same noise), and each releases once."""
    from dpneuro.protocol.simulation import simulate

    S = 5
    proto = _dropping(cape_protocol(Zeros(shape=(5000,)), "cape", n_sites=S), 0)  # the masked secure-sum step
    res = simulate(proto, [10] * S, options=RunOptions(timeout=3))
    assert res.sites[4] is None
    assert res.aggregator["active"] == [0, 1, 2, 3]
    assert res.aggregator["cape"]["redos"] == 1
    survivors = [res.sites[s] for s in range(4)]
    e = np.stack([st["_last_noise"]["f"][0] for st in survivors])
    assert np.abs(e.mean(axis=0)).max() < 1e-8  # cancels among the 4 survivors
    tau = 2 * 0.5  # Zeros: noise multiplier 2, sensitivity 0.5
    var = res.aggregator["cape"]["noise_var"]["f"]
    assert var > tau**2 / 4**2  # above the symmetric 4-site plan's tau^2 / S^2: the price of the promise
    assert _chi2_var_ok(res.aggregator["combined"][0], var)
    promised = symmetric_guarantee(S, 1, ZERO_SUM_VARIANCE) * 0.5 / tau
    for st in survivors:  # one release, at the consortium's promise
        assert sum(r.count for r in st["ledger"].releases) == 1
        assert st["ledger"].releases[-1].mu_collusion == pytest.approx(promised, rel=1e-6)


def test_dropout_after_release_stops_the_run_without_second_releases():
    """A site that drops once the others released cannot be cancelled without a second release by every survivor,
    which their guards refuse: the aggregator stops, naming the site, and no survivor released twice."""
    from dpneuro.protocol.cape.phases import DropoutAfterRelease
    from dpneuro.protocol.exchange import InProcessExchange
    from dpneuro.protocol.simulation import simulate

    S = 5
    proto = _dropping(cape_protocol(Zeros(shape=(50,)), "cape", n_sites=S), -1)  # the release step
    ex = InProcessExchange(S)
    with pytest.raises(DropoutAfterRelease, match="site 4 dropped out after the other sites released round 0"):
        simulate(proto, [10] * S, exchange=ex, options=RunOptions(timeout=3))
    for s in range(4):
        assert [r["topic"] for r in ex.egress_log(s)].count("release") == 1


def test_mismatched_site_configuration_is_refused():
    class Odd(Zeros):
        def site_releases(self, state):
            shape = (5,) if state["site"] == 1 else (4,)
            return {"f": ReleaseSpec(shape, 0.5, 2.0)}

    with pytest.raises(ValueError, match="site 1"):
        run_cape(Odd(), [1, 1, 1], "conv", options=RunOptions(timeout=5))


def test_egress_carries_only_noised_masked_or_public():
    res = run_cape(Zeros(shape=(50,), rounds=2), [10] * 3, "cape")
    allowed = {"cape-noise", "secagg-mask", "encrypted-share", "secagg-share", "public"}
    for s in range(3):
        log = res.exchange.egress_log(s)
        assert log, "site sent nothing?"
        for rec in log:
            for name, arr in rec["arrays"].items():
                assert arr["carries"] in allowed, (s, rec["topic"], name, arr["carries"])
        released = [r for r in log if r["topic"] == "release"]
        assert len(released) == 2 and released[0]["arrays"]["f"]["carries"] == "cape-noise"


def test_inprocess_rounds_are_reproducible_with_seeds():
    a = run_cape(Zeros(shape=(64,), rounds=2, seed=5), [10] * 3, "cape")
    b = run_cape(Zeros(shape=(64,), rounds=2, seed=5), [10] * 3, "cape",
                 exchange=InProcessExchange(3))
    assert np.array_equal(a.aggregator["combined"][1], b.aggregator["combined"][1])
