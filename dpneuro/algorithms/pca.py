"""capePCA and its baselines: private distributed dimension reduction.

[CAPE-TF] Sec. IV and Alg. 2, [capeDJICA] Alg. 3 (capePCA); [DPdisPCA] Alg. 1 (DPdisPCA);
Dwork et al.'s Analyze Gauss (pooled DP and local baselines).

Methods
-------
:func:`cape_pca`
    Every site releases its second-moment matrix ``A_s = X_s X_s^T / N_s``
    with noise under a :class:`~dpneuro.protocol.cape.NoisePlan`: ``"cape"``
    (correlated noise: the weighted average carries the pooled noise
    variance), ``"conv"`` (independent noise of the full std at every site)
    or ``"none"`` (no noise: the pooled non-private answer). The aggregator
    eigendecomposes the weighted average and releases the top-k eigenvectors
    and eigenvalues (post-processing). ``mode="power"`` replaces the one-shot
    D x D release by a noisy subspace iteration for voxel-level D (below).
:func:`pooled_dp_pca`, :func:`local_pca`
    Analyze Gauss on the pooled data (sensitivity 1/N) and on one site alone:
    the same algorithm run with one "site" under plan ``"conv"``.
:func:`dpdispca`
    DPdisPCA ([DPdisPCA] Alg. 1): each site adds conventional noise to ``A_s``,
    eigendecomposes locally and sends ``P_s = U_R Sigma_R^{1/2}`` (D x R);
    the aggregator takes the top-k left singular vectors of the stacked
    ``[sqrt(w_1) P_1 ... sqrt(w_S) P_S]``. It reuses capePCA's site
    computation and calibration; since its release is a *nonlinear*, site-
    specific post-processing of the noisy matrix and the aggregator needs the
    individual ``P_s`` (not their average), it is its own one-phase protocol
    on the generic driver rather than a CAPE plan.

Scaling (the consortium-agreed preprocessing)
---------------------------------------------
Every sensitivity below assumes each column (time point) has L2 norm <= 1.
``scale`` says how that is ensured, at each site, column by column:

``None``    the data already satisfy it (checked; an error otherwise). Whatever
            preprocessing made it so is outside this ledger.
``c``       a public constant agreed by the consortium (a float): columns are
            divided by ``c`` and any still above norm 1 are clipped to norm 1.
            The constant is public, not derived from the data privately.
``"clip"``  ``x / max(1, ||x||)``.
``"unit"``  ``x / ||x||`` (every time point on the unit sphere; zero columns stay 0).

All four act on each column alone, so they cost no privacy; the ledger
carries a note saying which one was used. The papers' preprocessing (divide
by the largest norm in the pooled data) is *not* private; the benchmarks do it
as the papers did, before calling these functions, and say so.

Privacy unit and sensitivity
----------------------------
Neighbouring datasets differ by *replacing* one unit at one site (dpneuro's
relation, ``neighbour="replace"``, the default): the site's counts ``N_s``
(columns) and ``M_s`` (subjects) are public metadata used as the denominators.
``neighbour="add-remove"`` (one unit added or removed while the denominator
stays N_s, the papers' convention: bounds sqrt(2) times smaller) exists only to
reproduce the papers' tables; with public counts it is really "zero out one
unit", which under-states what a swap of one person for another changes.

* Sample level (no subject boundaries): adding x (||x|| <= 1) changes
  N_s A_s by ||x x^T||_F = ||x||^2 <= 1. Every bound here is on the Frobenius
  norm, which is exactly the L2 norm of the vector the noise is drawn on,
  w(A) = the upper triangle with the off-diagonal entries times sqrt(2)
  (``symmetric_noise="symmetrized"``; :mod:`dpneuro.protocol.cape.packing`), and bounds
  the unique entries u(A) the papers' "mirrored" noise is drawn on. So
  Delta = 1 / N_s.
* Subject level (``subjects`` given, or the site's data come as per-subject
  blocks): a subject with n_m columns adds P = X_m X_m^T, PSD with
  ||P||_F <= tr P <= n_m, so Delta = max_m n_m / N_s, i.e. 1/M_s for equal
  scan lengths (see docs/privacy.md).
* Replacement: ||P - P'||_F^2 = ||P||_F^2 + ||P'||_F^2 - 2<P, P'> <= 2 n_m^2
  (<P, P'> >= 0 for PSD matrices): Delta = sqrt(2) n_m / N_s.
* Subject bound (``subject_bound=c`` < 1): a subject's normalised second
  moment P_m / n_m has trace <= 1 but is rarely rank one, so its Frobenius
  norm is typically well below 1 on real fMRI. Each P_m is scaled by
  min(1, c n_m / ||P_m||_F) (still PSD, now ||P_m||_F <= c n_m), and the
  same replacement argument gives Delta = sqrt(2) c max_m n_m / N_s: the
  noise shrinks by c at the cost of down-weighting the few subjects above it.
* Subspace contributions (``contribution="subspace"``): a subject adds
  P_m = (n_m / k) U_m U_m^T instead of X_m X_m^T, with U_m (D x r, r <= k)
  the top-k left singular vectors of its unit-norm block (per-subject PCA,
  as CanICA and MELODIC reduce each subject before the group step). P_m is
  PSD with trace <= n_m like X_m X_m^T, but its Frobenius norm is
  n_m sqrt(r) / k <= n_m / sqrt(k) whatever the data: every subject weighs
  the same, the dominant first eigenvalue of fMRI no longer sets the bound,
  and the replacement argument gives Delta = sqrt(2) c max_m n_m / N_s with
  c = min(subject bound, 1 / sqrt(k)) (no clipping needed at c = 1/sqrt(k)).
  The released eigenvalues then measure how consistently subjects share a
  direction (1/k each when all share it), not variance.
* Variances in the subspace (``variances=True``, subspace contributions only):
  whitening needs each component's variance, which subspace contributions do
  not carry. One more release, in the round after the basis V (D x k) is
  public, gives them: each site releases the k x k second moment of its
  projected data, sum_m f_m V^T X_m X_m^T V / N_s, each subject's term
  clipped to Frobenius norm <= c n_m (c the subject bound, 1 without one:
  ||V^T x|| <= ||x|| <= 1). It is a second moment of unit-bounded columns, so
  the replacement argument above gives Delta = sqrt(2) c max_m n_m / N_s, and
  its noise lives in k(k+1)/2 entries instead of D(D+1)/2: at D = 900 and
  k = 20 the noise's spectral norm is ~7x smaller for the same sigma. The
  aggregator eigendecomposes the noisy k x k average, H = U diag(theta) U^T,
  and returns the basis V U with the variances theta (post-processing), each
  raised to at least :data:`VARIANCE_FLOOR` times their mean (times 1/k when
  the noise leaves that mean <= 0; an eigenvalue pushed below the floor would
  whiten its component by a factor the data do not support). The run's (eps, delta) is split exactly in GDP:
  the variance release gets ``variance_share`` of mu^2 (noise multiplier
  z / sqrt(share)), the basis the rest (z / sqrt(1 - share), times
  sqrt(n_iter) per power round), so the two compose to the run's (eps, delta).
* Power mode releases A_s V with V (D x b) orthonormal and public:
  ||x x^T V||_F = ||x|| ||V^T x|| <= 1 and ||(P - P') V||_F <= ||P - P'||_F,
  so the sensitivities are exactly those of the covariance mode.

Power mode (noisy subspace iteration)
-------------------------------------
For voxel-level D the D x D matrix cannot be formed. Round t: the aggregator
broadcasts V_t (D x b, orthonormal; V_0 random and data-independent); each
site streams its data subject by subject and releases
``A_s V_t = sum_m X_m (X_m^T V_t) / N_s`` with noise; the aggregator
orthonormalises the weighted average (QR). After ``n_iter`` releases the last
one is used for a Rayleigh-Ritz step: with Y = (noisy) A V_{T-1},
H = sym(V_{T-1}^T Y) = U diag(theta) U^T, the basis is V_{T-1} U (top k by
theta) and theta are its Rayleigh quotients -- post-processing only. The T
Gaussian releases compose exactly in GDP (mu^2 = T (Delta/sigma)^2), so each
round uses the noise multiplier sqrt(T) * z(eps, delta) and the whole run is
(eps, delta); the ledger records the T releases. Memory per site is
O(D b + one subject).

Without noise (``tol``) the aggregator also takes the Rayleigh-Ritz pairs of
every round's product and stops as soon as every one of the top k has a
relative residual ||A w - theta w|| <= tol * theta_1; ``n_iter`` is then the
cap. Stopping looks at the data, which only a run without privacy may do: with
noise the number of releases is fixed in advance (and planned).

Eigenvectors are ordered by eigenvalue (descending), never by |eigenvalue|:
a large negative noise eigenvalue is not signal. Returned eigenvalues are
those of the noisy average; they can be small or negative at strong privacy,
so whitening code must floor them.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import scipy.linalg

from dpneuro import privacy
from dpneuro._utils.errors import UnsafeRelease
from dpneuro.data.matrix import NpyColumns, column_blocks, column_norms, scale_factors, subject_ranges
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import ReleaseSpec, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers
from dpneuro.protocol.cape.packing import check_symmetric_noise
from dpneuro.protocol.cape.plans import NoisePlan
from dpneuro.protocol.driver import Phase, RunOptions, State
from dpneuro.protocol.exchange import Payload
from dpneuro.protocol.simulation import simulate

__all__ = [
    "CapePCA",
    "DPdisPCA",
    "PCAResult",
    "SiteSource",
    "cape_pca",
    "dpdispca",
    "local_pca",
    "pca_sensitivity",
    "pooled_dp_pca",
    "top_eigh",
]

MODES = ("covariance", "power")
#: what one subject adds to the second moment: its X_m X_m^T, or (n_m / k) times the projector on its top-k
#: principal subspace (module docstring)
CONTRIBUTIONS = ("moment", "subspace")
#: share of the PCA's mu^2 (GDP) the variance release gets when ``variances=True`` (benchmarks/djica_utility.py)
VARIANCE_SHARE = 0.5
#: released variances are raised to at least this fraction of their mean (module docstring)
VARIANCE_FLOOR = 0.2
NEIGHBOURS = ("replace", "add-remove")
_NORM_TOL = 1e-6  # relative slack when checking ||x|| <= 1 on already-scaled data

#: what D and N are in a refusal of too many components (users meet them as parcels and time points)
_DN = "D is the number of features (parcels, atlas regions or voxels), N the time points of all sites"


# -- linear algebra helpers ------------------------------------------------------------------

def _fix_signs(V: np.ndarray) -> np.ndarray:
    """Make the largest-magnitude entry of every column positive (a deterministic sign)."""
    idx = np.argmax(np.abs(V), axis=0)
    signs = np.sign(V[idx, np.arange(V.shape[1])])
    signs[signs == 0] = 1.0
    return V * signs


def top_eigh(A: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """Top-``k`` eigenpairs of a symmetric matrix, ordered by eigenvalue (descending).

    Ordering is by value, not by |value| (the reference code's SVD orders by
    magnitude, which promotes large negative noise eigenvalues). Signs follow
    :func:`_fix_signs`.

    Returns
    -------
    eigenvalues : ndarray, shape (k,)
    V : ndarray, shape (D, k), orthonormal columns
    """
    A = np.asarray(A, dtype=np.float64)
    A = (A + A.T) / 2
    D = A.shape[0]
    lam, U = scipy.linalg.eigh(A, subset_by_index=[D - k, D - 1])
    order = np.argsort(lam)[::-1]
    return lam[order], _fix_signs(U[:, order])


def orthonormalize(Y: np.ndarray) -> np.ndarray:
    """Q of the QR decomposition with diag(R) >= 0 (so Q is a deterministic function of Y)."""
    Q, R = np.linalg.qr(Y)
    d = np.sign(np.diag(R))
    d[d == 0] = 1.0
    return Q * d


# -- site data ------------------------------------------------------------------------------

class SiteSource:
    """One site's data, read block by block so that at most one block is in memory.

    Parameters
    ----------
    data
        One of: a D x N array (in memory or a ``numpy.memmap``); the path of a
        ``.npy`` file or a :class:`dpneuro.data.matrix.NpyColumns` (read block by block
        from the file); a :class:`dpneuro.data.matrix.SiteData` (its
        subject boundaries are used); a sequence of D x N_m arrays (one per
        subject); or a callable returning a fresh iterable of D x N_m blocks on
        every call (e.g. ``site_data.iter_subjects``), one block per subject.
    subjects
        For array data only: the subjects' columns -- an int M (equal
        lengths), a list of lengths, or a list of ``(start, stop)`` ranges.
    chunk_columns
        Block width when an array without subject boundaries is streamed
        (default: about 64 MB of float64 per block).

    Notes
    -----
    :meth:`validate` reads the data once (shape, finite values, column norms)
    before anything is released; it is called by the algorithms' ``site_init``.
    """

    def __init__(self, data: Any, subjects: Any = None, *, chunk_columns: int | None = None):
        self._array: np.ndarray | None = None
        self._blocks_fn: Callable[[], Any] | None = None
        self._ranges: list[tuple[int, int]] | None = None
        self._subjects_spec = subjects
        self.chunk_columns = None if chunk_columns is None else max(1, int(chunk_columns))
        self.validated = False
        self.dim = self.n_samples = 0
        self.lengths: list[int] | None = None
        self.max_norm = 0.0
        if isinstance(data, (str, os.PathLike)):
            data = NpyColumns(data)
        if hasattr(data, "X") and hasattr(data, "boundaries") and hasattr(data, "iter_subjects"):
            if subjects is None:
                self._subjects_spec = [tuple(b) for b in data.boundaries]
            data = data.X
        if isinstance(data, np.ndarray):
            if data.ndim != 2:
                raise ValueError(f"site data must be a D x N matrix, got shape {data.shape}")
            if not (np.issubdtype(data.dtype, np.floating) or np.issubdtype(data.dtype, np.integer)):
                raise ValueError(f"site data must be real numbers, got dtype {data.dtype}")
            self._array = data
        elif isinstance(data, NpyColumns):
            self._array = data
        elif callable(data):
            self._blocks_fn = data
        elif isinstance(data, (list, tuple)):
            blocks = list(data)
            self._blocks_fn = lambda: iter(blocks)
        else:
            raise TypeError(f"unsupported site data {type(data).__name__}: give an array, a .npy path, a "
                            "SiteData, a list of blocks, or a callable returning an iterable of blocks "
                            "(a one-shot generator cannot be read once per round)")
        if self._blocks_fn is not None and subjects is not None:
            raise ValueError("subjects can only be given for array data; a block source has one block per subject")

    @property
    def has_subjects(self) -> bool:
        return self.lengths is not None

    def blocks(self):
        """Yield the site's data as D x n_b blocks (one subject each when subjects are known)."""
        if self._array is not None:
            ranges = self._ranges
            if ranges is None and self.chunk_columns:
                n = self._array.shape[1]
                ranges = [(a, min(a + self.chunk_columns, n)) for a in range(0, n, self.chunk_columns)]
            # default width: about 64 MB once a block is float64 (column_blocks counts 4-byte values)
            for _, _, blk in column_blocks(self._array, ranges, block_bytes=1 << 25):
                yield blk
                del blk  # before the next block is read: one subject in memory
        else:
            it = self._blocks_fn()
            if it is None:
                raise TypeError("the block source returned None instead of an iterable of blocks")
            # no local name for the block: a suspended generator would keep the previous
            # subject alive while the next one is read (two subjects in memory)
            yield from it

    def validate(self, name: str = "site") -> SiteSource:
        """Read the data once: common D, finite values, column norms. Idempotent."""
        if self.validated:
            return self
        if self._array is not None:
            n = self._array.shape[1]
            if self._subjects_spec is not None:
                self._ranges = subject_ranges(self._subjects_spec, n)
                self.lengths = [b - a for a, b in self._ranges]
        dim, n_total, lengths, max_norm = None, 0, [], 0.0
        for i, blk in enumerate(self.blocks()):
            blk = np.asarray(blk)
            if blk.ndim != 2:
                raise ValueError(f"{name}: block {i} must be a D x N_m matrix, got shape {blk.shape}")
            if not (np.issubdtype(blk.dtype, np.floating) or np.issubdtype(blk.dtype, np.integer)):
                raise ValueError(f"{name}: block {i} must hold real numbers, got dtype {blk.dtype}")
            if dim is None:
                dim = blk.shape[0]
            elif blk.shape[0] != dim:
                raise ValueError(f"{name}: block {i} has {blk.shape[0]} features, the first block has {dim}")
            if blk.shape[1] == 0:
                raise ValueError(f"{name}: block {i} has no columns")
            norms = column_norms(blk)  # finite norms <=> finite entries, without a D x n_b mask
            if not np.isfinite(norms).all():
                if not np.isfinite(blk).all():
                    raise ValueError(f"{name}: data contain NaN or infinite values (block {i}); "
                                     "nothing was released")
                raise ValueError(f"{name}: column norms overflow (block {i}); rescale the data")
            max_norm = max(max_norm, float(norms.max()))
            n_total += blk.shape[1]
            lengths.append(blk.shape[1])
            del blk  # before the next block is read
        if dim is None or n_total == 0:
            raise ValueError(f"{name}: no data")
        if dim < 1:
            raise ValueError(f"{name}: data have no features (D = 0)")
        self.dim, self.n_samples, self.max_norm = int(dim), int(n_total), max_norm
        if self._blocks_fn is not None:
            self.lengths = lengths
        self.validated = True
        return self


