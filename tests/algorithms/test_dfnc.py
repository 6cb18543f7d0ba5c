"""dFNC states: windows, CAPE k-means and capeAGN on window vectors, ledgers, an attack, dynamics, the generator."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cape_toys import check_attack_separation
from sklearn.cluster import KMeans

from dpneuro.algorithms import dfnc
from dpneuro.algorithms.agn import M3Stage, moment_stage, prepare_site
from dpneuro.algorithms.metrics import match_components
from dpneuro.datasets.states import make_dfnc_consortium, window_labels
from dpneuro.protocol.cape import run_cape

DELTA = 1e-5


def _consortium(subjects=10, R=8, K=3, T=120, seed=0, sites=4):
    P = make_dfnc_consortium(sites, subjects, R, K, n_timepoints=T, random_state=seed)
    return P, [dfnc.site_windows(tc) for tc in P.timecourses]


# -- windows ---------------------------------------------------------------------------------

def test_windows_match_a_direct_computation():
    """Taper by an explicit sum (rectangle * Gaussian, peak 1), then np.corrcoef and arctanh per window."""
    rng = np.random.default_rng(0)
    R, T, L, sig, step = 5, 70, 22, 3.0, 2
    tc = rng.standard_normal((R, T)) * rng.uniform(0.5, 3, (R, 1)) + rng.standard_normal((R, 1))
    x = (tc - tc.mean(1, keepdims=True)) / tc.std(1, keepdims=True)
    half = math.ceil(4 * sig)
    got = dfnc.window_connectivity(tc, window=L, sigma=sig, step=step)
    starts = range(0, T - L + 1, step)
    assert got.shape == (R * (R - 1) // 2, len(starts))
    iu = np.triu_indices(R, 1)
    for i, t0 in enumerate(starts):
        w = np.array([sum(math.exp(-0.5 * ((t - u) / sig) ** 2) for u in range(t0, t0 + L) if abs(t - u) <= half)
                      for t in range(T)])
        w /= w.max()
        want = np.arctanh(np.corrcoef(w * x)[iu])
        np.testing.assert_allclose(got[:, i], want, atol=1e-10)
    # rectangle only (sigma 0): as GIFT, the correlation of the whole zero-padded windowed series
    rect = dfnc.window_connectivity(tc, window=L, sigma=0.0, fisher=False)
    box = np.zeros(T)
    box[3:3 + L] = 1.0
    np.testing.assert_allclose(rect[:, 3], np.corrcoef(box * x)[iu], atol=1e-10)


def test_vectors_and_matrices_round_trip():
    rng = np.random.default_rng(1)
    C = np.corrcoef(rng.standard_normal((3, 6, 40)).transpose(0, 1, 2).reshape(3, 6, 40)[0])
    v = dfnc.matrix_to_vector(np.stack([C, C]))
    assert v.shape == (15, 2)
    np.testing.assert_allclose(dfnc.state_matrices(v)[1], C, atol=1e-12)
    with pytest.raises(ValueError, match="R\\(R-1\\)/2"):
        dfnc.state_matrices(np.zeros(14))


def test_window_settings_are_checked():
    with pytest.raises(ValueError, match="fewer than one window"):
        dfnc.taper(10, 22)
    with pytest.raises(ValueError, match="step"):
        dfnc.taper(50, 22, step=0)
    with pytest.raises(ValueError, match="constant"):
        dfnc.window_connectivity(np.r_[np.ones((1, 40)), np.random.default_rng(0).standard_normal((2, 40))])


# -- dynamics ----------------------------------------------------------------------------------

def test_dynamics_of_a_hand_made_sequence():
    h = [0, 0, 1, 1, 1, 0, 2, 2, 0, 0, 0, 0]
    d = dfnc.subject_dynamics(h, 4, tr=2.0, step=1)
    np.testing.assert_allclose(d["occupancy"], [7 / 12, 3 / 12, 2 / 12, 0])
    # runs: 0 -> 2, 1, 4; 1 -> 3; 2 -> 2; 3 never (0, as GIFT)
    np.testing.assert_allclose(d["dwell_windows"], [7 / 3, 3, 2, 0])
    np.testing.assert_allclose(d["dwell_seconds"], [14 / 3, 6, 4, 0])
    assert d["transitions"] == 4
    assert dfnc.subject_dynamics([1, 1, 1], 2)["transitions"] == 0


def test_site_dynamics_use_the_public_centroids():
    _, ws = _consortium(subjects=3, sites=1)
    C = ws[0].X[:, [0, 50, 120]]
    per = dfnc.site_dynamics(ws[0], C, "euclidean")
    lab = np.argmin(((ws[0].X[:, :, None] - C[:, None, :]) ** 2).sum(0), axis=1)
    n0 = ws[0].lengths[0]
    np.testing.assert_allclose(per["occupancy"][0], np.bincount(lab[:n0], minlength=3) / n0)
    assert per["occupancy"].shape == (3, 3) and per["transitions"].shape == (3,)


# -- non-private equivalence -----------------------------------------------------------------

@pytest.mark.parametrize("seed", [0, 1])
def test_noise_free_kmeans_is_pooled_lloyd(seed):
    """plan 'none', no clipping, equal windows per subject: the CAPE k-means rounds (on windows centred on any
    public point, the noise variances 0) are scikit-learn's Lloyd on the pooled windows from the same start."""
    _, ws = _consortium(seed=seed)
    X = np.concatenate([w.X for w in ws], axis=1)
    rng = np.random.default_rng(seed)
    C0 = X[:, rng.choice(X.shape[1], 3, replace=False)]
    centre = X.mean(axis=1) + rng.standard_normal(X.shape[0])
    alg = dfnc.CapeKMeans(3, 8, 1e9, 0.0, 0.0, init=C0 - centre[:, None], centre=centre, count_floor=1e-12)
    got = run_cape(alg, ws, "none").aggregator["centroids"] + centre[:, None]
    km = KMeans(3, init=C0.T, n_init=1, max_iter=8, tol=0.0, algorithm="lloyd").fit(X.T)
    np.testing.assert_allclose(got, km.cluster_centers_.T, atol=1e-8)


