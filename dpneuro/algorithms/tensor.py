"""Symmetric third-order tensors for orthogonal tensor decomposition (OTD).

The pieces capeAGN / AGN / AVN are built from ([CAPE-TF] Sec. V, App. B; [DP-OTD]):

- moments of the two latent-variable models of [CAPE-TF] App. B: the spherical
  mixture of Gaussians (MOG) and the single topic model (STM), either as full
  D x D x D tensors (what a site protects with noise) or directly whitened,
  M3(W, W, W), without forming the D^3 tensor;
- symmetric tensors from their C(D+2, 3) unique entries and back;
- the multilinear map T(A, B, C);
- whitening from the second moment, W = U D^{-1/2};
- the robust tensor power method of Anandkumar et al. (2014, Alg. 1), with
  all random restarts run as one batch, and deflation;
- recovery a_k = (W^T)^+ lambda_k u_k, w_k = 1 / lambda_k^2, and the
  Euclidean projection onto the probability simplex (STM).

Orientation: data matrices are D x N (samples are columns); components are
columns of D x K matrices.
"""

from __future__ import annotations

from math import comb

import numpy as np

from dpneuro.privacy import default_rng
from dpneuro.protocol.cape.packing import pack, unpack

__all__ = [
    "n_sym",
    "sym_from_unique",
    "unique_entries",
    "symmetrize",
    "multilinear",
    "rank_one_sum",
    "third_moment",
    "whitened_third_moment",
    "mog_correction",
    "mog_correction_whitened",
    "stm_second_moment",
    "stm_third_moment",
    "stm_whitened_third_moment",
    "estimate_sigma2",
    "whitening",
    "tensor_power",
    "recover",
    "project_simplex",
]

_CHUNK_ENTRIES = 4_000_000  # float64 entries per chunk of the n x D^2 product (32 MB)


# -- symmetric tensors -------------------------------------------------------------------

def n_sym(D: int) -> int:
    """Number of unique entries of a symmetric D x D x D tensor, C(D+2, 3)."""
    return comb(int(D) + 2, 3)


def sym_from_unique(vec: np.ndarray, D: int) -> np.ndarray:
    """Symmetric D x D x D tensor whose unique entries (i <= j <= k) are ``vec``.

    Vectorised with index arrays: each of the 6 index permutations is one
    fancy-index assignment (no loops over entries).
    """
    vec = np.asarray(vec, dtype=np.float64)
    if vec.shape != (n_sym(D),):
        raise ValueError(f"need C(D+2,3) = {n_sym(D)} unique entries for D = {D}, got shape {vec.shape}")
    return unpack(vec, (D, D, D), True)


def unique_entries(T: np.ndarray) -> np.ndarray:
    """The unique entries (i <= j <= k) of a symmetric 3-way tensor, in packing order."""
    return pack(np.asarray(T), True)


def symmetrize(T: np.ndarray) -> np.ndarray:
    """Orthogonal projection of a 3-way tensor onto symmetric tensors (mean over the 6 index orders).

    The result is symmetric to the last bit: it is rebuilt from its unique
    entries, so a release made from it carries no rounding asymmetry.
    """
    T = np.asarray(T, dtype=np.float64)
    if T.ndim != 3 or len(set(T.shape)) != 1:
        raise ValueError(f"need a cubic 3-way tensor, got shape {T.shape}")
    S = (T + T.transpose(0, 2, 1) + T.transpose(1, 0, 2) + T.transpose(1, 2, 0)
         + T.transpose(2, 0, 1) + T.transpose(2, 1, 0)) / 6.0
    return unpack(pack(S, True), S.shape, True)


def multilinear(T: np.ndarray, A: np.ndarray, B: np.ndarray | None = None,
                C: np.ndarray | None = None) -> np.ndarray:
    """T(A, B, C)_{abc} = sum_{ijk} T_ijk A_ia B_jb C_kc (B, C default to A).

    Three tensordots: cost D^3 K + D^2 K^2 + D K^3 for D x K factors.
    """
    B = A if B is None else B
    C = A if C is None else C
    out = np.tensordot(T, A, axes=([0], [0]))  # j, k, a
    out = np.tensordot(out, B, axes=([0], [0]))  # k, a, b
    return np.tensordot(out, C, axes=([0], [0]))  # a, b, c


def rank_one_sum(weights: np.ndarray, V: np.ndarray) -> np.ndarray:
    """sum_k w_k v_k (x) v_k (x) v_k for the columns v_k of V."""
    return np.einsum("k,ik,jk,lk->ijl", np.asarray(weights, float), V, V, V, optimize=True)


# -- moments ------------------------------------------------------------------------------

