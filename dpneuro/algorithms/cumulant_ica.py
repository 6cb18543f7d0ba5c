"""Temporal ICA in two releases: a refined whitening, then the sites' fourth-order cumulants.

capeDJICA releases a gradient every round; under privacy its rounds cost most
of a temporal run's budget. Independent sources can also be read off the
fourth-order cumulant tensor of white data: for y = A s with A orthogonal and
independent unit-variance s_r,
kappa_4(y) = E[y (x) y (x) y (x) y] - G(Sigma) = sum_r k_r a_r (x) a_r (x) a_r (x) a_r,
G(Sigma)_ijkl = S_ij S_kl + S_ik S_jl + S_il S_jk the Gaussian part of covariance
Sigma and k_r the sources' excess kurtoses (the tensor JADE diagonalises).

The tensor is only as good as the whitening: after the private PCA the data
are roughly white (covariance eigenvalues ~0.15-2 on [capeDJICA]'s set-up), a
direction of variance l carries its kurtosis times l^2 against noise of the
same size in every direction, and undoing it afterwards amplifies the noise as
much. So the sites first refine the whitening, in coordinates where every
direction already weighs about the same:

Round 0 (refinement). Subject m with n_m whitened time points Y_m (R x n_m):
S_m = Y_m Y_m^T / n_m, scaled to Frobenius norm <= c (``refine_clip``); the
site releases sum_m n_m S_m / N_s (R x R, symmetric). Sensitivity (replace one
subject): sqrt(2) c n_max / N_s (the terms are PSD, as the PCA's second
moments). The aggregator raises the noisy average's eigenvalues to at least
:data:`REFINE_FLOOR` times their mean and broadcasts P = S_hat^{-1/2}.

Round 1 (cumulants). Each subject's time points become P Y_m, and its
cumulant uses its own covariance S'_m = P Y_m Y_m^T P / n_m:
C_m = (1/n_m) sum_t y_t^(x)4 - G(S'_m), scaled to Frobenius norm <= B (``clip``);
the site releases sum_m n_m C_m / N_s as an R^2 x R^2 symmetric matrix.
Sensitivity: 2 B n_max / N_s (triangle inequality; C_m is not PSD). Its own
covariance makes C_m the subject's sample cumulant whatever the residual
scale of P Y_m, so no Gaussian part is left over from an imperfect whitening.

The two releases split the stage's GDP mu^2: ``refine_share`` to the
refinement (noise multiplier z / sqrt(share)), the rest to the cumulants
(z / sqrt(1 - share)), so they compose to the stage's (eps, delta) exactly.

Aggregator, after round 1 (post-processing). It symmetrizes the noisy tensor
T over its 24 index orders and, for r = 1..R, runs the tensor power iteration
w <- T(., w, w, w) / ||.||, orthogonal to the directions already found, from
``n_restarts`` random starts (public randomness), keeps the start whose
|T(w, w, w, w)| is largest and deflates T -= T(w,w,w,w) w^(x)4. Found one at
a time, the directions then are refitted jointly: symmetrised Gaussian noise
has the same law in every orthonormal frame, so the least-squares fit of
sum_r k_r u_r^(x)4 to T is the orthogonal U maximising
sum_r T(u_r, u_r, u_r, u_r)^2 (Comon's kurtosis contrast), climbed from the
power method's U by pairwise Jacobi rotations, which lowers qNGI at the same
release (benchmarks/README.md). With U the directions (rows), the
unmixing of the sites' whitened data is W = U P: sources = W z, capeDJICA's
parametrisation.

``refine_share = 0`` skips the refinement (one release, P = I): for data that
are white already.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from dpneuro import privacy
from dpneuro.data.matrix import subject_ranges
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import ReleaseSpec, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers
from dpneuro.protocol.cape.plans import NoisePlan
from dpneuro.protocol.exchange import Payload

__all__ = ["REFINE_FLOOR", "REFINE_SHARE", "CapeCumulantICA", "CumulantICAResult", "cape_cumulant_ica", "contrast",
           "default_clips", "gaussian_part_of", "polish_directions", "power_directions",
           "release_bytes", "separate", "subject_cumulant", "subject_second_moment"]

_PERMS = tuple(itertools.permutations(range(4)))


def gaussian_part_of(S: np.ndarray) -> np.ndarray:
    """G(S)_ijkl = S_ij S_kl + S_ik S_jl + S_il S_jk as an R^2 x R^2 matrix: the fourth moment of N(0, S)."""
    R = S.shape[0]
    return (np.einsum("ij,kl->ijkl", S, S) + np.einsum("ik,jl->ijkl", S, S)
            + np.einsum("il,jk->ijkl", S, S)).reshape(R * R, R * R)


def _clipped(A: np.ndarray, clip: float | None) -> np.ndarray:
    if clip is not None:
        norm = float(np.linalg.norm(A))
        if norm > clip:
            A = A * (clip / norm)
    return A


def subject_second_moment(Y: np.ndarray, clip: float | None = None) -> np.ndarray:
    """A subject's second moment Y Y^T / n of its whitened time points Y (R x n), clipped to ``clip``."""
    Y = np.asarray(Y, np.float64)
    return _clipped(Y @ Y.T / Y.shape[1], clip)


