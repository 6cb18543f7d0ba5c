"""A site never releases more than its own configuration promises, whatever the aggregator's noise plan says.

The aggregator broadcasts the variance plan every site draws its noise from. A deviating aggregator (or anyone
who can write its messages) forges that plan here; every site must refuse before it draws or sends anything.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from cape_toys import Zeros

from dpneuro._utils.errors import UnsafeRelease
from dpneuro.privacy import cape_release_mu
from dpneuro.protocol.cape import NoisePlan, ReleaseSpec, cape_protocol
from dpneuro.protocol.cape.guard import verify_plan
from dpneuro.protocol.cape.plans import ZERO_SUM_VARIANCE, plan_variances, symmetric_guarantee
from dpneuro.protocol.driver import Phase, RunOptions
from dpneuro.protocol.exchange import InProcessExchange, Payload
from dpneuro.protocol.simulation import simulate

SPEC = ReleaseSpec((4,), sensitivity=0.5, noise_multiplier=2.0)  # tau = 1


def _forging(proto, forge):
    """``proto`` whose aggregator rewrites the plan arrays of its set-up broadcast with ``forge``."""
    setup = proto._setup[0]

    def agg(state, rnd, msgs):
        out = setup.aggregator(state, rnd, msgs)
        arrays = dict(out.arrays)
        forge(arrays)
        return Payload(arrays, out.meta, out.carries)

    proto._setup[0] = Phase(setup.topic, setup.site, agg, setup.site_spec, setup.broadcast_spec, setup.allow_dropout)
    return proto


def _scale(prefix, factor):
    def forge(arrays):
        for k in list(arrays):
            if k.startswith(prefix):
                arrays[k] = arrays[k] * factor
    return forge


def _run_forged(kind, forge, S=4, every_site=True):
    """Run under a forged plan; nothing noised leaves any site (with ``every_site``, nothing masked either: every
    site refused, where a plan that keeps some site within its promise lets that one take part in the masked sum)."""
    proto = _forging(cape_protocol(Zeros(shape=(50,)), kind, n_sites=S), forge)
    ex = InProcessExchange(S)
    with pytest.raises(UnsafeRelease) as err:
        simulate(proto, [10] * S, exchange=ex, options=RunOptions(timeout=10))
    for s in range(S):
        topics = {rec["topic"] for rec in ex.egress_log(s)}
        assert not topics & ({"release", "zs-masked"} if every_site else {"release"}), (s, topics)
    return str(err.value)


@pytest.mark.parametrize("forge, field", [
    (lambda a: (_scale("cape/e_var/", 1e-16)(a), _scale("cape/g_var/", 1e-16)(a)), "cape/"),  # the attack
    (_scale("cape/g_var/", 1e-4), "cape/e_var/f"),  # only the local part: a release alone still looks noisy
    (_scale("cape/e_var/", 1 / ZERO_SUM_VARIANCE), "cape/e_var/f"),  # the papers' c = 1: a weaker guarantee
])
def test_every_site_refuses_a_forged_cape_plan_before_it_releases(forge, field):
    msg = _run_forged("cape", forge)
    assert "refuses to release" in msg and field in msg and "nothing was released" in msg


def test_every_site_refuses_a_forged_conv_plan():
    msg = _run_forged("conv", _scale("cape/g_var/", 0.5))
    assert "cape/g_var/f" in msg and "below" in msg


def test_a_plan_without_this_site_or_with_bad_weights_is_refused():
    def drop_site(arrays):
        arrays["cape/sites"] = arrays["cape/sites"][:-1]
        for k in list(arrays):
            if k != "cape/sites" and k.startswith("cape/"):
                arrays[k] = arrays[k][:-1] / (arrays[k][:-1].sum() if k == "cape/weights" else 1.0)

    # site 3 is not in the plan; the others, planned as if 3 sites were the consortium, get a weaker guarantee
    assert "refuses to release" in _run_forged("cape", drop_site, every_site=False)

    def skew(arrays):
        arrays["cape/weights"] = np.array([0.97, 0.01, 0.01, 0.01])

    assert "refuses" in _run_forged("cape", skew, every_site=False)


def test_the_honest_plan_passes_and_the_ledger_equals_the_promise():
    res = simulate(cape_protocol(Zeros(shape=(50,)), "cape", n_sites=4), [10] * 4, options=RunOptions(timeout=10))
    promised = symmetric_guarantee(4, 1, ZERO_SUM_VARIANCE) * SPEC.sensitivity / SPEC.tau
    for st in res.sites:
        assert st["ledger"].releases[0].mu_collusion == pytest.approx(promised, rel=1e-9)


def test_unequal_sites_each_meet_their_promise_under_their_own_plan():
    taus = np.array([0.5, 1.0, 2.0, 1.5])
    w = np.array([0.1, 0.2, 0.3, 0.4])
    plan = NoisePlan()
    v = plan_variances(plan, taus, w)
    arrays = {"cape/sites": np.arange(4), "cape/weights": w, "cape/e_var/f": v.e_hat, "cape/g_var/f": v.g}
    for s in range(4):
        spec = ReleaseSpec((4,), 0.5, taus[s] / 0.5)
        assert verify_plan(arrays, {"f": spec}, s, plan, 4) == s


def test_whatever_a_forged_plan_claims_a_site_that_accepts_it_is_within_its_promise():
    """500 random forgeries of an honest 5-site plan (each entry scaled by 10^U(-3, 3), weights jittered): every
    plan a site accepts gives it, by the ledger's own formula, at least its noise alone and at most its promised
    guarantee; and the check is not vacuous: some forgeries are accepted, most are refused."""
    rng = np.random.default_rng(7)
    S, plan = 5, NoisePlan(n_colluding=1)
    taus, w = np.ones(S), np.full(S, 1 / S)
    honest = plan_variances(plan, taus, w)
    spec = ReleaseSpec((4,), 0.5, 2.0)
    promised = symmetric_guarantee(S, 1, ZERO_SUM_VARIANCE) * spec.sensitivity / spec.tau
    accepted = 0
    for _ in range(500):
        e = honest.e_hat * 10 ** rng.uniform(-3, 3, S) ** rng.integers(0, 2)
        g = honest.g * 10 ** rng.uniform(-3, 3, S) ** rng.integers(0, 2)
        ww = w * np.exp(rng.normal(0, 0.3, S) * rng.integers(0, 2))
        ww /= ww.sum()
        arrays = {"cape/sites": np.arange(S), "cape/weights": ww, "cape/e_var/f": e, "cape/g_var/f": g}
        try:
            verify_plan(arrays, {"f": spec}, 0, plan, S)
        except UnsafeRelease:
            continue
        accepted += 1
        assert cape_release_mu(spec.sensitivity, e, g, ww, 0, 1) <= promised * (1 + 1e-6)
    assert 5 <= accepted <= 450, accepted


def test_a_forged_power_iteration_basis_is_refused():
    """capePCA's streamed mode releases A_s V for the broadcast V: its sensitivity holds for orthonormal V only."""
    from dpneuro.algorithms.pca import CapePCA

    with pytest.raises(UnsafeRelease, match="'V'"):
        CapePCA._broadcast_basis({"site": 0, "_src": type("S", (), {"dim": 6})()},
                                 Payload({"V": 1e3 * np.eye(6)[:, :2]}), 2)
    V = np.linalg.qr(np.random.default_rng(0).standard_normal((6, 2)))[0]
    assert np.array_equal(CapePCA._broadcast_basis({"site": 0, "_src": type("S", (), {"dim": 6})()},
                                                   Payload({"V": V}), 2), V)


