"""capeAGN: decentralized differentially private orthogonal tensor decomposition.

Implements [CAPE-TF] Sec. V / Alg. 3 (capeAGN) on top of the CAPE wrapper, the
centralized AGN and AVN mechanisms of [DP-OTD] (Alg. 1), the local baseline (one
site alone), and a brain-state helper for reduced fMRI time points.

Models ([CAPE-TF] App. B). Samples are columns.

- ``"mog"``: spherical mixture of Gaussians, x = a_h + z, z ~ N(0, sigma^2 I).
  Site data: a D x N_s matrix. M2 = E[x x^T] - sigma^2 I,
  M3 = E[x (x) x (x) x] - sigma^2 sum_d (m e_d e_d + e_d m e_d + e_d e_d m), m = E[x].
- ``"stm"``: single topic model. Site data: one-hot words, an L x D x N_s
  array (L >= 3 words per document, t_l[:, n] one-hot); the first three words
  are used. M2 = E[t1 t2^T], M3 = E[t1 (x) t2 (x) t3], both symmetrised (the
  symmetric noise protects only a symmetric quantity; an unsymmetrised
  empirical moment would leak its antisymmetric part without noise).

Protocol (two CAPE runs, each one release per site):

1. stage ``agn-m2``: each site releases its second moment (D x D, symmetric
   noise on the D(D+1)/2 unique entries, shaped as :mod:`dpneuro.protocol.cape.packing`
   says: "symmetrized" by default, the papers' "mirrored" on request) with
   budget (eps_1, delta_1). The
   aggregator averages, estimates sigma^2 if not given (post-processing),
   forms M2 and broadcasts W = U_k D_k^{-1/2} and sigma^2.
2. stage ``agn-m3``: each site computes its D x D x D M3_s, CAPE adds a
   symmetric noise tensor drawn on its C(D+2, 3) unique entries, and the site
   sends only (M3_s + noise)(W, W, W), k x k x k (``site_postprocess``). The
   aggregator averages and runs the tensor power method; a_k = (W^T)^+ lambda_k u_k,
   w_k = 1 / lambda_k^2.

Privacy unit and sensitivities (L2, replace-one neighbours, ||x||_2 <= 1 for
MOG; a site with N_s samples; [CAPE-TF] App. C):

- M2, STM: sqrt(2)/N_s ([CAPE-TF] App. C).
- M2, MOG: sqrt(2)/N_s. [CAPE-TF] App. C gives 1/N_s, but that bound is on the
  spectral norm; the Gaussian mechanism needs the L2 norm of the released
  (unique) entries, and x = e_1 replaced by x' = e_2 changes two diagonal
  entries by 1/N_s each, so the L2 sensitivity is sqrt(2)/N_s (and
  ||x x^T - x' x'^T||_F <= sqrt(2) for unit vectors, so that is the max).
- M3, STM: sqrt(2)/N_s; M3, MOG: 2/N_s + 6 D sigma^2/N_s ([CAPE-TF] App. C; a bound
  on the Frobenius norm, hence on the unique entries).

The unit is one *sample* (one observation or document), as in the papers; the
ledgers say so. :func:`moment_stage` (which the dFNC states use on windows) can
use subject-level privacy: a subject owning m samples multiplies every
sensitivity by m.

MOG data must satisfy ||x||_2 <= 1. Pass ``scale`` (a public constant agreed
beforehand, never computed from the data): samples are divided by it and any
that still exceed the unit ball are projected onto it (per-sample, so the
sensitivities hold); components are returned in the data's units.

sigma^2: if not given, it is estimated at the aggregator from the noisy
stage-1 release (mean of the D - k smallest eigenvalues of E[x x^T]), which is
free post-processing, and broadcast. The reference code instead uses each
site's smallest covariance eigenvalue, a statistic of private data that
enters both the released moments and their sensitivities without any noise;
we do not do that.

Noise calibration is the analytic Gaussian mechanism (Balle & Wang 2018)
through :func:`dpneuro.privacy.noise_multiplier`; the papers' classic formula
needs eps < 1 and adds more noise. ``split`` divides eps and delta between the
stages (AVN: delta goes entirely to stage 1, stage 2 is pure eps_2-DP).
"""

from __future__ import annotations

import math
import time
import warnings
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dpneuro import privacy
from dpneuro.algorithms import tensor as tz
from dpneuro.privacy import PrivacyLedger, noise_multiplier
from dpneuro.privacy.noise import vector_laplace
from dpneuro.protocol.cape import ReleaseSpec, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers
from dpneuro.protocol.cape.packing import check_symmetric_noise, noise_array
from dpneuro.protocol.cape.plans import NoisePlan
from dpneuro.protocol.exchange import Payload

__all__ = [
    "AGNResult",
    "PreparedSite",
    "agn",
    "avn",
    "cape_agn",
    "finish_moments",
    "local_agn",
    "moment_stage",
    "otd",
    "prepare_site",
    "sensitivities",
]

