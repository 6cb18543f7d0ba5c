"""Static functional network connectivity (FNC) between components, private, over CAPE.

The consortium's mean FNC, the first matrix GIFT and COINSTAC's group ICA
report (Jafri et al. 2008): at each site, every subject's correlation matrix
between its R component time courses, Fisher z, upper triangle (a vector of
P = R(R-1)/2 entries, :func:`subject_fnc`). Nothing per subject leaves the
site: each subject's vector is scaled onto the public L2 bound B if longer
(B = :data:`FNC_BOUND` sqrt(P), an RMS Fisher z of 0.3 per pair, the bound of a
subject's mean window in :mod:`dpneuro.algorithms.dfnc`), and site s releases
their mean (1/M_s) sum_i clip(f_i) through CAPE. Replacing one subject moves it
by at most 2B / M_s (docs/privacy.md, "Static FNC"). The aggregator's
CAPE-weighted average is the consortium's mean over every subject; the
noise's per-entry variance (public: the plan's) comes with it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from dpneuro import privacy
from dpneuro.algorithms.dfnc import MEAN_BOUND, matrix_to_vector, noise_multipliers
from dpneuro.algorithms.subject_mean import CapeSubjectMean, clip_subjects
from dpneuro.privacy import PrivacyLedger
from dpneuro.protocol.cape import NoisePlan, planned_ledgers, run_cape
from dpneuro.protocol.cape import ledgers as cape_ledgers

__all__ = ["FNC_BOUND", "CapeFNC", "FNCSettings", "clip_subjects", "site_fnc", "subject_fnc"]

#: a subject's FNC vector is bounded to FNC_BOUND sqrt(P): the size of static connectivity between components
FNC_BOUND = MEAN_BOUND
#: |r| is capped below 1 before Fisher z (two collinear time courses)
_R_MAX = 1.0 - 1e-7


def subject_fnc(tc) -> np.ndarray:
    """One subject's FNC: the Fisher z of the correlations between its component time courses (R x T), upper
    triangle (P = R(R-1)/2 entries, row by row). A constant time course correlates 0 with every other."""
    tc = np.asarray(tc, np.float64)
    tc = tc - tc.mean(axis=1, keepdims=True)
    sd = np.sqrt((tc**2).sum(axis=1))
    unit = np.divide(tc, sd[:, None], out=np.zeros_like(tc), where=sd[:, None] > 0)
    C = np.clip(unit @ unit.T, -_R_MAX, _R_MAX)
    return matrix_to_vector(C)


def site_fnc(S, lengths: Sequence[int]) -> np.ndarray:
    """Every subject's FNC (M x P) from a site's component time courses S (R x N, subjects' columns in order)."""
    S = np.asarray(S, np.float64)
    bounds = np.cumsum([0, *[int(n) for n in lengths]])
    if bounds[-1] != S.shape[1]:
        raise ValueError(f"the subjects' lengths sum to {bounds[-1]}, the time courses have {S.shape[1]} columns")
    return np.array([subject_fnc(S[:, a:b]) for a, b in zip(bounds[:-1], bounds[1:])])


class CapeFNC(CapeSubjectMean):
    """The consortium's mean FNC as a CAPE algorithm: one release per site of its subjects' clipped mean.

    Site data: the site's per-subject FNC (M x P, :func:`site_fnc`). Release
    ``fnc`` (P,): sensitivity 2B / M_s under replacement, public bound B.
    The aggregator's result: ``fnc`` (the consortium's mean, Fisher z) and
    ``noise_var`` (its noise's variance per entry, from the plan).
    """

    name = "static-fnc"
    key = "fnc"
    tag = 47


@dataclass(frozen=True)
class FNCSettings:
    """The public settings of the static-FNC stage, identical at every party: ``epsilon``/``delta`` the stage's
    per site against the headline adversary (None with plan "none"), ``bound`` B (default FNC_BOUND sqrt(P))."""

    epsilon: float | None
    delta: float = 1e-5
    plan: Any = "cape"
    bound: float | None = None
    random_state: int | None = None

    @property
    def budget(self) -> privacy.GaussianBudget:
        """The (eps, delta) the stage is calibrated to (a planner scales the noise from it)."""
        return privacy.GaussianBudget(self.epsilon, self.delta)

    #: the ledger's name of the stage's one release
    ledger_stages = (CapeFNC.name,)

    def scale(self, P: int) -> float:
        return FNC_BOUND * math.sqrt(P) if self.bound is None else float(self.bound)

    def algorithm(self, *, P: int, n_sites: int) -> CapeFNC:
        z = noise_multipliers(self.epsilon, self.delta, {"fnc": 1.0}, n_sites=n_sites, plan=self.plan)["fnc"]
        return CapeFNC(self.scale(P), z, random_state=self.random_state)

    def planned(self, n_subjects: Sequence[int], n_components: int) -> list[PrivacyLedger]:
        """The ledgers the stage fills, from each site's subject count alone."""
        P = n_components * (n_components - 1) // 2
        alg = self.algorithm(P=P, n_sites=len(n_subjects))
        return planned_ledgers(alg, NoisePlan.coerce(self.plan), [alg.public_state(s, [0] * int(m), P)
                                                                  for s, m in enumerate(n_subjects)])

    def run(self, sites: Sequence[np.ndarray]) -> dict[str, Any]:
        """Every party in this process (notebooks, tests, benchmarks): ``fnc``, ``noise_var``, the ledgers."""
        P = np.shape(sites[0])[1]
        r = run_cape(self.algorithm(P=P, n_sites=len(sites)), list(sites), NoisePlan.coerce(self.plan))
        return {"fnc": r.aggregator["fnc"], "noise_var": float(r.aggregator["noise_var"]),
                "ledgers": cape_ledgers(r)}
