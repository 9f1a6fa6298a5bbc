"""Chunk values: a slice of a cohort's values with a leading client axis.

A chunk value of member type `T` for `c` clients is:

* `Rep(v)`: the same internal value `v` at every client (a broadcast);
* for a tensor type: an array with leading axis `c`;
* for a struct type: a tuple of chunk values (fields may mix `Rep` and stacked);
* for a sequence or sparse type: a list of `c` per-client values (never stacked).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from fedlang.core import types

# The values the runtime passes around, named for readers. They alias `Any` (or a list
# of it): what a value holds follows its fedlang type, and the code reads the type.

#: A local value in fedlang's internal form (`fedlang.core.structure`): an array for a
#: tensor, a tuple for a struct, an iterable of batches for a sequence.
Internal = Any
#: The values of a chunk's clients (see the module docstring).
ChunkValue = Any
#: An array: NumPy's on the host, a `jax.Array` on a device.
Leaf = Any
#: A value's arrays in its type's leaf order (`structure.flatten`): what a local
#: program takes and returns (its arguments, state and results).
Leaves = list[Leaf]
#: One batch of a client's dataset as `Leaves` (with its mask, for a masked reduce).
Batch = list[Leaf]
#: A client's dataset as the runtime reads it: an iterable of batches in internal form
#: (a `structure.Stream`, a list, a stream staged ahead by the simulation runtime).
Stream = Any


@dataclasses.dataclass(frozen=True)
class Rep:
    """The same value at every client of a chunk."""

    value: Internal


def _is_listy(t: types.Type) -> bool:
    return isinstance(t, types.SequenceType | types.SparseTensorType | types.FunctionType)


def stack(values: list[Internal], t: types.Type) -> ChunkValue:
    """Per-client internal values -> a chunk value."""
    if isinstance(t, types.StructType):
        return tuple(stack([v[i] for v in values], et) for i, et in enumerate(t.types))
    if _is_listy(t):
        return list(values)
    if not values:
        return np.zeros((0, *[d or 0 for d in t.shape]), t.dtype)  # type: ignore[attr-defined]
    if len({np.shape(v) for v in values}) > 1:
        return list(values)  # ragged (unknown dimensions differ between clients): kept per client
    # Device arrays meet on the host: one transfer per client value, and np.stack is far
    # cheaper than a jnp.stack of many small arrays (accumulators work on the host anyway).
    # Into an aligned buffer, which a later CPU computation on the chunk reads in place.
    host = [np.asarray(v) for v in values]
    out = aligned_empty((len(host), *host[0].shape), host[0].dtype)
    return np.stack(host, out=out)


ALIGNMENT = 64  # bytes: XLA:CPU uses a host array of this alignment without copying it


def aligned_empty(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """An uninitialized array whose data is `ALIGNMENT`-aligned: `jax.device_put` (and a
    jitted call) on a CPU device then uses it in place; a misaligned array is copied
    first (27 ms for 100 MB here, against 0.1 ms)."""
    return _aligned(shape, dtype, np.empty)


def aligned_zeros(shape: tuple[int, ...], dtype: npt.DTypeLike) -> np.ndarray:
    """`np.zeros` in an aligned buffer (see `aligned_empty`); like `np.zeros`, large
    buffers come zeroed from the allocator, not written twice."""
    return _aligned(shape, dtype, np.zeros)


def _aligned(
    shape: tuple[int, ...], dtype: npt.DTypeLike, alloc: Callable[..., np.ndarray]
) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if nbytes < 1 << 16 or dtype.kind not in "biufc":
        return alloc(shape, dtype)  # small (a copy costs nothing), or strings and such
    raw = alloc(nbytes + ALIGNMENT, np.uint8)
    start = -raw.ctypes.data % ALIGNMENT
    return raw[start : start + nbytes].view(dtype).reshape(shape)


def row(cv: ChunkValue, t: types.Type, i: int) -> Internal:
    """Client `i`'s internal value from a chunk value."""
    if isinstance(cv, Rep):
        return cv.value
    if isinstance(t, types.StructType):
        return tuple(row(x, et, i) for x, et in zip(cv, t.types))
    return cv[i]


def unstack(cv: ChunkValue, t: types.Type, c: int) -> list[Internal]:
    """A chunk value -> per-client internal values."""
    return [row(cv, t, i) for i in range(c)]


def select(cv: ChunkValue, index: int) -> ChunkValue:
    """Field `index` of a struct chunk value."""
    if isinstance(cv, Rep):
        return Rep(cv.value[index])
    return cv[index]


def leaves_with_axes(cv: ChunkValue, t: types.Type) -> tuple[Leaves, list[int | None]]:
    """Flat tensor leaves of a chunk value, with vmap in_axes (None for `Rep`)."""
    from fedlang.core import structure

    if isinstance(cv, Rep):
        leaves = structure.flatten(cv.value, t)
        return leaves, [None] * len(leaves)
    if isinstance(t, types.StructType):
        out: Leaves = []
        axes: list[int | None] = []
        for x, et in zip(cv, t.types):
            lv, ax = leaves_with_axes(x, et)
            out += lv
            axes += ax
        return out, axes
    if _is_listy(t) or isinstance(cv, list):
        raise Ragged(f"A chunk of {t} values cannot be vectorized.")
    return [cv], [0]


class Ragged(TypeError):
    """A chunk holds per-client values that cannot be stacked into one array."""


def take(cv: ChunkValue, t: types.Type, index: list[int]) -> ChunkValue:
    """The clients at `index` (in that order) of a chunk value."""
    if isinstance(cv, Rep):
        return cv
    if isinstance(t, types.StructType):
        return tuple(take(x, et, index) for x, et in zip(cv, t.types))
    if isinstance(cv, list):
        return [cv[i] for i in index]
    return cv[np.asarray(index, dtype=np.int64)]
