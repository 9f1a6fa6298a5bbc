"""Running a local JAX computation over a chunk of clients.

Without a dataset parameter the computation is vectorized with one `jax.vmap` over the
chunk (broadcast arguments are not copied: their vmap axis is None). With a dataset,
each client's reduce is run by one of these strategies:

* ``loop``: a host loop of jitted steps, streaming the client's batches (any size);
* ``scan``: consecutive batches of equal shape are stacked into segments of at most
  `MAX_SEGMENT` batches and folded by one jitted loop per segment, whose length is
  rounded up to a power of two (at least `MIN_SEGMENT`) and whose true number of
  batches is an argument: a run compiles one program per length bucket, never one per
  client length, and no padding batch is computed. Batches are pulled in windows
  bounded by the memory budget, so a client larger than memory still streams.
* ``vmap``: clients vectorized in groups (`vmap_exec`).

For a masked reduce (`dataset.reduce(..., masked=True)`) every batch is padded, with
mask 0, to the largest batch size the computation has seen, so a client's smaller last
batch compiles nothing new: the number of programs a run compiles is bounded by the
number of length buckets, whatever the clients' sizes.

``auto`` measures the candidates on a small probe within a time budget and remembers
the decision per program shape and device, also across runs (`autotune`). Either way
the fold is exact: no padding enters an unmasked step function.
"""

from __future__ import annotations

import concurrent.futures
import itertools
import os
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import jax
import numpy as np
from jax import lax

from fedlang.core import local, structure, types
from fedlang.runtime import autotune, chunks, counters, vmap_exec

STRATEGIES = ("auto", "loop", "scan", "vmap")

MIN_SEGMENT = 8  # the shortest scan segment (shorter runs are padded up to it)
MAX_SEGMENT = 64  # the longest; longer clients run several segments
PROBE_BATCHES = 8  # batches of one client on which 'auto' times loop against scan
PROBE_CLIENTS, PROBE_CLIENT_BATCHES = 4, 4  # clients x batches for vmap vs per client

Choice = autotune.Choice


