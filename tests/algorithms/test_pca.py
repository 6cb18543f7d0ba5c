"""capePCA, its baselines (conv, pooled DP, local, DPdisPCA) and the power mode."""

import math

import numpy as np
import pytest
from scipy import stats

from dpneuro.algorithms import CapePCA, SiteSource, cape_pca
from dpneuro.algorithms.baselines import dpdispca, local_pca, pooled_dp_pca
from dpneuro.algorithms.metrics import captured_energy
from dpneuro.algorithms.pca import VARIANCE_FLOOR, VARIANCE_SHARE, pca_sensitivity, top_eigh
from dpneuro.privacy import gaussian_sigma
from dpneuro.protocol.cape import run_cape
from dpneuro.protocol.cape.packing import pack, pack_weighted
from dpneuro.protocol.exchange import InProcessExchange

DELTA = 0.01
R2 = math.sqrt(2)  # replace-one-subject neighbours: sqrt(2) times the add/remove bound


def synthetic(D=40, K=8, S=5, Ns=300, seed=0):
    """The papers' set-up at small scale: diag(linspace(10, 1, K), 0.5 U(0,1)^(D-K)), centred, max norm 1."""
    rng = np.random.default_rng(seed)
    lam = np.r_[np.linspace(10, 1, K), 0.5 * rng.uniform(size=D - K)]
    X = rng.standard_normal((D, S * Ns)) * np.sqrt(lam)[:, None]
    X -= X.mean(axis=1, keepdims=True)
    X /= np.linalg.norm(X, axis=0).max()
    return [X[:, s * Ns:(s + 1) * Ns] for s in range(S)], X


def sin_max_angle(V, U):
    """Sine of the largest principal angle between span(V) and span(U) (orthonormal columns)."""
    return float(np.linalg.norm(V - U @ (U.T @ V), 2))  # accurate for tiny angles, unlike sqrt(1 - cos^2)


def exact(X, k):
    A = X @ X.T / X.shape[1]
    lam, U = np.linalg.eigh(A)
    return A, lam[::-1][:k], U[:, ::-1][:, :k]


def unique_entries(M):
    """The vector the covariance noise is iid on: w(M), unique entries times sqrt(copies)."""
    return pack_weighted(M)


def chi2_var_ok(x, var, alpha=1e-3):
    q = float(np.sum(x**2) / var)
    lo, hi = stats.chi2.ppf([alpha / 2, 1 - alpha / 2], x.size)
    return lo < q < hi


# -- correctness without noise ---------------------------------------------------------------

def test_plan_none_is_the_pooled_eigendecomposition():
    Xs, X = synthetic()
    A, lam, U = exact(X, 8)
    res = cape_pca(Xs, 8, None, DELTA, plan="none")
    assert res.basis.shape == (40, 8)
    assert np.allclose(res.basis.T @ res.basis, np.eye(8), atol=1e-12)
    assert sin_max_angle(res.basis, U) < 1e-8
    assert np.allclose(res.eigenvalues, lam, rtol=1e-10)
    assert np.all(np.diff(res.eigenvalues) <= 0)
    assert all(led.releases == [] and any("not private" in n for n in led.notes) for led in res.ledgers)


def test_top_eigh_orders_by_value_not_magnitude():
    A = np.diag([5.0, -10.0, 3.0, 1.0])
    lam, V = top_eigh(A, 2)
    assert np.allclose(lam, [5.0, 3.0])
    assert np.allclose(np.abs(V[[0, 2], [0, 1]]), 1.0)
    lam, _ = top_eigh(np.diag([1.0, -0.5, -3.0]), 3)
    assert np.allclose(lam, [1.0, -0.5, -3.0])


# -- noise levels and ledgers ------------------------------------------------------------------

def test_cape_noise_is_pooled_noise_and_conv_is_S_times_larger():
    S, Ns, eps = 4, 250, 1.0
    Xs, X = synthetic(D=40, S=S, Ns=Ns, seed=1)
    A = X @ X.T / X.shape[1]
    z = gaussian_sigma(eps, DELTA)
    tau_pool = R2 * z / (S * Ns)  # replace-one sensitivity sqrt(2) / N
    cape = cape_pca(Xs, 5, eps, DELTA, plan="cape", random_state=3)
    conv = cape_pca(Xs, 5, eps, DELTA, plan="conv", random_state=3)
    pooled = pooled_dp_pca(X, 5, eps, DELTA, random_state=3)
    assert chi2_var_ok(unique_entries(cape.info["A_hat"] - A), tau_pool**2)
    assert chi2_var_ok(unique_entries(pooled.info["A_hat"] - A), tau_pool**2)
    assert chi2_var_ok(unique_entries(conv.info["A_hat"] - A), S * tau_pool**2)
    for res in (cape, conv):
        for led in res.ledgers:
            (rel,) = led.releases
            assert rel.sensitivity == pytest.approx(R2 / Ns) and rel.unit == "sample"
            assert rel.sigma == pytest.approx(R2 * z / Ns, rel=1e-9)
            assert led.epsilon(DELTA) == pytest.approx(eps, rel=1e-6)
    (rel,) = pooled.ledgers[0].releases
    assert pooled.ledgers[0].owner == "pooled" and rel.sensitivity == pytest.approx(R2 / (S * Ns))


