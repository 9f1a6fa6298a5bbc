"""Client state: memory and time of a round against the number of clients (issue 25).

    .venv/bin/python bench/client_state.py            # 1,000, 10,000 and 100,000 clients
    .venv/bin/python bench/client_state.py --quick    # 1,000 and 10,000

A round reads every client's state (a vector of `--floats` float32, 4 KiB by default),
updates it (`s <- 0.9 s + scale`), writes it back and averages it. Each size runs in
a fresh process on the simulation runtime, twice: with the states in a
`ClientStateStore` (`store.cohort(ids)`: read and written chunk by chunk), and, for
contrast, with the states as plain Python lists passed in and returned whole. For
each it reports the seconds of a round whose clients are all seen for the first time
(they read the initial state), of a second round (they read the first round's files),
and the peak RSS of each round above the warm process (the kernel's VmHWM, reset
after a warm-up round that compiles the programs).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench"))
import _memory  # noqa: E402


def child(clients: int, floats: int, mode: str) -> dict[str, Any]:
    """Two rounds over `clients` clients in this (fresh) process."""
    import numpy as np

    import fedlang as fl
    from fedlang.simulation import ClientStateStore

    state_t = (np.float32, [floats])

    @fl.jax_computation()
    def initial():
        return np.zeros(floats, np.float32)

    @fl.jax_computation(state_t, np.float32)
    def update(s, scale):
        return 0.9 * s + scale

    @fl.federated_computation(fl.type_at_server(np.float32), fl.type_at_clients(state_t))
    def round_fn(scale, states):
        new = fl.federated_map(update, (states, fl.federated_broadcast(scale)))
        return fl.federated_mean(new), new

    step = fl.with_client_state(round_fn, initial, parameter="states", result=1)
    ids = [f"client-{i:07d}" for i in range(clients)]
    with tempfile.TemporaryDirectory(dir=os.environ.get("FEDLANG_BENCH_TMP")) as tmp:
        store = ClientStateStore(pathlib.Path(tmp) / "states", step.client_state)
        lists: dict[str, Any] = {}

        def run(scale: float, cohort: list[str]) -> Any:
            if mode == "store":
                mean, _ = step(np.float32(scale), store.cohort(cohort))
                return mean
            states = [lists.get(c, np.zeros(floats, np.float32)) for c in cohort]
            mean, new = step(np.float32(scale), states)
            lists.update(zip(cohort, new))
            return mean

        run(0.0, [f"warm-{i}" for i in range(64)])  # compile; 'auto' decides
        lists.clear()
        rows = {}
        for name, scale in (("first", 1.0), ("second", 2.0)):
            before = _memory.rss_bytes()
            reset = _memory.reset_peak()
            start = time.perf_counter()
            mean = run(scale, ids)
            rows[name] = {"seconds": time.perf_counter() - start,
                          "peak_above_before_mb": max(_memory.peak_bytes() - before, 0) / 2**20,
                          "peak_reset": reset}
        expected = 0.9 * 1.0 + 2.0
        assert abs(float(np.asarray(mean)[0]) - expected) < 1e-5, mean
    return {"clients": clients, "floats": floats, "mode": mode, **rows}


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1,000 and 10,000 clients")
    parser.add_argument("--sizes", type=int, nargs="*", help="numbers of clients")
    parser.add_argument("--floats", type=int, default=1024, help="float32s per client state")
    parser.add_argument("--modes", nargs="*", default=["store", "lists"])
    parser.add_argument("--child", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(int(args.child[0]), int(args.child[1]), args.child[2])))
        return []
    sizes = args.sizes or ((1_000, 10_000) if args.quick else (1_000, 10_000, 100_000))
    rows = []
    for mode in args.modes:
        for n in sizes:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(n), str(args.floats), mode],
                check=True, capture_output=True, text=True,
                env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    kib = args.floats * 4 / 1024
    print(f"### A round of client state ({kib:g} KiB per client) against the number of clients\n")
    header = ["states", "clients", "round 1 (s)", "round 2 (s)", "ms per client (round 2)",
              "peak RSS above the warm process, round 1 / round 2 (MB)"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        where = "ClientStateStore" if r["mode"] == "store" else "Python lists"
        lifetime = "" if r["first"]["peak_reset"] else " (lifetime peak)"
        print(f"| {where} | {r['clients']:,} | {r['first']['seconds']:.2f} | "
              f"{r['second']['seconds']:.2f} | "
              f"{1000 * r['second']['seconds'] / r['clients']:.3f} | "
              f"{r['first']['peak_above_before_mb']:.0f} / "
              f"{r['second']['peak_above_before_mb']:.0f}{lifetime} |")
    return rows


if __name__ == "__main__":
    main()
