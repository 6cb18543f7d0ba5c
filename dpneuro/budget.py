"""Privacy budget planning: what a setting spends, and settings that spend a target.

Both directions use the same accounting as the run itself (a ledger with the
releases the run will make), so the numbers the planner prints are the ones
the report will show for the same configuration.
"""

from __future__ import annotations

import math
from typing import Any

from .privacy import PrivacyLedger, cape_mu_z, gaussian_sigma, gdp_epsilon, gdp_mu, max_colluding


def _ledger(S: int, M: int, J: int, clip: float, z_pca: float, z_ica: float) -> PrivacyLedger:
    """The releases one site makes: one covariance (sensitivity 1/M), then G and h every round."""
    led = PrivacyLedger("site")
    led.record("A", 1.0 / M, z_pca / M, stage="capepca")
    for name in ("G", "h"):
        led.record(name, 2 * clip / M, z_ica * 2 * clip / M, count=J, stage="capedjica")
    return led


def _table(delta, S, M, J, clip, z_pca, z_ica, n_features, pca_eps, ica_eps_i, ica_delta_i) -> dict[str, Any]:
    led = _ledger(S, M, J, clip, z_pca, z_ica)
    S_C = max_colluding(S) if S >= 3 else 0
    factor = math.sqrt(2 * cape_mu_z(1.0, 1.0, S, S_C)) if S >= 3 else 1.0
    eps = led.epsilon(delta)
    eps_rdp = led.epsilon(delta, "rdp")
    eps_coll = gdp_epsilon(delta, led.mu * factor)
    M_total = S * M
    sd_cov = z_pca / M_total  # per entry of the averaged covariance under CAPE (pooled level)
    sd_grad = z_ica * 2 * clip / M_total
    lines = [
        f"sites S = {S}, subjects per site M_s = {M} (privacy unit: one subject), ICA rounds J = {J}, "
        f"clip B = {clip:g}, delta = {delta:g}",
        f"capePCA : eps = {pca_eps:.3g} for the one release; noise multiplier z = {z_pca:.3g}",
        f"capeDJICA: eps_i = {ica_eps_i:.3g}, delta_i = {ica_delta_i:g} per release (G and h, every round); "
        f"z = {z_ica:.3g}",
        f"total per site: eps = {eps:.3g} (exact GDP, mu = {led.mu:.3g}), {eps_rdp:.3g} (RDP); "
        f"{eps_coll:.3g} against the aggregator with {S_C} colluding site(s)",
        f"expected noise after CAPE averaging: covariance entries sd {sd_cov:.3g}, gradient entries sd "
        f"{sd_grad:.3g} (per round)",
    ]
    if n_features:
        # spectral norm of a D x D symmetric Gaussian matrix ~ 2 sd sqrt(D); unit-norm time points put
        # the whole signal's eigenvalues (summing to 1) above it only if it is small
        lines.append(f"with D = {n_features} features the covariance noise has spectral norm ~ "
                     f"{2 * sd_cov * math.sqrt(n_features):.3g} (eigenvalues of the data sum to 1: components "
                     f"whose eigenvalue is below this are lost)")
    return {"delta": delta, "sites": S, "subjects_per_site": M, "rounds": J, "clip": clip,
            "pca_epsilon": pca_eps, "pca_noise_multiplier": z_pca, "ica_epsilon_i": ica_eps_i,
            "ica_delta_i": ica_delta_i, "ica_noise_multiplier": z_ica, "mu": led.mu, "epsilon_exact": eps,
            "epsilon_rdp": eps_rdp, "epsilon_collusion": eps_coll, "noise_sd_covariance": sd_cov,
            "noise_sd_gradient": sd_grad, "lines": lines}


def _check_shape(sites: int, subjects: int, rounds: int, clip: float) -> None:
    if sites < 1 or subjects < 1 or rounds < 1:
        raise ValueError("sites, subjects and rounds must be >= 1")
    if not clip > 0:
        raise ValueError("clip must be > 0")


def spend(delta: float, *, sites: int, subjects: int, rounds: int, clip: float, pca_epsilon: float,
          ica_epsilon_i: float, ica_delta_i: float = 1e-2, calibration: str = "analytic",
          n_features: int | None = None) -> dict[str, Any]:
    """Total privacy per site of a run with these settings (pipeline calibration: PCA at delta/2)."""
    _check_shape(sites, subjects, rounds, clip)
    z_pca = gaussian_sigma(pca_epsilon, delta / 2)
    z_ica = gaussian_sigma(ica_epsilon_i, ica_delta_i, method=calibration)
    return _table(delta, sites, subjects, rounds, clip, z_pca, z_ica, n_features, pca_epsilon, ica_epsilon_i,
                  ica_delta_i)


def plan_budget(target_epsilon: float, delta: float, *, sites: int, subjects: int, rounds: int, clip: float,
                pca_share: float = 0.25, ica_delta_i: float = 1e-2, n_features: int | None = None) -> dict[str, Any]:
    """Per-stage budgets whose composition is ``target_epsilon`` at ``delta`` (exact GDP).

    ``pca_share`` of mu^2 goes to the PCA release, the rest is spread evenly
    over the 2 J ICA releases; per-release eps come from the analytic Gaussian.
    """
    _check_shape(sites, subjects, rounds, clip)
    if not 0 < pca_share < 1:
        raise ValueError(f"pca_share must be in (0, 1), got {pca_share}")
    mu = gdp_mu(target_epsilon, delta)
    mu_pca = math.sqrt(pca_share) * mu
    z_pca = 1 / mu_pca
    z_ica = math.sqrt(2 * rounds / ((1 - pca_share) * mu * mu))
    pca_eps = gdp_epsilon(delta / 2, mu_pca)
    ica_eps_i = gdp_epsilon(ica_delta_i, 1 / z_ica)
    out = _table(delta, sites, subjects, rounds, clip, z_pca, z_ica, n_features, pca_eps, ica_eps_i, ica_delta_i)
    out["lines"].insert(0, f"proposal for a total eps = {target_epsilon:g} per site at delta = {delta:g} "
                           f"({pca_share:.0%} of mu^2 to capePCA):")
    return out
