"""CPU of the bounds check's L2 norm between idle gaps: `np.dot` (OpenBLAS) against the
`np.einsum` that `plans/bounds.py` uses.

A server checks one report at a time, with idle time between reports. After a long
`np.dot`, OpenBLAS's worker threads spin for a while waiting for more work, and that
spinning is CPU time of the server's process. This measures the process's CPU
(user + system, all threads) per call, with `--gap` seconds of sleep between calls, for
vectors of 10^4 to 10^6 float64 values.

Run: python bench/norm.py [--calls N] [--gap SECONDS]   (results in bench/README.md,
"Edge aggregators")
"""

from __future__ import annotations

import argparse
import resource
import time

import numpy as np

from fedlang.deploy.plans import bounds


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def per_call(f, calls: int, gap: float) -> float:
    """Microseconds of the process's CPU per call of `f`, `gap` seconds apart."""
    start = _cpu()
    for _ in range(calls):
        f()
        time.sleep(gap)
    return 1e6 * (_cpu() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--gap", type=float, default=0.005)
    args = parser.parse_args()
    print("| values | np.dot, µs CPU per call | bounds check's norm (einsum), µs CPU per call |")
    print("|---:|---:|---:|")
    for n in (10**4, 10**5, 10**6):
        x = np.random.default_rng(0).random(n)
        ours = per_call(lambda x=x: bounds._l2([x]), args.calls, args.gap)  # first: no spin yet
        time.sleep(1.0)
        dot = per_call(lambda x=x: float(np.dot(x, x)), args.calls, args.gap)
        time.sleep(1.0)  # let OpenBLAS's threads go to sleep before the next size
        print(f"| {n:,} | {dot:,.0f} | {ours:,.0f} |", flush=True)


if __name__ == "__main__":
    main()
