"""Tests for the planted group effects of dpneuro.datasets.synth (make_consortium's ``effects``)."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np
import pytest

from dpneuro.data.load import load_site
from dpneuro.datasets.synth import load_manifest, make_consortium, network_model

KW = dict(n_sites=2, subjects_per_site=[2, 3], n_components=4, n_timepoints=40, space="grid30", random_state=5)


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def read_tsv(path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def sources(man) -> tuple[list[np.ndarray], list[dict]]:
    """Every subject's written ground-truth sources S (R x T) and its covariates, in manifest order."""
    S = [np.load(sub["sources"]).astype(np.float64) for site in man["sites"] for sub in site["subjects"]]
    return S, man["effects"]["subjects"]


def fisher_z(S: np.ndarray, j: int, k: int) -> float:
    return float(np.arctanh(np.corrcoef(S[j], S[k])[0, 1]))


def group_difference(values, patient) -> tuple[float, float]:
    """Patients' mean minus controls' and its standard error (Welch)."""
    a, b = np.asarray(values)[patient], np.asarray(values)[~patient]
    return a.mean() - b.mean(), float(np.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size))


def ols(y, *columns) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares coefficients of y on [1, columns...] and their standard errors."""
    X = np.column_stack([np.ones(len(y)), *columns])
    beta, *_ = np.linalg.lstsq(X, y, rcond=None)
    resid = y - X @ beta
    sigma2 = resid @ resid / (len(y) - X.shape[1])
    return beta, np.sqrt(np.diag(sigma2 * np.linalg.inv(X.T @ X)))


# ---------------------------------------------------------------------------
# (a) off by default: nothing changes
# ---------------------------------------------------------------------------

def test_default_call_unchanged(tmp_path):
    omitted = make_consortium(tmp_path / "a", **KW)
    none = make_consortium(tmp_path / "b", **KW, effects=None)
    assert files(tmp_path / "a") == files(tmp_path / "b")  # every file, manifest.json included
    assert "effects" not in omitted and "effects" not in none
    assert "effects" not in json.loads((tmp_path / "a" / "manifest.json").read_text())
    assert not list((tmp_path / "a").rglob("participants.tsv"))

    # an effects run into the same folder, then a default one: its participants.tsv files are removed
    make_consortium(tmp_path / "b", **KW, effects={"amplitude_group": [[1, 0.5]]})
    assert len(list((tmp_path / "b").rglob("participants.tsv"))) == KW["n_sites"]
    make_consortium(tmp_path / "b", **KW)
    assert files(tmp_path / "a") == files(tmp_path / "b")


def test_effects_change_no_draw_and_only_who_carries_them(tmp_path):
    base = make_consortium(tmp_path / "a", **KW)
    # covariates alone: every BOLD and source file as without effects
    plain = make_consortium(tmp_path / "b", **KW, effects={})
    for s0, s1 in zip(base["sites"], plain["sites"]):
        for a, b in zip(s0["subjects"], s1["subjects"]):
            assert Path(a["path"]).read_bytes() == Path(b["path"]).read_bytes()
            assert Path(a["sources"]).read_bytes() == Path(b["sources"]).read_bytes()
    # group effects: controls exactly as without effects, patients' untouched sources too
    man = make_consortium(tmp_path / "c", **KW, effects={"fnc_shift": [[0, 2, 0.3]], "amplitude_group": [[3, 0.4]]})
    S0, _ = sources(plain)
    S1, covs = sources(man)
    for a, b, cov in zip(S0, S1, covs):
        if cov["group"] == "control":
            np.testing.assert_array_equal(a, b)
        else:
            np.testing.assert_array_equal(a[[0, 1]], b[[0, 1]])
            assert not np.allclose(a[2], b[2]) and not np.allclose(a[3], b[3])
            np.testing.assert_allclose(b[3], np.exp(0.4) * a[3], rtol=1e-6)  # amplitude only
            # the documented construction: s_2 <- 0.3 s_0 + sqrt(1 - 0.3^2) s_2, re-standardised
            mixed = 0.3 * a[0] + np.sqrt(1 - 0.3 ** 2) * a[2]
            np.testing.assert_allclose(b[2], (mixed - mixed.mean()) / mixed.std(), rtol=1e-5, atol=1e-5)


def test_networks_effects_change_only_the_correlation_and_amplitudes():
    net = network_model("grid30", 4, random_state=3)
    X0, S0 = net.subject(1, 2, 60)
    la = np.array([0.0, 0.5, 0.0, -0.2])
    X1, S1 = net.subject(1, 2, 60, log_amplitude=la)
    np.testing.assert_allclose(S1, np.exp(la)[:, None] * S0, rtol=1e-6)
    np.testing.assert_allclose(X1 - X0, net.A @ (S1 - S0), atol=1e-5)  # the same draws: only A S changes
    shift = np.zeros((4, 4))
    shift[0, 1] = shift[1, 0] = 0.3
    _, S2 = net.subject(1, 2, 60, correlation_shift=shift)
    np.testing.assert_allclose(S2.std(axis=1), S0.std(axis=1), rtol=1e-5)  # the amplitudes are kept
    assert not np.allclose(S2, S0)
    with pytest.raises(ValueError, match="not positive definite"):
        net.subject(1, 2, 60, correlation_shift=3 * shift)
    np.testing.assert_array_equal(net.subject_correlation(1, 2), net.subject_correlation(1, 2))
    assert np.all(np.linalg.eigvalsh(net.subject_correlation(1, 2)) > 0)


# ---------------------------------------------------------------------------
# (b) participants.tsv
# ---------------------------------------------------------------------------

def test_participants_tsv_ids_groups_and_manifest(tmp_path):
    counts, fractions = [4, 5, 3], [0.5, 0.4, 1 / 3]
    man = make_consortium(tmp_path / "a", n_sites=3, subjects_per_site=counts, n_components=3, n_timepoints=30,
                          space="grid30", random_state=2, effects={"patients": fractions, "age": [30, 40]})
    eff = man["effects"]
    assert eff["settings"]["patients"] == fractions and eff["settings"]["age"] == [30.0, 40.0]
    assert eff["n_patients"] == [2, 2, 1]
    for site, n, frac in zip(man["sites"], counts, fractions):
        path = Path(site["path"]) / "participants.tsv"
        assert eff["participants"][site["site"]] == str(path)
        header = path.read_text().splitlines()[0]
        assert header.split("\t") == ["participant_id", "group", "age", "sex"]
        rows = read_tsv(path)
        # the ids are those the loader reports for this folder, in its order
        assert [r["participant_id"] for r in rows] == load_site(site["path"], man["mask"]).subject_ids
        assert sum(r["group"] == "patient" for r in rows) == round(frac * n)
        assert {r["group"] for r in rows} <= {"patient", "control"} and {r["sex"] for r in rows} <= {"F", "M"}
        for r in rows:
            assert 30.0 <= float(r["age"]) <= 40.0 and r["age"] == f"{float(r['age']):.1f}"
        listed = [s for s in eff["subjects"] if s["site"] == site["site"]]
        assert [(s["id"], s["group"], f"{s['age']:.1f}", s["sex"]) for s in listed] == \
            [(r["participant_id"], r["group"], r["age"], r["sex"]) for r in rows]

    # load_manifest resolves the tables; the same seed gives the same tables, another seed others
    assert load_manifest(tmp_path / "a")["effects"]["participants"] == eff["participants"]
    again = make_consortium(tmp_path / "b", n_sites=3, subjects_per_site=counts, n_components=3, n_timepoints=30,
                            space="grid30", random_state=2, effects={"patients": fractions, "age": [30, 40]})
    assert again["effects"]["subjects"] == eff["subjects"]
    other = make_consortium(tmp_path / "c", n_sites=3, subjects_per_site=counts, n_components=3, n_timepoints=30,
                            space="grid30", random_state=3, effects={"patients": fractions, "age": [30, 40]})
    assert other["effects"]["subjects"] != eff["subjects"]
    assert other["effects"]["n_patients"] == [2, 2, 1]


# ---------------------------------------------------------------------------
# (c) the planted connectivity difference
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("model", ["blobs", "networks"])
def test_fnc_shift_shows_up_between_groups(tmp_path, model):
    # 2 sites x 40 subjects, half patients: 40 per group
    man = make_consortium(tmp_path, n_sites=2, subjects_per_site=40, n_components=4, n_timepoints=100,
                          space="grid30", random_state=8, model=model, workers=2,
                          effects={"fnc_shift": [[0, 1, 0.4]]})
    truth = man["effects"]["fnc_shift"][0]
    assert truth["components"] == [0, 1] and truth["correlation_difference"] == 0.4
    if model == "blobs":  # independent sources: from 0 to 0.4, Fisher z by atanh(0.4)
        assert truth["control_correlation"] == 0.0
        assert truth["fisher_z_difference"] == pytest.approx(np.arctanh(0.4), abs=1e-12)
    S, covs = sources(man)
    patient = np.array([c["group"] == "patient" for c in covs])
    assert patient.sum() == 40
    # the shifted pair: mean Fisher z differs by the planted amount, within 4 standard errors
    diff, se = group_difference([fisher_z(s, 0, 1) for s in S], patient)
    assert abs(diff - truth["fisher_z_difference"]) < 4 * se, (diff, se, truth)
    assert diff > 4 * se  # and it is detectable at this sample size (the test has power)
    # a pair without a shift: no difference
    diff, se = group_difference([fisher_z(s, 2, 3) for s in S], patient)
    assert abs(diff) < 4 * se, (diff, se)


# ---------------------------------------------------------------------------
# (d) amplitude effects
# ---------------------------------------------------------------------------

def test_amplitude_age_and_group_recovered_from_the_sources(tmp_path):
    # networks: every subject has its own amplitude (lognormal sd 0.3), so the regression is a statistical test
    man = make_consortium(tmp_path, n_sites=3, subjects_per_site=20, n_components=4, n_timepoints=80,
                          space="grid30", random_state=4, model="networks", workers=2,
                          effects={"age": [20, 80], "amplitude_age": [[1, 1.0]], "amplitude_group": [[2, -0.5]]})
    eff = man["effects"]
    per_year = eff["amplitude_age"][0]["log_amplitude_per_year"]
    assert per_year == pytest.approx(1.0 / 30.0)
    assert eff["amplitude_age"][0]["age_centre"] == 50.0
    S, covs = sources(man)
    age = np.array([c["age"] for c in covs])
    patient = np.array([c["group"] == "patient" for c in covs], float)
    log_sd = np.log(np.array([s.std(axis=1) for s in S]))  # subjects x R
    for k, want_age, want_group in [(1, per_year, 0.0), (2, 0.0, -0.5), (0, 0.0, 0.0)]:
        (_, b_age, b_group), (_, se_age, se_group) = ols(log_sd[:, k], age, patient)
        assert abs(b_age - want_age) < 4 * se_age, (k, b_age, se_age)
        assert abs(b_group - want_group) < 4 * se_group, (k, b_group, se_group)
    # power: the planted slope is many standard errors from 0
    (_, b_age, _), (_, se_age, _) = ols(log_sd[:, 1], age, patient)
    assert b_age > 4 * se_age


def test_amplitude_age_reaches_the_voxels(tmp_path):
    # blobs: unit-variance sources, so the data projected on the truth maps give the amplitudes back up to the
    # white noise, whose variance there, noise^2 [(A^T A)^-1]_kk, is removed
    man = make_consortium(tmp_path, n_sites=2, subjects_per_site=15, n_components=4, n_timepoints=120,
                          space="grid30", random_state=6, workers=2, effects={"amplitude_age": [[0, 0.6]]})
    A = np.load(man["truth"]["A"]).astype(np.float64)
    noise_var = man["noise"] ** 2 * np.diag(np.linalg.inv(A.T @ A))
    log_sd = []
    for site in man["sites"]:
        data = load_site(site["path"], man["mask"], standardize=False)
        for a, b in data.boundaries:
            S_hat = np.linalg.lstsq(A, np.asarray(data.X[:, a:b], np.float64), rcond=None)[0]
            log_sd.append(0.5 * np.log(S_hat.var(axis=1) - noise_var))
    log_sd = np.array(log_sd)
    age = np.array([c["age"] for c in man["effects"]["subjects"]])
    per_year = man["effects"]["amplitude_age"][0]["log_amplitude_per_year"]
    (_, b0), (_, se0) = ols(log_sd[:, 0], age)
    assert abs(b0 - per_year) < 4 * se0 and b0 > 4 * se0, (b0, se0, per_year)
    (_, b1), (_, se1) = ols(log_sd[:, 1], age)
    assert abs(b1) < 4 * se1, (b1, se1)


# ---------------------------------------------------------------------------
# bad settings are refused before anything is written
# ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(effects=[0.5]), "effects must be a dict"),
        (dict(effects={"patient": 0.5}), "unknown effects key"),
        (dict(effects={"patients": [0.5]}), "lists 1 sites"),
        (dict(effects={"patients": 1.5}), "fractions in"),
        (dict(effects={"age": [70, 20]}), "lo < hi"),
        (dict(effects={"age": 40}), "lo < hi"),
        (dict(effects={"sex": 2}), "probability"),
        (dict(effects={"fnc_shift": [[0, 4, 0.2]]}), "< n_components"),
        (dict(effects={"fnc_shift": [[1, 1, 0.2]]}), "two different components"),
        (dict(effects={"fnc_shift": [[0, 1, 0.2], [1, 0, 0.1]]}), "each pair once"),
        (dict(effects={"fnc_shift": [[0, 1, 1.0]]}), "-1 < delta < 1"),
        (dict(effects={"fnc_shift": [[0, 1, 0.8], [0, 2, 0.8]]}), "not positive definite"),
        (dict(effects={"fnc_shift": [0, 1, 0.2]}), "3-element lists"),
        (dict(effects={"amplitude_age": [[0, 0.1], [0, 0.2]]}), "twice"),
        (dict(effects={"amplitude_group": [[-1, 0.1]]}), "must be >= 0"),
        (dict(effects={}, states=2), "not available with brain states"),
    ],
)
def test_bad_effects(tmp_path, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_consortium(tmp_path / "x", **{**KW, **kwargs})
    assert not (tmp_path / "x").exists()  # nothing written on bad input
