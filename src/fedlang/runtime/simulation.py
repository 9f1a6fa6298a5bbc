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
import numbers
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

import numpy as np

from fedlang.core import client_state, computation, intrinsics, ir, local, structure, types
from fedlang.core import intrinsic_defs as defs
from fedlang.runtime import (
    accumulate,
    autotune,
    bound_state,
    chunks,
    counters,
    lazy,
    local_exec,
    reference,
)

CLIENTS = types.CLIENTS


@dataclasses.dataclass
class Options:
    """Settings of the simulation runtime.

    Attributes:
      chunk_size: clients per chunk; None (or 'auto') derives it from `memory_budget`
        and the sizes of the values the wave computes per client: 8 to 256 clients, or
        fewer, down to 1, when 8 clients' values are large and would exceed the budget
        (`SimulationContext.chunk_size_for`).
      memory_budget: bytes a chunk may hold: its clients' values (with 'auto' chunk
        sizes) and the client data staged for it (and per window of one client's
        batches); a client larger than this is streamed. A fixed default, not a share
        of the machine's free memory, so that chunks, and with them the rounding of
        sums, do not change from run to run.
      strategy: how local computations reduce client datasets: 'auto' (measure and
        pick), 'loop' (host loop of jitted steps), 'scan' (lax.scan over segments) or
        'vmap' (clients vectorized, `vmap_width` at a time; see `vmap_exec`).
      num_clients: the cohort size when no CLIENTS-placed argument says.
      prefetch: stage the next chunk's client data on a background thread.
      vmap_width: clients per vectorized group with the 'vmap' strategy; None: as many
        as the chunk has and the device's memory holds.
      auto_budget_s: seconds 'auto' may spend timing candidates per decision (their
        first, compiling runs come on top; they run on a few clients and batches).
      decision_cache: where 'auto' keeps its decisions across runs: True for the
        default file (`autotune.default_cache_path()`), a path, or False (memory only).
      progress: say when 'auto' measures: True, False, or None (when stderr is a
        terminal). A live progress display (`run_training`'s bar) shows it in place of
        a line on stderr; it is also logged to the `fedlang.runtime` logger.
      client_threads: clients the per-client strategies run at once on one CPU device;
        None: one per core for steps with a convolution (XLA:CPU runs those on one
        thread), else 1 (`local_exec.client_threads_for`). Results do not depend on it.
    """

    chunk_size: int | str | None = None
    memory_budget: int = 512 << 20
    strategy: str = "auto"
    num_clients: int | None = None
    prefetch: bool = True
    vmap_width: int | None = None
    auto_budget_s: float = 1.0
    decision_cache: bool | str = True
    progress: bool | None = None
    client_threads: int | None = None

    def __post_init__(self) -> None:
        if self.client_threads is not None and self.client_threads < 1:
            raise ValueError(
                f"client_threads must be a positive number of threads or None, found "
                f"{self.client_threads}."
            )
        if self.chunk_size is not None and not (
            isinstance(self.chunk_size, str) and self.chunk_size == "auto"
        ):
            size = _whole(self.chunk_size)
            if size is None or size < 1:
                raise ValueError(
                    f"chunk_size must be a positive number of clients, 'auto' or None, found "
                    f"{self.chunk_size!r}."
                )
            self.chunk_size = size
        else:
            self.chunk_size = None  # 'auto'
        budget = _whole(self.memory_budget)
        if budget is None:
            raise ValueError(
                f"memory_budget must be a whole number of bytes, found {self.memory_budget!r}"
                f" ({type(self.memory_budget).__name__}). Write it as an int: 4 << 30 is 4 GiB."
            )
        self.memory_budget = budget
        if self.memory_budget < 1 << 16:
            raise ValueError(
                f"memory_budget must be at least 64 KiB, found {self.memory_budget} bytes."
            )
        if self.vmap_width is not None and self.vmap_width < 1:
            raise ValueError(
                f"vmap_width must be a positive number of clients or None, found {self.vmap_width}."
            )
        if self.auto_budget_s <= 0:
            raise ValueError(
                f"auto_budget_s must be a positive number of seconds, found {self.auto_budget_s}."
            )
        if self.strategy not in local_exec.STRATEGIES:
            raise ValueError(
                f"Unknown strategy {self.strategy!r}; expected one of {local_exec.STRATEGIES}."
            )


