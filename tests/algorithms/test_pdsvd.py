"""PD-SVD / PD-PCA ([PD-ML-Lite] Alg. 3, 4, 6, 7) and the KS distributional privacy measurement (Alg. 5)."""

import math

import numpy as np
import pytest

from dpneuro.algorithms import PDSVD, ks_privacy, pd_pca, pd_svd
from dpneuro.algorithms.pdsvd import Blinding, SiteInput, covariance_statistics
from dpneuro.protocol.driver import RunOptions
from dpneuro.protocol.exchange import InProcessExchange
from dpneuro.protocol.simulation import SimulatedDropout, simulate

CLEAR = {"public", "secagg-mask", "secagg-share", "encrypted-share"}


def sites_with_gap(D=60, k=4, S=3, Ns=100, seed=0, offsets=False):
    """Rank-k signal (eigen-gap ~4x) plus small noise; optionally a different mean per site."""
    rng = np.random.default_rng(seed)
    maps = np.linalg.qr(rng.standard_normal((D, k)))[0]
    out = []
    for s in range(S):
        X = maps @ (np.linspace(4, 2, k)[:, None] * rng.standard_normal((k, Ns))) + 0.3 * rng.standard_normal((D, Ns))
        if offsets:
            X += 3.0 * (s + 1) * maps[:, :1] + rng.standard_normal((D, 1))
        out.append(X)
    return out


def top_left(X, k):
    U, s, _ = np.linalg.svd(X, full_matrices=False)
    return U[:, :k], s[:k]


def sin_max_angle(V, U):
    return float(np.linalg.norm(V - U @ (U.T @ V), 2))


@pytest.mark.parametrize("secure", [True, False])
def test_pd_svd_is_the_pooled_top_k_subspace(secure):
    Xs = sites_with_gap()
    U, _ = top_left(np.hstack(Xs), 4)
    res = pd_svd(Xs, 4, 60, random_state=1, secure=secure)
    assert res.basis.shape == (60, 4)
    assert np.allclose(res.basis.T @ res.basis, np.eye(4), atol=1e-12)
    assert sin_max_angle(res.basis, U) < 1e-6
    assert res.singular_values is None
    for led in res.ledgers:
        assert led.releases == [] and any("measured" in n and "no differential-privacy noise" in n
                                          for n in led.notes)


def test_revealed_singular_values_match_numpy():
    Xs = sites_with_gap(seed=2)
    U, s = top_left(np.hstack(Xs), 4)
    res = pd_svd(Xs, 4, 60, random_state=1, reveal_singular_values=True)
    assert sin_max_angle(res.basis, U) < 1e-6
    assert np.allclose(res.singular_values, s, rtol=1e-6)


def test_pd_pca_centres_on_the_global_mean():
    Xs = sites_with_gap(seed=3, offsets=True)
    X = np.hstack(Xs)
    Uc, _ = top_left(X - X.mean(axis=1, keepdims=True), 4)
    res = pd_pca(Xs, 4, 60, random_state=1)
    assert sin_max_angle(res.basis, Uc) < 1e-6
    unc = pd_svd(Xs, 4, 60, random_state=1)  # without centring the mean direction dominates: a different subspace
    assert sin_max_angle(unc.basis, Uc) > 0.1


def test_aggregator_sees_only_blinded_norms_and_nothing_leaves_unmasked():
    Xs = sites_with_gap(seed=4)
    ex = InProcessExchange(n_sites=3)
    hidden = pd_svd(Xs, 4, 8, random_state=1, exchange=ex, site_secret=b"k" * 32)
    shown = pd_svd(Xs, 4, 8, random_state=1, reveal_singular_values=True)
    assert sin_max_angle(hidden.basis, shown.basis) < 1e-7  # same iterates (up to fixed-point rounding)
    h = np.array([t["norms"] for t in hidden.transcript if t["topic"] == "it"])
    s = np.array([t["norms"] for t in shown.transcript if t["topic"] == "it"])
    ratio = np.log2(h / s) + Blinding().lo  # the blinding factors r_{t,i} (reveal mode: the public 2^lo)
    b = Blinding()
    assert ratio.min() >= b.lo - 1e-6 and ratio.max() <= b.hi + 1e-6
    assert np.ptp(ratio) > 1.0  # factors differ across columns and rounds
    # the fixed part rho_i: within a column the factors vary only by the fresh part (5 bits)
    assert np.all(np.ptp(ratio, axis=0) <= b.fresh + 1e-6)
    for s_ in range(3):
        for rec in ex.egress_log(s_):
            assert {a["carries"] for a in rec["arrays"].values()} <= CLEAR, rec


