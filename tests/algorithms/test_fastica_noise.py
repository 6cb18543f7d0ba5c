"""FastICA on noise-dominated bases: no fit ends in an exception (issue 58).

A damped step can collapse two directions into one on a basis that is mostly noise; the decorrelation then
overflowed and scipy refused the NaNs. Now the decorrelation stays finite and orthogonal, the fit reports the
collapse, and the spatial and guided ICAs restart it from public seeds and say so.
"""

import dataclasses
import importlib
import warnings

import numpy as np
import pytest
import scipy.linalg
from threadpoolctl import threadpool_limits

from dpneuro.algorithms._fastica import COLLAPSE_CONDITION, _decorrelate, fastica, random_start, restart_seed
from dpneuro.algorithms.spatial_ica import FASTICA_RESTARTS, FastICACollapsed, guided_ica, spatial_ica

# the modules (the package's namespace holds the function spatial_ica under the module's name)
fastica_mod = importlib.import_module("dpneuro.algorithms._fastica")
spatial_mod = importlib.import_module("dpneuro.algorithms.spatial_ica")


def _white(A: np.ndarray) -> np.ndarray:
    A = A - A.mean(axis=0)
    _, s, vt = np.linalg.svd(A, full_matrices=False)
    return A @ vt.T * (np.sqrt(len(A)) / s)


def _noise_fit_input(i: int) -> tuple[np.ndarray, np.ndarray]:
    """Fit i of benchmarks/fastica_noise.py: a whitened Gaussian D x K basis (D 100-900, K 8-30) and its start."""
    rng = np.random.default_rng(i)
    D, K = int(rng.integers(100, 901)), int(rng.integers(8, 31))
    return _white(rng.standard_normal((D, K))), random_start(i, K)


def _noise_basis(b: int) -> tuple[np.ndarray, np.ndarray]:
    """Pure-noise basis b of benchmarks/fastica_noise.py (orthonormal D x K, eigenvalues in [1, 2])."""
    rng = np.random.default_rng(1000 + b)
    D, K = ((250, 20), (900, 20), (250, 30), (900, 30))[b % 4]
    return np.linalg.qr(rng.standard_normal((D, K)))[0], np.sort(rng.uniform(1.0, 2.0, K))[::-1]


def _sklearn_decorrelate(W: np.ndarray) -> np.ndarray:
    """scikit-learn's symmetric decorrelation, the formula the fits used before the guard."""
    s, u = scipy.linalg.eigh(W @ W.T)
    s = np.clip(s, np.finfo(W.dtype).tiny, None)
    return np.linalg.multi_dot([u * (1.0 / np.sqrt(s)), u.T, W])


def _assert_orthogonal(W: np.ndarray, atol: float = 1e-12) -> None:
    assert np.all(np.isfinite(W))
    np.testing.assert_allclose(W @ W.T, np.eye(len(W)), atol=atol)


def _signal_problem(seed: int, D: int = 600, R: int = 4) -> tuple[np.ndarray, np.ndarray]:
    """A small basis with R heavy-tailed maps (fast, converging fits)."""
    rng = np.random.default_rng(seed)
    V = np.linalg.qr(rng.laplace(size=(D, R)) ** 3 @ rng.standard_normal((R, R)))[0]
    return V, np.linspace(2.0, 1.0, R)


# -- the regression cases: each raised on the code before the guard -----------------------------------------

@pytest.mark.parametrize("i", [183, 882, 2771])
def test_a_noise_fit_that_overflowed_returns_cleanly(i):
    """Fits 183 (876 x 29), 882 (463 x 22) and 2771 (176 x 10) of benchmarks/fastica_noise.py raised ("array must
    not contain infs or NaNs", "matrix contains invalid numeric entries") after an overflow in the decorrelation
    (one BLAS thread, as the product runs FastICA: the trajectory on noise depends on the last bits). Now each
    returns a finite orthogonal unmixing and says whether it collapsed."""
    Z, w0 = _noise_fit_input(i)
    with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
        warnings.simplefilter("error")  # not even an overflow warning
        fit = fastica(Z, w0, tol=1e-6, max_iter=2000)
    _assert_orthogonal(fit.W)
    assert not (fit.collapsed and fit.converged)
    assert fit.converged or fit.collapsed or fit.n_iter == 2000


