"""Utility metrics for recovered components.

All functions take plain numpy arrays and return Python floats (or small
arrays). Orientation follows the project convention: spatial maps / mixing
vectors are *columns* of a D x R matrix, an unmixing matrix is R x R.

- :func:`qngi` -- normalized Moreau-Amari inter-symbol interference (the
  papers' "normalized gain index"), 0 for a scaled permutation.
- :func:`md_index` -- minimum distance index of Ilmonen et al. (2010).
- :func:`captured_energy` -- tr(V^T A V) of a subspace estimate.
- :func:`q_comp` -- mean distance of estimated columns to the true columns.
- :func:`match_components` / :func:`align_components` -- pair estimated maps
  with ground-truth maps by absolute correlation (Hungarian matching).
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linear_sum_assignment

__all__ = [
    "qngi",
    "md_index",
    "captured_energy",
    "q_comp",
    "match_components",
    "align_components",
]


# ---------------------------------------------------------------------------
# validation helpers
# ---------------------------------------------------------------------------

def _as_matrix(x, name: str) -> np.ndarray:
    """Return `x` as a finite 2-D float64 array or raise ValueError."""
    arr = np.asarray(x)
    if arr.dtype == object or not (
        np.issubdtype(arr.dtype, np.number) or arr.dtype == bool
    ):
        raise ValueError(f"{name} must be a numeric array, got dtype {arr.dtype}")
    if np.iscomplexobj(arr):
        raise ValueError(f"{name} must be real, got a complex array")
    arr = arr.astype(np.float64, copy=False)
    if arr.ndim != 2:
        raise ValueError(f"{name} must be a 2-D matrix, got shape {arr.shape}")
    if arr.size == 0:
        raise ValueError(f"{name} is empty (shape {arr.shape})")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} contains NaN or infinite values")
    return arr


def _check_square(arr: np.ndarray, name: str) -> None:
    if arr.shape[0] != arr.shape[1]:
        raise ValueError(f"{name} must be square, got shape {arr.shape}")


# ---------------------------------------------------------------------------
# unmixing quality
# ---------------------------------------------------------------------------

def qngi(P) -> float:
    """Normalized Moreau-Amari index (qNGI) of a square gain matrix.

    For ``P = W_est @ A_true`` (R x R),

    .. math::

        \\frac{1}{2R(R-1)} \\Big[\\sum_i \\Big(\\sum_j \\frac{|p_{ij}|}
        {\\max_k |p_{ik}|} - 1\\Big) + \\sum_j \\Big(\\sum_i
        \\frac{|p_{ij}|}{\\max_k |p_{kj}|} - 1\\Big)\\Big]

    Parameters
    ----------
    P : array_like, shape (R, R)
        Gain matrix (estimated unmixing times true mixing).

    Returns
    -------
    float
        Value in [0, 1]; 0 exactly for a scaled permutation matrix, values
        below about 0.1 mean a usable separation. For R = 1 the index is 0.

    Raises
    ------
    ValueError
        If `P` is not a finite square matrix, or has an all-zero row or
        column (a degenerate unmixing for which the index is undefined).
    """
    P = np.abs(_as_matrix(P, "P"))
    _check_square(P, "P")
    R = P.shape[0]
    row_max = P.max(axis=1)
    col_max = P.max(axis=0)
    if np.any(row_max == 0) or np.any(col_max == 0):
        raise ValueError("P has an all-zero row or column; qNGI is undefined")
    if R == 1:
        return 0.0
    rows = (P / row_max[:, None]).sum(axis=1) - 1.0
    cols = (P / col_max[None, :]).sum(axis=0) - 1.0
    value = (rows.sum() + cols.sum()) / (2.0 * R * (R - 1))
    # guard against rounding just outside [0, 1]
    return float(np.clip(value, 0.0, 1.0))


def md_index(W_est, A_true) -> float:
    """Minimum distance index of Ilmonen, Nordhausen, Oja & Ollila (2010).

    With ``G = W_est @ A_true`` (R x R) and the row-normalized squares
    ``G~_ij = g_ij^2 / sum_j g_ij^2``,

    ``MD = sqrt(R - max_P tr(P G~)) / sqrt(R - 1)``,

    the maximum taken over permutation matrices P (solved exactly with the
    Hungarian algorithm).

    Parameters
    ----------
    W_est : array_like, shape (R, D)
        Estimated unmixing matrix (usually square, R = D).
    A_true : array_like, shape (D, R)
        True mixing matrix.

    Returns
    -------
    float
        Value in [0, 1]; 0 for a scaled permutation (invariant to the
        scale, sign and order of the estimated rows). For R = 1 it is 0.

    Raises
    ------
    ValueError
        If the inputs are not finite matrices, their product is not square,
        or ``G`` has an all-zero row.
    """
    W = _as_matrix(W_est, "W_est")
    A = _as_matrix(A_true, "A_true")
    if W.shape[1] != A.shape[0]:
        raise ValueError(
            f"W_est {W.shape} and A_true {A.shape} cannot be multiplied"
        )
    G = W @ A
    _check_square(G, "W_est @ A_true")
    R = G.shape[0]
    G2 = G**2
    row_sums = G2.sum(axis=1)
    if np.any(row_sums == 0):
        raise ValueError("W_est @ A_true has an all-zero row; MD index is undefined")
    if R == 1:
        return 0.0
    G_tilde = G2 / row_sums[:, None]
    rows, cols = linear_sum_assignment(G_tilde, maximize=True)
    best = G_tilde[rows, cols].sum()
    value = np.sqrt(max(R - best, 0.0)) / np.sqrt(R - 1)
    return float(min(value, 1.0))


# ---------------------------------------------------------------------------
# subspace and component quality
# ---------------------------------------------------------------------------

def captured_energy(V, A, *, check_orthonormal: bool = True, atol: float = 1e-4) -> float:
    """Energy of a second-moment matrix captured by a subspace: tr(V^T A V).

    Parameters
    ----------
    V : array_like, shape (D, k)
        Subspace basis with orthonormal columns (e.g. top-k eigenvectors
        returned by a (DP) PCA).
    A : array_like, shape (D, D)
        True second-moment matrix (e.g. the pooled, non-private ``X X^T / N``).
    check_orthonormal : bool, default True
        Check ``V^T V = I`` up to `atol` (catches a V given as k x D or
        un-normalized columns, which would silently inflate the value).
    atol : float, default 1e-4
        Absolute tolerance of the orthonormality check.

    Returns
    -------
    float
        ``tr(V^T A V)``. Report it as a ratio ``q / q_pooled_nonprivate``.
    """
    V = _as_matrix(V, "V")
    A = _as_matrix(A, "A")
    _check_square(A, "A")
    if V.shape[0] != A.shape[0]:
        raise ValueError(
            f"V has {V.shape[0]} rows but A is {A.shape[0]} x {A.shape[1]}; "
            "V must be D x k with orthonormal columns"
        )
    if V.shape[1] > V.shape[0]:
        raise ValueError(
            f"V has more columns than rows ({V.shape}); expected D x k with k <= D"
        )
    if check_orthonormal:
        gram = V.T @ V
        if not np.allclose(gram, np.eye(V.shape[1]), atol=atol, rtol=0.0):
            err = np.abs(gram - np.eye(V.shape[1])).max()
            raise ValueError(
                f"V does not have orthonormal columns (max |V^T V - I| = {err:.3g})"
            )
    # sum of (A V) * V == tr(V^T A V) without forming the k x k product
    return float(np.einsum("ij,ij->", A @ V, V))


def _column_distances(A_hat: np.ndarray, A_true: np.ndarray) -> np.ndarray:
    """K x J Euclidean distances between columns of A_hat and of A_true."""
    # ||a - b||^2 = |a|^2 + |b|^2 - 2 a.b ; clip tiny negatives from rounding
    sq = (
        (A_hat**2).sum(axis=0)[:, None]
        + (A_true**2).sum(axis=0)[None, :]
        - 2.0 * (A_hat.T @ A_true)
    )
    return np.sqrt(np.maximum(sq, 0.0))


def q_comp(A_hat, A_true, match: str = "nearest") -> float:
    """Mean distance of estimated components to the true components.

    ``q_comp = (1/K) sum_k min_j ||a_hat_k - a_j||_2`` over the K columns of
    `A_hat` (``match="nearest"``, as in the papers; several estimates may
    pick the same true column), or the mean distance under the best
    one-to-one assignment (``match="hungarian"``).

    Parameters
    ----------
    A_hat : array_like, shape (D, K)
        Estimated components as columns.
    A_true : array_like, shape (D, J)
        True components as columns (J >= K for ``"hungarian"``).
    match : {"nearest", "hungarian"}
        Matching rule.

    Returns
    -------
    float
        Mean Euclidean distance (0 when the columns coincide). No sign or
        scale is removed: the metric is meant for methods (moment/tensor
        decompositions) that recover components with their true scale.
    """
    Ah = _as_matrix(A_hat, "A_hat")
    At = _as_matrix(A_true, "A_true")
    if Ah.shape[0] != At.shape[0]:
        raise ValueError(
            f"A_hat has {Ah.shape[0]} rows but A_true has {At.shape[0]}; "
            "components must be columns of D x K matrices"
        )
    dist = _column_distances(Ah, At)
    if match == "nearest":
        return float(dist.min(axis=1).mean())
    if match == "hungarian":
        if Ah.shape[1] > At.shape[1]:
            raise ValueError(
                f"hungarian matching needs at most as many estimated components "
                f"({Ah.shape[1]}) as true ones ({At.shape[1]})"
            )
        rows, cols = linear_sum_assignment(dist)
        return float(dist[rows, cols].mean())
    raise ValueError(f"match must be 'nearest' or 'hungarian', got {match!r}")


# ---------------------------------------------------------------------------
# map matching
# ---------------------------------------------------------------------------

def _correlations(est: np.ndarray, truth: np.ndarray) -> np.ndarray:
    """Pearson correlations between columns: K_est x K_true (0 for constant columns)."""
    e = est - est.mean(axis=0)
    t = truth - truth.mean(axis=0)
    ne = np.linalg.norm(e, axis=0)
    nt = np.linalg.norm(t, axis=0)
    # a constant column has no direction: give it correlation 0 rather than NaN
    ne[ne == 0] = np.inf
    nt[nt == 0] = np.inf
    return (e.T @ t) / ne[:, None] / nt[None, :]


def match_components(est, truth) -> tuple[np.ndarray, np.ndarray]:
    """Pair estimated columns with ground-truth columns by |correlation|.

    Solves the one-to-one assignment that maximises the summed absolute
    Pearson correlation (Hungarian algorithm).

    Parameters
    ----------
    est : array_like, shape (D, K_est)
        Estimated maps as columns (any order, sign and scale).
    truth : array_like, shape (D, K)
        Ground-truth maps as columns, K <= K_est.

    Returns
    -------
    perm : ndarray of int, shape (K,)
        ``est[:, perm[k]]`` is the estimate paired with ``truth[:, k]``.
    corr : ndarray of float, shape (K,)
        Signed correlation of each pair. Multiply the estimate by
        ``np.sign(corr)`` to flip it so the correlation is positive
        (see :func:`align_components`).
    """
    E = _as_matrix(est, "est")
    T = _as_matrix(truth, "truth")
    if E.shape[0] != T.shape[0]:
        raise ValueError(
            f"est has {E.shape[0]} rows but truth has {T.shape[0]}; "
            "maps must be columns of D x K matrices"
        )
    if E.shape[1] < T.shape[1]:
        raise ValueError(
            f"est has fewer columns ({E.shape[1]}) than truth ({T.shape[1]})"
        )
    C = _correlations(E, T)  # K_est x K
    # assign every truth column (rows of C.T) to a distinct estimate
    t_idx, e_idx = linear_sum_assignment(np.abs(C.T), maximize=True)
    perm = np.empty(T.shape[1], dtype=np.intp)
    perm[t_idx] = e_idx
    corr = C[perm, np.arange(T.shape[1])]
    return perm, corr


def align_components(est, truth) -> tuple[np.ndarray, np.ndarray]:
    """Reorder and sign-flip estimated maps to best match the ground truth.

    Parameters
    ----------
    est : array_like, shape (D, K_est)
    truth : array_like, shape (D, K)

    Returns
    -------
    aligned : ndarray, shape (D, K)
        ``est[:, perm] * sign(corr)``: column k pairs with ``truth[:, k]``
        and correlates non-negatively with it.
    corr : ndarray, shape (K,)
        The (now non-negative) correlations of the pairs.
    """
    perm, corr = match_components(est, truth)
    signs = np.where(corr < 0, -1.0, 1.0)
    aligned = np.asarray(est, dtype=np.float64)[:, perm] * signs[None, :]
    return aligned, np.abs(corr)
