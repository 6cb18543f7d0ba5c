"""Tests for dpneuro.protocol.secagg: fixed point, Shamir, masks, and the phases under the driver.

End-to-end runs use :func:`dpneuro.protocol.simulation.simulate` with a one-second
gather timeout; every dropout therefore costs about one second.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
import math
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dpneuro.protocol.driver import Phase, RunOptions
from dpneuro.protocol.exchange import Payload
from dpneuro.protocol.exchange.codec import decode_state, encode_state
from dpneuro.protocol.secagg import (
    PRIME,
    SecAggConfig,
    SecAggError,
    SecAggWarning,
    check_no_wrap,
    decode,
    encode,
    min_threshold,
    prg,
    setup_phases,
    shamir,
    sum_phases,
)
from dpneuro.protocol.simulation import SimulatedDropout, simulate

TIMEOUT = 1.0  # aggregator's gather timeout in the simulations (s)
STAGES = ["secagg-keys", "secagg-share-keys", "sum-masked", "sum-unmask"]


# -- a tiny protocol: setup, one secure sum per round, a final phase -------------------------

class SumProtocol:
    """Secure sum of ``x_s * (round + 1)`` over the sites, ``n_sums`` rounds.

    ``drops``: ``{(site, round, topic)}`` where the site vanishes instead of sending.
    ``tamper(site, round, topic, payload) -> payload`` may alter what a site sends.
    Every message the aggregator receives is kept in ``self.seen[(round, topic)]``.
    """

    name = "secagg-test"

    def __init__(self, config, n_sums=2, drops=(), tamper=None):
        self.config = config
        self.max_rounds = n_sums
        self.drops = set(drops)
        self.tamper = tamper
        self.seen: dict[tuple[int, str], dict[int, Payload]] = {}

    def phases(self, round):
        phases = setup_phases(self.config) if round == 0 else []
        phases += sum_phases(self.config, "sum", "_in", self._on_sum)
        phases.append(Phase("final", site=lambda s, r, inc: Payload(),
                            aggregator=lambda a, r, m: Payload(meta={"stop": r == self.max_rounds - 1}),
                            allow_dropout=True))
        return [self._wrap(p) for p in phases]

    def site_init(self, site, data):
        return {"site": site, "_x": data}

    def aggregator_init(self):
        return {"totals": {}}

    @staticmethod
    def _input(state, round):
        return state["_x"] * (round + 1)

    @staticmethod
    def _on_sum(agg_state, round, total):
        agg_state["totals"][round] = total
        return Payload(meta={"sum_round": round})

    def _wrap(self, phase):
        def site(state, rnd, incoming):
            if (state["site"], rnd, phase.topic) in self.drops:
                raise SimulatedDropout
            if phase.topic == "sum-masked":  # the protocol's own step puts the sum's input in the state
                state["_in"] = self._input(state, rnd)
            out = phase.site(state, rnd, incoming)
            return self.tamper(state["site"], rnd, phase.topic, out) if self.tamper else out

        def aggregator(agg_state, rnd, msgs):
            self.seen[(rnd, phase.topic)] = dict(msgs)
            return phase.aggregator(agg_state, rnd, msgs)

        return dataclasses.replace(phase, site=site, aggregator=aggregator)


def site_inputs(n_sites, shape=(6, 5), seed=0):
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=3.0, size=shape) for _ in range(n_sites)]


def run(config, inputs, **kw):
    proto = SumProtocol(config, **kw)
    result = simulate(proto, inputs, options=RunOptions(timeout=TIMEOUT))
    return proto, result


def check_sums(config, inputs, proto, result):
    """Each round's total equals the sum over the included sites, within quantisation."""
    agg = result.aggregator
    log = agg["secagg"]["log"]
    assert len(log) == proto.max_rounds
    for entry in log:
        r, included = entry["round"], entry["included"]
        expected = sum(inputs[s] * (r + 1) for s in included)
        # stochastic rounding moves each input by less than one quantum
        tol = len(included) * config.quantum + 1e-12
        np.testing.assert_allclose(agg["totals"][r], expected, rtol=0, atol=tol)
    return log


