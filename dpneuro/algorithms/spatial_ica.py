"""Spatial group ICA on the consortium's released PCA basis: post-processing, no further release.

In spatial group ICA (the model of CanICA, MELODIC and GIFT) the independent
sources are maps over the features (voxels or parcels) that every site shares.
capePCA releases the top-R eigenvectors V (D x R) of the consortium's second
moment of the features; the maps are a rotation of those eigenmaps,
M = V Q, chosen by FastICA so that the columns of M are as independent
(non-Gaussian over features) as possible. Only the released V and Lambda are
used, so by post-processing the ICA costs no privacy.

The result is written in capeDJICA's parametrisation so that everything
downstream (maps, time courses, reports, deployments) is shared:

- maps A = V Lambda^{1/2} W^{-1} = V Q  with  W = Q^{-1} Lambda^{1/2};
- time courses t = W z = Q^{-1} V^T x for a unit-norm time point x with whitened
  z = Lambda^{-1/2} V^T x: the least-squares fit of x on the maps within the
  released subspace (the first stage of dual regression), computed by each site
  on its own data, so nothing leaves the site.

FastICA starts from fixed, public rotations: an ICA of released values needs
no secret randomness, and a fixed start makes the aggregator's result
reproducible from what it received.

Stable ICA. FastICA on the released basis has several local optima whose maps
differ (on the real fMRI of benchmarks/real_frontier.py, even for the
non-private basis), so one run from one start caps a private run's agreement
with the non-private maps however little noise there is. As CanICA does,
:func:`spatial_ica` runs FastICA from ``n_init`` public starts and keeps the
run whose least sparse map is sparsest (smallest largest L1 norm of the
unit-variance maps, CanICA's criterion). benchmarks/stable_ica.py compares it
with one start, FastICA's contrast as the criterion (which sometimes picks a
rarely reached optimum) and ICASSO's centrotypes.

Convergence. FastICA stops when no component's step turns it by more than
the tolerance (scikit-learn's measure, max_k 1 - |<w_k new, w_k old>|). The
defaults were measured at 1e-4 ... 1e-12 (20 starts each on the test
problems, the demo's and two 20-network consortia's bases and sites, and
benchmarks/stable_ica.py's real-data bases, non-private and private). Spatial
ICA: the starts stop at 1e-6, the loosest whose kept maps match 1e-12's
(mean matched |r| >= 0.9995 everywhere; at 1e-5 a start that stopped after 8
iterations with two maps still mixed scored sparsest: 0.93 on the demo's
basis), and tighter ones converge no more starts: 1e-12 is at the rounding
floor (one start of a 200 x 8 test problem stalled at 1.4e-12, the kept start
on a site's 8,735 x 20 subspace ran to ``max_iter``). The kept run alone then
goes on towards 1e-12 within ``max_iter`` (``SPATIAL_ICA_POLISH_TOL``, at
the step size it ended with; kept only if it converges to the same maps,
|r| >= 0.999: plain steps from a point only damped steps reached wandered to
other optima on noise bases), so that its maps do not depend on where a start stopped: a
deployment and its simulation, whose bases differ in the last bits, keep
maps equal to a few 1e-6 (at 1e-6 alone: 1.4e-4, and which of the starts at
one optimum scores best changes with the last bits). Guided ICA: each site
converged at every tolerance or at none, and below 1e-10 one 20-network site
stopped on a plateau (its maps |r| 0.80 against 1e-12's), so it keeps 1e-10.
Every fit is FastICA stabilised as the reference FastICA package does it
(:mod:`dpneuro.algorithms._fastica`): scikit-learn's iteration, with a half
step after a two-step cycle and smaller steps after half of ``max_iter``.
On nearly Gaussian directions (a private basis that is mostly noise, real
data at eps 1; a site's K - R other directions when they hold Gaussian
noise) scikit-learn's plain step overshoots and cycles: every such fit ran
to ``max_iter``. Stabilised, every fit measured converges: all 84 spatial
and guided fits of the demo, of the real-data bases of
benchmarks/stable_ica.py --quick and of the 2 mm fMRIPrep tree of
benchmarks/site_speed.py (before, 24 ran to ``max_iter``). The kept maps of
every 20-start spatial ICA that converged before are unchanged (|r| >= 0.999);
single starts that approached their optimum oscillating, or slowly, can now
end at another one, and the stable ICA's agreement on real data moved within
its seeds' spread (benchmarks/stable_ica.py). ``status`` still says
``"not converged"`` when a fit runs out of iterations. The fits run on one BLAS
thread: their matrices (D x R) are small, and spare BLAS threads competing
with other work (a site's decoding threads, other processes) made them up
to 10x slower.

Collapses. On a noise-dominated basis a damped FastICA step can collapse two
directions into one: 38 of 10,000 single fits and 3 of 640 spatial ICA starts
on pure-noise bases (benchmarks/fastica_noise.py). FastICA stops such a fit
cleanly (:mod:`dpneuro.algorithms._fastica`) and both ICAs start it again, at
most ``FASTICA_RESTARTS`` times, from public seeds derived from the collapsed
start's (``restart_seed``): a spatial start from a new rotation, the guided
start from the references turned by a small public rotation. Every restart is
in the result (``restarts``, ``restart_note()``); none of those 41 collapsed
again. A spatial start that collapses every time is left out of the choice;
when every start does (or the guided one), :class:`FastICACollapsed` says why
and what to change.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from dpneuro._utils.blas import one_blas_thread
from dpneuro._utils.errors import DpneuroError
from dpneuro.algorithms._fastica import FastICAFit, fastica, random_start, restart_seed
from dpneuro.algorithms.djica import check_basis
from dpneuro.algorithms.metrics import match_components

__all__ = ["FASTICA_RESTARTS", "FastICACollapsed", "GUIDED_ICA_MAX_ITER", "GUIDED_ICA_TOL", "GuidedICAResult",
           "SPATIAL_ICA_MAX_ITER", "SPATIAL_ICA_POLISH_TOL", "SPATIAL_ICA_RESTARTS", "SPATIAL_ICA_TOL",
           "SpatialICAResult", "guided_ica", "spatial_ica"]

#: FastICA starts of the spatial ICA (public seeds init_seed, init_seed + 1, ...); 1 is a single run
SPATIAL_ICA_RESTARTS = 20
#: FastICA's tolerance (max 1 - |cos| of a step): the loosest whose kept maps matched 1e-12's (|r| >= 0.9995)
SPATIAL_ICA_TOL = 1e-6
#: FastICA's iteration limit: converging starts needed at most 1,546 iterations at 1e-6 (real data, eps 1-16)
SPATIAL_ICA_MAX_ITER = 2000
#: the kept run goes on to this tolerance (within max_iter): whichever of the starts at one optimum is kept, a
#: deployment and its simulation (bases equal to ~1e-15) give maps equal to a few 1e-6 (tests/api)
SPATIAL_ICA_POLISH_TOL = 1e-12
#: guided ICA's tolerance: every site measured converged at it or at none; looser stopped one on a plateau
GUIDED_ICA_TOL = 1e-10
#: guided ICA's iteration limit: sites converged within 1,236 iterations at 1e-10 (20 networks, 6 mm), and within
#: 1,148 where plain FastICA cycled (the 2 mm tree's sites, whose other directions are noise)
GUIDED_ICA_MAX_ITER = 2000
#: how the kept run is chosen: "sparsity" (CanICA's) or "contrast" (FastICA's logcosh objective)
SELECTIONS = ("sparsity", "contrast")
#: E[log cosh(nu)] for a standard normal nu: the logcosh contrast's Gaussian reference
_GAUSS_LOGCOSH = 0.3745672075
#: relative score difference below which two runs count as the same optimum
_TIE = 1e-6
#: a polished run is kept when each of its maps still matches one of the run's at |r| >= this
_SAME_MAPS = 0.999
#: times a collapsed FastICA start is started again (seeds ``restart_seed(seed, 1), ...``): collapses are rare (1 fit
#: in 260 on pure-noise bases, no restart collapsed again), so five in a row mean the basis, not bad luck
FASTICA_RESTARTS = 5
#: a guided restart starts from the references turned by a public random rotation of about this many radians per row
_GUIDED_TURN = 0.1


class FastICACollapsed(DpneuroError, RuntimeError):
    """FastICA collapsed from every start tried: the basis' directions are too close to Gaussian noise."""