def as_source(data: Any, subjects: Any = None) -> SiteSource:
    if isinstance(data, SiteSource):
        if subjects is not None:
            raise ValueError("give subjects when building the SiteSource, not again")
        return data
    return SiteSource(data, subjects)


def _check_scale(scale) -> None:
    if scale is None or scale in ("clip", "unit"):
        return
    if isinstance(scale, str):
        raise ValueError(f"scale must be None, a positive number, 'clip' or 'unit'; got {scale!r}")
    c = float(scale)
    if not (c > 0 and math.isfinite(c)):
        raise ValueError(f"scale constant must be positive and finite, got {scale}")


def scale_note(scale) -> str:
    if scale is None:
        return ("data were given already scaled to column norm <= 1 (checked); the consortium-agreed "
                "preprocessing that did so is public and is not covered by this ledger")
    if scale == "clip":
        return "each column clipped to norm <= 1 (x / max(1, ||x||)): per-sample, no data-dependent constant"
    if scale == "unit":
        return "each column scaled to unit norm (x / ||x||): per-sample, no data-dependent constant"
    return (f"columns divided by the consortium-agreed constant c = {float(scale):.6g}, then clipped to "
            "norm <= 1; c is public (agreed beforehand), not derived privately from the data")


#: relative slack on a clipped subject's Frobenius norm, so that rounding never lets it exceed the bound
_CLIP_SLACK = 1e-9