MODELS = ("mog", "stm")
SIMPLEX = ("euclidean", "clip")
_UNIT_NOTE = {
    "sample": "capeAGN privacy unit: one sample (one observation / document), replace-one "
              "neighbours, sensitivities of [CAPE-TF] App. C (MOG M2: sqrt(2)/N_s, see dpneuro.algorithms.agn)",
    "subject": "capeAGN privacy unit: one subject (all of its samples); sensitivities are the "
               "per-sample ones times the samples a subject owns",
}


# -- results -----------------------------------------------------------------------------

@dataclass
class AGNResult:
    """Recovered model and the privacy record of one OTD run.

    Attributes
    ----------
    components : ndarray, shape (D, k)
        Recovered a_k as columns, in the data's units (MOG) or as probability
        vectors (STM, after projection onto the simplex).
    weights : ndarray, shape (k,)
        w_k = 1 / lambda_k^2 (estimates of the mixture / topic weights; not
        renormalised).
    eigenvalues : ndarray, shape (k,)
        lambda_k of the whitened tensor.
    whitening : ndarray, shape (D, k)
        W = U D^{-1/2} (in the data's units), public after stage 1.
    sigma2 : float or None
        sigma^2 used (MOG; data units), given or estimated from the stage-1 release.
    ledgers : list of PrivacyLedger
        One per releasing party (sites; one ledger for centralized methods).
    epsilon_pure : float
        Pure-eps part not in the (Gaussian-only) ledgers: AVN's stage 2.
    info : dict
        Noise stds, sensitivities, timings (seconds) and other run details.
    """

    components: np.ndarray
    weights: np.ndarray
    eigenvalues: np.ndarray
    whitening: np.ndarray
    sigma2: float | None
    ledgers: list[PrivacyLedger]
    method: str
    model: str
    epsilon_pure: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


@dataclass(eq=False)
class PreparedSite:
    """One site's samples validated and prepared for capeAGN's moments (stays at the site)."""

    model: str
    D: int
    n: int
    X: np.ndarray | None = None  # MOG: scaled and clipped, D x n
    words: np.ndarray | None = None  # STM: word ids of the first three words, 3 x n
    raw: np.ndarray | None = None  # MOG: the samples as given (occupancies)
    scale: float = 1.0
    n_clipped: int = 0  # MOG samples projected onto the unit ball (not released)
    cache: dict = field(default_factory=dict, repr=False)  # site-local derived moments


# -- validation ---------------------------------------------------------------------------

def prepare_site(samples, model: str = "mog", *, scale: float | None = None, site: int | str = 0,
                 warn_clipping: bool = True) -> PreparedSite:
    """Validate one site's samples and bring them to the form the moments use.

    Raises ValueError (naming the site) for non-finite values, wrong shapes,
    STM input that is not one-hot words, or MOG samples outside the unit
    ball when no ``scale`` is given. Nothing is released.
    """
    if isinstance(samples, PreparedSite):
        return samples
    _check_model(model)
    where = f"site {site}"
    arr = np.asarray(samples)
    if arr.dtype == object or not (np.issubdtype(arr.dtype, np.number) or arr.dtype == bool):
        raise ValueError(f"{where}: samples must be a numeric array, got dtype {arr.dtype}")
    if np.iscomplexobj(arr):
        raise ValueError(f"{where}: samples must be real")
    if model == "mog":
        if arr.ndim != 2:
            raise ValueError(f"{where}: MOG samples must be a D x N matrix (samples are columns), "
                             f"got shape {arr.shape}")
        arr = arr.astype(np.float64, copy=False)
        D, n = arr.shape
        if D < 1 or n < 1:
            raise ValueError(f"{where}: empty data (shape {arr.shape})")
        if not np.all(np.isfinite(arr)):
            raise ValueError(f"{where}: samples contain NaN or infinite values")
        if scale is None:
            if np.any(np.einsum("dn,dn->n", arr, arr) > 1.0 + 1e-9):
                raise ValueError(
                    f"{where}: some samples have ||x||_2 > 1, outside the sensitivity analysis of "
                    "[CAPE-TF] App. C; pass scale=zeta, a public bound agreed beforehand (samples are divided "
                    "by it and projected onto the unit ball)")
            X, n_clip = arr, 0
        else:
            if not (scale > 0) or not math.isfinite(scale):
                raise ValueError(f"scale must be finite and > 0, got {scale}")
            X = arr / scale
            norms = np.sqrt(np.einsum("dn,dn->n", X, X))
            over = norms > 1.0
            n_clip = int(over.sum())
            if n_clip:
                X = X.copy()
                X[:, over] /= norms[over]
            if warn_clipping and n_clip > 0.05 * n:
                # local diagnostic only; the count is never released
                warnings.warn(f"{where}: {n_clip} of {n} samples exceed the norm bound scale={scale} and "
                              "were projected onto it; a larger scale would bias the moments less",
                              stacklevel=2)
        return PreparedSite("mog", D, n, X=X, raw=arr, scale=float(scale or 1.0), n_clipped=n_clip)
    # STM: one-hot words
    if scale is not None:
        raise ValueError("scale applies to MOG samples only (STM words are one-hot, ||t|| = 1)")
    if arr.ndim != 3:
        raise ValueError(f"{where}: STM samples must be one-hot words, an L x D x N array (L >= 3 words "
                         f"per document, t_l[:, n] one-hot), got shape {arr.shape}")
    L, D, n = arr.shape
    if L < 3:
        raise ValueError(f"{where}: STM needs at least 3 words per document, got L = {L}")
    if D < 1 or n < 1:
        raise ValueError(f"{where}: empty data (shape {arr.shape})")
    t = arr[:3].astype(np.float64, copy=False)
    if not np.all(np.isfinite(t)):
        raise ValueError(f"{where}: samples contain NaN or infinite values")
    if not np.all((t == 0) | (t == 1)) or not np.all(t.sum(axis=1) == 1):
        raise ValueError(f"{where}: STM input must be one-hot words: every t_l[:, n] must have "
                         "exactly one entry 1 and the others 0")
    words = np.argmax(t, axis=1).astype(np.int64)  # 3 x n
    return PreparedSite("stm", D, n, words=words)