def _collapsed_error(what: str, fits: int) -> FastICACollapsed:
    return FastICACollapsed(
        f"{what}: FastICA collapsed (two components into one) in all {fits} fits tried, restarts included: the "
        "basis is dominated by noise, its directions nearly Gaussian. Choose fewer components, or give the run "
        "more privacy budget or more subjects (less noise in the basis).")


def _restart_phrase(start: str, seeds: tuple[int, ...], *, gave_up: bool) -> str:
    """What a report says about one start's restarts."""
    tried = f"seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))}"
    if gave_up:
        return f"{start} collapsed on a noise-dominated basis, again after each restart ({tried}): left out"
    return f"{start} collapsed on a noise-dominated basis; restarted from {tried}"


@dataclass
class SpatialICAResult:
    """Spatial ICA of a released basis.

    Attributes
    ----------
    W : ndarray, shape (R, R)
        Unmixing in capeDJICA's parametrisation (time courses ``W z``).
    maps : ndarray, shape (D, R)
        The independent maps ``V Q`` (unit variance over features, positive skew).
    status : str
        ``"converged"`` or ``"not converged"`` (the kept FastICA run reached ``tol`` within ``max_iter``).
    n_iter : int
        FastICA iterations of the kept run to ``tol`` (not counting its polishing, within what is left of
        ``max_iter``: module notes).
    stability : ndarray, shape (R,)
        Per map, the mean over all runs of its best |correlation| with that run's maps (ICASSO's idea: 1 when
        every start finds it; 1 with a single run).
    scores : ndarray, shape (n_init,)
        Every run's selection score (smaller is better), in start order.
    kept : int
        Index of the kept run (its start is ``init_seed + kept``, or the last seed ``restarts`` gives it).
    n_converged : int
        How many of the ``n_init`` runs converged within ``max_iter`` (``status`` is the kept run's).
    restarts : tuple of (int, int)
        Every restart of a start that collapsed (module notes), in order: (start index, the public seed it was
        started again from). Empty when none collapsed; ``restart_note()`` says it in words.
    left_out : tuple of int
        Starts that collapsed on all ``FASTICA_RESTARTS`` restarts too: left out of the choice and of
        ``stability`` (score inf).
    init_seed : int
        The first start's seed (start i's is ``init_seed + i``).
    """

    W: np.ndarray
    maps: np.ndarray
    status: str
    n_iter: int
    stability: np.ndarray | None = None
    scores: np.ndarray | None = None
    kept: int = 0
    n_converged: int = 1
    restarts: tuple[tuple[int, int], ...] = ()
    left_out: tuple[int, ...] = ()
    init_seed: int = 0

    def restart_note(self) -> str:
        """The restarts in words, for the run's status and report ("" when no start collapsed)."""
        starts = dict.fromkeys(i for i, _ in self.restarts)
        return "; ".join(_restart_phrase(f"FastICA start {i} (seed {self.init_seed + i})",
                                         tuple(s for j, s in self.restarts if j == i), gave_up=i in self.left_out)
                         for i in starts)


