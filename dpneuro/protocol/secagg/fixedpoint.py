"""Fixed-point encoding of floats into the ring Z_{2^64}.

A value ``x`` becomes the integer ``round(x * 2**f)`` (two's complement in a
``uint64``), so sums of encoded values are plain ``uint64`` additions with
wraparound, which is what the masks need. Rounding is *stochastic*:
``floor(z)`` or ``floor(z) + 1`` with probabilities that make the encoding
unbiased, ``E[encode(x)] = x * 2**f``, so quantisation error does not
accumulate into a bias over many sites or rounds.

Values must lie in ``[-value_range, value_range]``; anything else, including
NaN and infinities, raises ``ValueError``. Nothing is clipped: a silently
clipped CAPE noise draw would break the zero-sum property without anybody
noticing.
"""

from __future__ import annotations

import math
import os
from fractions import Fraction

import numpy as np


def check_no_wrap(n_sites: int, value_range: float, frac_bits: int) -> None:
    """Refuse parameters for which a sum of ``n_sites`` encoded values could wrap.

    The decoded sum is exact (up to quantisation) as long as its magnitude is
    below ``2**63``, the two's-complement range of the ring. Each in-range
    value encodes to at most ``ceil(value_range * 2**frac_bits)``.

    Raises
    ------
    ValueError
        If ``n_sites * ceil(value_range * 2**frac_bits) > 2**63 - 1`` or a
        parameter is invalid.
    """
    if isinstance(frac_bits, bool) or not isinstance(frac_bits, (int, np.integer)) or not 0 <= frac_bits <= 62:
        raise ValueError(f"frac_bits must be an integer in [0, 62], got {frac_bits!r}")
    if not (isinstance(value_range, (int, float, np.floating, np.integer))
            and math.isfinite(value_range) and value_range > 0):
        raise ValueError(f"value_range must be a positive finite number, got {value_range!r}")
    per_value = math.ceil(Fraction(value_range) * 2**int(frac_bits))
    worst = int(n_sites) * per_value
    if worst > 2**63 - 1:
        max_sites = (2**63 - 1) // per_value
        raise ValueError(
            f"the sum of {n_sites} values of magnitude up to value_range={value_range} with "
            f"frac_bits={frac_bits} can reach {worst} >= 2**63 and wrap around in Z_2^64; "
            f"at most {max_sites} sites fit: lower value_range or frac_bits")


def _rng(rng: np.random.Generator | None) -> np.random.Generator:
    if rng is not None:
        return rng
    return np.random.default_rng(int.from_bytes(os.urandom(32), "little"))


def encode(
    x: np.ndarray, *, frac_bits: int, value_range: float, rng: np.random.Generator | None = None,
) -> np.ndarray:
    """Encode floats as ring elements with unbiased stochastic rounding.

    Parameters
    ----------
    x : array_like of float
        Values with ``|x| <= value_range``.
    frac_bits : int
        Scale is ``2**frac_bits``.
    value_range : float
        Bound on ``|x|``.
    rng : numpy.random.Generator, optional
        Source of the rounding randomness; a generator seeded from
        ``os.urandom`` by default.

    Returns
    -------
    numpy.ndarray of uint64
        Same shape as ``x``; negative values in two's complement.

    Raises
    ------
    ValueError
        If some values are non-finite or out of range; the message says how
        many and the largest magnitude.
    """
    check_no_wrap(1, value_range, frac_bits)
    a = np.asarray(x, dtype=np.float64)
    finite = np.isfinite(a)
    if not finite.all():
        n_bad = int(a.size - np.count_nonzero(finite))
        raise ValueError(f"cannot encode for secure aggregation: {n_bad} of {a.size} values are not finite "
                         "(NaN or infinite)")
    mag = np.abs(a)
    over = mag > value_range
    if over.any():
        raise ValueError(
            f"cannot encode for secure aggregation: {int(np.count_nonzero(over))} of {a.size} values exceed "
            f"value_range={value_range} (max |x| = {float(mag.max())!r}); values are never clipped, "
            "raise value_range in SecAggConfig or rescale the input")
    z = np.ldexp(a, int(frac_bits))  # exact: a power-of-two scaling
    low = np.floor(z)
    # round up with probability equal to the fractional part -> E[result] = z
    up = _rng(rng).random(a.shape) < (z - low)
    return (low + up).astype(np.int64).view(np.uint64)


def decode(y: np.ndarray, *, frac_bits: int) -> np.ndarray:
    """Map ring elements (two's complement) back to floats.

    Parameters
    ----------
    y : array_like of uint64
        Encoded values or their ring sum.
    frac_bits : int
        The scale used to encode.

    Returns
    -------
    numpy.ndarray of float64
    """
    a = np.asarray(y)
    if a.dtype != np.uint64:
        raise ValueError(f"expected a uint64 array of ring elements, got dtype {a.dtype}")
    return np.ldexp(a.view(np.int64).astype(np.float64), -int(frac_bits))