class LocalRunner:
    """Executes local JAX computations over chunks; remembers the strategy it picked.

    Args:
      strategy: one of `STRATEGIES`.
      memory_budget: bytes of one client's batches held at once (scan windows).
      devices: the JAX devices chunks are spread over (default: all local devices).
      vmap_width: clients per vectorized group; None picks the widest that fits the
        chunk and the device's memory.
      tuner: how 'auto' measures and remembers (default: in memory, 1 s budget).
      client_threads: clients run at once on one CPU device by the per-client
        strategies; None: `client_threads_for` decides per computation.
    """

    def __init__(
        self,
        strategy: str = "auto",
        memory_budget: int = 256 << 20,
        devices: list | None = None,
        vmap_width: int | None = None,
        tuner: autotune.Tuner | None = None,
        client_threads: int | None = None,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
        self.strategy = strategy
        self.vmap_width = vmap_width
        self.memory_budget = memory_budget
        self._devices = devices
        self.tuner = tuner or autotune.Tuner(cache=False)
        self._batch_sizes: dict[Hashable, int] = {}
        self.client_threads = client_threads
        self._threads: dict[Hashable, int] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._client_pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._client_pool_size = 0

    @property
    def choices(self) -> dict[tuple, Choice]:
        """The decisions 'auto' took (or read from the decision file) in this process."""
        return self.tuner.choices

    @property
    def devices(self) -> list:
        """The JAX devices chunks are spread over (looked up on first use: no backend
        starts before a computation runs)."""
        if self._devices is None:
            self._devices = jax.local_devices()
        return self._devices

    def close(self) -> None:
        """Stops the device worker threads (a later run starts them again)."""
        for pool in (self._pool, self._client_pool):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._client_pool = None

    # -- without a dataset: one vmap over the chunk ---------------------------------------

    def map_chunk(
        self, comp: local.LocalProgram, cv: chunks.ChunkValue, c: int
    ) -> chunks.ChunkValue:
        """Applies `comp` to each client of chunk value `cv`; returns a chunk value."""
        param_t = comp.type_signature.parameter
        result_t = comp.type_signature.result
        if comp.seq_index is not None:
            return self._map_with_dataset(comp, cv, c)
        if param_t is None:
            out = comp.invoke(None)
            return chunks.Rep(out)
        try:
            leaves, axes = chunks.leaves_with_axes(cv, param_t)
        except chunks.Ragged:
            return chunks.stack(
                [comp.invoke(chunks.row(cv, param_t, i)) for i in range(c)], result_t
            )
        if all(a is None for a in axes):
            return chunks.Rep(structure.unflatten(comp.run("fn", leaves), result_t))
        if not comp.can_vmap:
            return chunks.stack(
                [comp.invoke(chunks.row(cv, param_t, i)) for i in range(c)], result_t
            )
        key = ("vmap", tuple(axes))
        prog = comp.program(
            key, lambda: jax.jit(jax.vmap(comp.tuned_part("fn"), in_axes=tuple(axes)))
        )
        if len(self.devices) == 1 or c < 2 * len(self.devices):
            return structure.unflatten(prog(*leaves), result_t)
        # Split the chunk between devices; calls dispatch asynchronously, so they overlap.
        parts = np.array_split(np.arange(c), len(self.devices))
        outs = []
        for dev, idx in zip(self.devices, parts):
            lo, hi = int(idx[0]), int(idx[-1]) + 1
            placed = [
                jax.device_put(x if a is None else x[lo:hi], dev) for x, a in zip(leaves, axes)
            ]
            outs.append(prog(*placed))
        merged = [np.concatenate([np.asarray(o[j]) for o in outs]) for j in range(len(outs[0]))]
        return structure.unflatten(merged, result_t)

    # -- with a dataset: per-client reduce strategies -----------------------------------------

    def _map_with_dataset(
        self, comp: local.LocalProgram, cv: chunks.ChunkValue, c: int
    ) -> chunks.ChunkValue:
        vectorizable = comp.can_vmap and comp.uses_reduce
        if self.strategy == "vmap" and vectorizable:
            return self._vmapped(comp, cv, c)
        if (
            self.strategy == "auto"
            and vectorizable
            and c >= PROBE_CLIENTS
            and self._choose_width(comp, cv, c) == "vmap"
        ):
            return self._vmapped(comp, cv, c)
        return self._map_per_client(comp, cv, c)

    def _vmapped(
        self,
        comp: local.LocalProgram,
        cv: chunks.ChunkValue,
        c: int,
        streams: list[chunks.Stream] | None = None,
        rows: int | None = None,
    ) -> chunks.ChunkValue:
        return vmap_exec.map_vmapped(
            comp,
            cv,
            c,
            self.vmap_width or c,
            self._group_bytes(),
            lambda batches: self.pad_batches(comp, batches),
            streams,
            rows,
        )

    def _group_bytes(self) -> int:
        """Bytes of client batches one vectorized group may stage on its device."""
        limit = None
        try:
            stats = self.devices[0].memory_stats()
            limit = stats.get("bytes_limit") if stats else None
        except (AttributeError, NotImplementedError, RuntimeError):
            pass
        return int(limit) // 8 if limit else self.memory_budget

    def _map_per_client(
        self,
        comp: local.LocalProgram,
        cv: chunks.ChunkValue,
        c: int,
        streams: list[chunks.Stream] | None = None,
    ) -> chunks.ChunkValue:
        param_t, seq_index = local.parameter_type(comp), local.dataset_index(comp)
        result_t = comp.type_signature.result

        def client(i: int, device: jax.Device | None = None) -> chunks.Leaves:
            args = comp.split_arg(chunks.row(cv, param_t, i))
            leaves = comp.arg_leaves(args)
            if device is not None:
                leaves = [jax.device_put(x, device) for x in leaves]
            stream = args[seq_index] if streams is None else streams[i]
            out = self.run_client(comp, leaves, stream)
            if device is not None:  # results on several devices meet on the host
                out = [np.asarray(x) for x in out]
            return list(out)

        if len(self.devices) == 1 or c < 2:
            threads = min(c, self._threads_for(comp))
            if threads > 1:
                # One CPU device, several cores: XLA:CPU runs some programs (convolutions)
                # on one thread, so clients run side by side; a free thread takes the
                # next client, and results keep the clients' order (the same sums).
                # Longest first where the lengths are known (staged clients), so that no
                # core idles at the end of the chunk while one long client finishes.
                pool = self._threads_pool(threads)
                running = {i: pool.submit(client, i) for i in _longest_first(comp, cv, c)}
                try:
                    outs = [running[i].result() for i in range(c)]
                except BaseException:
                    for f in running.values():  # a client failed: the rest never starts
                        f.cancel()
                    raise
                return _gather(outs, result_t, self.devices[0].platform)
            # Results stay device arrays: no wait per client, one gather per chunk.
            return _gather([client(i) for i in range(c)], result_t, self.devices[0].platform)
        # Several devices: one worker thread per device takes clients round-robin. JAX
        # releases the GIL while a program runs, so devices (or CPU cores) work in parallel.
        nd = len(self.devices)
        pool = self._device_pool()
        futures = [
            pool.submit(lambda idx, dev: [client(j, dev) for j in idx], range(k, c, nd), dev)
            for k, dev in enumerate(self.devices)
        ]
        results: list[Any] = [None] * c
        for k, fut in enumerate(futures):
            for j, out in zip(range(k, c, nd), fut.result()):
                results[j] = out
        return _gather(results, result_t, "cpu")

    def _choose_width(self, comp: local.LocalProgram, cv: chunks.ChunkValue, c: int) -> str:
        """With 'auto': vectorized groups ('vmap') or one client at a time ('per-client'),
        decided once per computation and device on a probe of a few clients' first few
        batches (never on one-shot streams: those clients would lose the batches read)."""
        device = self.devices[0]
        key = ("width", comp.cache_key, device.platform)
        # Taken on the calling thread without the tuner's lock: measuring per-client runs
        # uses the device threads, which take that lock for their own decisions.
        choice = self.tuner.cached(key, None)
        if choice is not None:
            return choice.strategy
        param_t = local.parameter_type(comp)
        probe = chunks.take(cv, param_t, list(range(PROBE_CLIENTS)))
        full = _streams(comp, probe, PROBE_CLIENTS)
        if not all(getattr(s, "replayable", False) for s in full):
            return "per-client"  # decide on a later chunk whose data can be read twice
        streams = [list(itertools.islice(iter(s), PROBE_CLIENT_BATCHES)) for s in full]
        units = sum(len(s) for s in streams)
        if units == 0:
            return "per-client"
        first = next(i for i, s in enumerate(streams) if s)
        leaves = comp.arg_leaves(comp.split_arg(chunks.row(probe, param_t, first)))
        batch = local.with_mask(structure.flatten(streams[first][0], local.element_type(comp)))
        text = autotune.step_text(comp, leaves, batch)
        if autotune.prior(text, device.platform) is not None:
            choice = self.tuner.choices[key] = Choice("per-client", {}, "prior")
            return choice.strategy
        disk_key = self._disk_key("width", text, batch)  # None without a decision file
        choice = self.tuner.cached(key, disk_key)
        if choice is None:
            # Vectorizing computes padding (short clients in a group run to its longest):
            # time the probe at the chunk's group width, per padded step, and charge each
            # real batch the padding the chunk's clients would need.
            lengths = [
                len(s.batches) for s in _streams(comp, cv, c) if getattr(s, "complete", False)
            ]
            cap = min(self.vmap_width or c, c)
            rows = vmap_exec.pow2(cap)
            padding = vmap_exec.padded_steps(lengths, cap) / sum(lengths) if sum(lengths) else 1.0
            probe_steps = rows * vmap_exec.padded_length(max(len(s) for s in streams))
            n = PROBE_CLIENTS
            times = self.tuner.measure(
                f"{comp.name} ({n} clients x {PROBE_CLIENT_BATCHES} batches, groups of {rows})",
                {
                    "per-client": lambda: self._map_per_client(comp, probe, n, streams),
                    "vmap": lambda: self._vmapped(comp, probe, n, streams, rows),
                },
                {"per-client": units, "vmap": probe_steps / padding},
                decide=_width,
            )
            choice = Choice(_width(times), times)
            self.tuner.record(key, disk_key, choice)
        return choice.strategy

    def _disk_key(self, kind: str, text: str | None, batch: chunks.Batch) -> str | None:
        if self.tuner.path is None or text is None:
            return None
        return autotune.decision_key(kind, text, batch, self.devices[0])

    def _threads_for(self, comp: local.LocalProgram) -> int:
        if self.devices[0].platform != "cpu":
            return 1  # an accelerator runs one program at a time anyway
        if self.client_threads is not None:
            return self.client_threads
        key = comp.cache_key
        n = self._threads.get(key)
        if n is None:
            n = self._threads[key] = client_threads_for(comp, self.devices)
        return n

    def _threads_pool(self, threads: int) -> concurrent.futures.ThreadPoolExecutor:
        pool = self._client_pool
        if pool is None or self._client_pool_size != threads:
            if pool is not None:
                pool.shutdown(wait=True)
            pool = self._client_pool = concurrent.futures.ThreadPoolExecutor(
                threads, thread_name_prefix="fedlang-client"
            )
            self._client_pool_size = threads
        return pool

    def _device_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                len(self.devices), thread_name_prefix="fedlang-device"
            )
        return self._pool

    def pad_batches(
        self, comp: local.LocalProgram, batches: Iterable[chunks.Batch]
    ) -> Iterator[chunks.Batch]:
        """A masked computation's batches (leaves and mask) padded to the largest batch
        size it has seen, so tail batches compile nothing new; others pass unchanged."""
        if not comp.masked:
            yield from batches
            return
        key = comp.cache_key
        for b in batches:
            n = local.batch_size(b)
            target = self._batch_sizes.get(key, 0)
            if n > target:
                self._batch_sizes[key] = n
            elif n < target:
                b = _pad_rows(b, n, target)
            yield b

    def run_client(
        self, comp: local.LocalProgram, leaves: chunks.Leaves, stream: chunks.Stream
    ) -> chunks.Leaves:
        """One client's result leaves for a computation that reduces a dataset."""
        if not comp.uses_reduce:
            return comp.run("epilogue", leaves)
        flat = structure.flattener(local.element_type(comp))
        batches: Iterator[chunks.Batch] = self.pad_batches(
            comp, (local.with_mask(flat(b)) for b in stream)
        )
        strategy = self.strategy
        if strategy == "auto":
            batches, strategy = self._choose(comp, leaves, batches)
        if strategy == "scan":
            # The prologue runs inside the first scan program and the epilogue inside the
            # last: a client costs its segments' dispatches and nothing more.
            return self._fold_scan(comp, leaves, None, batches, finish=True)
        return self._client_loop(comp, leaves, batches)

    def _client_loop(
        self, comp: local.LocalProgram, leaves: chunks.Leaves, batches: Iterator[chunks.Batch]
    ) -> chunks.Leaves:
        state = self._fold_loop(comp, leaves, comp.run("prologue", leaves), batches)
        return list(comp.run("epilogue", leaves + list(state)))

    def _choose(
        self, comp: local.LocalProgram, leaves: chunks.Leaves, batches: Iterator[chunks.Batch]
    ) -> tuple[Iterator[chunks.Batch], str]:
        first = next(batches, None)
        if first is None:
            return iter(()), "loop"
        shapes = tuple(np.shape(x) for x in first)
        key = (comp.cache_key, shapes)
        known = self.tuner.choices.get(key)
        if known is not None:  # the common case: decided on an earlier client
            return itertools.chain([first], batches), known.strategy
        window = [first, *itertools.islice(batches, PROBE_BATCHES - 1)]
        rest = itertools.chain(window, batches)
        if len(window) < 2:
            return rest, "loop"
        with self.tuner.lock:
            choice = self.tuner.cached(key, None)
            disk_key = None
            if choice is None:
                text = autotune.step_text(comp, leaves, window[0])
                prior = autotune.prior(text, self.devices[0].platform)
                if prior is not None:
                    choice = self.tuner.choices[key] = Choice(prior, {}, "prior")
                else:
                    disk_key = self._disk_key("reduce", text, window[0])
                    choice = self.tuner.cached(key, disk_key)
            if choice is None:
                times = self.tuner.measure(
                    f"{comp.name} on batches {list(shapes[:-1])}",
                    {
                        "loop": lambda: self._client_loop(comp, leaves, iter(window)),
                        "scan": lambda: self._fold_scan(comp, leaves, None, iter(window), True),
                    },
                    len(window),
                    # The same steps either way: on a CPU, count the host's work.
                    cpu_clock=self.devices[0].platform == "cpu",
                    decide=_loop_or_scan,
                )
                choice = Choice(_loop_or_scan(times), times)
                self.tuner.record(key, disk_key, choice)
        return rest, choice.strategy

    @staticmethod
    def _fold_loop(
        comp: local.LocalProgram,
        leaves: chunks.Leaves,
        state: chunks.Leaves,
        batches: Iterator[chunks.Batch],
    ) -> chunks.Leaves:
        for b in batches:
            state = comp.run("step", leaves + list(state) + b)
        return list(state)

    def _fold_scan(
        self,
        comp: local.LocalProgram,
        leaves: chunks.Leaves,
        state: chunks.Leaves | None,
        batches: Iterator[chunks.Batch],
        finish: bool = False,
    ) -> chunks.Leaves:
        """Folds the batches; `state=None` runs the prologue first, `finish` the epilogue
        last (both fused into the first and last scan programs where there is one)."""
        window_bytes = 0
        run: list[chunks.Batch] = []
        run_shapes: list[tuple[int, ...]] = []  # the shapes of the run's batches
        for b in batches:
            shapes = _shapes(b)
            if run and comp.masked and shapes != run_shapes:
                # A smaller (tail) batch joins the run, padded and masked.
                b = local.pad_batch(b, run[0])
                shapes = _shapes(b)
            full = len(run) >= MAX_SEGMENT or window_bytes >= self.memory_budget
            if run and (full or shapes != run_shapes):
                state = self._scan_run(comp, leaves, state, run)
                run, window_bytes = [], 0
            if not run:
                run_shapes = shapes
            run.append(b)
            window_bytes += sum(getattr(x, "nbytes", 0) for x in b)
        if run:
            return self._scan_run(comp, leaves, state, run, finish)
        if state is None:
            state = comp.run("prologue", leaves)
        return list(comp.run("epilogue", leaves + list(state))) if finish else list(state)

    @staticmethod
    def _scan_run(
        comp: local.LocalProgram,
        leaves: chunks.Leaves,
        state: chunks.Leaves | None,
        run: list[chunks.Batch],
        finish: bool = False,
    ) -> chunks.Leaves:
        """Folds batches of one shape in segments of at most `MAX_SEGMENT` batches.

        Each segment is stacked into a power-of-two length (at least `MIN_SEGMENT`) and
        folded by a loop over its true number of batches. `state=None`: the first
        program starts with the prologue; `finish`: the last one ends with the epilogue
        and the result leaves are returned instead of the state.
        """
        n_args = len(leaves)
        assert comp.state_type is not None  # (a reduce has a state)
        n_state = len(structure.leaf_types(comp.state_type))
        out: chunks.Leaves = []
        for start in range(0, len(run), MAX_SEGMENT):
            segment = run[start : start + MAX_SEGMENT]
            n = len(segment)
            length = max(MIN_SEGMENT, 1 << (n - 1).bit_length())
            stacked = []
            for j, x in enumerate(segment[0]):
                first_leaf = np.asarray(x)
                buf = chunks.aligned_zeros((length, *first_leaf.shape), first_leaf.dtype)
                for k, b in enumerate(segment):
                    buf[k] = b[j]
                stacked.append(buf)
            first = state is None
            last = finish and start + n == len(run)
            # State passed between segments is donated: each segment reuses its buffers.
            donate = tuple(range(n_args, n_args + n_state)) if not first and not last else ()

            def build(
                f: bool = first, e: bool = last, d: tuple[int, ...] = donate
            ) -> Callable[..., chunks.Leaves]:
                return jax.jit(_segment_program(comp, n_args, n_state, f, e), donate_argnums=d)

            prog = comp.program(("segment", first, last), build)
            out = list(prog(*leaves, *([] if state is None else state), *stacked, np.int32(n)))
            state = out
            if first and last:
                _warm_lengths(comp, prog, leaves, stacked, length)
        return out


