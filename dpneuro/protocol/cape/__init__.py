"""CAPE: correlated-noise protocol for decentralized differential privacy."""

from dpneuro.protocol.cape.packing import n_unique, pack, unpack
from dpneuro.protocol.cape.phases import (
                     CapeAlgorithm,
                     ReleaseSpec,
                     cape_protocol,
                     ledgers,
                     noise_variance,
                     planned_ledgers,
                     record_release,
                     run_cape,
)
from dpneuro.protocol.cape.plans import NoisePlan, Variances, asymmetric_plan, plan_variances, symmetric_plan

__all__ = [
    "CapeAlgorithm",
    "NoisePlan",
    "ReleaseSpec",
    "Variances",
    "asymmetric_plan",
    "cape_protocol",
    "ledgers",
    "n_unique",
    "noise_variance",
    "pack",
    "plan_variances",
    "planned_ledgers",
    "record_release",
    "run_cape",
    "symmetric_plan",
    "unpack",
]