def test_cape_with_unequal_sites_still_has_the_pooled_noise():
    """Unequal N_s: the asymmetric plan ([capeDJICA] Sec. III-C) keeps the average at the pooled variance (z/N)^2."""
    _, X = synthetic(D=40, S=1, Ns=800, seed=6)
    sizes = [150, 250, 400]
    Xs = np.split(X, np.cumsum(sizes)[:-1], axis=1)
    A = X @ X.T / X.shape[1]
    z = gaussian_sigma(1.0, DELTA)
    res = cape_pca(Xs, 5, 1.0, DELTA, plan="cape", random_state=4)
    assert chi2_var_ok(unique_entries(res.info["A_hat"] - A), (R2 * z / 800) ** 2)
    for led, n in zip(res.ledgers, sizes):
        assert led.releases[0].sigma == pytest.approx(R2 * z / n, rel=1e-6)
        assert led.epsilon(DELTA) == pytest.approx(1.0, rel=1e-5)


def test_subject_level_units_and_sensitivities():
    Xs, _ = synthetic(D=12, K=4, S=3, Ns=60, seed=2)
    eq = cape_pca(Xs, 3, 1.0, DELTA, plan="conv", subjects=[6, 6, 6], random_state=0)
    assert eq.unit == "subject"
    assert all(led.releases[0].sensitivity == pytest.approx(R2 / 6) and led.releases[0].unit == "subject"
               for led in eq.ledgers)
    ranges = [[(0, 10), (10, 60)], [(0, 30), (30, 60)], [20, 20, 20]]
    uneq = cape_pca(Xs, 3, 1.0, DELTA, plan="conv", subjects=ranges, random_state=0)
    assert [led.releases[0].sensitivity for led in uneq.ledgers] == pytest.approx([R2 * 50 / 60, R2 * 30 / 60,
                                                                                   R2 * 20 / 60])
    old = cape_pca(Xs, 3, 1.0, DELTA, plan="conv", subjects=[6, 6, 6], neighbour="add-remove", random_state=0)
    assert old.ledgers[0].releases[0].sensitivity == pytest.approx(1 / 6)
    assert old.ledgers[0].releases[0].neighbour == "add-remove"
    # per-subject blocks mean subject level; unit='sample' forces the column level
    blocks = [[X[:, i:i + 10] for i in range(0, 60, 10)] for X in Xs]
    b = cape_pca(blocks, 3, 1.0, DELTA, plan="conv", random_state=0)
    assert b.ledgers[0].releases[0].sensitivity == pytest.approx(R2 / 6)
    smp = cape_pca(Xs, 3, 1.0, DELTA, plan="conv", subjects=[6, 6, 6], unit="sample", random_state=0)
    assert smp.ledgers[0].releases[0].sensitivity == pytest.approx(R2 / 60)
    assert pca_sensitivity(100, 1) == pytest.approx(R2 * 0.01)
    assert pca_sensitivity(100, 1, "add-remove") == pytest.approx(0.01)
    # the same noise realisation gives the same basis whatever the block layout
    assert np.allclose(b.basis, eq.basis)


def test_sitedata_boundaries_make_the_unit_subject():
    class FakeSiteData:  # the attributes of dpneuro.data.matrix.SiteData the sources use
        def __init__(self, X, bounds):
            self.X, self.boundaries = X, bounds

        def iter_subjects(self):
            for a, b in self.boundaries:
                yield self.X[:, a:b]

    Xs, _ = synthetic(D=12, K=4, S=3, Ns=60, seed=2)
    sd = [FakeSiteData(X, [(0, 20), (20, 40), (40, 60)]) for X in Xs]
    res = cape_pca(sd, 3, 1.0, DELTA, plan="conv", random_state=0)
    assert res.unit == "subject" and res.ledgers[0].releases[0].sensitivity == pytest.approx(R2 / 3)


def test_scale_options_and_their_ledger_notes():
    Xs, X = synthetic(D=12, K=4, S=3, Ns=60, seed=4)
    big = [5.0 * Y for Y in Xs]
    with pytest.raises(ValueError, match="scale="):
        cape_pca(big, 3, 1.0, DELTA, plan="conv")
    a = cape_pca(big, 3, None, DELTA, plan="none", scale=5.0)
    b = cape_pca(Xs, 3, None, DELTA, plan="none")
    assert np.allclose(a.basis, b.basis) and np.allclose(a.eigenvalues, b.eigenvalues)
    assert any("c = 5" in n and "public" in n for n in a.ledgers[0].notes)
    u = cape_pca(big, 3, None, DELTA, plan="none", scale="unit")
    Xu = X / np.linalg.norm(X, axis=0)
    assert np.allclose(u.eigenvalues, exact(Xu, 3)[1])
    assert any("unit norm" in n for n in u.ledgers[0].notes)
    huge = [1e4 * Y for Y in Xs]  # every column far above norm 1: clipping = unit scaling
    clip = cape_pca(huge, 3, None, DELTA, plan="none", scale="clip")
    assert np.allclose(clip.eigenvalues, u.eigenvalues)


def test_seeded_runs_are_reproducible():
    Xs, _ = synthetic(D=20, K=4, S=3, Ns=100)
    r1 = cape_pca(Xs, 4, 1.0, DELTA, plan="cape", random_state=7)
    r2 = cape_pca(Xs, 4, 1.0, DELTA, plan="cape", random_state=7)
    r3 = cape_pca(Xs, 4, 1.0, DELTA, plan="cape", random_state=8)
    assert np.allclose(r1.basis, r2.basis, atol=1e-9)
    assert not np.allclose(r1.basis, r3.basis, atol=1e-3)


# -- utility (statistical, fixed seeds) ---------------------------------------------------------

