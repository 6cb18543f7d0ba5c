"""Parameters of one secure-aggregation run."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from dpneuro.protocol.secagg import fixedpoint

#: default bound on |x| for every value a site contributes
DEFAULT_VALUE_RANGE = 2.0**20
#: default fixed-point resolution: 2**-32 ~ 2.3e-10
DEFAULT_FRAC_BITS = 32


def min_threshold(n_sites: int) -> int:
    """Smallest allowed Shamir threshold for ``n_sites`` sites: ``floor(2 S / 3) + 1``."""
    return (2 * int(n_sites)) // 3 + 1


@dataclass(frozen=True)
class SecAggConfig:
    """What all parties of a secure-aggregation run agree on beforehand.

    Parameters
    ----------
    n_sites : int
        Number of sites S in the consortium (site ids ``0 .. S-1``), at least 2.
    threshold : int, optional
        Shamir threshold t: any t surviving sites can unmask the sum, fewer
        learn nothing. Defaults to, and may not be below, ``floor(2S/3) + 1``
        ([capeDJICA] App. B-A); at most S. Up to ``S - t`` sites may drop out.
    value_range : float
        Every value a site contributes must satisfy ``|x| <= value_range``;
        anything else is an error (values are never clipped).
    frac_bits : int
        Fixed-point resolution: values are stored as integers in units of
        ``2**-frac_bits`` in the ring Z_{2^64}.
    run_id : str
        Label of the run, mixed into every derived key (defence in depth:
        the key pairs are fresh per run anyway).

    Raises
    ------
    ValueError
        If the threshold is outside ``[floor(2S/3)+1, S]``, S < 2, or the
        sum of S values of magnitude ``value_range`` could wrap around in
        the ring (``S * value_range * 2**frac_bits >= 2**63``).

    Notes
    -----
    The defaults (``value_range = 2**20``, ``frac_bits = 32``) give an
    absolute resolution of 2.3e-10 (relative ~1e-9 or better for values of
    order 1-100) and admit up to 2047 sites: ``2047 * 2**52 < 2**63``.
    """

    n_sites: int
    threshold: int | None = None
    value_range: float = DEFAULT_VALUE_RANGE
    frac_bits: int = DEFAULT_FRAC_BITS
    run_id: str = ""

    def __post_init__(self) -> None:
        s = self.n_sites
        if isinstance(s, bool) or not isinstance(s, (int, np.integer)):
            raise ValueError(f"n_sites must be an integer, got {s!r}")
        if s < 2:
            raise ValueError(f"secure aggregation needs at least 2 sites, got n_sites={s}: "
                             "the 'sum' over a single site is that site's input")
        t_min = min_threshold(s)
        t = t_min if self.threshold is None else self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise ValueError(f"threshold must be an integer, got {t!r}")
        if t < t_min:
            raise ValueError(
                f"threshold {t} is too low for {s} sites: it must be at least floor(2S/3) + 1 = {t_min}, "
                "otherwise a minority of sites together with the aggregator could reconstruct a site's "
                "secrets and unmask its input")
        if t > s:
            raise ValueError(f"threshold {t} exceeds the number of sites {s}")
        object.__setattr__(self, "n_sites", int(s))
        object.__setattr__(self, "threshold", int(t))
        fixedpoint.check_no_wrap(int(s), self.value_range, self.frac_bits)
        if not isinstance(self.run_id, str):
            raise ValueError(f"run_id must be a string, got {self.run_id!r}")

    @property
    def max_dropouts(self) -> int:
        """How many sites may drop out while a sum can still be unmasked."""
        return self.n_sites - self.threshold

    @property
    def quantum(self) -> float:
        """Fixed-point resolution ``2**-frac_bits``."""
        return math.ldexp(1.0, -self.frac_bits)

    def encode(self, x: np.ndarray, rng: np.random.Generator | None = None) -> np.ndarray:
        """Encode floats into the ring; see :func:`dpneuro.protocol.secagg.fixedpoint.encode`."""
        return fixedpoint.encode(x, frac_bits=self.frac_bits, value_range=self.value_range, rng=rng)

    def decode(self, y: np.ndarray) -> np.ndarray:
        """Decode ring elements (e.g. a sum) to floats; see :func:`dpneuro.protocol.secagg.fixedpoint.decode`."""
        return fixedpoint.decode(y, frac_bits=self.frac_bits)