def _whole(value: object) -> int | None:
    """`value` as an int if it is a whole number (a NumPy integer too), else None (bools,
    floats and strings are not numbers of clients or bytes)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    return None


@dataclasses.dataclass(frozen=True)
class RunStats:
    """What the last invocation did.

    Attributes:
      waves: passes over the cohort.
      num_clients: the cohort size.
      compilations: XLA programs compiled while it ran (0 once every shape was seen).
      host_to_device: explicit transfers of staged data to the device (the vectorized
        path makes one per group of clients, plus one per chunk).
      device_to_host: explicit waits for device results (one per chunk on the
        vectorized path; per-client strategies on an accelerator also one per chunk).
    """

    waves: int
    num_clients: int | None
    compilations: int = 0
    host_to_device: int = 0
    device_to_host: int = 0


class AggThunk(lazy.Thunk):
    """An aggregation of a CLIENTS value, computed in a wave with its peers."""

    # The client-state binding this "aggregation" writes its input to (a
    # `bound_state.StateWrite`), or None.
    writes: client_state.ClientStates | None = None

    def __init__(
        self,
        run: Run,
        input_: lazy.ClientsValue,
        make: Any,
        spec: tuple[intrinsics.IntrinsicDef, types.Type, accumulate.ServerArgs] | None = None,
    ):
        super().__init__(lambda: run.run_wave(self), (input_,))
        self.input = input_
        self.make = make  # () -> Accumulator, called when the wave starts
        # (definition, parameter type, server arguments) of an aggregation intrinsic, for
        # runtimes that accumulate elsewhere (None for collecting CLIENTS values).
        self.spec = spec
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

    def call(self, fn: reference.Function, arg: lazy.Value) -> lazy.Value:
        fn = lazy.force(fn)
        if isinstance(fn, reference._IntrinsicFn):
            return self.intrinsic(fn.definition, arg, fn.type_signature)
        if local.is_local(fn):
            return lazy.Thunk(lambda: fn.invoke(lazy.force(arg)), (arg,))
        return super().call(fn, arg)  # a closure: its body is evaluated lazily by `eval`

    def call_now(self, fn: reference.Function, arg: lazy.Value) -> reference.Value:
        """Calls a local function on concrete values (inside accumulators and maps)."""
        return lazy.force(self.call(fn, arg))

    def eval(self, node: ir.Node, env: reference.Env) -> lazy.Value:
        if isinstance(node, ir.Selection):
            src = self.eval(node.source, env)
            if isinstance(src, lazy.Thunk):
                return lazy.Thunk(lambda: lazy.force(src)[node.index], (src,))
            return src[node.index]
        return super().eval(node, env)

    def intrinsic(
        self, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
    ) -> lazy.Value:
        strategy = STRATEGIES.get(d.uri)
        if strategy is not None:
            out = strategy(self, d, arg, fn_type)
            if out is not NotImplemented:
                return out
        return self._fallback(d, arg, fn_type.parameter, fn_type.result)

    def _fallback(
        self,
        d: intrinsics.IntrinsicDef,
        arg: lazy.Value,
        t: Any,
        result_t: types.Type,
        impl: Semantics | None = None,
    ) -> lazy.Value:
        """An intrinsic without a strategy: materialize its CLIENTS inputs and run the
        reference semantics (or `impl`, with the same signature) on them."""
        collected = self.collect(arg, t)
        semantics = impl or d.impl

        def compute() -> reference.Value:
            return semantics(lazy.force(_force_collected(collected)), t, _Eager(self))

        thunk = lazy.Thunk(compute, (collected,))
        if isinstance(result_t, types.FederatedType) and result_t.placement is CLIENTS:
            if result_t.all_equal:
                return lazy.Replicated(
                    lazy.Thunk(lambda: thunk.get()[0], (thunk,)), result_t.member
                )
            return lazy.FromThunk(thunk, result_t.member)
        return thunk

    def collect(self, value: lazy.Value, t: types.Type) -> lazy.Value:
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

    def _apply(
        self, fn: reference.Function, cv: chunks.ChunkValue, c: int
    ) -> chunks.ChunkValue:
        if local.is_program(fn):
            return self.ctx.runner.map_chunk(fn, cv, c)
        if isinstance(fn, reference.Closure):
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

    def run_wave(self, target: AggThunk) -> chunks.Internal:
        """Computes `target` and every other ready aggregation in one pass over the cohort."""
        wave = self.ready_wave(target)
        values = self.compute_wave(wave)
        self.waves += 1
        for a, value in zip(wave[1:], values[1:]):
            a._value, a.done = value, True
        return values[0]

    def ready_wave(self, target: AggThunk) -> list[AggThunk]:
        """`target` (first) and the other aggregations whose inputs are ready, once the
        server values `target` needs are computed (which may run earlier waves)."""
        for dep in list(lazy.pending_thunks(target.input)):
            dep.get()
        wave = [
            a
            for a in self.aggregations
            if not a.done and a is not target and not any(lazy.pending_thunks(a.input))
        ]
        return [target, *wave]

    def compute_wave(self, wave: list[AggThunk]) -> list[chunks.Internal]:
        """The results of a wave's aggregations: here, one pass over chunks of clients
        (other runtimes override this to compute them elsewhere)."""
        accs = [a.make() for a in wave]
        self._pass(wave, accs, self.num_clients)
        return [acc.result() for acc in accs]

    def _pass(self, wave: list[AggThunk], accs: list[accumulate.Accumulator], n: int) -> None:
        size = self.ctx.chunk_size_for(wave)
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
        sources = list(dict.fromkeys(_clients_sources(wave)))
        seq_sources = [s for s in sources if _has_sequence(s.member)]
        pool = self.ctx.pool if self.ctx.options.prefetch and seq_sources else None
        budget = max(self.ctx.options.memory_budget // max(size, 1), 1 << 16)
        steps = _add_steps(wave)
        pending: concurrent.futures.Future | None = None
        for k, (start, stop) in enumerate(bounds):
            if pool is not None:
                if pending is None:
                    _stage(seq_sources, start, stop, budget)
                else:
                    pending.result()
                if k + 1 < len(bounds):
                    pending = pool.submit(_stage, seq_sources, *bounds[k + 1], budget)
            cache: lazy.Cache = {}
            for i, done in steps:
                value = wave[i].input.chunk(start, stop, cache)
                for key in done:  # values no later aggregation of the wave reads
                    cache.pop(key, None)
                accs[i].add(value, stop - start)
                del value


class _Eager:
    """The `intrinsics.Runtime` view of a run, for reference semantics on concrete values."""

    def __init__(self, run: Run):
        self.run = run

    @property
    def num_clients(self) -> int:
        return self.run.num_clients

    def call(self, fn: reference.Function, arg: reference.Value) -> reference.Value:
        return self.run.call_now(fn, arg)


# -- the strategy table: how this runtime executes each intrinsic ---------------------
#
# A strategy is `strategy(run, definition, arg, fn_type) -> value` (lazy values allowed)
# or NotImplemented to use the fallback. Intrinsics without a strategy run their
# reference semantics on materialized CLIENTS inputs (`Run._fallback`), which is valid
# for every intrinsic: a new one works here as soon as it is defined.

Strategy = Callable[[Run, intrinsics.IntrinsicDef, lazy.Value, types.FunctionType], lazy.Value]
#: Reference semantics, as an intrinsic's `impl`: `(arg, arg_type, runtime) -> result`
#: on concrete values (CLIENTS values as lists).
Semantics = Callable[[reference.Value, Any, intrinsics.Runtime], reference.Value]


def _replicate(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    return lazy.Replicated(arg, cast(types.FederatedType, fn_type.result).member)


def _at_server(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    return arg


def _map(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    fn, value = arg
    if isinstance(value, lazy.ClientsValue):
        member = cast(types.FederatedType, fn_type.result).member
        return lazy.Mapped(lazy.force(fn), value, member, run._apply)
    return lazy.Thunk(lambda: run.call_now(lazy.force(fn), lazy.force(value)), (fn, value))


def _zip(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    result_t = cast(types.FederatedType, fn_type.result)
    if result_t.placement is not CLIENTS:
        return NotImplemented
    return lazy.Zipped(arg, fn_type.parameter, result_t.member)  # type: ignore[arg-type]


def _eval_at_clients(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    fn = lazy.force(arg)
    member = cast(types.FederatedType, fn_type.result).member
    return lazy.Counted(fn, run.call_now, member)


def _aggregate(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    """Folds the clients' values chunk by chunk with the intrinsic's accumulator."""
    agg = accumulate.AGGREGATIONS[d.uri]
    t = fn_type.parameter
    assert t is not None
    if agg.clients == accumulate.ZIPPED:
        value = lazy.Zipped(arg, t, agg.client_type(t))
    else:
        value = arg[0] if agg.clients == accumulate.FIRST else arg
    server_args = agg.server_args(arg)
    return AggThunk(
        run,
        value,
        lambda: agg.make(d, t, tuple(lazy.force(server_args)), run.call_now),
        (d, t, server_args),
    )


def _select(
    run: Run, d: intrinsics.IntrinsicDef, arg: lazy.Value, fn_type: types.FunctionType
) -> lazy.Value:
    """federated_select with each client's keys looked up in one vectorized call."""

    def impl(concrete: reference.Value, t: Any, rt: intrinsics.Runtime) -> reference.Value:
        keys, max_key, server_val, fn = concrete
        out = []
        for i, client_keys in enumerate(keys):
            ks = defs.checked_select_keys(i, client_keys, max_key)
            if local.is_program(fn) and fn.can_vmap and fn.seq_index is None:
                out.append(local_exec.select_many(fn, server_val, ks))
            else:
                out.append([rt.call(fn, (server_val, np.int32(k))) for k in ks])
        return out

    return run._fallback(d, arg, fn_type.parameter, fn_type.result, impl)