def spatial_ica(basis, eigenvalues, *, max_iter: int = SPATIAL_ICA_MAX_ITER, tol: float = SPATIAL_ICA_TOL,
                init_seed: int = 0, n_init: int = SPATIAL_ICA_RESTARTS,
                select: str = "sparsity") -> SpatialICAResult:
    """FastICA (logcosh; CanICA uses the cube, whose maps differ little) of the eigenmaps in ``basis``, best of
    ``n_init`` starts.

    Components are signed so that each map's skew is positive (CanICA's
    convention: the network is the heavy tail) and ordered by the variance of
    the data they explain, largest first.

    Parameters
    ----------
    basis : ndarray, shape (D, R)
        Orthonormal columns V (capePCA's basis), D > R.
    eigenvalues : ndarray, shape (R,)
        The matching eigenvalues (positive). They order the components and enter W; the maps V Q do not
        depend on them.
    max_iter, tol : FastICA's iteration limit and tolerance. FastICA stops when 1 - |cos| of every
        component's step is below ``tol`` (a step of at most sqrt(2 tol) rad); see the module notes for how
        the defaults were measured; the kept run then goes on towards ``SPATIAL_ICA_POLISH_TOL``.
    init_seed : int
        Seed of the first start's rotation; start i uses ``init_seed + i`` (public; see the module notes), and if
        that fit collapses, ``restart_seed(init_seed + i, 1)``, ``restart_seed(init_seed + i, 2)``, ... (at most
        ``FASTICA_RESTARTS``; reported in ``restarts``).
    n_init : int
        FastICA runs; 1 is the single run from ``init_seed``.
    select : {"sparsity", "contrast"}
        Which run is kept: ``"sparsity"`` the one whose largest L1 norm over its unit-variance maps is
        smallest (CanICA's rule), ``"contrast"`` the largest logcosh negentropy sum_k (E G(m_k) - E G(nu))^2
        (FastICA's own objective). Scores within 1e-6 (relative) of the best count as ties and go to the
        earliest start.

    Raises
    ------
    FastICACollapsed
        When every start collapsed on every restart (module notes).
    """
    if int(n_init) != n_init or n_init < 1:
        raise ValueError(f"n_init must be an integer >= 1, got {n_init!r}")
    if select not in SELECTIONS:
        raise ValueError(f"select must be one of {SELECTIONS}, got {select!r}")
    V, lam = check_basis(basis, eigenvalues)
    with one_blas_thread():
        Z, white = _whiten(V)
        runs = [_run(Z, init_seed + i, max_iter, tol) for i in range(int(n_init))]
        left_out = tuple(i for i, r in enumerate(runs) if r.fit.collapsed)
        if len(left_out) == len(runs):
            raise _collapsed_error(f"spatial ICA of a {V.shape[0]} x {V.shape[1]} basis",
                                   sum(1 + len(r.restarts) for r in runs))
        scores = np.array([np.inf if r.fit.collapsed else _score(r.S, select) for r in runs])
        best = scores.min()
        # ties (one optimum found from several starts, scores equal to rounding) go to the earliest start
        kept = int(np.flatnonzero(scores <= best + _TIE * abs(best))[0])
        run = runs[kept]
        unmix, S, converged, n_iter = run.fit.W, run.S, run.fit.converged, run.fit.n_iter
        if converged and tol > SPATIAL_ICA_POLISH_TOL and n_iter < max_iter:
            unmix, S = _polish(Z, run, max_iter - n_iter)
    stability = _stability(S, [r.S for r in runs if not r.fit.collapsed])
    Q = white @ unmix.T  # V Q: the sources, up to a constant per map
    M = V @ Q
    sd = M.std(axis=0)
    skew = (((M - M.mean(axis=0)) / sd) ** 3).mean(axis=0)
    scale = np.where(skew < 0, -1.0, 1.0) / sd  # unit variance over features, heavy tail positive
    Q, M = Q * scale, M * scale
    Qinv = np.linalg.inv(Q)
    # the data's second moment each component carries: E[t_j^2] ||M_j||^2 with E[t t^T] = Q^-1 Lambda Q^-T
    explained = np.einsum("ij,j,ij->i", Qinv, lam, Qinv) * np.sum(M**2, axis=0)
    order = np.argsort(-explained, kind="stable")
    return SpatialICAResult(W=Qinv[order] * np.sqrt(lam), maps=M[:, order],
                            status="converged" if converged else "not converged", n_iter=n_iter,
                            stability=stability[order], scores=scores, kept=kept,
                            n_converged=sum(r.fit.converged for r in runs),
                            restarts=tuple((i, s) for i, r in enumerate(runs) for s in r.restarts), left_out=left_out,
                            init_seed=init_seed)