def _check_model(model: str) -> None:
    if model not in MODELS:
        raise ValueError(f"unknown model {model!r}; use one of {MODELS}")


def _check_privacy(epsilon: float, delta: float) -> None:
    if not (isinstance(epsilon, (int, float, np.floating, np.integer)) and epsilon > 0 and math.isfinite(epsilon)):
        raise ValueError(f"epsilon must be finite and > 0, got {epsilon}")
    if not (isinstance(delta, (int, float, np.floating)) and 0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")


def _check_split(split, n_parts: int) -> tuple[float, ...]:
    try:
        parts = tuple(float(x) for x in split)
    except TypeError:
        raise ValueError(f"split must be a sequence of {n_parts} fractions, got {split!r}") from None
    if len(parts) != n_parts:
        raise ValueError(f"split must have {n_parts} entries (one per stage), got {len(parts)}: {split!r}")
    if not all(math.isfinite(p) and p > 0 for p in parts):
        raise ValueError(f"infeasible privacy split {split!r}: every stage needs a positive share")
    if not math.isclose(sum(parts), 1.0, rel_tol=0, abs_tol=1e-9):
        raise ValueError(f"infeasible privacy split {split!r}: the shares must sum to 1 (got {sum(parts)})")
    return parts


def check_k(k, D: int, n_total: int, model: str, sigma2) -> int:
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)):
        raise ValueError(f"k must be an integer, got {k!r}")
    k = int(k)
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    if k > D:
        raise ValueError(f"k = {k} components exceed the dimension D = {D}: the whitened tensor is k x k x k "
                         "and needs k <= D linearly independent components")
    if k > n_total:
        raise ValueError(f"k = {k} exceeds the number of samples ({n_total})")
    if model == "mog" and sigma2 is None and k >= D:
        raise ValueError(f"k = {k} = D: sigma^2 cannot be estimated from E[xx^T] without noise-only "
                         "directions; pass sigma2 (public) or use k < D")
    return k


def _check_sigma2(sigma2, model: str) -> None:
    if sigma2 is None:
        return
    if model != "mog":
        raise ValueError("sigma2 applies to the MOG model only")
    if not (isinstance(sigma2, (int, float, np.floating, np.integer)) and sigma2 >= 0 and math.isfinite(sigma2)):
        raise ValueError(f"sigma2 must be finite and >= 0, got {sigma2}")


def _check_tpm(n_restarts, n_iter, simplex) -> None:
    for name, v in (("n_restarts", n_restarts), ("n_iter", n_iter)):
        if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < 1:
            raise ValueError(f"{name} must be a positive integer, got {v!r}")
    if simplex not in SIMPLEX:
        raise ValueError(f"simplex must be one of {SIMPLEX}, got {simplex!r}")


def _groups(samples_per_unit, unit: str, n_sites: int) -> list[int]:
    if unit not in ("sample", "subject"):
        raise ValueError(f"unit must be 'sample' or 'subject', got {unit!r}")
    g = samples_per_unit
    groups = [g] * n_sites if np.isscalar(g) else list(g)
    if len(groups) != n_sites:
        raise ValueError(f"samples_per_unit has {len(groups)} entries for {n_sites} sites")
    for s, m in enumerate(groups):
        if isinstance(m, bool) or not isinstance(m, (int, np.integer)) or m < 1:
            raise ValueError(f"site {s}: samples_per_unit must be a positive integer, got {m!r}")
    if unit == "sample" and any(m != 1 for m in groups):
        raise ValueError("unit='sample' means one sample per privacy unit; use unit='subject' "
                         "with samples_per_unit = samples a subject owns")
    return [int(m) for m in groups]


