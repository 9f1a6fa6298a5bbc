"""What a wave of the Ray runtime looks like on the wire, and the actor that runs it.

The driver turns a wave's lazy client dataflow (bound to its run, holding the whole
cohort's values) into a portable description (`WaveSpec`: `SourceSpec`, `RepSpec`, ...
nodes and `AggSpec` aggregations), pickled once per wave. Local computations inside it
are pickled by reference (`Registry`: a token, the computation itself sent once per
context); each task carries only its clients' slice of the per-client values. A
`Worker` (a Ray actor) rebuilds the graph over its slice, bound to its own run of the
simulation runtime, accumulates its clients and returns the partial aggregates.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import socket
import sys
import time
import uuid
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeAlias, TypeGuard

from fedlang.core import client_state, ir, local, structure, types
from fedlang.runtime import (
    accumulate,
    bound_state,
    chunks,
    counters,
    lazy,
    reference,
    simulation,
)

if TYPE_CHECKING:
    import ray  # for annotations only: Ray is imported where it is used

#: A reference to a value in Ray's object store.
ObjectRef: TypeAlias = "ray.ObjectRef"
#: The object references of the local computations a wave refers to, by token.
FunctionRefs = dict[str, ObjectRef]
#: Called on the worker with the task's index before each task, and with -1 before
#: each merge (`RayContext`'s `task_hook`).
Hook = Callable[[int], None]

# -- the portable form of a wave --------------------------------------------------------
#
# A wave's CLIENTS values are a graph of `lazy` nodes bound to the driver's run (and
# holding the whole cohort's data); a worker rebuilds the same graph, bound to its own
# run, over its task's slice of the per-client values.


@dataclasses.dataclass
class SourceSpec:
    index: int  # into the task's slices
    member: types.Type


@dataclasses.dataclass
class StateSourceSpec:
    index: int  # into the task's slices: the task's slice of a client-state binding
    member: types.Type


@dataclasses.dataclass
class RepSpec:
    value: reference.Value
    member: types.Type


@dataclasses.dataclass
class MapSpec:
    fn: reference.Function
    input: NodeSpec
    member: types.Type


@dataclasses.dataclass
class ZipSpec:
    parts: Parts
    arg_type: types.Type
    member: types.Type


@dataclasses.dataclass
class CountSpec:
    fn: reference.Function
    member: types.Type


#: A CLIENTS value of a wave in portable form (a node of its dataflow graph).
NodeSpec = SourceSpec | StateSourceSpec | RepSpec | MapSpec | ZipSpec | CountSpec
#: A struct of CLIENTS values in portable form: a `NodeSpec` where its type is federated,
#: else a tuple of `Parts` (an alias of `Any`: the type says which).
Parts = Any


@dataclasses.dataclass
class AggSpec:
    uri: str | None  # None: collect the per-client values (in client order)
    parameter_type: types.Type | None
    server_args: accumulate.ServerArgs
    member: types.Type
    write: int | None = None  # the task's client-state binding (a slice index) to write to


@dataclasses.dataclass
class WaveSpec:
    key: str
    inputs: list[NodeSpec]
    aggregations: list[AggSpec]
    options: simulation.Options
    hook: Hook | None


class NotPortable(Exception):
    """A wave refers to driver-side values a worker cannot receive (it runs locally)."""


class Portable:
    """Turns a wave's lazy graph into `WaveSpec` nodes and collects its sources."""

    def __init__(self) -> None:
        self.sources: list[reference.PerClient] = []
        self.source_types: list[types.Type] = []
        self._memo: dict[int, NodeSpec] = {}
        self._source_index: dict[int, int] = {}

    def node(self, v: lazy.ClientsValue) -> NodeSpec:
        key = id(v)
        if key not in self._memo:
            self._memo[key] = self._node(v)
        return self._memo[key]

    def _node(self, v: lazy.ClientsValue) -> NodeSpec:
        if isinstance(v, lazy.Source):
            return SourceSpec(self._source(v.values, v.member), v.member)
        if isinstance(v, bound_state.StateSource):
            return StateSourceSpec(self._source(v.binding, v.member), v.member)
        if isinstance(v, lazy.FromThunk):
            return SourceSpec(self._source(v.thunk.get(), v.member), v.member)
        if isinstance(v, lazy.Replicated):
            return RepSpec(self.value(lazy.force(v.value)), v.member)
        if isinstance(v, lazy.Mapped):
            return MapSpec(self.value(v.fn), self.node(v.input), v.member)
        if isinstance(v, lazy.Zipped):
            return ZipSpec(self._parts(v.parts, v.arg_type), v.arg_type, v.member)
        if isinstance(v, lazy.Counted):
            return CountSpec(self.value(v.fn), v.member)
        raise NotPortable(f"{type(v).__name__} values have no portable form")

    def _source(self, values: reference.PerClient, member: types.Type) -> int:
        if id(values) not in self._source_index:
            self._source_index[id(values)] = len(self.sources)
            self.sources.append(values)
            self.source_types.append(member)
        return self._source_index[id(values)]

    def _parts(self, v: lazy.Value, t: types.Type) -> Parts:
        if isinstance(t, types.FederatedType):
            return self.node(v)
        return tuple(self._parts(x, et) for x, et in zip(v, t.types))  # type: ignore[attr-defined]

    def value(self, v: lazy.Value) -> reference.Value:
        """A server value or function as workers receive it."""
        v = lazy.force(v)
        if isinstance(v, lazy.ClientsValue):
            raise NotPortable("a CLIENTS value is captured by a function")
        if isinstance(v, tuple):
            return tuple(self.value(x) for x in v)
        if isinstance(v, reference.Closure):
            free = ir.free_references(v.fn)
            return reference.Closure(v.fn, {k: self.value(v.env[k]) for k in free if k in v.env})
        return v


