"""Asynchronous (FedBuff) and synchronous (FedAvg) training on a virtual clock.

`run_async` simulates buffered asynchronous training: `concurrency` clients train at
once, each from the model version it downloaded when it started, and each finishes
after a duration drawn from `ClientTimes`; the server folds each report as it
arrives and steps when its buffer is full; a finished client is replaced at once
by another idle, available client. `run_sync` simulates synchronous rounds with
over-selection and a deadline: each round selects `ceil(cohort_size * (1 +
over_selection))` clients, closes when `cohort_size` reports arrived or at the
deadline, and uses only the reports that arrived.

Both return a `History` of `Record(time, step, client_updates, metrics, ...)` and
call `evaluate(model_weights)` every `eval_every` server steps. A seed reproduces a
run bit for bit: which client starts, and how long it takes, are counter-based draws
(`clock.rng`).

Speed: clients run on the current runtime (the simulation runtime by default) in
groups, never one at a time. A client's training is deferred until its report is
needed (when it finishes on the virtual clock); then every client started and not yet
trained is trained in one `federated_map` call: with the model broadcast when they all
started from one version, else with each client's own model version as a CLIENTS
value. A synchronous round is one call over its cohort.

Layering: this module imports only `core` and `simulation`; the processes it drives
are described by the Protocols `core.processes.BufferedProcess` (shared with the
deployment's driver) and `SyncProcess`, which
`fedlang.learning`'s `BufferedLearningProcess` and `LearningProcess` satisfy.
"""

from __future__ import annotations

import dataclasses
import math
import time as time_lib
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, cast

import numpy as np

from fedlang.core import computation, operators, processes, tracing, types
from fedlang.simulation import clock

Evaluate = Callable[[Any], Mapping[str, Any]]




class SyncProcess(Protocol):
    """What `run_sync` uses of a synchronous process (`fedlang.learning.LearningProcess`)."""

    def initialize(self) -> Any: ...

    def next(self, state: Any, client_data: Any) -> Any: ...

    def get_model_weights(self, state: Any) -> Any: ...


class ClientSource(Protocol):
    """Client datasets by id (`fedlang.simulation.ClientData`)."""

    @property
    def client_ids(self) -> list[str]: ...

    def create_dataset_for_client(self, client_id: str) -> Any: ...


@dataclasses.dataclass(frozen=True)
class Record:
    """One server step (or the start, step 0) of a simulated run.

    Attributes:
      time: virtual seconds since the start.
      step: server steps so far (rounds, or buffer applications).
      client_updates: client reports used by server steps so far.
      metrics: the process's metrics of this step, plus `'eval'` when evaluated.
      clients: the ids of the clients whose reports this step used.
      discarded: client trainings so far whose reports were not used (arrived
        after a deadline or a quorum, or refused as too stale).
      wall_time: real seconds since the start of the run.
    """

    time: float
    step: int
    client_updates: int
    metrics: Mapping[str, Any]
    clients: tuple[str, ...] = ()
    discarded: int = 0
    wall_time: float = 0.0


class History(list):  # type: ignore[type-arg]
    """A list of `Record`s, with the run's final `state` and `train_calls` (runtime
    calls that trained clients: one per group of clients starting from one model)."""

    state: Any = None
    train_calls: int = 0

    def time_to(self, metric: str, target: float) -> float | None:
        """The first virtual time at which `metrics['eval'][metric] >= target`, or None."""
        for r in self:
            value = r.metrics.get("eval", {}).get(metric)
            if value is not None and float(value) >= target:
                return r.time
        return None


def _ids(client_data: Any) -> list[str]:
    if isinstance(client_data, Mapping):
        ids = [str(c) for c in client_data]
    elif hasattr(client_data, "client_ids") and hasattr(client_data, "create_dataset_for_client"):
        ids = list(client_data.client_ids)
    else:
        raise TypeError(
            "Expected client_data to be a ClientData (client_ids, create_dataset_for_client) "
            f"or a mapping from client id to dataset, found {type(client_data).__name__}."
        )
    if not ids:
        raise ValueError("Expected at least one client in client_data, found none.")
    return ids


def _dataset(client_data: Any, client_id: str) -> Any:
    if isinstance(client_data, Mapping):
        return client_data[client_id]
    return client_data.create_dataset_for_client(client_id)