def drop_sites(n_sites, k):
    return [n_sites - 1, 1, n_sites // 2][:k]


def run_inline(phases, states, agg_state, round, incoming=None, skip=()):
    """Run phases synchronously (no driver, no threads); returns the last broadcast."""
    for ph in phases:
        msgs = {s: ph.site(st_, round, incoming) for s, st_ in states.items() if s not in skip}
        incoming = ph.aggregator(agg_state, round, msgs)
    return incoming


# -- configuration --------------------------------------------------------------------------

@pytest.mark.parametrize("n, t", [(2, 2), (3, 3), (4, 3), (5, 4), (6, 5), (9, 7), (10, 7), (100, 67)])
def test_default_threshold(n, t):
    assert min_threshold(n) == t
    assert SecAggConfig(n).threshold == t
    assert SecAggConfig(n).max_dropouts == n - t


def test_threshold_refused_outside_range():
    with pytest.raises(ValueError, match=r"floor\(2S/3\) \+ 1 = 7"):
        SecAggConfig(10, threshold=6)
    with pytest.raises(ValueError, match="exceeds the number of sites"):
        SecAggConfig(10, threshold=11)
    with pytest.raises(ValueError, match="at least 2 sites"):
        SecAggConfig(1)
    assert SecAggConfig(10, threshold=10).threshold == 10


def test_wrap_bound_checked_at_config_time():
    # defaults: 2**20 * 2**32 = 2**52 per value, so 2047 sites fit below 2**63 and 2048 do not
    assert SecAggConfig(2047).n_sites == 2047
    with pytest.raises(ValueError, match="wrap around"):
        SecAggConfig(2048)
    with pytest.raises(ValueError, match="at most 1 sites fit"):
        check_no_wrap(2, 2.0**30, 32)
    with pytest.raises(ValueError, match="frac_bits"):
        SecAggConfig(3, frac_bits=63)
    with pytest.raises(ValueError, match="value_range"):
        SecAggConfig(3, value_range=float("inf"))


def test_largest_sum_does_not_wrap():
    cfg = SecAggConfig(2047)
    one = encode(np.array([cfg.value_range, -cfg.value_range]), frac_bits=32, value_range=cfg.value_range)
    total = np.zeros(2, np.uint64)
    for _ in range(cfg.n_sites):
        total += one
    np.testing.assert_array_equal(decode(total, frac_bits=32), [2047 * 2.0**20, -2047 * 2.0**20])


# -- fixed point ----------------------------------------------------------------------------

def test_fixed_point_round_trip():
    cfg = SecAggConfig(5)
    rng = np.random.default_rng(1)
    x = np.concatenate([rng.normal(scale=50, size=1000), [0.0, -0.0, 1.0, -1.0, cfg.value_range,
                                                           -cfg.value_range, 1e-12, -1e-12]])
    y = cfg.encode(x, rng=rng)
    assert y.dtype == np.uint64 and y.shape == x.shape
    back = cfg.decode(y)
    assert np.all(np.abs(back - x) < cfg.quantum)
    # relative precision ~1e-9 or better for values of order 1-100
    big = np.abs(x) >= 1
    assert np.max(np.abs(back - x)[big] / np.abs(x[big])) < 1e-9
    # multiples of the quantum are exact
    k = np.arange(-5, 6) * cfg.quantum * 3
    np.testing.assert_array_equal(cfg.decode(cfg.encode(k)), k)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(min_value=-2.0**20, max_value=2.0**20, allow_nan=False), min_size=1, max_size=20))
def test_fixed_point_round_trip_property(values):
    x = np.array(values)
    y = encode(x, frac_bits=32, value_range=2.0**20)
    z = np.ldexp(x, 32)
    # always one of the two neighbouring grid points
    got = y.view(np.int64)
    assert np.all((got == np.floor(z)) | (got == np.ceil(z)))
    assert np.all(np.abs(decode(y, frac_bits=32) - x) <= 2.0**-32)


@pytest.mark.parametrize("base", [0.0, 7.0, -3.0])
@pytest.mark.parametrize("frac", [0.3, -0.3])
def test_stochastic_rounding_unbiased(base, frac):
    # x sits 0.3 quanta off the grid: encodings are floor or ceil, their mean must be x * 2**f.
    # n = 400k draws of a Bernoulli(0.3) offset: sd of the mean 7.2e-4; tolerance 5 sd.
    f, n = 32, 400_000
    x = base + frac * 2.0**-f
    y = encode(np.full(n, x), frac_bits=f, value_range=16.0, rng=np.random.default_rng(2))
    k = y.view(np.int64) - np.int64(base * 2**f)
    assert set(np.unique(k)) <= {math.floor(frac), math.ceil(frac)}
    assert abs(k.mean() - frac) < 5 * math.sqrt(0.3 * 0.7 / n)


