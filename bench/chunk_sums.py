"""What aggregating a chunk of large client updates costs on a CPU, by the two paths.

A chunk of 8 updates of the FedAvg-paper CNN's dense layer (8 x 3136 x 512 float32,
51 MB) is summed and weight-summed over the clients' axis by XLA:CPU (`jnp.sum`,
`jnp.tensordot`, the accumulators' path before) and by NumPy (`np.add.reduce`,
`np.tensordot`, their path now for host float chunks), and handed to JAX as a NumPy
array that is 64-byte aligned (`chunks.aligned_empty`) or not (`np.stack`'s buffer).
Best of 5 runs each, in ms.

Usage: python bench/chunk_sums.py [--clients 8]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from typing import Any


def best_ms(fn: Callable[[], Any], repeats: int = 5) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1e3


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--clients", type=int, default=8)
    args = parser.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from fedlang.runtime import chunks

    rng = np.random.default_rng(0)
    shape = (args.clients, 3136, 512)
    misaligned = np.stack([rng.random(shape[1:], dtype=np.float32) for _ in range(shape[0])])
    aligned = chunks.aligned_empty(shape, np.float32)
    aligned[:] = misaligned
    w = rng.random(shape[0]).astype(np.float32)
    cpu = jax.devices("cpu")[0]
    rows = {
        "sum, XLA:CPU (jnp.sum of the host chunk)": lambda: np.asarray(
            jnp.sum(jnp.asarray(misaligned), axis=0)
        ),
        "sum, NumPy (np.add.reduce)": lambda: np.add.reduce(misaligned, axis=0),
        "weighted sum, XLA:CPU (jnp.tensordot)": lambda: np.asarray(
            jnp.tensordot(jnp.asarray(w), jnp.asarray(misaligned), axes=1)
        ),
        "weighted sum, NumPy (np.tensordot)": lambda: np.tensordot(w, misaligned, axes=1),
        "device_put, misaligned host array": lambda: jax.device_put(misaligned, cpu).block_until_ready(),
        "device_put, 64-byte aligned host array": lambda: jax.device_put(aligned, cpu).block_until_ready(),
    }
    print(f"chunk of {shape[0]} updates of {shape[1]}x{shape[2]} float32 "
          f"({misaligned.nbytes / 1e6:.0f} MB), misaligned by {misaligned.ctypes.data % 64} bytes")
    out = {}
    for name, fn in rows.items():
        out[name] = best_ms(fn)
        print(f"  {name:45s} {out[name]:8.2f} ms")
    return out


if __name__ == "__main__":
    main()