def test_a_noise_basis_whose_spatial_ica_raised_is_restarted():
    """Pure-noise basis 19 of benchmarks/fastica_noise.py (900 x 30, drawn from seed 1019): its start 8 collapsed
    and the spatial ICA raised. Now the start is restarted from ``restart_seed(8, 1), ...`` and reported."""
    V, lam = _noise_basis(19)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        r = spatial_ica(V, lam, init_seed=8, n_init=1)
    assert np.all(np.isfinite(r.maps)) and np.all(np.isfinite(r.W))
    seeds = [s for _, s in r.restarts]
    assert seeds == [restart_seed(8, a) for a in range(1, len(seeds) + 1)]
    assert (r.restart_note() != "") == bool(seeds)
    if seeds:  # (collapses on OpenBLAS' Haswell kernels; another BLAS may take another path)
        assert "FastICA start 0 (seed 8) collapsed" in r.restart_note() and str(seeds[0]) in r.restart_note()


# -- the decorrelation ------------------------------------------------------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_the_decorrelation_is_unchanged_on_well_conditioned_input(seed):
    """The demo and benchmarks are compared bit for bit: below the bound the same arithmetic as before."""
    rng = np.random.default_rng(seed)
    K = int(rng.integers(2, 31))
    U, V = np.linalg.qr(rng.standard_normal((K, K)))[0], np.linalg.qr(rng.standard_normal((K, K)))[0]
    for top in (1.0, 1e2, 1e5, np.sqrt(COLLAPSE_CONDITION) / 2):  # W W^T's condition up to a quarter of the bound
        s = np.exp(rng.uniform(0.0, np.log(top), K))
        s[0], s[-1] = 1.0, top
        for scale in (1e-3, 1.0, 1e3):
            W = (U * s) @ V.T * scale
            np.testing.assert_array_equal(_decorrelate(W), _sklearn_decorrelate(W))
    W = rng.standard_normal((K, K))  # a random start
    np.testing.assert_array_equal(_decorrelate(W), _sklearn_decorrelate(W))


@pytest.mark.parametrize("case", ["two equal rows", "a zero row", "rank one", "zero", "huge", "inf", "nan",
                                  "beyond the bound"])
def test_a_collapsed_estimate_decorrelates_to_a_finite_orthogonal_matrix(case):
    rng = np.random.default_rng(7)
    K = 6
    W = rng.standard_normal((K, K))
    if case == "two equal rows":
        W[3] = W[1]
    elif case == "a zero row":
        W[2] = 0.0
    elif case == "rank one":
        W = np.outer(rng.standard_normal(K), rng.standard_normal(K))
    elif case == "zero":
        W = np.zeros((K, K))
    elif case == "huge":
        W *= 1e200  # W W^T overflows
    elif case == "inf":
        W[0, 0] = np.inf
    elif case == "nan":
        W[4, 2] = np.nan
    else:
        U, V = np.linalg.qr(rng.standard_normal((K, K)))[0], np.linalg.qr(rng.standard_normal((K, K)))[0]
        W = (U * np.geomspace(1.0, np.sqrt(COLLAPSE_CONDITION) * 10, K)) @ V.T
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = _decorrelate(W)
    _assert_orthogonal(out)
    if case in ("two equal rows", "a zero row", "huge", "beyond the bound"):
        # the nearest orthogonal matrix where one is defined: U V^T of W's SVD, same row space
        u, _, vt = np.linalg.svd(np.where(np.isfinite(W), W, 0.0) / np.abs(W).max())
        np.testing.assert_allclose(out, u @ vt, atol=1e-10)


@pytest.mark.parametrize("row", ["equal", "zero"])
def test_a_fit_from_a_collapsed_start_reports_it(row):
    Z, _ = _noise_fit_input(3)
    K = Z.shape[1]
    w0 = random_start(0, K)
    w0[1] = w0[0] if row == "equal" else 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = fastica(Z, w0, tol=1e-6, max_iter=50)
    assert fit.collapsed and not fit.converged and fit.n_iter == 0
    _assert_orthogonal(fit.W)