def test_out_of_range_is_an_error_never_clipped():
    x = np.array([0.5, 2.5, -3.0, 1.0])
    with pytest.raises(ValueError, match=r"2 of 4 values exceed value_range=2.0 \(max \|x\| = 3.0\)"):
        encode(x, frac_bits=20, value_range=2.0)
    with pytest.raises(ValueError, match="1 of 3 values are not finite"):
        encode(np.array([1.0, np.nan, 0.0]), frac_bits=20, value_range=2.0)
    with pytest.raises(ValueError, match="not finite"):
        encode(np.array([np.inf]), frac_bits=20, value_range=2.0)
    # just above the range is refused too (no silent clipping to the bound)
    with pytest.raises(ValueError, match="exceed"):
        encode(np.array([np.nextafter(2.0, 3.0)]), frac_bits=20, value_range=2.0)


def test_decode_two_complement_sum():
    cfg = SecAggConfig(4)
    xs = [np.array([-1.5, 2.25, -1000.0]), np.array([-0.5, -4.25, 999.0]), np.array([0.0, 0.0, -2.0])]
    total = sum(cfg.encode(x) for x in xs)
    np.testing.assert_array_equal(cfg.decode(total), [-2.0, -2.0, -3.0])


# -- Shamir -----------------------------------------------------------------------------------

def test_shamir_any_t_of_n_reconstruct():
    secret = int.from_bytes(b"\x17" * 32, "big")
    n, t = 7, 5
    shares = shamir.split(secret, n, t)
    for subset in itertools.combinations(range(1, n + 1), t):
        assert shamir.reconstruct({x: shares[x - 1] for x in subset}) == secret
    # more than t shares also work
    assert shamir.reconstruct({x: shares[x - 1] for x in range(1, n + 1)}) == secret


def test_shamir_t_minus_1_shares_do_not_determine_the_secret():
    n, t = 7, 5
    secret = int.from_bytes(bytes(range(32)), "big")
    shares = shamir.split(secret, n, t)
    seen = {x: shares[x - 1] for x in (2, 3, 5, 7)}  # t - 1 shares
    # every other secret is equally consistent: the degree-(t-1) polynomial through
    # (0, other) and the t-1 shares exists, and it reproduces those shares
    for other in (0, 1, secret + 1, PRIME - 1):
        basis = {0: other, **seen}
        assert len(basis) == t
        assert all(shamir.interpolate(basis, x) == y for x, y in seen.items())
    # interpolating the t-1 shares alone does not give the secret
    assert shamir.reconstruct(seen) != secret


def test_shamir_verified_names_wrong_share():
    secret = 12345
    shares = shamir.split(secret, 7, 5)
    pts = {x: shares[x - 1] for x in range(1, 8)}
    pts[3] = (pts[3] + 1) % PRIME
    rec = shamir.reconstruct_verified(pts, 5, lambda s: s == secret)
    assert rec.secret == secret and rec.bad == (3,)
    # exactly t shares with a wrong one: detected, but cannot be attributed
    only_t = {x: pts[x] for x in (1, 2, 3, 4, 5)}
    with pytest.raises(shamir.ShamirError, match="cannot be identified"):
        shamir.reconstruct_verified(only_t, 5, lambda s: s == secret)
    with pytest.raises(shamir.ShamirError, match="4 shares given, 5 needed"):
        shamir.reconstruct_verified({x: pts[x] for x in (1, 2, 4, 5)}, 5, lambda s: True)


# -- masks ------------------------------------------------------------------------------------

def test_pairwise_masks_cancel_and_keys_agree():
    sks = [prg.new_private_key() for _ in range(4)]
    pks = [prg.public_key(k) for k in sks]
    n = 1001
    total = np.zeros(n, np.uint64)
    for u in range(4):
        y = np.zeros(n, np.uint64)
        for v in range(4):
            if v != u:
                key = prg.mask_key(sks[u], pks[v], "tag", u, v, 0, 3, "topic")
                assert key == prg.mask_key(sks[v], pks[u], "tag", v, u, 0, 3, "topic")
                prg.add_mask(y, key, +1 if u < v else -1)
        assert np.count_nonzero(y) > n - 5  # each site's masked vector looks random
        total += y
    assert not total.any()
    # different rounds/topics give unrelated masks
    k1 = prg.mask_key(sks[0], pks[1], "tag", 0, 1, 0, 3, "topic")
    k2 = prg.mask_key(sks[0], pks[1], "tag", 0, 1, 0, 4, "topic")
    k3 = prg.mask_key(sks[0], pks[1], "tag", 0, 1, 0, 3, "other")
    assert len({k1, k2, k3}) == 3
    np.testing.assert_array_equal(prg.keystream_u64(k1, 10), prg.keystream_u64(k1, 20)[:10])


