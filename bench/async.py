"""FedBuff against synchronous FedAvg on the virtual clock: time to accuracy, and the
simulator's own speed.

Workload W1 (logistic regression 784 -> 10 on the EMNIST-shaped synthetic data of
`data.py`, 1,000 clients, batch 20, one local epoch, client SGD 0.1, server SGD
1.0) through the public learning API (`build_weighted_fed_avg`, `build_fed_buff`).
Client times are heavy tailed: a participation lasts `compute * speed + network`
virtual seconds with compute ~ Pareto(scale 1, alpha 1.5) (infinite variance),
a per-device speed ~ LogNormal(1, 0.5) drawn once, and network ~ LogNormal(0.3, 0.5).

Runs (each until the target test accuracy, or the step limit):
* sync FedAvg, cohort 100, each round waiting for its slowest client;
* sync FedAvg, 130 selected (30% over-selection), closing at 100 reports or the deadline;
* FedBuff, concurrency 100, K = 10 (default staleness weight 1/sqrt(1+tau)).

It prints, per run: virtual time to the target, server steps and client updates used
(and discarded: past the deadline or quorum, or too stale) to get there, and the
simulator's speed: client trainings simulated per second of real time, measured on
separate runs of the same number of trainings without evaluation, after a warm-up run
that compiles the programs, the three interleaved three times (median; sync rounds
train only the reports they use).

Usage:
  python bench/async.py            # the full run
  python bench/async.py --quick    # a smoke run (smaller population, lower target)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def make_model_fn() -> Any:
    import jax
    import numpy as np
    import optax
    import workloads

    from fedlang.learning import models

    model = workloads.LOGREG

    def model_fn() -> Any:
        return models.FunctionalModel(
            init_fn=lambda rng: dict(sorted(model.init(jax.random.key(0)).items())),
            apply_fn=model.apply,
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y).mean(),
            input_spec={"x": (np.float32, [None, 784]), "y": (np.int32, [None])},
        )

    return model, model_fn


def client_times() -> Any:
    from fedlang.simulation import clock

    return clock.ClientTimes(
        compute=clock.Pareto(scale=1.0, alpha=1.5),
        network=clock.LogNormal(median=0.3, sigma=0.5),
        device_speed=clock.LogNormal(median=1.0, sigma=0.5),
    )


def run_all(args: argparse.Namespace) -> list[dict[str, Any]]:
    import optax
    import workloads
    from data import FederatedEmnist

    from fedlang.learning import algorithms
    from fedlang.simulation import async_sim

    ds = FederatedEmnist(seed=args.seed, num_clients=args.clients)
    clients = {f"c{i:04d}": ds.lazy_client(i, batch_size=20, flat=True)
               for i in range(args.clients)}
    test = ds.test_set(n=2000, flat=True)
    model, model_fn = make_model_fn()
    accuracy = workloads.make_accuracy(model)

    def evaluate(weights: Any) -> dict[str, float]:
        return {"accuracy": accuracy(weights.trainable, test)}

    def stop(record: Any) -> bool:
        return record.metrics.get("eval", {}).get("accuracy", 0.0) >= args.target

    fed_avg = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1), optax.sgd(1.0))
    fed_buff = algorithms.build_fed_buff(model_fn, optax.sgd(0.1), optax.sgd(1.0),
                                         buffer_size=args.buffer_size)
    times = client_times()
    common = {"client_times": times, "seed": args.seed, "evaluate": evaluate, "stop": stop}
    runs = [
        ("sync FedAvg", lambda steps, **kw: async_sim.run_sync(
            fed_avg, clients, cohort_size=args.cohort, num_rounds=steps, **kw)),
        (f"sync FedAvg +30%, deadline {args.deadline:g} s", lambda steps, **kw: async_sim.run_sync(
            fed_avg, clients, cohort_size=args.cohort, num_rounds=steps, over_selection=0.3,
            deadline=args.deadline, **kw)),
        (f"FedBuff C={args.cohort} K={args.buffer_size}", lambda steps, **kw: async_sim.run_async(
            fed_buff, clients, concurrency=args.cohort, num_steps=steps, **kw)),
    ]
    rows = []
    for name, run in runs:
        is_async = name.startswith("FedBuff")
        per_step = args.buffer_size if is_async else args.cohort
        # warm up: compile the programs these runs use, outside the clock
        run(3 * args.cohort // per_step, client_times=times, seed=args.seed + 1)
        h = run(args.max_updates // per_step, **common)
        last = h[-1]
        rows.append({
            "run": name, "target": args.target, "time_to_target": h.time_to("accuracy", args.target),
            "steps": last.step, "updates": last.client_updates, "discarded": last.discarded,
            "accuracy": last.metrics["eval"]["accuracy"], "virtual_time": last.time,
            "speeds": [], "runtime_calls_per_100": 0.0,
        })
        print(f"  {name}: {rows[-1]}", file=sys.stderr, flush=True)
    # The simulator's speed: the same number of client trainings, without evaluation,
    # the runs interleaved `repeats` times (the machine is shared and noisy): medians.
    for rep in range(args.repeats):
        for row, (name, run) in zip(rows, runs, strict=True):
            is_async = name.startswith("FedBuff")
            per_step = args.buffer_size if is_async else args.cohort
            start = time.perf_counter()
            s = run(args.speed_updates // per_step, client_times=times, seed=args.seed + 2 + rep)
            wall = time.perf_counter() - start
            # sync rounds train only the reports they use; FedBuff also trains refused ones
            trained = s[-1].client_updates + (s[-1].discarded if is_async else 0)
            row["speeds"].append(trained / wall)
            row["runtime_calls_per_100"] = 100 * s.train_calls / trained
    for row in rows:
        row["updates_per_s"] = statistics.median(row["speeds"])
    base = rows[0]["updates_per_s"]
    for row in rows:
        row["speed_ratio"] = row["updates_per_s"] / base
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| run | time to target (virtual s) | server steps | client updates used | "
        "discarded | final accuracy | simulated updates / real s (median) | vs sync FedAvg | "
        "training calls / 100 updates |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        t = "not reached" if r["time_to_target"] is None else f"{r['time_to_target']:.1f}"
        lines.append(
            f"| {r['run']} | {t} | {r['steps']} | {r['updates']} | {r['discarded']} | "
            f"{r['accuracy']:.3f} | {r['updates_per_s']:.0f} | {r['speed_ratio']:.2f} | "
            f"{r['runtime_calls_per_100']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smoke run (under a minute)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    args.clients = 300 if args.quick else 1000
    args.cohort, args.buffer_size, args.deadline = 100, 10, 8.0
    args.target = 0.6 if args.quick else 0.76
    args.max_updates = 1000 if args.quick else 10000  # per run, unless the target is reached
    args.speed_updates = 300 if args.quick else 1000
    args.repeats = 1 if args.quick else 3
    print(f"W1, {args.clients} clients, target accuracy {args.target}, "
          f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
          file=sys.stderr)
    rows = run_all(args)
    print(table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
