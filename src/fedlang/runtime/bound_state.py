"""Client-state bindings in the simulation and Ray runtimes: read and written by chunk.

A `ClientStates` binding (see `fedlang.core.client_state`) passed for a `{S}@CLIENTS`
parameter becomes a `StateSource`, a lazy CLIENTS value that reads each chunk's
states from the binding when the chunk is computed. When the computation declares
client state, its new-state result is not collected: a `StateWrite` accumulator
writes each chunk's new states to the binding as the wave computes them, so neither
the old nor the new states of a cohort are ever held at once. On Ray, each task reads
and writes through its own slice of the binding, on the worker; the driver only
merges counts. The invocation commits the binding when everything succeeded.
"""

from __future__ import annotations

import numpy as np

from fedlang.core import client_state, structure, types
from fedlang.runtime import accumulate, chunks, lazy


class StateSource(lazy.ClientsValue):
    """The states of a cohort, read from a binding one chunk at a time."""

    def __init__(self, binding: client_state.ClientStates, member: types.Type):
        self.binding = binding
        self.member = member

    def _chunk(self, start: int, stop: int, cache: lazy.Cache) -> chunks.ChunkValue:
        return structure.unflatten(self.binding.read(start, stop), self.member)


class StateWrite(accumulate.Accumulator):
    """Writes each chunk's new states to a binding; its result is the count written.

    Chunks arrive in client order (the wave's pass), so the offset of each is the sum
    of the sizes before it. Partials are counts: Ray tasks write on their workers and
    the driver adds what they report (merging needs no binding: `binding=None`).
    """

    def __init__(self, binding: client_state.ClientStates | None, member: types.Type):
        self.binding = binding
        self.member = member
        self.leaf_types = structure.leaf_types(member)
        self.count = 0

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        assert self.binding is not None, "a StateWrite made for merging cannot write"
        leaves, axes = chunks.leaves_with_axes(cv, self.member)
        stacked = [
            np.broadcast_to(np.asarray(x, lt.dtype), (c, *np.shape(x)))
            if axis is None else np.asarray(x, lt.dtype)
            for x, axis, lt in zip(leaves, axes, self.leaf_types)
        ]
        self.binding.write(self.count, self.count + c, stacked)
        self.count += c

    def result(self) -> int:
        return self.count

    @property
    def partial_type(self) -> types.Type:
        return types.TensorType(np.int64)

    def partial(self) -> accumulate.Partial:
        return np.int64(self.count)

    def merge(self, partial: accumulate.Partial) -> None:
        self.count += int(partial)


def as_source(value: client_state.ClientStates, t: types.FederatedType) -> StateSource:
    """The lazy CLIENTS value of a binding passed for a parameter of type `t`."""
    return StateSource(value, t.member)


def check_written(count: int, binding: client_state.ClientStates) -> None:
    """Refuses to commit unless every client of the cohort was written."""
    if count != len(binding):
        raise RuntimeError(
            f"Wrote the new client states of {count} clients of a cohort of {len(binding)}; "
            "nothing was committed. This is a bug in the runtime: please report it."
        )
