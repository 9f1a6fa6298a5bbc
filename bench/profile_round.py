"""Profiles FedAvg rounds of W1 (cohort 100) on the simulation runtime with cProfile.

Usage: python bench/profile_round.py [--strategy loop|scan|auto] [--cohort 100] [--rounds 3]
Prints the top functions by own time and the cumulative time of the runtime's stages.
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import data
import workloads

import fedlang as fl

STAGES = [
    "simulation.py:*(invoke)",
    "reference.py:*(to_internal)",
    "simulation.py:*(_stage)",
    "lazy.py:*(_chunk)",
    "local_exec.py:*(_map_with_dataset)",
    "local_exec.py:*(run_client)",
    "local_exec.py:*(_fold_loop)",
    "local_exec.py:*(_fold_scan)",
    "local_exec.py:*(_scan_run)",
    "computation.py:*(_run)",
    "structure.py:*(__iter__)",
    "structure.py:*(to_internal)",
    "structure.py:*(to_tensor)",
    "chunks.py:*(stack)",
    "accumulate.py:*(add)",
    "pjit.py:*(cache_miss)",
]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="loop")
    parser.add_argument("--cohort", type=int, default=100)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", default=None, help="write raw pstats here")
    args = parser.parse_args()
    ds = data.FederatedEmnist(0)
    model = workloads.LOGREG
    process = workloads.build_fedavg(model)
    central = workloads.Centralized(model)
    with fl.runtime.simulation_context(strategy=args.strategy):
        state = process.initialize()
        for r in range(2):  # warm-up: compile everything
            cd = [ds.client_batches(i, 20, r, True) for i in ds.sample_cohort(r, args.cohort)]
            state, _ = process.next(state, cd)
        rounds = [
            [ds.client_batches(i, 20, r, True) for i in ds.sample_cohort(r, args.cohort)]
            for r in range(2, 2 + args.rounds)
        ]
        prof = cProfile.Profile()
        t0 = time.perf_counter()
        prof.enable()
        for cd in rounds:
            state, _ = process.next(state, cd)
        prof.disable()
        fed = time.perf_counter() - t0
    params = state
    central.run_loop(params, rounds[0][0][:1])
    t0 = time.perf_counter()
    for cd in rounds:
        central.run_loop(params, [b for c in cd for b in c])
    cent = time.perf_counter() - t0
    steps = sum(len(c) for cd in rounds for c in cd)
    print(
        f"strategy {args.strategy}: fedlang {fed:.3f} s (under cProfile) vs centralized loop "
        f"{cent:.3f} s for {steps} steps ({1e6 * cent / steps:.0f} us/step centralized)"
    )
    stats = pstats.Stats(prof)
    if args.out:
        stats.dump_stats(args.out)
    stats.sort_stats("tottime").print_stats(25)
    print("stage cumulative times:")
    for pattern in STAGES:
        mod, fn = pattern.split(":*")
        for (file, _, name), (_cc, nc, tt, ct, _) in stats.stats.items():  # type: ignore[attr-defined]
            if file.endswith(mod) and f"({name})" == fn:
                print(f"  {pattern:40s} calls {nc:8d}  cum {ct:7.3f} s  own {tt:7.3f} s")


if __name__ == "__main__":
    main()
