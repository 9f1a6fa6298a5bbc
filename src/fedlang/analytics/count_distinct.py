"""Count distinct with HyperLogLog sketches merged by `federated_max`.

Flajolet, Fusy, Gandouet & Meunier, "HyperLogLog: the analysis of a near-optimal
cardinality estimation algorithm" (2007). Each client hashes its items to 32 bits
(`strings.hash_bytes` for strings, MurmurHash3's finalizer for integers); the top
`precision` bits pick one of `m = 2**precision` registers, which keeps the largest
"position of the first 1 bit" of the remaining bits. Registers merge by maximum, so the
clients' sketches are combined with `federated_max`, and the server estimates
`alpha_m m^2 / sum_j 2^-M[j]` (with linear counting when many registers are empty).
The relative standard error is about `1.04 / sqrt(m)`: 0.8% with `2**14` registers.
Duplicates, within a client or across clients, count once.

No DP: a register is a maximum, one client's value; the sketch is released as is.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.analytics import data
from fedlang.backends.jax import computation as jax_backend
from fedlang.backends.jax import strings
from fedlang.core import computation, operators, tracing, types

HASH_SEED = 0x411


def _check_precision(precision: int) -> int:
    if isinstance(precision, bool) or not isinstance(precision, int) or not 4 <= precision <= 18:
        raise ValueError(f"Expected precision to be an integer in [4, 18], found {precision!r}.")
    return precision


def _registers(h: Any, keep: Any, precision: int) -> tuple[Any, Any]:
    """Register index and rank (`1 + leading zeros` of the rest) of 32-bit hashes."""
    index = (h >> (32 - precision)).astype(jnp.int32)
    rest = (h << precision) | jnp.uint32(1 << (precision - 1))  # caps the rank at 33 - p
    rank = jax.lax.clz(rest).astype(jnp.int32) + 1
    return index, jnp.where(keep, rank, 0)


def int_hash(x: Any) -> Any:
    """A 32-bit hash of integers (MurmurHash3's `fmix32` of the value and the seed)."""
    h = x.astype(jnp.uint32) ^ jnp.uint32(HASH_SEED)
    h = (h ^ (h >> 16)) * jnp.uint32(0x85EBCA6B)
    h = (h ^ (h >> 13)) * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def build_count_distinct(
    precision: int = 14, *, max_len: int | None = None
) -> computation.Computation:
    """The federated count distinct.

    Type signature: `({sequence<int32[?]>}@CLIENTS -> <estimate=float32,
    registers=int32[2**precision]>@SERVER)` for integer items, or with
    `sequence<<bytes=uint8[?,max_len],length=int32[?]>>` (strings encoded by
    `data.encode_clients`) when `max_len` is given.
    """
    p = _check_precision(precision)
    m = 2**p
    seq_t = data.number_type(np.int32) if max_len is None else data.string_type(max_len)
    reg_t = types.TensorType(np.int32, [m])

    @jax_backend.jax_computation(seq_t, result_type=reg_t)
    def client_registers(dataset):
        def step(state, batch, mask):
            if max_len is None:
                h = int_hash(batch)
            else:
                h = strings.hash_bytes(batch["bytes"], batch["length"], HASH_SEED)
            index, rank = _registers(h, mask > 0, p)
            return state.at[index].max(rank)

        return dataset.reduce(jnp.zeros(m, jnp.int32), step, masked=True)

    alpha = 0.7213 / (1 + 1.079 / m)

    @jax_backend.jax_computation(reg_t)
    def estimate(registers):
        regs = jnp.maximum(registers, 0)  # no clients: federated_max's empty value
        raw = alpha * m * m / jnp.sum(jnp.exp2(-regs.astype(jnp.float32)))
        zeros = jnp.sum(regs == 0).astype(jnp.float32)
        linear = m * jnp.log(m / jnp.maximum(zeros, 1.0))
        est = jnp.where((raw <= 2.5 * m) & (zeros > 0), linear, raw)
        return {"estimate": est, "registers": regs}

    @tracing.federated_computation(types.type_at_clients(seq_t))
    def run(datasets):
        merged = operators.federated_max(operators.federated_map(client_registers, datasets))
        return operators.federated_map(estimate, merged)

    return run


def count_distinct(
    client_items: Sequence[Any], precision: int = 14, *, max_len: int = 32
) -> float:
    """The estimated number of distinct items over all clients (one list per client of
    `str` items, or of integers).

    Example:
      >>> round(count_distinct([[1, 2, 3], [3, 4], []]))
      4
    """
    items = [list(c) for c in client_items]
    is_text = any(isinstance(x, str) for c in items for x in c)
    if is_text:
        comp = build_count_distinct(precision, max_len=max_len)
        out = comp(data.encode_clients(items, max_len).datasets)
    else:
        comp = build_count_distinct(precision)
        out = comp([data.number_batches(c, np.int32) for c in items])
    return float(out["estimate"])
