"""One-shot temporal ICA: one CAPE release of the sites' fourth-order cumulants, separated by the aggregator.

capeDJICA releases a gradient every round; under privacy its rounds cost most
of a temporal run's budget. Independent sources can also be read off the
fourth-order cumulant tensor of the whitened data: for z = A s with A
orthogonal and independent unit-variance s_r,
kappa_4(z) = E[z (x) z (x) z (x) z] - G = sum_r k_r a_r (x) a_r (x) a_r (x) a_r,
G_ijkl = d_ij d_kl + d_ik d_jl + d_il d_jk the Gaussian part and k_r the
sources' excess kurtoses (the tensor JADE diagonalises). So each site
releases its subjects' cumulant tensor once; the aggregator symmetrises the
noisy average and finds the a_r by the tensor power method with deflation
(post-processing).

Site step. Subject m with n_m whitened time points Y_m (R x n_m):
C_m = (1/n_m) sum_t y_t (x) y_t (x) y_t (x) y_t - G, scaled to Frobenius norm
<= B (the public ``clip``); the site releases sum_m n_m C_m / N_s as an
R^2 x R^2 symmetric matrix (pairs (ij), (kl)).

Sensitivity (replace one subject): its term changes by at most 2 B n_max / N_s
(triangle inequality; C_m is not PSD, so the sqrt(2) of the second moments
does not apply), in the Frobenius norm the symmetric release's noise is
calibrated to (:mod:`dpneuro.cape.packing`). One release: the run's (eps,
delta) calibrates it. Averaging the noisy tensor over the 24 index orders at
the aggregator is post-processing.

Aggregator step. For r = 1..R: the tensor power iteration
w <- T(., w, w, w) / ||.||, orthogonal to the directions already found, from
``n_restarts`` random starts (public randomness), keeps the start whose
|T(w, w, w, w)| is largest; then deflates T -= T(w,w,w,w) w^(x)4. The rows of
W are the directions: sources = W z.

It assumes white input (unit covariance, orthogonal mixing): the Gaussian part
subtracted is that of the identity. After dpneuro's private whitening the
data are only roughly white, and then it does not separate
(benchmarks/djica_end_to_end.py: qNGI ~0.3 where capeDJICA, which learns a
general unmixing, reaches 0.07). Not yet selectable in a run.
"""

from __future__ import annotations

import functools
import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .. import privacy
from ..cape import ReleaseSpec, ledgers as cape_ledgers, run_cape
from ..cape.plans import NoisePlan
from ..exchange import Payload
from ..io import subject_ranges
from ..privacy import PrivacyLedger

__all__ = ["CapeCumulantICA", "CumulantICAResult", "cape_cumulant_ica", "gaussian_part", "subject_cumulant"]

_PERMS = tuple(itertools.permutations(range(4)))


@functools.lru_cache(maxsize=8)
def gaussian_part(R: int) -> np.ndarray:
    """G_ijkl = d_ij d_kl + d_ik d_jl + d_il d_jk as an R^2 x R^2 matrix: the fourth moment of white noise.

    Built once per R (every subject subtracts it) and returned read-only.
    """
    eye = np.eye(R)
    G = (np.einsum("ij,kl->ijkl", eye, eye) + np.einsum("ik,jl->ijkl", eye, eye)
         + np.einsum("il,jk->ijkl", eye, eye)).reshape(R * R, R * R)
    G.flags.writeable = False
    return G


def subject_cumulant(Y: np.ndarray, clip: float | None = None) -> np.ndarray:
    """A subject's fourth-order cumulant of its whitened time points Y (R x n), R^2 x R^2, clipped to ``clip``."""
    R, n = Y.shape
    Y = np.asarray(Y, np.float64)
    YY = (Y[:, None, :] * Y[None, :, :]).reshape(R * R, n)
    C = YY @ YY.T / n - gaussian_part(R)
    if clip is not None:
        norm = float(np.linalg.norm(C))
        if norm > clip:
            C *= clip / norm
    return C


def symmetrize4(K: np.ndarray, R: int) -> np.ndarray:
    """Average an R^2 x R^2 matrix, read as an R x R x R x R tensor, over the 24 index orders."""
    T = K.reshape(R, R, R, R)
    return (sum(T.transpose(p) for p in _PERMS) / len(_PERMS)).reshape(R * R, R * R)


def power_directions(K: np.ndarray, R: int, rng: np.random.Generator, *, n_restarts: int = 8,
                     n_iter: int = 60) -> np.ndarray:
    """Orthonormal directions (rows) of a symmetric 4th-order tensor by the power method with deflation."""
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