def subject_clip_factor(gram_fro: float, n_columns: int, bound: float) -> float:
    """min(1, bound * n_m / ||P_m||_F): the multiplier that clips one subject's P_m = X_m X_m^T.

    ``gram_fro`` is ||P_m||_F of the subject's scaled block; ``bound`` is the
    public bound on the normalised matrix P_m / n_m (:func:`check_subject_bound`).
    """
    cap = bound * n_columns * (1.0 - _CLIP_SLACK)
    return 1.0 if gram_fro <= cap else cap / gram_fro


def gram_frobenius(B: np.ndarray) -> float:
    """||B B^T||_F from the smaller Gram matrix (same non-zero spectrum), in float64."""
    B = np.asarray(B, dtype=np.float64)
    G = B.T @ B if B.shape[1] <= B.shape[0] else B @ B.T
    return float(np.linalg.norm(G))


#: singular values below this fraction of the largest are rank deficiency, not a direction of the subject
_RANK_RTOL = 1e-6


def subspace_factor(B: np.ndarray, k: int) -> np.ndarray:
    """L (n x r) with B L = U_r, the top r = min(k, rank B) left singular vectors of the D x n block B.

    From the smaller Gram matrix in float64 (as :func:`gram_frobenius`), so a voxel-level block costs
    O(D n min(D, n)), never a D x D eigendecomposition when n < D.
    """
    B = np.asarray(B, dtype=np.float64)
    D, n = B.shape
    G = B.T @ B if n <= D else B @ B.T
    s2, E = np.linalg.eigh((G + G.T) / 2)
    order = np.argsort(s2)[::-1][:k]
    s2, E = s2[order], E[:, order]
    keep = s2 > (_RANK_RTOL ** 2) * max(float(s2[0]), 0.0) if s2.size and s2[0] > 0 else np.zeros(0, bool)
    s2, E = s2[keep], E[:, keep]
    if n <= D:  # E holds right singular vectors W: U = B W / s
        return E / np.sqrt(s2)
    return (B.T @ E) / s2  # E holds U: W / s = B^T U / s^2


def subject_factors(B: np.ndarray, contribution: str, k: int, bound: float | None):
    """One subject's contribution P_m as factors of its scaled block B (D x n_m): P_m = B K B^T.

    Returns the clip multiplier f (a float, K = f I) for ``"moment"``, or L (n_m x r) with K = L L^T for
    ``"subspace"`` (clip included in both).
    """
    n = B.shape[1]
    if contribution == "subspace":
        L = subspace_factor(B, k) * math.sqrt(n / k)  # P_m = (n_m / k) U U^T, ||P_m||_F = n_m sqrt(r) / k
        if bound is not None:
            L *= math.sqrt(subject_clip_factor(n * math.sqrt(L.shape[1]) / k, n, bound))
        return L
    return 1.0 if bound is None else subject_clip_factor(gram_frobenius(B), n, bound)


def second_moment(src: SiteSource, scale, subject_bound: float | None = None, contribution: str = "moment",
                  k: int | None = None) -> np.ndarray:
    """A_s = sum over blocks (subjects) of P_m / N_s, P_m from the scaled block (B F) (F the column factors).

    P_m = f_m (B F)(B F)^T with f_m :func:`subject_clip_factor` under ``subject_bound`` (None: no
    clipping), or with ``contribution="subspace"`` (n_m / k) times the projector on the block's top-k
    principal subspace (:func:`subject_factors`).
    """
    D = src.dim
    A = np.zeros((D, D))
    for blk in src.blocks():
        B = np.asarray(blk, dtype=np.float64)
        B = B * scale_factors(column_norms(B), scale)
        if contribution == "subspace":
            U = B @ subject_factors(B, contribution, k, subject_bound)
            A += U @ U.T
        else:
            P = B @ B.T
            if subject_bound is not None:
                P *= subject_clip_factor(float(np.linalg.norm(P)), B.shape[1], subject_bound)
            A += P
        del blk, B  # before the next block is read
    A /= src.n_samples
    return (A + A.T) / 2


