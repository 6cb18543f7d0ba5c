"""capeAGN / AGN / AVN: tensor algebra, noise, privacy records, utility, bad input."""

import importlib
from math import comb

import numpy as np
import pytest
from scipy import stats
from scipy.stats import ortho_group

from dpneuro.algorithms import tensor as tz
from dpneuro.algorithms.agn import (
    agn,
    avn,
    cape_agn,
    local_agn,
    otd,
    prepare_site,
    sensitivities,
)
from dpneuro.algorithms.metrics import q_comp
from dpneuro.privacy import PrivacyLedger, gaussian, gaussian_sigma
from dpneuro.privacy.noise import vector_laplace
from dpneuro.protocol.cape import NoisePlan, ReleaseSpec, ledgers, n_unique, run_cape
from dpneuro.protocol.cape.packing import noise_array, pack_weighted
from dpneuro.protocol.exchange import Payload

SIGMA2 = 0.05
agn_mod = importlib.import_module("dpneuro.algorithms.agn")  # the module, not the function baselines.agn


# -- synthetic set-ups of [CAPE-TF] Sec. VI-B ------------------------------------------------

def mog_data(D=10, K=5, N=50_000, S=5, seed=0):
    """K means = first K columns of a random orthogonal matrix, w ~ linspace(1, 10K, K)."""
    rng = np.random.default_rng(seed)
    w = np.linspace(1, 10 * K, K)
    w /= w.sum()
    A = ortho_group.rvs(D, random_state=rng)[:, :K]
    h = rng.choice(K, size=N, p=w)
    X = A[:, h] + np.sqrt(SIGMA2) * rng.standard_normal((D, N))
    return A, w, np.array_split(X, S, axis=1)


def mog_scale(D):
    """Public norm bound from the model (never from the data): ||a|| = 1, chi-square tail of ||z||^2."""
    return float(np.sqrt(1 + SIGMA2 * stats.chi2.ppf(1 - 1e-4, D) + 8 * np.sqrt(SIGMA2)))


def stm_data(D=10, K=5, N=50_000, S=5, seed=0, L=3):
    """Topics: clipped, renormalised columns of a random orthogonal matrix (reference set-up)."""
    rng = np.random.default_rng(seed)
    w = np.linspace(1, 10 * K, K)
    w /= w.sum()
    A = np.maximum(ortho_group.rvs(D, random_state=rng)[:, :K], 0)
    A /= A.sum(axis=0)
    h = rng.choice(K, size=N, p=w)
    words = np.empty((L, N), np.int64)
    for j in range(K):
        idx = np.flatnonzero(h == j)
        words[:, idx] = rng.choice(D, size=(L, len(idx)), p=A[:, j])
    onehot = np.zeros((L, D, N), np.uint8)
    onehot[np.arange(L)[:, None], words, np.arange(N)[None, :]] = 1
    return A, w, np.array_split(onehot, S, axis=2)


def _match(est, true):
    """Permutation and sign aligning the columns of est to those of true (by |inner product|)."""
    from scipy.optimize import linear_sum_assignment

    C = np.abs(est.T @ true)
    r, c = linear_sum_assignment(-C)
    perm = np.empty(true.shape[1], int)
    perm[c] = r
    return perm


# -- tensor algebra -----------------------------------------------------------------------------

@pytest.mark.parametrize("K,k,seed", [(6, 6, 0), (8, 4, 1), (10, 10, 2)])
def test_tensor_power_recovers_orthogonal_decomposition(K, k, seed):
    rng = np.random.default_rng(seed)
    V = ortho_group.rvs(K, random_state=rng)[:, :k]
    lam = rng.uniform(1.0, 3.0, k)
    T = tz.rank_one_sum(lam, V)
    got_lam, U = tz.tensor_power(T, k, n_restarts=10, n_iter=30, random_state=rng)
    perm = _match(U, V)
    assert np.allclose(U[:, perm], V, atol=1e-8)  # odd order: eigenvectors come with their sign
    assert np.allclose(got_lam[perm], lam, atol=1e-8)