@pytest.mark.parametrize("method", dfnc.METHODS)
def test_non_private_states_recover_the_planted_ones(method):
    """4 x 12 subjects, R = 12, 200 TRs. Measured: every state's correlation with the truth 0.97-0.99; occupancy
    within 0.08 of the windows' planted states (windows straddling a switch blur k-means' boundaries)."""
    P, ws = _consortium(subjects=12, R=12, T=200, seed=3)
    truth = dfnc.matrix_to_vector(P.states)
    res = dfnc.dfnc_states(ws, 3, None, plan="none", method=method, random_state=0)
    perm, corr = match_components(np.tanh(res.vectors), np.tanh(truth))
    assert corr.min() > 0.95, corr
    assert res.states.shape == (3, 12, 12) and np.allclose(np.diagonal(res.states, axis1=1, axis2=2), 1)
    lab = np.concatenate([window_labels(h, dfnc.taper(200), 3) for s in P.labels for h in s])
    np.testing.assert_allclose(res.occupancy[perm], np.bincount(lab, minlength=3) / lab.size, atol=0.1)


def test_contracted_third_moment_is_the_agn_release():
    """The dFNC M3 stage sends M3_s(W, W, W) + E(W, W, W); without noise that is agn's (M3_s)(W, W, W)."""
    _, ws = _consortium(subjects=3, R=6)
    B = dfnc.default_bound(ws[0].D) * 3
    sites = [prepare_site(w.X, "mog", scale=B, warn_clipping=False) for w in ws]
    groups = {s: max(w.lengths) for s, w in enumerate(ws)}
    W = np.random.default_rng(0).standard_normal((ws[0].D, 3))
    full = moment_stage(3, 3, 0.0, groups, scale=B, W=W, sigma2=0.01)
    assert type(full) is M3Stage
    fast = dfnc._agn_stages(3, 0.0, 0.0, groups, B, None, W=W, sigma2=0.01)
    a = run_cape(full, sites, "none").aggregator["m3w"]
    b = run_cape(fast, sites, "none").aggregator["m3w"]
    np.testing.assert_allclose(a, b, atol=1e-12)


# -- privacy: ledgers, planner, sensitivity, attack -------------------------------------------

@pytest.mark.parametrize("method", dfnc.METHODS)
def test_ledger_records_every_release_and_the_planner_agrees(method):
    """Equal sites: the composed headline eps is the target; every release is in the ledger at its sensitivity
    (mean 2 B0 / M_s, each round's sums 2B / M_s and counts sqrt(2) / M_s, occupancy sqrt(2) / M_s); the
    planner, from counts alone, predicts the same ledgers."""
    _, ws = _consortium(subjects=8)
    res = dfnc.dfnc_states(ws, 3, 4.0, DELTA, method=method, random_state=5)
    plan = dfnc.plan_ledgers([w.lengths for w in ws], 8, 3, 4.0, DELTA, method=method)
    B, B0 = dfnc.default_bound(ws[0].D), dfnc.MEAN_BOUND * math.sqrt(ws[0].D)
    for led, want in zip(res.ledgers, plan):
        assert led.epsilon(DELTA, collusion=True) == pytest.approx(4.0, rel=1e-6)
        assert led.mu_collusion == pytest.approx(want.mu_collusion, rel=1e-9)
        assert sorted((r.name, r.count) for r in led.releases) == sorted((r.name, r.count) for r in want.releases)
        assert all(r.unit == "subject" and r.neighbour == "replace" for r in led.releases)
        stages = {r.stage for r in led.releases}
        assert stages == set(dfnc.StateSettings(3, 4.0, method=method).ledger_stages)
        sens = {r.name: r.sensitivity for r in led.releases}
        if method == "kmeans":
            assert sens["sums"] == pytest.approx(2 * B / 8) and sens["counts"] == pytest.approx(math.sqrt(2) / 8)
            assert sens["mean"] == pytest.approx(2 * B0 / 8) and sens["occupancy"] == pytest.approx(math.sqrt(2) / 8)
            # 3 over-clustered rounds, 1 at K, 2 final
            assert sum(r.count for r in led.releases if r.name == "sums") == 6
        else:
            assert sens["m2"] == pytest.approx(math.sqrt(2) / 8)  # a subject's windows over the site's