@dataclass
class _Run:
    """One FastICA run of the spatial ICA, its standardised maps and the seeds it was restarted from."""

    fit: FastICAFit
    S: np.ndarray
    restarts: tuple[int, ...] = ()


def _polish(Z: np.ndarray, run: _Run, budget: int) -> tuple[np.ndarray, np.ndarray]:
    """The kept run continued towards ``SPATIAL_ICA_POLISH_TOL`` within ``budget`` iterations, at the step size it
    ended with: (unmixing, standardised maps). Kept as it was unless the polishing converges to the same maps
    (a plain step from a point the damped steps reached may wander off to another optimum)."""
    fit = fastica(Z, run.fit.W, tol=SPATIAL_ICA_POLISH_TOL, max_iter=budget, step=run.fit.step)
    S = _standardise(Z @ fit.W.T)
    if fit.converged and np.abs(S.T @ run.S / len(S)).max(axis=1).min() >= _SAME_MAPS:
        return fit.W, S
    return run.fit.W, run.S


def _run(Z: np.ndarray, seed: int, max_iter: int, tol: float) -> _Run:
    """One FastICA run from the public start ``seed``, started again from ``restart_seed(seed, 1), ...`` while it
    collapses (at most ``FASTICA_RESTARTS`` times; the last fit is returned, collapsed or not)."""
    fit = fastica(Z, random_start(seed, Z.shape[1]), tol=tol, max_iter=max_iter)
    restarts: list[int] = []
    while fit.collapsed and len(restarts) < FASTICA_RESTARTS:
        restarts.append(restart_seed(seed, len(restarts) + 1))
        fit = fastica(Z, random_start(restarts[-1], Z.shape[1]), tol=tol, max_iter=max_iter)
    return _Run(fit, _standardise(Z @ fit.W.T), tuple(restarts))


