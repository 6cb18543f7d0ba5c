"""Group statistics as a stage of the run: planner = run, a distinguishing attack, the participants tables (matched,
refused, left out, re-read when edited), and a whole run with planted effects that writes group_effects.tsv and
the report's section."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
from cape_toys import check_attack_separation

import dpneuro
from dpneuro.algorithms.glm import (
    CapeGLM,
    Design,
    GLMSettings,
    detectable,
    network_pairs,
    pack_statistics,
    parse_design,
)
from dpneuro.config import ConfigError, RunConfig, SiteEntry
from dpneuro.data.networks import NOISE_FLAG
from dpneuro.data.participants import CovariateError
from dpneuro.datasets.synth import make_consortium
from dpneuro.run import stages
from dpneuro.run.planner import (
    SiteShape,
    components_supported,
    group_detectable,
    plan_for_target,
    planned_settings,
    stage_mu,
)

R = 4
COVARIATES = {"group": ["control", "patient"], "age": [20, 70], "sex": ["F", "M"]}


def _cfg(**kw) -> RunConfig:
    d = dict(sites=[SiteEntry(f"s{i}", "x") for i in range(4)], out="/tmp/unused", n_components=R, seed=7,
             simulation=True, design="group + age + sex", covariates=COVARIATES)
    d.update(kw)
    return RunConfig(**d)


def _packed(cfg: RunConfig, counts, seed: int = 0):
    """Every site's packed contributions for random subjects (the GLM stage's site inputs)."""
    rng = np.random.default_rng(seed)
    settings = stages.factory.glm_settings(cfg)
    out = []
    for s, m in enumerate(counts):
        vals = [{"group": rng.choice(COVARIATES["group"]), "age": str(rng.uniform(20, 70)),
                 "sex": rng.choice(COVARIATES["sex"])} for _ in range(m)]
        X, _ = settings.design.rows(vals, s)
        out.append(pack_statistics(X, rng.normal(0, 0.1, (m, settings.n_measures)), settings.design,
                                   settings.families)[0])
    return out


def test_the_planner_predicts_the_stage_ledgers_on_unequal_sites():
    counts = (12, 30, 7, 20)
    for plan in ("cape", "conv"):
        cfg = _cfg(plan=plan, glm_epsilon=2.5)
        _, leds = stages.run_inprocess(stages.release("glm"), cfg, _packed(cfg, counts), [[100] * m for m in counts],
                                       dim=0, public={})
        planned = stages.release("glm").plan(cfg, [SiteShape(f"s{i}", (100,) * m) for i, m in enumerate(counts)],
                                                0)
        for run, plan_led in zip(leds, planned):
            assert run.by_stage() == pytest.approx(plan_led.by_stage())
            assert run.by_stage() == pytest.approx({"group-glm": run.mu_collusion})
    equal = _cfg(glm_epsilon=1.5)
    _, leds = stages.run_inprocess(stages.release("glm"), equal, _packed(equal, (20,) * 4), [[100] * 20] * 4, dim=0,
                                   public={})
    for led in leds:  # equal sites spend exactly glm_epsilon at delta / 2
        assert math.isclose(led.epsilon(equal.pca_delta, collusion=True), 1.5, rel_tol=1e-6)


def test_a_total_epsilon_is_split_over_the_group_statistics_too():
    cfg = _cfg(fnc=False, epsilon=None)
    shapes = [SiteShape(f"s{i}", (150,) * 50) for i in range(4)]
    plan = plan_for_target(cfg, shapes, 100, 6.0)
    assert set(planned_settings(plan.config)) == {"pca_epsilon", "glm_epsilon"}
    assert max(plan.epsilon.values()) == pytest.approx(6.0, rel=1e-6)
    assert "group-glm" in next(iter(plan.privacy["sites"].values()))["by_stage_mu"]


def test_the_runs_question_decides_the_split_and_the_plan_says_what_it_can_detect():
    """question "group differences" gives the group statistics three quarters of mu^2 of the same total (the
    rest in the other stages' own ratio; the maps keep half their components here), narrows the standard error
    the plan predicts by up to the ratio of the noise multipliers (less the sampling part), and says what the
    maps lose; "maps" keeps the split of the stages' own settings."""
    shapes = [SiteShape(f"s{i}", (150,) * 100) for i in range(4)]
    plans = {q: plan_for_target(_cfg(epsilon=None, question=q), shapes, 400, 4.0) for q in ("maps", "group differences")}
    mu = {q: stage_mu(p) for q, p in plans.items()}
    for q, p in plans.items():
        assert max(p.epsilon.values()) == pytest.approx(4.0, rel=1e-6)
    share = {q: m["glm"] ** 2 / sum(v**2 for v in m.values()) for q, m in mu.items()}
    assert share["group differences"] == pytest.approx(0.75, abs=1e-6)
    assert share["maps"] < 0.2  # the stages' own settings: glm_epsilon 2 beside pca_epsilon 6
    rest = {q: mu[q]["fnc"] / mu[q]["reduce"] for q in mu}
    assert rest["group differences"] == pytest.approx(rest["maps"], rel=1e-6)
    found = {q: group_detectable(p.config, [100] * 4) for q, p in plans.items()}
    # the noise's part of the standard error scales with the noise multiplier, 1 / mu; the sampling part stays.
    # The maps' split leaves the design unresolved here (its se inf: no finding), the question's resolves it
    assert np.isfinite(found["group differences"][0]["se"])
    at8 = {q: plan_for_target(_cfg(epsilon=None, question=q), shapes, 400, 8.0) for q in plans}
    eight = {q: group_detectable(p.config, [100] * 4)[0] for q, p in at8.items()}
    plan8 = {q: stage_mu(p) for q, p in at8.items()}
    z = plan8["group differences"]["glm"] / plan8["maps"]["glm"]
    ratio = eight["maps"]["se"] / eight["group differences"]["se"]
    assert 0.6 * z < ratio < 1.05 * z
    assert found["group differences"][0]["detectable"] < found["maps"][0]["detectable"]
    assert all(r["pooled"] < r["detectable"] for r in found["group differences"])
    text = str(plans["group differences"])
    assert "question \"group differences\"" in text and "the maps" in text and "80 % power" in text
    with pytest.raises(ConfigError, match="needs a design"):
        _cfg(question="group differences", design="").validate(data_sites=())
    # where three quarters would leave the maps less than half the components they support alone, the share is
    # the largest that keeps half (8 components at eps 2: the maps alone support 4, the question keeps 2)
    tight = {q: plan_for_target(_cfg(epsilon=None, question=q, n_components=8), shapes, 400, 2.0)
             for q in ("maps", "group differences")}
    alone = components_supported(tight["maps"])
    m = stage_mu(tight["group differences"])
    assert m["glm"] ** 2 / sum(v**2 for v in m.values()) < 0.7
    assert components_supported(tight["group differences"]) >= math.ceil(min(alone, 8) / 2)
    assert m["glm"] > stage_mu(tight["maps"])["glm"] * 1.5


def test_distinguishing_attack_separates_neighbours_by_at_most_the_ledgers_mu():
    """Neighbouring consortia differ in one subject of site 0 (its measures flipped to the far side of their
    bound). The aggregator with site 3's draws runs the likelihood-ratio test, 150 protocol runs per world: the
    separation is at most the ledger's mu and, for this neighbour (a patient at the design's largest norm but for
    the site indicator site 0 does not have), more than half of it."""
    design = Design(parse_design("group", {"group": ["control", "patient"]}), ("a", "b", "c", "d"))
    settings = GLMSettings(design, ("amplitude",), 3, 2.0)
    rng = np.random.default_rng(3)
    worlds_xy = []
    for s, m in enumerate((6, 8, 7, 9)):
        X, _ = design.rows([{"group": ["patient", "control"][i % 2]} for i in range(m)], s)
        worlds_xy.append((X, rng.normal(0, 0.1, (m, 3))))
    X0, Y0 = worlds_xy[0]
    Y0 = Y0.copy()
    Y0[0] = [10.0, -10.0, 10.0]
    Y1 = Y0.copy()
    Y1[0] = -Y0[0]
    T0 = pack_statistics(X0, Y0, design, settings.families)[0]
    T1 = pack_statistics(X0, Y1, design, settings.families)[0]
    rest = [pack_statistics(X, Y, design, settings.families)[0] for X, Y in worlds_xy[1:]]
    z = settings.algorithm(n_sites=4).z
    alg = CapeGLM(1.0, z)
    diff = {"glm": alg.site_compute(alg.site_init(0, T1), 0, None)["glm"]
            - alg.site_compute(alg.site_init(0, T0), 0, None)["glm"]}
    check_attack_separation(lambda seed: CapeGLM(1.0, z, random_state=seed), [[T0, *rest], [T1, *rest]], diff,
                            at_least=0.5)


def test_the_design_is_checked_with_the_configuration():
    with pytest.raises(ConfigError, match="'design'.*no entry in covariates"):
        _cfg(design="group + bmi").validate(data_sites=())
    with pytest.raises(ConfigError, match="'glm_measures'"):
        _cfg(glm_measures=["fnc", "alff"]).validate(data_sites=())
    with pytest.raises(ConfigError, match="'design'"):
        _cfg(design="group, age").validate(data_sites=())
    assert not stages.release("glm").active(_cfg(design=""))


@pytest.fixture(scope="module")
def planted(tmp_path_factory):
    """3 sites of unequal size and patient fractions, patients' FNC raised between components 0 and 1."""
    root = tmp_path_factory.mktemp("glm")
    man = make_consortium(root / "data", n_sites=3, subjects_per_site=[14, 10, 16], n_components=R,
                          n_timepoints=100, space="grid30", random_state=5,
                          effects={"patients": [0.3, 0.5, 0.6], "fnc_shift": [[0, 1, 0.6]]})
    return root, man


def _fit(man, out, **kw):
    ica = dpneuro.DecentralizedICA(n_components=R, mask=man["mask"], random_state=1, parcels=0, out=out,
                                   design="group + age + sex", covariates=COVARIATES, **kw)
    return ica.fit({s["site"]: s["path"] for s in man["sites"]})


def test_a_run_with_a_design_writes_the_group_effects_and_the_report_section(planted, tmp_path):
    root, man = planted
    # noise negligible: the measures and the matching tested; at the default pca_epsilon this small consortium's
    # released eigenvalues sit at the noise's edge (every component noise, no finding)
    ica = _fit(man, tmp_path / "run", glm_epsilon=1000.0, pca_epsilon=20.0)
    rows = ica.group_effects_
    assert len(rows) == 3 * (R * (R - 1) // 2 + R)
    assert {r["contrast"] for r in rows} == {"group: patient vs control", "age (per unit)", "sex: M vs F"}
    assert all(r["ci_low"] <= r["estimate"] <= r["ci_high"] for r in rows)
    # q: the FDR over the measures of components above the privacy noise; a noise component's is no finding
    assert all(0 <= r["p"] <= r["q"] <= 1 for r in rows if r["signal"])
    assert all(np.isnan(r["q"]) for r in rows if not r["signal"])
    # the planted FNC difference is found: one edge differs at FDR q < 0.05
    group_fnc = [r for r in rows if r["contrast"].startswith("group") and r["measure"].startswith("fnc")]
    best = max(group_fnc, key=lambda r: abs(r["estimate"] / r["se"]))
    assert best["q"] < 0.05 and best["estimate"] > 0, best  # the shift raised a correlation
    out = Path(ica.output_dir_)
    assert (out / "group_effects.tsv").exists() and (out / "group_effects.json").exists()
    html = (out / "report.html").read_text()
    assert "Group statistics" in html and "group: patient vs control" in html
    # what these intervals can find, next to what they found: detectable() of the run's own standard errors
    record = json.loads((out / "group_effects.json").read_text())
    found_at = record["detectable_80"]["group: patient vs control"]["fnc"]
    se = np.median([r["se"] for r in group_fnc])
    tested = sum(r["signal"] for r in rows if r["contrast"].startswith("group"))
    assert found_at == pytest.approx(detectable(se, tested), rel=1e-6) and "80 % power" in html
    assert record["design_directions_shrunk"] == 0 and record["design_snr"] > 2
    for led in ica.privacy_.ledgers.values():
        assert "group-glm" in led.by_stage()


def test_a_subject_without_covariates_stops_its_site_or_is_left_out(planted, tmp_path):
    root, man = planted
    table = Path(man["sites"][1]["path"]) / "participants.tsv"
    original = table.read_text()
    lines = original.splitlines()
    gone = lines[2].split("\t")[0]
    try:
        table.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
        with pytest.raises(CovariateError, match=f"{gone} \\(not in the participants table\\)"):
            _fit(man, tmp_path / "stop", glm_epsilon=64.0)
        odd = lines[4].split("\t")[0]  # a level the consortium did not agree on
        table.write_text("\n".join(lines[:2] + lines[3:4] + [lines[4].replace("patient", "relative").replace(
            "control", "relative")] + lines[5:]) + "\n")
        with pytest.raises(CovariateError, match=f"{odd} \\(group = 'relative' is not one of the agreed levels"):
            _fit(man, tmp_path / "stop2", glm_epsilon=64.0)
        table.write_text("\n".join(lines[:2] + lines[3:]) + "\n")
        ica = _fit(man, tmp_path / "skip", glm_epsilon=64.0, on_bad_subject="skip")
        counts = json.loads((Path(ica.output_dir_) / "group_effects.json").read_text())["subjects"]
        assert counts == {man["sites"][0]["site"]: 14, man["sites"][1]["site"]: 9, man["sites"][2]["site"]: 16}
    finally:
        table.write_text(original)


def test_an_edited_participants_table_is_read_again_on_a_rerun(planted, tmp_path):
    root, man = planted
    out = tmp_path / "rerun"
    first = {(r["contrast"], r["measure"]): r["estimate"] for r in _fit(man, out, glm_epsilon=64.0).group_effects_}
    table = Path(man["sites"][0]["path"]) / "participants.tsv"
    original = table.read_text()
    try:
        table.write_text(original.replace("\tpatient\t", "\tcontrol\t", 1))
        second = {(r["contrast"], r["measure"]): r["estimate"]
                  for r in _fit(man, out, glm_epsilon=64.0).group_effects_}
    finally:
        table.write_text(original)
    assert first.keys() == second.keys() and first != second


def test_the_brain_states_dynamics_are_measures_too(planted, tmp_path):
    root, man = planted
    with pytest.raises(ConfigError, match="set brain_states"):
        _cfg(glm_measures=["states"]).validate(data_sites=())
    ica = _fit(man, tmp_path / "states", glm_epsilon=64.0, brain_states=2, glm_measures=["amplitude", "states"])
    measures = [r["measure"] for r in ica.group_effects_ if r["contrast"] == "age (per unit)"]
    assert measures == [*(f"amplitude IC{i + 1:02d}" for i in range(R)), "occupancy S1", "occupancy S2", "dwell S1",
                        "dwell S2", "transitions"]
    # each subject's dynamics, as its site wrote them, explain the model's occupancy estimates: the intercept-free
    # contrasts are finite and the occupancies' group effects are opposite (fractions of time sum to 1)
    occ = {r["measure"]: r["estimate"] for r in ica.group_effects_ if r["contrast"].startswith("group")}
    assert np.isfinite(list(occ.values())).all()
    assert occ["occupancy S1"] == pytest.approx(-occ["occupancy S2"], abs=0.35)


def test_network_measures_and_hypotheses_run_on_named_components_and_are_refused_where_none_can_be(planted,
                                                                                                    tmp_path):
    """On a standard space the components are named, every party derives the same networks, and the group
    model tests the network pairs (glm_measures = ["networks"]) or only the listed hypotheses, each with its own
    bound; a hypothesis of networks the run has no components for is reported as not measured and is no finding.
    On a toy grid the atlas names nothing: the run refuses before any release."""
    man = make_consortium(tmp_path / "data", n_sites=3, subjects_per_site=[14, 10, 16], n_components=6,
                          n_timepoints=100, space="mni6mm", model="networks", random_state=5,
                          effects={"patients": [0.3, 0.5, 0.6]})
    sites = {s["site"]: s["path"] for s in man["sites"]}
    kw = dict(n_components=6, mask=man["mask"], random_state=1, design="group",
              covariates={"group": ["control", "patient"]}, glm_epsilon=1000.0, pca_epsilon=20.0)
    ica = dpneuro.DecentralizedICA(out=tmp_path / "all", glm_measures=["networks"], **kw).fit(sites)
    table = [line.split("\t") for line in (Path(ica.output_dir_) / "components.tsv").read_text().splitlines()]
    head = table[0]
    nets = tuple("noise" if float(row[head.index("noise_fraction")]) > NOISE_FLAG else row[head.index("network")]
                 for row in table[1:])  # the atlas's names; a map mostly outside grey matter in no network
    expected = [name for name, _ in network_pairs(nets)]
    assert expected and [r["measure"] for r in ica.group_effects_] == expected
    present = expected[0]
    ica2 = dpneuro.DecentralizedICA(out=tmp_path / "hyp", glm_hypotheses=[present, "networks Limbic-Cerebellum"],
                                    **kw).fit(sites)
    rows = {r["measure"]: r for r in ica2.group_effects_}
    assert list(rows) == [present, "networks Limbic-Cerebellum"]
    record = json.loads((Path(ica2.output_dir_) / "group_effects.json").read_text())
    if "Limbic" in nets and "Cerebellum" in nets:
        pytest.skip("the run named both networks")  # the generator's seed decides; 5 names neither
    assert record["not_measured"] == ["networks Limbic-Cerebellum"]
    assert not rows["networks Limbic-Cerebellum"]["signal"] and np.isnan(rows["networks Limbic-Cerebellum"]["q"])
    assert rows[present]["signal"] and rows[present]["q"] == pytest.approx(rows[present]["p"])  # a family of one
    root, grid = planted
    with pytest.raises(ConfigError, match="atlas covers"):
        _fit(grid, tmp_path / "grid", glm_measures=["networks"])
    assert not (tmp_path / "grid" / "work").exists() or not any((tmp_path / "grid").rglob("*.npy"))