def _chunks(n: int, width: int):
    step = max(1, _CHUNK_ENTRIES // max(width, 1))
    for start in range(0, n, step):
        yield slice(start, min(start + step, n))


def third_moment(X: np.ndarray) -> np.ndarray:
    """(1/N) sum_n x_n (x) x_n (x) x_n for the columns of the D x N matrix ``X``.

    Computed as one matrix product per chunk of samples,
    [x_ni x_nj]_{i<=j}^T x_n: only the D(D+1)/2 unique pairs (i, j) are
    formed, so the cost is N D^3 / 2 multiply-adds in BLAS, memory stays
    bounded, and the result is exactly symmetric.
    """
    D, N = X.shape
    iu, ju = np.triu_indices(D)
    P = np.zeros((len(iu), D))
    for sl in _chunks(N, len(iu)):
        Xc = X[:, sl].T  # n x D
        P += (Xc[:, iu] * Xc[:, ju]).T @ Xc
    M = np.empty((D, D, D))
    M[iu, ju] = P
    M[ju, iu] = P
    return symmetrize(M / N)


def whitened_third_moment(X: np.ndarray, W: np.ndarray) -> np.ndarray:
    """(1/N) sum_n (W^T x_n)^(x)3, i.e. E[x (x) x (x) x](W, W, W) without the D^3 tensor."""
    Y = W.T @ X
    return third_moment(Y)


def mog_correction(m: np.ndarray) -> np.ndarray:
    """sum_d (m e_d e_d + e_d m e_d + e_d e_d m) as a D x D x D tensor ([CAPE-TF] App. B)."""
    m = np.asarray(m, float)
    eye = np.eye(len(m))
    return (np.einsum("i,jk->ijk", m, eye) + np.einsum("j,ik->ijk", m, eye)
            + np.einsum("k,ij->ijk", m, eye))


def mog_correction_whitened(m: np.ndarray, W: np.ndarray) -> np.ndarray:
    """``mog_correction(m)(W, W, W)`` from v = W^T m and G = W^T W (no D^3 tensor)."""
    v = W.T @ m
    G = W.T @ W
    return (np.einsum("a,bc->abc", v, G) + np.einsum("b,ac->abc", v, G)
            + np.einsum("c,ab->abc", v, G))


def stm_second_moment(words: np.ndarray, D: int) -> np.ndarray:
    """Symmetrised E[t1 t2^T] from the word ids of the first two words (``words``: L x N ints)."""
    N = words.shape[1]
    M = np.bincount(words[0] * D + words[1], minlength=D * D).reshape(D, D) / N
    return (M + M.T) / 2.0


def stm_third_moment(words: np.ndarray, D: int) -> np.ndarray:
    """Symmetrised E[t1 (x) t2 (x) t3] (D^3) from the first three words' ids."""
    N = words.shape[1]
    M = np.bincount((words[0] * D + words[1]) * D + words[2], minlength=D**3).reshape(D, D, D) / N
    return symmetrize(M)


def stm_whitened_third_moment(words: np.ndarray, W: np.ndarray) -> np.ndarray:
    """``stm_third_moment(words)(W, W, W)`` from the rows W[t_l] (no D^3 tensor).

    Symmetrising commutes with applying the same W to every mode.
    """
    Y1, Y2, Y3 = (W[words[i]] for i in range(3))  # N x K each
    N, K = Y1.shape
    M = np.zeros((K * K, K))
    for sl in _chunks(N, K * K):
        M += (Y1[sl, :, None] * Y2[sl, None, :]).reshape(-1, K * K).T @ Y3[sl]
    return symmetrize(M.reshape(K, K, K) / N)


# -- whitening ----------------------------------------------------------------------------

def estimate_sigma2(S: np.ndarray, k: int) -> float:
    """Spherical noise variance of a MOG from its (noisy) second moment E[x x^T].

    E[x x^T] = sum_k w_k a_k a_k^T + sigma^2 I, so its D - k smallest
    eigenvalues equal sigma^2; their mean is the estimate (clipped at 0).
    Applied to a noisy release it is post-processing (no privacy cost).
    """
    D = S.shape[0]
    if k >= D:
        raise ValueError(f"sigma^2 can be estimated from E[xx^T] only when k < D (k = {k}, D = {D}); "
                         "pass sigma2 explicitly")
    ev = np.linalg.eigvalsh((S + S.T) / 2.0)
    return float(max(ev[: D - k].mean(), 0.0))


def whitening(M2: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """W = U_k D_k^{-1/2} from the top-k eigenpairs of the symmetric ``M2``.

    Eigenpairs are ordered by eigenvalue (not by magnitude). A noisy M2 can
    have a k-th eigenvalue <= 0; such eigenvalues are floored at 1e-12 times
    the largest one so that W stays finite (the recovery is then poor, as it
    must be at that noise level).

    Returns
    -------
    W : ndarray, shape (D, k)
    evals : ndarray, shape (k,)
        The (floored) eigenvalues used.
    """
    M2 = (M2 + M2.T) / 2.0
    ev, U = np.linalg.eigh(M2)
    order = np.argsort(ev)[::-1][:k]
    ev, U = ev[order], U[:, order]
    floor = 1e-12 * max(abs(ev[0]), np.finfo(float).tiny)
    ev = np.maximum(ev, floor)
    return U / np.sqrt(ev)[None, :], ev


# -- tensor power method ----------------------------------------------------------------

def _normalise(V: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(V, axis=0)
    return V / np.where(n > 0, n, 1.0)


def _apply_iuu(T: np.ndarray, U: np.ndarray) -> np.ndarray:
    """T(I, u, u) for every column u of U (K x L) at once: K^3 L flops."""
    TU = np.tensordot(T, U, axes=([2], [0]))  # i, j, l
    return np.einsum("ijl,jl->il", TU, U)


def tensor_power(T: np.ndarray, k: int, *, n_restarts: int = 30, n_iter: int = 50,
                 random_state=None) -> tuple[np.ndarray, np.ndarray]:
    """Robust tensor power method with deflation (Anandkumar et al. 2014, Alg. 1).

    For each of ``k`` components: ``n_restarts`` starting points uniform on
    the sphere are iterated ``n_iter`` times with u <- T(I,u,u)/||T(I,u,u)||
    (all restarts as one batch), the one with the largest T(u,u,u) is refined
    with ``n_iter`` more iterations, its eigenvalue lambda = T(u,u,u) is
    recorded and lambda u(x)u(x)u is subtracted (deflation).

    Parameters
    ----------
    T : ndarray, shape (K, K, K)
        Symmetric tensor (e.g. the whitened M3(W, W, W)).
    k : int
        Number of components to extract (k <= K).
    n_restarts, n_iter : int
        L and N of the paper.
    random_state : None, int or numpy Generator
        Source of the random starts (not privacy noise); a Generator is used as it is.

    Returns
    -------
    lambdas : ndarray, shape (k,)
    U : ndarray, shape (K, k)
        Unit eigenvectors as columns.
    """
    T = np.array(T, dtype=np.float64)
    if T.ndim != 3 or len(set(T.shape)) != 1:
        raise ValueError(f"tensor power method needs a cubic 3-way tensor, got shape {T.shape}")
    K = T.shape[0]
    if not 1 <= k <= K:
        raise ValueError(f"cannot extract k = {k} components from a {K} x {K} x {K} tensor")
    if n_restarts < 1 or n_iter < 1:
        raise ValueError(f"n_restarts and n_iter must be >= 1, got {n_restarts}, {n_iter}")
    rng = default_rng(random_state)
    lambdas = np.zeros(k)
    U_out = np.zeros((K, k))
    for j in range(k):
        U = _normalise(rng.standard_normal((K, n_restarts)))
        for _ in range(n_iter):
            U = _normalise(_apply_iuu(T, U))
        vals = np.einsum("il,il->l", _apply_iuu(T, U), U)  # T(u, u, u) per restart
        u = U[:, [int(np.argmax(vals))]]
        for _ in range(n_iter):
            u = _normalise(_apply_iuu(T, u))
        lam = float((_apply_iuu(T, u)[:, 0]) @ u[:, 0])
        lambdas[j], U_out[:, j] = lam, u[:, 0]
        T -= lam * np.einsum("i,j,l->ijl", u[:, 0], u[:, 0], u[:, 0])
    return lambdas, U_out


def recover(W: np.ndarray, lambdas: np.ndarray, U: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Model parameters from the decomposition of M3(W, W, W) ([CAPE-TF] App. B-C).

    a_k = (W^T)^+ lambda_k u_k and w_k = 1 / lambda_k^2.
    """
    lambdas = np.asarray(lambdas, float)
    A = np.linalg.pinv(W.T) @ (U * lambdas[None, :])
    with np.errstate(divide="ignore"):
        w = 1.0 / lambdas**2
    return A, w


def project_simplex(V: np.ndarray) -> np.ndarray:
    """Euclidean projection of every column of ``V`` onto the probability simplex.

    The sort-based algorithm of Duchi et al. (2008), vectorised over columns.
    """
    V = np.asarray(V, dtype=np.float64)
    D = V.shape[0]
    srt = -np.sort(-V, axis=0)
    css = np.cumsum(srt, axis=0) - 1.0
    idx = np.arange(1, D + 1)[:, None]
    cond = srt - css / idx > 0
    rho = D - 1 - np.argmax(cond[::-1], axis=0)  # last index where cond holds
    theta = css[rho, np.arange(V.shape[1])] / (rho + 1)
    return np.maximum(V - theta[None, :], 0.0)