def subject_cumulant(Y: np.ndarray, clip: float | None = None) -> np.ndarray:
    """A subject's fourth-order sample cumulant of its time points Y (R x n), R^2 x R^2, clipped to ``clip``.

    The fourth moment minus the Gaussian part of the subject's own second moment.
    """
    R, n = Y.shape
    Y = np.asarray(Y, np.float64)
    YY = (Y[:, None, :] * Y[None, :, :]).reshape(R * R, n)
    return _clipped(YY @ YY.T / n - gaussian_part_of(Y @ Y.T / n), clip)


def symmetrize4(K: np.ndarray, R: int) -> np.ndarray:
    """Average an R^2 x R^2 matrix, read as an R x R x R x R tensor, over the 24 index orders."""
    T = K.reshape(R, R, R, R)
    return (sum(T.transpose(p) for p in _PERMS) / len(_PERMS)).reshape(R * R, R * R)


def power_directions(K: np.ndarray, R: int, random_state=None, *, n_restarts: int = 8,
                     n_iter: int = 60) -> np.ndarray:
    """Orthonormal directions (rows) of a symmetric 4th-order tensor by the power method with deflation.

    ``random_state`` (None, an int or a Generator, used as it is) draws the starts.
    """
    rng = privacy.default_rng(random_state)
    T = symmetrize4(K, R)
    found: list[np.ndarray] = []
    for _ in range(R):
        best = None
        for _ in range(n_restarts):
            w = rng.standard_normal(R)
            for u in found:
                w -= (w @ u) * u
            w /= np.linalg.norm(w)
            for _ in range(n_iter):
                v = (T @ np.kron(w, w)).reshape(R, R) @ w
                for u in found:
                    v -= (v @ u) * u
                norm = np.linalg.norm(v)
                if norm == 0:
                    break
                w = v / norm
            val = float(np.kron(w, w) @ T @ np.kron(w, w))
            if best is None or abs(val) > abs(best[0]):
                best = (val, w)
        val, w = best
        found.append(w)
        ww = np.kron(w, w)
        T = T - val * np.outer(ww, ww)
    return np.array(found)


def contrast(K: np.ndarray, U: np.ndarray) -> float:
    """sum_r T(u_r, u_r, u_r, u_r)^2 of the symmetric tensor T of K over the rows u_r of U."""
    R = U.shape[1]
    UU = np.einsum("ri,rj->rij", U, U).reshape(len(U), R * R)
    return float(np.sum(np.einsum("ri,ij,rj->r", UU, symmetrize4(K, R), UU) ** 2))


#: the angles the pairwise rotations of :func:`polish_directions` try first, in [0, pi/2) (0.25 degree apart)
_ANGLES = np.linspace(0.0, math.pi / 2, 360, endpoint=False)


def _rotated_pair(t: np.ndarray, angle) -> tuple:
    """(T(u_p'^4), T(u_q'^4)) after rotating u_p, u_q by ``angle``, from t_j = T(u_p^(4-j) u_q^j), j = 0..4."""
    c, s = np.cos(angle), np.sin(angle)
    to_p = sum(math.comb(4, j) * c ** (4 - j) * s ** j * t[j] for j in range(5))
    to_q = sum(math.comb(4, j) * (-s) ** (4 - j) * c ** j * t[j] for j in range(5))
    return to_p, to_q


