"""Gaussian mechanism: calibration and the exact Gaussian privacy curve.

A Gaussian mechanism with L2 sensitivity ``Delta`` and noise std ``sigma`` is
``mu``-GDP with ``mu = Delta / sigma`` (Dong, Roth & Su 2019); its exact
(eps, delta) curve is the analytic Gaussian curve of Balle & Wang (2018):

    delta(eps) = Phi(-eps/mu + mu/2) - exp(eps) * Phi(-eps/mu - mu/2).

Composition of Gaussians is exact in GDP: ``mu^2 = sum_i (Delta_i/sigma_i)^2``.

This is the one place where a privacy target becomes noise:
:func:`noise_multiplier` (eps, delta, number of releases, method -> std per
unit sensitivity) and its inverse :func:`epsilon_for_multiplier`. Every
algorithm, the configuration check and the budget planner call these two;
an algorithm reports what it spends as a :class:`GaussianBudget`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import optimize, special


def _log_ndtr(x: float) -> float:
    return float(special.log_ndtr(x))


def gdp_delta(epsilon: float, mu: float) -> float:
    """delta(eps) of a ``mu``-GDP mechanism (exact; computed in log space)."""
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    a = _log_ndtr(-epsilon / mu + mu / 2)
    b = epsilon + _log_ndtr(-epsilon / mu - mu / 2)
    if b >= a:
        return 0.0
    return float(math.exp(a) * -math.expm1(b - a))


def gdp_epsilon(delta: float, mu: float) -> float:
    """Smallest eps with ``gdp_delta(eps, mu) <= delta``."""
    _check_delta(delta)
    if mu <= 0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    lo, hi = 0.0, max(1.0, mu * mu)
    while gdp_delta(hi, mu) > delta:
        lo, hi = hi, hi * 2
    log_d = math.log(delta)
    f = lambda e: math.log(max(gdp_delta(e, mu), 1e-300)) - log_d  # noqa: E731
    return float(optimize.brentq(f, lo, hi, xtol=1e-12, rtol=1e-12))


def gdp_mu(epsilon: float, delta: float) -> float:
    """The ``mu`` whose GDP curve passes through (eps, delta)."""
    _check_epsilon(epsilon)
    _check_delta(delta)
    log_d = math.log(delta)
    lo, hi = 1e-6, 1.0
    while gdp_delta(epsilon, hi) < delta:
        lo, hi = hi, hi * 2
    f = lambda m: math.log(max(gdp_delta(epsilon, m), 1e-300)) - log_d  # noqa: E731
    return float(optimize.brentq(f, lo, hi, xtol=1e-14, rtol=1e-13))


def gaussian_sigma(epsilon: float, delta: float, sensitivity: float = 1.0, method: str = "analytic") -> float:
    """Noise std for an (eps, delta)-DP Gaussian mechanism.

    ``method="analytic"`` (Balle & Wang 2018) is optimal for every eps > 0.
    ``method="classic"`` is ``sqrt(2 ln(1.25/delta)) * sensitivity / eps``,
    the Dwork & Roth bound, which holds only for eps < 1 and is refused otherwise.
    """
    _check_epsilon(epsilon)
    _check_delta(delta)
    if sensitivity < 0 or not math.isfinite(sensitivity):
        raise ValueError(f"sensitivity must be finite and >= 0, got {sensitivity}")
    if method == "classic":
        if epsilon >= 1:
            raise ValueError(
                f"the classic Gaussian formula sqrt(2 ln(1.25/delta))/eps holds only for eps < 1 "
                f"(got eps={epsilon}); use method='analytic' (Balle & Wang 2018), valid for any eps"
            )
        return math.sqrt(2 * math.log(1.25 / delta)) * sensitivity / epsilon
    if method != "analytic":
        raise ValueError(f"unknown method {method!r}; use 'analytic' or 'classic'")
    return sensitivity / gdp_mu(epsilon, delta)


CALIBRATIONS = ("analytic", "classic")


def noise_multiplier(epsilon, delta: float, releases: int = 1, method: str = "analytic") -> float:
    """Noise std per unit sensitivity of each of ``releases`` Gaussian releases that together are (eps, delta)-DP.

    ``epsilon`` None or +inf: no noise (0.0; only a non-private plan may ask).
    ``"analytic"`` splits mu exactly (GDP): z = sqrt(releases) / mu(eps, delta).
    ``"classic"`` (the papers' sqrt(2 ln(1.25/delta)) / eps, eps < 1) is a
    per-release formula: it refuses ``releases > 1``.
    """
    if epsilon is None or (isinstance(epsilon, (int, float)) and math.isinf(epsilon) and epsilon > 0):
        return 0.0
    if method not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {method!r}; use one of {CALIBRATIONS}")
    if isinstance(releases, bool) or int(releases) != releases or releases < 1:
        raise ValueError(f"releases must be a positive integer, got {releases!r}")
    if method == "classic" and releases > 1:
        raise ValueError("calibration 'classic' calibrates one release; composed releases use 'analytic' (exact)")
    return gaussian_sigma(float(epsilon), float(delta), 1.0, method=method) * math.sqrt(int(releases))


def epsilon_for_multiplier(z: float, delta: float, releases: int = 1, method: str = "analytic") -> float:
    """The eps that :func:`noise_multiplier` maps to ``z`` (inverse; inf for z = 0)."""
    if z <= 0:
        return math.inf
    if method == "classic":
        if releases != 1:
            raise ValueError("calibration 'classic' calibrates one release")
        return math.sqrt(2 * math.log(1.25 / delta)) / z
    if method not in CALIBRATIONS:
        raise ValueError(f"unknown calibration {method!r}; use one of {CALIBRATIONS}")
    return gdp_epsilon(delta, math.sqrt(releases) / z)


@dataclass(frozen=True)
class GaussianBudget:
    """What an algorithm spends, as a planner sees it: its (eps, delta) and how eps becomes its noise multiplier.

    A planner that looks for the settings spending a target scales :attr:`noise_multiplier` and asks for the
    eps that gives it (:meth:`epsilon_for`), as dp-accounting's ``calibrate_dp_mechanism`` searches a
    mechanism's parameter.
    """

    epsilon: float | None
    delta: float
    calibration: str = "analytic"

    @property
    def noise_multiplier(self) -> float:
        """The multiplier of one Gaussian release at (eps, delta) (:func:`noise_multiplier`)."""
        return noise_multiplier(self.epsilon, self.delta, method=self.calibration)

    def epsilon_for(self, z: float) -> float:
        """The eps whose :attr:`noise_multiplier` is ``z`` at this delta (:func:`epsilon_for_multiplier`)."""
        return epsilon_for_multiplier(z, self.delta, method=self.calibration)


def split_gdp(site_mu: Sequence[Mapping[str, float]], target_mu: float, multipliers: Mapping[str, float],
              share: Mapping[str, float] | None = None) -> dict[str, float]:
    """The noise multiplier of each stage at which the most exposed site spends ``target_mu`` in total.

    ``site_mu`` holds each site's mu per stage at the stages' current ``multipliers``. A stage's mu is
    inversely proportional to its multiplier, and the stages compose in GDP as ``sqrt(sum mu^2)``. Stage ``st``
    gets ``share[st]`` of the largest site's mu^2. By default each stage keeps the part it has now, that
    site's current mu per stage.

    Each stage is first scaled so that alone, at its share, it would give ``target_mu``. Then all stages are
    scaled together until the largest site's total is ``target_mu``: sites whose stages peak at different sites
    spend less than the sum of the shares.
    """
    stages = list(multipliers)
    mu = {st: max(m[st] for m in site_mu) for st in stages}
    if share is None:
        total = sum(v**2 for v in mu.values())
        share = {st: mu[st] ** 2 / total for st in stages}
    alone = {st: multipliers[st] * mu[st] / (math.sqrt(share[st]) * target_mu) for st in stages}
    mu_max = max(math.sqrt(sum((m[st] * multipliers[st] / alone[st]) ** 2 for st in stages)) for m in site_mu)
    return {st: z * mu_max / target_mu for st, z in alone.items()}


def gaussian_epsilon(sigma: float, delta: float, sensitivity: float = 1.0) -> float:
    """eps of one Gaussian release (exact analytic curve)."""
    return gdp_epsilon(delta, sensitivity / sigma if sigma > 0 else math.inf)


def rdp_closed_form_epsilon(rounds: int, sensitivity: float, sigma: float, delta: float) -> float:
    """Closed-form RDP bound for ``rounds`` Gaussian releases.

    With rho = J Delta^2 / (2 sigma^2) (the RDP slope), optimising the classic
    conversion eps = rho*alpha + log(1/delta)/(alpha - 1) over alpha gives
    eps = rho + 2 sqrt(rho log(1/delta)).
    """
    _check_delta(delta)
    rho = rounds * sensitivity**2 / (2 * sigma**2)
    return rho + 2 * math.sqrt(rho * math.log(1 / delta))


def moments_accountant_epsilon(rounds: int, sensitivity: float, sigma: float, delta: float) -> float:
    """Positive root of the moments-accountant quadratic of [capeDJICA] App. G, corrected.

    The paper's quadratic has its linear term off by a factor 2; the correct form is
    (sigma^2/(2 J Delta^2)) eps^2 - eps/2 + J Delta^2/(8 sigma^2) + log(delta) = 0,
    whose positive root is :func:`rdp_closed_form_epsilon`.
    """
    _check_delta(delta)
    a = sigma**2 / (2 * rounds * sensitivity**2)
    b = -0.5
    c = rounds * sensitivity**2 / (8 * sigma**2) + math.log(delta)
    roots = np.roots([a, b, c])
    real = roots[np.isreal(roots)].real
    return float(real.max())


def _check_epsilon(epsilon: float) -> None:
    if not (epsilon > 0) or math.isnan(epsilon):
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    if math.isinf(epsilon):
        raise ValueError("epsilon = inf means no privacy: run the non-private plan ('none') instead of "
                         "calibrating noise for it")


def _check_delta(delta: float) -> None:
    if not (0 < delta < 1):
        raise ValueError(f"delta must be in (0, 1), got {delta}")