def sensitivities(model: str, D: int, n: int, sigma2: float = 0.0, group: int = 1) -> tuple[float, float]:
    """L2 sensitivities (Delta_2, Delta_3) of a site's M2 and M3 (see the module docstring).

    ``n`` is the site's sample count, ``sigma2`` the MOG noise variance in the
    scaled units (||x|| <= 1), ``group`` the samples one privacy unit owns.
    """
    _check_model(model)
    if model == "mog":
        d2, d3 = math.sqrt(2.0), 2.0 + 6.0 * D * sigma2
    else:
        d2 = d3 = math.sqrt(2.0)
    return d2 * group / n, d3 * group / n


# -- per-site moments ----------------------------------------------------------------------

def _second_moment(sd: PreparedSite) -> np.ndarray:
    """E[x x^T] (MOG; sigma^2 I is subtracted at the aggregator) or symmetrised E[t1 t2^T] (STM)."""
    if sd.model == "mog":
        S = sd.X @ sd.X.T / sd.n
        return (S + S.T) / 2.0
    return tz.stm_second_moment(sd.words, sd.D)


def _third_moment(sd: PreparedSite, sigma2: float) -> np.ndarray:
    """Full D x D x D M3 of a site, exactly symmetric."""
    if sd.model == "mog":
        if "m3raw" not in sd.cache:  # E[x(x)x(x)x] is the costly part (N D^3 / 2); reused across runs
            sd.cache["m3raw"] = tz.third_moment(sd.X)
        m = sd.X.mean(axis=1)
        return tz.symmetrize(sd.cache["m3raw"] - sigma2 * tz.mog_correction(m))
    return tz.stm_third_moment(sd.words, sd.D)


def third_moment_whitened(sd: PreparedSite, W: np.ndarray, sigma2: float) -> np.ndarray:
    """M3(W, W, W) without forming the D^3 tensor."""
    if sd.model == "mog":
        m = sd.X.mean(axis=1)
        return tz.whitened_third_moment(sd.X, W) - sigma2 * tz.mog_correction_whitened(m, W)
    return tz.stm_whitened_third_moment(sd.words, W)


def _whiten(S_hat: np.ndarray, k: int, model: str, sigma2: float | None) -> tuple[np.ndarray, float | None]:
    """Aggregator step after stage 1: sigma^2 (MOG) and W, both post-processing of the release."""
    if model == "mog":
        s2 = tz.estimate_sigma2(S_hat, k) if sigma2 is None else float(sigma2)
        W, _ = tz.whitening(S_hat - s2 * np.eye(S_hat.shape[0]), k)
        return W, s2
    W, _ = tz.whitening(S_hat, k)
    return W, None


def _finish(T: np.ndarray, W: np.ndarray, k: int, model: str, scale: float, simplex: str,
            n_restarts: int, n_iter: int, rng: np.random.Generator):
    """Tensor power method on the whitened tensor and recovery of (a_k, w_k)."""
    lambdas, U = tz.tensor_power(tz.symmetrize(T), k, n_restarts=n_restarts, n_iter=n_iter, random_state=rng)
    A, w = tz.recover(W, lambdas, U)
    if model == "mog":
        A = A * scale
    elif simplex == "euclidean":
        A = tz.project_simplex(A)
    else:
        A = np.maximum(A, 0.0)
        tot = A.sum(axis=0)
        A = np.where(tot > 0, A / np.where(tot > 0, tot, 1.0), 1.0 / A.shape[0])
    return A, w, lambdas


# -- CAPE stages ---------------------------------------------------------------------------

class _Stage:
    """Shared site-side plumbing of the CAPE stages."""

    max_rounds = 1

    #: the ledger's stage names of the stage's release
    ledger_stages: tuple[str, ...] = ()

    def __init__(self, model: str, noise_multiplier: float, unit: str, groups: list[int],
                 seed: int | None, stage_id: int, scale: float | None, symmetric_noise: str = "symmetrized",
                 budget: privacy.GaussianBudget | None = None):
        self.model, self.z, self.unit, self.groups = model, noise_multiplier, unit, groups
        self.seed, self.stage_id, self.scale = seed, stage_id, scale
        self.symmetric_noise = check_symmetric_noise(symmetric_noise)
        self.budget = budget  # the (eps, delta) the noise multiplier was calibrated to, for a planner

    #: brain states clip about half of the time points on purpose (a tight public bound): no warning then
    quiet_clipping = False

    def site_init(self, site: int, data) -> dict:
        sd = prepare_site(data, self.model, scale=self.scale, site=site, warn_clipping=not self.quiet_clipping)
        state: dict[str, Any] = {"_data": sd, "n": sd.n, "D": sd.D, "group": self.groups[site]}
        if self.seed is not None:
            state["rng"] = np.random.default_rng([self.seed, self.stage_id, site])
        return state

    def site_weight(self, state) -> float:
        return float(state["n"])

    def public_state(self, site: int, lengths, dim: int) -> dict:
        """What a site's releases depend on: its counts (the budget planner calls this without data)."""
        lengths = [int(n) for n in lengths]
        group = max(lengths) if self.unit == "subject" else 1
        return {"n": sum(lengths), "D": int(dim), "group": group}

    def aggregator_init(self) -> dict:
        return {}

    def aggregator_first(self, state) -> Payload:
        return Payload()


