"""Private group statistics: every measure's linear model, fitted from CAPE-released sufficient statistics.

The consortium asks whether its subjects differ (patients against controls, an
age slope) on what the run measured per subject: the static FNC edges and each
component's amplitude. No site shares a subject's numbers. Per subject, at its
site: a design row x (intercept, the covariates, the site as a covariate of its
own) and measures y (Q values). The model of measure q is y_q = X beta_q + e.

Privacy (docs/privacy.md, "Group statistics"): each entry of x is in [-1, 1]
(categorical levels as 0/1 indicators, a continuous covariate mapped from its
public range; values outside are clipped and counted), so ||x|| <= B_x; each
family of measures is scaled onto a public L2 bound (:data:`FAMILY_RMS` times
the square root of its size), so ||y|| <= B_y. A subject contributes

    t = [ a_1 upper(x x') / B_x^2,  a_2 vec(x y') / (B_x B_y),  a_3 (y * y) / B_y^2 ]

with a_1^2 + a_2^2 + a_3^2 = 1 (:data:`SHARES`), so ||t|| <= 1 whatever its
data, and site s releases the mean of its subjects' t (:class:`CapeGLM`):
sensitivity 2 / M_s under replacement. The aggregator's CAPE-weighted mean
times N holds the pooled X'X, X'Y and the diagonal of Y'Y, each with public
Gaussian noise.

Inference (:func:`fit_glm`) is post-processing of the release: OLS from the
noisy statistics, and intervals from a parametric bootstrap over both the
sampling error and the public noise distribution (Ferrando, Wang and Sheldon
2022, "Parametric bootstrap for differentially private confidence
intervals"): the bootstrap statistics are drawn from the fitted model given
the released design moments, fresh privacy noise of the plan's variance is
added, and each draw is solved as the release was. The intervals and
p-values are Wald's on the bootstrap standard error (t with N - p degrees of
freedom; the bootstrap's percentiles covered less, skewed by the noisy X'X), q-values
Benjamini-Hochberg within each contrast (``scipy.stats.false_discovery_control``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from scipy import stats

from dpneuro import privacy
from dpneuro.algorithms.dfnc import noise_multipliers
from dpneuro.algorithms.fnc import subject_fnc
from dpneuro.algorithms.subject_mean import CapeSubjectMean, clip_subjects
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import NoisePlan, planned_ledgers, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers

__all__ = ["CapeGLM", "Covariate", "Design", "FAMILY_RMS", "GLMSettings", "MEASURES", "SHARES", "fit_glm",
           "measure_names", "pack_statistics", "parse_design", "subject_measures", "unpack_statistics"]

#: the measures a site computes per subject from its component time courses
MEASURES = ("fnc", "amplitude", "states")
#: each family's public L2 bound is FAMILY_RMS sqrt(its size): an RMS of 0.3 per entry of the subject's deviation
#: from the consortium's mean FNC (Fisher z), of its relative log amplitudes and of its brain-state dynamics
#: (fractions)
FAMILY_RMS = {"fnc": 0.3, "amplitude": 0.3, "states": 0.3}
#: shares a_k^2 of a subject's unit norm: X'X, X'Y (what carries the effects), diag(Y'Y) (the residual variance)
SHARES = (0.1, 0.7, 0.2)
#: bootstrap draws of the parametric bootstrap
N_BOOT = 2000
#: eigenvalues of the released X'X are held at least FLOOR times its noise sd: a design direction the noise drowns
#: is shrunk rather than inverted. On 4 x 100 subjects (benchmarks/group_stats.py, 60 runs per cell) 3 kept the
#: intervals at 0.96 coverage with power 0.41 on 0.5 FNC shifts at eps 4; 1 inverted near-singular draws (intervals
#: 19x OLS's, power 0.01); at eps 1 the floor shrinks non-zero effects by about half (their coverage 0.77)
FLOOR = 3.0


# -- the design ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class Covariate:
    """One term of the design: categorical (``levels``, the first the reference) or continuous (public range
    ``low``..``high``, mapped onto [-1, 1])."""

    name: str
    levels: tuple[str, ...] = ()
    low: float = 0.0
    high: float = 0.0

    @property
    def categorical(self) -> bool:
        return bool(self.levels)

    def columns(self) -> list[str]:
        return [f"{self.name}[{lv}]" for lv in self.levels[1:]] if self.categorical else [self.name]

    def encode(self, value: str) -> tuple[list[float], bool]:
        """This covariate's columns for one subject's value, and whether a continuous value was clipped."""
        if self.categorical:
            if value not in self.levels:
                raise ValueError(f"{self.name} = {value!r} is not one of the agreed levels {list(self.levels)}")
            return [1.0 if value == lv else 0.0 for lv in self.levels[1:]], False
        v = float(value)
        if not math.isfinite(v):
            raise ValueError(f"{self.name} = {value!r} is not a number")
        mid, half = (self.low + self.high) / 2, (self.high - self.low) / 2
        u = (v - mid) / half
        return [min(1.0, max(-1.0, u))], abs(u) > 1.0

    def per_unit(self) -> float:
        """Factor from a coefficient of the encoded column to one per unit of the covariate."""
        return 1.0 if self.categorical else 2.0 / (self.high - self.low)


def parse_design(design: str, covariates: Mapping[str, Any]) -> tuple[Covariate, ...]:
    """The terms of ``design`` ("group + age + sex"), each described in ``covariates``: a list of level names
    (categorical, the first the reference) or [low, high] (continuous, its public range)."""
    names = [t.strip() for t in design.split("+") if t.strip()]
    if not names:
        raise ValueError("the design names no covariate; e.g. design = \"group + age\"")
    if len(set(names)) != len(names):
        raise ValueError(f"design {design!r} names a covariate twice")
    out = []
    for name in names:
        if name == "site":
            raise ValueError("the site is always in the model as a covariate of its own: leave it out of the design")
        spec = covariates.get(name)
        if spec is None:
            raise ValueError(f"design term {name!r} has no entry in covariates: give its levels "
                             f"(e.g. {name} = [\"control\", \"patient\"]) or its public range (e.g. {name} = [18, 80])")
        spec = list(spec)
        if len(spec) >= 2 and all(isinstance(v, str) for v in spec):
            if len(set(spec)) != len(spec):
                raise ValueError(f"covariate {name!r}: its levels repeat: {spec}")
            out.append(Covariate(name, levels=tuple(spec)))
        elif (len(spec) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in spec)
              and math.isfinite(spec[0]) and math.isfinite(spec[1]) and spec[0] < spec[1]):
            out.append(Covariate(name, low=float(spec[0]), high=float(spec[1])))
        else:
            raise ValueError(f"covariate {name!r}: {spec!r} is neither two or more level names nor a range "
                             "[low, high] with low < high")
    return tuple(out)


@dataclass(frozen=True)
class Design:
    """The consortium's design: an intercept, its covariates, and an indicator of each site but the first."""

    covariates: tuple[Covariate, ...]
    sites: tuple[str, ...]

    @property
    def columns(self) -> tuple[str, ...]:
        return ("intercept", *(c for cov in self.covariates for c in cov.columns()),
                *(f"site[{s}]" for s in self.sites[1:]))

    @property
    def p(self) -> int:
        return len(self.columns)

    @property
    def norm_bound(self) -> float:
        """B_x: the intercept, at most one nonzero entry in [-1, 1] per covariate and one site indicator."""
        return math.sqrt(1 + len(self.covariates) + (len(self.sites) > 1))

    @property
    def indicators(self) -> list[int]:
        """The columns of categorical levels (0/1: each equals its own square)."""
        out, j = [], 1
        for cov in self.covariates:
            n = len(cov.columns())
            if cov.categorical:
                out += range(j, j + n)
            j += n
        return out

    @property
    def private_pairs(self) -> tuple[np.ndarray, np.ndarray]:
        """The entries (i <= j) of X'X a site releases: those with a covariate, but for a level's square, which
        equals its product with the intercept. The rest (the intercept's and the sites' products) are the
        public subject counts."""
        i, j = np.triu_indices(self.p)
        c = self.p - (len(self.sites) - 1)  # intercept and covariate columns; the sites' follow
        keep = (((i >= 1) & (i < c)) | ((j >= 1) & (j < c))) & ~((i == j) & np.isin(i, self.indicators))
        return i[keep], j[keep]

    @property
    def moment_bound(self) -> float:
        """The L2 bound of a subject's released entries of x x' (:attr:`private_pairs`): with u_k = z_k^2 <= 1
        for the C covariates (one nonzero column each), sum_{k<l} u_k u_l + sum_continuous u_k^2 + sum_k u_k |w|^2
        <= C(C-1)/2 + C_continuous + C |w|^2, w the intercept and site indicator (|w|^2 <= 2)."""
        n_cov, n_pub = len(self.covariates), 1 + (len(self.sites) > 1)
        n_cont = sum(not c.categorical for c in self.covariates)
        return math.sqrt(n_cov * (n_cov - 1) / 2 + n_cont + n_cov * n_pub)

    def public_moments(self, counts: Sequence[float]) -> np.ndarray:
        """X'X's public entries from each site's subject count (the covariates' entries left 0)."""
        counts = np.asarray(counts, np.float64)
        c = self.p - (len(self.sites) - 1)
        A = np.zeros((self.p, self.p))
        A[0, 0] = counts.sum()
        for s in range(1, len(self.sites)):
            A[0, c + s - 1] = A[c + s - 1, 0] = A[c + s - 1, c + s - 1] = counts[s]
        return A

    def contrasts(self) -> list[tuple[str, int, float]]:
        """What is tested: each covariate's columns, as (label, column, factor to per unit)."""
        out, j = [], 1
        for cov in self.covariates:
            for col in cov.columns():
                label = (f"{cov.name}: {col[len(cov.name) + 1:-1]} vs {cov.levels[0]}" if cov.categorical
                         else f"{cov.name} (per unit)")
                out.append((label, j, cov.per_unit()))
                j += 1
        return out

    def rows(self, values: Sequence[Mapping[str, str]], site: int) -> tuple[np.ndarray, int]:
        """The design rows of a site's subjects (their covariates by name) and how many values were clipped."""
        X = np.zeros((len(values), self.p))
        clipped = 0
        for i, v in enumerate(values):
            row = [1.0]
            for cov in self.covariates:
                enc, cut = cov.encode(v[cov.name])
                row += enc
                clipped += cut
            row += [1.0 if site == s else 0.0 for s in range(1, len(self.sites))]
            X[i] = row
        return X, clipped


