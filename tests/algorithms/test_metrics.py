"""Tests for dpneuro.algorithms.metrics (definitions in its docstrings)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from dpneuro.algorithms.metrics import (
    align_components,
    captured_energy,
    match_components,
    md_index,
    q_comp,
    qngi,
)


def scaled_permutation(R: int, rng: np.random.Generator) -> np.ndarray:
    """Random permutation matrix with random signs and scales (0.1 .. 10)."""
    perm = rng.permutation(R)
    scales = rng.uniform(0.1, 10.0, R) * rng.choice([-1.0, 1.0], R)
    P = np.zeros((R, R))
    P[np.arange(R), perm] = scales
    return P


finite_floats = st.floats(-100, 100, allow_nan=False, allow_infinity=False)


def square_matrices(min_side=2, max_side=6):
    return st.integers(min_side, max_side).flatmap(
        lambda r: arrays(np.float64, (r, r), elements=finite_floats)
    )


def nondegenerate(P: np.ndarray) -> bool:
    """No all-zero row/column (where the indices are undefined)."""
    A = np.abs(P)
    return bool(np.all(A.max(axis=0) > 1e-6) and np.all(A.max(axis=1) > 1e-6))


# ---------------------------------------------------------------------------
# qNGI
# ---------------------------------------------------------------------------

class TestQngi:
    @pytest.mark.parametrize("R", [1, 2, 5, 20])
    def test_zero_for_scaled_permutations(self, R):
        rng = np.random.default_rng(R)
        for _ in range(5):
            assert qngi(scaled_permutation(R, rng)) == pytest.approx(0.0, abs=1e-12)

    def test_known_2x2(self):
        # P = [[1, .5], [.25, 1]]
        # rows: (1 + .5 - 1) + (.25 + 1 - 1) = .75
        # cols: (1 + .25 - 1) + (.5 + 1 - 1) = .75
        # qNGI = 1.5 / (2 * 2 * 1) = 0.375 ; an un-normalized ISI would give 1.5
        assert qngi([[1.0, 0.5], [0.25, 1.0]]) == pytest.approx(0.375)

    def test_known_2x2_with_signs_and_unequal_maxima(self):
        # P = [[2, -1], [1, 4]]: row maxima 2, 4 ; column maxima 2, 4
        # rows: (1 + .5 - 1) + (.25 + 1 - 1) = .75
        # cols: (1 + .5 - 1) + (.25 + 1 - 1) = .75  -> 1.5 / 4
        assert qngi([[2.0, -1.0], [1.0, 4.0]]) == pytest.approx(0.375)

    def test_known_3x3(self):
        # P = [[1,0,0],[0,1,0],[0,.5,1]]: row 3 gives .5, column 2 gives .5
        # qNGI = 1 / (2 * 3 * 2) = 1/12 (un-normalized: 1; /R(R-1) only: 1/6)
        P = [[1.0, 0, 0], [0, 1.0, 0], [0, 0.5, 1.0]]
        assert qngi(P) == pytest.approx(1.0 / 12.0)

    @pytest.mark.parametrize("R", [2, 3, 10])
    def test_all_equal_is_worst_case_one(self, R):
        assert qngi(np.ones((R, R))) == pytest.approx(1.0)

    def test_identity_vs_random(self):
        rng = np.random.default_rng(0)
        R = 20
        assert qngi(np.eye(R)) == 0.0
        random_vals = [qngi(rng.standard_normal((R, R))) for _ in range(5)]
        assert min(random_vals) > 0.3
        # a slightly perturbed permutation is close to, but not exactly, 0
        near = qngi(np.eye(R) + 0.01 * rng.standard_normal((R, R)))
        assert 0 < near < 0.05

    def test_invariant_to_row_and_column_permutation_and_global_scale(self):
        rng = np.random.default_rng(1)
        P = rng.standard_normal((6, 6))
        base = qngi(P)
        assert qngi(P[rng.permutation(6)]) == pytest.approx(base)
        assert qngi(P[:, rng.permutation(6)]) == pytest.approx(base)
        assert qngi(-3.7 * P) == pytest.approx(base)
        assert qngi(P.T) == pytest.approx(base)  # definition is symmetric

    @settings(max_examples=60, deadline=None)
    @given(square_matrices())
    def test_bounds_property(self, P):
        assume(nondegenerate(P))
        v = qngi(P)
        assert 0.0 <= v <= 1.0

    @settings(max_examples=30, deadline=None)
    @given(st.integers(2, 8), st.integers(0, 2**32 - 1))
    def test_scaled_permutation_times_gain(self, R, seed):
        # left-multiplying by a scaled permutation does not make P worse
        # than "all mixed", and a scaled permutation itself is perfect
        rng = np.random.default_rng(seed)
        Q = scaled_permutation(R, rng)
        assert qngi(Q) == pytest.approx(0.0, abs=1e-12)
        assert 0.0 <= qngi(Q @ rng.standard_normal((R, R))) <= 1.0

    @pytest.mark.parametrize(
        "bad, msg",
        [
            (np.ones((2, 3)), "square"),
            (np.ones(3), "2-D"),
            ([[1.0, np.nan], [0.0, 1.0]], "NaN"),
            ([[1.0, np.inf], [0.0, 1.0]], "NaN or infinite"),
            ([[1.0, 0.0], [0.0, 0.0]], "all-zero"),
            (np.zeros((0, 0)), "empty"),
            ([["a", "b"], ["c", "d"]], "numeric"),
        ],
    )
    def test_validation(self, bad, msg):
        with pytest.raises(ValueError, match=msg):
            qngi(bad)


# ---------------------------------------------------------------------------
# MD index
# ---------------------------------------------------------------------------

class TestMdIndex:
    @pytest.mark.parametrize("R", [1, 2, 5, 20])
    def test_zero_for_scaled_permutations(self, R):
        rng = np.random.default_rng(R)
        A = rng.standard_normal((R, R))
        W = scaled_permutation(R, rng) @ np.linalg.inv(A)
        assert md_index(W, A) == pytest.approx(0.0, abs=1e-6)

    def test_known_2x2(self):
        # G = [[1, 1], [0, 1]]: G~ = [[.5, .5], [0, 1]]
        # best permutation is identity: tr = 1.5 -> MD = sqrt(2 - 1.5) / 1
        assert md_index(np.eye(2), [[1.0, 1.0], [0.0, 1.0]]) == pytest.approx(np.sqrt(0.5))

    def test_known_2x2_second(self):
        # G = [[3, 4], [0, 2]]: G~ = [[9/25, 16/25], [0, 1]]
        # identity: .36 + 1 = 1.36 ; swap: .64 + 0 -> MD = sqrt(.64) = .8
        assert md_index(np.eye(2), [[3.0, 4.0], [0.0, 2.0]]) == pytest.approx(0.8)

    @pytest.mark.parametrize("R", [2, 4, 9])
    def test_all_equal_is_one(self, R):
        # G~ = 1/R everywhere: max tr = 1 -> sqrt(R - 1) / sqrt(R - 1)
        assert md_index(np.eye(R), np.ones((R, R))) == pytest.approx(1.0)

    def test_matches_brute_force_over_permutations(self):
        # max_perm tr(P G~) must be the exact optimum, not a greedy matching
        from itertools import permutations

        rng = np.random.default_rng(2)
        R = 4
        for _ in range(20):
            G = rng.standard_normal((R, R))
            Gt = G**2 / (G**2).sum(axis=1, keepdims=True)
            best = max(sum(Gt[i, p[i]] for i in range(R)) for p in permutations(range(R)))
            assert md_index(np.eye(R), G) == pytest.approx(np.sqrt(R - best) / np.sqrt(R - 1))

    def test_invariant_to_row_scaling_and_permutation_of_W(self):
        rng = np.random.default_rng(3)
        R = 6
        A = rng.standard_normal((R, R))
        W = np.linalg.inv(A) + 0.3 * rng.standard_normal((R, R))
        base = md_index(W, A)
        assert 0 < base < 1
        Q = scaled_permutation(R, rng)
        assert md_index(Q @ W, A) == pytest.approx(base)

    def test_affine_invariance(self):
        # MD depends only on G = W A, so W C and C^{-1} A give the same value
        rng = np.random.default_rng(4)
        R = 5
        W, A, C = (rng.standard_normal((R, R)) for _ in range(3))
        assert md_index(W @ C, np.linalg.solve(C, A)) == pytest.approx(md_index(W, A))

    def test_identity_vs_random(self):
        rng = np.random.default_rng(5)
        R = 15
        assert md_index(np.eye(R), np.eye(R)) == pytest.approx(0.0, abs=1e-12)
        vals = [md_index(rng.standard_normal((R, R)), np.eye(R)) for _ in range(5)]
        assert min(vals) > 0.5

    def test_rectangular_factors_with_square_product(self):
        rng = np.random.default_rng(6)
        A = rng.standard_normal((10, 3))  # D x R
        W = np.linalg.pinv(A)  # R x D
        assert md_index(W, A) == pytest.approx(0.0, abs=1e-8)

    @settings(max_examples=60, deadline=None)
    @given(square_matrices())
    def test_bounds_property(self, G):
        assume(np.all((G**2).sum(axis=1) > 1e-12))
        v = md_index(np.eye(G.shape[0]), G)
        assert 0.0 <= v <= 1.0

    def test_validation(self):
        with pytest.raises(ValueError, match="cannot be multiplied"):
            md_index(np.eye(3), np.eye(4))
        with pytest.raises(ValueError, match="square"):
            md_index(np.ones((2, 5)), np.ones((5, 3)))
        with pytest.raises(ValueError, match="NaN"):
            md_index(np.eye(2), [[np.nan, 0], [0, 1]])
        with pytest.raises(ValueError, match="all-zero row"):
            md_index(np.diag([1.0, 0.0]), np.eye(2))


# ---------------------------------------------------------------------------
# captured energy
# ---------------------------------------------------------------------------

class TestCapturedEnergy:
    def test_known_values(self):
        A = np.diag([3.0, 2.0, 1.0])
        e = np.eye(3)
        assert captured_energy(e[:, :1], A) == pytest.approx(3.0)
        assert captured_energy(e[:, :2], A) == pytest.approx(5.0)
        assert captured_energy(e[:, [2]], A) == pytest.approx(1.0)
        # v = (e1 + e2)/sqrt2 with A = [[2,1,0],[1,2,0],[0,0,1]]:
        # v^T A v = (2 + 1 + 1 + 2) / 2 = 3
        A2 = np.array([[2.0, 1, 0], [1, 2, 0], [0, 0, 1]])
        v = np.array([[1.0], [1.0], [0.0]]) / np.sqrt(2)
        assert captured_energy(v, A2) == pytest.approx(3.0)

    def test_top_eigenvectors_maximise_and_rotation_invariant(self):
        rng = np.random.default_rng(0)
        D, k = 12, 3
        X = rng.standard_normal((D, 200))
        A = X @ X.T / 200
        evals, evecs = np.linalg.eigh(A)
        V = evecs[:, ::-1][:, :k]
        best = captured_energy(V, A)
        assert best == pytest.approx(evals[::-1][:k].sum())
        # any rotation inside the subspace gives the same energy
        Q, _ = np.linalg.qr(rng.standard_normal((k, k)))
        assert captured_energy(V @ Q, A) == pytest.approx(best)
        # a random subspace captures less (Ky Fan)
        Vr, _ = np.linalg.qr(rng.standard_normal((D, k)))
        assert captured_energy(Vr, A) < best

    def test_validation(self):
        A = np.eye(4)
        with pytest.raises(ValueError, match="orthonormal"):
            captured_energy(2 * np.eye(4)[:, :2], A)
        with pytest.raises(ValueError, match="rows"):
            captured_energy(np.eye(3)[:, :2], A)
        with pytest.raises(ValueError, match="square"):
            captured_energy(np.eye(4)[:, :2], np.ones((4, 3)))
        with pytest.raises(ValueError, match="more columns"):
            captured_energy(np.ones((2, 4)), np.eye(2))
        with pytest.raises(ValueError, match="NaN"):
            captured_energy(np.eye(4)[:, :1], np.full((4, 4), np.nan))
        # the check can be switched off for an un-normalized basis
        assert captured_energy(2 * np.eye(4)[:, :1], A, check_orthonormal=False) == 4.0


# ---------------------------------------------------------------------------
# q_comp
# ---------------------------------------------------------------------------

class TestQComp:
    A_true = np.array([[1.0, 0.0], [0.0, 1.0]])  # columns e1, e2
    # estimates: (1, 0) and (0.9, 0.1) -- both closest to e1
    A_hat = np.array([[1.0, 0.9], [0.0, 0.1]])

    def test_zero_for_exact_and_permuted_columns(self):
        rng = np.random.default_rng(0)
        A = rng.standard_normal((30, 5))
        for match in ("nearest", "hungarian"):
            assert q_comp(A, A, match) == pytest.approx(0.0, abs=1e-7)
            assert q_comp(A[:, rng.permutation(5)], A, match) == pytest.approx(0.0, abs=1e-7)

    def test_known_nearest(self):
        # col 1: distance 0 to e1; col 2: |(-.1, .1)| = .1414 to e1
        # mean = 0.1414 / 2
        assert q_comp(self.A_hat, self.A_true) == pytest.approx(np.sqrt(0.02) / 2)

    def test_known_hungarian(self):
        # one-to-one: (hat1->e1: 0) + (hat2->e2: |(.9, -.9)| = 1.2728) = 1.2728
        # beats (hat1->e2: sqrt2) + (hat2->e1: .1414) = 1.556 -> mean .6364
        assert q_comp(self.A_hat, self.A_true, "hungarian") == pytest.approx(
            np.sqrt(1.62) / 2
        )

    def test_no_sign_invariance(self):
        A = np.eye(3)
        # -e1 is at distance sqrt2 from e2, e3 and 2 from e1
        assert q_comp(-A[:, :1], A) == pytest.approx(np.sqrt(2))

    def test_validation(self):
        with pytest.raises(ValueError, match="rows"):
            q_comp(np.ones((3, 2)), np.ones((4, 2)))
        with pytest.raises(ValueError, match="match must be"):
            q_comp(self.A_hat, self.A_true, "greedy")
        with pytest.raises(ValueError, match="at most as many"):
            q_comp(np.ones((2, 3)), np.ones((2, 2)), "hungarian")
        # nearest matching allows more estimates than truths
        assert q_comp(np.ones((2, 3)), np.ones((2, 2))) == 0.0


# ---------------------------------------------------------------------------
# component matching
# ---------------------------------------------------------------------------

class TestMatchComponents:
    def test_recovers_permutation_and_signs(self):
        rng = np.random.default_rng(0)
        D, K = 500, 8
        truth = rng.standard_normal((D, K))
        perm = rng.permutation(K)
        signs = rng.choice([-1.0, 1.0], K)
        scales = rng.uniform(0.5, 5, K)
        est = np.empty_like(truth)
        est[:, perm] = truth * signs * scales + 0.2 * rng.standard_normal((D, K))
        got_perm, corr = match_components(est, truth)
        np.testing.assert_array_equal(got_perm, perm)
        np.testing.assert_array_equal(np.sign(corr), signs)
        assert np.all(np.abs(corr) > 0.9)

        aligned, acorr = align_components(est, truth)
        assert aligned.shape == truth.shape
        assert np.all(acorr > 0.9)
        for k in range(K):
            assert np.corrcoef(aligned[:, k], truth[:, k])[0, 1] == pytest.approx(acorr[k])

    def test_hungarian_beats_greedy(self):
        # Correlated truths t0 = e1, t1 = (e1 + e2)/sqrt2 and estimates
        # est0 = e1 + .4 e2 (|r| .93 with t0, .92 with t1),
        # est1 = e1 - .9 e2 (|r| .74 with t0, .05 with t1).
        # Greedy takes the largest |r| (est0, t0) first and ends with .93 + .05;
        # the optimal pairing is est1 -> t0, est0 -> t1: .74 + .92.
        rng = np.random.default_rng(1)
        M = rng.standard_normal((200, 2))
        Q, _ = np.linalg.qr(M - M.mean(axis=0))  # centred orthonormal e1, e2
        e1, e2 = Q.T
        truth = np.column_stack([e1, (e1 + e2) / np.sqrt(2)])
        est = np.column_stack([e1 + 0.4 * e2, e1 - 0.9 * e2])
        perm, corr = match_components(est, truth)
        np.testing.assert_array_equal(perm, [1, 0])
        np.testing.assert_allclose(
            corr, [1 / np.sqrt(1.81), 1.4 / np.sqrt(2 * 1.16)], rtol=1e-10
        )

    def test_more_estimates_than_truth(self):
        rng = np.random.default_rng(2)
        truth = rng.standard_normal((100, 3))
        est = np.column_stack([rng.standard_normal(100), truth[:, 2], truth[:, 0], truth[:, 1]])
        perm, corr = match_components(est, truth)
        np.testing.assert_array_equal(perm, [2, 3, 1])
        np.testing.assert_allclose(corr, 1.0)

    def test_constant_column_gets_zero_correlation(self):
        truth = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
        est = np.column_stack([np.ones(3), truth[:, 1]])
        perm, corr = match_components(est, truth)
        assert np.all(np.isfinite(corr))
        np.testing.assert_array_equal(perm, [0, 1])
        assert corr[0] == 0.0

    def test_validation(self):
        with pytest.raises(ValueError, match="fewer columns"):
            match_components(np.ones((5, 2)), np.ones((5, 3)))
        with pytest.raises(ValueError, match="rows"):
            match_components(np.ones((5, 2)), np.ones((4, 2)))
