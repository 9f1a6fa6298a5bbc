"""Benchmarks FedAvg rounds on fedlang's runtimes against centralized training in plain JAX.

Every configuration (workload x cohort x runtime/strategy) runs in its own subprocess,
so its peak RSS (`ru_maxrss`) is its own. Per configuration:

* timed run: warm-up rounds, then timed rounds of `process.next`; each round's client
  data is generated *before* the clock starts (lists of dicts of numpy arrays). After
  each timed round, centralized training in plain JAX runs SGD with batch 20 over
  exactly the same batches (a jitted `lax.scan` and a Python loop of jitted steps; the
  faster counts), so the ratio is paired round by round on the same noisy machine.
* memory run (strategy 'auto'): clients are passed as lazy iterables that generate
  their batches when iterated, so the caller never holds the cohort's data; its peak
  RSS is fedlang's own footprint (the cohort-1,000 vs cohort-100 target).

Usage:
  python bench/run_simulation.py            # full run (~20 minutes on 2 CPU cores)
  python bench/run_simulation.py --quick    # smoke run (< 60 s)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
WORKLOADS = {"W1": "logreg", "W2": "cnn"}


# ----------------------------------------------------------------------------
# One configuration (runs in a subprocess)


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def run_config(cfg: dict[str, Any]) -> dict[str, Any]:
    """Runs one configuration in this process and returns its measurements."""
    sys.path.insert(0, HERE)
    import data
    import jax
    import numpy as np
    import workloads

    import fedlang as fl
    from fedlang.runtime import local_exec

    model = workloads.MODELS[WORKLOADS[cfg["workload"]]]
    ds = data.FederatedEmnist(cfg["seed"])
    test = ds.test_set(cfg["test_size"], flat=model.flat)
    accuracy = workloads.make_accuracy(model)
    process = workloads.build_fedavg(model)
    central = workloads.Centralized(model) if cfg["centralized"] else None
    vmapped = None
    on_cpu = jax.default_backend() == "cpu"
    if cfg["centralized"] and (cfg.get("vmapped") or (cfg.get("vmapped") is None and (
        not on_cpu or (cfg["workload"] == "W1" and cfg["cohort"] <= 100)
    ))):
        # On CPU the vmapped CNN is minutes a round (XLA:CPU batches convolutions badly),
        # and W1 at cohort 1,000 tens of seconds (padding to the longest client is computed).
        vmapped = workloads.VmappedFedAvg(model)
    rss_before = _peak_rss_mib()
    # XLA compilations in the process, counted here (not by the runtime) so that any
    # revision is measured the same way.
    compiles = [0]

    def on_event(event: str, duration_secs: float, **kwargs: Any) -> None:
        if event == "/jax/core/compile/backend_compile_duration":
            compiles[0] += 1

    jax.monitoring.register_event_duration_secs_listener(on_event)

    if cfg["runtime"] == "reference":
        ctx_manager = fl.runtime.reference_context()
    else:
        # Options newer than some revisions benchmarked (FEDLANG_REV) are passed only when set.
        extra = {k: cfg[k] for k in ("vmap_width", "decision_cache") if k in cfg}
        ctx_manager = fl.runtime.simulation_context(strategy=cfg["strategy"], **extra)
    times: list[float] = []
    compiled: list[int] = []
    cpu_times: list[float] = []
    vm_times: list[float] = []
    vm_ratios: list[float] = []
    examples: list[int] = []
    cent: dict[str, list[float]] = {"scan": [], "loop": []}
    ratios: list[float] = []
    with ctx_manager as ctx:
        state = process.initialize()
        for r in range(cfg["warmup"] + cfg["rounds"]):
            cohort = ds.sample_cohort(r, cfg["cohort"])
            if cfg["lazy"]:
                client_data: list[Any] = [ds.lazy_client(i, 20, r, model.flat) for i in cohort]
            else:
                client_data = [ds.client_batches(i, 20, r, model.flat) for i in cohort]
            compiled_before = compiles[0]
            c0, t0 = time.process_time(), time.perf_counter()
            new_state, train_loss = process.next(state, client_data)
            dt = time.perf_counter() - t0
            dcpu = time.process_time() - c0  # all threads: less disturbed by a busy machine
            n_compiled = compiles[0] - compiled_before
            if r == 0:
                first_round_s = dt
                first_round_examples = sum(ds.num_examples(i) for i in cohort)
            if r < cfg["warmup"]:
                state = new_state
                continue
            times.append(dt)
            cpu_times.append(dcpu)
            examples.append(sum(ds.num_examples(i) for i in cohort))
            if central is not None:
                batches = [b for c in client_data for b in c]
                c = _time_centralized(
                    central, state, batches, cent, cfg["centralized_methods"], len(times) == 1
                )
                ratios.append(dt / c)
            if vmapped is not None:
                groups = vmapped.prepare(state, client_data)  # compiles outside the clock
                t1 = time.perf_counter()
                vmapped.run(state, groups)
                vm_times.append(time.perf_counter() - t1)
                vm_ratios.append(dt / vm_times[-1])
            compiled.append(n_compiled)
            state = new_state
            print(
                f"  round {r}: {dt:.3f} s, {examples[-1]} examples, loss {float(train_loss):.3f}, "
                f"compiled {n_compiled}",
                file=sys.stderr,
            )
    out: dict[str, Any] = {
        **cfg,
        "round_s": times,
        "median_s": statistics.median(times),
        "median_cpu_s": statistics.median(cpu_times),
        "examples_per_round": statistics.mean(examples),
        "examples_per_s": sum(examples) / sum(times),
        "accuracy": accuracy(state, test),
        "rounds_total": cfg["warmup"] + cfg["rounds"],
        "rss_before_rounds_mib": rss_before,
        "peak_rss_mib": _peak_rss_mib(),
        "first_round_s": first_round_s,
        # Round 1 against a timed round of the same size (rounds differ in examples).
        "first_round_vs_later": first_round_s
        / first_round_examples
        / (sum(times) / sum(examples)),
        "compilations_per_round": compiled,
        "rounds_compiled_after_warmup": sum(1 for n in compiled if n),
        "platform": jax.default_backend(),
    }
    if vm_times:
        out.update(vmapped_median_s=statistics.median(vm_times), ratio_vmapped=statistics.median(vm_ratios))
    if central is not None:
        medians = {k: statistics.median(v) for k, v in cent.items() if v}
        best = min(medians, key=medians.__getitem__)
        out.update(
            centralized_s={k: v for k, v in cent.items() if v},
            centralized_median_s=medians,
            centralized_method=best,
            ratio=statistics.median(ratios),
        )
    if cfg["runtime"] == "simulation" and hasattr(local_exec, "describe_choices"):
        out["choices"] = [
            {k: (list(v) if isinstance(v, tuple) else v) for k, v in c.items()}
            for c in local_exec.describe_choices(ctx.runner)
        ]
        out["auto_picked"] = sorted({c["picked"] for c in out["choices"]})
    del jax, np
    return out


def _time_centralized(
    central: Any,
    params: Any,
    batches: list[Any],
    acc: dict[str, list[float]],
    methods: list[str],
    first: bool,
) -> float:
    """Times centralized SGD over `batches`; returns the faster method's seconds.

    Both methods run on the first timed round; later, a method more than 2x slower than
    the other is skipped (on CPU a scan over the CNN is ~10x slower than the loop).
    """
    import jax.numpy as jnp
    import numpy as np

    params = {k: jnp.asarray(v) for k, v in params.items()}
    medians = {k: statistics.median(v) for k, v in acc.items() if v}
    if not first and len(medians) == 2:
        fast = min(medians, key=medians.__getitem__)
        methods = [m for m in methods if m == fast or medians[m] < 2 * medians[fast]]
    seconds = {}
    for m in methods:
        if m == "scan":
            xs = np.stack([b["x"] for b in batches])
            ys = np.stack([b["y"] for b in batches])
            # Compile outside the clock: the scan's length changes every round.
            compiled = central.scan.lower(params, xs, ys).compile()
            t0 = time.perf_counter()
            jax_out = compiled(params, jnp.asarray(xs), jnp.asarray(ys))
            _block(jax_out)
        else:
            central.run_loop(params, batches[:1])  # compiled after the first round
            t0 = time.perf_counter()
            central.run_loop(params, batches)
        seconds[m] = time.perf_counter() - t0
        acc[m].append(seconds[m])
    return min(seconds.values())


def _block(x: Any) -> None:
    import jax

    jax.block_until_ready(x)


# ----------------------------------------------------------------------------
# The plan, the subprocesses, the table


def plan(quick: bool, seed: int, kind: str = "cpu") -> list[dict[str, Any]]:
    def cfg(workload, cohort, strategy, warmup, rounds, runtime="simulation", lazy=False, methods=None):
        return {
            "workload": workload,
            "cohort": cohort,
            "runtime": runtime,
            "strategy": strategy,
            "warmup": warmup,
            "rounds": rounds,
            "lazy": lazy,
            "centralized": not lazy and runtime == "simulation",
            "centralized_methods": methods or ["scan", "loop"],
            "seed": seed,
            "test_size": 2000 if quick else 10_000,
        }

    if kind == "gpu":
        # The GPU table in ~4 minutes: 2 warm-up + 3 timed rounds per configuration.
        def g(workload, cohort, strategy, **kw):
            return {**cfg(workload, cohort, strategy, 2, 3), "vmapped": True, "test_size": 2000, **kw}

        # The three targets (auto within 1.3x of the vmapped baseline) first, so that a
        # run cut short by its time limit still has them.
        return [
            g("W1", 100, "auto"),
            {**g("W1", 1000, "auto"), "warmup": 1, "rounds": 2},
            g("W2", 100, "auto"),
            *[g("W1", 100, s) for s in ("loop", "scan", "vmap")],
            g("W2", 10, "auto"),
            g("W2", 10, "loop"),
            g("W2", 100, "vmap"),
        ]
    if quick:
        return [
            *[cfg("W1", 10, s, 1, 2) for s in ("loop", "scan", "auto")],
            cfg("W1", 10, "-", 1, 1, runtime="reference"),
            cfg("W2", 2, "loop", 1, 1, methods=["loop"]),
            cfg("W1", 30, "auto", 1, 1, lazy=True),
        ]
    strategies = ("loop", "scan", "auto")
    return [
        *[cfg("W1", c, s, 3, 5) for c in (10, 100) for s in strategies],
        *[cfg("W1", 1000, s, 2, 3) for s in strategies],
        cfg("W1", 10, "-", 1, 3, runtime="reference"),
        cfg("W2", 10, "loop", 2, 3),
        cfg("W2", 10, "scan", 1, 1, methods=["loop"]),  # ~100 s a round, slow compiles
        cfg("W2", 10, "auto", 2, 3),
        *[cfg("W1", c, "auto", 1, 2, lazy=True) for c in (10, 100, 1000)],
        cfg("W2", 10, "auto", 1, 2, lazy=True),
    ]


def run_in_subprocess(cfg: dict[str, Any]) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(cfg)],
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"Configuration {cfg} failed:\n{proc.stderr[-4000:]}")
    sys.stderr.write(proc.stderr[-2000:])  # its rounds and what 'auto' measured
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _label(r: dict[str, Any]) -> str:
    return "reference" if r["runtime"] == "reference" else r["strategy"]


def table(results: list[dict[str, Any]]) -> str:
    """A markdown table: one row per timed configuration, lazy-input RSS beside 'auto'."""
    lazy_rss = {(r["workload"], r["cohort"]): r["peak_rss_mib"] for r in results if r["lazy"]}
    cols = [
        "workload",
        "cohort",
        "runtime",
        "auto picked",
        "s/round (median)",
        "examples/s",
        "centralized s (method)",
        "ratio",
        "vmapped FedAvg s",
        "ratio to vmapped",
        "rounds compiled after warm-up",
        "round 1 s",
        "accuracy",
        "peak RSS MiB (timed)",
        "peak RSS MiB (lazy inputs)",
    ]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in results:
        if r["lazy"]:
            continue
        has_cent = "ratio" in r
        is_auto = r["strategy"] == "auto"
        cells = [
            r["workload"],
            str(r["cohort"]),
            _label(r),
            ",".join(r.get("auto_picked", [])) if is_auto else "-",
            f"{r['median_s']:.3f}",
            f"{r['examples_per_s']:,.0f}",
            f"{min(r['centralized_median_s'].values()):.3f} ({r['centralized_method']})"
            if has_cent
            else "-",
            f"{r['ratio']:.2f}x" if has_cent else "-",
            f"{r['vmapped_median_s']:.3f}" if "vmapped_median_s" in r else "-",
            f"{r['ratio_vmapped']:.2f}x" if "ratio_vmapped" in r else "-",
            f"{r['rounds_compiled_after_warmup']} of {r['rounds']}"
            if "rounds_compiled_after_warmup" in r and r["runtime"] == "simulation"
            else "-",
            f"{r['first_round_s']:.2f}" if "first_round_s" in r else "-",
            f"{r['accuracy']:.3f}",
            f"{r['peak_rss_mib']:.0f}",
            f"{lazy_rss[(r['workload'], r['cohort'])]:.0f}"
            if is_auto and (r["workload"], r["cohort"]) in lazy_rss
            else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def targets(results: list[dict[str, Any]]) -> list[str]:
    def find(workload: str, cohort: int, lazy: bool = False, strategy: str = "auto") -> Any:
        for r in results:
            if (r["workload"], r["cohort"], r["lazy"], r["strategy"]) == (
                workload,
                cohort,
                lazy,
                strategy,
            ) and r["runtime"] == "simulation":
                return r
        return None

    out = []
    for workload, cohort in (("W1", 100), ("W2", 10)):
        r = find(workload, cohort)
        if r is not None:
            best = min(
                (x for x in results if x["workload"] == workload and x["cohort"] == cohort and "ratio" in x),
                key=lambda x: x["ratio"],
            )
            out.append(
                f"{workload} cohort {cohort} <= 1.5x centralized: auto {r['ratio']:.2f}x "
                f"({'met' if r['ratio'] <= 1.5 else 'NOT met'}); best strategy "
                f"{best['strategy']} {best['ratio']:.2f}x"
            )
    r100, r1000 = find("W1", 100, lazy=True), find("W1", 1000, lazy=True)
    if r100 is not None and r1000 is not None:
        growth = r1000["peak_rss_mib"] / r100["peak_rss_mib"] - 1
        out.append(
            f"W1 peak RSS cohort 1000 within 20% of cohort 100 (lazy inputs): "
            f"{r1000['peak_rss_mib']:.0f} vs {r100['peak_rss_mib']:.0f} MiB ({growth:+.0%}, "
            f"{'met' if growth <= 0.2 else 'NOT met'})"
        )
    return out


def machine() -> dict[str, Any]:
    import jax

    import fedlang

    model = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "nproc": os.cpu_count(),
        "cpu": model,
        "ram_gib": round(ram, 1),
        "jax": jax.__version__,
        "python": platform.python_version(),
        "fedlang": os.path.dirname(fedlang.__file__),
        "fedlang_rev": os.environ.get("FEDLANG_REV", "working tree"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="smoke run: few rounds, small cohorts")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--plan", choices=["cpu", "gpu"], default="cpu",
                        help="'gpu': the accelerator table (bench/gpu.sh)")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(run_config(json.loads(args.worker))))
        return
    out_path = args.out or os.path.join(
        HERE, "results_quick.json" if args.quick else "results.json"
    )
    start = time.perf_counter()
    results = []
    for cfg in plan(args.quick, args.seed, args.plan):
        t0 = time.perf_counter()
        r = run_in_subprocess(cfg)
        results.append(r)
        with open(out_path + ".partial", "w") as f:  # survives an interrupted run
            json.dump(results, f)
        extra = f", ratio {r['ratio']:.2f}x" if "ratio" in r else ""
        print(
            f"{r['workload']} cohort {r['cohort']} {_label(r)}{' (lazy)' if r['lazy'] else ''}: "
            f"{r['median_s']:.3f} s/round{extra}, peak RSS {r['peak_rss_mib']:.0f} MiB "
            f"[{time.perf_counter() - t0:.0f} s]",
            flush=True,
        )
    report = {
        "machine": machine(),
        "quick": args.quick,
        "wall_s": time.perf_counter() - start,
        "results": results,
        "targets": targets(results),
    }
    with open(out_path, "w") as f:
        json.dump(report, f, indent=1)
    os.remove(out_path + ".partial")
    print()
    print(table(results))
    print()
    for line in report["targets"]:
        print(line)
    print(f"\nmachine: {report['machine']}; wall {report['wall_s']:.0f} s; results in {out_path}")


if __name__ == "__main__":
    main()
