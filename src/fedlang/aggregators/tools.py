"""Helpers shared by the aggregators: norms, PRNG keys carried in state, client counts.

Randomness in an aggregator is deterministic given its seed. The process state holds
a raw JAX PRNG key (`uint32[2]`); each round the server splits it into the next
state's key and a round key. Client values arrive without client ids, so where each
client needs its own randomness (stochastic rounding) it folds a hash of its own value
into the broadcast round key (`client_key`): two clients with bit-identical values in
the same round draw the same random numbers, which is harmless for unbiasedness.
"""

from __future__ import annotations

import os
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, types

KEY_TYPE = types.TensorType(np.uint32, [2])


def seed_key(seed: int | None) -> np.ndarray:
    """A raw PRNG key (`uint32[2]`) from `seed`; a fresh random one when `seed` is None."""
    if seed is None:
        seed = int.from_bytes(os.urandom(4), "little")
    if not isinstance(seed, int | np.integer) or isinstance(seed, bool):
        raise TypeError(f"Expected an integer seed (or None), found {seed!r}.")
    return np.asarray(jax.random.key_data(jax.random.key(int(seed) % 2**32)), np.uint32)


def wrap(key: Any) -> Any:
    """A typed JAX key from a raw `uint32[2]` key."""
    return jax.random.wrap_key_data(jnp.asarray(key, jnp.uint32))


def split(key: Any) -> tuple[Any, Any]:
    """`(next_state_key, round_key)`, both raw `uint32[2]`."""
    a, b = jax.random.split(wrap(key))
    return jax.random.key_data(a), jax.random.key_data(b)


def value_hash(tree: Any) -> Any:
    """A `uint32` hash of every bit of a pytree of tensors (wrapping integer arithmetic)."""
    h = jnp.uint32(0x9E3779B9)
    for i, leaf in enumerate(jax.tree.leaves(tree)):
        x = jnp.ravel(leaf)
        if x.dtype.itemsize == 4:
            bits = jax.lax.bitcast_convert_type(x, jnp.uint32)
        else:
            bits = x.astype(jnp.float32).view(jnp.uint32) if x.dtype.kind == "f" else x.astype(
                jnp.uint32
            )
        bits = bits ^ (bits >> 16)
        pos = jnp.arange(bits.shape[0], dtype=jnp.uint32) * jnp.uint32(2) + jnp.uint32(2 * i + 1)
        mixed = bits * jnp.uint32(0x45D9F3B) * pos
        h = (h ^ jnp.sum(mixed ^ (mixed >> 13), dtype=jnp.uint32)) * jnp.uint32(0x27D4EB2D)
    return h


def client_key(round_key: Any, value: Any) -> Any:
    """A typed key for one client: the round key with the hash of its value folded in."""
    return jax.random.fold_in(wrap(round_key), value_hash(value))


def global_norm(tree: Any) -> Any:
    """The global L2 norm of a pytree, in float32 (0 for an empty tree).

    Optax's `optax.tree.norm` (which `optax.global_norm` now forwards to, with a
    deprecation warning) on the leaves cast to float32, so trees mixing dtypes (e.g.
    bfloat16 and float32 weights) have a norm under strict dtype promotion.
    """
    return jnp.asarray(optax.tree.norm(jax.tree.map(lambda x: x.astype(jnp.float32), tree)),
                       jnp.float32)


def tree_scale(tree: Any, factor: Any) -> Any:
    """Every leaf multiplied by a scalar (cast to the leaf's dtype)."""
    return jax.tree.map(lambda x: (x * factor.astype(x.dtype)).astype(x.dtype), tree)


def gaussian_like(key: Any, tree: Any, stddev: Any) -> Any:
    """Independent N(0, stddev^2) noise with the structure of `tree` (one key per leaf)."""
    leaves, treedef = jax.tree.flatten(tree)
    noise = [
        (jax.random.normal(jax.random.fold_in(key, i), jnp.shape(x), jnp.float32) * stddev).astype(
            x.dtype
        )
        for i, x in enumerate(leaves)
    ]
    return jax.tree.unflatten(treedef, noise)


def count_clients(value: Any) -> Any:
    """`int32@SERVER`: how many clients hold `value` (a `{T}@CLIENTS` traced value)."""
    member = value.type_signature.member

    @jax_backend.jax_computation(member)
    def one(v):
        del v
        return jnp.int32(1)

    return operators.federated_sum(operators.federated_map(one, value))


def leaves_of(value: Any, t: types.Type) -> list[Any]:
    """JAX: the tensor leaves of a container value in the order of its type `t`
    (`jax.tree.leaves` sorts dict keys; fedlang types keep the declared order)."""
    from fedlang.core import structure

    return list(structure.flatten(structure.from_container(value, t), t))


def from_leaves(t: types.Type, leaves: list[Any]) -> Any:
    """JAX: leaves (in the order of `t`) back in the container structure of `t`."""
    from fedlang.core import structure

    return structure.to_container(structure.unflatten(list(leaves), t), t)


def zeros(t: types.Type, unknown_dim: int | None = None) -> Any:
    """Zeros of a local type as NumPy arrays, in the type's containers.

    Args:
      t: a struct of tensor types.
      unknown_dim: the size given to unknown (`?`) dimensions; None refuses them.

    Raises:
      TypeError: when a dimension is unknown and `unknown_dim` is None.
    """
    from fedlang.core import structure

    fill = 0 if unknown_dim is None else unknown_dim

    def shape(lt: types.TensorType) -> tuple[int, ...]:
        if None in lt.shape and unknown_dim is None:
            raise TypeError(f"Expected a type of fully known shape, found {lt} in {t}.")
        return tuple(fill if d is None else d for d in lt.shape)

    leaves = [np.zeros(shape(lt), lt.dtype) for lt in structure.leaf_types(t)]
    return structure.to_container(structure.unflatten(leaves, t), t)


def map_type(fn: Any, t: types.Type) -> types.Type:
    """The struct type `t` with each tensor leaf type `lt` replaced by `fn(lt)`."""
    if isinstance(t, types.StructType):
        return types.StructType([(n, map_type(fn, et)) for n, et in t.elements],
                                container=t.container)
    return fn(t)


def num_elements(value_t: types.Type) -> int:
    """The number of scalars in a local type of fully known shape."""
    leaf_types = cast("list[types.TensorType]", types.tensor_leaves(value_t))
    return int(sum(int(np.prod(cast("tuple[int, ...]", t.shape))) for t in leaf_types))


def check_number(name: str, x: Any, low: float = 0.0, strict: bool = False) -> float:
    """`float(x)` if it is a real number `>= low` (`> low` when strict), else an error.

    Raises:
      TypeError: when `x` is not a real number.
      ValueError: when it is out of range.
    """
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(f"Expected {name} to be a number, found {type(x).__name__} {x!r}.")
    v = float(x)
    if not np.isfinite(v) or v < low or (strict and v == low):
        raise ValueError(
            f"Expected {name} {'>' if strict else '>='} {low:g}, found {v!r}."
        )
    return v


def check_inner(f: Any, name: str = "inner") -> Any:
    """Checks an inner factory is an aggregation factory (weighted or not).

    Raises:
      TypeError: when it is not.
    """
    from fedlang.aggregators import factory

    if not isinstance(f, factory.UnweightedAggregationFactory | factory.WeightedAggregationFactory):
        raise TypeError(
            f"Expected {name} to be an aggregation factory (such as MeanFactory()), "
            f"found {type(f).__name__}."
        )
    return f
