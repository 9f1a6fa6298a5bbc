"""Data benchmark: an 8 GB federated dataset through the on-disk store and FedAvg rounds.

1. Generates at least `--gigabytes` (default 8) of EMNIST-shaped data (28x28 float32
   pixels, int32 labels) over `--clients` clients (default 1,100), deterministically
   per client from `(seed, client)`, and streams it into `fedlang.simulation.store.write`
   one client at a time (the generator never holds more than one client).
2. Opens the store memory-mapped and runs `--rounds` FedAvg rounds
   (`fedlang.learning.algorithms.build_weighted_fed_avg`, softmax regression
   784 -> 10, SGD, batch 20, one epoch) with cohorts of `--cohort` (100) clients read
   from the store through `fedlang.simulation.run_training`.
3. Prints a table: conversion time and throughput, per-round time, the time spent
   loading data (reading the store + batching + copying each batch, measured inside
   the clients' dataset iterators, summed over the main and the runtime's staging
   thread, so it overlaps compute) against the round time, and peak memory:
   `ru_maxrss` (peak RSS, which includes file pages of the memory-mapped store that
   the process touched) and the peak of anonymous memory (`RssAnon`, sampled every
   20 ms: the memory the process itself allocated).

The store goes to a new temporary directory (printed at the start) unless `--dir`
says where; it is deleted at the end unless `--keep`.

Usage:
  python bench/data_store.py                    # full run (~15 minutes on 2 cores)
  python bench/data_store.py --gigabytes 0.2 --clients 60 --cohort 20 --rounds 2  # smoke
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import resource
import shutil
import tempfile
import threading
import time

import numpy as np

SIDE, NUM_CLASSES = 28, 10
EXAMPLE_BYTES = SIDE * SIDE * 4 + 4


def client_sizes(num_clients: int, total_bytes: float, seed: int) -> np.ndarray:
    """Lognormal client sizes (sigma 0.5) scaled so the data has at least `total_bytes`."""
    rng = np.random.default_rng([seed, 0])
    raw = rng.lognormal(0.0, 0.5, num_clients)
    target = int(np.ceil(total_bytes / EXAMPLE_BYTES))
    sizes = np.maximum(np.floor(raw / raw.sum() * target), 20).astype(np.int64)
    sizes[: target - sizes.sum()] += 1 if target > sizes.sum() else 0
    return sizes


def client_arrays(index: int, size: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """Client `index`: labels with Dirichlet(0.5) proportions, pixels = per-label
    prototype + Gaussian noise (sigma 0.5), clipped to [0, 1]."""
    protos = np.random.default_rng([seed, 1]).uniform(0, 1, (NUM_CLASSES, SIDE, SIDE)).astype(np.float32)
    rng = np.random.default_rng([seed, 2, index])
    y = rng.choice(NUM_CLASSES, size=size, p=rng.dirichlet(np.full(NUM_CLASSES, 0.5))).astype(np.int32)
    x = protos[y]
    x += 0.5 * rng.standard_normal(x.shape, dtype=np.float32)
    np.clip(x, 0.0, 1.0, out=x)
    return x, y


def _rows(x: np.ndarray, y: np.ndarray):
    for i in range(len(y)):
        yield {"x": x[i], "y": y[i]}


def _source(sizes: np.ndarray, seed: int):
    for i, n in enumerate(sizes):
        x, y = client_arrays(i, int(n), seed)
        yield f"c{i:05d}", _rows(x, y)


class MemorySampler:
    """Samples this process's RssAnon/RssFile from /proc every `interval` seconds."""

    def __init__(self, interval: float = 0.02):
        self.peak = {"RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(interval,), daemon=True)

    def _run(self, interval: float) -> None:
        while not self._stop.is_set():
            try:
                with open("/proc/self/status") as f:
                    for line in f:
                        key = line.split(":")[0]
                        if key in self.peak:
                            self.peak[key] = max(self.peak[key], int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(interval)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _timed(ds, clock: list[float]):
    """`ds` whose iteration time (read + batch + a copy that pages the data in) is added to clock[0]."""
    from fedlang.simulation import Dataset

    def gen():
        it = iter(ds)
        while True:
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                clock[0] += time.perf_counter() - t
                return
            batch = {k: np.array(v) for k, v in batch.items()}  # page the mapped rows in
            clock[0] += time.perf_counter() - t
            yield batch

    return Dataset.from_generator_fn(gen, element_spec=ds.structure)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dir", default=None,
                        help="the directory to write the store in (default: a new temporary directory)")
    parser.add_argument("--gigabytes", type=float, default=8.0)
    parser.add_argument("--clients", type=int, default=1100)
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--memory-budget-mb", type=int, default=128,
                        help="the simulation runtime's staged client data per chunk (its default: 512)")
    parser.add_argument("--keep", action="store_true", help="keep the generated store")
    return parser.parse_args(argv)