def test_cape_matches_pooled_dp_and_beats_conv_and_dpdispca():
    """Mean captured-energy ratio over 6 data sets (D=50, K=10, S=5, N_s=400).

    Measured: eps=0.5 cape 0.837 (sd 0.013), pooled 0.837, conv 0.61 (0.04),
    DPdisPCA 0.60; eps=1: cape 0.922, pooled 0.918, conv 0.77, DPdisPCA 0.76.
    Margins are > 4 standard errors of the differences.
    """
    D, K, S, Ns = 50, 10, 5, 400
    for eps, margin in [(0.5, 0.12), (1.0, 0.07)]:
        r = {m: [] for m in ("cape", "conv", "pooled", "dpdis", "local")}
        for rep in range(6):
            Xs, X = synthetic(D, K, S, Ns, seed=rep)
            A = X @ X.T / X.shape[1]
            qo = np.sort(np.linalg.eigvalsh(A))[::-1][:K].sum()
            r["cape"].append(captured_energy(cape_pca(Xs, K, eps, DELTA, plan="cape", random_state=100 + rep).basis, A) / qo)
            r["conv"].append(captured_energy(cape_pca(Xs, K, eps, DELTA, plan="conv", random_state=100 + rep).basis, A) / qo)
            r["pooled"].append(captured_energy(pooled_dp_pca(X, K, eps, DELTA, random_state=200 + rep).basis, A) / qo)
            r["dpdis"].append(captured_energy(dpdispca(Xs, K, eps, DELTA, random_state=100 + rep).basis, A) / qo)
            r["local"].append(captured_energy(local_pca(Xs[0], K, eps, DELTA, random_state=300 + rep).basis, A) / qo)
        m = {k: float(np.mean(v)) for k, v in r.items()}
        assert abs(m["cape"] - m["pooled"]) < 0.03, m
        assert m["cape"] > m["conv"] + margin, m
        assert m["cape"] > m["dpdis"] + margin, m
        assert m["conv"] > m["local"], m


# -- DPdisPCA -----------------------------------------------------------------------------

def test_dpdispca_ledger_and_noiseless_limit():
    Xs, X = synthetic(D=20, K=4, S=4, Ns=200, seed=5)
    res = dpdispca(Xs, 4, 1.0, DELTA, random_state=1)
    assert res.info["R"] == 8
    for led in res.ledgers:
        (rel,) = led.releases
        assert rel.sensitivity == pytest.approx(R2 / 200) and rel.stage == "dpdispca"
        assert led.epsilon(DELTA) == pytest.approx(1.0, rel=1e-6)
    # with R = D and (almost) no noise, P_s P_s^T = A_s and the answer is the pooled subspace
    _, _, U = exact(X, 4)
    nearly = dpdispca(Xs, 4, 1e7, DELTA, R=20, random_state=1)
    assert sin_max_angle(nearly.basis, U) < 1e-2
    with pytest.raises(ValueError, match="R must be"):
        dpdispca(Xs, 4, 1.0, DELTA, R=3)
    with pytest.raises(ValueError, match="exceeds D"):
        dpdispca(Xs, 4, 1.0, DELTA, R=21)


# -- power mode ------------------------------------------------------------------------------

def low_rank_sites(D=2000, r=5, S=3, subjects=3, T=50, seed=0, dtype=np.float64):
    """Per-site lists of per-subject D x T blocks: rank-r signal plus noise, columns of unit norm."""
    rng = np.random.default_rng(seed)
    maps = np.linalg.qr(rng.standard_normal((D, r)))[0] * np.linspace(6, 2, r)
    sites = []
    for _ in range(S):
        blocks = []
        for _ in range(subjects):
            B = maps @ rng.standard_normal((r, T)) + 0.3 * rng.standard_normal((D, T)) / math.sqrt(D) * 10
            blocks.append((B / np.linalg.norm(B, axis=0)).astype(dtype))
        sites.append(blocks)
    return sites


def test_power_mode_matches_covariance_mode_and_exact_eigh(tmp_path):
    k = 5
    sites = low_rank_sites()
    X = np.hstack([np.hstack(b) for b in sites])
    _, lam, U = exact(X, k)
    # three kinds of streamed input: a memory-mapped .npy, a callable of blocks, a list of blocks
    np.save(tmp_path / "site0.npy", np.hstack(sites[0]))
    inputs = [str(tmp_path / "site0.npy"), lambda: iter(sites[1]), sites[2]]
    power = cape_pca(inputs, k, None, DELTA, plan="none", mode="power", n_iter=30, subjects=None, random_state=0)
    cov = cape_pca([np.hstack(b) for b in sites], k, None, DELTA, plan="none")
    assert power.rounds == 30 and power.mode == "power"
    assert sin_max_angle(power.basis, U) < 1e-6
    assert sin_max_angle(cov.basis, U) < 1e-6
    assert np.allclose(power.eigenvalues, lam, rtol=1e-8)
    assert np.allclose(cov.eigenvalues, lam, rtol=1e-8)
    assert np.allclose(power.basis.T @ power.basis, np.eye(k), atol=1e-10)


def test_power_mode_streams_float32_and_composes_its_releases():
    k, n_iter, eps = 3, 6, 2.0
    sites = low_rank_sites(D=300, r=3, S=3, subjects=4, T=20, seed=1, dtype=np.float32)
    res = cape_pca(sites, k, eps, DELTA, plan="cape", mode="power", n_iter=n_iter, random_state=2)
    z1 = gaussian_sigma(eps, DELTA)
    for led in res.ledgers:
        (rel,) = led.releases
        assert rel.count == n_iter and rel.unit == "subject"
        assert rel.sensitivity == pytest.approx(R2 * 20 / 80)  # one subject of 20 of the site's 80 columns
        assert rel.sigma == pytest.approx(math.sqrt(n_iter) * z1 * R2 * 20 / 80, rel=1e-9)
        assert led.epsilon(DELTA) == pytest.approx(eps, rel=1e-6)
    assert np.allclose(res.basis.T @ res.basis, np.eye(k), atol=1e-10)
    with pytest.raises(ValueError, match="n_iter >= 2"):
        cape_pca(sites, k, eps, DELTA, plan="conv", mode="power", n_iter=1)