def _check_count(name: str, value: Any, lowest: int, highest: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lowest or (
            highest is not None and value > highest):
        bound = f">= {lowest}" if highest is None else f"in [{lowest}, {highest}]"
        raise ValueError(f"Expected {name} to be an int {bound}, found {value!r}.")
    return int(value)


def _check_common(client_times: Any, availability: Any, eval_every: int) -> None:
    if not isinstance(client_times, clock.ClientTimes):
        raise TypeError(
            f"Expected client_times to be a clock.ClientTimes, found {type(client_times).__name__}."
        )
    if availability is not None and not isinstance(availability, clock.AvailabilityWindows):
        raise TypeError(
            "Expected availability to be None or a clock.AvailabilityWindows, found "
            f"{type(availability).__name__}."
        )
    _check_count("eval_every", eval_every, 1)


_TRAIN_MANY: dict[tuple[int, bool], tuple[computation.Computation, computation.Computation]] = {}


def train_many(train: computation.Computation, per_client_weights: bool = False
               ) -> computation.Computation:
    """`train` mapped over a group of clients in one runtime call.

    Args:
      train: a local computation `(weights, dataset) -> report`.
      per_client_weights: False: `(weights@SERVER, {dataset}@CLIENTS) ->
        {report}@CLIENTS` (every client starts from the same weights, broadcast);
        True: `({weights}@CLIENTS, {dataset}@CLIENTS) -> {report}@CLIENTS`.
    """
    key = (id(train), per_client_weights)
    cached = _TRAIN_MANY.get(key)
    if cached is not None and cached[0] is train:
        return cached[1]
    param = cast(types.StructType, train.type_signature.parameter)
    weights_t, data_t = param.types
    if per_client_weights:

        @tracing.federated_computation(types.type_at_clients(weights_t),
                                       types.type_at_clients(data_t))
        def train_group(weights, datasets):
            return operators.federated_map(train, (weights, datasets))
    else:

        @tracing.federated_computation(types.type_at_server(weights_t),
                                       types.type_at_clients(data_t))
        def train_group(weights, datasets):
            return operators.federated_map(
                train, (operators.federated_broadcast(weights), datasets))

    _TRAIN_MANY[key] = (train, train_group)
    return train_group


class _Run:
    """Shared bookkeeping: history, evaluation, stopping."""

    def __init__(self, process: Any, evaluate: Evaluate | None, eval_every: int,
                 stop: Callable[[Record], bool] | None):
        self.process, self.evaluate, self.eval_every, self.stop = (
            process, evaluate, eval_every, stop)
        self.history = History()
        self.start = time_lib.perf_counter()
        self.updates = 0
        self.discarded = 0

    def record(self, state: Any, t: float, step: int, metrics: Mapping[str, Any],
               clients: Sequence[str]) -> bool:
        """Appends a record; returns True when `stop` says to stop."""
        metrics = dict(metrics)
        if self.evaluate is not None and step % self.eval_every == 0:
            metrics["eval"] = dict(self.evaluate(self.process.get_model_weights(state)))
        rec = Record(float(t), step, self.updates, metrics, tuple(clients), self.discarded,
                     time_lib.perf_counter() - self.start)
        self.history.append(rec)
        return bool(self.stop(rec)) if self.stop is not None else False


@dataclasses.dataclass
class _Job:
    client: int
    version: int
    start: float
    end: float
    report: Any = None


def run_async(
    process: processes.BufferedProcess,
    client_data: ClientSource | Mapping[str, Any],
    *,
    concurrency: int,
    num_steps: int,
    client_times: clock.ClientTimes | None = None,
    availability: clock.AvailabilityWindows | None = None,
    seed: int = 0,
    evaluate: Evaluate | None = None,
    eval_every: int = 1,
    max_time: float | None = None,
    stop: Callable[[Record], bool] | None = None,
) -> History:
    """Simulates buffered asynchronous training (FedBuff) on the virtual clock.

    Args:
      process: a `BufferedProcess` (e.g. `fedlang.learning.algorithms.build_fed_buff`).
      client_data: the population: a `ClientData`, or a mapping id -> dataset.
      concurrency: clients training at once (at most the population).
      num_steps: server steps (buffer applications) to run.
      client_times: durations of participations (default `ClientTimes()`).
      availability: which clients may start at a time (default: all, always).
      seed: the seed of every draw (which clients start, durations, availability).
      evaluate: `model_weights -> {name: value}`, called at the start and every
        `eval_every` server steps; its result is in `metrics['eval']`.
      eval_every: see `evaluate`.
      max_time: stop at the first server step at or past this virtual time (or at
        the first event past it).
      stop: `record -> bool`, called on each record; True stops the run.

    Returns:
      A `History` (records of step 0, then each server step; `history.state` is the
      final state). Refused stale reports count as `discarded`.

    Raises:
      ValueError, TypeError: for bad arguments (before anything runs).
    """
    ids = _ids(client_data)
    n = len(ids)
    concurrency = _check_count("concurrency", concurrency, 1, n)
    num_steps = _check_count("num_steps", num_steps, 0)
    client_times = clock.ClientTimes() if client_times is None else client_times
    _check_common(client_times, availability, eval_every)
    same_weights, own_weights = train_many(process.train), train_many(process.train, True)
    speeds = client_times.speeds(seed, n)

    run = _Run(process, evaluate, eval_every, stop)
    state = process.initialize()
    queue = clock.EventQueue()
    busy = np.zeros(n, bool)
    untrained: list[_Job] = []             # started jobs not yet trained, in start order
    weights: dict[int, Any] = {}           # version -> the weights its clients downloaded
    in_flight: dict[int, int] = {}         # version -> jobs started from it, not yet folded
    starts = 0
    step = 0
    version_clients: list[str] = []

    def start(t: float) -> None:
        nonlocal starts
        free = ~busy if availability is None else (~busy & availability.mask(seed, n, t))
        candidates = np.flatnonzero(free)
        if candidates.size == 0:
            # nobody to start now: try again when availability changes
            if availability is not None:
                queue.push(availability.next_change(t), None)
            return
        client = int(candidates[clock.rng(seed, clock.STREAM_SELECT, starts).integers(
            candidates.size)])
        duration = float(client_times.durations(seed, starts, [client], n, speeds)[0])
        starts += 1
        model, version = process.client_model(state)
        weights.setdefault(version, model)
        job = _Job(client, version, t, t + duration)
        untrained.append(job)
        in_flight[version] = in_flight.get(version, 0) + 1
        busy[client] = True
        queue.push(t + duration, job)

    def train(job: _Job, pending_now: int) -> None:
        # Every client started and not trained yet, in one runtime call, except those
        # finishing after the last report the run can still use (at most the reports
        # left to fill `num_steps` buffers; refusals may need more: trained when due).
        status = process.status(state)
        needed = (num_steps - step) * int(status["buffer_size"]) - int(status["buffer_fill"])
        horizon = job.end if needed <= pending_now else queue.nth_time(needed - pending_now)
        group = [j for j in untrained if j is job or j.end <= horizon]
        untrained[:] = [j for j in untrained if not (j is job or j.end <= horizon)]
        datasets = [_dataset(client_data, ids[j.client]) for j in group]
        versions = {j.version for j in group}
        if len(versions) == 1:
            reports = same_weights(weights[group[0].version], datasets)
        else:
            reports = own_weights([weights[j.version] for j in group], datasets)
        for j, report in zip(group, reports, strict=True):
            j.report = report
        run.history.train_calls += 1

    stopped = run.record(state, 0.0, 0, {}, ())
    for _ in range(concurrency):
        start(0.0)
    while not stopped and step < num_steps:
        if not queue:
            raise RuntimeError("The async simulation ran out of events with clients idle; "
                               "this is a bug in run_async.")
        t, events = queue.pop_simultaneous()
        if max_time is not None and t > max_time:
            break  # no server step reached max_time (every report refused, or none due)
        restarts = 0
        for i, job in enumerate(events):
            restarts += 1
            if job is None or stopped or step >= num_steps:
                continue
            if job.report is None:
                train(job, len(events) - i)
            busy[job.client] = False
            refused = process.status(state)["refused_stale"]
            state = process.fold(state, job.report, job.version)
            job.report = None
            in_flight[job.version] -= 1
            if process.status(state)["refused_stale"] > refused:
                run.discarded += 1
            else:
                run.updates += 1
                version_clients.append(ids[job.client])
            if process.is_full(state):
                state, metrics = process.apply(state)
                step += 1
                stopped = run.record(state, t, step, metrics, version_clients)
                version_clients = []
                current = process.client_model(state)[1]
                for v in [v for v, k in in_flight.items() if k == 0 and v != current]:
                    in_flight.pop(v)
                    weights.pop(v, None)
                if max_time is not None and t >= max_time:
                    stopped = True
        if not stopped and step < num_steps:
            for _ in range(restarts):
                start(t)
    run.history.state = state
    return run.history


def run_sync(
    process: SyncProcess,
    client_data: ClientSource | Mapping[str, Any],
    *,
    cohort_size: int,
    num_rounds: int,
    over_selection: float = 0.0,
    deadline: float | None = None,
    client_times: clock.ClientTimes | None = None,
    availability: clock.AvailabilityWindows | None = None,
    seed: int = 0,
    evaluate: Evaluate | None = None,
    eval_every: int = 1,
    max_time: float | None = None,
    stop: Callable[[Record], bool] | None = None,
) -> History:
    """Simulates synchronous rounds (FedAvg) with over-selection and a deadline.

    Each round selects `ceil(cohort_size * (1 + over_selection))` available clients
    (uniformly, all if fewer are available) and closes when `cohort_size` of them
    reported, or at `deadline` seconds after it opened, whichever comes first; only
    the reports that arrived are trained into the model (the others are counted as
    `discarded`). A round in which no report arrived takes its deadline and makes no
    server step. Without over-selection or deadline, a round waits for its slowest
    client.

    Args:
      process: a `SyncProcess` (`next(state, datasets) -> (state, metrics)`, e.g.
        `build_weighted_fed_avg`).
      client_data, client_times, availability, seed, evaluate, eval_every, max_time,
      stop: as for `run_async`.
      cohort_size: reports per round.
      num_rounds: rounds to run (server steps; rounds without reports count too).
      over_selection: extra fraction of clients selected (0.3: 30% more).
      deadline: seconds a round waits at most (None: until `cohort_size` reported).

    Returns:
      A `History`.

    Raises:
      ValueError, TypeError: for bad arguments.
    """
    ids = _ids(client_data)
    n = len(ids)
    cohort_size = _check_count("cohort_size", cohort_size, 1, n)
    num_rounds = _check_count("num_rounds", num_rounds, 0)
    if not (isinstance(over_selection, (int, float)) and 0 <= over_selection < math.inf):
        raise ValueError(f"Expected over_selection to be a number >= 0, found {over_selection!r}.")
    if deadline is not None and not (isinstance(deadline, (int, float)) and 0 < deadline < math.inf):
        raise ValueError(f"Expected deadline to be None or seconds > 0, found {deadline!r}.")
    client_times = clock.ClientTimes() if client_times is None else client_times
    _check_common(client_times, availability, eval_every)
    selected = min(n, math.ceil(cohort_size * (1 + over_selection) - 1e-9))
    speeds = client_times.speeds(seed, n)

    run = _Run(process, evaluate, eval_every, stop)
    state = process.initialize()
    t = 0.0
    stopped = run.record(state, t, 0, {}, ())
    for r in range(num_rounds):
        if stopped:
            break
        free = np.ones(n, bool) if availability is None else availability.mask(seed, n, t)
        candidates = np.flatnonzero(free)
        while candidates.size == 0:  # nobody available: wait for the next window
            t = cast(clock.AvailabilityWindows, availability).next_change(t)
            candidates = np.flatnonzero(availability.mask(seed, n, t))  # type: ignore[union-attr]
        gen = clock.rng(seed, clock.STREAM_SELECT, r)
        picked = gen.choice(candidates, min(selected, candidates.size), replace=False)
        durations = client_times.durations(seed, r, picked, n, speeds)
        order = np.argsort(durations, kind="stable")
        quorum = min(cohort_size, picked.size)
        close = float(durations[order[quorum - 1]])
        if deadline is not None:
            close = min(close, float(deadline))
        used = [int(picked[i]) for i in order[:quorum] if durations[i] <= close]
        run.discarded += int(picked.size) - len(used)
        t += close if used or deadline is None else float(deadline)
        metrics: Mapping[str, Any] = {}
        if used:
            out = process.next(state, [_dataset(client_data, ids[c]) for c in used])
            state, metrics = out[0], out[1]
            run.history.train_calls += 1
            run.updates += len(used)
        stopped = run.record(state, t, r + 1, metrics, [ids[c] for c in used])
        if max_time is not None and t >= max_time:
            stopped = True
    run.history.state = state
    return run.history