def second_moment_times(src: SiteSource, scale, V: np.ndarray, subject_bound: float | None = None,
                        factors: list | None = None, contribution: str = "moment",
                        k: int | None = None) -> np.ndarray:
    """A_s V streamed: sum over blocks of B F K_m F (B^T V) / N_s, never forming A_s.

    K_m is the subject's :func:`subject_factors` (f_m I, or L L^T for subspace contributions). Float32
    data are multiplied in float32 (half the memory and time of a float64 copy of the block) and
    accumulated in float64. The factors depend on the data only: pass a list as ``factors`` to keep them
    from the first call (filled when empty) instead of recomputing them.
    """
    shaped = subject_bound is not None or contribution == "subspace"
    known = bool(factors)
    Y = np.zeros((src.dim, V.shape[1]))
    for i, blk in enumerate(src.blocks()):
        B = np.asarray(blk)
        if B.dtype not in (np.float32, np.float64):
            B = B.astype(np.float64)
        fs = scale_factors(column_norms(B), scale)
        K = 1.0
        if shaped:
            if known:
                K = factors[i]
            else:
                K = subject_factors(B * fs, contribution, k, subject_bound)
                if factors is not None:
                    factors.append(K)
        C = B.T @ V.astype(B.dtype, copy=False)
        if isinstance(K, np.ndarray):  # the projector's n_m x n_m middle factor, in float64
            C *= fs[:, None].astype(B.dtype, copy=False)
            C = (K @ (K.T @ C)).astype(B.dtype, copy=False)
            C *= fs[:, None].astype(B.dtype, copy=False)
        else:
            C *= (K * fs ** 2)[:, None].astype(B.dtype, copy=False)
        Y += B @ C
        del blk, B, C  # before the next block is read: one subject in memory
    Y /= src.n_samples
    return Y


def projected_second_moment(src: SiteSource, scale, V: np.ndarray, subject_bound: float | None = None) -> np.ndarray:
    """sum over subjects of f_m V^T B_m B_m^T V / N_s (k x k), each term clipped to ``subject_bound`` * n_m.

    The variance release of ``variances=True`` (module docstring): the second moment of the scaled data
    projected on the public basis V (D x k, orthonormal), streamed one subject at a time.
    """
    k = V.shape[1]
    H = np.zeros((k, k))
    for blk in src.blocks():
        B = np.asarray(blk)
        if B.dtype not in (np.float32, np.float64):
            B = B.astype(np.float64)
        Y = (V.T.astype(B.dtype, copy=False) @ B).astype(np.float64)
        Y *= scale_factors(column_norms(B), scale)
        P = Y @ Y.T
        if subject_bound is not None:
            P *= subject_clip_factor(float(np.linalg.norm(P)), B.shape[1], subject_bound)
        H += P
        del blk, B, Y  # before the next block is read
    H /= src.n_samples
    return (H + H.T) / 2


def check_subject_bound(bound) -> float | None:
    """A public bound in (0, 1) on one subject's normalised second moment ||P_m / n_m||_F, or None (no clipping).

    1 is no clipping (a unit-norm time point already gives ||P_m / n_m||_F <= 1), so it becomes None.
    """
    if bound is None:
        return None
    if isinstance(bound, bool) or not isinstance(bound, (int, float, np.integer, np.floating)):
        raise ValueError(f"subject_bound must be a number in (0, 1], got {bound!r}")
    b = float(bound)
    if not (0 < b <= 1):
        raise ValueError(f"subject_bound must be in (0, 1] (1: no clipping; a unit-norm time point already "
                         f"gives ||P_m / n_m||_F <= 1), got {bound!r}")
    return None if b == 1 else b


def contribution_bound(subject_bound: float | None, contribution: str = "moment", k: int | None = None) -> float | None:
    """The bound c on a subject's normalised contribution ||P_m / n_m||_F the sensitivity uses (None: 1).

    The subject bound, and with subspace contributions at most 1/sqrt(k), which holds by construction.
    """
    if contribution not in CONTRIBUTIONS:
        raise ValueError(f"contribution must be one of {CONTRIBUTIONS}, got {contribution!r}")
    bound = check_subject_bound(subject_bound)
    if contribution == "moment":
        return bound
    own = 1.0 / math.sqrt(check_k(k))
    return own if bound is None else min(bound, own)


def pca_sensitivity(n_samples: int, max_subject_len: int = 1, neighbour: str = "replace",
                    subject_bound: float | None = None) -> float:
    """L2 sensitivity of A_s (and of A_s V) for one unit of ``max_subject_len`` columns.

    ``max_subject_len=1`` is the sample level. With ``subject_bound`` c every
    subject's P_m has ||P_m||_F <= c n_m (clipped, or by construction: :func:`contribution_bound`),
    which scales the bound by c. See the module docstring for the derivation.
    """
    if neighbour not in NEIGHBOURS:
        raise ValueError(f"neighbour must be one of {NEIGHBOURS}, got {neighbour!r}")
    c = check_subject_bound(subject_bound) or 1.0
    base = c * max_subject_len / n_samples
    return base * (math.sqrt(2.0) if neighbour == "replace" else 1.0)


#: the covariance mode's peak memory in D x D float64 matrices (one site and the aggregator in one process,
#: measured at D = 3000: the site's sum, its noise and message, the aggregator's average and eigendecomposition)
COVARIANCE_MATRICES = 9


def covariance_bytes(dim: int) -> int:
    """Memory the covariance mode needs for ``dim`` features (:data:`COVARIANCE_MATRICES` D x D doubles)."""
    return COVARIANCE_MATRICES * 8 * int(dim) ** 2


def covariance_release_bytes(dim: int) -> int:
    """Array bytes of the covariance mode's release: one D x D float64 matrix."""
    return 8 * int(dim) ** 2


# -- parameter checks -----------------------------------------------------------------------

def check_k(k) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k must be a positive integer, got {k!r}")
    return int(k)


def _noise_multiplier(epsilon, delta, rounds: int = 1, calibration: str = "analytic") -> float:
    """Per-release std per unit sensitivity so that ``rounds`` releases compose to (eps, delta)."""
    return privacy.noise_multiplier(epsilon, delta, rounds, calibration)


def _check_tol(tol, mode: str, z: float) -> float | None:
    """The power mode's convergence tolerance: only without noise (a private run's releases are planned)."""
    if tol is None:
        return None
    if isinstance(tol, bool) or not isinstance(tol, (int, float, np.integer, np.floating)) or not 0 < tol < 1:
        raise ValueError(f"tol must be a number in (0, 1), got {tol!r}")
    if mode != "power":
        raise ValueError("tol stops the power mode's iterations; the covariance mode has none")
    if z != 0:
        raise ValueError("tol stops on convergence, which depends on the data: only a run without noise "
                         "(epsilon=None) may use it; a private run makes its planned number of releases")
    return float(tol)


def _check_privacy(epsilon, delta, plan_kind: str) -> None:
    no_noise = epsilon is None or (isinstance(epsilon, (float, int)) and math.isinf(epsilon) and epsilon > 0)
    if no_noise:
        if plan_kind != "none":
            raise ValueError(f"epsilon={epsilon!r} means no noise: only plan 'none' runs without noise; "
                             f"give a finite epsilon > 0 for plan {plan_kind!r}")
    else:
        try:
            e = float(epsilon)
        except (TypeError, ValueError):
            raise ValueError(f"epsilon must be a number > 0, got {epsilon!r}") from None
        if not (e > 0) or not math.isfinite(e):
            raise ValueError(f"epsilon must be finite and > 0, got {epsilon!r}")
    if plan_kind != "none" or not no_noise:
        try:
            d = float(delta)
        except (TypeError, ValueError):
            raise ValueError(f"delta must be a number in (0, 1), got {delta!r}") from None
        if not (0 < d < 1):
            raise ValueError(f"delta must be in (0, 1), got {delta!r}")