def _ritz_residual(A, V, theta):
    """max_i ||A v_i - theta_i v_i|| / theta_1 on the explicit matrix."""
    return float(np.linalg.norm(A @ V - V * theta, axis=0).max() / theta[0])


def test_power_mode_without_noise_stops_when_converged():
    """tol: fewer passes over the data, every Ritz pair within tol on the explicit matrix, tighter tol = more rounds."""
    k = 5
    sites = low_rank_sites(D=400, r=k, S=3, subjects=3, T=60, seed=4)
    X = np.hstack([np.hstack(b) for b in sites])
    # the sites' weighted average: each site's own mean, weighted by its columns (equal here)
    A, lam, U = exact(X, k)
    rounds = {}
    for tol in (1e-3, 1e-6, 1e-9):
        res = cape_pca(sites, k, None, None, plan="none", mode="power", n_iter=60, oversample=k, tol=tol, random_state=0)
        rounds[tol] = res.rounds
        assert _ritz_residual(A, res.basis, res.eigenvalues) <= tol * (1 + 1e-6)
        # residual r bounds the angle by r / gap and the eigenvalue error by r^2 / gap
        gap = lam[-1] - np.linalg.eigvalsh(A)[::-1][k]
        assert sin_max_angle(res.basis, U) <= tol * lam[0] / gap * 1.01
        assert np.abs(res.eigenvalues - lam).max() <= (tol * lam[0]) ** 2 / gap * 1.01 + 1e-15
    assert rounds[1e-3] < rounds[1e-6] < rounds[1e-9] < 60
    full = cape_pca(sites, k, None, None, plan="none", mode="power", n_iter=12, oversample=k, random_state=0)
    assert full.rounds == 12  # no tol: every planned round


def test_stopping_on_convergence_is_refused_with_noise_or_without_iterations():
    sites = low_rank_sites(D=50, r=2, S=3, subjects=2, T=10, seed=5)
    with pytest.raises(ValueError, match="only a run without noise"):
        CapePCA(2, 1.0, DELTA, mode="power", n_iter=10, tol=1e-4)
    with pytest.raises(ValueError, match="covariance mode has none"):
        CapePCA(2, None, None, mode="covariance", tol=1e-4)
    for bad in (0, 1, -1e-3, "1e-3", True):
        with pytest.raises(ValueError, match="tol must be"):
            CapePCA(2, None, None, mode="power", n_iter=10, tol=bad)
    # the cap still holds when the tolerance is out of reach
    res = cape_pca(sites, 2, None, None, plan="none", mode="power", n_iter=3, tol=1e-12, random_state=0)
    assert res.rounds == 3


# -- per-subject bound -------------------------------------------------------------------------

def _subject_fro(B):
    """||B B^T / n||_F of a block of unit columns (the normalised second moment's Frobenius norm)."""
    return float(np.linalg.norm(B @ B.T) / B.shape[1])


def test_subject_bound_clips_each_subject_to_the_bound_and_keeps_the_rest():
    sites = low_rank_sites(D=60, r=3, S=3, subjects=4, T=30, seed=3)
    fro = [_subject_fro(B) for blocks in sites for B in blocks]
    c = float(np.median(fro))  # half the subjects above the bound, half below
    res = cape_pca(sites, 3, None, DELTA, plan="none", subject_bound=c)
    expect = []
    for blocks in sites:
        A = sum(min(1.0, c / _subject_fro(B)) * (B @ B.T) for B in blocks) / sum(B.shape[1] for B in blocks)
        expect.append(A)
    assert np.allclose(res.info["A_hat"], sum(expect) / 3, atol=1e-12)
    # each clipped contribution is within the bound, and the ones below it are untouched
    for B in sites[0]:
        f = min(1.0, c / _subject_fro(B))
        assert np.linalg.norm(f * B @ B.T) <= c * B.shape[1] * (1 + 1e-12)
        assert (f == 1.0) == (_subject_fro(B) <= c)


def test_subject_bound_in_power_mode_equals_the_clipped_covariance():
    sites = low_rank_sites(D=80, r=4, S=3, subjects=3, T=25, seed=4)
    cov = cape_pca(sites, 4, None, DELTA, plan="none", subject_bound=0.3)
    power = cape_pca(sites, 4, None, DELTA, plan="none", mode="power", n_iter=40, subject_bound=0.3, random_state=0)
    assert sin_max_angle(power.basis, cov.basis) < 1e-6
    assert np.allclose(power.eigenvalues, cov.eigenvalues, rtol=1e-8)
    # float32 blocks: the same clip factors (computed in float64) to float32 accuracy
    sites32 = [[B.astype(np.float32) for B in blocks] for blocks in sites]
    p32 = cape_pca(sites32, 4, None, DELTA, plan="none", mode="power", n_iter=40, subject_bound=0.3, random_state=0)
    assert np.allclose(p32.eigenvalues, cov.eigenvalues, rtol=1e-5)


