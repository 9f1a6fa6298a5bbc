"""TensorFlow's stateless random normals, in NumPy: TFF's seeded initializations, ported.

TFF draws some initial values with `tf.random.stateless_normal(shape, seed)` (k-means
centroids: `build_fed_kmeans(..., random_seed=(a, b))`). To give the same values for
the same seed, this module transcribes what TensorFlow 2.14 runs on a CPU for it:

* `StatelessRandomGetKeyCounter` (`tensorflow/core/kernels/stateless_random_ops.cc`,
  `GenerateKey`): the seed pair, scrambled by one Philox call from a fixed key, gives
  the generator's key and counter;
* Philox-4x32-10 (`tensorflow/tsl/lib/random/philox_random.h`), one call per four
  outputs, its 128-bit counter incremented between calls;
* `NormalDistribution<PhiloxRandom, float>` (`random_distributions.h`): Box-Muller on
  each pair of 32-bit outputs, each turned into a float in [0, 1) from its low 23 bits.

The values agree with TensorFlow's to float32 rounding (a few units in the last place,
from the host's `log`/`sin`/`cos`), which `tests/learning/test_fed_kmeans.py` checks
against values TFF 0.87 computed. It runs on the host, once, when a process is built.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from numpy.typing import ArrayLike

_M32 = np.uint64(0xFFFFFFFF)
_PHILOX_M = (np.uint64(0xD2511F53), np.uint64(0xCD9E8D57))
_PHILOX_W = (np.uint64(0x9E3779B9), np.uint64(0xBB67AE85))
_SEED_KEY = (0x3EC8F720, 0x02461E29)  # GenerateKey's fixed key


def philox_4x32_10(counter: Sequence[ArrayLike], key: Sequence[ArrayLike]) -> list[np.ndarray]:
    """Ten Philox-4x32 rounds on counters given as four uint64 arrays of 32-bit words."""
    c = [np.asarray(x, np.uint64) for x in counter]
    k0, k1 = (np.asarray(x, np.uint64) for x in key)
    for _ in range(10):
        p0, p1 = _PHILOX_M[0] * c[0], _PHILOX_M[1] * c[2]
        c = [((p1 >> np.uint64(32)) ^ c[1] ^ k0) & _M32, p1 & _M32,
             ((p0 >> np.uint64(32)) ^ c[3] ^ k1) & _M32, p0 & _M32]
        k0, k1 = (k0 + _PHILOX_W[0]) & _M32, (k1 + _PHILOX_W[1]) & _M32
    return c


def _unit_float(x: np.ndarray) -> np.ndarray:
    """A 32-bit word as a float32 in [0, 1): its low 23 bits as the mantissa of [1, 2), minus 1."""
    bits = (np.uint64(0x7F << 23) | (x & np.uint64(0x7FFFFF))).astype(np.uint32)
    return bits.view(np.float32) - np.float32(1.0)


def stateless_normal(shape: Sequence[int], seed: Sequence[int]) -> np.ndarray:
    """`tf.random.stateless_normal(shape, seed, dtype=tf.float32)` as TensorFlow computes it
    on a CPU.

    Args:
      shape: the output's shape.
      seed: two integers (TF takes int32 or int64; negative values wrap as TF's casts do).

    Returns:
      A float32 array of standard normal values.

    Raises:
      ValueError: when `seed` is not two integers.
    """
    seed = tuple(seed)
    if len(seed) != 2 or not all(isinstance(s, int | np.integer) for s in seed):
        raise ValueError(f"Expected a seed of two integers, such as (1, 2), found {seed!r}.")
    s0, s1 = (int(s) & 0xFFFFFFFFFFFFFFFF for s in seed)
    words = [s0 & 0xFFFFFFFF, s0 >> 32, s1 & 0xFFFFFFFF, s1 >> 32]
    mix = [int(w) for w in philox_4x32_10([np.uint64(w) for w in words],
                                          [np.uint64(k) for k in _SEED_KEY])]
    n = int(np.prod(shape, dtype=np.int64))
    # The key is mix[0:2]; the counter starts at (0, 0, mix[2], mix[3]) and block i uses
    # counter + i (i < 2^64: the high words never carry).
    i = np.arange((n + 3) // 4, dtype=np.uint64)
    high = [np.full_like(i, mix[2]), np.full_like(i, mix[3])]
    x = philox_4x32_10([i & _M32, i >> np.uint64(32), *high], [np.uint64(mix[0]), np.uint64(mix[1])])
    out = np.empty([len(i), 4], np.float32)
    for j in (0, 2):
        u1 = np.maximum(_unit_float(x[j]), np.float32(1e-7))
        v1 = np.float32(2.0 * np.pi) * _unit_float(x[j + 1])
        radius = np.sqrt(np.float32(-2.0) * np.log(u1))
        out[:, j], out[:, j + 1] = np.sin(v1) * radius, np.cos(v1) * radius
    return out.reshape(-1)[:n].reshape(tuple(shape))
