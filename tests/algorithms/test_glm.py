"""The private group GLM on arrays: the design's encoding and bounds, the packed statistics, OLS without noise, and
intervals and tests that hold their levels under the privacy noise (repeated draws, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest
from scipy import stats

from dpneuro.algorithms.glm import (
    FAMILY_RMS,
    CapeGLM,
    Design,
    GLMSettings,
    bh_power,
    contrast_errors,
    family_bounds,
    fit_glm,
    kind,
    measure_names,
    network_pairs,
    normal_hypothesis,
    pack_statistics,
    parse_design,
    subject_measures,
    unpack_statistics,
)

COVARIATES = {"group": ["control", "patient"], "age": [20, 70], "sex": ["F", "M"]}
R = 5  # 10 edges and 5 amplitudes
DESIGN = Design(parse_design("group + age + sex", COVARIATES), ("a", "b", "c", "d"))


def _consortium(rng, *, M=(100, 100, 100, 100), group=0.0, age=0.0, sd=0.1):
    """Every site's (X, Y) with a group effect on the first 3 measures and an age slope (per year) on the last;
    patient fractions 0.3 to 0.6, site offsets. Returns the sites and the true coefficients (contrast x measure)."""
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, None, plan="none")
    Q = settings.n_measures
    truth = np.zeros((3, Q))
    truth[0, :3], truth[1, -1] = group, age
    sites = []  # measures within their public bounds: clipping would bias the truth they are scored against
    for s, m in enumerate(M):
        g = rng.random(m) < 0.3 + 0.1 * s
        years = rng.uniform(20, 70, m)
        sex = rng.random(m) < 0.5
        X, _ = DESIGN.rows([{"group": COVARIATES["group"][int(gi)], "age": f"{a:.1f}", "sex": "FM"[int(x)]}
                            for gi, a, x in zip(g, years, sex)], s)
        Y = (0.02 * s + g[:, None] * truth[0] + (np.round(years, 1)[:, None] - 45) * truth[1]
             + rng.normal(0, sd, (m, Q)))
        sites.append((X, Y))
    return sites, truth


def test_the_design_encodes_levels_ranges_and_sites_and_refuses_what_it_cannot():
    assert DESIGN.columns == ("group[patient]", "age", "sex[M]", "site[a]", "site[b]", "site[c]", "site[d]")
    X, clipped = DESIGN.rows([{"group": "patient", "age": "45", "sex": "F"},
                              {"group": "control", "age": "95", "sex": "M"}], 2)
    np.testing.assert_array_equal(X, [[1, 0, -1, 0, 0, 1, 0], [-1, 1, 1, 0, 0, 1, 0]])  # age 95 clipped to 70
    assert clipped == 1
    assert DESIGN.contrasts()[0][2] == 2.0  # a level's +-1 column spans 2 from the reference to the level
    assert [lab for lab, _, _ in DESIGN.contrasts()] == ["group: patient vs control", "age (per unit)",
                                                          "sex: M vs F"]
    assert DESIGN.contrasts()[1][2] == pytest.approx(2 / 50)  # per year: the column spans 50 years over [-1, 1]
    with pytest.raises(ValueError, match="not one of the agreed levels"):
        DESIGN.rows([{"group": "unknown", "age": "40", "sex": "F"}], 0)
    for design, covs, match in (("group + site", COVARIATES, "always in the model"),
                                ("group + bmi", COVARIATES, "no entry in covariates"),
                                ("age", {"age": [70, 20]}, "neither"), ("group + group", COVARIATES, "twice"),
                                ("", COVARIATES, "names no covariate")):
        with pytest.raises(ValueError, match=match):
            parse_design(design, covs)


def test_every_subjects_contribution_has_norm_at_most_one_and_the_bound_is_reached():
    """The sensitivity argument: whatever a subject's covariates and measures, its packed row has L2 norm <= 1;
    a subject at the corners of the design with measures far out comes close to 1."""
    rng = np.random.default_rng(0)
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, None, plan="none")
    worst = 0.0
    for trial in range(200):
        m = 20
        vals = [{"group": rng.choice(COVARIATES["group"]), "age": str(rng.uniform(-50, 200)),
                 "sex": rng.choice(COVARIATES["sex"])} for _ in range(m)]
        X, _ = DESIGN.rows(vals, int(rng.integers(4)))
        Y = rng.standard_normal((m, settings.n_measures)) * (100 if trial % 2 else 0.1)
        T, _ = pack_statistics(X, Y, DESIGN, settings.families)
        worst = max(worst, np.linalg.norm(T, axis=1).max())
    assert 0.85 < worst <= 1.0 + 1e-12


def test_unpacking_the_mean_contribution_gives_the_pooled_statistics():
    rng = np.random.default_rng(1)
    sites, _ = _consortium(rng, M=(30, 20, 25, 35))
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, None, plan="none")
    packed = [pack_statistics(X, Y, DESIGN, settings.families)[0] for X, Y in sites]
    n = [len(X) for X, _ in sites]
    st = unpack_statistics(np.vstack(packed).mean(axis=0), n, 0.0, DESIGN, settings.families)
    X, Y = np.vstack([x for x, _ in sites]), np.vstack([y for _, y in sites])
    x, h = X[:, :3], X[:, 3:]
    np.testing.assert_allclose(st["XX"], x.T @ x, atol=1e-9)  # the levels' diagonal is the public count
    np.testing.assert_allclose(st["Sx"], h.T @ x, atol=1e-9)
    np.testing.assert_allclose(st["Sy"], h.T @ Y, atol=1e-9)  # these measures lie within their bounds
    np.testing.assert_allclose(st["XY"], x.T @ Y, atol=1e-9)
    np.testing.assert_allclose(st["YY"], [(Y[:, sl] ** 2).sum() for sl in settings.families.values()], atol=1e-9)
    assert set(st["sd"].values()) == {0.0} and st["n"] == sum(n)


def test_without_noise_the_fit_is_ordinary_least_squares():
    rng = np.random.default_rng(2)
    sites, _ = _consortium(rng, group=0.1, age=0.004)
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, None, plan="none", random_state=0)
    out = settings.run(sites)
    X, Y = np.vstack([x for x, _ in sites]), np.vstack([y for _, y in sites])
    beta, rss, *_ = np.linalg.lstsq(X, Y, rcond=None)  # the covariates and an intercept per site
    cols, unit = [0, 1, 2], np.array([2.0, 2 / 50, 2.0])[:, None]
    np.testing.assert_allclose(out["estimate"], beta[cols] * unit, atol=1e-10)
    # the standard error is OLS's with each family's residual variance pooled over its measures, and no noise
    df = len(X) - X.shape[1]
    sigma2 = np.concatenate([np.full(sl.stop - sl.start, rss[sl].sum() / (df * (sl.stop - sl.start)))
                             for sl in settings.families.values()])
    se = np.sqrt(np.outer(np.diag(np.linalg.inv(X.T @ X))[cols], sigma2)) * unit
    np.testing.assert_allclose(out["se"], se, rtol=1e-8)
    assert np.all(out["noise_sd"] == 0) and all(not led.releases for led in out["ledgers"])


@pytest.mark.parametrize("epsilon", [2.0, 8.0])
def test_intervals_cover_the_truth_and_tests_hold_their_level_under_the_privacy_noise(epsilon):
    """60 private fits of 4 x 100 subjects (unequal patient fractions): the 95 % intervals cover the true
    coefficients at 0.90 to 0.999 of all 45 contrast x measure pairs (2,700 intervals: a binomial sd of 0.004 at
    0.95), the nominal 5 % test rejects at most 8 % of the null pairs (and some), and within each contrast (BH's
    family) the q-values' false discovery proportion averages at most 5 % (plus the margin of 180 families)."""
    rng = np.random.default_rng(int(epsilon))
    covered, rejected, false_disc = [], [], []
    for rep in range(60):
        sites, truth = _consortium(rng, group=0.3, age=0.005)
        out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, epsilon, random_state=rep).run(sites)
        covered.append((out["ci_low"] <= truth) & (truth <= out["ci_high"]))
        rejected.append(out["p"][truth == 0] < 0.05)
        disc = out["q"] < 0.05  # BH's family: one contrast's measures
        false_disc += [(d & (t == 0)).sum() / max(d.sum(), 1) for d, t in zip(disc, truth)]
    coverage = np.mean(covered)
    assert 0.90 <= coverage <= 0.999, coverage
    assert 0.002 <= np.mean(rejected) <= 0.08, np.mean(rejected)
    assert np.mean(false_disc) <= 0.05 + 0.03, np.mean(false_disc)  # 180 families: a margin of about 2 sd