# -- end to end under the driver ---------------------------------------------------------------

@pytest.mark.parametrize("n_sites", range(3, 11))
def test_exact_sum_no_dropout(n_sites):
    cfg = SecAggConfig(n_sites)
    inputs = site_inputs(n_sites, seed=n_sites)
    proto, result = run(cfg, inputs)
    log = check_sums(cfg, inputs, proto, result)
    assert all(e["included"] == list(range(n_sites)) for e in log)
    # every surviving site advanced its key epoch once per sum and closed the sum
    for st_ in result.sites:
        assert st_["secagg"]["epoch"] == 2 and st_["secagg"]["open"] is None


# S - t dropouts for every S in 4..10 (S = 3 tolerates none), plus intermediate counts for S = 7, 10
DROPOUT_CASES = [(n, n - min_threshold(n)) for n in range(4, 11)] + [(7, 1), (10, 1), (10, 2)]


@pytest.mark.parametrize("stage", STAGES)
@pytest.mark.parametrize("n_sites, n_drop", DROPOUT_CASES)
def test_exact_sum_with_dropouts(n_sites, n_drop, stage):
    """``n_drop`` sites vanish at one stage of round 0; both sums still come out right."""
    cfg = SecAggConfig(n_sites)
    assert 1 <= n_drop <= cfg.max_dropouts
    gone = drop_sites(n_sites, n_drop)
    inputs = site_inputs(n_sites, seed=100 + n_sites)
    proto, result = run(cfg, inputs, drops={(s, 0, stage) for s in gone})
    log = check_sums(cfg, inputs, proto, result)
    survivors = sorted(set(range(n_sites)) - set(gone))
    if stage == "sum-unmask":  # their round-0 inputs were sent, so they count
        assert log[0]["included"] == list(range(n_sites))
        assert log[0]["responded"] == survivors
        assert log[1]["dropped_before_input"] == sorted(gone)  # their next keys are reconstructed
    else:
        assert log[0]["included"] == survivors
    assert log[1]["included"] == survivors
    assert all(result.sites[s] is None for s in gone)
    assert_never_both_share_kinds(proto)


def test_dropouts_spread_over_stages_and_rounds():
    """S=10, t=7: one dropout in keys, one in masked (round 0), one in unmask (round 1); three sums."""
    cfg = SecAggConfig(10)
    inputs = site_inputs(10, seed=7)
    drops = {(2, 0, "secagg-keys"), (5, 0, "sum-masked"), (8, 1, "sum-unmask")}
    proto, result = run(cfg, inputs, n_sums=3, drops=drops)
    log = check_sums(cfg, inputs, proto, result)
    assert [e["included"] for e in log] == [[0, 1, 3, 4, 6, 7, 8, 9], [0, 1, 3, 4, 6, 7, 8, 9],
                                            [0, 1, 3, 4, 6, 7, 9]]
    assert [e["dropped_before_input"] for e in log] == [[5], [], [8]]
    assert_never_both_share_kinds(proto)


def test_share_keys_dropout_then_unmask_dropout():
    cfg = SecAggConfig(7)  # t = 5
    inputs = site_inputs(7, seed=8)
    proto, result = run(cfg, inputs, drops={(0, 0, "secagg-share-keys"), (6, 0, "sum-unmask")})
    log = check_sums(cfg, inputs, proto, result)
    assert log[0]["included"] == [1, 2, 3, 4, 5, 6] and log[1]["included"] == [1, 2, 3, 4, 5]
    assert_never_both_share_kinds(proto)