def usable_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def client_threads_for(comp: local.LocalProgram, devices: list) -> int:
    """How many clients of `comp` the per-client strategies run at once.

    On one CPU device with several cores, a step with a convolution runs one client per
    core: XLA:CPU runs convolutions on one thread (the FedAvg paper's CNN steps as fast
    on one core as on two), so clients side by side are what uses the other cores
    (1.35-1.45x on 2 cores, `bench/cnn_cpu.py`). Other steps run one client at a time: small
    ones are bound by dispatch, which threads contend for, and XLA already spreads
    large matrix products over the cores. Accelerators and several devices: 1 (they
    have their own parallelism)."""
    if len(devices) != 1 or devices[0].platform != "cpu" or comp.state_type is None:
        return 1
    cores = usable_cores()
    if cores < 2:
        return 1
    text = autotune.abstract_step_text(comp)
    return cores if text is not None and "conv_general_dilated" in text else 1


def select_many(
    fn: local.LocalProgram, server_val: chunks.Internal, keys: np.ndarray
) -> list[chunks.Internal]:
    """`[fn(server_val, k) for k in keys]` for a vectorizable computation, as one vmapped call.

    One call per key would move the server value to the device and dispatch once per
    key (milliseconds each for a large table); a client asking for 1,000 rows of a
    1,000,000-row table would then take seconds.
    """
    leaves = [jax.numpy.asarray(x) for x in fn.arg_leaves([server_val, np.int32(0)])[:-1]]
    many = fn.program(
        ("select_many", len(leaves)),
        lambda: jax.jit(jax.vmap(fn.tuned_part("fn"), in_axes=(*[None] * len(leaves), 0))),
    )
    padded = np.zeros(1 << max(len(keys) - 1, 0).bit_length(), np.int32)  # few compiled sizes
    padded[: len(keys)] = keys
    outs = [np.asarray(x) for x in many(*leaves, padded)]
    result_t = fn.type_signature.result
    return [structure.unflatten([x[j] for x in outs], result_t) for j in range(len(keys))]