# -- capePCA as a CAPE algorithm ----------------------------------------------------------------

def _check_variances(variances, share, contribution: str, calibration: str, tol) -> bool:
    if not isinstance(variances, (bool, np.bool_)):
        raise ValueError(f"variances must be True or False, got {variances!r}")
    if not variances:
        return False
    if contribution != "subspace":
        raise ValueError("variances=True releases the variances that subspace contributions lack; with "
                         "contribution='moment' the eigenvalues already are variances")
    if isinstance(share, bool) or not isinstance(share, (int, float, np.floating)) or not 0 < share < 1:
        raise ValueError(f"variance_share must be a number in (0, 1), got {share!r}")
    if calibration != "analytic":
        raise ValueError("variances=True splits the run's (eps, delta) between two releases exactly in GDP, "
                         "which needs calibration='analytic'")
    if tol is not None:
        raise ValueError("variances=True releases the variances in a planned last round; tol would stop the "
                         "power iterations at a round the data decide")
    return True


class CapePCA:
    """capePCA (covariance mode) and the noisy subspace iteration (power mode) for :mod:`dpneuro.protocol.cape`.

    Parameters
    ----------
    k : int
        Number of components.
    epsilon, delta : float
        The whole run's (eps, delta) at each site (power mode splits it
        over ``n_iter`` rounds by exact GDP composition). ``epsilon=None``
        (or inf) only with plan "none".
    mode : {"covariance", "power"}
    n_iter : int
        Power mode: number of releases (rounds), >= 2.
    unit : {"sample", "subject"} or None
        Privacy unit; None: "subject" when the site's data carry subject
        boundaries, else "sample".
    scale : None, float, "clip" or "unit"
        How columns are brought to norm <= 1 (module docstring).
    neighbour : {"replace", "add-remove"}
        Neighbour relation (module docstring); "add-remove" only to reproduce the papers.
    random_state : None, int or numpy Generator
        Seeds every site's noise (``default_rng([seed, site])``) and the
        power mode's V_0 (a Generator gives the seed by one draw); None draws
        from OS entropy (production).
    oversample : int
        Power mode: iterate on k + oversample columns, return the top k.
    dim : int or None
        D if known to the aggregator in advance; otherwise read from the
        sites' declared release shapes.
    calibration : {"analytic", "classic"}
        Gaussian calibration (:func:`dpneuro.privacy.noise_multiplier`); the
        papers used "classic" (valid for eps < 1 only).
    keep_matrix : bool
        Covariance mode: keep the noisy average (D x D) in the aggregator's
        state as ``A_hat`` (simulations and diagnostics; it is checkpointed).
    subject_bound : float in (0, 1] or None
        Subject level only: a public bound c on each subject's normalised
        second moment ``||X_m X_m^T / n_m||_F``; a subject above it is scaled
        down to it, and the sensitivity shrinks by the factor c (module
        docstring). None or 1: no clipping (unit-norm columns give 1).
    symmetric_noise : {"symmetrized", "mirrored"}
        Covariance mode: how the noise on the D x D release's unique entries
        is shaped (:mod:`dpneuro.protocol.cape.packing`). "symmetrized" (default)
        gives the off-diagonal entries std / sqrt(2) at the same guarantee;
        "mirrored" is the papers' (every unique entry the full std).
    contribution : {"moment", "subspace"}
        Subject level only: what a subject adds, its X_m X_m^T ("moment", the
        papers') or (n_m / k) times the projector on its own top-k principal
        subspace ("subspace": norm n_m / sqrt(k) by construction, so the
        bound is at most 1/sqrt(k); module docstring).
    tol : float or None
        Power mode without noise only: stop once every top-k Ritz pair has a
        relative residual below ``tol`` (module docstring); ``n_iter`` caps
        the rounds. None: always ``n_iter`` rounds.
    variances : bool
        Subspace contributions only: one more release, the k x k second
        moment of the data projected on the released basis, so the returned
        eigenvalues are variances (whitening needs them; module docstring).
    variance_share : float in (0, 1)
        The variance release's share of the run's mu^2 (:data:`VARIANCE_SHARE`).
    """

    name = "capepca"

    def __init__(self, k: int, epsilon, delta, *, mode: str = "covariance", n_iter: int | None = None,
                 unit: str | None = None, scale=None, neighbour: str = "replace", random_state=None,
                 oversample: int = 0, dim: int | None = None, calibration: str = "analytic",
                 keep_matrix: bool = False, subject_bound: float | None = None, tol: float | None = None,
                 contribution: str = "moment", symmetric_noise: str = "symmetrized", variances: bool = False,
                 variance_share: float = VARIANCE_SHARE):
        self.k = check_k(k)
        self.symmetric_noise = check_symmetric_noise(symmetric_noise)
        self.subject_bound = check_subject_bound(subject_bound)
        self.bound = contribution_bound(self.subject_bound, contribution, self.k)  # what the sensitivity uses
        self.contribution = contribution
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if unit not in (None, "sample", "subject"):
            raise ValueError(f"unit must be 'sample', 'subject' or None, got {unit!r}")
        if neighbour not in NEIGHBOURS:
            raise ValueError(f"neighbour must be one of {NEIGHBOURS}, got {neighbour!r}")
        _check_scale(scale)
        if isinstance(oversample, bool) or not isinstance(oversample, (int, np.integer)) or oversample < 0:
            raise ValueError(f"oversample must be an integer >= 0, got {oversample!r}")
        self.mode, self.unit, self.scale, self.neighbour = mode, unit, scale, neighbour
        self.random_state = privacy.resolve_random_state(random_state)
        self.oversample, self.dim = int(oversample), dim
        if mode == "power":
            n_iter = 20 if n_iter is None else n_iter
            if isinstance(n_iter, bool) or not isinstance(n_iter, (int, np.integer)) or n_iter < 2:
                raise ValueError(f"power mode needs n_iter >= 2 (the last release is the Rayleigh-Ritz step), "
                                 f"got {n_iter!r}")
            self.n_iter = int(n_iter)
        else:
            self.n_iter = 1
        self.variances = _check_variances(variances, variance_share, contribution, calibration, tol)
        self.variance_share = float(variance_share)
        # the basis' releases, then (variances) one k x k release in the last round
        self.max_rounds = self.n_iter + int(self.variances)
        self.epsilon, self.delta = epsilon, delta
        self.calibration, self.keep_matrix = calibration, bool(keep_matrix)
        self.z = _noise_multiplier(epsilon, delta, self.n_iter, calibration)
        self.z_variances = 0.0
        if self.variances:  # exact GDP split of the run's mu^2 between the basis and the variances
            self.z_variances = self.z / math.sqrt(self.n_iter * self.variance_share)
            self.z /= math.sqrt(1.0 - self.variance_share)
        self.tol = _check_tol(tol, mode, self.z)

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The run's (eps, delta) at each site and its calibration (what a planner rescales)."""
        return privacy.GaussianBudget(self.epsilon, self.delta, self.calibration)

    @property
    def ledger_stages(self) -> tuple[str, ...]:
        """The ledger's stage names of this algorithm's releases (basis, power rounds, variances)."""
        return self.name, f"{self.name}-power", f"{self.name}-variances"

    @property
    def block(self) -> int:
        return self.k + self.oversample

    # -- site ----------------------------------------------------------------------------
    def site_init(self, site: int, data: Any) -> State:
        src = as_source(data).validate(f"site {site}")
        if self.block > src.dim:
            raise ValueError(f"site {site}: k = {self.k} (+ oversample {self.oversample}) exceeds the "
                             f"number of features D = {src.dim}")
        if self.dim is not None and src.dim != self.dim:
            raise ValueError(f"site {site} has D = {src.dim} features, the run expects {self.dim}")
        if self.scale is None and src.max_norm > 1 + _NORM_TOL:
            raise ValueError(f"site {site}: a column has norm {src.max_norm:.4g} > 1; bring the data to the "
                             "consortium-agreed norm bound (scale=c with the public constant c) or pass "
                             "scale='clip' / 'unit'. Nothing was released")
        state = self.public_state(site, src.lengths if src.has_subjects else None, src.n_samples, src.dim)
        state["_src"] = src
        if self.random_state is not None:
            state["rng"] = np.random.default_rng([int(self.random_state), int(site)])
        return state

    def public_state(self, site: int, lengths: Sequence[int] | None, n_samples: int, dim: int) -> State:
        """What a site's releases depend on: its public counts (the planner calls this without data)."""
        unit = self.unit or ("subject" if lengths is not None else "sample")
        if unit == "subject" and lengths is None:
            raise ValueError(f"site {site}: unit='subject' needs subject boundaries (subjects=..., a SiteData, "
                             "or one block per subject)")
        clipped = self.bound is not None
        if clipped and unit != "subject":
            what = ("contribution='subspace' replaces each subject's second moment by its principal subspace"
                    if self.contribution == "subspace" else "subject_bound clips each subject's second moment")
            raise ValueError(f"site {site}: {what}, so it needs the subject as the privacy unit (subject "
                             "boundaries and unit='subject')")
        max_len = max(lengths) if unit == "subject" else 1
        sens = pca_sensitivity(n_samples, max_len, self.neighbour, self.bound)
        ledger = PrivacyLedger(owner=f"site-{site}")
        ledger.note(scale_note(self.scale))
        what = "one subject (all its time points)" if unit == "subject" else "one sample (column)"
        ledger.note(f"{self.name}: privacy unit = {what}, neighbours by {self.neighbour}, counts N_s (and M_s) "
                    f"public; sensitivity {sens:.6g} = {'sqrt(2) * ' if self.neighbour == 'replace' else ''}"
                    f"{f'{self.bound:g} * ' if clipped else ''}{max_len}/{n_samples}")
        if self.contribution == "subspace":
            ledger.note(f"{self.name}: each subject adds (n_m / {self.k}) times the projector on its own top-{self.k} "
                        f"principal subspace (Frobenius norm <= n_m / sqrt({self.k}) by construction)"
                        + (f", clipped to {self.subject_bound:g} * n_m" if self.bound == self.subject_bound else ""))
        elif clipped:
            ledger.note(f"{self.name}: each subject's X_m X_m^T clipped to Frobenius norm <= "
                        f"{self.subject_bound:g} * n_m (the public subject bound); a subject above it is "
                        "scaled down, never dropped")
        if self.mode == "power" and self.tol is not None:
            ledger.note(f"{self.name} power mode without noise: up to {self.n_iter} products A_s V_t, stopped when "
                        f"every top-{self.k} Ritz pair's relative residual is below {self.tol:g}")
        elif self.mode == "power":
            ledger.note(f"{self.name} power mode: {self.n_iter} releases of A_s V_t, per-release noise multiplier "
                        f"sqrt({self.n_iter}) * z(eps, delta) so that their composition is the run's (eps, delta)")
        state = {"site": site, "dim": dim, "n": n_samples, "unit": unit, "sensitivity": sens, "ledger": ledger}
        if self.variances:
            state["sensitivity_variances"] = pca_sensitivity(n_samples, max_len, self.neighbour, self.subject_bound)
            ledger.note(f"{self.name}: then the {self.k} x {self.k} second moment of the data projected on the "
                        "released "
                        f"basis (each subject's term clipped to {self.subject_bound or 1:g} * n_m; sensitivity "
                        f"{state['sensitivity_variances']:.6g}), so the eigenvalues are variances; it gets "
                        f"{self.variance_share:g} of the run's mu^2, the basis the rest")
        return state

    def site_releases(self, state: State) -> dict[str, ReleaseSpec]:
        D = int(state["dim"])
        basis_rounds = tuple(range(self.n_iter)) if self.variances else None
        # ||A_s||_F <= tr(A_s) <= 1 for unit-norm columns, or the subjects' clipped contribution bound; V and its
        # block have spectral norm <= 1 (checked at the site), so A_s V and V^T A_s V are bounded alike
        bound = max(1.0, float(self.bound or 1.0), float(self.subject_bound or 1.0))
        if self.mode == "covariance":
            out = {"A": ReleaseSpec((D, D), state["sensitivity"], self.z, symmetric=True, unit=state["unit"],
                                    stage=self.name, neighbour=self.neighbour,
                                    symmetric_noise=self.symmetric_noise, rounds=basis_rounds, bound=bound)}
        else:
            out = {"AV": ReleaseSpec((D, self.block), state["sensitivity"], self.z, unit=state["unit"],
                                     stage=f"{self.name}-power", neighbour=self.neighbour, rounds=basis_rounds,
                                     bound=bound)}
        if self.variances:
            out["H"] = ReleaseSpec((self.k, self.k), state["sensitivity_variances"], self.z_variances, symmetric=True,
                                   unit=state["unit"], stage=f"{self.name}-variances", neighbour=self.neighbour,
                                   symmetric_noise=self.symmetric_noise, rounds=(self.n_iter,), bound=bound)
        return out

    def site_weight(self, state: State) -> float:
        return float(state["n"])

    def site_compute(self, state: State, round: int, broadcast: Payload | None) -> dict[str, np.ndarray]:
        src = state["_src"]
        if self.variances and round == self.n_iter:
            V = self._broadcast_basis(state, broadcast, self.k)
            return {"H": projected_second_moment(src, self.scale, V, self.subject_bound)}
        if self.mode == "covariance":
            return {"A": second_moment(src, self.scale, self.subject_bound, self.contribution, self.k)}
        V = self._broadcast_basis(state, broadcast, self.block)
        return {"AV": second_moment_times(src, self.scale, V, self.subject_bound,
                                          state.setdefault("_clip_factors", []), self.contribution, self.k)}

    @staticmethod
    def _broadcast_basis(state: State, broadcast: Payload | None, width: int) -> np.ndarray:
        src = state["_src"]
        if broadcast is None or "V" not in broadcast.arrays:
            raise RuntimeError(f"site {state['site']}: no subspace V received")
        V = np.asarray(broadcast.arrays["V"], dtype=np.float64)
        if V.shape != (src.dim, width):
            raise ValueError(f"site {state['site']}: broadcast V has shape {V.shape}, expected {(src.dim, width)}")
        # the release's sensitivity holds for ||V||_2 <= 1 only: a scaled V would scale it past the noise
        if not (np.all(np.isfinite(V)) and np.linalg.norm(V, 2) <= 1 + 1e-6):
            who = state.get("site_name") or f"site {state['site']}"
            raise UnsafeRelease(f"{who} refuses to release: the aggregator's broadcast basis 'V' is "
                                "not orthonormal (spectral norm above 1), so this site's sensitivity would not bound "
                                "its release; nothing was released")
        return V

    # -- aggregator ----------------------------------------------------------------------
    def aggregator_init(self) -> State:
        return {}

    def _public_dim(self, state: State) -> int:
        specs = state.get("cape", {}).get("specs", {})
        for spec in specs.values():
            return int(spec["shape"][0])
        if self.dim is None:
            raise RuntimeError("the aggregator does not know D")
        return int(self.dim)

    def aggregator_first(self, state: State) -> Payload:
        D = self._public_dim(state)
        weights = np.asarray(state.get("cape", {}).get("weights", []), dtype=float)
        if weights.size and self.k > min(D, weights.sum()):
            raise ValueError(f"k = {self.k} components exceeds min(D, N) = min({D}, {int(weights.sum())}): "
                             f"{_DN}; ask for at most {min(D, int(weights.sum()))}")
        if self.mode == "covariance":
            return Payload()
        # V_0: random and data-independent, so it costs no privacy
        rng = np.random.default_rng(None if self.random_state is None else [int(self.random_state), 2**31 - 1])
        V0 = orthonormalize(rng.standard_normal((D, self.block)))
        state["V"] = V0
        return Payload({"V": V0})

    def aggregator_update(self, state: State, round: int, combined: dict[str, np.ndarray]) -> Payload:
        if self.variances and round == self.n_iter:
            H = (combined["H"] + combined["H"].T) / 2
            theta, U = np.linalg.eigh(H)
            order = np.argsort(theta)[::-1]
            # the variances' mean is the projected data's (positive) trace / k; noise above it all leaves 1/k
            level = float(theta.mean()) if theta.mean() > 0 else 1.0 / self.k
            lam = np.maximum(theta[order], VARIANCE_FLOOR * level)
            V = _fix_signs(state["basis"] @ U[:, order])
            state.update(subspace=state["basis"], basis=V, eigenvalues=lam, H_hat=H)
            return Payload({"V": V, "eigenvalues": lam}, {"stop": True})
        if self.mode == "covariance":
            A = combined["A"]
            lam, V = top_eigh(A, self.k)
            state.update(basis=V, eigenvalues=lam)
            if self.keep_matrix:
                state["A_hat"] = (A + A.T) / 2
            return self._basis_done(V, lam)
        Y, Vp = combined["AV"], state["V"]
        stop = round >= self.n_iter - 1
        if stop or self.tol is not None:
            # Rayleigh-Ritz: Ritz pairs of span(V_t) from Y = A V_t
            H = Vp.T @ Y
            theta, U = np.linalg.eigh((H + H.T) / 2)
            order = np.argsort(theta)[::-1][: self.k]
            Uk, th = U[:, order], theta[order]
            if self.tol is not None:
                residual = np.linalg.norm(Y @ Uk - (Vp @ Uk) * th, axis=0)
                state["residual"] = float(residual.max() / max(abs(th[0]), np.finfo(float).tiny))
                stop = stop or state["residual"] <= self.tol
        if not stop:
            V = orthonormalize(Y)
            state["V"] = V
            return Payload({"V": V})
        V = _fix_signs(Vp @ Uk)
        state.update(basis=V, eigenvalues=th)
        return self._basis_done(V, th)

    def _basis_done(self, V: np.ndarray, lam: np.ndarray) -> Payload:
        """The basis is known: the final broadcast, or (variances) V for the variance release."""
        if self.variances:
            return Payload({"V": V})
        return Payload({"V": V, "eigenvalues": lam}, {"stop": True})  # the driver records the rounds


