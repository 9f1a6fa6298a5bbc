"""Peak memory of a FedAvg round against the model's size, with chunks of 8 and with 'auto'.

    .venv/bin/python bench/sim_memory.py                        # S = 16 and 64 MiB, about a minute
    .venv/bin/python bench/sim_memory.py --sizes 64 256 1024    # the README's table (~10 minutes)

The model is one float32 Dense layer of S MiB (`FunctionalModel`, [2048, S / 8 KiB]),
trained by `build_weighted_fed_avg` (SGD) on `--cohort` clients (10), each a generator
dataset of 2 batches of 4 examples, on the simulation runtime with its default options
(strategy 'auto', without the decision file). Each size and setting runs in a fresh
process, one at a time: `chunk_size=8` (what 'auto' picked for every large model
before issue 40: at least 8 clients a chunk) and `auto` (`chunk_size=None`); also
`chunk_size=1` with `--settings`. Reported:
the clients per chunk, the process's RSS when idle (JAX imported, the process built,
before `initialize`), the peak RSS of the round (the kernel's VmHWM, reset after
`initialize`), the peak over idle as a multiple of S (the server's model included),
and the round's seconds (not a benchmark of speed: one round, compilation included).
A setting whose peak would not fit the machine's available memory (from the multiple
measured at the previous size) is skipped, not run into the OOM killer.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _memory  # noqa: E402

SETTINGS = {"chunk_size=8": 8, "chunk_size=1": 1, "auto": None}
# Peak over idle, in S, assumed for a setting before any size was measured (both measured
# on a 2-core VM at S = 64 MiB, with some margin).
FIRST_GUESS = {"chunk_size=8": 34.0, "chunk_size=1": 14.0, "auto": 14.0}
IDLE = 400 << 20  # about what the idle process holds


def child(mib: int, cohort: int, setting: str, strategy: str) -> dict[str, Any]:
    """One FedAvg round of an `mib` MiB model in this (fresh) process."""
    import jax.numpy as jnp
    import numpy as np
    import optax

    import fedlang.simulation as sim
    from fedlang.core import context
    from fedlang.learning import algorithms, models
    from fedlang.runtime import simulation

    d = 2048
    k = (mib << 20) // (4 * d)

    def model_fn() -> models.Model:
        return models.FunctionalModel(
            init_fn=lambda rng: {"w": jnp.zeros([d, k])},
            apply_fn=lambda p, x: x @ p["w"],
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y
            ).mean(),
            input_spec={"x": (np.float32, [None, d]), "y": (np.int32, [None])},
        )

    def rows(seed: int) -> Any:
        rng = np.random.default_rng(seed)
        for _ in range(2):
            yield {"x": rng.random((4, d), dtype=np.float32),
                   "y": rng.integers(0, k, 4).astype(np.int32)}

    class Recording(simulation.SimulationContext):
        """The simulation runtime, noting the chunk sizes it picks."""

        sizes: list[int] = []

        def chunk_size_for(self, wave: list[simulation.AggThunk]) -> int:
            size = super().chunk_size_for(wave)
            self.sizes.append(size)
            return size

    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1))
    clients = [sim.Dataset.from_generator(rows, args=(i,)) for i in range(cohort)]
    idle = _memory.rss_bytes()
    state = process.initialize()
    reset = _memory.reset_peak()
    options = simulation.Options(
        chunk_size=SETTINGS[setting], strategy=strategy, decision_cache=False
    )
    start = time.perf_counter()
    with Recording(options) as ctx, context.with_context(ctx):
        state, metrics = process.next(state, clients)
    seconds = time.perf_counter() - start
    peak = _memory.peak_bytes()
    assert metrics["client_work"]["train"]["num_examples"] == cohort * 8
    return {"mib": mib, "cohort": cohort, "setting": setting, "chunks": sorted(set(ctx.sizes)),
            "idle_mb": idle / 2**20, "peak_mb": peak / 2**20,
            "x": (peak - idle) / (mib << 20), "seconds": seconds, "peak_reset": reset}


def available_bytes() -> int:
    """MemAvailable of /proc/meminfo (the pages a new process can get without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def machine() -> str:
    """The CPU, its cores and the memory, in words."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    with open("/proc/meminfo") as f:
        total = int(f.readline().split()[1]) * 1024
    return f"{model}, {os.cpu_count()} cores, {total / 2**30:.0f} GiB RAM"


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="*", default=[16, 64],
                        help="model sizes S in MiB (default 16 64; the README has 64 256 1024)")
    parser.add_argument("--cohort", type=int, default=10, help="clients per round")
    parser.add_argument("--settings", nargs="*", default=["chunk_size=8", "auto"],
                        choices=list(SETTINGS))
    parser.add_argument("--strategy", default="auto", help="the runtime's strategy option")
    parser.add_argument("--child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        mib, cohort, setting, strategy = args.child
        print(json.dumps(child(int(mib), int(cohort), setting, strategy)))
        return []
    rows: list[dict[str, Any]] = []
    multiple = dict(FIRST_GUESS)
    for mib in sorted(args.sizes):
        for setting in args.settings:
            need, free = int(multiple[setting] * 1.15 * (mib << 20)) + IDLE, available_bytes()
            if need > free:
                rows.append({"mib": mib, "setting": setting,
                             "skipped": f"needs ~{need / 2**30:.0f} GiB, "
                                        f"{free / 2**30:.0f} GiB available"})
                continue
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(mib), str(args.cohort), setting,
                 args.strategy],
                check=True, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            ).stdout
            row = json.loads(out.strip().splitlines()[-1])
            multiple[setting] = max(row["x"], 1.0)
            rows.append(row)
    print(f"### Peak RSS of a FedAvg round of an S MiB model, cohort {args.cohort}\n")
    print(f"{machine()}; strategy {args.strategy!r}.\n")
    header = ["S (MiB)", "chunk_size", "clients per chunk", "idle RSS (MiB)", "peak RSS (MiB)",
              "peak over idle (x S)", "round (s)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        if "skipped" in r:
            print(f"| {r['mib']} | {r['setting']} | skipped: {r['skipped']} | | | | |")
            continue
        lifetime = "" if r["peak_reset"] else " (lifetime peak)"
        print(f"| {r['mib']} | {r['setting']} | {', '.join(map(str, r['chunks']))} | "
              f"{r['idle_mb']:.0f} | {r['peak_mb']:.0f}{lifetime} | {r['x']:.1f} | "
              f"{r['seconds']:.1f} |")
    return rows


if __name__ == "__main__":
    main()