class _M2Stage(_Stage):
    """Stage 1: sites release E[x x^T] (or sym E[t1 t2^T]); the aggregator broadcasts W and sigma^2."""

    name = "capeagn-m2"
    ledger_stages = ("agn-m2",)

    def __init__(self, *args, k: int, sigma2: float | None, **kw):
        super().__init__(*args, **kw)
        self.k, self.sigma2 = k, sigma2

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        d2, _ = sensitivities(self.model, state["D"], state["n"], 0.0, state["group"])
        return {"m2": ReleaseSpec((state["D"], state["D"]), d2, self.z, symmetric=True,
                                  unit=self.unit, stage=self.ledger_stages[0], symmetric_noise=self.symmetric_noise)}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        return {"m2": _second_moment(state["_data"])}

    def aggregator_update(self, state, round, combined) -> Payload:
        state["m2"] = combined["m2"]
        W, s2 = _whiten(combined["m2"], self.k, self.model, self.sigma2)
        state["W"], state["sigma2"] = W, s2
        arrays = {"W": W} if s2 is None else {"W": W, "sigma2": np.array([s2])}
        return Payload(arrays, {"stop": True}, carries={k: "public (post-processing)" for k in arrays})


class M3Stage(_Stage):
    """Stage 2: sites release (M3_s + symmetric noise)(W, W, W)."""

    name = "capeagn-m3"
    ledger_stages = ("agn-m3",)

    def __init__(self, *args, W: np.ndarray, sigma2: float, **kw):
        super().__init__(*args, **kw)
        self.W, self.sigma2 = W, sigma2

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        D = state["D"]
        _, d3 = sensitivities(self.model, D, state["n"], self.sigma2, state["group"])
        return {"m3": ReleaseSpec((D, D, D), d3, self.z, symmetric=True, unit=self.unit,
                                  stage=self.ledger_stages[0], symmetric_noise=self.symmetric_noise)}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        return {"m3": _third_moment(state["_data"], self.sigma2)}

    def site_postprocess(self, state, name: str, noisy: np.ndarray) -> np.ndarray:
        # linear, identical at all sites (W is the public stage-1 broadcast)
        return tz.multilinear(noisy, self.W)

    def aggregator_update(self, state, round, combined) -> Payload:
        state["m3w"] = combined["m3"]
        return Payload(meta={"stop": True})


def moment_stage(order: int, n_components: int, noise_multiplier: float, groups, *, scale: float,
                 random_state=None, W: np.ndarray | None = None, sigma2: float | None = None,
                 budget: privacy.GaussianBudget | None = None):
    """One capeAGN release on MOG samples as a CAPE algorithm: ``order`` 2 (M2, then W and sigma^2) or 3.

    For the product's brain-states stage, run by every entry point through the
    driver: ``groups`` maps each site id to the samples one subject owns there
    (subject-level privacy); a deployed site needs only its own entry. Stage 3
    needs the public ``W`` and ``sigma2`` of stage 2's broadcast (in the
    scaled units). ``budget``: the (eps, delta) ``noise_multiplier`` was calibrated to, which the stage
    reports to a planner. ``random_state`` (None, an int or a Generator) seeds the sites' noise.
    """
    common = dict(unit="subject", groups=groups, seed=privacy.resolve_random_state(random_state), scale=scale,
                  budget=budget)
    if order == 2:
        stage = _M2Stage("mog", noise_multiplier, stage_id=1, k=n_components, sigma2=None, **common)
    elif order == 3:
        if W is None:
            raise ValueError("the third-moment stage needs W from the second-moment stage")
        stage = M3Stage("mog", noise_multiplier, stage_id=2, W=np.asarray(W, np.float64),
                         sigma2=float(sigma2 or 0.0), **common)
    else:
        raise ValueError(f"order must be 2 or 3, got {order!r}")
    stage.quiet_clipping = True
    return stage