def test_subject_bound_shrinks_sensitivity_and_noise_by_the_bound():
    sites = low_rank_sites(D=30, r=3, S=3, subjects=5, T=20, seed=5)
    full = cape_pca(sites, 3, 2.0, DELTA, plan="conv", random_state=1)
    clipped = cape_pca(sites, 3, 2.0, DELTA, plan="conv", random_state=1, subject_bound=0.4)
    for a, b in zip(full.ledgers, clipped.ledgers):
        (ra,), (rb,) = a.releases, b.releases
        assert rb.sensitivity == pytest.approx(0.4 * ra.sensitivity, rel=1e-12)
        assert rb.sigma == pytest.approx(0.4 * ra.sigma, rel=1e-12)
        assert b.epsilon(DELTA) == pytest.approx(a.epsilon(DELTA), rel=1e-9)  # same guarantee
        assert any("clipped to Frobenius norm <= 0.4" in n for n in b.notes)
    assert cape_pca(sites, 3, 2.0, DELTA, plan="conv", random_state=1, subject_bound=1.0).ledgers[0].releases[0].sigma \
        == pytest.approx(full.ledgers[0].releases[0].sigma, rel=1e-12)


def test_subject_bound_buys_utility_where_subjects_sit_below_it():
    # subjects whose normalised second moments have Frobenius ~0.46: a bound of 0.5 barely reweights
    # them and halves the noise; over 6 noise draws every clipped run captures more energy
    sites = low_rank_sites(D=150, r=5, S=3, subjects=8, T=40, seed=6)
    fro = np.array([_subject_fro(B) for blocks in sites for B in blocks])
    assert 0.4 < np.median(fro) < 0.5
    X = np.hstack([np.hstack(b) for b in sites])
    A, _, U = exact(X, 5)
    gains = []
    for seed in range(6):
        e_full = captured_energy(cape_pca(sites, 5, 4.0, DELTA, random_state=seed).basis, A)
        e_clip = captured_energy(cape_pca(sites, 5, 4.0, DELTA, random_state=seed, subject_bound=0.5).basis, A)
        gains.append(e_clip - e_full)
    assert min(gains) > 0
    none = cape_pca(sites, 5, None, DELTA, plan="none", subject_bound=0.5)
    assert sin_max_angle(none.basis, U) < 0.2  # the bias of clipping is small on such data


def test_subject_bound_distinguishing_attack_sees_the_calibrated_separation():
    """The best test between two neighbouring sites separates them by 1/z, not 1/(c z).

    Site: three subjects on D = 3; the neighbours differ in subject 0 (constant along e1 or e2:
    rank one, ||P||_F = n, the extremal pair). The likelihood-ratio statistic is the noisy
    release projected on the difference of the two clean releases; its mean shift over its
    std must equal Delta_true / tau = 1 / z when clipping is applied (and 1 / (c z) if it were not).
    """
    c, eps, n_draws = 0.5, 2.0, 1000
    rest = [np.ones((3, 2)) / math.sqrt(3)] * 2
    worlds = [[np.tile(np.eye(3)[:, [j]], (1, 3))] + rest for j in (0, 1)]
    clean = [pack_weighted(cape_pca([w], 2, None, DELTA, plan="none", scale="unit", subject_bound=c).info["A_hat"])
             for w in worlds]
    u = (clean[1] - clean[0]) / np.linalg.norm(clean[1] - clean[0])
    stats_ = [[], []]
    for i in range(n_draws):
        for j, w in enumerate(worlds):
            res = local_pca(w, 2, eps, DELTA, scale="unit", subject_bound=c, random_state=2 * i + j)
            stats_[j].append(float(pack_weighted(res.info["A_hat"]) @ u))
    tau = res.ledgers[0].releases[0].sigma
    z = tau / res.ledgers[0].releases[0].sensitivity
    a, b = np.array(stats_[0]), np.array(stats_[1])
    assert np.std(a) == pytest.approx(tau, rel=0.1) and np.std(b) == pytest.approx(tau, rel=0.1)
    sep = (b.mean() - a.mean()) / tau
    se = math.sqrt(2 / n_draws)
    assert abs(sep - 1 / z) < 4 * se  # 1 / (c z) would be 1 / z away: > 10 standard errors here
    assert 1 / z - 1 / (c * z) < -10 * se


# -- subspace contributions --------------------------------------------------------------------------

def _projector_average(sites, k):
    """sum over subjects of (n_m / k) U_m U_m^T / N_s per site, averaged with weights N_s / N (by hand)."""
    out, N = 0.0, sum(B.shape[1] for blocks in sites for B in blocks)
    for blocks in sites:
        for B in blocks:
            B = B / np.linalg.norm(B, axis=0)
            U = np.linalg.svd(B, full_matrices=False)[0][:, :min(k, B.shape[1])]
            out = out + (B.shape[1] / k) * (U @ U.T)
    return out / N


@pytest.mark.parametrize("D", [80, 12])  # subjects with fewer columns than features, and more
def test_subspace_contribution_is_each_subjects_projector_in_both_modes(D):
    sites = low_rank_sites(D=D, r=3, S=3, subjects=3, T=25, seed=11)
    expect = _projector_average(sites, 4)
    cov = cape_pca(sites, 4, None, DELTA, plan="none", scale="unit", contribution="subspace")
    assert np.allclose(cov.info["A_hat"], expect, atol=1e-12)
    lam, U = top_eigh(expect, 4)
    assert np.allclose(cov.eigenvalues, lam, rtol=1e-10) and sin_max_angle(cov.basis, U) < 1e-8
    power = cape_pca(sites, 4, None, DELTA, plan="none", scale="unit", contribution="subspace", mode="power",
                     n_iter=60, oversample=4, tol=1e-10, random_state=0)
    assert np.allclose(power.eigenvalues, lam, rtol=1e-8)
    sites32 = [[B.astype(np.float32) for B in blocks] for blocks in sites]
    p32 = cape_pca(sites32, 4, None, DELTA, plan="none", scale="unit", contribution="subspace", mode="power",
                   n_iter=60, oversample=4, tol=1e-6, random_state=0)
    assert np.allclose(p32.eigenvalues, lam, rtol=1e-4)
    # every subject weighs n_m / N whatever its spectrum: a subject scaled up 100-fold changes nothing
    loud = [[B * (100.0 if i == 0 else 1.0) for i, B in enumerate(blocks)] for blocks in sites]
    assert np.allclose(cape_pca(loud, 4, None, DELTA, plan="none", scale="unit",
                                contribution="subspace").info["A_hat"], expect, atol=1e-12)


