"""The Ray runtime: the simulation runtime's waves computed by Ray actors.

A computation is evaluated exactly as by the simulation runtime (lazily, aggregations in
waves, server work in the driver). Only `compute_wave` differs: a wave's cohort is cut
into tasks of consecutive clients, each task runs on a Ray actor, which evaluates the
wave's client dataflow on its clients with the simulation runtime (same chunks, same
strategies, same compiled programs) and returns the *partial* aggregates
(`accumulate.Accumulator.partial`). Partials are merged pairwise on the actors, in a
tree (adjacent tasks first, so the merge order never depends on scheduling); the driver
receives only the root: O(1) values per aggregation, never per-client ones.

What travels:

* once per wave, the wave's portable description (`ray_wave.WaveSpec`): the client dataflow
  graph with its broadcast values, and the aggregations with their server arguments;
* once per context and local computation, the computation itself (pickled, cached on
  each actor with its compiled programs across rounds);
* per task, the task's slice of each per-client argument. For client datasets this is
  the datasets' *recipes* (a `fedlang.simulation.Dataset` reading an on-disk store, a
  generator of batches): workers open and read the data themselves.

Faults: a task whose actor dies is re-run on a replacement actor; the result is
unchanged (tasks are pure functions of the wave and their clients). An error raised by
the computation or by reading a client's data is raised in the driver as it was raised
on the worker (e.g. a `StoreError` naming the client and the file), with a note saying
which clients the task held; the actors stay usable.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import math
import os
import pickle
import sys
import uuid
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from fedlang.core import client_state, computation
from fedlang.runtime import accumulate, chunks, ray_wave, reference, simulation

# Tasks a worker has queued at once: one running, one waiting (its arguments in flight).
_IN_FLIGHT = 2

#: A Ray actor running a `ray_wave.Worker`.
Actor = Any


@dataclasses.dataclass(frozen=True)
class Transfers:
    """What one invocation moved between the driver and the Ray workers.

    Attributes:
      waves: waves computed on Ray.
      tasks: tasks run (retries included).
      retries: tasks re-run because their actor died.
      to_workers: bytes the driver sent (wave descriptions, per-task client slices,
        local computations sent for the first time).
      from_workers: bytes the driver received (the root partials of each wave).
      between_workers: bytes of task partials merged on the actors (not via the driver).
      worker_compilations: XLA programs the workers compiled for this invocation (0
        once every actor has seen the computation's shapes: programs are cached).
      worker_seconds: seconds the workers spent in tasks (all workers together).
    """

    waves: int = 0
    tasks: int = 0
    retries: int = 0
    to_workers: int = 0
    from_workers: int = 0
    between_workers: int = 0
    worker_compilations: int = 0
    worker_seconds: float = 0.0

    def plus(self, **counts: float) -> Transfers:
        return dataclasses.replace(
            self, **{k: getattr(self, k) + v for k, v in counts.items()}
        )


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ImportError(
            "The Ray runtime needs Ray, which is not installed: pip install 'fedlang[ray]'."
        ) from e
    return ray


# -- the actors of a Ray session ----------------------------------------------------------


class _Pool:
    """The actors computing waves, shared by every `RayContext` of this process and Ray
    session (contexts are cheap; actors hold processes, JAX and compiled programs)."""

    def __init__(self, num_workers: int, num_gpus: float, start_timeout: float):
        import ray

        self.num_gpus = num_gpus
        self._cls = ray.remote(num_cpus=0 if num_gpus else 1, num_gpus=num_gpus, max_restarts=0)(
            ray_wave.Worker
        )
        self.actors = [self._start() for _ in range(num_workers)]
        try:
            # An actor Ray cannot place (its CPU or GPU is held by another job, or a node
            # never joins) would make every wave wait forever: fail with what to do.
            ray.get([a.where.remote() for a in self.actors], timeout=start_timeout)
        except ray.exceptions.GetTimeoutError:
            self.close()
            each = "one GPU" if num_gpus else "one CPU"
            raise RuntimeError(
                f"{num_workers} Ray workers ({each} each) did not all start within "
                f"{start_timeout:g} s; the cluster has {ray.cluster_resources()} and "
                f"{ray.available_resources()} free. Ask for fewer workers (num_workers=), "
                "free what other Ray jobs hold, or wait longer (start_timeout=)."
            ) from None

    def _start(self) -> Actor:
        import jax

        config = {
            name: getattr(jax.config, name)
            for name in ("jax_enable_x64", "jax_numpy_dtype_promotion",
                         "jax_default_matmul_precision")
        }
        # The driver's working directory too: pytest's importlib mode, for one, names
        # test modules relative to it without putting it on sys.path.
        return self._cls.remote([*sys.path, os.getcwd()], config)

    def replace(self, slot: int, actor: Actor) -> None:
        """Replaces a dead actor (once, however many of its tasks report it)."""
        import ray

        if self.actors[slot] is actor:
            ray.kill(actor, no_restart=True)
            self.actors[slot] = self._start()

    def close(self) -> None:
        import ray

        for actor in self.actors:
            ray.kill(actor, no_restart=True)
        self.actors = []


_POOLS: dict[tuple[str, int, float], _Pool] = {}  # (session, workers, GPUs per worker)


def _session() -> str:
    import ray

    ctx = ray.get_runtime_context()
    return f"{ctx.gcs_address}/{ctx.get_job_id()}"


def _pool(num_workers: int, num_gpus: float, start_timeout: float) -> _Pool:
    session = _session()
    key = (session, num_workers, num_gpus)
    if key not in _POOLS:
        # One pool per session at a time: another pool's actors hold the CPUs (or GPUs)
        # this one needs, and Ray would wait for them forever.
        for other in [k for k in _POOLS if k[0] == session]:
            _POOLS.pop(other).close()
        _POOLS[key] = _Pool(num_workers, num_gpus, start_timeout)
    return _POOLS[key]


def close_pools() -> None:
    """Stops the actors of every Ray context of this process (before `ray.shutdown()`)."""
    import ray

    pools = list(_POOLS.values())
    _POOLS.clear()
    if ray.is_initialized():
        for p in pools:
            p.close()


# -- the driver ------------------------------------------------------------------------------


class RayRun(simulation.Run):
    """The simulation runtime's evaluation, with each wave computed by Ray actors."""

    ctx: RayContext

    def compute_wave(self, wave: list[simulation.AggThunk]) -> list[chunks.Internal]:
        n = self.num_clients
        if n == 0:
            return super().compute_wave(wave)
        portable = ray_wave.Portable()
        try:
            spec = ray_wave.WaveSpec(
                uuid.uuid4().hex,
                [portable.node(a.input) for a in wave],
                [ray_wave.aggregation_spec(a, portable) for a in wave],
                # One client at a time per worker: a worker holds one CPU (or one GPU).
                dataclasses.replace(
                    self.ctx.options, num_clients=None, progress=False, client_threads=1
                ),
                self.ctx.task_hook,
            )
        except ray_wave.NotPortable:
            # e.g. a function mapped at the clients captures another CLIENTS value:
            # correct here, at the driver.
            return super().compute_wave(wave)
        parts = self.ctx.compute(spec, portable, n)
        accs = [
            ray_wave.OrderedCollect(s.member) if s.uri is None and s.write is None else a.make()
            for a, s in zip(wave, spec.aggregations)
        ]
        for partials in parts:
            for acc, p in zip(accs, partials):
                acc.merge(p)
        return [acc.result() for acc in accs]


class RayContext(simulation.SimulationContext):
    """Runs computations with each wave's client work on Ray actors (module docstring).

    Args:
      options: the simulation runtime's settings, used by every worker (`chunk_size`,
        `strategy`, ...); or give them as keyword arguments.
      num_workers: actors computing waves; None: one per CPU of the cluster (one per GPU
        when `use_gpus` and the cluster has GPUs).
      use_gpus: place one actor per GPU (None: when the cluster has GPUs).
      tasks_per_worker: tasks a wave's cohort is cut into, per worker (more balance the
        load and lose less work to a dead actor; fewer send fewer partials).
      max_retries: tasks re-run after their actor died before the wave fails.
      task_hook: `hook(task_index)` called on the worker before each task, and
        `hook(-1)` before each merge (for fault injection in tests; None normally).
      start_timeout: seconds the workers may take to start (be placed on the cluster
        and import fedlang) before the call fails with what to change.
    """

    name = "ray"

    def __init__(
        self,
        options: simulation.Options | None = None,
        *,
        num_workers: int | None = None,
        use_gpus: bool | None = None,
        tasks_per_worker: int = 2,
        max_retries: int = 3,
        task_hook: ray_wave.Hook | None = None,
        start_timeout: float = 300.0,
        **kwargs: Any,
    ):
        super().__init__(options, **kwargs)
        if num_workers is not None and num_workers < 1:
            raise ValueError(f"num_workers must be a positive number or None, found {num_workers}.")
        if tasks_per_worker < 1:
            raise ValueError(f"tasks_per_worker must be positive, found {tasks_per_worker}.")
        self.num_workers = num_workers
        self.use_gpus = use_gpus
        self.tasks_per_worker = tasks_per_worker
        if start_timeout <= 0:
            raise ValueError(f"start_timeout must be positive seconds, found {start_timeout}.")
        self.max_retries = max_retries
        self.task_hook = task_hook
        self.start_timeout = start_timeout
        self.registry = ray_wave.Registry()
        self.transfers = Transfers()
        self.last_transfers: Transfers | None = None

    def make_run(self, n: int | None) -> simulation.Run:
        return RayRun(self, n)

    def invoke(
        self, comp: computation.Computation, arg: reference.PythonValue
    ) -> reference.PythonValue:
        self.transfers = Transfers()
        try:
            return super().invoke(comp, arg)
        finally:
            self.last_transfers = self.transfers

    def workers(self) -> _Pool:
        """The actors (started on first use, shared with other contexts of this session)."""
        ray = _import_ray()

        if not ray.is_initialized():
            raise RuntimeError(
                "Ray is not running: use fedlang.runtime.ray_context(), or call ray.init() "
                "before making a RayContext."
            )
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0))
        use_gpus = gpus > 0 if self.use_gpus is None else self.use_gpus
        if use_gpus and not gpus:
            raise ValueError("use_gpus=True, but the Ray cluster has no GPUs.")
        cpus = int(resources.get("CPU", 0))
        count = self.num_workers or (gpus if use_gpus else max(cpus, 1))
        have, what = (gpus, "GPUs") if use_gpus else (cpus, "CPUs")
        if count > have:
            raise ValueError(
                f"num_workers={count} asks for one of the cluster's {what} each, but it has "
                f"{have}: each worker would wait for a free one forever. Use num_workers <= "
                f"{have} (or None: one per {what[:-1]}), or add nodes to the cluster."
            )
        return _pool(count, 1 if use_gpus else 0, self.start_timeout)

    def compute(
        self, spec: ray_wave.WaveSpec, sources: ray_wave.Portable, n: int
    ) -> list[list[accumulate.Partial]]:
        """A wave's partials over `n` clients (lists of one partial per aggregation), to
        merge in order: normally one, the merge tree's root; the tasks' partials when an
        actor died while merging."""
        import ray

        pool = self.workers()
        num_tasks = min(n, len(pool.actors) * self.tasks_per_worker)
        size = math.ceil(n / num_tasks)
        bounds = [(s, min(s + size, n)) for s in range(0, n, size)]
        data, tokens, sent = ray_wave.dumps(spec, self.registry)
        spec_ref = [ray.put(data)]  # in a list: actors fetch it once per wave, not per task
        fn_refs = self.registry.refs(tokens)
        self.transfers = self.transfers.plus(waves=1, to_workers=sent + len(data))

        def task_values(i: int) -> tuple[bytes, ray_wave.FunctionRefs]:
            # Serialized when the task is submitted (a cohort's in-memory data is never
            # serialized all at once); (the task's per-client values, computations).
            start, stop = bounds[i]
            part, more, new = ray_wave.dumps_slices(
                [_task_slice(v, start, stop) for v in sources.sources], sources.source_types,
                self.registry,
            )
            self.transfers = self.transfers.plus(to_workers=new + len(part))
            return part, (self.registry.refs(tokens | more) if more - tokens else fn_refs)

        leaves = self._run_tasks(pool, spec.key, spec_ref, bounds, task_values)
        parts = self._merge_tree(pool, spec.key, spec_ref, fn_refs, leaves)
        self.transfers = self.transfers.plus(from_workers=sum(len(p) for p in parts))
        return [pickle.loads(p) for p in parts]

    def _run_tasks(
        self,
        pool: _Pool,
        key: str,
        spec_ref: list[ray_wave.ObjectRef],
        bounds: list[tuple[int, int]],
        task_values: Callable[[int], tuple[bytes, ray_wave.FunctionRefs]],
    ) -> list[ray_wave.ObjectRef]:
        import ray

        pending = collections.deque(range(len(bounds)))
        # status -> (task, slot, actor, partial)
        inflight: dict[ray_wave.ObjectRef, tuple[int, int, Actor, ray_wave.ObjectRef]] = {}
        load = [0] * len(pool.actors)
        done: dict[int, ray_wave.ObjectRef] = {}
        retries = 0
        try:
            while pending or inflight:
                for slot, actor in enumerate(pool.actors):
                    while pending and load[slot] < _IN_FLIGHT:
                        i = pending.popleft()
                        values, refs = task_values(i)
                        status, partial = actor.run_task.options(num_returns=2).remote(
                            key, spec_ref, refs, i, *bounds[i], values
                        )
                        del values
                        inflight[status] = (i, slot, actor, partial)
                        load[slot] += 1
                ready, _ = ray.wait(list(inflight), num_returns=1)
                i, slot, actor, partial = inflight.pop(ready[0])
                load[slot] -= 1
                try:
                    _, size, compiled, seconds = ray.get(ready[0])
                except ray.exceptions.RayActorError as e:
                    retries += 1
                    if retries > self.max_retries:
                        raise RuntimeError(
                            f"Ray actors died {retries} times in one wave (last on clients "
                            f"{bounds[i][0]}..{bounds[i][1] - 1}); giving up. Check the "
                            "workers' logs (out of memory?) or raise max_retries."
                        ) from e
                    pool.replace(slot, actor)
                    pending.append(i)
                    continue
                except ray.exceptions.RayTaskError as e:
                    if isinstance(e.cause, BaseException):
                        raise e.cause from e  # the worker's error, as raised there
                    raise
                done[i] = partial
                self.transfers = self.transfers.plus(
                    tasks=1, between_workers=size, worker_compilations=compiled,
                    worker_seconds=seconds,
                )
        finally:
            if inflight:  # a task failed: let the others finish, so the actors are idle
                ray.wait(list(inflight), num_returns=len(inflight), timeout=600)
            self.transfers = self.transfers.plus(retries=retries)
        return [done[i] for i in range(len(bounds))]

    def _merge_tree(
        self,
        pool: _Pool,
        key: str,
        spec_ref: list[ray_wave.ObjectRef],
        fn_refs: ray_wave.FunctionRefs,
        leaves: list[ray_wave.ObjectRef],
    ) -> list[bytes]:
        """The task partials merged on the actors: [root], or, when an actor died while
        merging, the task partials themselves (they live in the object store, not in
        the actors) for the driver to merge in order."""
        import ray

        level = leaves
        try:
            while len(level) > 1:
                nxt = []
                for j in range(0, len(level) - 1, 2):
                    actor = pool.actors[(j // 2) % len(pool.actors)]
                    nxt.append(actor.merge.remote(key, spec_ref, fn_refs, level[j], level[j + 1]))
                if len(level) % 2:
                    nxt.append(level[-1])
                level = nxt
            return [ray.get(level[0])]
        except ray.exceptions.RayActorError:
            for slot, actor in enumerate(list(pool.actors)):
                try:
                    ray.get(actor.where.remote())
                except ray.exceptions.RayActorError:
                    pool.replace(slot, actor)
            return list(ray.get(leaves))



def _task_slice(values: reference.PerClient, start: int, stop: int) -> reference.PerClient:
    """A task's part of a per-client argument: a list, or a client-state binding's slice
    (the worker reads and writes those clients' states itself)."""
    if isinstance(values, client_state.ClientStates):
        return values.slice(start, stop)
    return list(values[start:stop])


@contextlib.contextmanager
def ray_context(
    address: str | None = None,
    *,
    num_cpus: int | None = None,
    num_workers: int | None = None,
    use_gpus: bool | None = None,
    tasks_per_worker: int = 2,
    runtime_env: dict[str, Any] | None = None,
    **options: Any,
) -> Iterator[RayContext]:
    """Runs computations called in the body on Ray: each wave's clients on Ray actors.

    Args:
      address: a Ray cluster to join (`"auto"`, `"ray://host:10001"`, `"host:6379"`);
        None starts a local Ray instance (stopped at the end of the block). If Ray is
        already initialized in this process, that instance is used and left running.
      num_cpus: CPUs of the local instance (None: all of this machine's).
      num_workers: actors computing waves (None: one per CPU, or per GPU).
      use_gpus: one actor per GPU (None: when the cluster has GPUs).
      tasks_per_worker: tasks each wave's cohort is cut into, per worker.
      runtime_env: Ray's runtime environment for the workers (e.g. `{"py_modules":
        [...]}` so a cluster's machines can import your code).
      **options: the simulation runtime's settings (`chunk_size`, `memory_budget`,
        `strategy`, `num_clients`, ...; see `fedlang.runtime.Options`); every worker
        runs its clients with them.

    Example:
      >>> import numpy as np, fedlang as fl
      >>> @fl.federated_computation(fl.type_at_clients(np.float32))
      ... def mean(x):
      ...   return fl.federated_mean(x)
      >>> with fl.runtime.ray_context(num_cpus=2):  # doctest: +SKIP
      ...   print(mean([1.0, 2.0, 3.0]))
      2.0
    """
    ray = _import_ray()

    from fedlang.core import context as core_context

    started = not ray.is_initialized()
    if started:
        init: dict[str, Any] = {"include_dashboard": False, "runtime_env": runtime_env}
        if address is None:
            init["num_cpus"] = num_cpus
        else:
            init["address"] = address
        with warnings.catch_warnings():
            # Ray starts its processes with fork + exec; JAX, if running, warns of forks.
            warnings.filterwarnings("ignore", "os.fork", RuntimeWarning)
            ray.init(**init)
    ctx = RayContext(
        simulation.Options(**options),
        num_workers=num_workers,
        use_gpus=use_gpus,
        tasks_per_worker=tasks_per_worker,
    )
    try:
        with ctx, core_context.with_context(ctx):
            yield ctx
    finally:
        if started:
            close_pools()
            ray.shutdown()
