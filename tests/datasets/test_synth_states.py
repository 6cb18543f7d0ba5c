"""Tests for the planted dFNC connectivity states of dpneuro.datasets.synth."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.algorithms import dfnc
from dpneuro.datasets.states import StateProcess, default_dwell, state_correlations
from dpneuro.datasets.synth import garch_sources, load_manifest, make_consortium

GRID = np.ones((30, 30, 1), bool)  # grid30: the whole grid is the mask


def subjects(man):
    """(site index, subject index in site, site name, subject entry), in manifest order."""
    return [(s_idx, m_idx, site["site"], sub) for s_idx, site in enumerate(man["sites"])
            for m_idx, sub in enumerate(site["subjects"])]


def bold(sub):
    return np.asarray(nib.load(sub["path"]).dataobj, dtype=np.float64)[GRID]


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


KW = dict(n_sites=2, subjects_per_site=[1, 2], n_components=5, n_timepoints=30, space="grid30", random_state=11)


# ---------------------------------------------------------------------------
# states off: nothing changes
# ---------------------------------------------------------------------------

def test_states_off_is_the_old_generator(tmp_path):
    omitted = make_consortium(tmp_path / "a", **KW)
    zero = make_consortium(tmp_path / "b", **KW, states=0, state_dwell=[10.0, 20.0])
    assert files(tmp_path / "a") == files(tmp_path / "b")  # every file, manifest.json included
    for key in ("n_states", "states", "state_labels", "state_model"):
        assert key not in zero["truth"]
    assert not list((tmp_path / "b" / "truth").glob("labels_*"))
    assert not (tmp_path / "b" / "truth" / "states.npy").exists()

    # the old code path, re-derived from its streams: S = GARCH from (seed, 1, site, subject),
    # then that stream's noise; A from (seed, 0)
    A = np.load(omitted["truth"]["A"])
    g = omitted["truth"]["garch"]
    for s_idx, m_idx, _, sub in subjects(omitted):
        rng = np.random.default_rng(np.random.SeedSequence(KW["random_state"], spawn_key=(1, s_idx, m_idx)))
        S = garch_sources(KW["n_timepoints"], np.array(g["alpha"]), np.array(g["beta"]), rng,
                          omega=g["omega"]).astype(np.float32)
        X = A @ S
        X += np.float32(0.5) * rng.standard_normal(X.shape, dtype=np.float32)
        np.testing.assert_array_equal(np.load(sub["sources"]), S)
        np.testing.assert_array_equal(np.asarray(nib.load(sub["path"]).dataobj)[GRID], X)


def test_states_on_changes_no_other_draw(tmp_path):
    off = make_consortium(tmp_path / "off", **KW)
    on = make_consortium(tmp_path / "on", **KW, states=2)
    np.testing.assert_array_equal(np.load(on["truth"]["A"]), np.load(off["truth"]["A"]))
    assert on["truth"]["garch"] == off["truth"]["garch"]
    A = np.load(on["truth"]["A"]).astype(np.float64)
    states = np.load(on["truth"]["states"]).astype(np.float64)
    proc = StateProcess(states, np.array(on["truth"]["state_model"]["dwell"]), 2.0)
    for (s_idx, m_idx, site, s_on), (_, _, _, s_off) in zip(subjects(on), subjects(off)):
        # the sources: the planted process on the subject's own stream (3, site, subject)
        rng = np.random.default_rng(np.random.SeedSequence(KW["random_state"], spawn_key=(3, s_idx, m_idx)))
        S_exp, h = proc.subject(KW["n_timepoints"], rng)
        S = np.load(s_on["sources"]).astype(np.float64)
        np.testing.assert_allclose(S, S_exp, atol=1e-5)
        np.testing.assert_array_equal(np.load(on["truth"]["state_labels"][site][s_on["id"]]), h)
        # same noise draws
        G = np.load(s_off["sources"]).astype(np.float64)
        np.testing.assert_allclose(bold(s_on) - A @ S, bold(s_off) - A @ G, atol=1e-4)


def test_state_matrices_are_correlations_and_differ():
    C = state_correlations(8, 4, random_state=3)
    assert C.shape == (4, 8, 8)
    np.testing.assert_allclose(C, C.transpose(0, 2, 1))
    np.testing.assert_allclose(np.diagonal(C, axis1=1, axis2=2), 1.0)
    assert np.linalg.eigvalsh(C).min() > 0  # positive definite: a valid correlation of the sources
    v = dfnc.matrix_to_vector(C)
    r = np.corrcoef(v.T)
    assert np.abs(r[np.triu_indices(4, 1)]).max() < 0.9  # four different states


@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("long")
    man = make_consortium(out, 2, 3, n_components=6, n_timepoints=600, space="grid30", random_state=4, states=3,
                          state_dwell=[20.0, 40.0, 80.0])
    S = [np.load(sub["sources"]).astype(np.float64) for *_, sub in subjects(man)]
    labels = [np.load(man["truth"]["state_labels"][site][sub["id"]]).astype(np.int64)
              for _, _, site, sub in subjects(man)]
    return out, man, S, labels


def test_dwell_times_and_occupancy_follow_the_chain(long_run):
    _, man, _, labels = long_run
    dwell_s = np.array(man["truth"]["state_model"]["dwell"])
    runs = {k: [] for k in range(3)}
    for h in labels:
        change = np.flatnonzero(np.diff(h)) + 1
        starts = np.r_[0, change]
        for a, b in zip(starts[:-1], starts[1:]):  # the last run is censored by the scan's end
            runs[int(h[a])].append(b - a)
    for k in range(3):
        # geometric run lengths of mean dwell / TR; 3600 TRs give >= 15 runs per state: within 40 %
        assert len(runs[k]) >= 15
        assert abs(np.mean(runs[k]) * 2.0 / dwell_s[k] - 1) < 0.4
    occ = np.bincount(np.concatenate(labels), minlength=3) / sum(h.size for h in labels)
    assert occ[0] < occ[2]  # longer dwell, more time


def test_window_connectivity_of_each_state_is_its_planted_matrix(long_run):
    _, man, S, labels = long_run
    planted = np.load(man["truth"]["states"]).astype(np.float64)
    # inside long segments of one state, the sources' correlation is that state's (shrunk by the white noise
    # of std 0.3: a factor 1 / 1.09)
    for k in range(3):
        segs = []
        for x, h in zip(S, labels):
            ok = np.convolve(h == k, np.ones(11), "same") == 11  # 5 TRs from any change
            if ok.sum() > 20:
                segs.append(x[:, ok])
        est = np.corrcoef(np.concatenate(segs, axis=1))
        r = np.corrcoef(dfnc.matrix_to_vector(est, fisher=False), dfnc.matrix_to_vector(planted[k], fisher=False))
        assert r[0, 1] > 0.9


def test_state_truth_files_and_manifest(long_run):
    out, man, _, _ = long_run
    raw = json.loads((out / "manifest.json").read_text())
    t = raw["truth"]
    assert t["n_states"] == 3 and t["states"] == "truth/states.npy"
    assert t["state_labels"] == {
        "site-01": {f"sub-000{i}": f"truth/labels_site-01_sub-000{i}.npy" for i in (1, 2, 3)},
        "site-02": {f"sub-000{i}": f"truth/labels_site-02_sub-000{i}.npy" for i in (4, 5, 6)},
    }
    assert t["state_model"]["dwell"] == [20.0, 40.0, 80.0] and t["state_model"]["lowpass"] == 0.15
    assert "state_patterns" not in t
    assert load_manifest(out) == man
    C = np.load(man["truth"]["states"])
    assert C.shape == (3, 6, 6) and C.dtype == np.float32
    for _, _, site, sub in subjects(man):
        lab = np.load(man["truth"]["state_labels"][site][sub["id"]])
        assert lab.dtype == np.int8 and lab.shape == (600,) and set(np.unique(lab)) <= {0, 1, 2}


def test_default_dwell_is_30_to_90_seconds(tmp_path):
    man = make_consortium(tmp_path, 1, 1, n_components=4, n_timepoints=30, space="grid30", random_state=0, states=4)
    assert man["truth"]["state_model"]["dwell"] == default_dwell(4).tolist() == [30.0, 50.0, 70.0, 90.0]


def test_states_deterministic_per_subject_and_stale_files_removed(tmp_path):
    kw = dict(n_components=4, n_timepoints=20, space="grid30", random_state=2, states=2)
    small = make_consortium(tmp_path / "s", 1, 1, **kw)
    big = make_consortium(tmp_path / "b", 2, 2, **kw)
    np.testing.assert_array_equal(np.load(small["truth"]["states"]), np.load(big["truth"]["states"]))
    lab = small["truth"]["state_labels"]["site-01"]["sub-0001"]
    np.testing.assert_array_equal(np.load(lab), np.load(big["truth"]["state_labels"]["site-01"]["sub-0001"]))
    # a re-run without states into the same folder leaves no state truth behind
    make_consortium(tmp_path / "b", 1, 1, n_components=4, n_timepoints=20, space="grid30", random_state=2)
    truth = sorted(p.name for p in (tmp_path / "b" / "truth").iterdir())
    assert truth == ["A.npy", "S_site-01_sub-0001.npy", "maps.nii.gz"]


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (dict(states=1), "states must be 0"),
        (dict(states=-1), "states"),
        (dict(states=2.0), "states"),
        (dict(states=2, state_dwell=[1.0, 30.0]), "dwell"),  # not longer than a TR
        (dict(states=2, state_dwell=[30.0]), "dwell"),  # one per state
        (dict(states=2, n_components=1), "n_components"),
    ],
)
def test_bad_state_arguments(tmp_path, kwargs, msg):
    kw = {"n_components": 5, "n_timepoints": 10, "space": "grid30", **kwargs}
    with pytest.raises(ValueError, match=msg):
        make_consortium(tmp_path / "x", 1, 1, **kw)
    assert not (tmp_path / "x").exists()  # nothing written on bad input
    with pytest.raises(TypeError):
        make_consortium(tmp_path / "x", 1, 1, 5, 10, "grid30", 0, 0.5, 2.0, False, "float32", 3)  # keyword-only


def test_states_recoverable_by_pooled_kmeans_of_windows(tmp_path):
    """The point of the data: GIFT's dFNC on the true sources finds the planted states."""
    from sklearn.cluster import KMeans

    K, R = 3, 6
    man = make_consortium(tmp_path, 3, 4, n_components=R, n_timepoints=200, space="grid30", random_state=0, states=K)
    ws = dfnc.site_windows([np.load(sub["sources"]) for *_, sub in subjects(man)])
    km = KMeans(K, n_init=10, random_state=0).fit(ws.X.T)
    planted = dfnc.matrix_to_vector(np.load(man["truth"]["states"]).astype(np.float64))
    from dpneuro.algorithms.metrics import match_components

    _, corr = match_components(np.tanh(km.cluster_centers_.T), np.tanh(planted))
    assert np.all(corr > 0.85)