def _longest_first(comp: local.LocalProgram, cv: chunks.ChunkValue, c: int) -> list[int]:
    """The chunk's clients by decreasing number of batches when every client's batches
    are staged (their number known), else in their order."""
    lengths = []
    for s in _streams(comp, cv, c):
        if not getattr(s, "complete", False):
            return list(range(c))
        lengths.append(len(s.batches))
    return sorted(range(c), key=lambda i: -lengths[i])


def _loop_or_scan(times: dict[str, float]) -> str:
    """`scan` unless `loop` clearly wins (20%): a one-client probe charges scan its
    per-client costs over few batches (W1 at cohort 100 ran 1.7x faster by scan when its
    probe measured the two within 10% of each other)."""
    return "loop" if times["loop"] < 0.8 * times["scan"] else "scan"


def _width(times: dict[str, float]) -> str:
    """Vectorizing must clearly win (20%): per-client runs stream and are the safe default."""
    return "vmap" if times["vmap"] < 0.8 * times["per-client"] else "per-client"


def _shapes(batch: chunks.Batch) -> list[tuple[int, ...]]:
    """A batch's leaf shapes (`.shape` where there is one: `np.shape` costs ~1 us more a
    call, and the per-client strategies ask once per batch)."""
    return [x.shape if hasattr(x, "shape") else np.shape(x) for x in batch]


