"""Static FNC as a stage of the run: the pooled mean without noise, the calibrated noise, planner = run, the
subject bound and a distinguishing attack, and the files a run writes."""

from __future__ import annotations

import math

import numpy as np
import pytest
from cape_toys import check_attack_separation

from dpneuro.algorithms.fnc import CapeFNC, FNCSettings, clip_subjects, site_fnc, subject_fnc
from dpneuro.config import RunConfig, SiteEntry
from dpneuro.run import stages
from dpneuro.run.planner import SiteShape

R = 6
P = R * (R - 1) // 2


def _cfg(**kw) -> RunConfig:
    d = dict(sites=[SiteEntry(f"s{i}", "x") for i in range(4)], out="/tmp/unused", n_components=R, seed=7,
             simulation=True)
    d.update(kw)
    return RunConfig(**d)


def _sites(seed: int, subjects=(20, 30, 25, 40), T: int = 100, coupling: float = 0.2):
    """Component time courses with a shared correlation structure, per site (R x N) and subject lengths."""
    rng = np.random.default_rng(seed)
    C = np.full((R, R), coupling) + (1 - coupling) * np.eye(R)
    C[0, 1] = C[1, 0] = -0.3
    L = np.linalg.cholesky(C)
    S = [L @ rng.standard_normal((R, m * T)) for m in subjects]
    return S, [[T] * m for m in subjects]


def test_subject_fnc_is_the_fisher_z_of_the_correlations():
    rng = np.random.default_rng(0)
    tc = rng.standard_normal((R, 80))
    tc[2] += tc[0]
    np.testing.assert_allclose(subject_fnc(tc), np.arctanh(np.corrcoef(tc)[np.triu_indices(R, 1)]), atol=1e-12)
    tc[4] = 3.0  # a constant course correlates 0 with the others, not NaN
    f = subject_fnc(tc)
    assert np.all(np.isfinite(f)) and np.all(f[[3, 7, 10, 12, 14]] == 0)
    with pytest.raises(ValueError, match="lengths sum to 90"):
        site_fnc(tc, [40, 50])


def test_without_noise_the_stage_is_the_pooled_mean_of_every_subjects_bounded_fnc():
    S, lengths = _sites(1)
    cfg = _cfg(plan="none")
    res, leds = stages.run_inprocess(stages.release("fnc"), cfg, S, lengths, dim=0, public={})
    every = np.vstack([site_fnc(s, ln) for s, ln in zip(S, lengths)])
    bound = FNCSettings(None).scale(P)
    np.testing.assert_allclose(res["fnc"], clip_subjects(every, bound)[0].mean(axis=0), atol=1e-12)
    assert res["noise_var"] == 0 and all(not led.releases for led in leds)
    # the coupling planted, 0.2 between most pairs and -0.3 between the first two, within the bound for most
    assert np.mean(np.linalg.norm(every, axis=1) > bound) < 0.2
    assert abs(res["fnc"][0] - np.arctanh(-0.3)) < 0.04 and abs(np.median(res["fnc"]) - np.arctanh(0.2)) < 0.03


def test_the_noise_is_the_calibrated_noise_and_the_stage_spends_fnc_epsilon():
    """Repeated runs: the consortium's mean scatters around the noiseless one with the variance the plan
    announces (chi-square spread over 40 runs x 15 entries), and every equal site spends exactly fnc_epsilon at
    delta / 2."""
    S, lengths = _sites(2, subjects=(30, 30, 30, 30))
    exact = stages.run_inprocess(stages.release("fnc"), _cfg(plan="none"), S, lengths, dim=0, public={})[0]["fnc"]
    draws, announced = [], set()
    for seed in range(40):
        cfg = _cfg(fnc_epsilon=1.5, seed=seed)
        res, leds = stages.run_inprocess(stages.release("fnc"), cfg, S, lengths, dim=0, public={})
        draws.append(res["fnc"] - exact)
        announced.add(round(res["noise_var"], 12))
        for led in leds:
            assert math.isclose(led.epsilon(cfg.pca_delta, collusion=True), 1.5, rel_tol=1e-6)
    assert len(announced) == 1
    ratio = np.var(np.array(draws)) / announced.pop()
    assert 0.8 < ratio < 1.2, ratio  # 600 draws: the ratio's sd is about 0.06


def test_the_planner_predicts_the_stage_ledgers_on_unequal_sites():
    S, lengths = _sites(3, subjects=(12, 30, 7, 20))
    for plan in ("cape", "conv"):
        cfg = _cfg(plan=plan, fnc_epsilon=2.5)
        _, leds = stages.run_inprocess(stages.release("fnc"), cfg, S, lengths, dim=0, public={})
        planned = stages.release("fnc").plan(cfg, [SiteShape(f"s{i}", ln) for i, ln in enumerate(lengths)], 0)
        for run, plan_led in zip(leds, planned):
            assert run.by_stage() == pytest.approx(plan_led.by_stage())
            assert run.by_stage() == pytest.approx({"static-fnc": run.mu_collusion})


def test_one_subject_moves_a_sites_release_by_at_most_the_declared_sensitivity():
    S, lengths = _sites(4)
    base = site_fnc(S[0], lengths[0])
    alg = CapeFNC(FNCSettings(None).scale(P), 1.0)
    spec = alg.site_releases(alg.site_init(0, base))["fnc"]
    rng = np.random.default_rng(5)
    f0 = alg.site_compute(alg.site_init(0, base), 0, None)["fnc"]
    worst = 0.0
    for trial in range(30):
        F = base.copy()
        F[trial % len(F)] = rng.standard_normal(P) * (50 if trial % 2 else 0.2)  # far out, or inside the bound
        worst = max(worst, np.linalg.norm(alg.site_compute(alg.site_init(0, F), 0, None)["fnc"] - f0))
    assert spec.sensitivity == pytest.approx(2 * alg.B / len(base))
    assert 0.5 * spec.sensitivity < worst <= spec.sensitivity + 1e-12
    assert np.linalg.norm(f0) <= spec.bound + 1e-12  # the aggregator's public check holds for honest sites


def test_distinguishing_attack_separates_neighbours_by_at_most_the_ledgers_mu():
    """Neighbouring consortia differ in one subject of site 0 (its FNC replaced by the far side of the bound).
    The aggregator with site 3's draws runs the likelihood-ratio test, 150 protocol runs per world: the
    statistic has unit spread and shifts by the separation the neighbour allows, at most the ledger's mu and,
    for this worst-case neighbour, close to it."""
    S, lengths = _sites(6, subjects=(6, 8, 7, 9), T=60)
    F = [site_fnc(s, ln) for s, ln in zip(S, lengths)]
    B, z = FNCSettings(None).scale(P), 0.8
    alg = CapeFNC(B, z)
    f0 = clip_subjects(F[0], B)[0]
    far = -f0[0] / np.linalg.norm(f0[0]) * B * 10  # clipped onto the bound, opposite the subject it replaces
    F1 = F[0].copy()
    F1[0] = far
    worlds = [F, [F1] + F[1:]]
    diff = {"fnc": (alg.site_compute(alg.site_init(0, F1), 0, None)["fnc"]
                    - alg.site_compute(alg.site_init(0, F[0]), 0, None)["fnc"])}
    check_attack_separation(lambda seed: CapeFNC(B, z, random_state=seed), worlds, diff, at_least=0.8)


def test_fnc_false_has_no_stage_and_no_release():
    cfg = _cfg(fnc=False)
    assert not stages.release("fnc").active(cfg)
    assert "fnc" not in [r.name for r in stages.active_releases(cfg)]