# -- the measures -------------------------------------------------------------------------------

def measure_names(measures: Sequence[str], n_components: int, n_states: int = 0) -> list[str]:
    """Each measure's name, in the order of :func:`subject_measures`: "fnc IC01-IC02", "amplitude IC03",
    "occupancy S1", "dwell S1", "transitions"."""
    iu = np.triu_indices(n_components, 1)
    names = {"fnc": [f"fnc IC{i + 1:02d}-IC{j + 1:02d}" for i, j in zip(*iu)],
             "amplitude": [f"amplitude IC{i + 1:02d}" for i in range(n_components)],
             "states": [*(f"occupancy S{k + 1}" for k in range(n_states)),
                        *(f"dwell S{k + 1}" for k in range(n_states)), "transitions"]}
    return [n for m in measures for n in names[m]]


def family_sizes(measures: Sequence[str], n_components: int, n_states: int = 0) -> dict[str, slice]:
    """Each family's columns among the measures."""
    out, at = {}, 0
    for m in measures:
        if m not in MEASURES:
            raise ValueError(f"unknown measure {m!r}; measures: {list(MEASURES)}")
        size = {"fnc": n_components * (n_components - 1) // 2, "amplitude": n_components,
                "states": 2 * n_states + 1}[m]
        out[m] = slice(at, at + size)
        at += size
    return out