def polish_directions(K: np.ndarray, U: np.ndarray, *, sweeps: int = 50) -> np.ndarray:
    """Rotate the orthonormal rows of U, pair by pair, to maximise :func:`contrast` (Comon's kurtosis contrast).

    With noise of the same law in every orthonormal frame (symmetrised Gaussian noise is), maximising
    sum_r T(u_r^4)^2 over orthogonal U is least squares: the nearest sum_r k_r u_r^(x)4 to the noisy tensor.
    The power method finds the directions one at a time; this refits them jointly. A pair's rotation by an
    angle a sends T(u_p^4) to sum_j C(4,j) cos(a)^(4-j) sin(a)^j T(u_p^(4-j) u_q^j) (likewise u_q): the best
    angle on a 0.25-degree grid, refined by a parabola through its neighbours, is taken while it raises the
    contrast.
    """
    U = np.array(U, np.float64)
    R = U.shape[1]
    T = np.einsum("ai,bj,ck,dl,ijkl->abcd", U, U, U, U, symmetrize4(K, R).reshape(R, R, R, R), optimize=True)
    step = _ANGLES[1]
    for _ in range(sweeps):
        moved = False
        for p, q in itertools.combinations(range(R), 2):
            t = [T[(p,) * (4 - j) + (q,) * j] for j in range(5)]
            f = np.square(_rotated_pair(t, _ANGLES)).sum(axis=0)
            k = int(np.argmax(f))
            lo, hi = f[k - 1], f[(k + 1) % len(f)]  # f has period pi/2
            curv = lo - 2 * f[k] + hi
            angle = _ANGLES[k] + (0.5 * step * (lo - hi) / curv if curv < 0 else 0.0)
            gain = float(np.square(_rotated_pair(t, angle)).sum()) - f[0]
            if abs(math.sin(angle)) < 1e-7 or gain <= 1e-10 * f[0]:
                continue
            moved = True
            J = np.array([[math.cos(angle), math.sin(angle)], [-math.sin(angle), math.cos(angle)]])
            U[[p, q]] = J @ U[[p, q]]
            for mode in range(4):
                view = np.moveaxis(T, mode, 0)
                view[[p, q]] = np.tensordot(J, view[[p, q]], axes=1)
        if not moved:
            break
    return U


def separate(K: np.ndarray, R: int, random_state=None, *, n_restarts: int = 8, n_iter: int = 60) -> np.ndarray:
    """The aggregator's directions (rows) from the noisy cumulant matrix K (post-processing): the power method's,
    refitted jointly by :func:`polish_directions`."""
    return polish_directions(K, power_directions(K, R, random_state, n_restarts=n_restarts, n_iter=n_iter))


#: share of the stage's GDP mu^2 the refinement gets (the cumulants the rest); measured against 0.05 and 0.2 on
#: [capeDJICA]'s set-up (benchmarks/README.md)
REFINE_SHARE = 0.1
#: the refined covariance's eigenvalues are raised to at least this times their mean (post-processing)
REFINE_FLOOR = 0.05


def release_bytes(R: int) -> int:
    """Array bytes of the largest release, the R^2 x R^2 cumulant matrix (float64)."""
    return 8 * int(R) ** 4


def default_clips(R: int, n: int) -> tuple[float, float]:
    """Public bounds (refine_clip, clip) for subjects of ``n`` time points in R dimensions.

    The root-mean-square Frobenius norms a white Gaussian subject's second
    moment and sample cumulant would have: sqrt(R + R(R+1)/n) and
    sqrt(R(R+2)(R+4)(R+6) / n) (the sum of the fourth moment's entry variances).
    Real subjects' terms are about these sizes: the bounds scale the noise
    with the data, whatever R and n.
    """
    return math.sqrt(R + R * (R + 1) / n), math.sqrt(R * (R + 2) * (R + 4) * (R + 6) / n)