# -- DPdisPCA: its own one-phase protocol, reusing capePCA's site computation -----------------

class DPdisPCA:
    """DPdisPCA ([DPdisPCA] Alg. 1) as a protocol for the generic driver.

    Site: the capePCA covariance computation and calibration, conventional
    symmetric Gaussian noise of the full std (recorded in the ledger), then the
    partial square root ``P_s = U_R diag(sqrt(max(lambda_R, 0)))`` of the
    noisy matrix (top R eigenvalues by value; a negative one contributes 0).
    Aggregator: top-k left singular vectors of ``[sqrt(w_1) P_1 ... sqrt(w_S) P_S]``
    (= eigenvectors of ``sum_s w_s P_s P_s^T``; w_s = N_s / N, i.e. 1/S for equal sites).
    """

    name = "dpdispca"
    max_rounds = 1

    def __init__(self, k: int, epsilon, delta, R: int | None = None, **kw):
        self.base = CapePCA(k, epsilon, delta, mode="covariance", **kw)
        self.base.name = self.name
        self.k = self.base.k
        R = 2 * self.k if R is None else R
        if isinstance(R, bool) or not isinstance(R, (int, np.integer)) or R < self.k:
            raise ValueError(f"intermediate dimension R must be an integer >= k = {self.k}, got {R!r}")
        self.R = int(R)
        if self.base.z <= 0:
            raise ValueError("DPdisPCA needs a finite epsilon > 0")

    def phases(self, round: int) -> Sequence[Phase]:
        return [Phase("dpdispca", self._site, self._agg)]

    def site_init(self, site: int, data: Any) -> State:
        state = self.base.site_init(site, data)
        if self.R > state["dim"]:
            raise ValueError(f"site {site}: R = {self.R} exceeds D = {state['dim']}")
        state.setdefault("rng", privacy.default_rng())
        return state

    def aggregator_init(self) -> State:
        return {}

    def _site(self, state: State, rnd: int, incoming: Payload | None) -> Payload:
        spec = self.base.site_releases(state)["A"]
        A = self.base.site_compute(state, rnd, None)["A"]
        noise = privacy.gaussian(state["rng"], A.shape, spec.tau, state["ledger"], symmetric=True,
                                 symmetric_noise=spec.symmetric_noise)
        state["ledger"].record("A", spec.sensitivity, spec.tau, unit=spec.unit, stage=self.name,
                               neighbour=spec.neighbour)
        lam, U = top_eigh(A + noise, self.R)
        P = U * np.sqrt(np.maximum(lam, 0.0))  # post-processing of the noisy release
        return Payload({"P": P, "weight": np.array([float(state["n"])])}, {},
                       carries={"P": "gaussian-noise (post-processed)", "weight": "public"})

    def _agg(self, state: State, rnd: int, msgs: dict[int, Payload]) -> Payload:
        sites = sorted(msgs)
        n = np.array([float(msgs[s].arrays["weight"][0]) for s in sites])
        w = n / n.sum()
        dims = {msgs[s].arrays["P"].shape[0] for s in sites}
        if len(dims) != 1:
            raise ValueError(f"sites sent P_s with different numbers of features {sorted(dims)}")
        if self.k > min(dims.pop(), n.sum()):
            raise ValueError(f"k = {self.k} exceeds min(D, N)")
        M = np.hstack([np.sqrt(wi) * msgs[s].arrays["P"] for wi, s in zip(w, sites)])
        U, sv, _ = np.linalg.svd(M, full_matrices=False)
        V, lam = _fix_signs(U[:, : self.k]), sv[: self.k] ** 2
        state.update(basis=V, eigenvalues=lam)
        return Payload({"V": V, "eigenvalues": lam}, {"stop": True})