def test_the_noise_widens_the_intervals_as_epsilon_falls_and_the_planted_effects_are_found():
    rng = np.random.default_rng(5)
    sites, truth = _consortium(rng, group=0.3, age=0.005)
    width = {}
    for eps in (None, 1.0, 8.0, 64.0):
        out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, eps, plan="none" if eps is None else "cape",
                          random_state=3).run(sites)
        width[eps] = float(np.mean(out["ci_high"] - out["ci_low"]))
        if eps in (None, 64.0):
            assert np.all(out["q"][0, :3] < 0.05) and out["q"][1, -1] < 0.05  # the planted effects
        if eps != 1.0:  # the within-site design is resolved: nothing shrunk
            assert out["floored"] == 0
        assert np.mean(out["q"][truth == 0] < 0.05) < 0.1
    assert width[None] < width[64.0] < width[8.0] < width[1.0]


def test_estimates_are_unbiased_and_the_noise_narrows_with_the_budget_as_its_multiplier_does():
    """40 private fits per budget of 4 x 100 subjects (patient fractions 0.3 to 0.6): the mean ratio of the
    estimate to the truth on the planted group effects (0.3 on 3 measures) is 1 within 0.1 (its sd over 120
    estimates is about 0.03 at eps 4), the noise sd the fit reports matches the estimates' spread over the noise
    draws within 15 %, and it scales with the release's noise multiplier (eps 2 against 4: z ratio 1.84)."""
    rng = np.random.default_rng(11)
    sites, truth = _consortium(rng, group=0.3, age=0.005)
    noise = {}
    for eps in (2.0, 4.0):
        est, reported = [], []
        for rep in range(40):
            out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, eps, random_state=100 + rep).run(sites)
            est.append(out["estimate"])
            reported.append(out["noise_sd"])
        est, reported = np.array(est), np.array(reported)
        if eps == 4.0:
            assert abs(np.mean(est[:, 0, :3] / truth[0, :3]) - 1) < 0.1
        spread = est.std(axis=0, ddof=1)
        assert 0.85 < np.median(spread / reported.mean(axis=0)) < 1.15
        noise[eps] = np.median(reported.mean(axis=0)[0])
    z = {e: GLMSettings(DESIGN, ("fnc", "amplitude"), R, e).algorithm(n_sites=4).z for e in (2.0, 4.0)}
    assert noise[2.0] / noise[4.0] == pytest.approx(z[2.0] / z[4.0], rel=0.1)