def test_sites_with_different_secrets_cannot_decode():
    Xs = sites_with_gap(D=10, k=2, S=3, Ns=20, seed=5)
    proto = PDSVD(2, 3, n_sites=3, secure=False, norm_bound=50.0, random_state=0)
    data = [SiteInput(X, bytes([s + 1]) * 32) for s, X in enumerate(Xs)]
    with pytest.raises(RuntimeError, match="same secret"):
        simulate(proto, data)


def test_a_dropout_stops_pd_svd():
    Xs = sites_with_gap(D=10, k=2, S=4, Ns=20, seed=6)
    calls = {"n": 0}

    def flaky():  # site 3 vanishes at its third pass over the data (validation, round 0, round 1)
        calls["n"] += 1
        if calls["n"] == 3:
            raise SimulatedDropout
        return iter([Xs[3]])

    proto = PDSVD(2, 4, n_sites=4, norm_bound=50.0, random_state=0)
    data = [SiteInput(X, b"s" * 32) for X in Xs[:3]] + [SiteInput(flaky, b"s" * 32)]
    with pytest.raises(RuntimeError, match="dropped out"):
        simulate(proto, data, options=RunOptions(timeout=2))


# -- KS distributional privacy ------------------------------------------------------------------

def test_ks_privacy_detects_a_dominant_unit():
    """A unit much larger than everything else moves V and Sigma: its presence is detectable."""
    rng = np.random.default_rng(7)
    Xs = [0.1 * rng.standard_normal((6, 30)) for _ in range(3)]
    Xs[0][:, 0] = 0.0
    Xs[0][0, 0] = 3.0  # the target: far outside the data's spread
    stats_ = covariance_statistics()
    res = ks_privacy({"w_sum": stats_["w_sum"], "d_max": stats_["d_max"]}, Xs, target=(0, 0), k=2, n_iter=15,
                     n_trials=20, random_state=1, reveal_singular_values=True)
    assert res.pi < 1e-3 and res.pi == min(res.p_values.values())
    a, b = res.samples["w_sum"]
    assert len(a) == len(b) == 20 and np.median(a) > np.median(b)


def test_ks_privacy_does_not_flag_a_typical_unit():
    rng = np.random.default_rng(8)
    scales = np.sqrt(np.array([5.0, 3.0, 2.0, 1.0, 0.5, 0.2]))[:, None]
    Xs = [scales * rng.standard_normal((6, 200)) for _ in range(3)]
    res = ks_privacy(covariance_statistics()["w_sum"], Xs, target=(1, 5), k=2, n_iter=15, n_trials=20,
                     subsample=0.5, random_state=2)
    assert res.pi > 0.01, res.p_values


# -- bad input -----------------------------------------------------------------------------------

@pytest.mark.parametrize("case, match", [
    ("k", "exceeds min"),
    ("dim", "same number of features"),
    ("nan", "NaN or infinite"),
    ("bound", "norm bound"),
    ("iters", "n_iter"),
])
def test_bad_input_is_refused(case, match):
    Xs = sites_with_gap(D=10, k=2, S=3, Ns=5, seed=9)
    kw, k, n_iter = {}, 2, 5
    if case == "k":
        k = 11
    elif case == "dim":
        Xs[2] = Xs[2][:8]
    elif case == "nan":
        Xs[1][0, 0] = np.nan
    elif case == "bound":
        kw["norm_bound"] = 0.5
    elif case == "iters":
        n_iter = 0
    ex = InProcessExchange(n_sites=3)
    with pytest.raises(ValueError, match=match):
        pd_svd(Xs, k, n_iter, exchange=ex, **kw)
    assert all(ex.egress_log(s) == [] for s in range(3))


def test_protocol_needs_the_shared_secret():
    Xs = sites_with_gap(D=10, k=2, S=3, Ns=5, seed=9)
    with pytest.raises(ValueError, match="shared secret"):
        simulate(PDSVD(2, 3, n_sites=3, secure=False, norm_bound=50.0), Xs)
    assert math.isfinite(PDSVD(2, 3, n_sites=3, reveal_singular_values=True).norm_bound)


def test_what_the_ledger_and_the_aggregator_say_is_what_happens():
    """The ledger is not private (eps infinite) and the aggregator learns n exactly, as documented."""
    Xs = sites_with_gap(D=12, k=2, S=3, Ns=25, seed=6)
    res = pd_svd(Xs, 2, 3, random_state=1, site_secret=b"s" * 32)
    for led in res.ledgers:
        assert led.epsilon(1e-5) == math.inf and led.not_private and not led.releases
    t = next(x for x in res.transcript if x["topic"] == "n")
    n = sum(X.shape[1] for X in Xs)
    assert round(t["value"] / t["check"] * len(Xs)) == n  # up to the secure sum's fixed-point rounding