def aggregation_spec(a: simulation.AggThunk, portable: Portable) -> AggSpec:
    if a.writes is not None:  # new client states: each task writes its own clients'
        return AggSpec(None, None, (), a.input.member, portable._source(a.writes, a.input.member))
    if a.spec is None:
        return AggSpec(None, None, (), a.input.member)
    d, t, server_args = a.spec
    return AggSpec(d.uri, t, tuple(lazy.force(server_args)), a.input.member)


# -- pickling local computations by reference -------------------------------------------


class Registry:
    """The driver's local computations, each sent to the Ray object store once.

    A wave's description refers to a local computation by a token; an actor unpickles
    each computation once and keeps it (with the programs it compiled) across rounds.
    """

    def __init__(self) -> None:
        # id -> (fn, token, ref, bytes)
        self.by_id: dict[int, tuple[local.LocalComputation, str, ObjectRef, int]] = {}
        self._is_local: dict[type, bool] = {}

    def is_local(self, obj: object) -> TypeGuard[local.LocalComputation]:
        t = type(obj)
        if t not in self._is_local:
            self._is_local[t] = local.is_local(obj)
        return self._is_local[t]

    def token(self, fn: local.LocalComputation) -> tuple[str, int]:
        """(token, bytes newly sent) of a local computation."""
        entry = self.by_id.get(id(fn))
        if entry is not None:
            return entry[1], 0
        import ray
        from ray import cloudpickle

        data = cloudpickle.dumps(fn)
        token = uuid.uuid4().hex
        # The registry keeps `fn` alive: its id cannot be reused by another object.
        self.by_id[id(fn)] = (fn, token, ray.put(data), len(data))
        return token, len(data)

    def refs(self, tokens: set[str]) -> FunctionRefs:
        return {tok: ref for _, tok, ref, _ in self.by_id.values() if tok in tokens}


