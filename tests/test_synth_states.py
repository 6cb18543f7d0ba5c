"""Tests for the brain-state (co-activation pattern) model of dpneuro.synth."""

from __future__ import annotations

import json
from pathlib import Path

import nibabel as nib
import numpy as np
import pytest

from dpneuro.synth import garch_sources, load_manifest, make_consortium, state_centroids, state_sequence

GRID = np.ones((30, 30, 1), bool)  # grid30: the whole grid is the mask


def subjects(man):
    """(site index, subject index in site, site name, subject entry), in manifest order."""
    return [(s_idx, m_idx, site["site"], sub) for s_idx, site in enumerate(man["sites"])
            for m_idx, sub in enumerate(site["subjects"])]


def bold(sub):
    return np.asarray(nib.load(sub["path"]).dataobj, dtype=np.float64)[GRID]


def files(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def run_lengths(labels: np.ndarray) -> np.ndarray:
    """Lengths of the runs of equal labels, the last (censored by the series end) dropped."""
    change = np.flatnonzero(np.diff(labels)) + 1
    edges = np.concatenate([[0], change])
    return np.diff(edges)


def corr_rows(a, b):
    a = a - a.mean(axis=1, keepdims=True)
    b = b - b.mean(axis=1, keepdims=True)
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    b = b / np.linalg.norm(b, axis=1, keepdims=True)
    return a @ b.T


def matched_corr(est, truth):
    """Correlation of each true row with its Hungarian-matched estimate."""
    from scipy.optimize import linear_sum_assignment

    C = corr_rows(truth, est)
    rows, cols = linear_sum_assignment(-C)
    return C[rows, cols]


KW = dict(n_sites=2, subjects_per_site=[1, 2], n_components=5, n_timepoints=30, space="grid30", random_state=11)


# ---------------------------------------------------------------------------
# states off: nothing changes
# ---------------------------------------------------------------------------

def test_states_off_is_the_old_generator(tmp_path):
    omitted = make_consortium(tmp_path / "a", **KW)
    zero = make_consortium(tmp_path / "b", **KW, states=0, state_dwell=3.0, state_strength=0.9)
    assert files(tmp_path / "a") == files(tmp_path / "b")  # every file, manifest.json included
    for key in ("n_states", "states", "state_patterns", "state_labels", "state_model"):
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
    mu = np.load(on["truth"]["states"]).astype(np.float64)
    c = np.array(on["truth"]["state_model"]["noise_scale"])
    A = np.load(on["truth"]["A"]).astype(np.float64)
    for (_, _, site, s_on), (_, _, _, s_off) in zip(subjects(on), subjects(off)):
        labels = np.load(on["truth"]["state_labels"][site][s_on["id"]])
        G = np.load(s_off["sources"]).astype(np.float64)
        S = np.load(s_on["sources"]).astype(np.float64)
        # same GARCH draws, shifted by the state means and scaled
        np.testing.assert_allclose(S, mu[labels].T + c[:, None] * G, atol=1e-5)
        # same noise draws
        np.testing.assert_allclose(bold(s_on) - A @ S, bold(s_off) - A @ G, atol=1e-4)
        assert not np.allclose(S, G)


# ---------------------------------------------------------------------------
# the helpers
# ---------------------------------------------------------------------------

@pytest.mark.parametrize("dwell", [2.0, 8.0, 20.0])
def test_state_sequence_dwell_times_and_occupancy(dwell):
    K, T = 4, 1000
    rng = np.random.default_rng(5)
    seqs = [state_sequence(T, K, dwell, rng) for _ in range(100)]
    runs = np.concatenate([run_lengths(h) for h in seqs])
    # geometric dwell times: mean `dwell` (10%), variance dwell (dwell - 1) (25%)
    assert runs.mean() == pytest.approx(dwell, rel=0.10)
    assert runs.var() == pytest.approx(dwell * (dwell - 1), rel=0.25)
    # a switch always goes to another state, every state occurs, occupancy uniform within +-0.03
    for h in seqs:
        assert h.dtype.kind == "i" and h.shape == (T,) and h.min() >= 0 and h.max() < K
    occupancy = np.bincount(np.concatenate(seqs), minlength=K) / (100 * T)
    assert np.all(np.abs(occupancy - 1 / K) < 0.03), occupancy
    # uniform initial state
    first = np.bincount([h[0] for h in seqs], minlength=K)
    assert first.min() >= 10


def test_state_sequence_edge_cases():
    rng = np.random.default_rng(0)
    h = state_sequence(200, 3, 1.0, rng)  # dwell 1: a switch at every step
    assert np.all(np.diff(h) != 0)
    assert state_sequence(1, 2, 8.0, rng).shape == (1,)
    a = state_sequence(50, 3, 4.0, np.random.default_rng(1))
    np.testing.assert_array_equal(a, state_sequence(50, 3, 4.0, np.random.default_rng(1)))
    with pytest.raises(ValueError, match="state_dwell"):
        state_sequence(10, 3, 0.5, rng)
    with pytest.raises(ValueError, match="n_states"):
        state_sequence(10, 1, 8.0, rng)


@pytest.mark.parametrize("R, K", [(6, 3), (20, 4), (5, 2), (4, 4)])
def test_state_centroids_sparse_centred_distinct(R, K):
    strength = 0.4
    mu = state_centroids(R, K, strength, np.random.default_rng(R * K))
    assert mu.shape == (K, R)
    np.testing.assert_allclose(mu.sum(axis=0), 0, atol=1e-12)  # centred over the states
    m = max(1, min(3, R // K))
    active = np.abs(mu).max(axis=0) > 0
    assert active.sum() == K * m  # a few components per state, disjoint blocks
    # every participating source: the states carry `strength` of its unit variance
    np.testing.assert_allclose((mu[:, active] ** 2).mean(axis=0), strength)
    # each state's own block: its m largest entries, the first positive (K = 2: mu_2 = -mu_1)
    a = np.sqrt(strength * K * K / (K - 1))
    assert all(mu[k].max() == pytest.approx(a * (K - 1) / K) for k in range(K))
    if K > 2:
        own = [set(np.flatnonzero(np.isclose(np.abs(mu[k]), a * (K - 1) / K))) for k in range(K)]
        assert all(len(o) == m for o in own) and len(set().union(*own)) == K * m
    else:
        np.testing.assert_allclose(mu[0], -mu[1])
    # well separated: any two differ by a on 2m components
    for j in range(K):
        for k in range(j + 1, K):
            assert np.linalg.norm(mu[j] - mu[k]) == pytest.approx(a * np.sqrt(2 * m))
    with pytest.raises(ValueError, match="exceeds"):
        state_centroids(3, 4, 0.4, np.random.default_rng(0))
    with pytest.raises(ValueError, match="state_strength"):
        state_centroids(6, 3, 1.0, np.random.default_rng(0))


# ---------------------------------------------------------------------------
# the generator with states on
# ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def long_run(tmp_path_factory):
    """8 sources (6 in a state, 2 not), 3 states, 6 subjects x 400 time points."""
    out = tmp_path_factory.mktemp("long")
    man = make_consortium(out, 2, 3, n_components=8, n_timepoints=400, space="grid30", random_state=4,
                          noise=0.5, states=3)
    S = np.concatenate([np.load(sub["sources"]) for *_, sub in subjects(man)], axis=1).astype(np.float64)
    labels = np.concatenate([np.load(man["truth"]["state_labels"][site][sub["id"]])
                             for _, _, site, sub in subjects(man)])
    return out, man, S, labels


def test_sources_unit_variance_and_state_means(long_run):
    _, man, S, labels = long_run
    mu = np.load(man["truth"]["states"]).astype(np.float64)
    # every row: mean 0 (+-0.1) and variance 1 (+-0.1) over the pooled 2400 time points
    np.testing.assert_allclose(S.mean(axis=1), 0, atol=0.1)
    np.testing.assert_allclose(S.var(axis=1), 1, atol=0.1)
    # rows in a state have reduced GARCH scale, the others none
    c = np.array(man["truth"]["state_model"]["noise_scale"])
    active = np.abs(mu).max(axis=0) > 0
    assert active.sum() == 6
    np.testing.assert_allclose(c[active], np.sqrt(1 - 0.4))
    np.testing.assert_allclose(c[~active], 1.0)
    # the mean over the time points labelled k is mu_k (within 0.1 per component)
    for k in range(3):
        sel = labels == k
        assert sel.mean() > 0.2
        np.testing.assert_allclose(S[:, sel].mean(axis=1), mu[k], atol=0.1)
    # the states are separated: the mean of one state is far from the others' centroids
    between = min(np.linalg.norm(mu[j] - mu[k]) for j in range(3) for k in range(j + 1, 3))
    assert between > 2.0


def test_state_truth_files_and_manifest(long_run):
    out, man, _, labels = long_run
    raw = json.loads((out / "manifest.json").read_text())
    t = raw["truth"]
    assert t["n_states"] == 3
    assert t["states"] == "truth/states.npy" and t["state_patterns"] == "truth/state_patterns.npy"
    assert t["state_labels"] == {
        "site-01": {f"sub-000{i}": f"truth/labels_site-01_sub-000{i}.npy" for i in (1, 2, 3)},
        "site-02": {f"sub-000{i}": f"truth/labels_site-02_sub-000{i}.npy" for i in (4, 5, 6)},
    }
    assert t["state_model"]["dwell"] == 8.0 and t["state_model"]["strength"] == 0.4
    assert t["state_model"]["components_per_state"] == 2
    assert load_manifest(out) == man
    assert Path(man["truth"]["states"]) == out / "truth" / "states.npy"

    mu = np.load(man["truth"]["states"])
    P = np.load(man["truth"]["state_patterns"])
    A = np.load(man["truth"]["A"])
    assert mu.shape == (3, 8) and mu.dtype == np.float32
    assert P.shape == (3, 900) and P.dtype == np.float32
    np.testing.assert_allclose(P, mu.astype(np.float64) @ A.T.astype(np.float64), atol=1e-5)
    for _, _, site, sub in subjects(man):
        lab = np.load(man["truth"]["state_labels"][site][sub["id"]])
        assert lab.dtype == np.int8 and lab.shape == (400,) and set(np.unique(lab)) <= {0, 1, 2}
    assert set(np.unique(labels)) == {0, 1, 2}


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
        (dict(states=6), "exceeds n_components"),
        (dict(states=2, state_dwell=0.5), "state_dwell"),
        (dict(states=2, state_dwell=float("nan")), "state_dwell"),
        (dict(states=2, state_dwell="long"), "state_dwell"),
        (dict(states=2, state_strength=0.0), "state_strength"),
        (dict(states=2, state_strength=1.0), "state_strength"),
        (dict(states=2, state_strength=float("inf")), "state_strength"),
    ],
)
def test_bad_state_arguments(tmp_path, kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        make_consortium(tmp_path / "x", 1, 1, n_components=5, n_timepoints=10, space="grid30", **kwargs)
    assert not (tmp_path / "x").exists()  # nothing written on bad input
    with pytest.raises(TypeError):
        make_consortium(tmp_path / "x", 1, 1, 5, 10, "grid30", 0, 0.5, 2.0, False, "float32", 3)  # keyword-only


# ---------------------------------------------------------------------------
# recoverability: the point of the data
# ---------------------------------------------------------------------------

def test_states_recoverable_by_kmeans(tmp_path):
    from sklearn.cluster import KMeans

    K, R = 3, 6
    man = make_consortium(tmp_path, 3, 4, n_components=R, n_timepoints=80, space="grid30", random_state=0, states=K)
    subs = subjects(man)
    S = np.concatenate([np.load(sub["sources"]) for *_, sub in subs], axis=1).astype(np.float64)
    X = np.concatenate([bold(sub) for *_, sub in subs], axis=1)
    mu = np.load(man["truth"]["states"]).astype(np.float64)
    P = np.load(man["truth"]["state_patterns"]).astype(np.float64)

    # the pooled true sources: centroids in source space
    km = KMeans(K, n_init=10, random_state=0).fit(S.T)
    assert np.all(matched_corr(km.cluster_centers_, mu) > 0.9)

    # the voxel data on its top-R PCA subspace: centroids mapped back to voxels are A mu_k
    from scipy.linalg import eigh

    Xc = X - X.mean(axis=1, keepdims=True)
    U = eigh(Xc @ Xc.T, subset_by_index=[X.shape[0] - R, X.shape[0] - 1])[1]  # top-R principal axes
    km = KMeans(K, n_init=10, random_state=0).fit((U.T @ Xc).T)
    assert np.all(matched_corr(km.cluster_centers_ @ U.T, P) > 0.8)
