import importlib
import inspect
import json
import math
import pkgutil

import dp_accounting
import numpy as np
import pytest
from scipy import stats

import dpneuro
from dpneuro.algorithms.agn import cape_agn
from dpneuro.privacy import (
    PrivacyLedger,
    cape_delta,
    cape_delta_asymmetric,
    cape_mu_z,
    check_collusion,
    gaussian,
    gaussian_epsilon,
    gaussian_sigma,
    gdp_delta,
    max_colluding,
    moments_accountant_epsilon,
    mu_z_numeric,
    rdp_closed_form_epsilon,
    resolve_random_state,
)
from dpneuro.privacy.cape_delta import cape_mu_z_paper, cape_release_mu

DELTA = 1e-5


@pytest.mark.parametrize("eps", [0.05, 0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 50.0])
@pytest.mark.parametrize("delta", [1e-2, 1e-5, 1e-8])
def test_analytic_sigma_matches_dp_accounting(eps, delta):
    ours = gaussian_sigma(eps, delta)
    ref = dp_accounting.get_sigma_gaussian(eps, delta)
    assert ours == pytest.approx(ref, rel=1e-4)


def test_sigma_scales_with_sensitivity_and_roundtrips():
    s1 = gaussian_sigma(0.7, 1e-5, sensitivity=1.0)
    assert gaussian_sigma(0.7, 1e-5, sensitivity=0.01) == pytest.approx(0.01 * s1, rel=1e-12)
    assert gaussian_epsilon(s1, 1e-5) == pytest.approx(0.7, rel=1e-8)
    # a sigma off by sqrt(2) misses the target delta by orders of magnitude
    assert gdp_delta(0.7, math.sqrt(2) / s1) > 10 * 1e-5


def test_classic_formula_value_and_refusal():
    eps, delta = 0.5, 1e-5
    expected = math.sqrt(2 * math.log(1.25 / delta)) * 2.0 / eps
    assert gaussian_sigma(eps, delta, 2.0, method="classic") == pytest.approx(expected, rel=1e-15)
    # classic is never tighter than analytic
    assert gaussian_sigma(eps, delta, method="classic") > gaussian_sigma(eps, delta)
    with pytest.raises(ValueError, match="analytic"):
        gaussian_sigma(1.0, delta, method="classic")
    with pytest.raises(ValueError, match="analytic"):
        gaussian_sigma(3.0, delta, method="classic")


@pytest.mark.parametrize("bad", [(0.0, 1e-5), (-1.0, 1e-5), (1.0, 0.0), (1.0, 1.0), (float("nan"), 1e-5)])
def test_sigma_rejects_bad_parameters(bad):
    with pytest.raises(ValueError):
        gaussian_sigma(*bad)


def test_ledger_reference_figures():
    led = PrivacyLedger("site-01")
    led.record("grad", sensitivity=1.0, sigma=5.0, count=100)
    assert led.epsilon(DELTA, "exact") == pytest.approx(10.00, abs=0.005)
    assert led.epsilon(DELTA, "pld") == pytest.approx(10.00, abs=0.01)
    assert led.epsilon(DELTA, "rdp") == pytest.approx(10.73, abs=0.01)

    led2 = PrivacyLedger()
    led2.record("grad", sensitivity=1.0, sigma=2.0, count=1000)
    assert led2.epsilon(DELTA, "exact") == pytest.approx(191.5, abs=0.05)
    assert led2.epsilon(DELTA, "rdp") == pytest.approx(198.5, abs=0.1)


def test_ledger_count_is_composition():
    once = PrivacyLedger()
    once.record("x", 0.3, 1.2, count=1)
    many = PrivacyLedger()
    many.record("x", 0.3, 1.2, count=50)
    loop = PrivacyLedger()
    for _ in range(50):
        loop.record("x", 0.3, 1.2)
    assert many.epsilon(DELTA) == pytest.approx(loop.epsilon(DELTA), rel=1e-12)
    assert many.epsilon(DELTA) > 3 * once.epsilon(DELTA)
    assert many.mu == pytest.approx(math.sqrt(50) * 0.3 / 1.2)