# -- convenience entry points for simulations ---------------------------------------------------

@dataclass
class PCAResult:
    """What a PCA run released, and each site's ledger.

    Attributes
    ----------
    basis : ndarray, shape (D, k)
        Orthonormal columns, ordered by eigenvalue (descending).
    eigenvalues : ndarray, shape (k,)
        The released top eigenvalues (of the noisy average; Ritz values in power mode).
    ledgers : list of PrivacyLedger
        One per site (None for a site that dropped out).
    method, plan, mode, unit, rounds
        What ran: e.g. "capepca[cape]", "cape", "power", "subject", 15.
    info : dict
        ``noise_multiplier`` (per release), ``sensitivity`` (per site) and, in
        covariance mode, ``A_hat``: the noisy weighted average the aggregator
        eigendecomposed (DPdisPCA: ``R``).
    """

    basis: np.ndarray
    eigenvalues: np.ndarray
    ledgers: list
    method: str
    plan: str
    mode: str = "covariance"
    unit: str = "sample"
    rounds: int = 1
    info: dict = field(default_factory=dict)


def _prepare_sites(X_sites, subjects, k: int) -> list[SiteSource]:
    """Wrap and validate every site's data before the protocol starts (errors before any release)."""
    if isinstance(X_sites, np.ndarray) or not isinstance(X_sites, Sequence) or len(X_sites) == 0:
        raise ValueError("X_sites must be a non-empty list with one data matrix (or source) per site")
    S = len(X_sites)
    if subjects is not None and len(subjects) != S:
        raise ValueError(f"subjects must have one entry per site ({S}), got {len(subjects)}")
    srcs = []
    for s, X in enumerate(X_sites):
        src = as_source(X, None if subjects is None else subjects[s])
        srcs.append(src.validate(f"site {s}"))
    return check_sources(srcs, k)


