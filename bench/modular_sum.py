"""Secure modular sums in the simulation runtime: uint64 arithmetic against exact Python
integers, on the same chunk in one run.

`federated_secure_modular_sum` and `federated_secure_sum_bitwidth` are accumulated by
`runtime.accumulate.ModularSum`. A leaf whose moduli allow it is summed in uint64; other
leaves in Python integers (object arrays). This times both paths on one chunk of clients
(the exact path forced on the same accumulator type) and checks they agree.

    python bench/modular_sum.py [--clients 100] [--size 100000] [--repeats 3]
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from fedlang.core import types
from fedlang.runtime import accumulate


def _time(x: np.ndarray, modulus: int, fast: bool, repeats: int) -> tuple[float, np.ndarray]:
    member = types.TensorType(x.dtype, list(x.shape[1:]))
    best, result = float("inf"), None
    for _ in range(repeats):
        acc = accumulate.ModularSum(member, [modulus], lambda n: [modulus], [modulus])
        if not fast:
            acc.fast = [False]  # the exact Python-integer path, as before the uint64 one
        start = time.perf_counter()
        acc.add(x, x.shape[0])
        result = acc.result()
        best = min(best, time.perf_counter() - start)
    return best, np.asarray(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--size", type=int, default=100_000)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    print(f"{args.clients} clients x {args.size} values, best of {args.repeats}\n")
    print("| input | modulus | uint64 path | exact Python integers | ratio |")
    print("|---|---|---:|---:|---:|")
    for dtype, modulus in ((np.uint32, 2**32), (np.int32, 2**20), (np.int32, 1_000_003)):
        info = np.iinfo(dtype)
        x = rng.integers(info.min, info.max, (args.clients, args.size), dtype=dtype, endpoint=True)
        fast_s, fast_r = _time(x, modulus, True, args.repeats)
        exact_s, exact_r = _time(x, modulus, False, args.repeats)
        if not np.array_equal(fast_r, exact_r):
            raise SystemExit(f"the two paths disagree for {np.dtype(dtype).name} mod {modulus}")
        print(f"| {np.dtype(dtype).name} | {modulus} | {fast_s:.3f} s | {exact_s:.3f} s "
              f"| {exact_s / fast_s:.1f}x |")


if __name__ == "__main__":
    main()