def test_survivors_of_a_dropout_keep_the_consortiums_promise():
    """The aggregator's plan for 4 survivors of 5 sites passes every survivor's check; the 4-site symmetric
    plan (what a consortium configured with 4 sites would get) does not."""
    plan = NoisePlan(n_colluding=1)
    taus, w = np.ones(4), np.full(4, 0.25)
    survivors = plan_variances(plan, taus, w, consortium=5)
    four = plan_variances(plan, taus, w)
    spec = ReleaseSpec((4,), 0.5, 2.0)
    for v, ok in ((survivors, True), (four, False)):
        arrays = {"cape/sites": np.array([0, 1, 2, 4]), "cape/weights": w, "cape/e_var/f": v.e_hat,
                  "cape/g_var/f": v.g}
        if ok:
            assert verify_plan(arrays, {"f": spec}, 4, plan, 5) == 3
        else:
            with pytest.raises(UnsafeRelease, match="5 sites"):
                verify_plan(arrays, {"f": spec}, 4, plan, 5)
    assert math.isclose(cape_release_mu(0.5, survivors.e_hat, survivors.g, w, 0, 1),
                        symmetric_guarantee(5, 1, ZERO_SUM_VARIANCE) * 0.5, rel_tol=1e-9)


def test_a_plan_signed_with_the_aggregators_own_key_is_refused_by_every_site(tmp_path):
    """The issue's attack as deployed: each party in its own thread with its own signing key over a shared folder;
    the aggregator's plan (validly signed by it) asks for noise of variance 1e-16. Every site refuses, by name,
    and no site's egress log holds a noised or masked release."""
    import threading

    import deploy_common as dc

    from dpneuro.protocol.driver import run_aggregator, run_site
    from dpneuro.protocol.exchange import DirectoryExchange
    from dpneuro.protocol.exchange.keys import PartyKeys, load_private_key, read_public_keys

    names = ["site-01", "site-02", "site-03", "site-04"]
    keys_file, private = dc.party_keys(tmp_path / "keys", names)
    public = read_public_keys(keys_file)

    def exchange(party):
        keys = PartyKeys(party, load_private_key(private[party]), public, names)
        return DirectoryExchange(tmp_path / "shared", 4, run_id="run", key=keys, site_names=names)

    proto = _forging(cape_protocol(Zeros(shape=(50,)), "cape", n_sites=4),
                     lambda a: (_scale("cape/e_var/", 1e-16)(a), _scale("cape/g_var/", 1e-16)(a)))
    out: dict = {}

    def party(name, fn):
        try:
            out[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[name] = exc

    agg_ex = exchange("aggregator")
    threads = [threading.Thread(target=party, args=("aggregator", lambda: run_aggregator(
        proto, agg_ex, options=RunOptions(timeout=4))))]
    threads += [threading.Thread(target=party, args=(n, lambda s=s, n=n: run_site(proto, s, 10, exchange(n),
                                                                                   timeout=20)))
                for s, n in enumerate(names)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    for n in names:
        assert isinstance(out[n], UnsafeRelease), out[n]
        assert f"site {n!r} refuses to release" in str(out[n])
    for s in range(4):
        assert not {r["topic"] for r in agg_ex.egress_log(s)} & {"release", "zs-masked"}