def test_a_collapsing_damped_step_ends_the_fit_with_the_last_estimate(monkeypatch):
    """A damped mix of W with a step whose rows are W's swapped (as if a swap were not undone) has two equal rows:
    the fit stops there, collapsed, with W, instead of decorrelating a singular matrix."""
    Z, w0 = _noise_fit_input(5)
    monkeypatch.setattr(fastica_mod, "_aligned", lambda F, W: W[[1, 0, *range(2, len(W))]])
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fit = fastica(Z, w0, tol=1e-6, max_iter=50, step=0.5)
    assert fit.collapsed and not fit.converged and fit.n_iter == 1 and fit.step == 0.5
    np.testing.assert_array_equal(fit.W, _decorrelate(w0))  # the start: the last orthogonal estimate


def test_a_fit_on_non_finite_data_reports_a_collapse():
    Z, w0 = _noise_fit_input(5)
    Z = Z.copy()
    Z[3, 1] = np.inf
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # inf * 0 in the data's own products
        fit = fastica(Z, w0, tol=1e-6, max_iter=50)
    assert fit.collapsed and not fit.converged
    _assert_orthogonal(fit.W)


def test_restart_seeds_are_public_and_apart_from_the_other_starts():
    seeds = [restart_seed(s, a) for s in range(20) for a in range(1, FASTICA_RESTARTS + 1)]
    assert seeds == [int(np.random.SeedSequence([s, a]).generate_state(1)[0]) for s in range(20)
                     for a in range(1, FASTICA_RESTARTS + 1)]  # as documented
    assert len(set(seeds)) == len(seeds) and not set(seeds) & set(range(1000))
    random_start(seeds[0], 3)  # a valid seed of the start


# -- the callers restart and report -----------------------------------------------------------------------

def _collapsing(monkeypatch, module, collapses):
    """Make ``module.fastica`` report a collapse on the fits ``collapses(call index, w_init)`` picks."""
    real = module.fastica
    calls = []

    def fake(X, w_init, **kw):
        fit = real(X, w_init, **kw)
        calls.append(np.array(w_init))
        if collapses(len(calls) - 1, w_init):
            return dataclasses.replace(fit, converged=False, collapsed=True)
        return fit

    monkeypatch.setattr(module, "fastica", fake)
    return calls


def _is_start(w_init, seed) -> bool:
    return w_init.shape == (w_init.shape[0],) * 2 and np.array_equal(w_init, random_start(seed, len(w_init)))


def test_spatial_ica_restarts_a_collapsed_start_and_reports_it(monkeypatch):
    V, lam = _signal_problem(0)
    before = spatial_ica(V, lam, n_init=3)
    calls = _collapsing(monkeypatch, spatial_mod, lambda k, w: _is_start(w, 1))  # start 1's fit, once
    r = spatial_ica(V, lam, n_init=3)
    seed = restart_seed(1, 1)
    assert r.restarts == ((1, seed),) and r.left_out == ()
    assert any(_is_start(w, seed) for w in calls)
    assert r.restart_note() == f"FastICA start 1 (seed 1) collapsed on a noise-dominated basis; restarted from seed {seed}"
    assert np.isfinite(r.scores).all() and r.n_converged == 3 and r.status == "converged"
    assert before.restarts == () and before.restart_note() == ""
    # start 1 is the restarted fit's; the others are as they were
    np.testing.assert_array_equal(np.delete(r.scores, 1), np.delete(before.scores, 1))


def test_a_start_that_collapses_every_time_is_left_out(monkeypatch):
    V, lam = _signal_problem(1)
    restarted = {restart_seed(2, a) for a in range(1, FASTICA_RESTARTS + 1)}
    _collapsing(monkeypatch, spatial_mod, lambda k, w: _is_start(w, 2) or any(_is_start(w, s) for s in restarted))
    r = spatial_ica(V, lam, n_init=3)
    assert r.left_out == (2,) and [i for i, _ in r.restarts] == [2] * FASTICA_RESTARTS
    assert r.scores[2] == np.inf and r.kept != 2 and r.n_converged == 2
    assert "left out" in r.restart_note() and np.all(np.isfinite(r.maps))


