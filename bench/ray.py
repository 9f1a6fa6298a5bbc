"""W1 FedAvg rounds on a local Ray instance against the in-process simulation runtime.

Each configuration runs in its own process (so its peak RSS, `ru_maxrss`, is its own):
the simulation runtime, and the Ray runtime with 1 and 2 workers on a local instance.
Clients are `bench/data.py`'s lazy clients (a recipe: the generator and the client's
index), so with Ray the workers generate the pixels and the driver never holds them.

Per configuration: the median round time over the timed rounds, the driver's peak RSS,
and for Ray the bytes moved per round between the driver and the workers (wave
descriptions and per-task client recipes out, root partials back) and between workers
(task partials merged in the tree), and the workers' task seconds.

From the 1-worker run it fits a cost model and checks it against the 2-worker run:

    round(W workers) = driver + tasks_seconds / W + merges * ceil(log2(tasks))

where `driver` is the round time not spent in tasks with one worker (evaluation,
serialization, the server step), `tasks_seconds` the workers' total task time, and a
merge a few milliseconds. On N machines of k workers each, W = N * k and the driver
additionally sends the wave description once per machine (bytes / bandwidth).

Usage:
  python bench/ray.py            # cohorts 1,000 and 10,000 (minutes)
  python bench/ray.py --quick    # cohorts 100 and 1,000, one timed round
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = pathlib.Path(__file__).resolve().parent
# This file is bench/ray.py: with bench/ on the path, `import ray` would import it.
sys.path = [p for p in sys.path if pathlib.Path(p or ".").resolve() != HERE]


def _load(name: str) -> Any:
    """Imports bench/NAME.py as a module (not via sys.path, see above)."""
    spec = importlib.util.spec_from_file_location(f"fedlang_bench_{name}", HERE / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def worker(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs one configuration in this process and returns its measurements.

    `runtime` is "simulation" or "ray" (that runtime alone: its peak RSS is the
    driver's), or "paired": the two alternately, round by round on the same cohorts,
    so that the ratio of their round times sees the same machine load.
    """
    from ray import cloudpickle

    import fedlang as fl
    from fedlang.core import context as core_context

    data, workloads = _load("data"), _load("workloads")
    # Ray workers cannot import bench/ modules: the lazy clients travel by value.
    cloudpickle.register_pickle_by_value(data)
    cloudpickle.register_pickle_by_value(workloads)

    ds = data.FederatedEmnist(seed=0, num_clients=max(1000, cfg["cohort"]))
    process = workloads.build_fedavg(workloads.LOGREG)
    contexts: dict[str, Any] = {}
    if cfg["runtime"] in ("simulation", "paired"):
        contexts["simulation"] = fl.runtime.SimulationContext(strategy="scan", decision_cache=False)
    manager: Any = contextlib.nullcontext()
    if cfg["runtime"] in ("ray", "paired"):
        manager = fl.runtime.ray_context(
            num_cpus=2, num_workers=cfg["workers"], strategy="scan", decision_cache=False
        )
    rss_before = _peak_rss_mib()
    times: dict[str, list[float]] = {name: [] for name in ("simulation", "ray")}
    moved = []
    with manager as ray_ctx:
        if ray_ctx is not None:
            contexts["ray"] = ray_ctx
        states = {}
        for name, ctx in contexts.items():
            with core_context.with_context(ctx):
                states[name] = process.initialize()
        for r in range(cfg["warmup"] + cfg["rounds"]):
            cohort = ds.sample_cohort(r, cfg["cohort"])
            for name, ctx in contexts.items():
                clients = [ds.lazy_client(int(i), 20, r, True) for i in cohort]
                with core_context.with_context(ctx):
                    t0 = time.perf_counter()
                    states[name], _ = process.next(states[name], clients)
                    dt = time.perf_counter() - t0
                if r >= cfg["warmup"]:
                    times[name].append(dt)
                    if name == "ray":
                        moved.append(ctx.last_transfers)
    out: dict[str, Any] = dict(cfg)
    out.update(times=times, rss_before_mib=rss_before, peak_rss_mib=_peak_rss_mib())
    for name in contexts:
        out[f"{name}_round_s"] = statistics.median(times[name])
    if len(contexts) == 2:
        out["ratio"] = statistics.median(
            a / b for a, b in zip(times["ray"], times["simulation"]))
    if moved:
        last = moved[-1]
        out.update(
            tasks=last.tasks,
            waves=last.waves,
            to_workers=last.to_workers,
            from_workers=last.from_workers,
            between_workers=last.between_workers,
            worker_seconds=statistics.median(t.worker_seconds for t in moved),
            worker_compilations=last.worker_compilations,
        )
    return out


