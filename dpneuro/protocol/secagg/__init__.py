"""Secure aggregation: sums over sites in which the aggregator sees only the total.

Bonawitz et al. (2017) for honest-but-curious parties, as used by CAPE
([capeDJICA] App. B-A): X25519 key agreement, ChaCha20 pairwise and self masks in the
ring Z_{2^64}, Shamir t-of-S shares over GF(2^521 - 1) so that up to S - t
sites may drop out, and fixed-point encoding with stochastic rounding.

Typical use inside a protocol::

    cfg = SecAggConfig(n_sites=S)
    phases = setup_phases(cfg)                            # once per run
    phases += sum_phases(cfg, "noise", "_noise", on_sum)  # per secure sum of each site's state["_noise"]

A secret shared by the sites only (the aggregator relays it encrypted) can be
agreed right after the setup with ``group_secret_phase(cfg)``; each site then
reads it with ``group_secret(state, broadcast)``.
"""

from dpneuro.protocol.secagg.config import DEFAULT_FRAC_BITS, DEFAULT_VALUE_RANGE, SecAggConfig, min_threshold
from dpneuro.protocol.secagg.errors import SecAggDropped, SecAggError, SecAggWarning
from dpneuro.protocol.secagg.fixedpoint import check_no_wrap, decode, encode
from dpneuro.protocol.secagg.phases import group_secret, group_secret_phase, setup_phases, sum_phases
from dpneuro.protocol.secagg.shamir import PRIME, ShamirError

__all__ = [
    "DEFAULT_FRAC_BITS",
    "DEFAULT_VALUE_RANGE",
    "PRIME",
    "SecAggConfig",
    "SecAggDropped",
    "SecAggError",
    "SecAggWarning",
    "ShamirError",
    "check_no_wrap",
    "decode",
    "encode",
    "group_secret",
    "group_secret_phase",
    "min_threshold",
    "setup_phases",
    "sum_phases",
]
