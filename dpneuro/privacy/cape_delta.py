"""CAPE's (eps, delta) against colluding sites ([capeDJICA] Theorem 1 and Sec. III-C).

The adversary sees every honest site's release a_s = f_s + e_s + g_s and, by
pooling the aggregator's broadcast sum with the colluders' own draws, the
honest sites' partial sum of e_hat. Its privacy-loss variable is Gaussian
N(mu_z, 2 mu_z) with mu_z = v^T Sigma^-1 v / 2, where Sigma is the covariance of
what it sees and v the change a neighbouring dataset makes. Then

    delta = 2 sigma_z / (eps - mu_z) * phi((eps - mu_z) / sigma_z).

Erratum: the proof of [capeDJICA] Thm. 1 treats the colluders' draws e_hat_c as unknown
to the adversary although the colluders hand them over, and its printed
closed form (eq. 1) also mis-inverts the honest sites' covariance. We use the
adversary that knows the colluders' draws (it subtracts them from every
release); then, with S_H = S - S_C honest sites, per-site sensitivity Delta and
local std tau,

    mu_z = S (S + S_H) Delta^2 / (2 (S + 1) S_H tau^2),

which grows with S_C as it should and equals the numeric v^T Sigma^-1 v / 2.
The paper's eq. (1) is kept as :func:`cape_mu_z_paper` for comparison.

With the zero-sum draws' variance scaled by c (var(e_hat_s) = c tau^2,
:data:`dpneuro.protocol.cape.plans.ZERO_SUM_VARIANCE`) the same inversion gives

    mu_z = S (S_H + c S) Delta^2 / (2 S_H (c S + 1) tau^2),

which tends to S Delta^2 / (2 S_H tau^2) as c grows: with no colluders,
Delta^2 / (2 tau^2), what the pooled average alone reveals.
"""

from __future__ import annotations

import itertools
import math

import numpy as np


def max_colluding(n_sites: int) -> int:
    """The collusion bound of [capeDJICA]: S_C = ceil(S/3) - 1."""
    return math.ceil(n_sites / 3) - 1


def check_collusion(n_sites: int, n_colluding: int | None) -> int:
    """Validate the collusion assumption; return S_C (default: the bound)."""
    if n_sites < 3:
        raise ValueError(
            f"CAPE needs at least 3 sites (got {n_sites}): with fewer, one site can subtract its own "
            "noise from the broadcast zero-sum and learn the other's; use plan='conv' instead"
        )
    bound = max_colluding(n_sites)
    if n_colluding is None:
        return bound
    if n_colluding < 0 or n_colluding > bound:
        raise ValueError(
            f"CAPE's guarantee holds for at most ceil(S/3) - 1 = {bound} colluding sites when S = {n_sites} "
            f"([capeDJICA] Thm. 1); {n_colluding} were assumed. Add sites or use plan='conv'"
        )
    return int(n_colluding)