def test_the_power_predicted_from_public_quantities_is_the_power_measured():
    """At eps 3 (4 x 100 subjects, patient fractions 0.3 to 0.6, residual sd 0.1 per measure, the sites' offsets
    given) the power
    :func:`bh_power` predicts from :func:`contrast_errors` (counts, the plan's noise, the stated residual sd and
    fractions) is within 0.12 of the fraction of 3 planted group effects found at q < 0.05 over 40 fits, at three
    effect sizes (120 trials each: a binomial sd of at most 0.046)."""
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, 3.0)
    z = settings.algorithm(n_sites=4).z
    fractions = [{"group": 0.3 + 0.1 * s, "sex": 0.5} for s in range(4)]
    for effect in (0.15, 0.25, 0.35):
        se = contrast_errors(settings, [100] * 4, noise_sd=2 * z, residual_sd={"fnc": 0.1, "amplitude": 0.1},
                             fractions=fractions, effect=effect, site_sd=0.022)[0, 0]  # offsets 0, .02, .04, .06
        predicted = bh_power(effect, se, settings.families["fnc"].stop, n_effects=3)
        rng = np.random.default_rng(int(effect * 100))
        found = []
        for rep in range(40):
            sites, _ = _consortium(rng, group=effect, age=0.0)
            out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, 3.0, random_state=rep).run(sites)
            q = stats.false_discovery_control(out["p"][0, settings.families["fnc"]], method="bh")
            found += list(q[:3] < 0.05)
        assert abs(np.mean(found) - predicted) < 0.12, (effect, np.mean(found), predicted)