def test_unequal_sites_stay_within_the_budget():
    P = make_dfnc_consortium(4, [6, 9, 12, 15], 6, 3, n_timepoints=80, random_state=2)
    ws = [dfnc.site_windows(tc) for tc in P.timecourses]
    res = dfnc.dfnc_states(ws, 3, 2.0, DELTA, random_state=1)
    eps = [led.epsilon(DELTA, collusion=True) for led in res.ledgers]
    assert max(eps) == pytest.approx(2.0, rel=1e-6) and min(eps) <= 2.0 + 1e-9
    plan = dfnc.plan_ledgers([w.lengths for w in ws], 6, 3, 2.0, DELTA)
    np.testing.assert_allclose([p.mu_collusion for p in plan], [led.mu_collusion for led in res.ledgers], rtol=1e-9)


def _subject_contribution(alg, ws, C):
    """Site 0's released sums and counts for centroids C (the site step)."""
    from dpneuro.protocol.exchange import Payload

    st = alg.site_init(0, ws)
    return alg.site_compute(st, 0, Payload({"centroids": C, "noise_var": np.zeros(C.shape[1])}))


def test_replacing_a_subject_moves_the_release_by_at_most_its_sensitivity():
    """Adversarial replacements (a subject's windows all in one state, far out; or spread) stay within each
    release's sensitivity (the k-means sums 2B / M and counts sqrt(2) / M, the mean 2 B0 / M, the occupancy
    sqrt(2) / M), and the worst reaches near the bound."""
    _, ws = _consortium(subjects=6, R=6, sites=1)
    w0 = ws[0]
    C = w0.X[:, [0, 60, 200]]
    B = 0.5
    algs = {"kmeans": dfnc.CapeKMeans(3, 1, B, 1.0, 1.0, init=C, centre=np.zeros(w0.D)),
            "mean": dfnc.CapeMean(0.8, 1.0), "occupancy": dfnc.CapeOccupancy(C, 1.0)}
    alg = algs["kmeans"]
    base = _subject_contribution(alg, w0, C)
    rng = np.random.default_rng(0)
    worst_s = worst_c = 0.0
    worst = {"mean": 0.0, "occupancy": 0.0}
    other_base = {k: _subject_contribution(algs[k], w0, C)[k] for k in worst}
    n0 = w0.lengths[0]
    for trial in range(20):
        X = w0.X.copy()
        if trial % 4 == 1:
            X[:, :n0] = (C[:, trial % 3] * 50)[:, None]  # every window in one state, huge
        elif trial % 4 == 3:  # every window in one state, within the bound: its whole count moves
            X[:, :n0] = C[:, trial % 3][:, None] + 1e-3 * rng.standard_normal((w0.D, n0))
        else:
            X[:, :n0] = rng.standard_normal((w0.D, n0)) * 10
        neighbour = dfnc.WindowSet(X, w0.lengths)
        other = _subject_contribution(alg, neighbour, C)
        worst_s = max(worst_s, np.linalg.norm(other["sums"] - base["sums"]))
        worst_c = max(worst_c, np.linalg.norm(other["counts"] - base["counts"]))
        for k in worst:
            worst[k] = max(worst[k], np.linalg.norm(_subject_contribution(algs[k], neighbour, C)[k] - other_base[k]))
    spec = alg.site_releases(alg.site_init(0, w0))
    assert worst_s <= spec["sums"].sensitivity + 1e-12 and worst_c <= spec["counts"].sensitivity + 1e-12
    # the counts reach sqrt(2) / M only when the replaced subject was itself all in one other state
    assert worst_s > 0.6 * spec["sums"].sensitivity and worst_c > 0.3 * spec["counts"].sensitivity
    for k, got in worst.items():
        sens = algs[k].site_releases(algs[k].site_init(0, w0))[k].sensitivity
        assert 0.5 * sens < got <= sens + 1e-12, (k, got, sens)