def _std_normal_pdf(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def delta_from_mu_z(epsilon: float, mu_z: float) -> float:
    """delta = 2 sigma_z/(eps - mu_z) phi((eps - mu_z)/sigma_z), sigma_z^2 = 2 mu_z."""
    if not epsilon > 0:
        raise ValueError(f"epsilon must be > 0, got {epsilon}")
    sigma_z = math.sqrt(2 * mu_z)
    if epsilon <= mu_z:
        raise ValueError(
            f"epsilon={epsilon:g} is not above mu_z={mu_z:.4g}: the CAPE bound gives no delta < 1 here; "
            "increase the noise or epsilon"
        )
    x = (epsilon - mu_z) / sigma_z
    return float(min(1.0, 2 * sigma_z / (epsilon - mu_z) * _std_normal_pdf(x)))


def cape_mu_z(tau: float, sensitivity: float, n_sites: int, n_colluding: int,
              zero_sum_variance: float = 1.0) -> float:
    """mu_z for the symmetric plan (every site std ``tau``, zero-sum variance ``zero_sum_variance`` tau^2).

    Equivalent observations: b_s = e_hat_s + g_s for each honest s (the known
    mean term removed) and E = sum_H e_hat_s. Given E the b_s have covariance
    (a + b) I - (a / S_H) 1 1^T (a = c tau^2, b = tau^2 / S), whose inverse's
    diagonal (Sherman-Morrison) is (S_H b + a) / (S_H b (a + b)):
    S (S_H + c S) / (S_H (c S + 1) tau^2), S (S + S_H) / ((S + 1) S_H tau^2) at c = 1.
    """
    S, S_H, c = n_sites, n_sites - n_colluding, zero_sum_variance
    return S * (S_H + c * S) * sensitivity**2 / (2 * S_H * (c * S + 1) * tau * tau)


def cape_mu_z_paper(tau: float, n_total: int, n_sites: int, n_colluding: int) -> float:
    """[capeDJICA] eq. (1) as printed (see the erratum in the module docstring)."""
    S, S_C, N = n_sites, n_colluding, n_total
    return S**3 / (2 * tau**2 * N**2 * (1 + S)) * (
        (S - S_C + 2) / (S - S_C) + (9 / (S - S_C)) * S_C**2 / (S * (1 + S) - 3 * S_C**2)
    )


def cape_delta(
    epsilon: float, tau: float, n_total: int, n_sites: int, n_colluding: int | None = None,
    *, sensitivity: float | None = None,
) -> float:
    """CAPE delta for the symmetric setting of [capeDJICA] Theorem 1.

    ``sensitivity`` defaults to the theorem's 1/N_s = S/N (one sample per person);
    pass the subject-level sensitivity for fMRI.
    """
    S_C = check_collusion(n_sites, n_colluding)
    if tau <= 0:
        raise ValueError(f"tau must be > 0, got {tau}")
    delta_s = n_sites / n_total if sensitivity is None else sensitivity
    return delta_from_mu_z(epsilon, cape_mu_z(tau, delta_s, n_sites, S_C))


def _observation_matrix(weights: np.ndarray, honest: list[int]) -> np.ndarray:
    """Rows: honest releases a_s, then sum_{i in H} w_i e_hat_i; columns: honest [e_hat, g].

    The colluders' draws are known to the adversary, so they are subtracted
    from every release and do not appear.
    """
    S, n = len(weights), len(honest)
    w = weights[honest]
    L = np.zeros((n + 1, 2 * n))
    for row, s in enumerate(honest):
        L[row, :n] -= w / (weights[s] * S)
        L[row, row] += 1.0
        L[row, n + row] = 1.0
    L[-1, :n] = w
    return L


def mu_z_numeric(
    sensitivity: float, e_var: np.ndarray, g_var: np.ndarray, weights: np.ndarray,
    site: int, colluding: list[int],
) -> float:
    """mu_z = v^T Sigma^-1 v / 2 for ``site`` when the ``colluding`` sites join the aggregator (inf when the
    variances leave the release without noise: no guarantee)."""
    S = len(weights)
    honest = [site] + [s for s in range(S) if s != site and s not in colluding]
    L = _observation_matrix(np.asarray(weights, float), honest)
    var = np.r_[np.asarray(e_var, float)[honest], np.asarray(g_var, float)[honest]]
    Sigma = L @ np.diag(var) @ L.T
    v = np.zeros(len(honest) + 1)
    v[0] = sensitivity
    try:
        mu_z = float(v @ np.linalg.solve(Sigma, v) / 2)
    except np.linalg.LinAlgError:
        return math.inf
    return mu_z if math.isfinite(mu_z) and mu_z >= 0 else math.inf


def cape_delta_asymmetric(
    epsilon: float, sensitivities, e_var, g_var, weights=None, *,
    n_colluding: int | None = None, colluding=None, max_subsets: int = 20000,
) -> np.ndarray:
    """Per-site CAPE delta for the weighted/asymmetric plan of [capeDJICA] Sec. III-C.

    ``e_var`` are the variances of each site's zero-sum draw e_hat_s and
    ``g_var`` of its local draw g_s (see :func:`dpneuro.protocol.cape.asymmetric_plan`).
    Without an explicit ``colluding`` set, the worst case over every set of
    ``n_colluding`` other sites is taken for each site.
    """
    sens = np.asarray(sensitivities, float)
    S = len(sens)
    S_C = check_collusion(S, n_colluding if colluding is None else len(colluding))
    w = np.full(S, 1.0 / S) if weights is None else np.asarray(weights, float)
    out = np.empty(S)
    for s in range(S):
        if colluding is not None:
            sets = [[c for c in colluding if c != s]]
        else:
            others = [i for i in range(S) if i != s]
            if math.comb(len(others), S_C) > max_subsets:
                raise ValueError(
                    f"{math.comb(len(others), S_C)} colluding sets to check for site {s}; pass colluding= explicitly"
                )
            sets = [list(c) for c in itertools.combinations(others, S_C)]
        mu = max(mu_z_numeric(sens[s], e_var, g_var, w, s, c) for c in sets)
        out[s] = delta_from_mu_z(epsilon, mu)
    return out


def cape_release_mu(
    sensitivity: float, e_var, g_var, weights, site: int, n_colluding: int, *, max_subsets: float = 20000,
    closed_form: bool = True,
) -> float:
    """GDP mu of one CAPE release of ``site`` against the aggregator with ``n_colluding`` sites.

    The adversary's privacy loss is N(mu_z, 2 mu_z), i.e. that of a Gaussian
    mechanism with mu = sqrt(2 mu_z); releases compose in GDP like any other.
    Symmetric plans use the closed form (unless ``closed_form=False``: a site
    checking a plan someone else sent uses the general formula, whose answer
    no tolerance of "symmetric" can bend); others the worst colluding set.
    """
    e_var, g_var, w = (np.asarray(x, float) for x in (e_var, g_var, weights))
    S = len(w)
    if closed_form and np.allclose(w, 1 / S) and np.allclose(e_var, e_var[0]) and np.allclose(g_var, g_var[0]) \
            and g_var[0] > 0:
        tau2 = S * g_var[0]  # the symmetric plan: var(g) = tau^2 / S, var(e_hat) = c tau^2
        return math.sqrt(2 * cape_mu_z(math.sqrt(tau2), sensitivity, S, n_colluding, e_var[0] / tau2))
    others = [i for i in range(S) if i != site]
    if math.comb(len(others), n_colluding) > max_subsets:
        raise ValueError(f"too many colluding sets to check ({math.comb(len(others), n_colluding)})")
    mu_z = max(mu_z_numeric(sensitivity, e_var, g_var, w, site, list(c))
               for c in itertools.combinations(others, n_colluding))
    return math.sqrt(2 * mu_z)