def test_two_mechanisms_per_round_equal_one():
    zw, zb = 3.0, 4.0
    two = PrivacyLedger()
    two.record("W", 1.0, zw, count=200)
    two.record("b", 1.0, zb, count=200)
    z = 1 / math.sqrt(1 / zw**2 + 1 / zb**2)
    one = PrivacyLedger()
    one.record("Wb", 1.0, z, count=200)
    for method in ("exact", "rdp"):
        assert two.epsilon(DELTA, method) == pytest.approx(one.epsilon(DELTA, method), rel=1e-6)


def test_ledger_roundtrip_merge_and_stages():
    a = PrivacyLedger("site-02")
    a.record("cov", 0.01, 0.1, unit="subject", stage="pca")
    a.note("the scaling constant is public")
    b = PrivacyLedger("site-02")
    b.record("G", 0.2, 1.0, count=30, stage="ica")
    d = json.loads(json.dumps(a.merge(b).to_dict()))
    m = PrivacyLedger.from_dict(d)
    assert [r.name for r in m.releases] == ["cov", "G"]
    assert m.notes == ["the scaling constant is public"]
    assert m.mu == pytest.approx(math.sqrt(0.1**2 + 30 * 0.2**2))
    st = m.by_stage()
    assert st["pca"] == pytest.approx(0.1) and st["ica"] == pytest.approx(math.sqrt(30) * 0.2)
    with pytest.raises(ValueError, match="different parties"):
        a.merge(PrivacyLedger("site-03"))
    with pytest.raises(ValueError, match="count"):
        a.record("x", 1.0, 1.0, count=0)
    with pytest.raises(ValueError, match="unit"):
        a.record("x", 1.0, 1.0, unit="voxel")
    assert PrivacyLedger().epsilon(DELTA) == 0.0


@pytest.mark.parametrize("J,sigma", [(1, 3.0), (100, 5.0), (1000, 2.0), (50, 0.7)])
def test_moments_accountant_corrected_quadratic_equals_rdp_closed_form(J, sigma):
    ma = moments_accountant_epsilon(J, 1.0, sigma, DELTA)
    rdp = rdp_closed_form_epsilon(J, 1.0, sigma, DELTA)
    assert ma == pytest.approx(rdp, rel=1e-10)
    # the paper's printed linear term (-eps instead of -eps/2) gives a different root
    a, c = sigma**2 / (2 * J), J / (8 * sigma**2) + math.log(DELTA)
    wrong = max(np.roots([a, -1.0, c]).real)
    assert abs(wrong - rdp) / rdp > 0.03
    # the continuous-order bound is never below dp-accounting's optimal conversion
    acc = dp_accounting.rdp.RdpAccountant()
    acc.compose(dp_accounting.GaussianDpEvent(sigma), J)
    assert rdp >= acc.get_epsilon(DELTA) - 1e-9


@pytest.mark.parametrize("S", [3, 4, 5, 6, 7, 10, 13, 16, 25])
@pytest.mark.parametrize("c", [1.0, 3.0, 100.0])
def test_cape_closed_form_equals_numeric(S, c):
    """The symmetric plan with var(e_hat) = c tau^2: closed form, the general inversion, and the release's mu."""
    SC = max_colluding(S)
    tau, sens = 0.37, 1 / 250
    closed = cape_mu_z(tau, sens, S, SC, c)
    colluders = list(range(S - SC, S))
    e_var, g_var, w = np.full(S, c * tau**2), np.full(S, tau**2 / S), np.full(S, 1 / S)
    numeric = mu_z_numeric(sens, e_var, g_var, w, 0, colluders)
    assert closed == pytest.approx(numeric, rel=1e-10)
    assert cape_release_mu(sens, e_var, g_var, w, 0, SC) == pytest.approx(math.sqrt(2 * numeric), rel=1e-10)


