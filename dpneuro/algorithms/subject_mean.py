"""The mean of every subject's bounded vector, released through CAPE: the one-release shape of the static FNC and
the group GLM's sufficient statistics.

Each subject's vector is scaled onto the public L2 bound B if longer, and site
s releases the mean (1/M_s) sum_i clip(v_i): replacing one subject moves it by
at most 2B / M_s. The aggregator's CAPE-weighted average is the mean over every
subject of the consortium; the noise's per-entry variance (public: the plan's)
comes with it.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from dpneuro import privacy
from dpneuro.protocol.cape import ReleaseSpec, noise_variance
from dpneuro.protocol.exchange import Payload

__all__ = ["CapeSubjectMean", "clip_subjects", "site_counts"]


def clip_subjects(F: np.ndarray, bound: float) -> tuple[np.ndarray, np.ndarray]:
    """Each subject's row scaled onto L2 norm ``bound`` when longer; the rows and which were scaled."""
    n = np.linalg.norm(F, axis=1)
    scaled = n > bound
    return F * np.minimum(1.0, bound / np.maximum(n, 1e-300))[:, None], scaled


def site_counts(state: dict) -> np.ndarray:
    """Each site's subjects behind the aggregator's combined release (its public weight; 0 for a site not in the
    sum)."""
    cs = state["cape"]
    summed = np.asarray(cs["summed"], np.int64)
    counts = np.zeros(len(cs["weights"]))
    counts[summed] = np.asarray(cs["weights"])[summed]
    return counts


class CapeSubjectMean:
    """One release per site of its subjects' clipped mean (a subclass names it: ``name``, ``key``, ``tag``).

    Site data: M x L, one row per subject. Release ``key`` (L,): sensitivity
    2B / M_s under replacement, public bound B. The aggregator's result:
    ``key`` (the consortium's mean), ``noise_var`` (its noise's variance per
    entry, from the plan) and ``counts`` (each site's subjects behind it).
    """

    name = "subject-mean"
    key = "mean"
    #: the site's noise stream: numpy's seed sequence [random_state, tag, site]
    tag = 0
    max_rounds = 1

    def __init__(self, bound: float, z: float, random_state=None):
        if not (bound > 0 and math.isfinite(bound)):
            raise ValueError(f"bound must be finite and > 0, got {bound}")
        self.B, self.z = float(bound), float(z)
        self.random_state = privacy.resolve_random_state(random_state)

    def site_init(self, site: int, data) -> dict:
        F = np.atleast_2d(np.asarray(data, np.float64))
        if F.shape[0] < 1 or not np.all(np.isfinite(F)):
            raise ValueError(f"site {site}: the subjects' {self.key} rows must be a finite M x L matrix, got shape "
                             f"{F.shape}")
        clipped, scaled = clip_subjects(F, self.B)
        state: dict[str, Any] = {"_F": clipped, "M": int(F.shape[0]), "P": int(F.shape[1]),
                                 "clipped": int(scaled.sum())}
        if self.random_state is not None:
            state["rng"] = np.random.default_rng([self.random_state, self.tag, site])
        return state

    def public_state(self, site: int, lengths, dim: int) -> dict:
        """What a site's release depends on (the planner calls this without data)."""
        return {"M": len(lengths), "P": int(dim)}

    def site_weight(self, state) -> float:
        return float(state["M"])

    def site_releases(self, state) -> dict[str, ReleaseSpec]:
        return {self.key: ReleaseSpec((state["P"],), 2.0 * self.B / state["M"], self.z, unit="subject",
                                      stage=self.name, bound=self.B)}

    def site_compute(self, state, round, broadcast) -> dict[str, np.ndarray]:
        return {self.key: state["_F"].sum(axis=0) / state["M"]}

    def aggregator_init(self) -> dict:
        return {}

    def aggregator_first(self, state) -> Payload:
        return Payload()

    def aggregator_update(self, state, round, combined) -> Payload:
        state[self.key] = np.asarray(combined[self.key], np.float64)
        state["noise_var"] = noise_variance(state, self.key)
        state["counts"] = site_counts(state)
        return Payload({self.key: state[self.key]}, {"stop": True}, carries={self.key: "public"})