def subject_measures(S, lengths: Sequence[int], measures: Sequence[str], fnc_centre=None,
                     dynamics: Mapping[str, np.ndarray] | None = None
                     ) -> tuple[np.ndarray, list[str], dict[str, slice]]:
    """Every subject's measures (M x Q) from a site's component time courses S (R x N, subjects in order): the
    FNC edges (Fisher z, minus the consortium's public mean ``fnc_centre`` when known), each component's
    relative log amplitude (log of its time course's sd over the RMS of the subject's components' sds) and, from
    its brain-state ``dynamics`` (:func:`dpneuro.algorithms.dfnc.site_dynamics` with ``n_windows``, each
    subject's window count), each state's fraction of time less 1/K, its mean dwell as a fraction of the
    subject's windows, and the transitions per window. Returns the matrix, each measure's name
    (:func:`measure_names`) and each family's columns."""
    S = np.asarray(S, np.float64)
    R = S.shape[0]
    bounds = np.cumsum([0, *[int(n) for n in lengths]])
    if bounds[-1] != S.shape[1]:
        raise ValueError(f"the subjects' lengths sum to {bounds[-1]}, the time courses have {S.shape[1]} columns")
    K = 0 if dynamics is None else int(np.shape(dynamics["occupancy"])[1])
    families = family_sizes(measures, R, K)
    blocks = []
    for m in measures:
        if m == "fnc":
            F = np.array([subject_fnc(S[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
            block = F if fnc_centre is None else F - np.asarray(fnc_centre, np.float64)[None, :]
        elif m == "amplitude":
            # relative to the subject's own RMS over components: the time courses' scale follows the public
            # whitening, and a subject's overall gain (scanner, head size) is not a component's amplitude
            sd = np.maximum(np.array([S[:, a:b].std(axis=1) for a, b in zip(bounds[:-1], bounds[1:])]), 1e-300)
            block = np.log(sd / np.sqrt((sd**2).mean(axis=1, keepdims=True)))
        else:
            if dynamics is None:
                raise ValueError("the states measures need the subjects' brain-state dynamics")
            n = np.asarray(dynamics["n_windows"], np.float64)[:, None]
            block = np.hstack([np.asarray(dynamics["occupancy"]) - 1.0 / K,
                               np.asarray(dynamics["dwell_windows"]) / n,
                               np.asarray(dynamics["transitions"], np.float64)[:, None] / np.maximum(n - 1, 1)])
        blocks.append(block)
    return np.concatenate(blocks, axis=1), measure_names(measures, R, K), families


def family_bounds(families: Mapping[str, slice]) -> dict[str, float]:
    """Each family's public L2 bound per subject."""
    return {m: FAMILY_RMS[m] * math.sqrt(sl.stop - sl.start) for m, sl in families.items()}


# -- sufficient statistics, packed with a subject's norm at most 1 -------------------------------

def _scales(design: Design, y_bound: float) -> tuple[float, float, float]:
    bx = design.norm_bound
    a1, a2, a3 = (math.sqrt(s) for s in SHARES)
    return a1 / design.moment_bound, a2 / (bx * y_bound), a3 / y_bound**2


def statistics_length(design: Design, Q: int) -> int:
    return len(design.private_pairs[0]) + design.p * Q + Q


def pack_statistics(X: np.ndarray, Y: np.ndarray, design: Design, families: Mapping[str, slice]
                    ) -> tuple[np.ndarray, int]:
    """Every subject's contribution t (M x L, each of L2 norm at most 1) and how many subjects' measures were
    scaled onto their bound."""
    bounds = family_bounds(families)
    Y = np.array(Y, np.float64)
    scaled = np.zeros(len(Y), bool)
    for m, sl in families.items():
        Y[:, sl], cut = clip_subjects(Y[:, sl], bounds[m])
        scaled |= cut
    c1, c2, c3 = _scales(design, math.sqrt(sum(b**2 for b in bounds.values())))
    i, j = design.private_pairs
    xx = X[:, i] * X[:, j]
    xy = (X[:, :, None] * Y[:, None, :]).reshape(len(X), -1)
    return np.concatenate([c1 * xx, c2 * xy, c3 * Y**2], axis=1), int(scaled.sum())


def unpack_statistics(mean, counts: Sequence[float], noise_var: float, design: Design,
                      families: Mapping[str, slice]) -> dict[str, Any]:
    """The pooled X'X (p x p), X'Y (p x Q) and diag(Y'Y) (Q) from the consortium's mean contribution over the
    sites' subjects (``counts``, public), with each block's noise sd (public: the plan's per-entry variance of
    the mean)."""
    p, Q = design.p, sum(sl.stop - sl.start for sl in families.values())
    n = float(np.sum(counts))
    bounds = family_bounds(families)
    c1, c2, c3 = _scales(design, math.sqrt(sum(b**2 for b in bounds.values())))
    total = np.asarray(mean, np.float64) * n
    i, j = design.private_pairs
    k1 = len(i)
    k2 = k1 + p * Q
    if total.shape != (k2 + Q,):
        raise ValueError(f"the release has {total.shape} entries, the design and measures need {k2 + Q}")
    XtX = design.public_moments(counts)
    XtX[i, j] = XtX[j, i] = total[:k1] / c1
    for g in design.indicators:  # a level's square is its sum
        XtX[g, g] = XtX[0, g]
    sd = n * math.sqrt(noise_var)
    return {"XtX": XtX, "XtY": total[k1:k2].reshape(p, Q) / c2, "YtY": total[k2:] / c3, "n": float(n),
            "sd": (sd / c1, sd / c2, sd / c3)}


# -- inference ----------------------------------------------------------------------------------

def _psd(A: np.ndarray, floor: float) -> np.ndarray:
    """Symmetric matrices (..., p, p) with eigenvalues raised to at least ``floor``."""
    w, V = np.linalg.eigh(A)
    return (V * np.maximum(w, floor)[..., None, :]) @ np.swapaxes(V, -1, -2)


def _moment_noise(rng, size: int, design: Design, sd: float) -> np.ndarray:
    """Noise as the release puts it on X'X: on the released entries, symmetric, a level's square its sum's."""
    E = np.zeros((size, design.p, design.p))
    i, j = design.private_pairs
    E[:, i, j] = rng.normal(0.0, sd, (size, len(i)))
    E[:, j, i] = E[:, i, j]
    for g in design.indicators:
        E[:, g, g] = E[:, 0, g]
    return E


def fit_glm(stats_: Mapping[str, Any], design: Design, *, level: float = 0.95, n_boot: int = N_BOOT,
            random_state=None) -> dict[str, np.ndarray]:
    """Each tested contrast's estimate on every measure, with its interval, p- and q-value.

    ``stats_``: :func:`unpack_statistics` (noise sd 0 for exact statistics:
    then this is OLS with a bootstrap of its sampling error). Returns arrays
    C x Q: ``estimate``, ``se``, ``ci_low``, ``ci_high``, ``p``, ``q`` and
    ``noise_sd`` (the part of the sd the privacy noise adds), ``sigma``
    (Q: each measure's residual sd) and ``floored`` (how many of X'X's
    eigenvalues the noise held at :data:`FLOOR`: their effects are shrunk
    toward zero).
    """
    N, p = stats_["n"], design.p
    s_xx, s_xy, s_yy = stats_["sd"]
    XtY, YtY = np.asarray(stats_["XtY"]), np.asarray(stats_["YtY"])
    Q = XtY.shape[1]
    if N - p < 2:
        raise ValueError(f"{N:g} subjects cannot fit {p} coefficients")
    floor = max(1e-9 * N, FLOOR * s_xx)  # a design column the noise drowns is held at the noise's size
    floored = int(np.sum(np.linalg.eigvalsh(np.asarray(stats_["XtX"])) < floor))
    A = _psd(np.asarray(stats_["XtX"]), floor)
    beta = np.linalg.solve(A, XtY)
    rss = YtY - np.einsum("pq,pq->q", beta, XtY)
    # the residual variance from a noisy Y'Y: never below zero, raised by the noise's sd so the sampling part
    # of the intervals is not understated when the noise is large
    sigma2 = (np.maximum(rss, 0.0) + s_yy) / (N - p)
    rng = np.random.default_rng(random_state)
    L = np.linalg.cholesky(A)
    cols = [j for _, j, _ in design.contrasts()]
    draws, noise_only = np.empty((n_boot, len(cols), Q)), np.empty((n_boot, len(cols), Q))
    batch = 250
    for b0 in range(0, n_boot, batch):
        m = min(batch, n_boot - b0)
        # the statistics a new sample of the fitted model would give, then the release's noise on them
        sampled = A @ beta + L @ (rng.standard_normal((m, p, Q)) * np.sqrt(sigma2))
        E = _moment_noise(rng, m, design, s_xx)
        noise = rng.normal(0.0, s_xy, (m, p, Q))
        A_star = _psd(A + E, floor)
        draws[b0:b0 + m] = np.linalg.solve(A_star, sampled + noise)[:, cols]
        noise_only[b0:b0 + m] = np.linalg.solve(A_star, A @ beta + noise)[:, cols]
    unit = np.array([u for _, _, u in design.contrasts()])[:, None]
    est = beta[cols] * unit
    dev = (draws - beta[cols][None]) * unit[None]
    se = dev.std(axis=0, ddof=1)
    # Wald intervals on the bootstrap's se: they covered better than its percentiles, which the noisy X'X skews
    half = stats.t.ppf(0.5 + level / 2, df=N - p) * se
    t = np.divide(est, se, out=np.zeros_like(est), where=se > 0)
    pval = 2 * stats.t.sf(np.abs(t), df=N - p)
    return {"estimate": est, "se": se, "ci_low": est - half, "ci_high": est + half, "p": pval,
            "q": np.array([stats.false_discovery_control(row, method="bh") for row in pval]),
            "noise_sd": (noise_only - beta[cols][None]).std(axis=0, ddof=1) * unit, "sigma": np.sqrt(sigma2),
            "floored": floored}


# -- the CAPE release and the stage's settings ----------------------------------------------------

class CapeGLM(CapeSubjectMean):
    """The group GLM's one release per site: the mean of its subjects' packed sufficient statistics
    (:func:`pack_statistics`, each of norm at most 1: sensitivity 2 / M_s)."""

    name = "group-glm"
    key = "glm"
    tag = 49


@dataclass(frozen=True)
class GLMSettings:
    """The public settings of the group-statistics stage, identical at every party: the design and measures,
    ``epsilon``/``delta`` the stage's per site against the headline adversary (None with plan "none")."""

    design: Design
    measures: tuple[str, ...]
    n_components: int
    epsilon: float | None
    delta: float = 1e-5
    n_states: int = 0
    plan: Any = "cape"
    random_state: int | None = None
    n_boot: int = N_BOOT
    level: float = 0.95
    families: dict[str, slice] = field(init=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "families", family_sizes(self.measures, self.n_components, self.n_states))

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The (eps, delta) the stage is calibrated to (a planner scales the noise from it)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    #: the ledger's name of the stage's one release
    ledger_stages = (CapeGLM.name,)

    @property
    def n_measures(self) -> int:
        return sum(sl.stop - sl.start for sl in self.families.values())

    @property
    def length(self) -> int:
        return statistics_length(self.design, self.n_measures)

    def algorithm(self, *, n_sites: int) -> CapeGLM:
        z = noise_multipliers(self.epsilon, self.delta, {"glm": 1.0}, n_sites=n_sites, plan=self.plan)["glm"]
        return CapeGLM(1.0, z, random_state=self.random_state)

    def planned(self, n_subjects: Sequence[int]) -> list[PrivacyLedger]:
        """The ledgers the stage fills, from each site's count of subjects in the model alone."""
        alg = self.algorithm(n_sites=len(n_subjects))
        return planned_ledgers(alg, NoisePlan.coerce(self.plan), [alg.public_state(s, [0] * int(m), self.length)
                                                                  for s, m in enumerate(n_subjects)])

    def fit(self, mean, counts: Sequence[float], noise_var: float) -> dict[str, np.ndarray]:
        """The aggregator's post-processing of the release (``counts``: each site's subjects in the model, 0 for a
        site that is not in the sum): :func:`fit_glm`."""
        st = unpack_statistics(mean, counts, noise_var, self.design, self.families)
        seed = None if self.random_state is None else [self.random_state, 491]
        return fit_glm(st, self.design, level=self.level, n_boot=self.n_boot, random_state=seed)

    def run(self, sites: Sequence[tuple[np.ndarray, np.ndarray]]) -> dict[str, Any]:
        """Every party in this process (tests, benchmarks): each site's (X, Y); the fit and the ledgers."""
        packed = [pack_statistics(X, Y, self.design, self.families)[0] for X, Y in sites]
        r = run_cape(self.algorithm(n_sites=len(sites)), packed, NoisePlan.coerce(self.plan))
        agg = r.aggregator
        return {**self.fit(agg["glm"], agg["counts"], agg["noise_var"]), "ledgers": cape_ledgers(r)}
