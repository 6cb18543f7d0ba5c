"""Privacy core: Gaussian calibration, accounting, CAPE delta, noise draws."""

from dpneuro.privacy.cape_delta import (
    cape_delta,
    cape_delta_asymmetric,
    cape_mu_z,
    cape_release_mu,
    check_collusion,
    delta_from_mu_z,
    max_colluding,
    mu_z_numeric,
)
from dpneuro.privacy.gaussian import (
    CALIBRATIONS,
    GaussianBudget,
    epsilon_for_multiplier,
    gaussian_epsilon,
    gaussian_sigma,
    gdp_delta,
    gdp_epsilon,
    gdp_mu,
    moments_accountant_epsilon,
    noise_multiplier,
    rdp_closed_form_epsilon,
    split_gdp,
)
from dpneuro.privacy.ledger import PrivacyLedger, Release
from dpneuro.privacy.noise import default_rng, gaussian, resolve_random_state
from dpneuro.privacy.summary import privacy_report

__all__ = [
    "PrivacyLedger",
    "privacy_report",
    "Release",
    "cape_delta",
    "cape_delta_asymmetric",
    "cape_mu_z",
    "cape_release_mu",
    "check_collusion",
    "default_rng",
    "delta_from_mu_z",
    "CALIBRATIONS",
    "GaussianBudget",
    "epsilon_for_multiplier",
    "noise_multiplier",
    "gaussian",
    "resolve_random_state",
    "gaussian_epsilon",
    "gaussian_sigma",
    "gdp_delta",
    "gdp_epsilon",
    "gdp_mu",
    "max_colluding",
    "moments_accountant_epsilon",
    "mu_z_numeric",
    "rdp_closed_form_epsilon",
    "split_gdp",
]
