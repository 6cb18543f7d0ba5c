"""Shamir t-of-n secret sharing over the prime field GF(2^521 - 1).

A secret ``s`` (a 32-byte value read as an integer) is the constant term of
a random polynomial ``f`` of degree ``t - 1``; party ``i`` (evaluation point
``x = i``, here ``site + 1``) gets ``f(i)``. Any ``t`` shares determine ``f``
and hence ``s = f(0)`` by Lagrange interpolation; any ``t - 1`` shares are
consistent with *every* secret, so they reveal nothing.

:func:`reconstruct_verified` also copes with wrong shares when more than
``t`` are available: it looks for a ``t``-subset whose reconstruction passes
a check (commitment or public key) and names the shares that disagree with it.
"""

from __future__ import annotations

import itertools
import math
import random
import secrets
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from dpneuro._utils.errors import DpneuroError

#: the Mersenne prime 2^521 - 1, comfortably larger than any 32-byte secret
PRIME = 2**521 - 1
#: bytes needed for one share (a field element)
SHARE_BYTES = (PRIME.bit_length() + 7) // 8  # 66


class ShamirError(DpneuroError, ValueError):
    """Shares are too few, malformed, or do not reconstruct a valid secret."""


def split(secret: int, n: int, t: int) -> list[int]:
    """Split ``secret`` into ``n`` shares, any ``t`` of which reconstruct it.

    Parameters
    ----------
    secret : int
        ``0 <= secret < PRIME``.
    n, t : int
        Number of shares and threshold, ``1 <= t <= n``.

    Returns
    -------
    list of int
        ``shares[i]`` is the polynomial evaluated at ``x = i + 1``.
    """
    if not 0 <= secret < PRIME:
        raise ValueError("secret must be in [0, PRIME)")
    if not 1 <= t <= n:
        raise ValueError(f"need 1 <= t <= n, got t={t}, n={n}")
    coeffs = [secret] + [secrets.randbelow(PRIME) for _ in range(t - 1)]
    shares = []
    for x in range(1, n + 1):
        acc = 0
        for c in reversed(coeffs):  # Horner
            acc = (acc * x + c) % PRIME
        shares.append(acc)
    return shares


def interpolate(points: Mapping[int, int], at: int = 0) -> int:
    """Evaluate at ``at`` the unique polynomial of degree < len(points) through ``points``.

    Parameters
    ----------
    points : mapping int -> int
        Evaluation point ``x`` (distinct, non-zero mod PRIME) to share value.
    at : int
        Where to evaluate; 0 gives the secret.
    """
    xs = list(points)
    if len(set(x % PRIME for x in xs)) != len(xs):
        raise ShamirError("duplicate evaluation points")
    total = 0
    for i in xs:
        num, den = 1, 1
        for j in xs:
            if j != i:
                num = num * (at - j) % PRIME
                den = den * (i - j) % PRIME
        total = (total + points[i] * num * pow(den, -1, PRIME)) % PRIME
    return total


def reconstruct(points: Mapping[int, int]) -> int:
    """The secret ``f(0)`` from shares ``{x: f(x)}`` (all of them are used)."""
    if not points:
        raise ShamirError("no shares to reconstruct from")
    return interpolate(points, 0)


@dataclass(frozen=True)
class Recovery:
    """Outcome of :func:`reconstruct_verified`.

    Attributes
    ----------
    secret : int
        The reconstructed secret (it passed the check).
    used : tuple of int
        Evaluation points of the ``t`` shares it was reconstructed from.
    bad : tuple of int
        Evaluation points whose shares disagree with the reconstructed
        polynomial (wrong shares); empty if all agree.
    """

    secret: int
    used: tuple[int, ...]
    bad: tuple[int, ...]


def _consistent(points: Mapping[int, int], basis: Mapping[int, int]) -> tuple[int, ...]:
    """Points (not in ``basis``) whose value disagrees with the polynomial through ``basis``."""
    return tuple(x for x in sorted(points) if x not in basis and interpolate(basis, x) != points[x] % PRIME)


def reconstruct_verified(
    points: Mapping[int, int], t: int, check: Callable[[int], bool], *, max_tries: int = 5000,
) -> Recovery:
    """Reconstruct a secret that must pass ``check``, tolerating wrong shares.

    With exactly ``t`` shares a failed check cannot say which share is wrong.
    With more, ``t``-subsets are tried (all of them if there are at most
    ``max_tries``, otherwise ``max_tries`` random ones) until one
    reconstructs a secret passing ``check``; shares off that polynomial are
    reported as bad.

    Parameters
    ----------
    points : mapping int -> int
        Evaluation point to share value.
    t : int
        Threshold (polynomial degree + 1).
    check : callable
        ``check(secret) -> bool``, e.g. compares a hash with a commitment.
    max_tries : int
        Budget of ``t``-subsets to try.

    Returns
    -------
    Recovery

    Raises
    ------
    ShamirError
        With fewer than ``t`` shares, or if no tried subset passes the check.
    """
    pts = {int(x): int(y) % PRIME for x, y in points.items()}
    if len(pts) < t:
        raise ShamirError(f"{len(pts)} shares given, {t} needed")
    xs = sorted(pts)
    n_subsets = math.comb(len(xs), t)
    if n_subsets <= max_tries:
        subsets = itertools.combinations(xs, t)
    else:
        # deterministic sampling keeps the failure reproducible for a given input
        sampler = random.Random(0)
        subsets = (tuple(sorted(sampler.sample(xs, t))) for _ in range(max_tries))
    for subset in subsets:
        basis = {x: pts[x] for x in subset}
        secret = interpolate(basis, 0)
        if check(secret):
            return Recovery(secret=secret, used=subset, bad=_consistent(pts, basis))
        if len(xs) == t:
            break
    raise ShamirError(
        f"no {t} of the {len(xs)} shares (points {xs}) reconstruct a secret that passes the check"
        + ("; with exactly t shares the wrong one cannot be identified" if len(xs) == t else ""))


def to_bytes(value: int) -> bytes:
    """A share (field element) as :data:`SHARE_BYTES` big-endian bytes."""
    return int(value).to_bytes(SHARE_BYTES, "big")


def from_bytes(data: bytes) -> int:
    """Inverse of :func:`to_bytes`; rejects values outside the field."""
    if len(data) != SHARE_BYTES:
        raise ShamirError(f"a share is {SHARE_BYTES} bytes, got {len(data)}")
    value = int.from_bytes(data, "big")
    if value >= PRIME:
        raise ShamirError("share value is not a field element")
    return value