def test_when_every_start_collapses_the_error_says_why_and_what_to_do(monkeypatch):
    V, lam = _signal_problem(2)
    _collapsing(monkeypatch, spatial_mod, lambda k, w: True)
    with pytest.raises(FastICACollapsed, match="fewer components.*privacy budget"):
        spatial_ica(V, lam, n_init=2)
    with pytest.raises(FastICACollapsed, match=f"all {1 + FASTICA_RESTARTS} fits"):
        guided_ica(V, V[:, :2] * 3 + 0.1)


def test_guided_ica_restarts_a_collapsed_fit_from_turned_references(monkeypatch):
    rng = np.random.default_rng(3)
    D, R = 2000, 3
    A = rng.laplace(size=(D, 2 * R)) ** 3
    V = np.linalg.qr(A @ rng.standard_normal((2 * R, 2 * R)))[0]
    ref = A[:, :R] + 0.5 * rng.standard_normal((D, R))
    before = guided_ica(V, ref)
    calls = _collapsing(monkeypatch, spatial_mod, lambda k, w: k == 0)  # the references' start, once
    g = guided_ica(V, ref, random_state=4)
    assert g.restarts == (restart_seed(4, 1),) and before.restarts == ()
    assert g.restart_note() == f"the guided FastICA start collapsed on a noise-dominated basis; restarted from seed {g.restarts[0]}"
    # the restart's start: the references' start turned by about 0.1 rad per row, not a random rotation
    first, second = (w / np.linalg.norm(w, axis=1, keepdims=True) for w in calls)
    assert 0.9 < np.abs(np.sum(first * second, axis=1)).min() < 1.0
    assert g.status == "converged" and g.agreement.min() > 0.9
    np.testing.assert_allclose(np.abs(g.agreement), np.abs(before.agreement), atol=1e-3)  # the same maps


def test_the_run_records_a_restart_in_the_unmixings_status(monkeypatch):
    """The spatial unmixing's status (run.json's ica_status, the report's headline) names the collapsed start."""
    from dpneuro.run import roles

    V, lam = _signal_problem(0)
    _collapsing(monkeypatch, spatial_mod, lambda k, w: _is_start(w, 3))
    status = roles._spatial_result(V, lam).status
    assert status == f"converged; FastICA start 3 (seed 3) collapsed on a noise-dominated basis; restarted from " \
                     f"seed {restart_seed(3, 1)}"
    monkeypatch.undo()
    assert roles._spatial_result(V, lam).status == "converged"


def test_the_site_maps_record_says_where_the_guided_ica_restarted(monkeypatch):
    from test_spatial_ica import site_blocks

    from dpneuro.run.site_maps import site_voxel_maps

    blocks, runs, boundaries, S, mask = site_blocks()
    record: dict = {}
    site_voxel_maps(runs, boundaries, S, mask, decode=blocks.__getitem__, workers=1, record=record)
    assert record["site_maps_ica"]["restarted_from"] == []
    _collapsing(monkeypatch, spatial_mod, lambda k, w: k == 0)
    site_voxel_maps(runs, boundaries, S, mask, decode=blocks.__getitem__, workers=1, record=record)
    assert record["site_maps_ica"]["restarted_from"] == [restart_seed(0, 1)]
    assert record["site_maps_ica"]["status"] == "converged"


# -- many noise fits ----------------------------------------------------------------------------------------

@pytest.mark.slow  # ~3 minutes: 500 fits of up to 2,000 iterations (benchmarks/fastica_noise.py runs 10,000)
def test_hundreds_of_noise_fits_raise_nothing():
    bad = []
    with threadpool_limits(limits=1, user_api="blas"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for i in range(500):  # fit 183 among them raised before the guard
            Z, w0 = _noise_fit_input(i)
            try:
                fit = fastica(Z, w0, tol=1e-6, max_iter=2000)
            except Exception as e:  # noqa: BLE001 (any exception is the failure counted)
                bad.append((i, repr(e)))
                continue
            if not np.all(np.isfinite(fit.W)) or np.abs(fit.W @ fit.W.T - np.eye(len(fit.W))).max() > 1e-6:
                bad.append((i, "not a finite orthogonal unmixing"))
    assert not bad, bad