def test_subspace_contribution_sensitivity_noise_and_refusals():
    sites = low_rank_sites(D=30, r=3, S=3, subjects=5, T=20, seed=5)
    full = cape_pca(sites, 4, 2.0, DELTA, plan="conv", random_state=1)
    sub = cape_pca(sites, 4, 2.0, DELTA, plan="conv", random_state=1, contribution="subspace")
    bound = cape_pca(sites, 4, 2.0, DELTA, plan="conv", random_state=1, contribution="subspace", subject_bound=0.3)
    loose = cape_pca(sites, 4, 2.0, DELTA, plan="conv", random_state=1, contribution="subspace", subject_bound=0.9)
    for a, b, c, d in zip(full.ledgers, sub.ledgers, bound.ledgers, loose.ledgers):
        (ra,), (rb,), (rc,), (rd,) = a.releases, b.releases, c.releases, d.releases
        assert rb.sigma == pytest.approx(ra.sigma / 2, rel=1e-12)  # 1 / sqrt(k), k = 4
        assert rc.sigma == pytest.approx(0.3 * ra.sigma, rel=1e-12)  # a tighter bound clips the projector
        assert rd.sigma == pytest.approx(rb.sigma, rel=1e-12)  # a looser one cannot raise it
        assert b.epsilon(DELTA) == pytest.approx(a.epsilon(DELTA), rel=1e-9)
        assert any("principal subspace" in n for n in b.notes)
    # clipped below 1/sqrt(k): every projector scaled to 0.3 n_m
    clipped = cape_pca(sites, 4, None, DELTA, plan="none", scale="unit", contribution="subspace",
                       subject_bound=0.3)
    assert np.allclose(clipped.info["A_hat"], _projector_average(sites, 4) * 0.3 * 2, atol=1e-12)
    with pytest.raises(ValueError, match="contribution must be one of"):
        CapePCA(2, 1.0, DELTA, contribution="projector")
    X = np.hstack(sites[0])
    with pytest.raises(ValueError, match="needs the subject as the privacy unit"):
        cape_pca([X, X, X], 2, 1.0, DELTA, scale="unit", contribution="subspace")


def _attack_separation(worlds, k, how, eps=2.0, n_draws=1000, **kw):
    """The likelihood-ratio attack between two one-site worlds: the release in the coordinates its noise is
    iid in (w for "symmetrized", the unique entries for "mirrored"), projected on the difference of the clean
    releases. Returns (mean shift / noise std, ||clean difference||_F / sensitivity, 1 / z, standard error)."""
    vec = pack_weighted if how == "symmetrized" else (lambda A: pack(A, True))
    clean = [cape_pca([w], k, None, DELTA, plan="none", scale="unit", **kw).info["A_hat"] for w in worlds]
    u = vec(clean[1]) - vec(clean[0])
    u /= np.linalg.norm(u)
    stats_ = [[], []]
    for i in range(n_draws):
        for j, w in enumerate(worlds):
            res = local_pca(w, k, eps, DELTA, scale="unit", symmetric_noise=how, random_state=2 * i + j, **kw)
            stats_[j].append(float(vec(res.info["A_hat"]) @ u))
    rel = res.ledgers[0].releases[0]
    a, b = np.array(stats_[0]), np.array(stats_[1])
    assert np.std(a) == pytest.approx(rel.sigma, rel=0.1) and np.std(b) == pytest.approx(rel.sigma, rel=0.1)
    return ((b.mean() - a.mean()) / rel.sigma, np.linalg.norm(clean[1] - clean[0]) / rel.sensitivity,
            rel.sensitivity / rel.sigma, math.sqrt(2 / n_draws))


def test_subspace_contribution_distinguishing_attack_sees_the_calibrated_separation():
    """Neighbours differ in subject 0: its columns span (e1, e2) or (e3, e4), orthogonal top-2 subspaces,
    the extremal pair (||P - P'||_F is the sensitivity). The likelihood-ratio statistic is shifted by exactly
    Delta / tau = 1 / z: the noise is calibrated to the true worst case."""
    D, k = 4, 2
    rest = [np.ones((D, 2)) / 2.0] * 2
    worlds = [[np.column_stack([np.eye(D)[:, a], np.eye(D)[:, b]] * 2)] + rest for a, b in ((0, 1), (2, 3))]
    sep, frob, inv_z, se = _attack_separation(worlds, k, "symmetrized", contribution="subspace")
    assert frob == pytest.approx(1.0, rel=1e-9)
    assert abs(sep - inv_z) < 4 * se