def _standardise(S: np.ndarray) -> np.ndarray:
    return (S - S.mean(axis=0)) / S.std(axis=0)


def _score(S: np.ndarray, select: str) -> float:
    """Selection score of one run's standardised maps (smaller is better)."""
    if select == "sparsity":
        return float(np.abs(S).sum(axis=0).max())
    return -float(np.sum((np.mean(np.log(np.cosh(S)), axis=0) - _GAUSS_LOGCOSH) ** 2))


def _stability(S: np.ndarray, runs: list[np.ndarray]) -> np.ndarray:
    """Per column of ``S``, the mean over ``runs`` of its largest |correlation| with that run's columns."""
    D = len(S)
    return np.mean([np.abs(S.T @ other / D).max(axis=1) for other in runs], axis=0)


def _whiten(V: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(Z, white): the centred columns of ``V`` (D x R) times ``white``, with identity covariance over features."""
    D, R = V.shape
    if D <= R:
        raise ValueError(f"spatial ICA needs more features than components (D = {D}, R = {R})")
    # whiten here: the eigenmaps are orthonormal, so after centring an SVD makes them exactly white
    # (FastICA's own whitening of such nearly isotropic input can return duplicated components)
    Vc = V - V.mean(axis=0)
    _, sv, Vt = np.linalg.svd(Vc, full_matrices=False)
    if sv[-1] <= 1e-12 * sv[0]:
        raise ValueError("the centred eigenmaps are rank deficient: choose fewer components")
    white = Vt.T * (np.sqrt(D) / sv)
    return Vc @ white, white


@dataclass
class GuidedICAResult:
    """Spatial ICA of a basis guided by reference maps.

    Attributes
    ----------
    maps : ndarray, shape (D, R)
        The independent maps, column k paired with reference k, signed to correlate positively with it, unit
        variance over features.
    agreement : ndarray, shape (R,)
        Each map's correlation with its reference.
    status : str
        ``"converged"`` or ``"not converged"`` (FastICA within ``max_iter``).
    n_iter : int
        FastICA iterations (``max_iter`` when not converged; of the last fit when restarted).
    restarts : tuple of int
        The public seeds the fit was started again from after it collapsed (module notes), in order; empty when
        it did not. ``restart_note()`` says it in words.
    """

    maps: np.ndarray
    agreement: np.ndarray
    status: str
    n_iter: int
    restarts: tuple[int, ...] = ()

    def restart_note(self) -> str:
        """The restarts in words, for the site's record and report ("" when the fit did not collapse)."""
        return _restart_phrase("the guided FastICA start", self.restarts, gave_up=False) if self.restarts else ""


def guided_ica(basis, references, *, max_iter: int = GUIDED_ICA_MAX_ITER,
               tol: float = GUIDED_ICA_TOL, random_state: int = 0) -> GuidedICAResult:
    """FastICA (logcosh) of the maps spanned by ``basis``, started from ``references`` and paired with them.

    Group-information-guided ICA: the references (the consortium's maps)
    give FastICA its start, their coordinates in the whitened basis, and
    R of the basis' K >= R independent maps are paired with the R references
    (the assignment of largest summed |correlation|) and signed to agree
    with them. The maps are the basis' own independent maps in the
    references' order, so a site's maps line up with the consortium's. With
    K > R the directions beyond the references start from their orthogonal
    complement and give what is not the references' (noise, other networks)
    components of its own instead of mixing it into theirs.

    Parameters
    ----------
    basis : ndarray, shape (D, K)
        Orthonormal columns spanning the maps (a site's principal subspace), D > K.
    references : ndarray, shape (D, R)
        One reference map per column, R <= K.
    max_iter, tol : FastICA's iteration limit and tolerance (measured in the module notes).
    random_state : int
        Public seed of the restarts, used only if the fit collapses: restart a (at most ``FASTICA_RESTARTS``;
        reported in ``restarts``) starts from the references' start plus
        ``0.1 / sqrt(K) * random_start(restart_seed(random_state, a), K)``, each row turned by about 0.1 rad.

    Raises
    ------
    FastICACollapsed
        When the fit collapsed on every restart too (module notes).
    """
    V = np.asarray(basis, np.float64)
    ref = np.asarray(references, np.float64)
    if V.ndim != 2 or ref.ndim != 2 or ref.shape[0] != V.shape[0] or ref.shape[1] > V.shape[1]:
        raise ValueError(f"basis {V.shape} must be D x K and references {ref.shape} D x R with R <= K")
    sd = ref.std(axis=0)
    if not np.all(np.isfinite(ref)) or np.any(sd <= 0):
        raise ValueError("every reference map must be finite and not constant")
    R, K = ref.shape[1], V.shape[1]
    with one_blas_thread():
        Z, _ = _whiten(V)
        start = (Z.T @ ((ref - ref.mean(axis=0)) / sd) / len(Z)).T  # R x K: row k holds reference k's coordinates
        rest = np.linalg.svd(start)[2][R:]  # the orthogonal complement of their span
        # the nearest orthogonal matrix: defined even where two references share a direction
        u, _, vt = np.linalg.svd(np.concatenate([start, rest]) if K > R else start)
        fit = fastica(Z, u @ vt, tol=tol, max_iter=max_iter)
        restarts: list[int] = []
        while fit.collapsed and len(restarts) < FASTICA_RESTARTS:
            restarts.append(restart_seed(random_state, len(restarts) + 1))
            turned = u @ vt + random_start(restarts[-1], K) * (_GUIDED_TURN / np.sqrt(K))  # rows of norm ~0.1
            fit = fastica(Z, turned, tol=tol, max_iter=max_iter)
        if fit.collapsed:
            raise _collapsed_error(f"guided ICA of a {V.shape[0]} x {K} basis", 1 + len(restarts))
        S = Z @ fit.W.T
    perm, corr = match_components(S, ref)
    maps = S[:, perm] * np.where(corr < 0, -1.0, 1.0)
    maps = (maps - maps.mean(axis=0)) / maps.std(axis=0)
    return GuidedICAResult(maps=maps, agreement=np.abs(corr),
                           status="converged" if fit.converged else "not converged", n_iter=fit.n_iter,
                           restarts=tuple(restarts))