def finish_moments(m3w: np.ndarray, W: np.ndarray, n_components: int, *, scale: float, random_state=None,
                   n_restarts: int = 30, n_iter: int = 50) -> tuple[np.ndarray, np.ndarray]:
    """The aggregator's last step (post-processing): components (data units, as columns) and weights."""
    seed = privacy.resolve_random_state(random_state)
    rng = np.random.default_rng(None if seed is None else [seed, 99])
    A, w, _ = _finish(np.asarray(m3w), np.asarray(W), n_components, "mog", scale, "euclidean", n_restarts,
                      n_iter, rng)
    return A, w


# -- drivers -------------------------------------------------------------------------------

def _prepare_all(site_samples, model: str, scale) -> list[PreparedSite]:
    if isinstance(site_samples, np.ndarray) or not isinstance(site_samples, Sequence):
        raise ValueError("site_samples must be a list with one data array per site")
    if len(site_samples) < 1:
        raise ValueError("no sites given")
    sites = [prepare_site(x, model, scale=scale, site=s) for s, x in enumerate(site_samples)]
    D0, sc0 = sites[0].D, sites[0].scale
    for s, sd in enumerate(sites):
        if sd.D != D0:
            raise ValueError(f"site {s} has D = {sd.D} features but site 0 has D = {D0}: "
                             "all sites must share the feature space")
        if sd.scale != sc0 or (scale is not None and model == "mog" and sd.scale != scale):
            raise ValueError(f"site {s} was prepared with scale {sd.scale}, not {scale if scale else sc0}: "
                             "all sites must use the same public scale")
    return sites


def cape_agn(site_samples: Sequence, n_components: int, epsilon: float, delta: float, *, model: str = "mog",
             plan: str | NoisePlan = "cape", split: Sequence[float] = (0.5, 0.5), sigma2: float | None = None,
             scale: float | None = None, random_state=None, n_restarts: int = 30, n_iter: int = 50,
             simplex: str = "euclidean", unit: str = "sample", samples_per_unit: int | Sequence[int] = 1,
             secagg_config=None, symmetric_noise: str = "symmetrized") -> AGNResult:
    """Decentralized DP orthogonal tensor decomposition (capeAGN, [CAPE-TF] Alg. 3).

    Parameters
    ----------
    site_samples : list
        One entry per site: a D x N_s matrix (MOG, samples are columns) or an
        L x D x N_s one-hot word array (STM).
    n_components : int
        Number of components (k <= D).
    epsilon, delta : float
        Total budget per site; ``split`` divides both between the stages.
    model : {"mog", "stm"}
    plan : {"cape", "conv", "none"} or NoisePlan
        "cape": correlated noise (needs >= 3 sites); "conv": independent noise
        of the full per-site std; "none": no noise (not private).
    split : (float, float)
        Shares of (eps, delta) for stage 1 (M2) and stage 2 (M3); positive, sum 1.
    sigma2 : float, optional
        MOG noise variance in the data's units (public). Default: estimated
        from the stage-1 release at the aggregator.
    scale : float, optional
        Public norm bound for MOG samples (see module docstring).
    random_state : None, int or numpy Generator
        Seeds the sites' noise and the power method's restarts (simulations
        and tests only; a Generator gives the seed by one draw; production
        runs draw from OS entropy).
    n_restarts, n_iter : int
        Tensor power method's L and N.
    simplex : {"euclidean", "clip"}
        STM post-processing of the components onto probability vectors.
    unit, samples_per_unit :
        Privacy unit; "subject" with the samples each subject owns (per site).
    symmetric_noise : {"symmetrized", "mirrored"}
        How the noise on the moments' unique entries is shaped
        (:mod:`dpneuro.protocol.cape.packing`): "symmetrized" (default) divides an entry
        standing for m entries of the full array by sqrt(m), at the same
        guarantee; "mirrored" is the papers'.

    Returns
    -------
    AGNResult
        Components, weights, per-site merged ledgers (both stages).
    """
    seed = privacy.resolve_random_state(random_state)
    _check_model(model)
    _check_privacy(epsilon, delta)
    eps_split = _check_split(split, 2)
    _check_sigma2(sigma2, model)
    _check_tpm(n_restarts, n_iter, simplex)
    nplan = NoisePlan.coerce(plan)
    sites = _prepare_all(site_samples, model, scale)
    nplan.check(len(sites))
    groups = _groups(samples_per_unit, unit, len(sites))
    D = sites[0].D
    k = check_k(n_components, D, sum(sd.n for sd in sites), model, sigma2)  # the papers' k
    sc = sites[0].scale
    s2_scaled = None if sigma2 is None else float(sigma2) / sc**2
    (e1, e2), (d1, d2) = _stage_budget(epsilon, delta, eps_split)
    z1, z2 = noise_multiplier(e1, d1), noise_multiplier(e2, d2)

    t0 = time.perf_counter()
    common = dict(unit=unit, groups=groups, seed=seed, scale=scale, symmetric_noise=symmetric_noise)
    st1 = _M2Stage(model, z1, stage_id=1, k=k, sigma2=s2_scaled, **common)
    r1 = run_cape(st1, sites, nplan, secagg_config=secagg_config)
    W, s2 = r1.aggregator["W"], r1.aggregator["sigma2"]
    t1 = time.perf_counter()
    st2 = M3Stage(model, z2, stage_id=2, W=W, sigma2=s2 or 0.0, **common)
    r2 = run_cape(st2, sites, nplan, secagg_config=secagg_config)
    t2 = time.perf_counter()
    rng = np.random.default_rng(None if seed is None else [seed, 99])
    A, w, lambdas = _finish(r2.aggregator["m3w"], W, k, model, sc, simplex, n_restarts, n_iter, rng)
    t3 = time.perf_counter()

    leds = []
    for l1, l2 in zip(cape_ledgers(r1), cape_ledgers(r2)):
        if l1 is None or l2 is None:
            leds.append(l1 or l2)
            continue
        led = l1.merge(l2)
        led.note(_UNIT_NOTE[unit])
        if model == "mog":
            led.note("sigma^2 " + ("given (public)" if sigma2 is not None else
                                   "estimated at the aggregator from the stage-1 release (post-processing)"))
        leds.append(led)
    info = {
        "plan": nplan.kind, "epsilon": (e1, e2), "delta": (d1, d2), "noise_multiplier": (z1, z2),
        "sensitivity": [sensitivities(model, D, sd.n, s2 or 0.0, g) for sd, g in zip(sites, groups)],
        "sigma2_scaled": s2, "scale": sc, "n_sites": len(sites),
        "time": {"stage1": t1 - t0, "stage2": t2 - t1, "tpm": t3 - t2, "total": t3 - t0},
    }
    return AGNResult(A, w, lambdas, W / sc, None if s2 is None else s2 * sc**2, leds,
                     f"capeagn[{nplan.kind}]", model, info=info)


