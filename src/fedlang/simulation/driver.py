"""`run_training`: the experiment driver loop for any iterative process.

Each round the driver samples a cohort, opens the cohort's datasets lazily, calls
`process.next(state, client_data)`, evaluates every `evaluate_every` rounds, hands a
metrics record to each writer, and checkpoints the whole run every `checkpoint_every`
rounds. It needs only `process.initialize()` and `process.next(state, data)` returning
`(state, metrics)` or an object with `.state` and `.metrics` (a `LearningProcess`),
so it drives `fedlang.templates.IterativeProcess`es and `fedlang.learning` algorithms
alike.

A process whose clients keep state (`process.client_state` is not None: SCAFFOLD,
Ditto, ...) also needs a `ClientStateStore`: each round the driver passes
`store.cohort(client_ids)` as the third argument of `next`, and the round's new
client states are committed to the store with the round. The store is checkpointed
with the run: each checkpoint records the store's version, the store keeps every
version a kept checkpoint may return to, and resuming rolls it back to the
checkpoint's version (so a round the store committed after the last checkpoint is
redone, exactly). A fresh run needs a store no round has written (version 0), and
with checkpoints it first saves round 0, so a run killed before its first
checkpoint resumes from the start.

Resuming is exact. All randomness the driver controls is counter based: the sampler
draws round `r`'s cohort from `(sampler seed, r)`, and each client's `preprocess`
seed is `derive_seed(seed, r, client_id)`. A checkpoint holds the state's exact bytes,
the sampler state and the round number, so a run stopped after round `k` and resumed
reaches the same final weights, bit for bit, as an uninterrupted run (given a
deterministic process: same runtime settings, CPU).

Example:
  >>> from fedlang.simulation import sampling
  >>> class Count:  # any process: initialize() and next(state, data) -> (state, metrics)
  ...     def initialize(self):
  ...         return {'n': 0}
  ...     def next(self, state, data):
  ...         return {'n': state['n'] + len(data)}, {'clients': len(data)}
  >>> result = run_training(Count(), lambda round_num, ids: ids,
  ...                       sampling.UniformSampler(['a', 'b', 'c'], 2, seed=0), rounds=3,
  ...                       progress=False)
  >>> result.state, result.history[-1]['metrics']['train']
  ({'n': 6}, {'clients': 2})
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import pathlib
import sys
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from fedlang.core import status as status_lib
from fedlang.simulation import checkpoint as checkpoint_lib
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation import metrics as metrics_lib
from fedlang.simulation import state_store as state_store_lib
from fedlang.simulation import writers as writers_lib


@dataclasses.dataclass(frozen=True)
class TrainingResult:
    """What `run_training` returns.

    Attributes:
      state: the process state after the last round.
      round_num: the number of completed rounds (equal to `rounds`).
      history: `{'round': r, 'metrics': {...}}` for each round run by this call, with
        metrics as plain Python (`'train'`, `'eval'` when evaluated, timings).
      resumed_from: the checkpoint round this call resumed from, or None.
      checkpoint: the newest checkpoint written, or None.
    """

    state: Any
    round_num: int
    history: list[dict[str, Any]]
    resumed_from: int | None = None
    checkpoint: pathlib.Path | None = None


STOPPING = "stopping after this round (Ctrl-C again to stop now)"


class TrainingInterrupted(KeyboardInterrupt):
    """Ctrl-C (SIGINT) stopped `run_training`; `result` holds what was done.

    The first Ctrl-C stops at the end of the round in progress and checkpoints the
    rounds done (with `checkpoint_dir`), so running the same training again resumes
    with nothing lost; a second one stops at once, mid-round (see
    `fedlang.core.status.defer_interrupts`, which `run_training` enters). It is a
    `KeyboardInterrupt`, so code that does not catch it stops as Ctrl-C stops it.

    Attributes:
      result: a `TrainingResult` whose `round_num` is the rounds completed, `history`
        the rounds this call ran and `checkpoint` the newest checkpoint (None if none).
      rounds: the rounds the run was asked for.
      checkpoint_round: the round of `result.checkpoint` (None without one).
    """

    def __init__(self, result: TrainingResult, rounds: int, checkpoint_round: int | None):
        super().__init__(f"stopped after round {result.round_num} of {rounds}")
        self.result = result
        self.rounds = rounds
        self.checkpoint_round = checkpoint_round


def derive_seed(seed: int, round_num: int, client_id: str) -> int:
    """The seed of one client's data pipeline in one round: a function of
    `(seed, round_num, client_id)` only, so resumed runs shuffle identically."""
    key = zlib.crc32(str(client_id).encode())
    return int(np.random.SeedSequence(int(seed), spawn_key=(int(round_num), key)).generate_state(1)[0])


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None).malloc_trim  # glibc only (musl has none)
    except (OSError, AttributeError):
        return None


def release_free_memory() -> None:
    """Hands memory the process freed back to the OS (glibc's `malloc_trim`; elsewhere
    a no-op), called by `run_training` after each round.

    A round allocates and frees a cohort's batches on two threads (the simulation
    runtime stages the next chunk of clients on a background thread), and glibc keeps
    the freed pages in its arenas. On the data benchmark (cohorts of 100 from an Arrow
    store), once the round's batches are freed this call takes anonymous RSS between
    rounds from ~850 MB to ~240 MB and the next round's peak 30-60 MB lower; it costs
    under a millisecond. (Batches still held by reference cycles are freed only by the
    cyclic GC, later; no `gc.collect()` here: it costs ~0.2 s with JAX loaded.)
    """
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def _split_output(out: Any, stateful: bool = False) -> tuple[Any, Any]:
    if hasattr(out, "state") and hasattr(out, "metrics"):
        return out.state, out.metrics
    if isinstance(out, tuple) and len(out) == 2:
        return out
    if stateful and isinstance(out, tuple) and len(out) == 3:
        return out[0], out[1]  # (state, metrics, client states)
    raise TypeError(
        "Expected process.next to return (state, metrics) or an object with .state and "
        f".metrics, found {type(out).__name__}. Wrap a state-only process so next returns "
        "(state, {})."
    )


def _sampler_config(sampler: Any) -> dict[str, Any]:
    config: dict[str, Any] = {"kind": type(sampler).__name__}
    if hasattr(sampler, "get_state"):
        config.update({k: v for k, v in sampler.get_state().items() if k != "round_num"})
    if hasattr(sampler, "cohort_size"):
        config["cohort_size"] = int(sampler.cohort_size)
    ids = getattr(sampler, "client_ids", None)
    if ids is not None:
        config["num_clients"] = len(ids)
        config["client_ids_crc32"] = zlib.crc32("\n".join(map(str, ids)).encode())
    return metrics_lib.to_python(config)


def _data_fn(train_data: Any, preprocess: Callable[..., Any] | None, seed: int
             ) -> Callable[[int, list[str]], Any]:
    if isinstance(train_data, client_data_lib.ClientData):

        def make(round_num: int, cohort: list[str]) -> list[dataset_lib.Dataset]:
            datasets = [train_data.create_dataset_for_client(cid) for cid in cohort]
            if preprocess is None:
                return datasets
            return [preprocess(ds, derive_seed(seed, round_num, cid)) for ds, cid in zip(datasets, cohort)]

        return make
    if callable(train_data):
        if preprocess is not None:
            raise ValueError(
                "Expected preprocess only with a ClientData, found a train_data function too; "
                "apply the preprocessing inside the function."
            )
        return train_data
    raise TypeError(
        f"Expected train_data to be a ClientData or a function (round_num, client_ids) -> "
        f"client data, found {type(train_data).__name__}."
    )


def _pace(marks: Sequence[tuple[int, float]], total: int) -> tuple[float, float]:
    """`(seconds per round, seconds left)` from `marks`, `(round done, time)` from the
    run's start on: both from one measurement, the wall time of
    whole rounds (training, evaluation, checkpoints, writers), leaving out the run's
    first round (compilation) once there is a later one.

    Example:
      >>> _pace([(0, 0.0), (1, 20.0), (2, 21.0), (3, 22.0)], total=10)
      (1.0, 7.0)
    """
    first, last = (marks[1] if len(marks) > 2 else marks[0]), marks[-1]
    rate = (last[1] - first[1]) / max(last[0] - first[0], 1)
    return rate, rate * max(total - last[0], 0)


class _Progress:
    """A rich progress bar (rounds, time per round and ETA from one measurement: `_pace`,
    latest metrics, and what a slow step is doing, e.g. the runtime measuring:
    `fedlang.core.status`), or nothing."""

    def __init__(self, enabled: bool | None, total: int, start: int,
                 clock: Callable[[], float] | None = None):
        self._bar: Any = None
        self._showing = contextlib.ExitStack()
        self._clock, self._total = clock or time.perf_counter, total
        self._marks = [(start, self._clock())]
        if enabled is False:
            return
        from rich import console as rich_console
        from rich import progress as rp

        console = rich_console.Console(stderr=True)
        if enabled is None and not console.is_terminal:
            return
        self._bar = rp.Progress(
            rp.TextColumn("[bold]round {task.completed}/{task.total}"),
            rp.BarColumn(bar_width=24),
            rp.TextColumn("{task.fields[round_time]}"),
            rp.TimeElapsedColumn(),
            rp.TextColumn("ETA {task.fields[eta]}"),
            rp.TextColumn("{task.fields[summary]}"),
            rp.TextColumn("[dim]{task.fields[status]}"),
            console=console,
            transient=False,
        )
        self._bar.start()
        self._task = self._bar.add_task("rounds", total=total, completed=start,
                                        round_time="", eta="-:--:--", summary="", status="")
        self._latest: dict[str, float] = {}
        self._showing.enter_context(status_lib.showing(self._status))

    def _status(self, message: str) -> None:
        self._bar.update(self._task, status=message)

    def update(self, round_num: int, flat: Mapping[str, Any]) -> None:
        if self._bar is None:
            return
        self._marks.append((round_num, self._clock()))
        rate, left = _pace(self._marks, self._total)
        self._latest.update(_short_metrics(flat))  # evaluation metrics persist between evaluations
        summary = "  ".join(f"{k} {v:.3g}" for k, v in self._latest.items())
        self._bar.update(self._task, completed=round_num, round_time=f"{rate:.2f}s/round",
                         eta=str(datetime.timedelta(seconds=round(left))), summary=summary,
                         status="")

    def close(self) -> None:
        self._showing.close()
        if self._bar is not None:
            self._bar.stop()


def _short_metrics(flat: Mapping[str, Any], limit: int = 4) -> dict[str, float]:
    """Losses and accuracies among flattened metrics, with short labels ('eval acc')."""
    out: dict[str, float] = {}
    for key, value in metrics_lib.scalars(flat).items():
        head, tail = key.split("/", 1)[0], key.rsplit("/", 1)[-1]
        if tail in ("loss", "accuracy") and len(out) < limit:
            label = {"loss": "loss", "accuracy": "acc"}[tail]
            out[label if head == "train" else f"{head} {label}"] = float(value)
    return out


def run_training(
    process: Any,
    train_data: client_data_lib.ClientData | Callable[[int, list[str]], Any],
    sampler: Any,
    rounds: int,
    *,
    preprocess: Callable[[dataset_lib.Dataset, int], Any] | None = None,
    evaluation: Callable[[Any], Any] | None = None,
    evaluate_every: int = 1,
    metrics: Sequence[writers_lib.MetricsWriter] = (),
    checkpoint_dir: str | pathlib.Path | None = None,
    checkpoint_every: int = 1,
    keep_checkpoints: int = 2,
    resume: bool = True,
    config: Mapping[str, Any] | None = None,
    seed: int = 0,
    progress: bool | None = None,
    client_state_store: state_store_lib.ClientStateStore | None = None,
) -> TrainingResult:
    """Runs `rounds` rounds of `process` over sampled cohorts, resuming if it can.

    Args:
      process: has `initialize()` and `next(state, client_data)`, which returns
        `(state, metrics)` or an object with `.state` and `.metrics`.
      train_data: a `ClientData` (the cohort's datasets, optionally through
        `preprocess`, are passed to `next`), or a function
        `(round_num, client_ids) -> client data` for full control.
      sampler: has `sample() -> client ids`; with `checkpoint_dir` also
        `get_state()`/`set_state()` (e.g. `UniformSampler`).
      rounds: the total number of rounds (including those of a resumed checkpoint).
      preprocess: `preprocess(dataset, seed) -> dataset` for each client of each
        round, e.g. `lambda ds, s: ds.shuffle(100, seed=s).batch(20)`; `seed` is
        `derive_seed(seed, round_num, client_id)`.
      evaluation: `evaluation(state) -> metrics`, run after rounds divisible by
        `evaluate_every` and after the last round.
      evaluate_every: rounds between evaluations.
      metrics: writers (see `fedlang.simulation.writers`, `default_writers(dir)`).
      checkpoint_dir: where checkpoints go; None disables them.
      checkpoint_every: rounds between checkpoints (the last round is always saved).
      keep_checkpoints: how many of the newest checkpoints to keep.
      resume: continue from the newest checkpoint in `checkpoint_dir` if there is one;
        False requires that `checkpoint_dir` holds no checkpoint (nothing is deleted).
      config: JSON-able description of the run (model, optimizers, data, ...); with
        the seeds, sampler and state structure it forms the checkpoint fingerprint,
        so a checkpoint of another configuration is refused.
      seed: the seed of the clients' `preprocess` seeds.
      progress: show a progress bar; None shows one when stderr is a terminal.
      client_state_store: for a process whose clients keep state (its
        `client_state` is not None), where that state lives:
        `ClientStateStore(directory, process.client_state)`. It is checkpointed and
        resumed with the run (see the module docstring).

    Returns:
      A `TrainingResult`.

    Raises:
      CheckpointMismatchError: (a `ValueError`) if the checkpoint in `checkpoint_dir`
        is from a different configuration.
      CheckpointError: if the newest checkpoint is corrupt.
      ValueError: for invalid counts, or a checkpoint beyond `rounds`.
      FileExistsError: with `resume=False` when `checkpoint_dir` has checkpoints.
      TypeError: for a process, sampler or data of the wrong kind, or a process
        that keeps client state without a `client_state_store` (or the reverse).
      ClientStateError: (a `ValueError`) a store of another state type, a fresh run
        given a store that rounds already wrote, or a checkpoint without the store's
        version.
    """
    for name, value, low in (("rounds", rounds, 0), ("evaluate_every", evaluate_every, 1),
                             ("checkpoint_every", checkpoint_every, 1)):
        if not isinstance(value, int | np.integer) or value < low:
            raise ValueError(f"Expected {name} to be an integer >= {low}, found {value!r}.")
    if not (hasattr(process, "initialize") and hasattr(process, "next")):
        raise TypeError(
            f"Expected a process with initialize() and next(state, data), found {type(process).__name__}."
        )
    if not hasattr(sampler, "sample"):
        raise TypeError(f"Expected a sampler with sample(), found {type(sampler).__name__}.")
    if checkpoint_dir is not None and not (hasattr(sampler, "get_state") and hasattr(sampler, "set_state")):
        raise TypeError(
            f"Expected a sampler with get_state()/set_state() to checkpoint, found "
            f"{type(sampler).__name__}. Use fedlang.simulation.UniformSampler or add them."
        )
    store = _check_store(process, client_state_store)
    make_data = _data_fn(train_data, preprocess, seed)
    run_config = {"config": metrics_lib.to_python(dict(config or {})), "seed": int(seed),
                  "sampler": _sampler_config(sampler)}

    # Ctrl-C stops at the end of a round (a KeyboardInterrupt inside JAX is unsafe)
    with status_lib.defer_interrupts(STOPPING) as interrupts:
        return _run(process, make_data, sampler, rounds, evaluation, evaluate_every, metrics,
                    checkpoint_dir, checkpoint_every, keep_checkpoints, resume, run_config,
                    progress, interrupts, store)


def _run(process: Any, make_data: Callable[[int, list[str]], Any], sampler: Any, rounds: int,
         evaluation: Callable[[Any], Any] | None, evaluate_every: int,
         metrics: Sequence[writers_lib.MetricsWriter],
         checkpoint_dir: str | pathlib.Path | None, checkpoint_every: int, keep_checkpoints: int,
         resume: bool, run_config: dict[str, Any], progress: bool | None,
         interrupts: status_lib.Interrupts,
         store: state_store_lib.ClientStateStore | None) -> TrainingResult:
    """`run_training` once its arguments are checked, with Ctrl-C deferred to a round's end."""
    state = process.initialize()
    fp = checkpoint_lib.fingerprint(run_config, state)
    start, resumed_from, last_ckpt = 0, None, None
    if checkpoint_dir is not None and not resume and checkpoint_lib.latest(checkpoint_dir):
        raise FileExistsError(
            f"Expected no checkpoints in {checkpoint_dir} for a fresh run (resume=False), found "
            f"{len(checkpoint_lib.checkpoints(checkpoint_dir))}. Delete them, pass another "
            "checkpoint_dir, or resume=True to continue that run."
        )
    if checkpoint_dir is not None and resume and (path := checkpoint_lib.latest(checkpoint_dir)):
        ckpt = checkpoint_lib.load(path)
        state = ckpt.restore(state, fp, run_config)
        if ckpt.round_num > rounds:
            raise ValueError(
                f"Expected rounds >= {ckpt.round_num} (the checkpoint {path} is that far), found "
                f"rounds={rounds}. Pass more rounds or a fresh checkpoint_dir."
            )
        sampler.set_state(ckpt.driver_state["sampler"])
        start = resumed_from = ckpt.round_num
        last_ckpt = path
        if store is not None:
            store.rollback(_store_version(ckpt.driver_state, path))
    elif store is not None:
        last_ckpt = _start_store(store, checkpoint_dir, state, fp, run_config, sampler,
                                 keep_checkpoints) or last_ckpt
    for w in metrics:
        w.truncate(start)

    history: list[dict[str, Any]] = []
    done = saved = start

    def save() -> pathlib.Path:
        assert checkpoint_dir is not None
        return _save(checkpoint_dir, done, state, fp, run_config, sampler, keep_checkpoints,
                     store)

    def interrupted() -> TrainingInterrupted:
        return TrainingInterrupted(TrainingResult(state, done, history, resumed_from, last_ckpt),
                                   rounds, None if last_ckpt is None else saved)

    bar = _Progress(progress, rounds, start)
    try:
        for round_num in range(start + 1, rounds + 2):  # + 1: a Ctrl-C in the last round
            if interrupts.requested():
                if checkpoint_dir is not None and done > saved:
                    with interrupts.shielded():
                        last_ckpt, saved = save(), done  # nothing done is lost
                raise interrupted()
            if round_num > rounds:
                break
            t0 = time.perf_counter()
            cohort = list(sampler.sample())
            if store is None:
                out = process.next(state, make_data(round_num, cohort))
            else:
                out = process.next(state, make_data(round_num, cohort),
                                   store.cohort(map(str, cohort)))
            state, train_metrics = _split_output(out, store is not None)
            release_free_memory()  # the round's data is garbage now
            record: dict[str, Any] = {"train": metrics_lib.to_python(train_metrics)}
            record["round_time_s"] = time.perf_counter() - t0
            if evaluation is not None and (round_num % evaluate_every == 0 or round_num == rounds):
                t1 = time.perf_counter()
                record["eval"] = metrics_lib.to_python(evaluation(state))
                record["eval_time_s"] = time.perf_counter() - t1
            for w in metrics:
                w.write(round_num, record)
            history.append({"round": round_num, "metrics": record})
            done = round_num
            if checkpoint_dir is not None and (round_num % checkpoint_every == 0 or round_num == rounds):
                last_ckpt, saved = save(), done
            bar.update(round_num, metrics_lib.flatten_metrics(record))
    except KeyboardInterrupt as e:  # a second Ctrl-C: at once, mid-round
        if isinstance(e, TrainingInterrupted):
            raise
        raise interrupted() from e
    finally:
        with interrupts.shielded():  # metrics files and the plot are written whole
            bar.close()
            for w in metrics:
                w.close()
    return TrainingResult(state, rounds, history, resumed_from, last_ckpt)