def dumps_slices(
    slices: list[reference.PerClient], member_types: list[types.Type], registry: Registry
) -> tuple[bytes, set[str], int]:
    """`dumps` of a task's per-client values. Client datasets are sent as recipes (a
    `Dataset`, a list); one that cannot be sent (a one-shot generator) is read here and
    its batches are sent instead."""
    try:
        return dumps(slices, registry)
    except (TypeError, AttributeError, pickle.PicklingError):
        pass
    read = [
        values if isinstance(values, client_state.ClientStates)  # workers read those themselves
        else [_read_streams(v, t) for v in values]
        for values, t in zip(slices, member_types)
    ]
    return dumps(read, registry)


def _read_streams(value: chunks.Internal, t: types.Type) -> chunks.Internal:
    if isinstance(t, types.SequenceType) and isinstance(value, structure.Stream):
        return value if value.replayable else structure.Stream(
            list(value), value.element_type, value.path
        )
    if isinstance(t, types.StructType) and isinstance(value, tuple):
        return tuple(_read_streams(v, et) for v, et in zip(value, t.types))
    return value


def dumps(value: object, registry: Registry) -> tuple[bytes, set[str], int]:
    """(bytes, tokens of the local computations referred to, bytes of new computations)."""
    from ray import cloudpickle

    tokens: set[str] = set()
    sent = 0

    class Pickler(cloudpickle.CloudPickler):
        def persistent_id(self, obj: object) -> str | None:
            nonlocal sent
            if registry.is_local(obj):
                token, new = registry.token(obj)
                tokens.add(token)
                sent += new
                return token
            return None

    buf = io.BytesIO()
    Pickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(value)
    return buf.getvalue(), tokens, sent


# -- the worker ----------------------------------------------------------------------------


class Worker:
    """A Ray actor: runs tasks of waves with its own simulation runtime."""

    def __init__(self, sys_path: list[str], jax_config: dict[str, Any]):
        # Functions defined in the driver's modules (a script, tests) are pickled by
        # reference: make the driver's import path importable here.
        for p in sys_path:
            if p not in sys.path and os.path.isdir(p):
                sys.path.append(p)
        import jax

        for name, value in jax_config.items():
            jax.config.update(name, value)
        self.contexts: dict[str, simulation.SimulationContext] = {}
        self.fns: dict[str, local.LocalComputation] = {}
        self.wave: WaveSpec | None = None

    def where(self) -> str:
        return f"{socket.gethostname()} (pid {os.getpid()})"

    def _loads(self, data: bytes, fn_refs: FunctionRefs) -> Any:
        import ray

        fns = self.fns

        class Unpickler(pickle.Unpickler):
            def persistent_load(self, token: str) -> local.LocalComputation:
                if token not in fns:
                    fns[token] = pickle.loads(ray.get(fn_refs[token]))
                return fns[token]

        return Unpickler(io.BytesIO(data)).load()

    def _spec(self, spec_key: str, spec_ref: list[ObjectRef], fn_refs: FunctionRefs) -> WaveSpec:
        import ray

        if self.wave is None or self.wave.key != spec_key:
            self.wave = self._loads(ray.get(spec_ref[0]), fn_refs)
        return self.wave

    def _context(self, options: simulation.Options) -> simulation.SimulationContext:
        key = repr(options)
        if key not in self.contexts:
            self.contexts[key] = simulation.SimulationContext(options)
        return self.contexts[key]

    def run_task(
        self,
        spec_key: str,
        spec_ref: list[ObjectRef],
        fn_refs: FunctionRefs,
        task: int,
        start: int,
        stop: int,
        slices: bytes,
    ) -> tuple[tuple[int, int, int, float], bytes]:
        """Accumulates the clients `start..stop-1` of a wave.

        Returns ((clients, bytes of the partials, programs compiled, seconds), partials).
        """
        from ray import cloudpickle

        counters.start()
        before = counters.snapshot()
        began = time.perf_counter()

        spec = self._spec(spec_key, spec_ref, fn_refs)
        if spec.hook is not None:
            spec.hook(task)
        n = stop - start
        try:
            values = self._loads(slices, fn_refs)
            run = simulation.Run(self._context(spec.options), n)
            memo: dict[int, lazy.ClientsValue] = {}
            inputs = [_rebuild(node, run, values, memo) for node in spec.inputs]
            accs = [make_accumulator(a, run, values) for a in spec.aggregations]
            wave = [simulation.AggThunk(run, x, None) for x in inputs]
            run._pass(wave, accs, n)
            partials = [acc.partial() for acc in accs]
        except Exception as e:
            e.add_note(
                f"(raised on the Ray worker {self.where()} computing clients "
                f"{start}..{start + n - 1} of the cohort)"
            )
            raise
        data = cloudpickle.dumps(partials)
        compiled = counters.snapshot().minus(before).compilations
        return (n, len(data), compiled, time.perf_counter() - began), data

    def merge(
        self,
        spec_key: str,
        spec_ref: list[ObjectRef],
        fn_refs: FunctionRefs,
        left: bytes,
        right: bytes,
    ) -> bytes:
        """The partials of two adjacent runs of clients, merged (left first)."""
        from ray import cloudpickle

        spec = self._spec(spec_key, spec_ref, fn_refs)
        if spec.hook is not None:
            spec.hook(-1)
        run = simulation.Run(self._context(spec.options), None)
        accs = [make_accumulator(a, run) for a in spec.aggregations]
        for part in (left, right):
            for acc, p in zip(accs, pickle.loads(part)):
                acc.merge(p)
        return cloudpickle.dumps([acc.partial() for acc in accs])