def _stage_budget(epsilon: float, delta: float, split: tuple[float, ...]):
    eps = tuple(epsilon * p for p in split)
    dels = tuple(delta * p for p in split)
    return eps, dels


def _central(data, n_components: int, *, model: str, mechanism: str, epsilon: float | None, delta: float | None,
             split, sigma2, scale, seed, n_restarts, n_iter, simplex, unit, samples_per_unit,
             owner: str, symmetric_noise: str = "symmetrized") -> AGNResult:
    """AGN / AVN / non-private OTD on one party's data (pooled or one site)."""
    _check_model(model)
    _check_sigma2(sigma2, model)
    _check_tpm(n_restarts, n_iter, simplex)
    check_symmetric_noise(symmetric_noise)
    private = mechanism != "none"
    if private:
        _check_privacy(epsilon, delta)
        parts = _check_split(split, 2)
    sd = prepare_site(data, model, scale=scale, site=owner)
    group = _groups(samples_per_unit, unit, 1)[0]
    D, n = sd.D, sd.n
    k = check_k(n_components, D, n, model, sigma2)  # the papers' k
    sc = sd.scale
    s2_in = None if sigma2 is None else float(sigma2) / sc**2
    rng = np.random.default_rng(seed)
    ledger = PrivacyLedger(owner=owner)
    info: dict[str, Any] = {"time": {}}
    eps_pure = 0.0

    t0 = time.perf_counter()
    S = _second_moment(sd)
    if private:
        e1, e2 = epsilon * parts[0], epsilon * parts[1]
        # AVN's stage 2 is pure eps: all of delta goes to stage 1
        d1 = delta * parts[0] if mechanism == "agn" else delta
        d2 = delta * parts[1]
        d2_sens, _ = sensitivities(model, D, n, 0.0, group)
        tau1 = d2_sens * noise_multiplier(e1, d1)
        S = S + privacy.gaussian(rng, (D, D), tau1, ledger, symmetric=True, symmetric_noise=symmetric_noise)
        ledger.record("m2", d2_sens, tau1, unit=unit, stage="agn-m2")
        info.update(epsilon=(e1, e2), delta=(d1, d2 if mechanism == "agn" else 0.0), tau_m2=tau1)
    W, s2 = _whiten(S, k, model, s2_in)
    t1 = time.perf_counter()
    T = third_moment_whitened(sd, W, s2 or 0.0)
    t2 = time.perf_counter()
    if private:
        _, d3_sens = sensitivities(model, D, n, s2 or 0.0, group)
        if mechanism == "agn":
            tau2 = d3_sens * noise_multiplier(e2, d2)
            b = privacy.gaussian(rng, (tz.n_sym(D),), tau2, ledger)
            ledger.record("m3", d3_sens, tau2, unit=unit, stage="agn-m3")
            info["tau_m3"] = tau2
        else:
            beta = e2 / d3_sens
            b = vector_laplace(rng, tz.n_sym(D), beta, ledger)
            eps_pure = e2
            ledger.note(f"AVN stage 'agn-m3': pure eps = {e2:.6g} release (vector Laplace, beta = "
                        f"{beta:.6g}, sensitivity {d3_sens:.6g}); not in the Gaussian composition: "
                        "add it to the ledger's eps (basic composition)")
            info["beta"] = beta
        E = noise_array(b, (D, D, D), True, symmetric_noise)
        t_noise = time.perf_counter()
        T = T + tz.multilinear(E, W)
        info["time"]["noise_tensor"] = t_noise - t2
        info["time"]["noise_contract"] = time.perf_counter() - t_noise
        ledger.note(_UNIT_NOTE[unit])
    t3 = time.perf_counter()
    A, w, lambdas = _finish(T, W, k, model, sc, simplex, n_restarts, n_iter, rng)
    t4 = time.perf_counter()
    info["time"].update(stage1=t1 - t0, m3_whitened=t2 - t1, tpm=t4 - t3, total=t4 - t0)
    info.update(sigma2_scaled=s2, scale=sc)
    return AGNResult(A, w, lambdas, W / sc, None if s2 is None else s2 * sc**2,
                     [ledger] if private else [], mechanism, model, epsilon_pure=eps_pure, info=info)