def _streams(comp: local.LocalProgram, cv: chunks.ChunkValue, c: int) -> list[chunks.Stream]:
    """The dataset argument of each client of a chunk value."""
    param_t, seq_index = local.parameter_type(comp), local.dataset_index(comp)
    return [comp.split_arg(chunks.row(cv, param_t, i))[seq_index] for i in range(c)]


def _gather(outs: list[chunks.Leaves], result_t: types.Type, platform: str) -> chunks.ChunkValue:
    """Per-client result leaves -> a chunk value on the host, with one wait per chunk.

    On an accelerator the clients' leaves are stacked on the device and fetched in one
    transfer; on the CPU they already are host memory and `np.stack` is cheapest.
    """
    if not outs:
        return chunks.stack([], result_t)
    n_leaves = len(outs[0])
    same = all(len({np.shape(o[j]) for o in outs}) == 1 for j in range(n_leaves))
    if platform == "cpu" or not same:
        return chunks.stack([structure.unflatten(o, result_t) for o in outs], result_t)
    stacked = [jax.numpy.stack([o[j] for o in outs]) for j in range(n_leaves)]
    counters.add(device_to_host=1)
    return structure.unflatten(list(jax.device_get(stacked)), result_t)


def _pad_rows(batch: chunks.Batch, n: int, target: int) -> chunks.Batch:
    """A batch whose non-scalar leaves all lead with `n` examples, padded with zeros
    (and mask 0) to `target` examples; any other batch is returned unchanged."""
    if any(np.ndim(x) and np.shape(x)[0] != n for x in batch):
        return batch
    out = []
    for x in batch:
        if np.ndim(x):
            x = np.asarray(x)
            padded = np.zeros((target, *x.shape[1:]), x.dtype)
            padded[:n] = x
            x = padded
        out.append(x)
    return out