def test_late_site_is_dropped_and_its_input_stays_masked():
    """A site whose masked input misses the deadline is left out; its s key (not its b seed) is revealed,
    and the site itself stops quietly (SecAggDropped is a SiteDropped) instead of failing the run."""
    cfg = SecAggConfig(4)
    inputs = site_inputs(4, seed=11)

    def slow(site, rnd, topic, payload):
        if site == 2 and topic == "sum-masked" and rnd == 0:
            time.sleep(1.5 * TIMEOUT)
        return payload

    proto, result = run(cfg, inputs, n_sums=1, tamper=slow)
    log = check_sums(cfg, inputs, proto, result)
    assert log[0]["included"] == [0, 1, 3] and log[0]["dropped_before_input"] == [2]
    assert result.sites[2] is None
    unmask = proto.seen[(0, "sum-unmask")]
    assert all(p.meta["s_for"] == [2] and 2 not in p.meta["b_for"] for p in unmask.values())


def assert_never_both_share_kinds(proto):
    """Per sum, the aggregator got b-shares and s-key shares for disjoint sets of sites."""
    for (rnd, topic), msgs in proto.seen.items():
        if not topic.endswith("-unmask"):
            continue
        b_owners = {v for p in msgs.values() for v in p.meta["b_for"]}
        s_owners = {v for p in msgs.values() for v in p.meta["s_for"]}
        assert not b_owners & s_owners, (rnd, b_owners, s_owners)


@pytest.mark.parametrize("stage, pattern", [
    ("secagg-keys", "only 3 of 5 sites advertised keys"),
    ("sum-masked", "only 3 of the 5 sites sent masked inputs"),
    ("sum-unmask", "only 3 sites responded to unmasking"),
])
def test_too_few_survivors_is_a_clear_error(stage, pattern):
    cfg = SecAggConfig(5)  # t = 4: two dropouts are one too many
    proto = SumProtocol(cfg, n_sums=1, drops={(1, 0, stage), (3, 0, stage)})
    with pytest.raises(SecAggError, match=pattern) as info:
        simulate(proto, site_inputs(5), options=RunOptions(timeout=TIMEOUT))
    assert "threshold t=4" in str(info.value)


def _corrupt(kind, sender, owner):
    """A tamper hook flipping one bit of ``sender``'s share of ``owner``'s b seed or s key."""
    def tamper(site, rnd, topic, payload):
        if site != sender or not topic.endswith("-unmask") or rnd != 0:
            return payload
        names = payload.meta[f"{kind}_for"]
        rows = payload.arrays[f"{kind}_shares"].copy()
        rows[names.index(owner), -1] ^= 1
        return dataclasses.replace(payload, arrays={**payload.arrays, f"{kind}_shares": rows})
    return tamper


def test_corrupted_b_share_detected_named_and_outvoted():
    cfg = SecAggConfig(5)  # t = 4, 5 responders: one wrong share can be identified
    inputs = site_inputs(5, seed=9)
    with pytest.warns(SecAggWarning, match=r"self-mask seed of site 2 sent by sites 4 are inconsistent"):
        proto, result = run(cfg, inputs, n_sums=1, tamper=_corrupt("b", sender=4, owner=2))
    check_sums(cfg, inputs, proto, result)
    assert result.aggregator["secagg"]["bad_shares"] == [
        {"topic": "sum", "round": 0, "secret": "the self-mask seed of site 2", "sites": [4]}]


def test_corrupted_s_share_detected_and_named():
    cfg = SecAggConfig(7)  # t = 5; site 0 drops before its input, 6 responders
    inputs = site_inputs(7, seed=10)
    with pytest.warns(SecAggWarning, match=r"mask key of dropped site 0 sent by sites 3 are inconsistent"):
        proto, result = run(cfg, inputs, n_sums=1, drops={(0, 0, "sum-masked")},
                            tamper=_corrupt("s", sender=3, owner=0))
    check_sums(cfg, inputs, proto, result)


def test_corrupted_share_with_exactly_t_responders_is_an_error():
    cfg = SecAggConfig(5)  # t = 4; one dropout leaves exactly t responders
    proto = SumProtocol(cfg, n_sums=1, drops={(0, 0, "sum-unmask")}, tamper=_corrupt("b", sender=4, owner=2))
    with pytest.raises(SecAggError, match="could not reconstruct the self-mask seed of site 2 from the shares "
                                          "of sites 1, 2, 3, 4"):
        simulate(proto, site_inputs(5), options=RunOptions(timeout=TIMEOUT))