def agn(samples, n_components: int, epsilon: float, delta: float, *, model: str = "mog", split=(0.5, 0.5),
        sigma2: float | None = None, scale: float | None = None, random_state=None,
        n_restarts: int = 30, n_iter: int = 50, simplex: str = "euclidean", unit: str = "sample",
        samples_per_unit: int = 1, owner: str = "pooled", symmetric_noise: str = "symmetrized") -> AGNResult:
    """Centralized AGN ([DP-OTD] Alg. 1) on one party's data (pooled data: the ideal capeAGN matches).

    Same conventions as :func:`cape_agn`; ``samples`` is one data array.
    """
    return _central(samples, n_components, model=model, mechanism="agn", epsilon=epsilon, delta=delta, split=split,
                    sigma2=sigma2, scale=scale, seed=privacy.resolve_random_state(random_state),
                    n_restarts=n_restarts, n_iter=n_iter,
                    simplex=simplex, unit=unit, samples_per_unit=samples_per_unit, owner=owner,
                    symmetric_noise=symmetric_noise)


def avn(samples, n_components: int, epsilon: float, delta: float, *, model: str = "mog", split=(0.5, 0.5),
        sigma2: float | None = None, scale: float | None = None, random_state=None,
        n_restarts: int = 30, n_iter: int = 50, simplex: str = "euclidean", unit: str = "sample",
        samples_per_unit: int = 1, owner: str = "pooled", symmetric_noise: str = "symmetrized") -> AGNResult:
    """Centralized AVN ([DP-OTD] Alg. 1): stage 2 noise with density proportional to exp(-beta ||b||).

    beta = eps_2 / Delta_3, pure eps_2-DP; stage 1 is Gaussian at (eps_1, delta).
    The total guarantee is (ledger eps at delta) + ``result.epsilon_pure``.
    """
    return _central(samples, n_components, model=model, mechanism="avn", epsilon=epsilon, delta=delta, split=split,
                    sigma2=sigma2, scale=scale, seed=privacy.resolve_random_state(random_state),
                    n_restarts=n_restarts, n_iter=n_iter,
                    simplex=simplex, unit=unit, samples_per_unit=samples_per_unit, owner=owner,
                    symmetric_noise=symmetric_noise)


def otd(samples, n_components: int, *, model: str = "mog", sigma2: float | None = None, scale: float | None = None,
        random_state=None, n_restarts: int = 30, n_iter: int = 50,
        simplex: str = "euclidean") -> AGNResult:
    """Non-private method-of-moments OTD (Anandkumar et al. 2014) on one dataset. Not private."""
    return _central(samples, n_components, model=model, mechanism="none", epsilon=None, delta=None, split=None,
                    sigma2=sigma2, scale=scale, seed=privacy.resolve_random_state(random_state),
                    n_restarts=n_restarts, n_iter=n_iter,
                    simplex=simplex, unit="sample", samples_per_unit=1, owner="pooled")


def local_agn(site_samples: Sequence, n_components: int, epsilon: float, delta: float, *, site: int = 0,
              **kwargs) -> AGNResult:
    """AGN on one site's data alone (the papers' "local" baseline); kwargs as :func:`agn`."""
    if not isinstance(site_samples, Sequence) or isinstance(site_samples, np.ndarray):
        raise ValueError("site_samples must be a list with one data array per site")
    if not 0 <= site < len(site_samples):
        raise ValueError(f"site {site} out of range for {len(site_samples)} sites")
    kwargs.setdefault("owner", f"site-{site}")
    return agn(site_samples[site], n_components, epsilon, delta, **kwargs)


