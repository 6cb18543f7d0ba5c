"""Noise plans: how much of each kind of noise every site adds.

A site that alone must release f(x_s) with std ``tau_s`` draws a zero-sum part
e_s (whose sum over sites is zero) and a local part g_s ([capeDJICA] Alg. 1-2). The
symmetric plan sets var(e_hat_s) = tau^2 and var(g_s) = tau^2 / S; the
weighted/asymmetric plan of [capeDJICA] Sec. III-C solves an S x S system for the
e_hat variances so that each release still has variance tau_s^2 while the
weighted average has the pooled variance.

The zero-sum part cancels in the average, so its size costs no utility, while
the aggregator and its colluders see every release through it: a plan's
``zero_sum_variance`` c scales var(e_hat_s) by c (the papers: c = 1). As c
grows, what the aggregator learns about one site tends to what the pooled
average reveals, and its guarantee to that of a trusted curator holding the
same noise (docs/privacy.md, "CAPE and collusion").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq

from dpneuro.privacy.cape_delta import cape_release_mu, check_collusion, max_colluding

PLAN_KINDS = ("cape", "conv", "none")
#: how CAPE plans unequal sites (different stds tau_s or weights mu_s): "guarantee" gives every site at least the
#: guarantee against the aggregator an equal consortium gives at the same noise multiplier, with the least noise
#: in the average (:func:`guarantee_plan`); "papers" solves [capeDJICA] Sec. III-C's system (exact release stds,
#: a pooled average; infeasible for some mixes, and the sites' guarantees then differ)
UNEQUAL_PLANS = ("guarantee", "papers")
#: var(e_hat_s) in units of the papers' plan. 100 puts the guarantee against the aggregator within 0.3 % of its
#: limit (4 sites, one colluder: mu 1.158 Delta / tau against 1.366 at c = 1 and 1.155 as c -> infinity), and
#: the draws stay far inside secure aggregation's fixed-point range (10 tau against 2^20)
ZERO_SUM_VARIANCE = 100.0


@dataclass(frozen=True)
class NoisePlan:
    """Which protocol adds the privacy noise.

    ``"cape"``: correlated noise (zero-sum part through secure aggregation plus
    local part); ``"conv"``: independent local noise of the full std at every
    site (the conventional decentralized scheme); ``"none"``: no noise (the
    non-private baseline; nothing it releases is private).
    ``n_colluding`` is the collusion assumption CAPE is run under (default
    ceil(S/3) - 1, the most [capeDJICA] Thm. 1 allows). ``zero_sum_variance``
    scales the zero-sum draws' variance (module docstring; 1 is the papers').
    ``unequal`` says how sites with different stds or weights are planned
    (:data:`UNEQUAL_PLANS`; equal sites get the symmetric plan either way).
    """

    def colluders(self, n_sites: int) -> int:
        """The number of colluding sites the plan protects against among ``n_sites``."""
        return max_colluding(n_sites) if self.n_colluding is None else int(self.n_colluding)

    kind: str = "cape"
    n_colluding: int | None = None
    zero_sum_variance: float = ZERO_SUM_VARIANCE
    unequal: str = "guarantee"

    def __post_init__(self):
        if self.kind not in PLAN_KINDS:
            raise ValueError(f"unknown noise plan {self.kind!r}; use one of {PLAN_KINDS}")
        if self.unequal not in UNEQUAL_PLANS:
            raise ValueError(f"unknown plan for unequal sites {self.unequal!r}; use one of {UNEQUAL_PLANS}")
        c = self.zero_sum_variance
        if isinstance(c, bool) or not isinstance(c, (int, float)) or not math.isfinite(c) or c < 1:
            raise ValueError(f"zero_sum_variance must be a finite number >= 1 (1: the papers' plan), got {c!r}; "
                             "below 1 a release alone would carry less than its planned noise")

    def check(self, n_sites: int) -> None:
        """Refuse a run outside CAPE's assumptions before anything is released."""
        if self.kind == "cape":
            check_collusion(n_sites, self.n_colluding)

    @classmethod
    def coerce(cls, plan: NoisePlan | str) -> NoisePlan:
        return plan if isinstance(plan, NoisePlan) else cls(kind=plan)