def test_a_larger_zero_sum_variance_tends_to_the_pooled_guarantee():
    """mu_z falls with c towards S Delta^2 / (2 S_H tau^2): Delta^2 / (2 tau^2) with no colluders, what the pooled
    average (noise tau / S, sensitivity Delta / S) reveals; at the default c = 100 within 1 % of the limit."""
    from dpneuro.protocol.cape.plans import ZERO_SUM_VARIANCE

    tau, sens = 0.5, 0.02
    for S in (3, 4, 10):
        for SC in range(max_colluding(S) + 1):
            mus = [cape_mu_z(tau, sens, S, SC, c) for c in (1, 2, 10, ZERO_SUM_VARIANCE, 1e8)]
            assert all(a > b for a, b in zip(mus, mus[1:]))
            limit = S * sens**2 / (2 * (S - SC) * tau**2)
            assert mus[-1] == pytest.approx(limit, rel=1e-6) and mus[3] == pytest.approx(limit, rel=1e-2)


def test_cape_mu_z_grows_with_colluders_unlike_paper_formula():
    # S_C = 0: the adversary knows the full sum of e_hat; mu_z = 2S/(S+1) * Delta^2/(2 tau^2)
    S, tau, N = 10, 0.5, 10_000
    sens = S / N
    assert cape_mu_z(tau, sens, S, 0) == pytest.approx(2 * S / (S + 1) * sens**2 / (2 * tau**2), rel=1e-12)
    mus = [cape_mu_z(tau, sens, S, c) for c in range(4)]
    assert all(a < b for a, b in zip(mus, mus[1:]))
    # the printed eq. (1) underestimates mu_z (erratum documented in dpneuro.privacy.cape_delta)
    assert cape_mu_z_paper(tau, N, S, 0) < 0.7 * mus[0]


def test_cape_delta_values_and_monotonicity():
    S, N, eps = 10, 10_000, 0.5
    taus = [0.002, 0.003, 0.005, 0.01]
    deltas = [cape_delta(eps, t, N, S) for t in taus]
    assert all(d1 > d2 for d1, d2 in zip(deltas, deltas[1:]))
    mu = cape_mu_z(0.003, S / N, S, 3)
    sz = math.sqrt(2 * mu)
    expected = 2 * sz / (eps - mu) * stats.norm.pdf((eps - mu) / sz)
    assert deltas[1] == pytest.approx(expected, rel=1e-12)
    # fewer assumed colluders -> smaller delta
    assert cape_delta(eps, 0.003, N, S, n_colluding=0) < deltas[1]


def test_cape_refuses_outside_assumptions():
    with pytest.raises(ValueError, match="at least 3 sites"):
        cape_delta(0.5, 0.01, 1000, 2)
    with pytest.raises(ValueError, match="colluding"):
        cape_delta(0.5, 0.01, 1000, 6, n_colluding=2)
    assert check_collusion(6, None) == 1
    assert [max_colluding(s) for s in (3, 4, 6, 7, 9, 10)] == [0, 1, 1, 2, 2, 3]
    with pytest.raises(ValueError, match="mu_z"):
        cape_delta(1e-6, 1e-4, 1000, 5)


def test_cape_asymmetric_numeric_matches_symmetric():
    S, tau, N = 7, 0.02, 7000
    sens = np.full(S, S / N)
    d = cape_delta_asymmetric(0.3, sens, np.full(S, tau**2), np.full(S, tau**2 / S))
    assert d == pytest.approx(np.full(S, cape_delta(0.3, tau, N, S)), rel=1e-9)