def run(cfg: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(cfg)],
        capture_output=True, text=True, env=env, check=False,
    )
    if proc.returncode:
        raise RuntimeError(f"{cfg} failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _model(one: dict[str, Any], workers: int, task_seconds: float | None = None) -> float:
    """The cost model fitted on the 1-worker run, predicting `workers` workers (with the
    1-worker run's task seconds, or those given)."""
    driver = one["ray_round_s"] - one["worker_seconds"]
    depth = math.ceil(math.log2(max(one["tasks"] * workers, 2)))
    seconds = one["worker_seconds"] if task_seconds is None else task_seconds
    return driver + seconds / workers + 0.005 * depth


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cohorts 100 and 1,000")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    parser.add_argument("--cohorts", help="comma-separated cohorts (default 1000,10000)")
    parser.add_argument("--out", help="write the results as JSON here")
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return
    cohorts = ([100, 1000] if args.quick else [1000, 10000]) if not args.cohorts else [
        int(c) for c in args.cohorts.split(",")]
    results = []
    for cohort in cohorts:
        rounds = 1 if args.quick else 3 if cohort < 10000 else 2
        configs = [("paired", 1, rounds), ("paired", 2, rounds),
                   ("simulation", 0, 1), ("ray", 2, 1)]
        for runtime, workers, n in configs:
            cfg = {"runtime": runtime, "workers": workers, "cohort": cohort,
                   "warmup": 1, "rounds": n}
            print(f"running {cfg} ...", file=sys.stderr, flush=True)
            results.append(run(cfg))
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"machine: {os.cpu_count()} cores (shared), python {sys.version.split()[0]}\n")
    print("Round times, the two runtimes alternating round by round in one process:\n")
    print("| cohort | Ray workers | simulation round s | Ray round s | Ray / simulation "
          "(median of paired rounds) | MB to workers / round | MB from workers / round | "
          "MB between workers / round | tasks | worker task s | model s (fit on 1 worker) | "
          "model s (this run's task s) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for cohort in cohorts:
        rows = [r for r in results if r["cohort"] == cohort]
        one = next(r for r in rows if r["runtime"] == "paired" and r["workers"] == 1)
        for r in rows:
            if r["runtime"] != "paired":
                continue
            print(f"| {cohort:,} | {r['workers']} | {r['simulation_round_s']:.2f} | "
                  f"{r['ray_round_s']:.2f} | {r['ratio']:.2f}x | {r['to_workers'] / 1e6:.3f} | "
                  f"{r['from_workers'] / 1e6:.3f} | {r['between_workers'] / 1e6:.3f} | "
                  f"{r['tasks']} | {r['worker_seconds']:.2f} | {_model(one, r['workers']):.2f} | "
                  f"{_model(one, r['workers'], r['worker_seconds']):.2f} |")
    print("\nPeak RSS of the driver, each runtime alone in its process:\n")
    print("| cohort | simulation MiB | Ray driver (2 workers) MiB |")
    print("|---|---|---|")
    for cohort in cohorts:
        rows = [r for r in results if r["cohort"] == cohort]
        sim_rss = next(r for r in rows if r["runtime"] == "simulation")["peak_rss_mib"]
        ray_rss = next(r for r in rows if r["runtime"] == "ray")["peak_rss_mib"]
        print(f"| {cohort:,} | {sim_rss:.0f} | {ray_rss:.0f} |")


if __name__ == "__main__":
    main()