def test_symmetrized_noise_distinguishing_attack_on_an_off_diagonal_difference():
    """Subject 0 along (e1 + e2)/sqrt(2) or (e1 - e2)/sqrt(2): the clean releases differ off the diagonal
    only, by the full sensitivity. Symmetrized noise (std tau / sqrt(2) there) lets the best attack separate
    the worlds by exactly 1 / z, what the ledger accounts, never more; the papers' mirrored noise leaves
    them 1 / (sqrt(2) z) apart, a guarantee it pays for and does not use."""
    D, k = 4, 1
    rest = [np.ones((D, 2)) / 2.0] * 2
    v = [np.array([1.0, s, 0, 0]) / math.sqrt(2) for s in (1.0, -1.0)]
    worlds = [[np.tile(x[:, None], (1, 3))] + rest for x in v]
    sep, frob, inv_z, se = _attack_separation(worlds, k, "symmetrized", eps=5.0, contribution="subspace")
    assert frob == pytest.approx(1.0, rel=1e-9)
    assert abs(sep - inv_z) < 4 * se
    sep_m, _, inv_z_m, _ = _attack_separation(worlds, k, "mirrored", eps=5.0, contribution="subspace")
    assert inv_z_m == pytest.approx(inv_z, rel=1e-12)  # the same calibration
    assert abs(sep_m - inv_z / math.sqrt(2)) < 4 * se
    assert inv_z * (1 - 1 / math.sqrt(2)) > 6 * se


# -- variances in the released subspace (variances=True) ---------------------------------------------

def _projected_moment(sites, V, bound=None):
    """sum over subjects of clip(V^T B B^T V) / N over every site's unit-norm columns (by hand)."""
    out, N = 0.0, sum(B.shape[1] for blocks in sites for B in blocks)
    for blocks in sites:
        for B in blocks:
            Y = V.T @ (B / np.linalg.norm(B, axis=0))
            P = Y @ Y.T
            if bound is not None:
                P *= min(1.0, bound * B.shape[1] / np.linalg.norm(P))
            out = out + P
    return out / N


@pytest.mark.parametrize("mode", ["covariance", "power"])
def test_variances_are_the_projected_second_moment_and_the_budget_splits_exactly(mode):
    sites = low_rank_sites(D=40, r=3, S=3, subjects=4, T=30, seed=21)
    kw = dict(scale="unit", contribution="subspace", mode=mode, random_state=3)
    if mode == "power":
        kw.update(n_iter=60, oversample=4)
    basis_only = cape_pca(sites, 3, None, DELTA, plan="none", **kw)
    res = cape_pca(sites, 3, None, DELTA, plan="none", variances=True, **kw)
    V = res.info["subspace"]
    assert np.allclose(np.abs(V.T @ basis_only.basis), np.eye(3), atol=1e-8)  # the same basis release first
    for bound in (None, 0.3):
        r = cape_pca(sites, 3, None, DELTA, plan="none", variances=True, subject_bound=bound, **kw)
        H = _projected_moment(sites, V, bound)
        lam, U = np.linalg.eigh(H)
        assert np.allclose(r.eigenvalues, lam[::-1], rtol=1e-10)
        assert np.allclose(np.abs(r.basis.T @ (V @ U[:, ::-1])), np.eye(3), atol=1e-8)
    assert res.rounds == (2 if mode == "covariance" else 61)
    # with noise: one more release, and the two compose exactly to the run's (eps, delta)
    noisy = cape_pca(sites, 3, 2.0, DELTA, plan="conv", variances=True, subject_bound=0.3, **kw)
    led = noisy.ledgers[0]
    names = [(r.name, r.count) for r in led.releases]
    assert names == ([("A", 1), ("H", 1)] if mode == "covariance" else [("AV", 60), ("H", 1)])
    assert led.epsilon(DELTA) == pytest.approx(2.0, rel=1e-6)
    basis, var = led.releases
    assert var.count * (var.sensitivity / var.sigma) ** 2 == pytest.approx(VARIANCE_SHARE * led.mu ** 2, rel=1e-9)
    assert var.sensitivity == pytest.approx(0.3 * basis.sensitivity / min(0.3, 1 / math.sqrt(3)), rel=1e-12)
    assert np.all(noisy.eigenvalues >= VARIANCE_FLOOR * np.mean(np.linalg.eigvalsh(noisy.info["H_hat"])) - 1e-15)


def test_variance_release_noise_is_calibrated_and_the_attack_sees_no_more():
    """One site; subject 0 lies along e1 or along e2, ten others span (e1, e2) in both worlds. Given
    the public basis V of each draw, the likelihood-ratio statistic of the noisy k x k release (in the
    coordinates its noise is iid in) has unit std, and its mean shift between the worlds is
    ||V^T (P - P') V||_w / sigma_H, never more than Delta_H / sigma_H = 1 / z_H."""
    D, k, T = 4, 2, 3
    rest = [np.column_stack([np.eye(D)[:, 0] + s * np.eye(D)[:, 1]] * T) for s in (1.0, -1.0)] * 5
    worlds = [[[np.column_stack([np.eye(D)[:, a]] * T)] + rest] for a in (0, 1)]
    n_draws, stats_, predicted = 600, [[], []], []
    for i in range(n_draws):
        for j, w in enumerate(worlds):
            r = cape_pca(w, k, 30.0, DELTA, plan="conv", scale="unit", contribution="subspace", variances=True,
                         random_state=2 * i + j)
            V, rel = r.info["subspace"], r.ledgers[0].releases[1]
            clean = [pack_weighted(_projected_moment(x, V)) for x in worlds]
            u = clean[1] - clean[0]
            predicted.append(np.linalg.norm(u) / rel.sigma) if j == 1 else None
            assert np.linalg.norm(u) <= rel.sensitivity * (1 + 1e-12)
            stats_[j].append(float((pack_weighted(r.info["H_hat"]) - clean[0]) @ u / np.linalg.norm(u) / rel.sigma))
    a, b = np.array(stats_[0]), np.array(stats_[1])
    se = math.sqrt(2 / n_draws)
    assert np.std(a) == pytest.approx(1.0, rel=0.1) and np.std(b) == pytest.approx(1.0, rel=0.1)
    inv_z = rel.sensitivity / rel.sigma
    assert max(predicted) <= inv_z * (1 + 1e-9)
    assert np.mean(predicted) > 0.9 * inv_z  # V spans (e1, e2): the extremal pair, the bound is attained
    assert abs((b.mean() - a.mean()) - np.mean(predicted)) < 4 * se


