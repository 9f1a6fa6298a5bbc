"""Lazy values of the simulation runtime.

A SERVER (or local) value that needs work is a `Thunk`; a CLIENTS value is a
`ClientsValue`: a small dataflow graph (sources, broadcasts, maps, zips) evaluated one
chunk of clients at a time, so a cohort is never materialized. Aggregations are
`Thunk`s too; the scheduler in `simulation.py` runs every aggregation that is ready in
one pass over the chunks (a "wave"), so client work shared by several aggregations
(model deltas and metrics of the same `federated_map`) runs once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from fedlang.core import types
from fedlang.runtime import chunks, reference

#: A value of the simulation runtime: as the interpreter's (`reference.Value`), but any
#: part may be a `Thunk` still to compute, and a CLIENTS value is a `ClientsValue`.
Value = Any
#: The chunk values computed for one chunk, by the id of their `ClientsValue` (a part
#: that several graphs share is computed once per chunk).
Cache = dict[int, chunks.ChunkValue]


class Thunk:
    """A value computed on first use from its dependencies."""

    def __init__(self, compute: Callable[[], Value], deps: tuple[Value, ...] = ()):
        self._compute = compute
        self.deps = deps
        self.done = False
        self._value: Value = None

    def get(self) -> Value:
        if not self.done:
            self._value = self._compute()
            self.done = True
            self._compute = None  # type: ignore[assignment]
            self.deps = ()
        return self._value


def force(value: Value) -> reference.Value:
    """The concrete internal value (forcing thunks, also inside structs)."""
    if isinstance(value, Thunk):
        return force(value.get())
    if isinstance(value, tuple) and any(_has_thunk(v) for v in value):
        return tuple(force(v) for v in value)
    return value


def _has_thunk(value: Value) -> bool:
    if isinstance(value, Thunk):
        return True
    return isinstance(value, tuple) and any(_has_thunk(v) for v in value)


def pending_thunks(value: Value) -> Iterator[Thunk]:
    """Unforced thunks a value (or a ClientsValue graph) depends on directly."""
    if isinstance(value, Thunk):
        if not value.done:
            yield value
    elif isinstance(value, tuple):
        for v in value:
            yield from pending_thunks(v)
    elif isinstance(value, ClientsValue):
        for dep in value.server_deps():
            yield from pending_thunks(dep)


class ClientsValue:
    """A lazily computed value at CLIENTS (`member` type per client)."""

    member: types.Type

    def chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        key = id(self)
        if key not in cache:
            cache[key] = self._chunk(start, stop, cache)
        return cache[key]

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        raise NotImplementedError

    def server_deps(self) -> list[Value]:
        """SERVER values (possibly thunks) this graph needs."""
        return [d for child in self.children() for d in child.server_deps()]

    def children(self) -> list[ClientsValue]:
        return []

    def sources(self) -> Iterator[Source]:
        for child in self.children():
            yield from child.sources()


class Source(ClientsValue):
    """Per-client values given by the caller (internal form, one entry per client).

    Client datasets can be staged ahead (pulled from their iterables into lists of
    batches) on a background thread; `staged` holds chunks prepared that way.
    """

    def __init__(self, values: list[chunks.Internal], member: types.Type):
        self.values = values
        self.member = member
        self.staged: dict[tuple[int, int], list[chunks.Internal]] = {}

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        staged = self.staged.pop((start, stop), None)
        values = staged if staged is not None else self.values[start:stop]
        return chunks.stack(values, self.member)

    def sources(self) -> Iterator[Source]:
        yield self


class Replicated(ClientsValue):
    """The same value at every client (a broadcast or `federated_value`)."""

    def __init__(self, value: Value, member: types.Type):
        self.value = value
        self.member = member

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        return chunks.Rep(force(self.value))

    def server_deps(self) -> list[Value]:
        return [self.value]


class Mapped(ClientsValue):
    """`fn` applied at each client; `apply(fn, chunk_value, c)` does the work."""

    def __init__(
        self,
        fn: reference.Function,
        input_: ClientsValue,
        member: types.Type,
        apply: Callable[[reference.Function, chunks.ChunkValue, int], chunks.ChunkValue],
    ):
        self.fn = fn
        self.input = input_
        self.member = member
        self._apply = apply

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        return self._apply(self.fn, self.input.chunk(start, stop, cache), stop - start)

    def children(self) -> list[ClientsValue]:
        return [self.input]


class Zipped(ClientsValue):
    """A struct of CLIENTS values seen as CLIENTS values of a struct."""

    def __init__(self, parts: Value, arg_type: types.Type, member: types.Type):
        self.parts = parts
        self.arg_type = arg_type
        self.member = member

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        return _zip_chunk(self.parts, self.arg_type, start, stop, cache)

    def children(self) -> list[ClientsValue]:
        out: list[ClientsValue] = []

        def walk(v: Value, t: types.Type) -> None:
            if isinstance(t, types.FederatedType):
                out.append(v)
            else:
                for x, et in zip(v, t.types):  # type: ignore[attr-defined]
                    walk(x, et)

        walk(self.parts, self.arg_type)
        return out


def _zip_chunk(v: Value, t: types.Type, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
    # A module-level function, not a closure: a recursive closure refers to itself and
    # would keep the chunk's `cache` (its staged client data) alive until a full GC.
    if isinstance(t, types.FederatedType):
        return v.chunk(start, stop, cache)
    return tuple(_zip_chunk(x, et, start, stop, cache) for x, et in zip(v, t.types))  # type: ignore[attr-defined]


class FromThunk(ClientsValue):
    """CLIENTS values computed whole by a thunk (a list per client): the slow fallback."""

    def __init__(self, thunk: Thunk, member: types.Type):
        self.thunk = thunk
        self.member = member

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        return chunks.stack(self.thunk.get()[start:stop], self.member)

    def server_deps(self) -> list[Value]:
        return [self.thunk]


class Counted(ClientsValue):
    """`fn()` evaluated at each client (`federated_eval` at CLIENTS); `call(fn, None)` runs it."""

    def __init__(self, fn: reference.Function, call: reference.Call, member: types.Type):
        self.fn = fn
        self.call = call
        self.member = member

    def _chunk(self, start: int, stop: int, cache: Cache) -> chunks.ChunkValue:
        return chunks.stack([self.call(self.fn, None) for _ in range(start, stop)], self.member)
