"""Running a local JAX computation over a chunk of clients.

Without a dataset parameter the computation is vectorized with one `jax.vmap` over the
chunk (broadcast arguments are not copied: their vmap axis is None). With a dataset,
each client's reduce is run by one of these strategies:

* ``loop``: a host loop of jitted steps, streaming the client's batches (any size);
* ``scan``: consecutive batches of equal shape are stacked and folded by jitted
  `lax.scan` programs over power-of-two segment lengths (a client with 13 batches
  runs segments of 8, 4 and 1), so a run compiles a handful of programs and a client
  costs a few dispatches instead of one per batch. Batches are pulled in windows
  bounded by the memory budget, so a client larger than memory still streams.

``auto`` times both on the first clients of each program shape and keeps the faster
(the issue's measurements show that which one wins depends on model and device).
Either way the fold is exact: no padding enters the user's step function.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import itertools
import threading
import time
from collections.abc import Iterator
from typing import Any

import jax
import numpy as np
from jax import lax

from fedlang.core import jax_computation as jax_backend
from fedlang.core import structure
from fedlang.runtime import chunks, vmap_exec

STRATEGIES = ("auto", "loop", "scan", "vmap")


@dataclasses.dataclass
class Choice:
    strategy: str
    seconds_per_batch: dict[str, float]


class LocalRunner:
    """Executes local JAX computations over chunks; remembers the strategy it picked."""

    def __init__(
        self,
        strategy: str = "auto",
        memory_budget: int = 256 << 20,
        devices: list | None = None,
        vmap_width: int = 16,
    ):
        if strategy not in STRATEGIES:
            raise ValueError(f"Unknown strategy {strategy!r}; expected one of {STRATEGIES}.")
        self.strategy = strategy
        self.vmap_width = vmap_width
        self.memory_budget = memory_budget
        self.devices = devices or jax.local_devices()
        self.choices: dict[Any, Choice] = {}
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None
        self._lock = threading.Lock()

    # -- without a dataset: one vmap over the chunk ---------------------------------------

    def map_chunk(self, comp: jax_backend.JaxLocal, cv: Any, c: int) -> Any:
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
            return chunks.Rep(structure.unflatten(comp._run("fn", leaves), result_t))
        if not comp.can_vmap:
            return chunks.stack(
                [comp.invoke(chunks.row(cv, param_t, i)) for i in range(c)], result_t
            )
        key = ("vmap", tuple(axes))
        prog = comp.program(
            key, lambda: jax.jit(jax.vmap(comp.trace_fn("fn"), in_axes=tuple(axes)))
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

    def _map_with_dataset(self, comp: jax_backend.JaxLocal, cv: Any, c: int) -> Any:
        vectorizable = comp.can_vmap and comp.uses_reduce
        if self.strategy == "vmap" and vectorizable:
            return vmap_exec.map_vmapped(comp, cv, c, self.vmap_width, _pad_to)
        if self.strategy == "auto" and vectorizable and c >= 4:
            picked = self._choose_width(comp, cv, c)
            if picked is not None:
                return picked
        return self._map_per_client(comp, cv, c)

    def _map_per_client(self, comp: Any, cv: Any, c: int) -> Any:
        param_t = comp.type_signature.parameter
        result_t = comp.type_signature.result

        def client(i: int, device: Any = None) -> Any:
            args = comp.split_arg(chunks.row(cv, param_t, i))
            leaves = comp.arg_leaves(args)
            if device is not None:
                leaves = [jax.device_put(x, device) for x in leaves]
            stream = args[comp.seq_index]  # type: ignore[index]
            out = self.run_client(comp, leaves, stream)
            if device is not None:  # results on several devices meet on the host
                out = [np.asarray(x) for x in out]
            # On one device results stay device arrays: no wait per client, one stack per chunk.
            return structure.unflatten(out, result_t)

        if len(self.devices) == 1 or c < 2:
            return chunks.stack([client(i) for i in range(c)], result_t)
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
        return chunks.stack(results, result_t)

    def _choose_width(self, comp: Any, cv: Any, c: int) -> Any:
        """With 'auto': on the first chunk of each computation, time vmapped groups against
        clients one at a time (on a few clients, after compiling both) and keep the faster.
        Returns the chunk's result when vmap was picked, else None (run per client)."""
        key = ("width", id(comp), self.devices[0].platform)
        if key in self.choices:
            if self.choices[key].strategy != "vmap":
                return None
            return vmap_exec.map_vmapped(comp, cv, c, self.vmap_width, _pad_to)
        n = min(c, 8)
        probe = chunks.take(cv, comp.type_signature.parameter, list(range(n)))
        if not all(getattr(s, "replayable", False) for s in _streams(comp, probe, n)):
            # Timing would consume one-shot streams (clients would lose batches): decide on
            # a later chunk whose first clients' data can be read twice.
            return None
        times = {}
        for name, run in (
            ("per-client", lambda: self._map_per_client(comp, probe, n)),
            ("vmap", lambda: vmap_exec.map_vmapped(comp, probe, n, self.vmap_width, _pad_to)),
        ):
            jax.block_until_ready(run())  # compile
            t0 = time.perf_counter()
            jax.block_until_ready(run())
            times[name] = time.perf_counter() - t0
        # Vectorizing must clearly win (20%): per-client runs stream and are the safe default.
        picked = "vmap" if times["vmap"] < 0.8 * times["per-client"] else "per-client"
        self.choices[key] = Choice(picked, times)
        return self._choose_width(comp, cv, c) if self.choices[key].strategy == "vmap" else None

    def _device_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(
                len(self.devices), thread_name_prefix="fedlang-device"
            )
        return self._pool

    def run_client(self, comp: jax_backend.JaxLocal, leaves: list[Any], stream: Any) -> list[Any]:
        """One client's result leaves for a computation that reduces a dataset."""
        if not comp.uses_reduce:
            return comp._run("epilogue", leaves)
        element_t = comp.element_type
        batches: Iterator[Any] = (_with_mask(structure.flatten(b, element_t)) for b in stream)
        strategy = self.strategy
        if strategy == "auto":
            batches, strategy = self._choose(comp, leaves, batches)
        if strategy == "scan":
            # The prologue runs inside the first scan program and the epilogue inside the
            # last: a client costs its segments' dispatches and nothing more.
            return self._fold_scan(comp, leaves, None, batches, finish=True)
        state = self._fold_loop(comp, leaves, comp._run("prologue", leaves), batches)
        return comp._run("epilogue", leaves + list(state))

    def _choose(self, comp: Any, leaves: list[Any], batches: Iterator) -> tuple[Iterator, str]:
        window = list(itertools.islice(batches, 8))
        rest = itertools.chain(window, batches)
        if len(window) < 2:
            return rest, "loop"
        key = (id(comp), tuple(np.shape(x) for x in window[0]))
        with self._lock:
            return rest, self._choice(key, comp, leaves, window)

    def _choice(self, key: Any, comp: Any, leaves: list[Any], window: list[Any]) -> str:
        if key not in self.choices:
            state = comp._run("prologue", leaves)
            times = {}
            for name, fold in (("loop", self._fold_loop), ("scan", self._fold_scan)):
                fold(comp, leaves, state, iter(window))  # compile
                t0 = time.perf_counter()
                jax.block_until_ready(fold(comp, leaves, state, iter(window)))
                times[name] = (time.perf_counter() - t0) / len(window)
            self.choices[key] = Choice(min(times, key=times.__getitem__), times)
        return self.choices[key].strategy

    @staticmethod
    def _fold_loop(comp: Any, leaves: list[Any], state: list[Any], batches: Iterator) -> list[Any]:
        for b in batches:
            state = comp._run("step", leaves + list(state) + b)
        return list(state)

    def _fold_scan(
        self,
        comp: Any,
        leaves: list[Any],
        state: list[Any] | None,
        batches: Iterator,
        finish: bool = False,
    ) -> list[Any]:
        """Folds the batches; `state=None` runs the prologue first, `finish` the epilogue
        last (both fused into the first and last scan programs where there is one)."""
        window_bytes = 0
        run: list[list[Any]] = []
        for b in batches:
            shapes = [np.shape(x) for x in b]
            if run and comp.masked and shapes != [np.shape(x) for x in run[0]]:
                b = _pad_to(b, run[0])  # a smaller (tail) batch joins the run, padded and masked
                shapes = [np.shape(x) for x in b]
            if run and shapes != [np.shape(x) for x in run[0]]:
                state = self._scan_run(comp, leaves, state, run)
                run, window_bytes = [], 0
            run.append(b)
            window_bytes += sum(getattr(x, "nbytes", 0) for x in b)
            if window_bytes >= self.memory_budget:
                state = self._scan_run(comp, leaves, state, run)
                run, window_bytes = [], 0
        if run:
            return self._scan_run(comp, leaves, state, run, finish)
        if state is None:
            state = comp._run("prologue", leaves)
        return list(comp._run("epilogue", leaves + list(state))) if finish else list(state)

    @staticmethod
    def _scan_run(
        comp: Any,
        leaves: list[Any],
        state: list[Any] | None,
        run: list[list[Any]],
        finish: bool = False,
    ) -> list[Any]:
        """Folds batches of one shape with scans over power-of-two segment lengths.

        `state=None`: the first program starts with the prologue; `finish`: the last one
        ends with the epilogue and the result leaves are returned instead of the state.
        """
        if len(run) == 1:  # a lone batch (e.g. a ragged tail): one step, no scan to compile
            if state is None:
                state = comp._run("prologue", leaves)
            state = list(comp._run("step", leaves + list(state) + run[0]))
            return list(comp._run("epilogue", leaves + state)) if finish else state
        n_args = len(leaves)
        n_state = len(structure.leaf_types(comp.state_type))
        stacked = [np.stack([np.asarray(b[j]) for b in run]) for j in range(len(run[0]))]
        start, remaining = 0, len(run)
        out: list[Any] = []
        while remaining:
            length = 1 << (remaining.bit_length() - 1)
            first, last = state is None, finish and length == remaining
            prog = comp.program(
                ("scan", first, last),
                lambda f=first, e=last: jax.jit(_scan_program(comp, n_args, n_state, f, e)),
            )
            segment = [x[start : start + length] for x in stacked]
            out = list(prog(*leaves, *([] if state is None else state), *segment))
            start += length
            remaining -= length
            state = out
        return out