STRATEGIES: dict[str, Strategy] = {
    **{uri: _aggregate for uri in accumulate.AGGREGATIONS},
    defs.FEDERATED_BROADCAST.uri: _replicate,
    defs.FEDERATED_VALUE_AT_CLIENTS.uri: _replicate,
    defs.FEDERATED_VALUE_AT_SERVER.uri: _at_server,
    defs.FEDERATED_MAP.uri: _map,
    defs.FEDERATED_ZIP.uri: _zip,
    defs.FEDERATED_EVAL_AT_CLIENTS.uri: _eval_at_clients,
    defs.FEDERATED_SELECT.uri: _select,
}


def _force_collected(value: lazy.Value) -> lazy.Value:
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


#: The clients of an 'auto' chunk: at least MIN_CHUNK, at most MAX_CHUNK, unless a
#: client's values are large (`large_chunk_size`).
MIN_CHUNK, MAX_CHUNK = 8, 256
#: What MIN_CHUNK clients' values (twice over, as counted) may take whatever the budget:
#: splitting a chunk smaller than this saves little memory and costs a pass per chunk.
SMALL_CHUNK_BYTES = 64 << 20


def large_chunk_size(budget: int, per_client: int) -> int:
    """Clients per chunk when a client's values are large: as many as fit `budget` (each
    client's `per_client` bytes twice over, for inputs and outputs in flight), from 1
    to MIN_CHUNK; MIN_CHUNK when their values take at most SMALL_CHUNK_BYTES.

    Args:
      budget: bytes the chunk may hold (`Options.memory_budget`).
      per_client: bytes of the values one client adds to a chunk.

    Returns:
      The number of clients, 1 to MIN_CHUNK.

    Example:
      >>> large_chunk_size(512 << 20, 1 << 30)  # a 1 GiB model: one client at a time
      1
      >>> large_chunk_size(512 << 20, 64 << 20)
      4
      >>> large_chunk_size(64 << 10, 16 << 10)  # small values: never fewer than 8
      8
    """
    need = 2 * max(per_client, 1)
    if MIN_CHUNK * need <= SMALL_CHUNK_BYTES:
        return MIN_CHUNK
    return int(min(max(budget // need, 1), MIN_CHUNK))


def _held_bytes(nodes: list[lazy.ClientsValue]) -> int:
    """Bytes per client of the values a chunk of these graph nodes holds: each node once
    (a chunk computes a node shared by several aggregations once), without the nodes
    that hold no per-client copy (a broadcast is one value; a zip and a selection
    refer to their inputs' arrays)."""
    distinct = {id(node): node for node in nodes}.values()
    return sum(
        _type_bytes(node.member)
        for node in distinct
        if not isinstance(node, lazy.Replicated | lazy.Zipped) and not _is_selection(node)
    )


def _is_selection(node: lazy.ClientsValue) -> bool:
    """Whether `node` maps `x -> x[i][j]` (`Run._apply` selects without copying)."""
    return (
        isinstance(node, lazy.Mapped)
        and isinstance(node.fn, reference.Closure)
        and _selection_path(node.fn.fn) is not None
    )


def _add_steps(wave: list[AggThunk]) -> list[tuple[int, list[int]]]:
    """The order in which a chunk's values are added to the wave's accumulators: (index
    in `wave`, cache keys of the values no later step reads) per aggregation.

    Aggregations of small values go first, the largest last, and each chunk value is
    dropped once the last aggregation that reads it has it: a FedAvg chunk then adds
    its weighted updates while the clients' models and unweighted updates are already
    freed, not with all three held. The accumulators are independent, so the order
    changes no result.
    """
    order = sorted(range(len(wave)), key=lambda i: _type_bytes(wave[i].input.member))
    last: dict[int, int] = {}
    for step, i in enumerate(order):
        for node in _graph(wave[i].input):
            last[id(node)] = step
    done: list[list[int]] = [[] for _ in order]
    for key, step in last.items():
        done[step].append(key)
    return [(i, done[step]) for step, i in enumerate(order)]


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


def _stage_value(v: chunks.Internal, t: types.Type, budget: int) -> chunks.Internal:
    if isinstance(t, types.SequenceType):
        return _StagedStream(v, budget)
    if isinstance(t, types.StructType):
        return tuple(_stage_value(x, et, budget) for x, et in zip(v, t.types))
    return v


class _StagedStream:
    """A client's batches pulled ahead of time; beyond the budget the rest streams."""

    def __init__(self, stream: Iterable[chunks.Internal], budget: int):
        self.batches: list[chunks.Internal] = []
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

    def __iter__(self) -> Iterator[chunks.Internal]:
        return itertools.chain(self.batches, self.rest)


class SimulationContext:
    """Runs computations with the simulation runtime (see the module docstring)."""

    name = "simulation"
    # Runs every intrinsic: by STRATEGIES, else by the reference semantics.
    refuse: reference.Refuse | None = None

    def __init__(self, options: Options | None = None, **kwargs: Any):
        self.options = options or Options(**kwargs)
        o = self.options
        self.runner = local_exec.LocalRunner(
            o.strategy,
            o.memory_budget,
            vmap_width=o.vmap_width,
            tuner=autotune.Tuner(o.auto_budget_s, o.decision_cache, o.progress),
            client_threads=o.client_threads,
        )
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self.last_run: RunStats | None = None

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        """The thread that stages the next chunk's client data (started on first use)."""
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="fedlang-stage"
            )
        return self._pool

    def close(self) -> None:
        """Stops this context's threads; it stays usable (they restart when needed)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self.runner.close()

    def __enter__(self) -> SimulationContext:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def chunk_size_for(self, wave: list[AggThunk]) -> int:
        """Clients per chunk: as set, or what fits the memory budget.

        The estimate counts the bytes of every per-client value the wave computes
        (model weights, updates, metrics: the sizes their types give, unknown dims as
        1) twice over, for inputs and outputs in flight. Chunks hold 8 to 256 clients
        (with client datasets at most 32 on a CPU, 128 on an accelerator), each value
        counted once per aggregation that reads it: a wide margin, which small models
        have always run with. When not even 8 clients fit that way, each value is
        counted once, as a chunk holds it, and the chunk takes as many clients as fit,
        down to 1 (`large_chunk_size`): a large model then holds a few copies of
        itself, not a few per client of a chunk of 8.
        """
        if self.options.chunk_size is not None:
            return cast(int, self.options.chunk_size)
        budget = self.options.memory_budget
        nodes = [node for a in wave for node in _graph(a.input)]
        per_client = sum(_type_bytes(node.member) for node in nodes)
        size = budget // max(2 * per_client, 1)
        if size < MIN_CHUNK:
            return large_chunk_size(budget, _held_bytes(nodes))
        size = min(size, MAX_CHUNK)
        if any(_has_sequence(s.member) for s in _clients_sources(wave)):
            # Client datasets are staged a chunk ahead; their sizes are unknown until read,
            # so keep chunks small enough that staging overlaps compute and memory stays flat
            # (32 clients on a CPU; an accelerator vectorizes a chunk's clients together, and
            # wider groups keep it busy: 128 there).
            on_cpu = self.runner.devices[0].platform == "cpu"
            size = min(size, 32 if on_cpu else 128)
        return size

    def make_run(self, n: int | None) -> Run:
        """The evaluation of one invocation (runtimes that compute waves elsewhere, such
        as the Ray runtime, return a `Run` subclass overriding `compute_wave`)."""
        return Run(self, n)

    def invoke(
        self, comp: computation.Computation, arg: reference.PythonValue
    ) -> reference.PythonValue:
        reference.check_runtime_supports(self, comp)
        counters.start()
        before = counters.snapshot()
        t = comp.type_signature
        n = reference.infer_num_clients(arg, t.parameter, self.options.num_clients)
        internal = reference.to_internal(arg, t.parameter, n)
        run = self.make_run(n)
        internal = _as_lazy(internal, t.parameter)
        node = comp.to_ir()
        fn = run.eval(node, {}) if isinstance(node, ir.Lambda) else node.computation
        bound = client_state.bound_states(comp, arg)
        if bound is None:
            result = run.call(fn, internal)
            result = run.collect(result, t.result)
            out = reference.to_python(_force_collected_deep(result), t.result)
        else:
            out = _invoke_writing(run, fn, internal, t, *bound)
        spent = counters.snapshot().minus(before)
        self.last_run = RunStats(  # not the run: it holds the data
            waves=run.waves,
            num_clients=run._n,
            compilations=spent.compilations,
            host_to_device=spent.host_to_device,
            device_to_host=spent.device_to_host,
        )
        return out


def _invoke_writing(
    run: Run,
    fn: reference.Function,
    internal: lazy.Value,
    t: types.FunctionType,
    spec: client_state.ClientStateSpec,
    binding: client_state.ClientStates,
) -> reference.PythonValue:
    """Runs a computation whose new client states go to `binding`: they are written
    chunk by chunk in the waves (never collected), and committed if all succeeds."""
    result_t = cast(types.StructType, t.result)
    binding.begin()
    try:
        result = run.call(fn, internal)
        result = list(result.get() if isinstance(result, lazy.Thunk) else result)
        write = AggThunk(
            run, result[spec.result], lambda: bound_state.StateWrite(binding, spec.state_type)
        )
        write.writes = binding
        result[spec.result] = write
        forced = list(_force_collected_deep(run.collect(tuple(result), result_t)))
        bound_state.check_written(forced[spec.result], binding)
        forced[spec.result] = []
        binding.commit()
    except BaseException:
        binding.abort()
        raise
    out = reference.to_python(tuple(forced), result_t)
    return client_state.replace_result(out, result_t, spec.result, binding)


def _force_collected_deep(value: lazy.Value) -> reference.Value:
    value = lazy.force(value) if isinstance(value, lazy.Thunk) else value
    if isinstance(value, tuple):
        return tuple(_force_collected_deep(v) for v in value)
    if isinstance(value, lazy.ClientsValue):
        raise AssertionError("CLIENTS values must be collected before forcing")
    return value


def _as_lazy(value: reference.Value, t: types.Type | None) -> lazy.Value:
    """Turns the interpreter's per-client lists into lazy CLIENTS values."""
    if t is None:
        return None
    if isinstance(t, types.FederatedType) and t.placement is CLIENTS:
        if t.all_equal:
            return lazy.Replicated(value[0] if value else None, t.member)
        if isinstance(value, client_state.ClientStates):
            return bound_state.as_source(value, t)
        return lazy.Source(value, t.member)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(_as_lazy(v, et) for v, et in zip(value, t.types))
    return value