def test_distinguishing_attack_separates_neighbours_by_at_most_the_ledgers_mu():
    """Neighbouring consortia differ in one subject of site 0 (its windows replaced by one far-out state). The
    aggregator with site 3's draws runs the best (likelihood-ratio) test on one k-means round, 150 protocol runs
    per world: its statistic has unit spread and shifts by the separation the neighbour allows, which is at most
    the ledger's mu. This neighbour moves the sums near their bound; its counts, weighted by its clipping factor,
    move little, so the separation is about half of mu."""
    _, ws = _consortium(subjects=5, R=5, K=3, T=60)
    C = ws[1].X[:, [0, 30, 60]]
    B, z = 0.3, 0.6
    n0 = ws[0].lengths[0]
    X1 = ws[0].X.copy()
    X1[:, :n0] = (C[:, 1] * 40)[:, None]
    worlds = [ws, [dfnc.WindowSet(X1, ws[0].lengths)] + ws[1:]]
    algs = [dfnc.CapeKMeans(3, 1, B, z, z, init=C, centre=np.zeros(C.shape[0])) for _ in worlds]
    f = [_subject_contribution(a, w[0], C) for a, w in zip(algs, worlds)]
    diff = {k: f[1][k] - f[0][k] for k in f[0]}
    check_attack_separation(lambda seed: dfnc.CapeKMeans(3, 1, B, z, z, init=C, centre=np.zeros(C.shape[0]),
                                                         random_state=seed), worlds, diff, at_least=0.4)


# -- private utility (fixed seeds) -------------------------------------------------------------

def test_private_kmeans_degrades_gracefully_with_the_budget():
    """4 sites x 40 subjects, R = 8 (28 pairs), 3 states, 120 TRs, seeds 0-2. Measured: mean state correlation with
    the truth 0.89 at eps 8, 0.20 at eps 0.25."""
    P, ws = _consortium(subjects=40, seed=4)
    truth = np.tanh(dfnc.matrix_to_vector(P.states))
    got = {}
    for eps in (0.25, 8.0):
        cs = []
        for seed in range(3):
            res = dfnc.dfnc_states(ws, 3, eps, DELTA, random_state=seed)
            cs.append(match_components(np.tanh(res.vectors), truth)[1].mean())
        got[eps] = np.mean(cs)
    assert got[8.0] > 0.85, got
    assert got[0.25] < 0.5, got


# -- generator ---------------------------------------------------------------------------------

def test_generator_plants_valid_states_with_the_asked_dwell_times():
    P = make_dfnc_consortium(2, 20, 10, 4, n_timepoints=400, dwell=(20, 40, 60, 120), random_state=1)
    for C in P.states:
        assert np.allclose(np.diag(C), 1) and np.allclose(C, C.T) and np.linalg.eigvalsh(C).min() > 0
    runs = {k: [] for k in range(4)}
    for site in P.labels:
        for h in site:
            starts = np.r_[0, np.flatnonzero(np.diff(h)) + 1]
            lens = np.diff(np.r_[starts, h.size])
            for k, n, s in zip(h[starts], lens, starts):
                if s > 0 and s + n < h.size:  # runs cut by the scan's ends are shorter
                    runs[k].append(n)
    dwell = np.array([np.mean(runs[k]) for k in range(4)]) * P.tr
    np.testing.assert_allclose(dwell, [20, 40, 60, 120], rtol=0.25)
    occ = P.occupancy
    assert np.all(np.diff(occ) > 0)  # longer dwell, more time
    # the same seed gives the same consortium
    Q = make_dfnc_consortium(2, 20, 10, 4, n_timepoints=400, dwell=(20, 40, 60, 120), random_state=1)
    assert np.array_equal(P.timecourses[1][3], Q.timecourses[1][3])


def test_refusals():
    _, ws = _consortium(subjects=3)
    with pytest.raises(ValueError, match="metric"):
        dfnc.dfnc_states(ws, 3, 1.0, metric="manhattan")
    with pytest.raises(ValueError, match="method"):
        dfnc.dfnc_states(ws, 3, 1.0, method="gmm")
    with pytest.raises(ValueError, match="plan 'none'"):
        dfnc.dfnc_states(ws, 3, None)
    with pytest.raises(ValueError, match="at least 3 sites"):
        dfnc.dfnc_states(ws[:2], 3, 1.0)
    with pytest.raises(ValueError, match="n_states"):
        dfnc.dfnc_states(ws, 1, 1.0)


def test_random_state_is_the_seed():
    _, ws = _consortium(subjects=4)
    a = dfnc.dfnc_states(ws, 3, 4.0, random_state=3)
    b = dfnc.dfnc_states(ws, 3, 4.0, random_state=3)
    c = dfnc.dfnc_states(ws, 3, 4.0, random_state=4)
    assert np.array_equal(a.vectors, b.vectors) and not np.allclose(a.vectors, c.vectors)
