"""Brain states (capeAGN) as a stage of the run: recovery, subject-level sensitivities, occupancy, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dpneuro import analysis, stages
from dpneuro.algorithms.agn import prepare_site, sensitivities
from dpneuro.config import ConfigError, RunConfig, SiteEntry
from dpneuro.metrics import match_components

R, K = 6, 3


def _cfg(**kw) -> RunConfig:
    d = dict(sites=[SiteEntry(f"s{i}", "x") for i in range(4)], out="/tmp/unused", n_components=R,
             brain_states=K, seed=7, simulation=True)
    d.update(kw)
    return RunConfig(**d)


def _mixture(seed: int, *, subjects: int = 40, T: int = 60, sites: int = 4):
    """Whitened-like time points of a K-state mixture: x = mu_h + N(0, s^2 I), E||x||^2 ~ R."""
    rng = np.random.default_rng(seed)
    mu = np.zeros((R, K))
    for k in range(K):  # distinct sparse states
        mu[[k, (k + 3) % R], k] = [1.6, -1.2]
    Z, lengths, labels = [], [], []
    for _ in range(sites):
        h = rng.integers(0, K, subjects * T)
        Z.append(mu[:, h] + 0.6 * rng.standard_normal((R, subjects * T)))
        lengths.append([T] * subjects)
        labels.append(h)
    return mu, Z, lengths, labels


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_non_private_states_recover_the_centroids_and_weights(seed):
    mu, Z, lengths, labels = _mixture(seed)
    res = stages.states_inprocess(_cfg(plan="none"), Z, lengths)
    perm, corr = match_components(res.centroids, mu)
    # signed: a state's sign is meaningful; magnitudes shrink (points beyond the public bound are projected)
    assert np.all(corr > 0.97), corr
    true_occ = np.bincount(np.concatenate(labels), minlength=K) / sum(len(h) for h in labels)
    np.testing.assert_allclose(res.occupancy[perm], true_occ, atol=0.06)


def test_private_states_degrade_with_the_budget_and_spend_two_releases():
    mu, Z, lengths, _ = _mixture(3)
    err = {}
    for eps in (0.5, 8.0):
        cfg = _cfg(states_epsilon=eps)
        errs = []
        for s in range(4):
            res = stages.states_inprocess(cfg.__class__(**{**cfg.__dict__, "seed": 100 + s}), Z, lengths)
            perm, corr = match_components(res.centroids, mu)
            errs.append(np.mean(corr))
        err[eps] = np.median(errs)
        led = res.ledgers[0]
        assert sorted(r.stage for r in led.releases) == ["agn-m2", "agn-m3"]
        assert all(r.unit == "subject" for r in led.releases)
        m, n = 60, 40 * 60  # subject-level: the longest subject's time points over the site's
        d2, d3 = sensitivities("mog", R, n, 0.0, m)
        assert {r.stage: r.sensitivity for r in led.releases}["agn-m2"] == pytest.approx(d2)
        assert {r.stage: r.sensitivity for r in led.releases}["agn-m3"] >= d3
    assert err[8.0] > 0.93 and err[0.5] < err[8.0] - 0.1, err


@pytest.mark.filterwarnings("ignore:.*exceed the norm bound")
def test_subject_level_sensitivity_bounds_a_replaced_subject():
    """Replacing one subject (all its time points) moves M2 and M3 by at most the ledger's sensitivities."""
    rng = np.random.default_rng(4)
    T, M, scale = 20, 10, math.sqrt(R)
    sigma2 = 0.05
    worst2 = worst3 = 0.0
    for trial in range(30):
        X = rng.standard_normal((R, T * M)) * (1 + 3 * rng.random())
        Y = X.copy()
        # adversarial replacement: the subject's points all at the ball's edge, in one direction
        v = rng.standard_normal(R)
        Y[:, :T] = (v / np.linalg.norm(v) * scale * 5)[:, None]
        a, b = prepare_site(X, "mog", scale=scale), prepare_site(Y, "mog", scale=scale)
        n = a.n
        m2 = lambda p: p.X @ p.X.T / n  # noqa: E731
        m3 = lambda p: np.einsum("in,jn,kn->ijk", p.X, p.X, p.X) / n  # noqa: E731
        worst2 = max(worst2, np.linalg.norm(m2(a) - m2(b)))
        worst3 = max(worst3, np.linalg.norm(m3(a) - m3(b)))
    d2, d3 = sensitivities("mog", R, T * M, sigma2, T)
    assert worst2 <= d2 and worst3 <= d3
    assert worst2 > 0.5 * d2  # the bound is attained up to a constant, not loose by orders of magnitude


def test_occupancy_is_each_subjects_fraction_nearest_each_state():
    rng = np.random.default_rng(0)
    C = rng.standard_normal((R, K))
    Z = rng.standard_normal((R, 50))
    occ = analysis.state_occupancy(Z, [20, 30], C)
    nearest = np.argmin(((Z[:, :, None] - C[:, None, :]) ** 2).sum(axis=0), axis=1)
    np.testing.assert_allclose(occ[0], np.bincount(nearest[:20], minlength=K) / 20)
    np.testing.assert_allclose(occ[1], np.bincount(nearest[20:], minlength=K) / 30)
    np.testing.assert_allclose(occ.sum(axis=1), 1.0)


@pytest.mark.parametrize("kw, field", [
    ({"brain_states": 1}, "brain_states"),
    ({"brain_states": -2}, "brain_states"),
    ({"brain_states": R}, "brain_states"),
    ({"brain_states": 2, "states_epsilon": 0.0}, "states_epsilon"),
    ({"brain_states": 2, "states_epsilon": float("inf")}, "states_epsilon"),
])
def test_bad_brain_states_settings_are_refused_before_anything_runs(kw, field, tmp_path):
    (tmp_path / "d").mkdir()
    cfg = _cfg(**{**kw, "sites": [SiteEntry(f"s{i}", str(tmp_path / "d")) for i in range(4)]})
    with pytest.raises(ConfigError, match=field):
        cfg.validate()