def test_variances_stay_positive_when_the_noise_swamps_them():
    # tiny data at a tiny eps: the noisy variances' mean can be <= 0; whitening still gets positive ones
    sites = low_rank_sites(D=12, r=2, S=3, subjects=2, T=5, seed=4)
    for seed in range(5):
        r = cape_pca(sites, 4, 0.01, DELTA, plan="cape", scale="unit", contribution="subspace", variances=True,
                     random_state=seed)
        assert np.all(r.eigenvalues > 0) and np.all(np.isfinite(r.eigenvalues))
        theta = np.linalg.eigvalsh(r.info["H_hat"])
        level = theta.mean() if theta.mean() > 0 else 1 / 4
        assert r.eigenvalues.min() == pytest.approx(max(theta.min(), VARIANCE_FLOOR * level), rel=1e-9)


def test_variances_refusals():
    with pytest.raises(ValueError, match="eigenvalues already are variances"):
        CapePCA(2, 1.0, DELTA, variances=True)
    with pytest.raises(ValueError, match="variance_share"):
        CapePCA(2, 1.0, DELTA, contribution="subspace", variances=True, variance_share=1.0)
    with pytest.raises(ValueError, match="calibration='analytic'"):
        CapePCA(2, 0.5, DELTA, contribution="subspace", variances=True, calibration="classic")
    with pytest.raises(ValueError, match="planned last round"):
        CapePCA(2, None, DELTA, contribution="subspace", variances=True, mode="power", tol=1e-4)


# -- bad input: clear errors before any release ---------------------------------------------------

def _ok_sites():
    return synthetic(D=10, K=3, S=3, Ns=20, seed=9)[0]


@pytest.mark.parametrize("kwargs, match", [
    (dict(n_components=11), "exceeds min"),
    (dict(n_components=0), "positive integer"),
    (dict(n_components=2.5), "positive integer"),
    (dict(epsilon=0.0), "epsilon"),
    (dict(epsilon=-1.0), "epsilon"),
    (dict(epsilon=float("nan")), "epsilon"),
    (dict(epsilon=math.inf), "only plan 'none'"),
    (dict(epsilon=None, plan="conv"), "only plan 'none'"),
    (dict(delta=0.0), "delta"),
    (dict(delta=1.0), "delta"),
    (dict(delta=float("nan")), "delta"),
    (dict(plan="pooled"), "unknown noise plan"),
    (dict(mode="lanczos"), "mode"),
    (dict(calibration="classic", epsilon=2.0), "classic"),
    (dict(subjects=[3, 3, 7]), "equal length"),
    (dict(subjects=[[(0, 5), (6, 20)], 2, 2]), "tile"),
])
def test_bad_parameters_are_refused(kwargs, match):
    args = dict(n_components=2, epsilon=1.0, delta=DELTA, plan="cape")
    args.update(kwargs)
    ex = InProcessExchange(n_sites=3)
    with pytest.raises(ValueError, match=match):
        cape_pca(_ok_sites(), args.pop("n_components"), args.pop("epsilon"), args.pop("delta"), exchange=ex, **args)
    assert all(ex.egress_log(s) == [] for s in range(3))


@pytest.mark.parametrize("bad, match", [
    ("nan", "NaN or infinite"),
    ("inf", "NaN or infinite"),
    ("dim", "same number of features"),
    ("norm", "norm"),
    ("two_sites_cape", "at least 3 sites"),
])
def test_bad_data_are_refused(bad, match):
    Xs = _ok_sites()
    if bad == "nan":
        Xs[1] = Xs[1].copy(); Xs[1][2, 3] = np.nan
    elif bad == "inf":
        Xs[2] = Xs[2].copy(); Xs[2][0, 0] = np.inf
    elif bad == "dim":
        Xs[1] = Xs[1][:9]
    elif bad == "norm":
        Xs[0] = Xs[0] * 3
    elif bad == "two_sites_cape":
        Xs = Xs[:2]
    ex = InProcessExchange(n_sites=len(Xs))
    with pytest.raises(ValueError, match=match):
        cape_pca(Xs, 2, 1.0, DELTA, plan="cape", exchange=ex)
    if bad != "two_sites_cape":
        with pytest.raises(ValueError, match=match):
            dpdispca(Xs, 2, 1.0, DELTA)
    assert all(ex.egress_log(s) == [] for s in range(len(Xs)))


def test_site_side_validation_stops_the_protocol_before_any_release():
    """A site that finds bad data in site_init fails the run; no site has released anything."""
    Xs = _ok_sites()
    Xs[1] = Xs[1].copy(); Xs[1][0, 0] = np.nan
    ex = InProcessExchange(n_sites=3)
    with pytest.raises(ValueError, match="NaN"):
        run_cape(CapePCA(2, 1.0, DELTA, random_state=0), [SiteSource(X) for X in Xs], "conv", exchange=ex)
    for s in range(3):
        assert all(rec["topic"] != "release" for rec in ex.egress_log(s))
