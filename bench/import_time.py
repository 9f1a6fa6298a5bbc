"""What `import fedlang` costs: wall time in fresh interpreters, and which heavy modules
it loads (none should start until used).

    python bench/import_time.py [--runs 5]

To compare with another revision, put its sources first on the path, e.g.
`git archive REV src | tar -x -C /tmp/rev && PYTHONPATH=/tmp/rev/src python bench/import_time.py`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

_PROBE = r"""
import json, sys, time
start = time.perf_counter()
import fedlang
elapsed = time.perf_counter() - start
heavy = ["jax", "pyarrow", "keras", "flax", "optax", "matplotlib", "fastapi", "ray"]
print(json.dumps({"s": elapsed, "loaded": [m for m in heavy if m in sys.modules],
                  "file": fedlang.__file__}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    results = [
        json.loads(subprocess.run([sys.executable, "-c", _PROBE], check=True,
                                  capture_output=True, text=True).stdout)
        for _ in range(args.runs)
    ]
    times = sorted(r["s"] for r in results)
    print(f"fedlang from {results[0]['file']}")
    print("| runs | min | median | max | heavy modules loaded |")
    print("|---:|---:|---:|---:|---|")
    print(f"| {args.runs} | {times[0]:.2f} s | {statistics.median(times):.2f} s | "
          f"{times[-1]:.2f} s | {', '.join(results[0]['loaded']) or 'none'} |")


if __name__ == "__main__":
    main()