def test_masked_input_independent_of_input():
    """The aggregator's view of one masked input does not depend on the input.

    Site 0 sends all zeros, site 1 all ones (2**32 in the ring), 20,000 words
    each. Tests, each at significance 1e-3: chi-square uniformity of the top
    8 bits (256 bins) of each masked vector, and a two-sample KS test between
    the two masked vectors. The unmasked encodings fail the same tests.
    """
    n, alpha = 20_000, 1e-3
    cfg = SecAggConfig(3)
    inputs = [np.zeros(n), np.ones(n), np.full(n, 5.0)]
    proto, result = run(cfg, inputs, n_sums=1)
    np.testing.assert_allclose(result.aggregator["totals"][0], 6.0, atol=3 * cfg.quantum)
    masked = proto.seen[(0, "sum-masked")]
    y0, y1 = masked[0].arrays["y"], masked[1].arrays["y"]

    def top_byte_pvalue(y):
        counts = np.bincount((y >> np.uint64(56)).astype(np.int64), minlength=256)
        return stats.chisquare(counts).pvalue

    assert top_byte_pvalue(y0) > alpha and top_byte_pvalue(y1) > alpha
    as_unit = lambda y: (y >> np.uint64(11)).astype(np.float64) / 2.0**53  # noqa: E731
    assert stats.ks_2samp(as_unit(y0), as_unit(y1)).pvalue > alpha
    assert stats.kstest(as_unit(y0), "uniform").pvalue > alpha
    # power check: the unmasked encodings are obviously not uniform
    assert top_byte_pvalue(cfg.encode(inputs[1])) < alpha


def test_only_masked_or_encrypted_data_leaves_a_site():
    cfg = SecAggConfig(4)
    proto, result = run(cfg, site_inputs(4), n_sums=1)
    allowed = {"public", "encrypted-share", "secagg-mask", "secagg-share"}
    for site in range(4):
        for rec in result.exchange.egress_log(site):
            if rec["topic"] == "final":
                continue
            for name, arr in rec["arrays"].items():
                assert arr["carries"] in allowed, (rec["topic"], name)
                assert arr["dtype"] in ("uint8", "uint64"), (rec["topic"], name)


def _setup_inline(n_sites, round=0):
    cfg = SecAggConfig(n_sites)
    states = {s: {"site": s, "_x": np.full(3, float(s))} for s in range(n_sites)}
    agg: dict = {}
    share_keys = run_inline(setup_phases(cfg), states, agg, round)
    return cfg, states, agg, share_keys


def test_site_refuses_request_for_both_shares_of_one_site():
    cfg, states, agg, incoming = _setup_inline(4)
    masked, unmask = sum_phases(cfg, "sum", "_x", lambda a, r, t: Payload())
    msgs = {s: masked.site(st_, 0, incoming) for s, st_ in states.items()}
    bcast = masked.aggregator(agg, 0, msgs)
    assert bcast.meta["s_request"] == []
    # a (curious) aggregator asking for site 2's mask key although site 2's input is in the sum
    bad = dataclasses.replace(bcast, meta={**bcast.meta, "s_request": [2]})
    with pytest.raises(SecAggError, match="site 0 refuses to unmask .* both the self-mask seed and the mask "
                                          "key of sites 2"):
        unmask.site(states[0], 0, bad)
    # ... or for s only, leaving b out: still refused, site 2's input is in the sum
    bad = dataclasses.replace(bcast, meta={**bcast.meta, "b_request": [0, 1, 3], "s_request": [2]})
    with pytest.raises(SecAggError, match="mask keys of sites 2, whose masked inputs are in the sum"):
        unmask.site(states[1], 0, bad)
    # too few inputs in the sum
    bad = dataclasses.replace(bcast, meta={**bcast.meta, "u2": [0, 1], "b_request": [0, 1]})
    with pytest.raises(SecAggError, match="only 2 inputs are in the sum"):
        unmask.site(states[3], 0, bad)
    # the honest request goes through, and the sum is right
    replies = {s: unmask.site(st_, 0, bcast) for s, st_ in states.items()}
    assert all(p.meta["s_for"] == [] and p.meta["b_for"] == [0, 1, 2, 3] for p in replies.values())
    out = unmask.aggregator(agg, 0, replies)
    assert out.meta["secagg_included"] == [0, 1, 2, 3]


def test_site_refuses_too_few_advertised_keys():
    cfg = SecAggConfig(5)
    states = {s: {"site": s} for s in range(5)}
    keys, share = setup_phases(cfg)
    msgs = {s: keys.site(st_, 0, None) for s, st_ in states.items()}
    bcast = keys.aggregator({}, 0, msgs)
    short = Payload(arrays={k: v[:3] for k, v in bcast.arrays.items()}, meta={**bcast.meta, "u0": [0, 1, 2]})
    with pytest.raises(SecAggError, match="site 0 refuses to continue: only 3 sites advertised keys"):
        share.site(states[0], 0, short)