@dataclass(frozen=True)
class Variances:
    """Per-site noise variances for one released quantity."""

    e_hat: np.ndarray  # variance of each site's zero-sum draw e_hat_s
    g: np.ndarray  # variance of each site's local draw g_s
    weights: np.ndarray  # aggregation weights mu_s (sum to 1)

    def release_variance(self) -> np.ndarray:
        """Marginal variance of e_s + g_s at each site (what one release alone carries)."""
        S = len(self.weights)
        mu, sig2 = self.weights, self.e_hat
        tau_e2 = (1 - 2 / S) * sig2 + np.sum(mu**2 * sig2) / (mu**2 * S**2)
        return tau_e2 + self.g

    def combined_variance(self) -> float:
        """Variance of the weighted average's noise (the zero-sum part cancels)."""
        return float(np.sum(self.weights**2 * self.g))


def symmetric_plan(tau: float, n_sites: int) -> Variances:
    """[capeDJICA] Lemma 1: var(e_hat) = tau^2 (so var(e) = (1 - 1/S) tau^2), var(g) = tau^2 / S."""
    S = n_sites
    return Variances(np.full(S, tau**2), np.full(S, tau**2 / S), np.full(S, 1.0 / S))


def asymmetric_plan(taus, weights, tau_pool: float | None = None, site_names=None) -> Variances:
    """[capeDJICA] Sec. III-C: site s needs release std ``taus[s]``; the aggregator averages with ``weights``.

    ``tau_pool`` is the std the weighted average should carry, as if the data
    were pooled; by default sqrt(sum_s mu_s^2 tau_s^2 / S), which is tau / S
    for equal sites. Raises ValueError naming the site when the plan is infeasible.
    """
    taus = np.asarray(taus, float)
    mu = np.asarray(weights, float)
    S = len(taus)
    names = site_names or [f"site {s}" for s in range(S)]
    _check_sites(taus, mu, names)
    if tau_pool is None:
        # the weighted average of independent releases has variance sum mu^2 tau^2;
        # pooling removes the cross-site independence: S times less (exact when symmetric)
        tau_pool = float(np.sqrt(np.sum(mu**2 * taus**2) / S))
    g = tau_pool**2 / (mu**2 * S)
    rhs = taus**2 - g
    # (1 - 1/S)^2 sigma_s^2 + sum_{i != s} mu_i^2 sigma_i^2 / (mu_s^2 S^2) = rhs_s
    M = (mu[None, :] ** 2) / (mu[:, None] ** 2 * S**2)
    np.fill_diagonal(M, (1 - 1 / S) ** 2)
    sig2 = np.linalg.solve(M, rhs)
    for s in range(S):
        if rhs[s] <= 0:
            raise ValueError(
                f"infeasible CAPE plan: {names[s]} would need local noise var {g[s]:.3g} above its whole "
                f"budget tau_s^2 = {taus[s] ** 2:.3g}; lower its weight or give it a looser privacy target, or "
                "plan unequal sites with NoisePlan(unequal='guarantee') (the default)"
            )
        if sig2[s] < 0:
            raise ValueError(
                f"infeasible CAPE plan: {names[s]} would need a negative zero-sum variance ({sig2[s]:.3g}); "
                "its weight or std is too far from the others'; plan unequal sites with "
                "NoisePlan(unequal='guarantee') (the default), which exists for any mix"
            )
    return Variances(sig2, g, mu)


def _check_sites(taus: np.ndarray, mu: np.ndarray, names) -> None:
    if len(mu) != len(taus):
        raise ValueError(f"{len(taus)} site stds but {len(mu)} weights")
    if np.any(mu <= 0) or not np.isclose(mu.sum(), 1.0):
        bad = int(np.argmin(mu))
        raise ValueError(f"{names[bad]}: aggregation weights must be positive and sum to 1, got {mu.tolist()} "
                         "(a site without time points cannot take part)")
    if np.any(~(taus > 0)) or not np.all(np.isfinite(taus)):
        bad = int(np.argmin(np.where(np.isfinite(taus), taus, -1.0)))
        raise ValueError(f"{names[bad]}: release std must be a finite number > 0, got {taus[bad]}")


def symmetric_guarantee(n_sites: int, n_colluding: int, zero_sum_variance: float) -> float:
    """GDP mu per unit of sensitivity/std of one release of the symmetric plan against the aggregator and
    ``n_colluding`` sites: the guarantee an equal consortium gets at noise multiplier 1."""
    S, c = n_sites, zero_sum_variance
    return cape_release_mu(1.0, np.full(S, c), np.full(S, 1.0 / S), np.full(S, 1.0 / S), 0, n_colluding)