def _streams(comp: Any, cv: Any, c: int) -> list[Any]:
    """The dataset argument of each client of a chunk value."""
    param_t = comp.type_signature.parameter
    return [comp.split_arg(chunks.row(cv, param_t, i))[comp.seq_index] for i in range(c)]


def _with_mask(batch: list[Any]) -> list[Any]:
    return [*batch, jax_backend.full_mask(batch)]


def _pad_to(batch: list[Any], like: list[Any]) -> list[Any]:
    """`batch` padded with zero examples (mask 0) to the shapes of `like`, if it fits."""
    n, target = jax_backend.batch_size(batch), jax_backend.batch_size(like)
    if n >= target or len(batch) != len(like):
        return batch
    for x, y in zip(batch, like):
        sx, sy = np.shape(x), np.shape(y)
        if len(sx) != len(sy) or (sx and (sx[0] != n or sx[1:] != sy[1:])) or (not sx and sy):
            return batch
    return [
        np.pad(np.asarray(x), [(0, target - n)] + [(0, 0)] * (np.ndim(x) - 1)) if np.ndim(x) else x
        for x in batch
    ]


def _scan_program(
    comp: Any, n_args: int, n_state: int, prologue: bool = False, epilogue: bool = False
) -> Any:
    """`scan` of the step over stacked batches, optionally starting with the prologue
    (no state argument) and ending with the epilogue (returns the result leaves)."""
    step = comp.trace_fn("step")
    start_fn = comp.trace_fn("prologue") if prologue else None
    end_fn = comp.trace_fn("epilogue") if epilogue else None

    def program(*flat: Any) -> list[Any]:
        args = flat[:n_args]
        if start_fn is not None:
            state, stacked = list(start_fn(*args)), flat[n_args:]
        else:
            state, stacked = list(flat[n_args : n_args + n_state]), flat[n_args + n_state :]

        def body(carry: Any, batch: Any) -> tuple[Any, None]:
            return list(step(*args, *carry, *batch)), None

        final, _ = lax.scan(body, state, list(stacked))
        return list(end_fn(*args, *final)) if end_fn is not None else final

    return program


def describe_choices(runner: LocalRunner) -> list[dict[str, Any]]:
    """What `auto` picked: per computation and batch shape ('loop' or 'scan' per client),
    and per computation and platform ('vmap' or 'per-client'), with the measured times."""
    rows = []
    for key, c in runner.choices.items():
        if key[0] == "width":
            rows.append(
                {
                    "program": f"{key[1]:x}",
                    "decision": f"vmap width on {key[2]}",
                    "picked": c.strategy,
                    **c.seconds_per_batch,
                }
            )
        else:
            rows.append(
                {
                    "program": f"{key[0]:x}",
                    "decision": f"reduce of batches {key[1]}",
                    "picked": c.strategy,
                    **c.seconds_per_batch,
                }
            )
    return rows