def test_one_subject_moves_a_sites_release_by_at_most_the_declared_sensitivity():
    rng = np.random.default_rng(6)
    sites, _ = _consortium(rng, M=(40, 30, 30, 30))
    settings = GLMSettings(DESIGN, ("fnc", "amplitude"), R, 2.0)
    X, Y = sites[0]
    alg = settings.algorithm(n_sites=4)
    T0, _ = pack_statistics(X, Y, DESIGN, settings.families)
    state = alg.site_init(0, T0)
    spec, f0 = alg.site_releases(state)["glm"], alg.site_compute(state, 0, None)["glm"]
    def release(X1, Y1):
        return alg.site_compute(alg.site_init(0, pack_statistics(X1, Y1, DESIGN, settings.families)[0]), 0, None)

    worst, far = 0.0, 0.0
    for trial in range(40):
        X1, Y1 = X.copy(), Y.copy()
        i = trial % len(X)
        X1[i] = [(-1) ** (trial % 3), (-1) ** trial * (trial % 5) / 4, -(-1) ** (trial % 3), 1, 0, 0, 0]
        Y1[i] = rng.standard_normal(Y.shape[1]) * (30 if trial % 2 else 0.1)
        worst = max(worst, np.linalg.norm(release(X1, Y1)["glm"] - f0))
        X2, Y2 = X1.copy(), Y1.copy()  # its neighbour: the same person's measures far on the other side
        Y1[i], Y2[i] = 30 * Y1[i], -30 * Y1[i]
        far = max(far, np.linalg.norm(release(X1, Y1)["glm"] - release(X2, Y2)["glm"]))
    assert spec.sensitivity == pytest.approx(2 / len(X)) and isinstance(alg, CapeGLM)
    assert worst <= spec.sensitivity + 1e-12 and 0.5 * spec.sensitivity < far <= spec.sensitivity + 1e-12


def test_subject_measures_are_each_subjects_fnc_and_relative_amplitudes():
    rng = np.random.default_rng(7)
    S = rng.standard_normal((R, 300)) * np.array([1, 2, 1, 1, 0.5])[:, None]
    Y, names, families = subject_measures(S, [100, 200], ("fnc", "amplitude"))
    assert names == measure_names(("fnc", "amplitude"), R) and names[0] == "fnc IC01-IC02"
    assert Y.shape == (2, 15) and families == {"fnc": slice(0, 10), "amplitude": slice(10, 15)}
    sd = S[:, 100:].std(axis=1)
    np.testing.assert_allclose(Y[1, 10:], np.log(sd / np.sqrt(np.mean(sd**2))), atol=1e-12)
    np.testing.assert_allclose(Y[0, :10], np.arctanh(np.corrcoef(S[:, :100])[np.triu_indices(R, 1)]), atol=1e-12)
    centred, _, _ = subject_measures(S, [100, 200], ("fnc",), fnc_centre=np.full(10, 0.1))
    np.testing.assert_allclose(centred, Y[:, :10] - 0.1, atol=1e-12)


def test_fit_refuses_a_model_with_as_many_coefficients_as_subjects():
    st = {"counts": np.array([2.0, 2.0, 2.0, 2.0]), "XY": np.zeros((3, 2)), "n": 8.0}
    with pytest.raises(ValueError, match="cannot fit 7 coefficients"):
        fit_glm(st, DESIGN)


def test_the_states_measures_are_fractions_of_each_subjects_windows():
    rng = np.random.default_rng(8)
    S = rng.standard_normal((3, 200))
    dyn = {"occupancy": np.array([[0.25, 0.75], [0.5, 0.5]]), "dwell_windows": np.array([[5.0, 15.0], [10.0, 0.0]]),
           "transitions": np.array([3, 9]), "n_windows": np.array([40, 20])}
    Y, names, families = subject_measures(S, [100, 100], ("states",), dynamics=dyn)
    assert names == ["occupancy S1", "occupancy S2", "dwell S1", "dwell S2", "transitions"]
    np.testing.assert_allclose(Y, [[-0.25, 0.25, 5 / 40, 15 / 40, 3 / 39], [0.0, 0.0, 10 / 20, 0.0, 9 / 19]])
    assert families == {"states": slice(0, 5)}
    with pytest.raises(ValueError, match="dynamics"):
        subject_measures(S, [100, 100], ("states",))