class CapeCumulantICA:
    """The refinement and the cumulant release as a :mod:`dpneuro.protocol.cape` algorithm (module docstring).

    Parameters
    ----------
    n_components : int
        R, the whitened data's dimension.
    epsilon, delta : float
        The stage's (eps, delta), split between its two releases; ``epsilon=None`` only without noise.
    clip, refine_clip : float or None
        Public bounds on a subject's cumulant and second moment (Frobenius norm); None: :func:`default_clips`
        at the site's median subject length.
    refine_share : float in [0, 1)
        The refinement's share of the stage's mu^2; 0: no refinement round.
    random_state : None, int or numpy Generator
        Seeds the sites' noise and the aggregator's starts (a Generator gives the seed by one draw); None: OS
        entropy.
    """

    name = "cumulant-ica"

    def __init__(self, n_components: int, epsilon, delta, *, clip: float | None = None,
                 refine_clip: float | None = None, refine_share: float = REFINE_SHARE, random_state=None,
                 n_restarts: int = 8, n_iter: int = 60):
        for name, v in (("clip", clip), ("refine_clip", refine_clip)):
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf):
                raise ValueError(f"{name} must be a positive number (a public bound on a subject's term) or None, "
                                 f"got {v!r}")
        if isinstance(refine_share, bool) or not isinstance(refine_share, (int, float)) or not 0 <= refine_share < 1:
            raise ValueError(f"refine_share must be a number in [0, 1), got {refine_share!r}")
        self.R, self.random_state = int(n_components), privacy.resolve_random_state(random_state)
        self.clip, self.refine_clip = clip, refine_clip
        self.refine_share = float(refine_share)
        self.n_restarts, self.n_iter = int(n_restarts), int(n_iter)
        self.epsilon, self.delta = epsilon, delta
        z = privacy.noise_multiplier(epsilon, delta)
        self.z_refine = z / math.sqrt(self.refine_share) if self.refine_share > 0 else math.inf
        self.z_cumulant = z / math.sqrt(1.0 - self.refine_share)
        self.refines = self.refine_share > 0
        self.max_rounds = 2 if self.refines else 1

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The stage's (eps, delta), both releases together (what a planner rescales)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    @property
    def ledger_stages(self) -> tuple[str, ...]:
        return (self.name,)

    def _clips(self, lengths: Sequence[int]) -> tuple[float, float]:
        c, b = default_clips(self.R, int(np.median(lengths)))
        return (self.refine_clip or c), (self.clip or b)

    def site_init(self, site: int, data) -> dict:
        Z, lengths = data
        Z = np.asarray(Z)
        lengths = [int(n) for n in lengths]
        if Z.ndim != 2 or Z.shape[0] != self.R:
            raise ValueError(f"site {site}: whitened data must be {self.R} x N, got shape {Z.shape}")
        if sum(lengths) != Z.shape[1] or min(lengths) < 1:
            raise ValueError(f"site {site}: subject lengths must be positive and add up to {Z.shape[1]}")
        state = self.public_state(site, lengths)
        state["_Z"] = Z
        if self.random_state is not None:
            state["rng"] = np.random.default_rng([int(self.random_state), int(site)])
        return state

    def public_state(self, site: int, lengths: Sequence[int]) -> dict:
        N, n_max = int(sum(lengths)), max(lengths)
        c, B = self._clips(lengths)
        sens = 2.0 * B * n_max / N
        sens_refine = math.sqrt(2.0) * c * n_max / N
        ledger = PrivacyLedger(owner=f"site-{site}")
        if self.refines:
            ledger.note(f"{self.name}: first the subjects' second moments of the whitened data, each clipped to "
                        f"Frobenius norm {c:.6g}; sensitivity {sens_refine:.6g} = sqrt(2) * {c:.6g} * {n_max}/{N}; "
                        f"{self.refine_share:g} of the stage's mu^2")
        ledger.note(f"{self.name}: one release of the subjects' fourth-order cumulants of the "
                    f"{'refined ' if self.refines else ''}whitened data, each clipped to Frobenius norm {B:.6g}; "
                    f"privacy unit one subject, neighbours by replace, sensitivity {sens:.6g} = 2 * {B:.6g} * "
                    f"{n_max}/{N}")
        return {"site": site, "lengths": list(lengths), "n": N, "sensitivity": sens, "sensitivity_refine": sens_refine,
                "clips": (c, B), "ledger": ledger}

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        R, last = self.R, self.max_rounds - 1
        out = {"K4": ReleaseSpec((R * R, R * R), state["sensitivity"], self.z_cumulant, symmetric=True,
                                 unit="subject", stage=self.name, rounds=(last,))}
        if self.refines:
            out["S2"] = ReleaseSpec((R, R), state["sensitivity_refine"], self.z_refine, symmetric=True,
                                    unit="subject", stage=self.name, rounds=(0,))
        return out

    def site_weight(self, state) -> float:
        return float(state["n"])

    def _subjects(self, state):
        Z, start = state["_Z"], 0
        for n in state["lengths"]:
            yield n, Z[:, start:start + n]
            start += n

    def site_compute(self, state, round: int, broadcast: Payload | None) -> dict[str, np.ndarray]:
        c, B = state["clips"]
        if self.refines and round == 0:
            S = sum(n * subject_second_moment(Y, c) for n, Y in self._subjects(state))
            return {"S2": S / state["n"]}
        P = np.asarray(broadcast.arrays["P"], np.float64) if self.refines else None
        K = sum(n * subject_cumulant(Y if P is None else P @ Y, B) for n, Y in self._subjects(state))
        return {"K4": K / state["n"]}

    def aggregator_init(self) -> dict:
        return {}

    def aggregator_first(self, state) -> Payload:
        return Payload()

    def aggregator_update(self, state, round: int, combined: dict[str, np.ndarray]) -> Payload:
        if self.refines and round == 0:
            S = (combined["S2"] + combined["S2"].T) / 2
            theta, U = np.linalg.eigh(S)
            # the refined covariance's mean eigenvalue is about 1; noise above it all leaves 1
            level = float(theta.mean()) if theta.mean() > 0 else 1.0
            theta = np.maximum(theta, REFINE_FLOOR * level)
            P = (U / np.sqrt(theta)) @ U.T
            state.update(P=P, S_hat=S)
            return Payload({"P": P})
        P = state.get("P", np.eye(self.R))
        rng = np.random.default_rng(None if self.random_state is None else [int(self.random_state), 2**31 - 1])
        U = separate(combined["K4"], self.R, rng, n_restarts=self.n_restarts, n_iter=self.n_iter)
        state.update(U=U, W=U @ P, K4=combined["K4"])
        return Payload({"W": U @ P}, {"stop": True})


