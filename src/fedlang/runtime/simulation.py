"""The simulation runtime: the fast, memory-bounded way to run federated computations.

A cohort's values are never materialized. The IR is first evaluated lazily into a
dataflow graph (`lazy.py`); aggregations are then run in waves: every aggregation
whose inputs are ready is computed in one pass over chunks of clients, with the next
chunk's client data staged on a background thread while the current one computes.
Local JAX computations run vectorized over a chunk (`jax.vmap`) or, when they consume
client datasets, by the strategy `local_exec.LocalRunner` picks by measurement.
Peak memory is O(chunk size), whatever the cohort size.

Results equal the reference runtime's (within floating-point tolerance); the same
conformance suite runs on both.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
from collections.abc import Iterator
from typing import Any, cast

import numpy as np

from fedlang.core import computation, intrinsics, ir, structure, types
from fedlang.runtime import accumulate, chunks, lazy, local_exec, reference

CLIENTS = types.CLIENTS


@dataclasses.dataclass
class Options:
    """Settings of the simulation runtime.

    Attributes:
      chunk_size: clients per chunk; None derives it from `memory_budget` and the sizes
        of the values mapped over clients (at most 256).
      memory_budget: bytes of client data staged per chunk (and per window of one
        client's batches); a client larger than this is streamed.
      strategy: how local computations reduce client datasets: 'auto' (measure and
        pick), 'loop' (host loop of jitted steps), 'scan' (lax.scan over segments) or
        'vmap' (clients vectorized, `vmap_width` at a time; see `vmap_exec`).
      num_clients: the cohort size when no CLIENTS-placed argument says.
      prefetch: stage the next chunk's client data on a background thread.
      vmap_width: clients per vectorized group with the 'vmap' strategy.
    """

    chunk_size: int | None = None
    memory_budget: int = 512 << 20
    strategy: str = "auto"
    num_clients: int | None = None
    prefetch: bool = True
    vmap_width: int = 16

    def __post_init__(self) -> None:
        if self.chunk_size is not None and self.chunk_size < 1:
            raise ValueError(
                f"chunk_size must be a positive number of clients, found {self.chunk_size}."
            )
        if self.memory_budget < 1 << 16:
            raise ValueError(
                f"memory_budget must be at least 64 KiB, found {self.memory_budget} bytes."
            )
        if self.strategy not in local_exec.STRATEGIES:
            raise ValueError(
                f"Unknown strategy {self.strategy!r}; expected one of {local_exec.STRATEGIES}."
            )


@dataclasses.dataclass(frozen=True)
class RunStats:
    """What the last invocation did: passes over the cohort, and its size."""

    waves: int
    num_clients: int | None


class AggThunk(lazy.Thunk):
    """An aggregation of a CLIENTS value, computed in a wave with its peers."""

    def __init__(self, run: Run, input_: lazy.ClientsValue, make: Any):
        super().__init__(lambda: run.run_wave(self), (input_,))
        self.input = input_
        self.make = make  # () -> Accumulator, called when the wave starts
        run.aggregations.append(self)


class Run(reference.Interpreter):
    """One invocation: the reference interpreter made lazy, and the wave scheduler.

    It evaluates the IR like the reference interpreter, except that local calls become
    thunks, CLIENTS values lazy graphs and aggregations `AggThunk`s.
    """

    def __init__(self, ctx: SimulationContext, n: int | None):
        super().__init__(n)
        self.ctx = ctx
        self._n = n
        self.aggregations: list[AggThunk] = []
        self.waves = 0

    # -- evaluation into a lazy graph -------------------------------------------------

    def call(self, fn: Any, arg: Any) -> Any:
        fn = lazy.force(fn)
        if isinstance(fn, reference._IntrinsicFn):
            return self.intrinsic(fn.definition, arg, fn.type_signature)
        if isinstance(fn, ir.LocalComputation):
            return lazy.Thunk(lambda: fn.invoke(lazy.force(arg)), (arg,))
        return super().call(fn, arg)  # a closure: its body is evaluated lazily by `eval`

    def call_now(self, fn: Any, arg: Any) -> Any:
        """Calls a local function on concrete values (inside accumulators and maps)."""
        return lazy.force(self.call(fn, arg))

    def eval(self, node: ir.Node, env: dict[str, Any]) -> Any:
        if isinstance(node, ir.Selection):
            src = self.eval(node.source, env)
            if isinstance(src, lazy.Thunk):
                return lazy.Thunk(lambda: lazy.force(src)[node.index], (src,))
            return src[node.index]
        return super().eval(node, env)

    def intrinsic(self, d: intrinsics.IntrinsicDef, arg: Any, fn_type: types.FunctionType) -> Any:
        uri, t = d.uri, fn_type.parameter
        result_t = fn_type.result
        member = result_t.member if isinstance(result_t, types.FederatedType) else None
        if uri in ("federated_broadcast", "federated_value_at_clients"):
            return lazy.Replicated(arg, member)  # type: ignore[arg-type]
        if uri == "federated_value_at_server":
            return arg
        if uri == "federated_map":
            fn, value = arg
            if isinstance(value, lazy.ClientsValue):
                return lazy.Mapped(lazy.force(fn), value, member, self._apply)  # type: ignore[arg-type]
            return lazy.Thunk(lambda: self.call_now(lazy.force(fn), lazy.force(value)), (fn, value))
        if uri == "federated_zip" and result_t.placement is CLIENTS:  # type: ignore[attr-defined]
            return lazy.Zipped(arg, t, member)  # type: ignore[arg-type]
        if uri == "federated_eval_at_clients":
            fn = lazy.force(arg)
            return lazy.Counted(lambda: self.call_now(fn, None), member)  # type: ignore[arg-type]
        make = self._accumulator(uri, arg, t)
        if make is not None:
            value = arg[0] if uri in _TWO_PART else arg
            if uri == "federated_weighted_mean":
                arg_t = cast(types.StructType, t)  # <values, weights>, both at CLIENTS
                values_t = cast(types.FederatedType, arg_t.types[0])
                weights_t = cast(types.FederatedType, arg_t.types[1])
                value = lazy.Zipped(
                    arg, arg_t, types.StructType([values_t.member, weights_t.member])
                )
            return AggThunk(self, value, make)
        return self._fallback(d, arg, t, result_t)

    def _accumulator(self, uri: str, arg: Any, t: Any) -> Any:
        if uri == "federated_sum":
            return lambda: accumulate.Sum(t.member)
        if uri == "federated_mean":
            return lambda: accumulate.Mean(t.member)
        if uri == "federated_weighted_mean":
            return lambda: accumulate.WeightedMean(t.types[0].member, t.types[1].member)
        if uri in ("federated_min", "federated_max"):
            return lambda: accumulate.Extremum(t.member, uri == "federated_min")
        if uri == "federated_aggregate":
            _, zero, acc, merge, report = arg
            return lambda: accumulate.Aggregate(
                t.types[0].member,
                lazy.force(zero),
                lazy.force(acc),
                lazy.force(merge),
                lazy.force(report),
                self.call_now,
            )
        if uri in _SPARSE:
            return lambda: accumulate.SparseSum(t.member, _SPARSE[uri])
        if uri in ("federated_secure_modular_sum", "federated_secure_sum_bitwidth"):
            member = t.types[0].member
            bounds = intrinsics._per_leaf_bounds(lazy.force(arg[1]), t.types[1], member)
            if uri == "federated_secure_modular_sum":
                return lambda: accumulate.ModularSum(member, bounds, lambda n: bounds)
            return lambda: accumulate.ModularSum(
                member, [2**b for b in bounds], accumulate.bitwidth_moduli(bounds)
            )
        return None

    def _fallback(self, d: intrinsics.IntrinsicDef, arg: Any, t: Any, result_t: types.Type) -> Any:
        """Any other intrinsic: materialize its CLIENTS inputs and run the reference semantics."""
        collected = self.collect(arg, t)

        def compute() -> Any:
            return d.impl(lazy.force(_force_collected(collected)), t, _Eager(self))

        thunk = lazy.Thunk(compute, (collected,))
        if isinstance(result_t, types.FederatedType) and result_t.placement is CLIENTS:
            if result_t.all_equal:
                return lazy.Replicated(
                    lazy.Thunk(lambda: thunk.get()[0], (thunk,)), result_t.member
                )
            return lazy.FromThunk(thunk, result_t.member)
        return thunk

    def collect(self, value: Any, t: types.Type) -> Any:
        """Replaces CLIENTS values inside `value` by thunks of their per-client lists."""
        if (
            isinstance(t, types.FederatedType)
            and t.placement is CLIENTS
            and isinstance(value, lazy.ClientsValue)
        ):
            return AggThunk(self, value, lambda: accumulate.Collect(t.member))
        if isinstance(t, types.StructType) and isinstance(value, tuple):
            return tuple(self.collect(v, et) for v, et in zip(value, t.types))
        return value

    # -- applying functions to chunks ---------------------------------------------------

    def _apply(self, fn: Any, cv: Any, c: int) -> Any:
        runner = self.ctx.runner
        if isinstance(fn, ir.LocalComputation) and hasattr(fn, "trace_fn"):
            return runner.map_chunk(fn, cv, c)  # type: ignore[arg-type]
        if isinstance(fn, reference._Closure):
            path = _selection_path(fn.fn)
            if path is not None:
                for index in path:
                    cv = chunks.select(cv, index)
                return cv
        param_t = (
            fn.type_signature.parameter
            if hasattr(fn, "type_signature")
            else fn.fn.type_signature.parameter
        )
        result_t = (
            fn.type_signature.result
            if hasattr(fn, "type_signature")
            else fn.fn.type_signature.result
        )
        return chunks.stack(
            [self.call_now(fn, chunks.row(cv, param_t, i)) for i in range(c)], result_t
        )

    # -- waves --------------------------------------------------------------------------

    def run_wave(self, target: AggThunk) -> Any:
        """Computes `target` and every other ready aggregation in one pass over chunks."""
        for dep in list(lazy.pending_thunks(target.input)):
            dep.get()  # may run earlier waves
        wave = [
            a
            for a in self.aggregations
            if not a.done and a is not target and not any(lazy.pending_thunks(a.input))
        ]
        wave.insert(0, target)
        accs = [a.make() for a in wave]
        n = self.num_clients
        self._pass(wave, accs, n)
        self.waves += 1
        for a, acc in zip(wave, accs):
            if a is not target:
                a._value, a.done = acc.result(), True
        return accs[0].result()

    def _pass(self, wave: list[AggThunk], accs: list[accumulate.Accumulator], n: int) -> None:
        size = self.ctx.chunk_size_for(wave)
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
        sources = list(dict.fromkeys(_clients_sources(wave)))
        seq_sources = [s for s in sources if _has_sequence(s.member)]
        pool = self.ctx.pool if self.ctx.options.prefetch and seq_sources else None
        budget = max(self.ctx.options.memory_budget // max(size, 1), 1 << 16)
        pending: concurrent.futures.Future | None = None
        for k, (start, stop) in enumerate(bounds):
            if pool is not None:
                if pending is None:
                    _stage(seq_sources, start, stop, budget)
                else:
                    pending.result()
                if k + 1 < len(bounds):
                    pending = pool.submit(_stage, seq_sources, *bounds[k + 1], budget)
            cache: dict[int, Any] = {}
            for a, acc in zip(wave, accs):
                acc.add(a.input.chunk(start, stop, cache), stop - start)


class _Eager:
    """The `intrinsics.Runtime` view of a run, for reference semantics on concrete values."""

    def __init__(self, run: Run):
        self.run = run

    @property
    def num_clients(self) -> int:
        return self.run.num_clients

    def call(self, fn: Any, arg: Any) -> Any:
        return self.run.call_now(fn, arg)


_SPARSE = {
    "federated_sparse_sum": "dense",
    "federated_sparse_sum_keep_sparse": "sum",
    "federated_sparse_mean": "mean",
}

_TWO_PART = {"federated_aggregate", "federated_secure_modular_sum", "federated_secure_sum_bitwidth"}


def _force_collected(value: Any) -> Any:
    if isinstance(value, lazy.Thunk):
        return value.get()
    if isinstance(value, tuple):
        return tuple(_force_collected(v) for v in value)
    return value


def _selection_path(fn: ir.Lambda) -> list[int] | None:
    """[i, j] when `fn` is `(x -> x[i][j])`, else None."""
    path: list[int] = []
    node = fn.result
    while isinstance(node, ir.Selection):
        path.append(node.index)
        node = node.source
    if isinstance(node, ir.Reference) and node.name == fn.parameter_name and path:
        return path[::-1]
    return None


def _clients_sources(wave: list[AggThunk]) -> Iterator[lazy.Source]:
    for a in wave:
        yield from a.input.sources()


def _graph(value: lazy.ClientsValue) -> Iterator[lazy.ClientsValue]:
    yield value
    for child in value.children():
        yield from _graph(child)


def _type_bytes(t: types.Type) -> int:
    if isinstance(t, types.TensorType):
        return int(np.prod([d or 1 for d in t.shape], dtype=np.int64)) * t.dtype.itemsize
    if isinstance(t, types.StructType):
        return sum(_type_bytes(x) for x in t)
    return 0


def _has_sequence(t: types.Type) -> bool:
    if isinstance(t, types.SequenceType):
        return True
    return isinstance(t, types.StructType) and any(_has_sequence(x) for x in t)


def _stage(sources: list[lazy.Source], start: int, stop: int, budget: int) -> None:
    """Pulls the chunk's client datasets into lists (up to `budget` bytes per client)."""
    for s in sources:
        s.staged[(start, stop)] = [_stage_value(v, s.member, budget) for v in s.values[start:stop]]


def _stage_value(v: Any, t: types.Type, budget: int) -> Any:
    if isinstance(t, types.SequenceType):
        return _StagedStream(v, budget)
    if isinstance(t, types.StructType):
        return tuple(_stage_value(x, et, budget) for x, et in zip(v, t.types))
    return v


class _StagedStream:
    """A client's batches pulled ahead of time; beyond the budget the rest streams."""

    def __init__(self, stream: Any, budget: int):
        self.batches: list[Any] = []
        it = iter(stream)
        size = 0
        for b in it:
            self.batches.append(b)
            size += (
                sum(np.asarray(x).nbytes for x in structure.flatten(b, stream.element_type))
                if hasattr(stream, "element_type")
                else 0
            )
            if size >= budget:
                break
        else:
            it = iter(())
            self.complete = True  # every batch is staged: iterating again replays them
        self.rest = it

    complete = False

    @property
    def replayable(self) -> bool:
        return self.complete

    def __iter__(self) -> Iterator[Any]:
        return itertools.chain(self.batches, self.rest)


class SimulationContext:
    """Runs computations with the simulation runtime (see the module docstring)."""

    def __init__(self, options: Options | None = None, **kwargs: Any):
        self.options = options or Options(**kwargs)
        self.runner = local_exec.LocalRunner(
            self.options.strategy, self.options.memory_budget, vmap_width=self.options.vmap_width
        )
        self.pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fedlang-stage")
        self.last_run: RunStats | None = None

    def chunk_size_for(self, wave: list[AggThunk]) -> int:
        """Clients per chunk: as set, or what fits the memory budget (8 to 256).

        The estimate counts the bytes of every per-client value the wave computes
        (model weights, updates, metrics: the sizes their types give, unknown dims as
        1) twice over, for inputs and outputs in flight.
        """
        if self.options.chunk_size is not None:
            return self.options.chunk_size
        per_client = sum(_type_bytes(node.member) for a in wave for node in _graph(a.input))
        size = int(np.clip(self.options.memory_budget // max(2 * per_client, 1), 8, 256))
        if any(_has_sequence(s.member) for s in _clients_sources(wave)):
            # Client datasets are staged a chunk ahead; their sizes are unknown until read,
            # so keep chunks small enough that staging overlaps compute and memory stays flat.
            size = min(size, 32)
        return size

    def invoke(self, comp: computation.Computation, arg: Any) -> Any:
        t = comp.type_signature
        n = reference.infer_num_clients(arg, t.parameter, self.options.num_clients)
        internal = reference.to_internal(arg, t.parameter, n)
        run = Run(self, n)
        internal = _as_lazy(internal, t.parameter)
        node = comp.to_ir()
        fn = run.eval(node, {}) if isinstance(node, ir.Lambda) else node.computation  # type: ignore[attr-defined]
        result = run.call(fn, internal)
        result = run.collect(result, t.result)
        out = reference.to_python(_force_collected_deep(result), t.result)
        self.last_run = RunStats(
            waves=run.waves, num_clients=run._n
        )  # not the run: it holds the data
        return out


def _force_collected_deep(value: Any) -> Any:
    value = lazy.force(value) if isinstance(value, lazy.Thunk) else value
    if isinstance(value, tuple):
        return tuple(_force_collected_deep(v) for v in value)
    if isinstance(value, lazy.ClientsValue):
        raise AssertionError("CLIENTS values must be collected before forcing")
    return value


def _as_lazy(value: Any, t: types.Type | None) -> Any:
    """Turns the interpreter's per-client lists into lazy CLIENTS values."""
    if t is None:
        return None
    if isinstance(t, types.FederatedType) and t.placement is CLIENTS:
        if t.all_equal:
            return lazy.Replicated(value[0] if value else None, t.member)
        return lazy.Source(value, t.member)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(_as_lazy(v, et) for v, et in zip(value, t.types))
    return value