def test_network_measures_average_the_centred_edges_between_named_networks_and_hypotheses_select_them():
    """The "networks" family: per pair of atlas networks the mean of the subject's centred edges between their
    components (within a network of two or more; noise and "Other" components in none), named in the atlas's
    order; a hypothesis list releases exactly its measures, a pair without components as 0 and said."""
    rng = np.random.default_rng(3)
    R, lengths = 5, [60, 70]
    S = rng.standard_normal((R, sum(lengths)))
    nets = ("Default", "Vis", "Default", "noise", "Other")
    pairs = network_pairs(nets)
    assert [name for name, _ in pairs] == ["networks Vis-Default", "networks Default-Default"]
    assert pairs[0][1] == [(0, 1), (1, 2)] and pairs[1][1] == [(0, 2)]
    centre = rng.normal(0, 0.1, R * (R - 1) // 2)
    Y, names, fam = subject_measures(S, lengths, ("fnc", "networks"), centre, networks=nets)
    edges = Y[:, fam["fnc"]]
    iu = {(int(i), int(j)): k for k, (i, j) in enumerate(zip(*np.triu_indices(R, 1)))}
    np.testing.assert_allclose(Y[:, fam["networks"]][:, 0], edges[:, [iu[0, 1], iu[1, 2]]].mean(axis=1))
    np.testing.assert_allclose(Y[:, fam["networks"]][:, 1], edges[:, iu[0, 2]])
    assert names[fam["networks"].start:] == ["networks Vis-Default", "networks Default-Default"]
    settings = GLMSettings(DESIGN, ("fnc",), R, 2.0, networks=nets,
                           hypotheses=(normal_hypothesis("networks Default-Vis"),
                                       normal_hypothesis("networks Limbic-Cont"), "fnc IC01-IC03"))
    assert settings.computed == ("networks", "fnc") and settings.n_measures == 3
    assert list(settings.families) == ["networks Vis-Default", "networks Limbic-Cont", "fnc IC01-IC03"]
    Y2, names2, _ = subject_measures(S, lengths, settings.computed, centre, networks=nets)
    sel, absent = settings.select(Y2, names2)
    assert absent == ["networks Limbic-Cont"] and np.all(sel[:, 1] == 0)
    np.testing.assert_allclose(sel[:, 0], Y[:, fam["networks"]][:, 0])
    np.testing.assert_allclose(sel[:, 2], edges[:, iu[0, 2]])
    # each hypothesis is a family of its own: its own bound, the single measure's
    bounds = family_bounds(settings.families)
    assert all(b == pytest.approx(FAMILY_RMS[kind(n)]) for n, b in bounds.items())


def test_a_design_the_budget_cannot_resolve_reports_no_finding():
    """4 sites of 9 subjects at eps 2: the noise on the within-site X'X exceeds twice its weakest directions, so
    those are held (shrunk, counted) and every contrast that loads on them has q NaN (no finding), whatever the
    p-values; 100 subjects per site at eps 8 resolve the same design."""
    rng = np.random.default_rng(8)
    small, _ = _consortium(rng, M=(9, 9, 9, 9), group=0.3)
    out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, 2.0, random_state=1).run(small)
    assert out["floored"] >= 1 and out["design_snr"] < 2 and out["unresolved"].any()
    assert np.all(np.isnan(out["q"][out["unresolved"]])) and np.all(np.isfinite(out["p"]))
    big, _ = _consortium(rng, group=0.3)
    out = GLMSettings(DESIGN, ("fnc", "amplitude"), R, 8.0, random_state=1).run(big)
    assert out["floored"] == 0 and not out["unresolved"].any() and np.all(np.isfinite(out["q"]))