@dataclass
class CumulantICAResult:
    """The unmixing W (rows: directions in the whitened space) and every site's ledger."""

    W: np.ndarray
    ledgers: list[PrivacyLedger | None]

    def epsilon(self, delta: float, method: str = "exact", *, collusion: bool = False) -> float:
        return max(led.epsilon(delta, method, collusion=collusion) for led in self.ledgers if led is not None)


def cape_cumulant_ica(Z_sites, subjects, epsilon, delta, *, clip: float | None = None,
                      refine_clip: float | None = None, refine_share: float = REFINE_SHARE, plan="cape",
                      random_state=None, exchange=None, options=None) -> CumulantICAResult:
    """Run the cumulant ICA over the sites' whitened data (``subjects``: per site, a count, the lengths or the
    column ranges, as :func:`dpneuro.data.matrix.subject_ranges` reads them). W's rows unmix the given data."""
    plan = NoisePlan.coerce(plan)
    if plan.kind != "none" and (epsilon is None or math.isinf(epsilon)):
        raise ValueError("a private plan needs a finite epsilon")
    alg = CapeCumulantICA(Z_sites[0].shape[0], None if plan.kind == "none" else epsilon, delta, clip=clip,
                          refine_clip=refine_clip, refine_share=refine_share,
                          random_state=random_state)
    data = [(Z, [b - a for a, b in subject_ranges(sub, Z.shape[1])])
            for Z, sub in zip(Z_sites, subjects, strict=True)]
    res = run_cape(alg, data, plan, exchange=exchange, options=options)
    return CumulantICAResult(np.asarray(res.aggregator["W"]), cape_ledgers(res))