@pytest.mark.parametrize("how, off_diagonal_var", [("symmetrized", 2.0), ("mirrored", 4.0)])
def test_symmetric_noise_has_right_variance(how, off_diagonal_var):
    """std 2: the diagonal has variance 4 either way; off the diagonal 4 / 2 when symmetrized, 4 when mirrored."""
    rng = np.random.default_rng(0)
    led = PrivacyLedger()
    draws = np.stack([gaussian(rng, (6, 6), 2.0, led, symmetric=True, symmetric_noise=how) for _ in range(4000)])
    assert led.draws == 4000
    assert np.allclose(draws, np.swapaxes(draws, 1, 2))
    iu = np.triu_indices(6)
    vals = draws[:, iu[0], iu[1]]  # 21 unique entries per draw
    var = np.where(iu[0] == iu[1], 4.0, off_diagonal_var)
    # chi-square: sum of squares / var over n draws ~ chi2(n); two-sided 0.1% bounds per entry
    n = vals.shape[0]
    ss = (vals**2).sum(axis=0) / var
    lo, hi = stats.chi2.ppf([0.0005, 0.9995], n)
    assert np.all((ss > lo) & (ss < hi))
    # unique entries are uncorrelated
    c = np.corrcoef(vals.T)
    assert np.abs(c[np.triu_indices(21, 1)]).max() < 5 / math.sqrt(n)
    with pytest.raises(ValueError, match="symmetric_noise must be one of"):
        gaussian(rng, (6, 6), 2.0, led, symmetric=True, symmetric_noise="upper")


def test_symmetrized_noise_is_the_full_array_mechanism_symmetrized():
    """Gaussian noise on every entry of the D x D array, averaged with its transpose (post-processing of a
    mechanism whose sensitivity is the Frobenius norm), has the symmetrized noise's covariance: the same
    variance entry by entry (both are Gaussian, so the same distribution)."""
    rng = np.random.default_rng(1)
    led = PrivacyLedger()
    D, n, std = 5, 20000, 1.5
    full = rng.standard_normal((n, D, D)) * std
    post = (full + np.swapaxes(full, 1, 2)) / 2
    ours = gaussian(rng, (n, D, D), std, led, symmetric=True)
    ratio = ours.var(axis=0) / post.var(axis=0)
    assert np.all(np.abs(ratio - 1) < 6 * math.sqrt(4 / n))  # two independent sample variances, 6 sd


def test_random_state_is_one_spelling_for_every_seeded_function():
    assert resolve_random_state(None) is None and resolve_random_state(7) == 7
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    assert resolve_random_state(g1) == int(g2.integers(2**62))  # a Generator gives the seed by one draw
    assert isinstance(resolve_random_state(None, fresh=True), int)
    for bad in ("7", 7.0, True, -1, [3, 99]):
        with pytest.raises(ValueError, match="random_state"):
            resolve_random_state(bad)
    rng = np.random.default_rng(0)
    data = [rng.standard_normal((4, 60)) for _ in range(3)]
    a = cape_agn(data, 2, 2.0, 1e-5, scale=4.0, random_state=5, n_restarts=3, n_iter=10)
    b = cape_agn(data, 2, 2.0, 1e-5, scale=4.0, random_state=np.random.default_rng(9), n_restarts=3, n_iter=10)
    seed = int(np.random.default_rng(9).integers(2**62))
    c = cape_agn(data, 2, 2.0, 1e-5, scale=4.0, random_state=seed, n_restarts=3, n_iter=10)
    np.testing.assert_array_equal(b.components, c.components)
    assert not np.array_equal(a.components, c.components)


def test_no_public_function_spells_the_seed_otherwise():
    """Every public function and class of the package takes its seed as ``random_state``, never ``seed`` / ``rng``."""
    # the noise primitives take the party's own generator, which is not a seed
    allowed = {("dpneuro.privacy.noise", "gaussian"), ("dpneuro.privacy.noise", "vector_laplace"),
               ("dpneuro.protocol.secagg.fixedpoint", "encode"),
               ("dpneuro.config.schema", "RunConfig")}  # the TOML field is `seed` (the estimators' random_state)
    found = []
    for mod in pkgutil.walk_packages(dpneuro.__path__, "dpneuro."):
        if mod.name.endswith(".__main__"):
            continue  # a command, run by importing it
        m = importlib.import_module(mod.name)
        for name in getattr(m, "__all__", ()):
            obj = getattr(m, name, None)
            if not callable(obj) or (getattr(obj, "__module__", ""), name) in allowed:
                continue
            try:
                params = inspect.signature(obj).parameters
            except (TypeError, ValueError):
                continue
            found += [f"{mod.name}.{name}({p})" for p in params if p in ("seed", "rng")]
    assert not found
