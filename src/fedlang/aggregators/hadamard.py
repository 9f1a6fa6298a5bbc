"""The randomized Hadamard rotation, applied before quantization.

Rotating a vector by `H D / sqrt(n)` (`D` random signs, `H` the Walsh-Hadamard matrix)
spreads its energy evenly over the coordinates, so its min/max range shrinks and
uniform quantization loses less (Suresh et al., "Distributed Mean Estimation with
Limited Communication", 2017). The rotation is orthonormal, so the inverse is
`D H / sqrt(n)`. Vectors are zero-padded to a power of two.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp


def padded_size(n: int) -> int:
    """The smallest power of two >= n (at least 1)."""
    return 1 << max(0, (int(n) - 1).bit_length())


def fwht(x: Any) -> Any:
    """JAX: the orthonormal fast Walsh-Hadamard transform of a vector of length 2^k."""
    n = x.shape[0]
    k = n.bit_length() - 1
    if n != 1 << k:
        raise ValueError(f"Expected a length that is a power of two, found {n}.")
    y = x.reshape([2] * k) if k else x
    for axis in range(k):
        a = jnp.take(y, 0, axis=axis)
        b = jnp.take(y, 1, axis=axis)
        y = jnp.stack([a + b, a - b], axis=axis)
    return y.reshape(n) / jnp.sqrt(jnp.float32(n)).astype(x.dtype)


def _signs(key: Any, n: int) -> Any:
    return jnp.where(jax.random.bernoulli(key, 0.5, (n,)), 1.0, -1.0).astype(jnp.float32)


def rotate(x: Any, key: Any) -> Any:
    """JAX: the flattened, zero-padded `x` rotated by `H D / sqrt(n)` (`D` from `key`)."""
    flat = jnp.ravel(x).astype(jnp.float32)
    n = padded_size(flat.shape[0])
    flat = jnp.pad(flat, (0, n - flat.shape[0]))
    return fwht(flat * _signs(key, n))


def unrotate(y: Any, key: Any, size: int) -> Any:
    """JAX: the inverse of `rotate`, cropped to the first `size` entries (still flat)."""
    return (fwht(y) * _signs(key, y.shape[0]))[:size]
