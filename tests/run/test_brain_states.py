"""Brain states (dFNC) as a stage of the run: recovery through the stage table, planner = run, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
from sklearn.cluster import KMeans

from dpneuro.algorithms import dfnc
from dpneuro.algorithms.metrics import match_components
from dpneuro.config import ConfigError, RunConfig, SiteEntry
from dpneuro.datasets.states import make_dfnc_consortium
from dpneuro.run import roles, stages
from dpneuro.run.planner import SiteShape

R, K = 6, 3


def _cfg(**kw) -> RunConfig:
    d = dict(sites=[SiteEntry(f"s{i}", "x") for i in range(4)], out="/tmp/unused", n_components=R,
             brain_states=K, seed=7, simulation=True)
    d.update(kw)
    return RunConfig(**d)


def _planted(seed: int, subjects: int = 30, T: int = 150):
    P = make_dfnc_consortium(4, subjects, R, K, n_timepoints=T, random_state=seed)
    S = [np.concatenate(site, axis=1) for site in P.timecourses]
    lengths = [[tc.shape[1] for tc in site] for site in P.timecourses]
    return P, S, lengths


@pytest.mark.parametrize("seed", [0, 1])
def test_the_stage_without_noise_is_gifts_pooled_kmeans(seed):
    """Without noise the stage finds what GIFT's k-means finds on the pooled windows (scikit-learn, 10 starts):
    measured 0.987-1.000 per state; both find the planted states (0.83-0.99: with 6 components one planted
    state's windows are hard to tell from another's at 150 volumes, for either)."""
    P, S, lengths = _planted(seed)
    cfg = _cfg(plan="none")
    res = stages.states_inprocess(cfg, S, lengths)
    assert res["vectors"].shape == (R * (R - 1) // 2, K)
    X = np.concatenate([roles.site_windows(cfg, s, ln).X for s, ln in zip(S, lengths)], axis=1)
    pooled = KMeans(K, n_init=10, random_state=0).fit(X.T).cluster_centers_.T
    assert match_components(np.tanh(res["vectors"]), np.tanh(pooled))[1].min() > 0.98
    _, corr = match_components(np.tanh(res["vectors"]), np.tanh(dfnc.matrix_to_vector(P.states)))
    assert corr.min() > 0.8 and np.median(corr) > 0.95
    assert all(not led.releases and led.not_private for led in res["ledgers"])  # plan none: no noise, not private
    np.testing.assert_allclose(res["occupancy"].sum(), 1.0)


def test_the_stage_is_the_library_function_and_spends_states_epsilon():
    _, S, lengths = _planted(2, subjects=20)
    cfg = _cfg(states_epsilon=3.0)
    res = stages.states_inprocess(cfg, S, lengths)
    ws = [roles.site_windows(cfg, s, ln) for s, ln in zip(S, lengths)]
    st = stages.states_settings(cfg)
    lib = dfnc.dfnc_states(ws, K, st.epsilon, st.delta, random_state=st.random_state, method=st.method,
                           metric=st.metric, plan=st.plan)
    np.testing.assert_allclose(res["vectors"], lib.vectors)  # one protocol: the same noise, the same states
    np.testing.assert_allclose(res["occupancy"], lib.occupancy)
    for led in res["ledgers"]:  # equal sites: the stage composes to exactly states_epsilon at delta / 2
        assert math.isclose(led.epsilon(cfg.pca_delta, collusion=True), 3.0, rel_tol=1e-6)


def test_the_planner_predicts_the_stage_ledgers():
    _, S, lengths = _planted(3, subjects=12)
    lengths[1] = lengths[1][:8]  # an unequal site
    S[1] = S[1][:, :sum(lengths[1])]
    for method in dfnc.METHODS:
        cfg = _cfg(states_method=method, states_window=30, states_step=2)
        res = stages.states_inprocess(cfg, S, lengths)
        shapes = [SiteShape(f"s{i}", ln) for i, ln in enumerate(lengths)]
        planned = stages.release("states").plan(cfg, shapes, 0)
        for run, plan in zip(res["ledgers"], planned):
            assert run.by_stage() == pytest.approx(plan.by_stage())


def test_window_counts_match_the_windows():
    cfg = _cfg(states_window=20, states_step=3)
    S = np.random.default_rng(0).standard_normal((R, 50 + 61))
    ws = roles.site_windows(cfg, S, [50, 61])
    assert ws.lengths == roles.window_counts(cfg, [50, 61]) == [11, 14]


def test_a_subject_shorter_than_a_window_is_refused_naming_the_setting():
    cfg = _cfg(states_window=40)
    S = np.random.default_rng(0).standard_normal((R, 100))
    with pytest.raises(ConfigError, match="states_window.*site 2.*30 volumes"):
        stages.release("states").check(cfg, [S] * 4, [[70, 30] if i == 2 else [50, 50] for i in range(4)])
    shapes = [SiteShape(f"s{i}", (70, 30) if i == 2 else (50, 50)) for i in range(4)]
    with pytest.raises(ConfigError, match="states_window.*site s2"):  # the planner refuses it too
        stages.release("states").plan(cfg, shapes, 0)


@pytest.mark.parametrize("kw, field", [
    ({"brain_states": 1}, "brain_states"),
    ({"brain_states": -2}, "brain_states"),
    ({"brain_states": R * (R - 1) // 2 + 1}, "brain_states"),
    ({"states_epsilon": 0.0}, "states_epsilon"),
    ({"states_epsilon": float("inf")}, "states_epsilon"),
    ({"states_method": "gmm"}, "states_method"),
    ({"states_metric": "cosine"}, "states_metric"),
    ({"states_window": 2}, "states_window"),
    ({"states_step": 0}, "states_step"),
])
def test_bad_brain_states_settings_are_refused_before_anything_runs(kw, field, tmp_path):
    (tmp_path / "d").mkdir()
    cfg = _cfg(**{**kw, "sites": [SiteEntry(f"s{i}", str(tmp_path / "d")) for i in range(4)]})
    with pytest.raises(ConfigError, match=field):
        cfg.validate()