def test_keys_ratchet_so_a_revealed_key_covers_one_sum_only():
    """A site that drops at unmasking has b revealed for that sum; its s key revealed in the
    next sum must be a fresh key that never masked anything it sent."""
    cfg, states, agg, incoming = _setup_inline(4)
    first_pk = {s: prg.public_key(st_["secagg"]["s_sk"]) for s, st_ in states.items()}
    phases = sum_phases(cfg, "sum", "_x", lambda a, r, t: Payload(arrays={"t": t}))
    out = run_inline(phases, states, agg, 0, incoming, skip=())
    np.testing.assert_allclose(out.arrays["t"], 6.0, atol=4 * cfg.quantum)
    assert all(prg.public_key(st_["secagg"]["s_sk"]) != first_pk[s] for s, st_ in states.items())
    # round 1: site 3 is gone; its epoch-1 key is reconstructed, not the epoch-0 one
    live = {s: states[s] for s in (0, 1, 2)}
    for s, st_ in live.items():
        st_["_x"] = np.full(3, float(s))  # the sum took round 0's input
    masked, unmask = phases
    bcast = masked.aggregator(agg, 1, {s: masked.site(st_, 1, out) for s, st_ in live.items()})
    assert bcast.meta["s_request"] == [3]
    replies = {s: unmask.site(st_, 1, bcast) for s, st_ in live.items()}
    assert all(p.meta["s_for"] == [3] and 3 not in p.meta["b_for"] for p in replies.values())
    total = unmask.aggregator(agg, 1, replies).arrays["t"]
    np.testing.assert_allclose(total, 3.0, atol=3 * cfg.quantum)
    assert agg["secagg"]["log"][1]["epoch"] == 1


def test_states_are_checkpointable():
    cfg, states, agg, incoming = _setup_inline(3)
    masked, _ = sum_phases(cfg, "sum", "_x", lambda a, r, t: Payload())
    msgs = {s: masked.site(st_, 0, incoming) for s, st_ in states.items()}
    masked.aggregator(agg, 0, msgs)
    for state in [states[0], agg]:
        j, arrays = encode_state(state)
        restored = decode_state(j, arrays)
        assert restored["secagg"].keys() == state["secagg"].keys()
    np.testing.assert_array_equal(decode_state(*encode_state(agg))["secagg"]["open"]["ysum"],
                                  agg["secagg"]["open"]["ysum"])


def test_commitment_is_sha256_of_seed():
    # the b commitment is SHA-256 of the 32-byte seed, which Shamir recovers as an integer
    seed = bytes(range(32))
    value = shamir.reconstruct({x: y for x, y in enumerate(shamir.split(int.from_bytes(seed, "big"), 4, 3), 1)})
    assert hashlib.sha256(value.to_bytes(32, "big")).digest() == hashlib.sha256(seed).digest()


def test_interleaved_sums_refused():
    cfg, states, agg, incoming = _setup_inline(3)
    a = sum_phases(cfg, "a", "_x", lambda ag, r, t: Payload())
    b = sum_phases(cfg, "b", "_x", lambda ag, r, t: Payload())
    a[0].site(states[0], 0, incoming)
    with pytest.raises(SecAggError, match="'a' is still open; sums may not interleave"):
        b[0].site(states[0], 0, None)


def test_sum_input_is_taken_from_the_state_once():
    """A site adds what its protocol put in the state just before the sum, and the sum takes it out of the state:
    a later sum cannot send it again, and a sum without an input stops the site by name."""
    cfg, states, agg, incoming = _setup_inline(3)
    masked, _ = sum_phases(cfg, "sum", "_x", lambda a, r, t: Payload())
    masked.site(states[0], 0, incoming)
    assert "_x" not in states[0]
    masked_next, _ = sum_phases(cfg, "next", "_x", lambda a, r, t: Payload())
    states[0]["secagg"].pop("open")  # as if the first sum had ended
    with pytest.raises(SecAggError, match=r"site 0: secure sum 'next' has no input: .*state\['_x'\]"):
        masked_next.site(states[0], 0, None)
    with pytest.raises(ValueError, match="input_key must start with '_'"):
        sum_phases(cfg, "sum", "x", lambda a, r, t: Payload())