class CapeCumulantICA:
    """The one-shot cumulant release as a :mod:`dpneuro.cape` algorithm (one round; module docstring).

    Parameters
    ----------
    n_components : int
        R, the whitened data's dimension.
    epsilon, delta : float
        The release's (eps, delta); ``epsilon=None`` only without noise.
    clip : float
        Public bound B on a subject's cumulant (Frobenius norm).
    seed : int or None
        Seeds the sites' noise and the aggregator's starts; None: OS entropy.
    """

    name = "cumulant-ica"
    max_rounds = 1

    def __init__(self, n_components: int, epsilon, delta, *, clip: float, seed: int | None = None,
                 n_restarts: int = 8, n_iter: int = 60):
        if not (isinstance(clip, (int, float)) and not isinstance(clip, bool) and 0 < clip < math.inf):
            raise ValueError(f"clip must be a positive number (the public bound on a subject's cumulant), got {clip!r}")
        self.R, self.clip, self.seed = int(n_components), float(clip), seed
        self.n_restarts, self.n_iter = int(n_restarts), int(n_iter)
        self.epsilon, self.delta = epsilon, delta
        self.z = privacy.noise_multiplier(epsilon, delta)

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
        if self.seed is not None:
            state["rng"] = np.random.default_rng([int(self.seed), int(site)])
        return state

    def public_state(self, site: int, lengths: Sequence[int]) -> dict:
        N = int(sum(lengths))
        sens = 2.0 * self.clip * max(lengths) / N
        ledger = PrivacyLedger(owner=f"site-{site}")
        ledger.note(f"{self.name}: one release of the subjects' fourth-order cumulants of the whitened data, each "
                    f"clipped to Frobenius norm {self.clip:g}; privacy unit one subject, neighbours by replace, "
                    f"sensitivity {sens:.6g} = 2 * {self.clip:g} * {max(lengths)}/{N}")
        return {"site": site, "lengths": list(lengths), "n": N, "sensitivity": sens, "ledger": ledger}

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        return {"K4": ReleaseSpec((self.R * self.R, self.R * self.R), state["sensitivity"], self.z, symmetric=True,
                                  unit="subject", stage=self.name)}

    def site_weight(self, state) -> float:
        return float(state["n"])

    def site_compute(self, state, round: int, broadcast: Payload | None) -> dict[str, np.ndarray]:
        Z, K, start = state["_Z"], 0.0, 0
        for n in state["lengths"]:
            K = K + n * subject_cumulant(Z[:, start:start + n], self.clip)
            start += n
        return {"K4": K / state["n"]}

    def aggregator_init(self) -> dict:
        return {}

    def aggregator_first(self, state) -> Payload:
        return Payload()

    def aggregator_update(self, state, round: int, combined: dict[str, np.ndarray]) -> Payload:
        rng = np.random.default_rng(None if self.seed is None else [int(self.seed), 2**31 - 1])
        W = power_directions(combined["K4"], self.R, rng, n_restarts=self.n_restarts, n_iter=self.n_iter)
        state.update(W=W, K4=combined["K4"])
        return Payload({"W": W}, {"stop": True})


@dataclass
class CumulantICAResult:
    """The unmixing W (rows: directions in the whitened space) and every site's ledger."""

    W: np.ndarray
    ledgers: list[PrivacyLedger | None]

    def epsilon(self, delta: float, method: str = "exact", *, collusion: bool = False) -> float:
        return max(led.epsilon(delta, method, collusion=collusion) for led in self.ledgers if led is not None)


def cape_cumulant_ica(Z_sites, subjects, epsilon, delta, *, clip: float, plan="cape", random_state=None,
                      exchange=None, options=None) -> CumulantICAResult:
    """Run the one-shot cumulant ICA over the sites' whitened data (``subjects``: per site, a count, the
    lengths or the column ranges, as :func:`dpneuro.io.subject_ranges` reads them)."""
    plan = NoisePlan.coerce(plan)
    if plan.kind != "none" and (epsilon is None or math.isinf(epsilon)):
        raise ValueError("a private plan needs a finite epsilon")
    alg = CapeCumulantICA(Z_sites[0].shape[0], None if plan.kind == "none" else epsilon, delta, clip=clip,
                          seed=privacy.resolve_random_state(random_state))
    data = [(Z, [b - a for a, b in subject_ranges(sub, Z.shape[1])])
            for Z, sub in zip(Z_sites, subjects, strict=True)]
    res = run_cape(alg, data, plan, exchange=exchange, options=options)
    return CumulantICAResult(np.asarray(res.aggregator["W"]), cape_ledgers(res))