def test_pipeline_recovers_population_model_exactly():
    """Exact moments of a non-orthogonal model: whitening + TPM + recovery give a_k, w_k to 1e-8."""
    rng = np.random.default_rng(3)
    D, k = 9, 4
    A = rng.standard_normal((D, k))
    w = rng.dirichlet(np.ones(k))
    M2 = (A * w) @ A.T
    M3 = tz.rank_one_sum(w, A)
    W, _ = tz.whitening(M2, k)
    assert np.allclose(W.T @ M2 @ W, np.eye(k), atol=1e-10)
    lam, U = tz.tensor_power(tz.multilinear(M3, W), k, random_state=rng)
    A_hat, w_hat = tz.recover(W, lam, U)
    perm = _match(A_hat, A)
    assert np.allclose(A_hat[:, perm], A, atol=1e-8)
    assert np.allclose(w_hat[perm], w, atol=1e-8)


def test_moment_shortcuts_match_full_tensors():
    rng = np.random.default_rng(4)
    D, N, k = 7, 513, 3
    X = rng.standard_normal((D, N))
    W = rng.standard_normal((D, k))
    full = np.einsum("in,jn,kn->ijk", X, X, X) / N
    assert np.allclose(tz.third_moment(X), full, atol=1e-12)
    assert np.allclose(tz.whitened_third_moment(X, W), tz.multilinear(full, W), atol=1e-11)
    m = X.mean(axis=1)
    assert np.allclose(tz.mog_correction_whitened(m, W), tz.multilinear(tz.mog_correction(m), W), atol=1e-12)
    words = rng.integers(0, D, size=(3, N))
    t = np.zeros((3, D, N))
    t[np.arange(3)[:, None], words, np.arange(N)] = 1
    m3 = np.einsum("in,jn,kn->ijk", t[0], t[1], t[2]) / N
    m3_sym = tz.symmetrize(m3)
    assert np.allclose(tz.stm_third_moment(words, D), m3_sym, atol=1e-14)
    assert np.allclose(tz.stm_whitened_third_moment(words, W), tz.multilinear(m3_sym, W), atol=1e-12)
    m2 = t[0] @ t[1].T / N
    assert np.allclose(tz.stm_second_moment(words, D), (m2 + m2.T) / 2)
    S = tz.symmetrize(rng.standard_normal((D, D, D)))
    for p in [(0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]:
        assert np.array_equal(S, S.transpose(p))


def test_project_simplex_is_the_euclidean_projection():
    rng = np.random.default_rng(5)
    V = rng.standard_normal((12, 40)) * 0.5
    P = tz.project_simplex(V)
    assert np.all(P >= 0) and np.allclose(P.sum(axis=0), 1)
    # KKT: P = max(v - theta, 0) for the theta that makes the column sum to one (bisection)
    for j in range(V.shape[1]):
        lo, hi = V[:, j].min() - 1, V[:, j].max()
        for _ in range(200):
            th = (lo + hi) / 2
            lo, hi = (th, hi) if np.maximum(V[:, j] - th, 0).sum() > 1 else (lo, th)
        assert np.allclose(P[:, j], np.maximum(V[:, j] - th, 0), atol=1e-9)
    x = rng.dirichlet(np.ones(12), size=3).T
    assert np.allclose(tz.project_simplex(x), x)


# -- noise ----------------------------------------------------------------------------------------

def test_symmetric_noise_tensor_unique_entries_and_variance():
    D, std, reps = 12, 0.3, 40
    assert tz.n_sym(D) == comb(D + 2, 3) == n_unique((D, D, D), True)
    rng = np.random.default_rng(6)
    led = PrivacyLedger()
    draws = []
    for _ in range(reps):
        b = gaussian(rng, (tz.n_sym(D),), std, led)
        E = tz.sym_from_unique(b, D)
        for p in [(0, 2, 1), (1, 0, 2), (1, 2, 0), (2, 0, 1), (2, 1, 0)]:
            assert np.array_equal(E, E.transpose(p))
        assert np.array_equal(tz.unique_entries(E), b)  # exactly the C(D+2,3) iid draws, mirrored
        draws.append(b)
    assert led.draws == reps
    x = np.concatenate(draws)
    q = np.sum(x**2) / std**2
    lo, hi = stats.chi2.ppf([5e-4, 1 - 5e-4], x.size)
    assert lo < q < hi
    # distinct unique entries are uncorrelated; mirrored entries are the same draw
    d = np.stack(draws)
    c = np.corrcoef(d[:, :50].T)
    assert np.abs(c[np.triu_indices(50, 1)]).max() < 0.75


class _ZeroTensor:
    """A site releases a zero D x D x D symmetric tensor, optionally contracted with W."""

    name = "zero-tensor"
    max_rounds = 1

    def __init__(self, D, W=None, seed=0):
        self.D, self.W, self.seed = D, W, seed
        if W is not None:
            self.site_postprocess = lambda state, name, noisy: tz.multilinear(noisy, self.W)

    def site_init(self, site, data):
        return {"rng": np.random.default_rng([self.seed, site]), "_n": data}

    def site_releases(self, state):
        return {"t": ReleaseSpec((self.D,) * 3, sensitivity=0.5, noise_multiplier=2.0, symmetric=True)}

    def site_weight(self, state):
        return state["_n"]

    def site_compute(self, state, round, broadcast):
        return {"t": np.zeros((self.D,) * 3)}

    def aggregator_init(self):
        return {}

    def aggregator_first(self, state):
        return Payload()

    def aggregator_update(self, state, round, combined):
        state["t"] = combined["t"]
        return Payload(meta={"stop": True})


@pytest.mark.parametrize("plan", ["conv", "cape"])
def test_cape_wrapper_draws_symmetric_3way_noise_on_unique_entries(plan):
    D, S = 10, 3
    # the papers' zero-sum variance: every release alone at exactly its std
    res = run_cape(_ZeroTensor(D), [100] * S, NoisePlan(plan, zero_sum_variance=1.0))
    rel = res.exchange.gather(0, "release", [0, 1, 2], timeout=1)
    for s, msg in rel.items():
        t = msg.arrays["t"]
        for p in [(0, 2, 1), (1, 0, 2), (2, 1, 0)]:
            assert np.array_equal(t, t.transpose(p))
        u = pack_weighted(t)  # entries standing for m copies, times sqrt(m): iid at the release std
        assert u.size == comb(D + 2, 3)
        q = np.sum(u**2) / 1.0  # tau_s = 2 * 0.5
        lo, hi = stats.chi2.ppf([5e-4, 1 - 5e-4], u.size)
        assert lo < q < hi, f"site {s}"


def test_site_postprocess_keeps_cape_cancellation():
    """Sites send (noise)(W, W, W); the zero-sum parts still cancel in the weighted average."""
    D, k, S = 8, 3, 4
    W = np.random.default_rng(7).standard_normal((D, k))
    res = run_cape(_ZeroTensor(D, W), [100] * S, "cape")
    rel = res.exchange.gather(0, "release", list(range(S)), timeout=1)
    assert all(m.arrays["t"].shape == (k, k, k) for m in rel.values())
    assert all(m.carries["t"] == "cape-noise" for m in rel.values())
    w = np.full(S, 1 / S)
    g_part = sum(w[s] * tz.multilinear(noise_array(res.sites[s]["_last_noise"]["t"][1], (D,) * 3, True), W)
                 for s in range(S))
    e = np.stack([res.sites[s]["_last_noise"]["t"][0] for s in range(S)])
    assert np.abs(w @ e).max() < 1e-8 and np.abs(e).max() > 0.1
    assert np.allclose(res.aggregator["t"], g_part, atol=1e-7)
    for led in ledgers(res):  # the ledger records the declared D^3 release
        (r,) = led.releases
        assert r.sensitivity == 0.5


def test_vector_laplace_norm_and_direction():
    rng = np.random.default_rng(8)
    led = PrivacyLedger()
    dim, beta = 20, 3.0
    b = np.stack([vector_laplace(rng, dim, beta, led) for _ in range(3000)])
    assert led.draws == 3000
    r = np.linalg.norm(b, axis=1)
    assert stats.kstest(r, stats.gamma(a=dim, scale=1 / beta).cdf).pvalue > 1e-3
    u = b / r[:, None]
    assert np.abs(u.mean(axis=0)).max() < 4 / np.sqrt(3000 * dim) * 2
    assert np.allclose(u.T @ u / 3000, np.eye(dim) / dim, atol=0.02)
    with pytest.raises(ValueError):
        vector_laplace(rng, dim, 0.0, led)


# -- non-private recovery and the protocol's exactness ---------------------------------------

def test_nonprivate_mog_recovery_close_to_truth():
    for seed in range(3):
        A, w, sites = mog_data(seed=seed)
        r = otd(np.hstack(sites), 5, scale=mog_scale(10), random_state=seed)
        assert q_comp(r.components, A, "hungarian") < 0.06
        perm = _match(r.components, A)
        assert np.allclose(r.weights[perm], w, atol=0.02)
        assert r.sigma2 == pytest.approx(SIGMA2, rel=0.05)


def test_nonprivate_stm_recovery_close_to_truth():
    A, w, sites = stm_data(N=60_000)
    r = otd(np.concatenate(sites, axis=2), 5, model="stm", random_state=0)
    assert np.allclose(r.components.sum(axis=0), 1) and np.all(r.components >= 0)
    assert q_comp(r.components, A, "hungarian") < 0.08
    rnd = np.random.default_rng(0).dirichlet(np.ones(10), size=5).T
    assert q_comp(rnd, A) > 0.3


@pytest.mark.parametrize("model", ["mog", "stm"])
def test_plan_none_equals_pooled_method_of_moments(model):
    if model == "mog":
        A, _, sites = mog_data(N=12_000, S=3, seed=1)
        pooled, kw = np.hstack(sites), {"scale": mog_scale(10)}
    else:
        A, _, sites = stm_data(N=12_000, S=3, seed=1)
        pooled, kw = np.concatenate(sites, axis=2), {}
    a = cape_agn(sites, 5, 1.0, 0.01, model=model, plan="none", random_state=3, **kw)
    b = otd(pooled, 5, model=model, random_state=np.random.SeedSequence([3, 99]), **kw)  # cape_agn's finishing stream
    assert np.allclose(a.whitening, b.whitening, atol=1e-9)
    assert np.allclose(a.components, b.components, atol=1e-8)
    assert np.allclose(a.weights, b.weights, rtol=1e-8)
    assert all(not led.releases for led in a.ledgers)


def test_cape_m3_noise_has_pooled_variance():
    """Stage 2 under CAPE: aggregate = pooled M3(W,W,W) + noise of the pooled variance (conv: S times more)."""
    _, _, sites = mog_data(N=15_000, S=3, seed=2)
    D, k, S, z = 10, 5, 3, 3.0
    sds = [prepare_site(x, scale=mog_scale(D)) for x in sites]
    common = dict(unit="sample", groups=[1] * S, scale=None)
    st1 = agn_mod._M2Stage("mog", 1.0, stage_id=1, k=k, sigma2=None, seed=0, **common)
    W = run_cape(st1, sds, "none").aggregator["W"]
    s2 = SIGMA2 / mog_scale(D) ** 2
    pooled = tz.multilinear(sum(agn_mod._third_moment(sd, s2) for sd in sds) / S, W)
    tau_s = z * sensitivities("mog", D, sds[0].n, s2)[1]
    # exact variance of each entry of E(W,W,W) per unit variance of E's unique entries
    var_unit = np.zeros((k, k, k))
    for i in range(tz.n_sym(D)):
        probe = np.zeros(tz.n_sym(D))
        probe[i] = 1
        var_unit += tz.multilinear(noise_array(probe, (D,) * 3, True), W) ** 2
    ratio = {}
    for plan in ("cape", "conv"):
        r = []
        for seed in range(4):
            st2 = agn_mod.M3Stage("mog", z, stage_id=2, W=W, sigma2=s2, seed=seed, **common)
            diff = run_cape(st2, sds, plan).aggregator["m3w"] - pooled
            r.append(tz.unique_entries(diff**2 / (var_unit * tau_s**2 / S**2)))
        ratio[plan] = float(np.mean(r))  # 4 x 35 chi-square(1)-like terms, mean 1 for the pooled variance
    assert 0.6 < ratio["cape"] < 1.6
    assert 0.6 * S < ratio["conv"] < 1.6 * S


# -- privacy records ------------------------------------------------------------------------------

def test_cape_ledgers_record_both_stages_at_sample_level():
    A, _, sites = mog_data(N=15_000, S=3, seed=3)
    eps, delta = 2.0, 0.01
    r = cape_agn(sites, 5, eps, delta, plan="cape", scale=mog_scale(10), random_state=5)
    n_s = 5000
    s2 = r.info["sigma2_scaled"]
    d2, d3 = np.sqrt(2) / n_s, (2 + 6 * 10 * s2) / n_s
    for led in r.ledgers:
        rel = {x.name: x for x in led.releases}
        assert set(rel) == {"m2", "m3"}
        assert rel["m2"].sensitivity == pytest.approx(d2) and rel["m3"].sensitivity == pytest.approx(d3)
        assert rel["m2"].sigma == pytest.approx(gaussian_sigma(1.0, 0.005, d2), rel=1e-6)
        assert rel["m3"].sigma == pytest.approx(gaussian_sigma(1.0, 0.005, d3), rel=1e-6)
        assert {x.unit for x in led.releases} == {"sample"}
        assert {x.stage for x in led.releases} == {"agn-m2", "agn-m3"}
        assert any("sample" in n for n in led.notes)
        assert led.epsilon(delta) <= eps + 1e-9  # exact GDP composition of the two stages
    assert r.sigma2 == pytest.approx(SIGMA2, rel=0.3)


def test_avn_is_pure_eps_in_stage_two():
    A, _, sites = mog_data(N=10_000, S=1, seed=4)
    r = avn(sites[0], 5, 4.0, 0.01, scale=mog_scale(10), random_state=0, split=(0.25, 0.75))
    (led,) = r.ledgers
    (rel,) = led.releases
    assert rel.name == "m2"
    assert rel.sigma == pytest.approx(gaussian_sigma(1.0, 0.01, rel.sensitivity), rel=1e-6)  # all of delta
    assert r.epsilon_pure == pytest.approx(3.0)
    assert any("pure eps" in n for n in led.notes)
    assert led.draws == 2


def test_local_agn_uses_the_site_sample_size():
    A, _, sites = mog_data(N=15_000, S=3, seed=5)
    r = local_agn(sites, 5, 1.0, 0.01, site=2, scale=mog_scale(10), random_state=0)
    (led,) = r.ledgers
    assert led.owner == "site-2"
    assert led.releases[0].sensitivity == pytest.approx(np.sqrt(2) / 5000)


# -- utility ordering (statistical, fixed seeds) -------------------------------------------------

def test_cape_beats_conv_and_local_and_approaches_nonprivate():
    sc = mog_scale(10)
    q = {"cape": [], "conv": [], "local": [], "cape20": [], "nonprivate": []}
    for seed in range(10):
        A, _, sites = mog_data(seed=10 + seed)
        for plan in ("cape", "conv"):
            r = cape_agn(sites, 5, 1.0, 0.01, plan=plan, scale=sc, random_state=seed)
            q[plan].append(q_comp(r.components, A, "hungarian"))
        r = local_agn(sites, 5, 1.0, 0.01, scale=sc, random_state=seed)
        q["local"].append(q_comp(r.components, A, "hungarian"))
        if seed < 4:
            r = cape_agn(sites, 5, 20.0, 0.01, plan="cape", scale=sc, random_state=seed)
            q["cape20"].append(q_comp(r.components, A, "hungarian"))
            r = otd(np.hstack(sites), 5, scale=sc, random_state=seed)
            q["nonprivate"].append(q_comp(r.components, A, "hungarian"))
    med = {m: float(np.median(v)) for m, v in q.items()}
    # measured medians (10 seeds, eps = 1): cape 0.16, conv 0.43, local 0.75; eps = 20: cape ~ non-private
    assert med["cape"] < 0.7 * med["conv"]
    assert med["conv"] < 0.85 * med["local"]
    assert med["cape20"] < med["nonprivate"] + 0.03


# -- bad input: refused before any release -------------------------------------------------------

@pytest.fixture
def no_release(monkeypatch):
    def boom(*a, **k):
        raise AssertionError("a release was attempted")

    monkeypatch.setattr(agn_mod, "run_cape", boom)
    monkeypatch.setattr(agn_mod.privacy, "gaussian", boom)
    monkeypatch.setattr(agn_mod, "vector_laplace", boom)


def test_bad_input_is_refused_before_any_release(no_release):
    _, _, sites = mog_data(N=3000, S=3)
    sc = mog_scale(10)
    kw = dict(scale=sc)
    with pytest.raises(ValueError, match="exceed the dimension"):
        cape_agn(sites, 11, 1.0, 0.01, **kw)
    with pytest.raises(ValueError, match="exceed the dimension"):
        agn(sites[0], 11, 1.0, 0.01, **kw)
    with pytest.raises(ValueError, match="sigma\\^2 cannot be estimated"):
        cape_agn(sites, 10, 1.0, 0.01, **kw)
    bad = [s.copy() for s in sites]
    bad[1][3, 7] = np.nan
    with pytest.raises(ValueError, match="site 1.*NaN"):
        cape_agn(bad, 3, 1.0, 0.01, **kw)
    bad[1][3, 7] = np.inf
    with pytest.raises(ValueError, match="NaN or infinite"):
        agn(bad[1], 3, 1.0, 0.01, **kw)
    with pytest.raises(ValueError, match=r"\|\|x\|\|_2 > 1"):
        cape_agn(sites, 3, 1.0, 0.01)
    for split in [(0.6, 0.6), (1.0, 0.0), (-0.5, 1.5), (0.5, 0.25, 0.25), (0.5,), (np.nan, 0.5)]:
        with pytest.raises(ValueError, match="split"):
            cape_agn(sites, 3, 1.0, 0.01, split=split, **kw)
        with pytest.raises(ValueError, match="split"):
            avn(sites[0], 3, 1.0, 0.01, split=split, **kw)
    for eps, delta in [(0.0, 0.01), (np.inf, 0.01), (1.0, 0.0), (1.0, 1.0)]:
        with pytest.raises(ValueError, match="epsilon|delta"):
            cape_agn(sites, 3, eps, delta, **kw)
    with pytest.raises(ValueError, match="share the feature space"):
        cape_agn([sites[0], sites[1][:9], sites[2]], 3, 1.0, 0.01, **kw)
    with pytest.raises(ValueError):
        cape_agn(sites[:2], 3, 1.0, 0.01, plan="cape", **kw)  # CAPE needs >= 3 sites
    with pytest.raises(ValueError, match="unknown model"):
        cape_agn(sites, 3, 1.0, 0.01, model="lda", **kw)
    with pytest.raises(ValueError, match="n_restarts"):
        cape_agn(sites, 3, 1.0, 0.01, n_restarts=0, **kw)
    with pytest.raises(ValueError, match="sigma2"):
        cape_agn(sites, 3, 1.0, 0.01, sigma2=-1.0, **kw)


def test_stm_input_must_be_one_hot_words(no_release):
    _, _, sites = stm_data(N=3000, S=3)
    bad = [s.astype(float) for s in sites]
    bad[2][0, :, 5] = 0.5  # not 0/1
    with pytest.raises(ValueError, match="site 2.*one-hot"):
        cape_agn(bad, 3, 1.0, 0.01, model="stm")
    two = [s.copy() for s in sites]
    two[0][1, :2, 9] = 1  # two words at once
    with pytest.raises(ValueError, match="site 0.*one-hot"):
        cape_agn(two, 3, 1.0, 0.01, model="stm")
    empty = [s.copy() for s in sites]
    empty[1][2, :, 4] = 0  # no word
    with pytest.raises(ValueError, match="one-hot"):
        agn(empty[1], 3, 1.0, 0.01, model="stm")
    with pytest.raises(ValueError, match="at least 3 words"):
        cape_agn([s[:2] for s in sites], 3, 1.0, 0.01, model="stm")
    with pytest.raises(ValueError, match="L x D x N"):
        cape_agn([s[0] for s in sites], 3, 1.0, 0.01, model="stm")
    with pytest.raises(ValueError, match="exceed the dimension"):
        cape_agn(sites, 11, 1.0, 0.01, model="stm")


