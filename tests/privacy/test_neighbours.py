"""Replace-one-subject sensitivities: the recorded value is the worst case a brute-force search finds.

For every algorithm a small site is built, one subject (the longest) is
replaced by each candidate from a search set (including the extremal pairs
the derivations in docs/privacy.md name), the algorithm's own site step
computes the release, and the largest change over all pairs is compared with
the sensitivity the site records in its ledger: equal (the bound is tight and
sound) to 1e-9 relative.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.optimize import brentq

from dpneuro.algorithms.agn import _M2Stage
from dpneuro.algorithms.djica import CapeDJICA
from dpneuro.algorithms.pca import CapePCA, as_source, cape_pca
from dpneuro.protocol.cape.packing import pack
from dpneuro.protocol.exchange import Payload

RNG = np.random.default_rng(7)


def _unit(v):
    v = np.asarray(v, float)
    return v / np.linalg.norm(v)


def _candidates(D: int, T: int, n_random: int = 12):
    """Subjects of T columns: constant along each axis +-, plus random subjects (columns of norm 1)."""
    out = []
    for d in range(D):
        for sgn in (1.0, -1.0):
            out.append(np.tile(sgn * np.eye(D)[:, [d]], (1, T)))
    for _ in range(n_random):
        out.append(np.column_stack([_unit(RNG.standard_normal(D)) for _ in range(T)]))
    return out


def _max_change(release, base_blocks, slot, candidates):
    """max over candidate pairs of ||release(with a) - release(with b)||_2 for subject ``slot``."""
    vals = []
    for c in candidates:
        blocks = list(base_blocks)
        blocks[slot] = c
        vals.append(release(blocks))
    return max(np.linalg.norm(a - b) for a, b in itertools.combinations(vals, 2))


def _pca_site(lengths, D):
    return [np.column_stack([_unit(RNG.standard_normal(D)) for _ in range(T)]) for T in lengths]


@pytest.mark.parametrize("mode", ["covariance", "power"])
def test_capepca_recorded_sensitivity_is_the_replace_worst_case(mode):
    D, lengths = 3, [3, 2, 2]
    base = _pca_site(lengths, D)
    alg = CapePCA(2, 1.0, 1e-5, mode=mode, scale="unit", random_state=0, n_iter=3 if mode == "power" else None)
    state = alg.site_init(0, as_source(base))
    recorded = state["sensitivity"]
    V = np.eye(D)[:, :2]  # a public orthonormal basis that sees both extremal directions

    def release(blocks):
        st = alg.site_init(0, as_source(blocks))
        if mode == "covariance":
            return pack(alg.site_compute(st, 0, None)["A"], True)  # the unique entries noise is drawn on
        return alg.site_compute(st, 1, Payload({"V": V}))["AV"].ravel()

    worst = _max_change(release, base, 0, _candidates(D, lengths[0]))
    assert recorded == pytest.approx(math.sqrt(2) * 3 / 7, rel=1e-12)
    assert worst == pytest.approx(recorded, rel=1e-9)


def test_capepca_ledger_records_replace_and_its_sensitivity():
    sites = [_pca_site([3, 2, 2], 3) for _ in range(3)]
    res = cape_pca([np.hstack(b) for b in sites], 2, 1.0, 1e-5, subjects=[[3, 2, 2]] * 3, scale="unit", random_state=1)
    rel = res.ledgers[0].releases[0]
    assert rel.neighbour == "replace" and rel.unit == "subject"
    assert rel.sensitivity == pytest.approx(math.sqrt(2) * 3 / 7, rel=1e-12)
    # the papers' relation stays available, by name, sqrt(2) smaller
    old = cape_pca([np.hstack(b) for b in sites], 2, 1.0, 1e-5, subjects=[[3, 2, 2]] * 3, scale="unit", random_state=1,
                   neighbour="add-remove")
    assert old.ledgers[0].releases[0].neighbour == "add-remove"
    assert old.ledgers[0].releases[0].sensitivity == pytest.approx(rel.sensitivity / math.sqrt(2), rel=1e-12)


def _infomax_extremes():
    """Sources whose per-sample gradients at W = I, b = 0 are antipodal: diag(-1, 1) and diag(1, -1).

    With u = a e_1, (I + y u^T) = I - a tanh(a/2) e_1 e_1^T, which is diag(-1, 1) when a tanh(a/2) = 2;
    u = -a e_1 gives the same G and the opposite bias gradient y.
    """
    a = brentq(lambda t: t * math.tanh(t / 2) - 2.0, 0.1, 10.0)
    return [np.array([a, 0.0]), np.array([-a, 0.0]), np.array([0.0, a]), np.array([0.0, -a])]


@pytest.mark.parametrize("clip_unit", ["sample", "subject"])
def test_capedjica_recorded_sensitivities_are_the_replace_worst_case(clip_unit):
    lengths = [3, 2, 2]
    cands = [np.tile(u[:, None], (1, lengths[0])) for u in _infomax_extremes()]
    cands += [RNG.standard_normal((2, lengths[0])) * 3 for _ in range(8)]
    base = [RNG.standard_normal((2, T)) for T in lengths]
    alg = CapeDJICA(R=2, epsilon_i=1.0, delta_i=1e-2, clip_G=1.0, clip_h=0.5, plan="cape", calibration="analytic",
                    clip_unit=clip_unit, bias=True, random_state=0)
    state = alg.site_init(0, (np.hstack(base), lengths))
    specs = alg.site_releases(state)
    broadcast = Payload({"W": np.eye(2), "b": np.zeros(2)})

    def release(name):
        def f(blocks):
            st = alg.site_init(0, (np.hstack(blocks), lengths))
            return alg.site_compute(st, 0, broadcast)[name].ravel()
        return f

    assert specs["G"].neighbour == "replace"
    for name, bound in (("G", 1.0), ("h", 0.5)):
        worst = _max_change(release(name), base, 0, cands)
        assert specs[name].sensitivity == pytest.approx(2 * bound * 3 / 7, rel=1e-12)
        assert worst == pytest.approx(specs[name].sensitivity, rel=1e-9), name


@pytest.mark.parametrize("group", [1, 2])
def test_capeagn_second_moment_sensitivity_is_the_replace_worst_case(group):
    D, n = 3, 6
    base = np.column_stack([_unit(RNG.standard_normal(D)) * 0.9 for _ in range(n)])
    m2 = _M2Stage("mog", 1.0, "sample" if group == 1 else "subject", [group], None, 1, None, k=2, sigma2=0.0)
    state = m2.site_init(0, base)
    recorded = m2.site_releases(state)["m2"].sensitivity
    blocks = [base[:, i:i + group] for i in range(0, n, group)]

    def release(bl):
        return pack(m2.site_compute(m2.site_init(0, np.hstack(bl)), 0, None)["m2"], True)

    worst = _max_change(release, blocks, 0, _candidates(D, group))
    assert worst == pytest.approx(recorded, rel=1e-9)
    assert recorded == pytest.approx(math.sqrt(2) * group / n, rel=1e-12)


@pytest.mark.parametrize("mode", ["covariance", "power"])
def test_capepca_subject_bound_scales_the_worst_case_by_the_bound(mode):
    # every candidate is clipped at 0.5 (rank one: ||P||_F = T; random: >= T / sqrt(D)), so the worst
    # pair is two rank-one subjects along orthogonal axes: exactly sqrt(2) * 0.5 * 3 / 7
    D, lengths, c = 3, [3, 2, 2], 0.5
    base = _pca_site(lengths, D)
    alg = CapePCA(2, 1.0, 1e-5, mode=mode, scale="unit", random_state=0, n_iter=3 if mode == "power" else None,
                  subject_bound=c)
    recorded = alg.site_init(0, as_source(base))["sensitivity"]
    V = np.eye(D)[:, :2]

    def release(blocks):
        st = alg.site_init(0, as_source(blocks))
        if mode == "covariance":
            return pack(alg.site_compute(st, 0, None)["A"], True)
        return alg.site_compute(st, 1, Payload({"V": V}))["AV"].ravel()

    worst = _max_change(release, base, 0, _candidates(D, lengths[0]))
    assert recorded == pytest.approx(math.sqrt(2) * c * 3 / 7, rel=1e-12)
    assert worst == pytest.approx(recorded, rel=1e-6)
    assert worst <= recorded


@pytest.mark.parametrize("mode", ["covariance", "power"])
def test_capepca_subspace_contribution_worst_case_is_sqrt2_over_sqrt_k(mode):
    # a subject adds (n / k) U U^T whatever its data: the worst pair are two subjects with orthogonal top-k
    # subspaces (||P - P'||_F = sqrt(2 k) n / k), exactly the recorded sqrt(2) n / (sqrt(k) N)
    D, k, lengths = 4, 2, [4, 3, 3]
    base = _pca_site(lengths, D)
    alg = CapePCA(k, 1.0, 1e-5, mode=mode, scale="unit", random_state=0, n_iter=3 if mode == "power" else None,
                  contribution="subspace")
    recorded = alg.site_init(0, as_source(base))["sensitivity"]
    V = np.eye(D)[:, :k]

    def release(blocks):
        st = alg.site_init(0, as_source(blocks))
        if mode == "covariance":
            return pack(alg.site_compute(st, 0, None)["A"], True)
        return alg.site_compute(st, 1, Payload({"V": V}))["AV"].ravel()

    T = lengths[0]
    pairs = [np.column_stack([np.eye(D)[:, a if t % 2 else b] for t in range(T)]) for a, b in ((0, 1), (2, 3))]
    cands = pairs + _candidates(D, T)
    worst = _max_change(release, base, 0, cands)
    assert recorded == pytest.approx(math.sqrt(2) * T / (math.sqrt(k) * sum(lengths)), rel=1e-12)
    assert worst <= recorded * (1 + 1e-9)
    if mode == "covariance":  # the orthogonal pair attains it (power mode sees only span(V))
        assert worst == pytest.approx(recorded, rel=1e-9)


@pytest.mark.parametrize("bound", [None, 0.5])
def test_capepca_variance_release_worst_case_is_the_second_moments(bound):
    # the k x k release of variances=True is the second moment projected on the public basis V: rank-one
    # subjects along two axes inside span(V) are the worst pair, sqrt(2) c n / N (c = 1 without a bound),
    # measured in the Frobenius norm the noise is calibrated to
    from dpneuro.protocol.cape.packing import pack_weighted

    D, k, lengths = 3, 2, [3, 2, 2]
    base = _pca_site(lengths, D)
    alg = CapePCA(k, 1.0, 1e-5, scale="unit", random_state=0, contribution="subspace", variances=True,
                  subject_bound=bound)
    st0 = alg.site_init(0, as_source(base))
    recorded = alg.site_releases(st0)["H"].sensitivity
    V = np.eye(D)[:, :k]

    def release(blocks):
        st = alg.site_init(0, as_source(blocks))
        return pack_weighted(alg.site_compute(st, 1, Payload({"V": V}))["H"])

    worst = _max_change(release, base, 0, _candidates(D, lengths[0]))
    assert recorded == pytest.approx(math.sqrt(2) * (bound or 1.0) * 3 / 7, rel=1e-12)
    assert worst == pytest.approx(recorded, rel=1e-6)  # clipping keeps a 1e-9 slack below the bound
    assert worst <= recorded