def check_sources(srcs: list[SiteSource], k: int) -> list[SiteSource]:
    """Refuse sites with different D, or k > min(D, N), before anything is released."""
    dims = [src.dim for src in srcs]
    if len(set(dims)) != 1:
        raise ValueError(f"all sites must have the same number of features D; got {dims}")
    n_total = sum(src.n_samples for src in srcs)
    if k > min(dims[0], n_total):
        raise ValueError(f"k = {k} components exceeds min(D, N) = min({dims[0]}, {n_total}): {_DN}; ask for at "
                         f"most {min(dims[0], n_total)}")
    return srcs


def cape_pca(X_sites, n_components: int, epsilon, delta, *, plan="cape", subjects=None, unit: str | None = None,
             scale=None, neighbour: str = "replace", mode: str = "covariance", n_iter: int | None = None,
             oversample: int = 0, exchange=None, random_state=None,
             secagg_config=None, options: RunOptions | None = None, calibration: str = "analytic",
             method: str | None = None, subject_bound: float | None = None,
             tol: float | None = None, contribution: str = "moment",
             symmetric_noise: str = "symmetrized", variances: bool = False,
             variance_share: float = VARIANCE_SHARE) -> PCAResult:
    """capePCA (plan "cape"), its conventional baseline ("conv") or the pooled non-private answer ("none").

    Parameters
    ----------
    X_sites : list
        One entry per site: a D x N_s array, a ``.npy`` path, a SiteData, a
        list of per-subject blocks, a callable returning an iterable of
        blocks, or a :class:`SiteSource`.
    n_components : int
    epsilon, delta : float
        Each site's (eps, delta) for the whole run. ``epsilon=None`` or
        ``math.inf`` only with plan "none".
    plan : {"cape", "conv", "none"} or NoisePlan
    subjects : list, optional
        Per site: int M_s, list of lengths, or list of (start, stop) column
        ranges. Switches the privacy unit to one subject.
    unit, scale, neighbour, mode, n_iter, oversample, calibration, subject_bound, tol, contribution,
    symmetric_noise, variances, variance_share
        See :class:`CapePCA` and the module docstring.
    exchange : Exchange, optional
        Defaults to an in-process exchange.
    random_state : int or Generator, optional
        Reproducible noise for simulations (a Generator is turned into a
        seed); default OS entropy.

    Returns
    -------
    PCAResult
    """
    plan = NoisePlan.coerce(plan)
    _check_privacy(epsilon, delta, plan.kind)
    k = check_k(n_components)  # the papers' k
    srcs = _prepare_sites(X_sites, subjects, k)
    plan.check(len(srcs))
    alg = CapePCA(k, epsilon, delta, mode=mode, n_iter=n_iter, unit=unit, scale=scale, neighbour=neighbour,
                  random_state=random_state, oversample=oversample,
                  dim=srcs[0].dim, calibration=calibration,
                  keep_matrix=True, subject_bound=subject_bound, tol=tol,
                  contribution=contribution, symmetric_noise=symmetric_noise, variances=variances,
                  variance_share=variance_share)
    res = run_cape(alg, srcs, plan, exchange=exchange, options=options, secagg_config=secagg_config)
    agg = res.aggregator
    leds = cape_ledgers(res)
    units = sorted({s["unit"] for s in res.sites if s is not None})
    info = {"noise_multiplier": alg.z, "sensitivity": [s["sensitivity"] if s else None for s in res.sites]}
    for key in ("A_hat", "H_hat", "subspace"):  # diagnostics: the noisy averages, the basis H is taken in
        if key in agg:
            info[key] = agg[key]
    return PCAResult(agg["basis"], agg["eigenvalues"], leds, method or f"capepca[{plan.kind}]", plan.kind, mode,
                     "/".join(units), int(agg.get("rounds", alg.max_rounds)), info)


def _single(X, n_components, epsilon, delta, method: str, owner: str, subjects=None, **kw) -> PCAResult:
    res = cape_pca([X], n_components, epsilon, delta, plan="conv", subjects=None if subjects is None else [subjects],
                   method=method, **kw)
    for led in res.ledgers:
        if led is not None:
            led.owner = owner
    return res


def pooled_dp_pca(X_all, n_components: int, epsilon, delta, *, subjects=None, **kw) -> PCAResult:
    """Analyze Gauss on the pooled data: one noisy D x D release with sensitivity 1/N.

    The reference a trusted curator holding everybody's data would get; the
    ledger (owner "pooled") records that release. Same code path as
    :func:`cape_pca` with one site under plan "conv". Keywords as for :func:`cape_pca`.
    """
    return _single(X_all, n_components, epsilon, delta, "pooled-dp", "pooled", subjects, **kw)


def local_pca(X_site, n_components: int, epsilon, delta, *, subjects=None, **kw) -> PCAResult:
    """Analyze Gauss on one site's data alone (sensitivity 1/N_s): what a site gets without the consortium."""
    return _single(X_site, n_components, epsilon, delta, "local", "local", subjects, **kw)


def dpdispca(X_sites, n_components: int, epsilon, delta, R: int | None = None, *,
             subjects=None, unit: str | None = None,
             scale=None, neighbour: str = "replace", exchange=None, random_state=None,
             options: RunOptions | None = None,
             calibration: str = "analytic", symmetric_noise: str = "symmetrized") -> PCAResult:
    """DPdisPCA ([DPdisPCA] Alg. 1) with intermediate dimension ``R`` (default 2k).

    Each site's ledger records one release of A_s with conventional noise
    (the ``P_s`` it sends is post-processing of that release).
    """
    _check_privacy(epsilon, delta, "conv")
    k = check_k(n_components)  # the papers' k
    srcs = _prepare_sites(X_sites, subjects, k)
    proto = DPdisPCA(k, epsilon, delta, R, unit=unit, scale=scale, neighbour=neighbour,
                     random_state=random_state, dim=srcs[0].dim,
                     calibration=calibration, symmetric_noise=symmetric_noise)
    if proto.R > srcs[0].dim:
        raise ValueError(f"R = {proto.R} exceeds D = {srcs[0].dim}")
    res = simulate(proto, srcs, exchange=exchange, options=options)
    agg = res.aggregator
    leds = [s["ledger"] if s is not None else None for s in res.sites]
    units = sorted({s["unit"] for s in res.sites if s is not None})
    return PCAResult(agg["basis"], agg["eigenvalues"], leds, "dpdispca", "conv", "covariance", "/".join(units), 1,
                     {"R": proto.R, "noise_multiplier": proto.base.z})