def _save(checkpoint_dir: str | pathlib.Path, round_num: int, state: Any, fp: str,
          run_config: Mapping[str, Any], sampler: Any, keep: int,
          store: state_store_lib.ClientStateStore | None) -> pathlib.Path:
    """Saves a checkpoint; with client state, records the store's version and keeps
    every version the checkpoints kept may return to."""
    driver_state: dict[str, Any] = {"sampler": metrics_lib.to_python(sampler.get_state())}
    if store is not None:
        driver_state["client_state_version"] = store.version
    path = checkpoint_lib.save(checkpoint_dir, round_num, state, fingerprint=fp,
                               config=run_config, driver_state=driver_state, keep=keep)
    if store is not None:
        oldest = checkpoint_lib.checkpoints(checkpoint_dir)[0]
        store.retain_from(_store_version(checkpoint_lib.read_header(oldest)["driver_state"], oldest))
    return path


def _check_store(process: Any, store: Any) -> state_store_lib.ClientStateStore | None:
    spec: Any = getattr(process, "client_state", None)
    if spec is None and store is None:
        return None
    if store is None:
        raise TypeError(
            "Expected a client_state_store: this process keeps client state "
            f"({spec.state_type}). Pass client_state_store=fedlang.simulation.ClientStateStore("
            "directory, process.client_state)."
        )
    if spec is None:
        raise TypeError(
            "Expected no client_state_store: this process keeps no client state "
            "(process.client_state is None)."
        )
    if not isinstance(store, state_store_lib.ClientStateStore):
        raise TypeError(
            f"Expected client_state_store to be a fedlang.simulation.ClientStateStore, found "
            f"{type(store).__name__}."
        )
    if store.state_type != spec.state_type:
        raise state_store_lib.ClientStateError(
            f"Expected a client-state store of {spec.state_type} states for this process, found "
            f"one of {store.state_type} at {store.root}."
        )
    return store


def _start_store(store: state_store_lib.ClientStateStore, checkpoint_dir: Any, state: Any,
                 fp: str, run_config: Mapping[str, Any], sampler: Any, keep: int
                 ) -> pathlib.Path | None:
    """A fresh run's store: unused; with checkpoints, saved as round 0 at once."""
    if store.version != 0:
        raise state_store_lib.ClientStateError(
            f"Expected an unused client-state store for a fresh run, found {store.root} at "
            f"version {store.version}: rounds of another run wrote it. Pass a fresh directory, "
            "or resume that run (its checkpoint_dir, resume=True)."
        )
    if checkpoint_dir is None:
        store.retain_from(None)
        return None
    store.retain_from(0)
    return _save(checkpoint_dir, 0, state, fp, run_config, sampler, keep, store)


def _store_version(driver_state: Mapping[str, Any], path: pathlib.Path) -> int:
    version = driver_state.get("client_state_version")
    if not isinstance(version, int):
        raise state_store_lib.ClientStateError(
            f"Expected the checkpoint {path} to record a client-state version, found none: it "
            "was saved by a run without client state. Resume with the run's own settings."
        )
    return version
