"""Shamir secret sharing over the prime field GF(2**256 + 297).

A secret `s` (a 32-byte key or seed, read as an integer below 2**256) is the constant
term of a random polynomial of degree `threshold - 1`; holder `x` (an integer >= 1) gets
the point `(x, f(x))`. Any `threshold` points give back `s` by Lagrange interpolation at
zero; fewer reveal nothing about it (every secret is equally likely given them). The
prime is the smallest above 2**256, so every 32-byte secret is a field element. Python
integers do the arithmetic; the coefficients come from the operating system's CSPRNG.

Example:
  >>> points = list(zip([1, 2, 3], share(1234, [1, 2, 3], threshold=2)))
  >>> reconstruct(points[1:], threshold=2)
  1234
"""

from __future__ import annotations

import functools
import secrets
from collections.abc import Sequence

PRIME = (1 << 256) + 297
SHARE_BYTES = 33  # a field element, big-endian
SECRET_BYTES = 32


def share(secret: int, xs: Sequence[int], threshold: int) -> list[int]:
    """Splits `secret` into one share per holder `xs[i]`; any `threshold` rebuild it.

    Raises:
      ValueError: if the secret is not a field element, the holders are not distinct
        integers in [1, PRIME), or the threshold is not in [1, len(xs)].
    """
    if not 0 <= secret < PRIME:
        raise ValueError(f"Expected a secret in [0, 2**256 + 297), found {secret}.")
    _check_xs(xs)
    if not 1 <= threshold <= len(xs):
        raise ValueError(
            f"Expected a threshold between 1 and the {len(xs)} holders, found {threshold}."
        )
    coefficients = [secrets.randbelow(PRIME) for _ in range(threshold - 1)]
    out = []
    for x in xs:
        y = 0
        for c in reversed(coefficients):
            y = (y + c) * x % PRIME
        out.append((y + secret) % PRIME)
    return out


def reconstruct(points: Sequence[tuple[int, int]], threshold: int) -> int:
    """Rebuilds the secret from at least `threshold` points `(x, y)`.

    With more than `threshold` points, the first and the last `threshold` of them (by x)
    are interpolated separately and must agree, so a single wrong share is detected
    whenever a spare share exists.

    Raises:
      ValueError: too few points, repeated or out-of-range x, y outside the field, or
        shares that do not lie on one polynomial of degree `threshold - 1`.
    """
    if threshold < 1 or len(points) < threshold:
        raise ValueError(
            f"Expected at least {threshold} shares to reconstruct a secret, found {len(points)}."
        )
    ordered = sorted(points)
    _check_xs([x for x, _ in ordered])
    for x, y in ordered:
        if not 0 <= y < PRIME:
            raise ValueError(f"Expected a share value in the field, found {y} for holder {x}.")
    secret = _interpolate_at_zero(ordered[:threshold])
    if len(ordered) > threshold and _interpolate_at_zero(ordered[-threshold:]) != secret:
        raise ValueError(
            "Expected shares that lie on one polynomial, found inconsistent shares: at least "
            "one holder sent a wrong share."
        )
    return secret


def encode(y: int) -> bytes:
    """A share value as SHARE_BYTES big-endian bytes."""
    return y.to_bytes(SHARE_BYTES, "big")


def decode(data: bytes) -> int:
    """Reads a share value written by `encode`.

    Raises:
      ValueError: wrong length, or a value outside the field.
    """
    if len(data) != SHARE_BYTES:
        raise ValueError(f"Expected a {SHARE_BYTES}-byte share, found {len(data)} bytes.")
    y = int.from_bytes(data, "big")
    if y >= PRIME:
        raise ValueError("Expected a share value in the field, found one above the prime.")
    return y


def _check_xs(xs: Sequence[int]) -> None:
    if len(set(xs)) != len(xs) or any(not 1 <= x < PRIME for x in xs):
        raise ValueError(f"Expected distinct holder indices >= 1, found {list(xs)[:10]}.")


def _interpolate_at_zero(points: Sequence[tuple[int, int]]) -> int:
    weights = _lagrange_at_zero(tuple(x for x, _ in points))
    return sum(w * y for w, (_, y) in zip(weights, points)) % PRIME


@functools.lru_cache(maxsize=256)
def _lagrange_at_zero(xs: tuple[int, ...]) -> tuple[int, ...]:
    # l_i(0) = prod_{j != i} x_j / (x_j - x_i). Servers rebuild many secrets from the same
    # holders (a whole complete graph shares one set), so the weights are cached; the
    # denominators are inverted together (one modular inversion for all of them).
    nums, dens = [], []
    for i, xi in enumerate(xs):
        num, den = 1, 1
        for j, xj in enumerate(xs):
            if j != i:
                num = num * xj % PRIME
                den = den * (xj - xi) % PRIME
        nums.append(num)
        dens.append(den)
    return tuple(n * d % PRIME for n, d in zip(nums, _batch_inverse(dens)))


def _batch_inverse(values: list[int]) -> list[int]:
    # Montgomery's trick: prefix products, one inversion, then walk back.
    prefix, acc = [], 1
    for v in values:
        prefix.append(acc)
        acc = acc * v % PRIME
    inv = pow(acc, -1, PRIME)
    out = [0] * len(values)
    for i in range(len(values) - 1, -1, -1):
        out[i] = inv * prefix[i] % PRIME
        inv = inv * values[i] % PRIME
    return out