class OrderedCollect(accumulate.Collect):
    """Per-client values in client order; partials are lists, merged by concatenation."""

    def partial(self) -> accumulate.Partial:
        return self.values

    def merge(self, partial: accumulate.Partial) -> None:
        self.values.extend(partial)


def make_accumulator(
    a: AggSpec, run: simulation.Run, values: list[reference.PerClient] | None = None
) -> accumulate.Accumulator:
    """The accumulator of an aggregation on a worker (`values`: the task's slices; None
    when merging partials)."""
    if a.write is not None:
        return bound_state.StateWrite(None if values is None else values[a.write], a.member)
    if a.uri is None:
        return OrderedCollect(a.member)
    from fedlang.core import intrinsics

    d = intrinsics.lookup(a.uri)
    assert a.parameter_type is not None
    return accumulate.AGGREGATIONS[a.uri].make(d, a.parameter_type, a.server_args, run.call_now)


def _rebuild(
    spec: NodeSpec,
    run: simulation.Run,
    values: list[reference.PerClient],
    memo: dict[int, lazy.ClientsValue],
) -> lazy.ClientsValue:
    key = id(spec)
    if key in memo:
        return memo[key]
    out: lazy.ClientsValue
    if isinstance(spec, SourceSpec):
        out = lazy.Source(values[spec.index], spec.member)
    elif isinstance(spec, StateSourceSpec):
        out = bound_state.StateSource(values[spec.index], spec.member)
    elif isinstance(spec, RepSpec):
        out = lazy.Replicated(spec.value, spec.member)
    elif isinstance(spec, MapSpec):
        out = lazy.Mapped(spec.fn, _rebuild(spec.input, run, values, memo), spec.member, run._apply)
    elif isinstance(spec, ZipSpec):
        out = lazy.Zipped(_rebuild_parts(spec.parts, spec.arg_type, run, values, memo),
                          spec.arg_type, spec.member)
    elif isinstance(spec, CountSpec):
        out = lazy.Counted(spec.fn, run.call_now, spec.member)
    else:
        raise TypeError(f"Expected a portable CLIENTS value, found {type(spec).__name__}.")
    memo[key] = out
    return out


def _rebuild_parts(
    parts: Parts,
    t: types.Type,
    run: simulation.Run,
    values: list[reference.PerClient],
    memo: dict[int, lazy.ClientsValue],
) -> lazy.Value:
    if isinstance(t, types.FederatedType):
        return _rebuild(parts, run, values, memo)
    return tuple(
        _rebuild_parts(x, et, run, values, memo)
        for x, et in zip(parts, t.types)  # type: ignore[attr-defined]
    )