def guarantee_plan(taus, weights, n_colluding: int, zero_sum_variance: float = ZERO_SUM_VARIANCE,
                   site_names=None, consortium: int | None = None) -> Variances:
    """The CAPE plan for unequal sites: each at least its own guarantee, the least noise in the average.

    Site s's target is the guarantee an equal consortium of S sites gives
    against the aggregator and ``n_colluding`` sites at the site's own noise
    multiplier tau_s / Delta_s: mu_s <= m(S, S_C, c) Delta_s / tau_s
    (:func:`symmetric_guarantee`). When the zero-sum draws are large, that
    coalition learns a site's subjects only through the honest sites' weighted
    sum, whose noise is sum_h mu_h^2 var(g_h); the average's noise
    sum_s mu_s^2 var(g_s) is smallest under every site's constraint when each
    site adds the same share t = mu_s^2 var(g_s) (docs/privacy.md, "Unequal
    sites"). t is the smallest value at which every site's exact guarantee (the
    ledger's own computation) meets its target. The zero-sum variances are
    max(c, (S / (S - 1))^2) tau_s^2, so every release alone carries at least
    tau_s^2. Equal sites get the symmetric plan.

    ``consortium`` is the number of sites the run was configured with (default
    S): when sites have dropped out, the survivors' plan still gives each of
    them the guarantee of the full consortium (more local noise), which is what
    every site checks before it releases (:func:`dpneuro.protocol.cape.guard.verify_plan`).
    """
    taus = np.asarray(taus, float)
    mu = np.asarray(weights, float)
    S = len(taus)
    consortium = S if consortium is None else int(consortium)
    names = site_names or [f"site {s}" for s in range(S)]
    _check_sites(taus, mu, names)
    if consortium == S and np.allclose(taus, taus[0]) and np.allclose(mu, 1.0 / S):
        v = symmetric_plan(float(taus[0]), S)
        return Variances(v.e_hat * zero_sum_variance, v.g, v.weights)
    target = symmetric_guarantee(consortium, n_colluding, zero_sum_variance) / taus  # per unit sensitivity
    e_hat = max(zero_sum_variance, (S / (S - 1)) ** 2) * taus**2

    def excess(log_t: float) -> float:  # > 0 while some site is above its target
        g = math.exp(log_t) / mu**2
        return max(math.log(cape_release_mu(1.0, e_hat, g, mu, s, n_colluding) / target[s]) for s in range(S))

    # large zero-sum draws: the binding site's target is met at about max_s (mu_s tau_s)^2 / S
    lo = hi = math.log(float(np.max((mu * taus) ** 2)) / S)
    while excess(lo) <= 0:
        lo -= 1.0
    while excess(hi) > 0:
        hi += 1.0
    log_t = brentq(excess, lo, hi, xtol=1e-12)
    while excess(log_t) > 0:  # the root from above: every site at or below its target
        log_t += 1e-12
    return Variances(e_hat, math.exp(log_t) / mu**2, mu)


def plan_variances(plan: NoisePlan | str, taus, weights, site_names=None, consortium: int | None = None
                   ) -> Variances:
    """The variances ``plan`` uses for one quantity, given every site's release std and aggregation weight.

    Under "cape" every release alone carries at least its std tau_s: equal
    sites get the symmetric plan with zero-sum variances scaled by
    ``zero_sum_variance``, unequal ones :func:`guarantee_plan` (or
    [capeDJICA]'s :func:`asymmetric_plan`, scaled, with ``unequal="papers"``).
    ``consortium``: the configured number of sites when these are survivors (:func:`guarantee_plan`).
    """
    plan = NoisePlan.coerce(plan)
    taus = np.asarray(taus, float)
    w = np.asarray(weights, float)
    S = len(taus)
    if plan.kind == "none":
        return Variances(np.zeros(S), np.zeros(S), w)
    if plan.kind == "conv":
        return Variances(np.zeros(S), taus**2, w)
    c = plan.zero_sum_variance
    if plan.unequal == "guarantee":
        consortium = S if consortium is None else int(consortium)
        return guarantee_plan(taus, w, plan.colluders(consortium), c, site_names, consortium)
    if np.allclose(taus, taus[0]) and np.allclose(w, 1.0 / S):
        v = symmetric_plan(float(taus[0]), S)
    else:
        v = asymmetric_plan(taus, w, site_names=site_names)
    return Variances(v.e_hat * c, v.g, v.weights)