WARM_BYTES = 64 << 20  # the largest zero segment compiled ahead


def _warm_lengths(
    comp: local.LocalProgram,
    prog: Callable[..., chunks.Leaves],
    leaves: chunks.Leaves,
    stacked: list[np.ndarray],
    length: int,
) -> None:
    """The first time a whole client runs in one segment, compiles that program for the
    other length buckets too (on zero segments and a count of 0: nothing is folded), so
    that a client of a length not seen yet compiles nothing in a later round."""
    signature = tuple((x.shape[1:], x.dtype.str) for x in stacked)
    warmed: set[int] = comp.program(("warmed-lengths", signature), set)
    if warmed:
        return
    warmed.add(length)
    per_batch = sum(x[0].nbytes for x in stacked)
    other = MIN_SEGMENT
    while other <= MAX_SEGMENT:
        if other != length and other * per_batch <= WARM_BYTES:
            zeros = [np.zeros((other, *x.shape[1:]), x.dtype) for x in stacked]
            prog(*leaves, *zeros, np.int32(0))
            warmed.add(other)
        other *= 2


def _segment_program(
    comp: local.LocalProgram,
    n_args: int,
    n_state: int,
    prologue: bool = False,
    epilogue: bool = False,
) -> Callable[..., chunks.Leaves]:
    """A loop of the step over the first `count` of a segment's stacked batches,
    optionally starting with the prologue (no state argument) and ending with the
    epilogue (returns the result leaves). `count` is an argument, so every client
    length in a bucket shares the program, and padding batches are never computed."""
    step = comp.tuned_part("step")
    start_fn = comp.tuned_part("prologue") if prologue else None
    end_fn = comp.tuned_part("epilogue") if epilogue else None

    def program(*flat: chunks.Leaf) -> chunks.Leaves:
        args, count = flat[:n_args], flat[-1]
        if start_fn is not None:
            state, stacked = list(start_fn(*args)), flat[n_args:-1]
        else:
            state, stacked = list(flat[n_args : n_args + n_state]), flat[n_args + n_state : -1]

        def body(i: jax.Array, carry: chunks.Leaves) -> chunks.Leaves:
            batch = [lax.dynamic_index_in_dim(x, i, keepdims=False) for x in stacked]
            return list(step(*args, *carry, *batch))

        final = lax.fori_loop(0, count, body, state)
        return list(end_fn(*args, *final)) if end_fn is not None else list(final)

    return program


def describe_choices(runner: LocalRunner) -> list[dict[str, str | float]]:
    """What `auto` picked: per computation and batch shape ('loop' or 'scan' per client),
    and per computation and platform ('vmap' or 'per-client'), with the measured times."""
    rows: list[dict[str, str | float]] = []
    for key, c in runner.choices.items():
        if key[0] == "width":
            rows.append(
                {
                    "program": _program_name(key[1]),
                    "decision": f"vmap width on {key[2]}",
                    "picked": c.strategy,
                    "source": c.source,
                    **c.seconds_per_batch,
                }
            )
        else:
            rows.append(
                {
                    "program": _program_name(key[0]),
                    "decision": f"reduce of batches {key[1]}",
                    "picked": c.strategy,
                    "source": c.source,
                    **c.seconds_per_batch,
                }
            )
    return rows


def _program_name(cache_key: Hashable) -> str:
    """A readable name for a computation's cache key (its name, and an id when present)."""
    if isinstance(cache_key, tuple) and len(cache_key) == 3:
        kind, name, ident = cache_key
        return f"{name} ({kind}, {ident:x})" if isinstance(ident, int) else f"{name} ({kind})"
    return str(cache_key)