def store_dir(requested: str | None) -> pathlib.Path:
    """The directory to write the store in: `requested`, or a new temporary directory."""
    if requested is None:
        return pathlib.Path(tempfile.mkdtemp(prefix="fedlang-data-store-"))
    return pathlib.Path(requested)


def main() -> None:
    args = parse_args()

    import optax

    import fedlang as fl
    import fedlang.simulation as sim
    from fedlang.learning import algorithms, models

    out = store_dir(args.dir)
    path = out / "emnist_like_store"
    print(f"Writing the store to {path}{' (kept: --keep)' if args.keep else ' (deleted at the end)'}", flush=True)
    free = shutil.disk_usage(out.parent if not out.exists() else out).free
    if free < args.gigabytes * 1.2e9:
        raise SystemExit(f"Expected {args.gigabytes * 1.2:.1f} GB free under {out}, found {free / 1e9:.1f} GB.")
    sizes = client_sizes(args.clients, args.gigabytes * 1e9, args.seed)
    rows: list[tuple[str, str]] = []
    try:
        with MemorySampler() as mem:
            t0 = time.perf_counter()
            sim.store.write(path, _source(sizes, args.seed), overwrite=True)
            convert_s = time.perf_counter() - t0
            on_disk = sum(f.stat().st_size for f in path.iterdir())
            convert_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            convert_anon = mem.peak["RssAnon"]
        rows += [
            ("clients / examples", f"{len(sizes):,} / {int(sizes.sum()):,}"),
            ("store size on disk", f"{on_disk / 1e9:.2f} GB"),
            ("convert: time, throughput", f"{convert_s:.0f} s, {on_disk / 1e6 / convert_s:.0f} MB/s"),
            ("convert: peak RSS / peak anon", f"{convert_rss / 1e9:.2f} GB / {convert_anon / 1e9:.2f} GB"),
        ]

        cd = sim.ClientData.from_store(path)
        model_fn = lambda: models.FunctionalModel(  # noqa: E731
            lambda rng: {"w": np.zeros((SIDE * SIDE, NUM_CLASSES), np.float32),
                         "b": np.zeros(NUM_CLASSES, np.float32)},
            lambda p, x: x.reshape(x.shape[0], -1) @ p["w"] + p["b"],
            lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            {"x": (np.float32, [None, SIDE, SIDE]), "y": (np.int32, [None])},
            metrics=[models.Accuracy()])
        process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.05))
        clock = [0.0]
        load_per_round: list[float] = []

        def preprocess(ds, seed):
            return _timed(ds.shuffle(512, seed=seed).batch(20, drop_remainder=True), clock)

        class Split:
            def write(self, round_num, metrics):
                load_per_round.append(clock[0])
                clock[0] = 0.0

            def truncate(self, round_num):
                pass

            def close(self):
                pass

        with MemorySampler() as mem, fl.runtime.simulation_context(memory_budget=args.memory_budget_mb << 20):
            result = sim.run_training(process, cd, sim.UniformSampler(cd.client_ids, args.cohort, seed=args.seed),
                                      args.rounds, preprocess=preprocess, metrics=[Split()], progress=False)
        times = [h["metrics"]["round_time_s"] for h in result.history]
        train = result.history[-1]["metrics"]["train"]["client_work"]["train"]
        peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        steady = slice(1, None) if len(times) > 1 else slice(None)
        load, total = sum(load_per_round[steady]), sum(times[steady])
        rows += [
            ("cohort / rounds", f"{args.cohort} / {args.rounds} (first round compiles)"),
            ("runtime memory_budget", f"{args.memory_budget_mb} MB"),
            ("examples per round (mean)", f"{int(sizes.mean() * args.cohort):,}"),
            ("round time: first / steady mean", f"{times[0]:.1f} s / {np.mean(times[steady]):.1f} s"),
            # The runtime stages the next chunk's clients on a background thread, so the
            # time inside iterators (summed over threads) overlaps compute: not a split.
            ("steady rounds: in data iterators / round time", f"{load:.1f} s / {total:.1f} s"),
            ("last round train loss / accuracy", f"{train['loss']:.3f} / {train['accuracy']:.3f}"),
            ("training: peak RSS (incl. mapped file)", f"{peak_rss / 1e9:.2f} GB"),
            ("training: peak anon / file RSS", f"{mem.peak['RssAnon'] / 1e9:.2f} GB / {mem.peak['RssFile'] / 1e9:.2f} GB"),
        ]
    finally:
        if not args.keep:
            shutil.rmtree(path if args.dir else out, ignore_errors=True)
    rows.append(("machine", f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
                            f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GiB RAM"))
    width = max(len(k) for k, _ in rows)
    print(f"| {'measure'.ljust(width)} | value |\n|{'-' * (width + 2)}|-------|")
    for k, v in rows:
        print(f"| {k.ljust(width)} | {v} |")


if __name__ == "__main__":
    main()
