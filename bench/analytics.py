"""Federated analytics measurements (issue 14), printed as the tables of bench/README.md.

    .venv/bin/python bench/analytics.py           # the full run (tens of minutes on 2 cores)
    .venv/bin/python bench/analytics.py --quick   # small sizes, a few minutes
    .venv/bin/python bench/analytics.py --only heavy --method TrieHH   # one table's rows

1. Heavy hitters: precision and recall of the top-k found by TrieHH and by the IBLT
   sketch against the true top-k, for epsilon in {1, 3, 10, inf}, on the data of
   examples/word_frequencies.py (full: 10,000 clients, 50,000 words, top 100).
   Target at epsilon = inf: each method finds at least 95 of the true top 100.
2. Histograms and quantiles: errors of the DP results against the exact ones.
3. HyperLogLog: relative error at 10^6 distinct items with 2^14 registers (target <= 2%).
4. Round time and peak memory against the cohort size (memory must not grow with it):
   each cohort runs in a fresh process, which reports the peak RSS of the round (the
   kernel's VmHWM, reset after a warm-up round) above what it held before the round
   (the data and the compiled programs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import pathlib
import subprocess
import sys
import time
from typing import Any

import numpy as np

import fedlang as fl
from fedlang import analytics

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))
sys.path.insert(0, str(ROOT / "bench"))
import _memory  # noqa: E402
import word_frequencies as wf  # noqa: E402

EPSILONS = (1.0, 3.0, 10.0, math.inf)


def _table(header: list[str], rows: list[list[Any]]) -> None:
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for r in rows:
        print("| " + " | ".join(str(x) for x in r) + " |")
    print(flush=True)


def heavy_hitters(quick: bool, methods: list[str] | None = None) -> list[dict[str, Any]]:
    clients_n, vocab, k = (600, 3000, 20) if quick else (10_000, 50_000, 100)
    max_len, prefixes = 10, 256
    clients = wf.make_clients(clients_n, vocab)
    truth = set(wf.true_top(clients, k))
    encoded = analytics.data.encode_clients(clients, max_len)
    rows = []
    for eps in EPSILONS:
        for name, run in [
            ("TrieHH", lambda e=eps: wf.run_triehh(encoded, k, max_len, prefixes, e)),
            ("IBLT", lambda e=eps: wf.run_iblt(encoded, k, max_len, vocab, e)),
        ]:
            if methods and name not in methods:
                continue
            start = time.perf_counter()
            found = run()
            seconds = time.perf_counter() - start
            hits = len(set(found.items) & truth)
            rows.append({
                "method": name, "epsilon": eps, "found": len(found.items), "hits": hits,
                "precision": hits / len(found.items) if found.items else float("nan"),
                "recall": hits / k, "rounds": found.rounds, "seconds": seconds,
                "spent": None if found.privacy is None else tuple(found.privacy),
            })
            print(f"  {name} eps={eps}: {hits}/{k} in {seconds:.1f} s", file=sys.stderr, flush=True)
    print(f"### Heavy hitters: {clients_n:,} clients, {vocab:,} words, top {k}\n")
    _table(["method", "epsilon", "found", "of true top k", "precision", "recall", "rounds",
            "(eps, delta) reported", "seconds"],
           [[r["method"], r["epsilon"], r["found"], r["hits"], f"{r['precision']:.2f}",
             f"{r['recall']:.2f}", r["rounds"],
             "-" if r["spent"] is None else f"({r['spent'][0]:.2f}, {r['spent'][1]:g})",
             f"{r['seconds']:.1f}"] for r in rows])
    return rows


def histograms(quick: bool) -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    n, per = (500, 10) if quick else (5000, 10)
    clients = [rng.beta(2, 5, size=rng.integers(1, per + 1)).astype(np.float32) for _ in range(n)]
    every = np.concatenate(clients)
    edges = np.linspace(0, 1, 21)
    exact = np.histogram(every, edges)[0]
    qs = [0.1, 0.25, 0.5, 0.75, 0.9]
    exact_q = np.quantile(every, qs)
    rows = []
    with fl.runtime.simulation_context():
        for eps in EPSILONS:
            # A client adds at most `per` records: L2 norm <= per (one bin) for the
            # histogram, per * sqrt(depth + 1) for the tree of depth 8.
            hp = wf.privacy_for(eps, 1, clip=float(per), seed=1)
            h = analytics.histogram(clients, edges, privacy=hp)
            qp = wf.privacy_for(eps, 1, clip=float(per) * 3.0, seed=2)
            q = analytics.quantiles(clients, qs, 0, 1, depth=8, privacy=qp)
            rows.append({
                "epsilon": eps,
                "hist_mae": float(np.abs(h.counts - exact).mean()),
                "hist_rel_l1": float(np.abs(h.counts - exact).sum() / exact.sum()),
                "quantile_mae": float(np.abs(q.values - exact_q).mean()),
                "quantile_max": float(np.abs(q.values - exact_q).max()),
            })
    print(f"### Histograms (20 bins) and quantiles (tree of depth 8): {n:,} clients, "
          f"{len(every):,} records in [0, 1]\n")
    _table(["epsilon", "histogram: mean abs error per bin", "relative L1 error",
            "quantiles 0.1..0.9: mean abs error", "max abs error"],
           [[r["epsilon"], f"{r['hist_mae']:.1f}", f"{r['hist_rel_l1']:.4f}",
             f"{r['quantile_mae']:.4f}", f"{r['quantile_max']:.4f}"] for r in rows])
    return rows


def hyperloglog(quick: bool) -> list[dict[str, Any]]:
    distinct = 10**5 if quick else 10**6
    rows = []
    with fl.runtime.simulation_context():
        for seed in range(3 if quick else 5):
            rng = np.random.default_rng(seed)
            items = rng.choice(2**31 - 1, size=distinct, replace=False).astype(np.int32)
            # Each item is held by one to three clients: duplicates must count once.
            held = np.concatenate([items, rng.choice(items, size=distinct // 2)])
            rng.shuffle(held)
            start = time.perf_counter()
            est = analytics.count_distinct(np.array_split(held, 1000), precision=14)
            rows.append({"seed": seed, "estimate": est, "rel_error": est / distinct - 1,
                         "seconds": time.perf_counter() - start})
    print(f"### HyperLogLog, 2^14 registers, {distinct:,} distinct items over 1,000 clients\n")
    _table(["run", "estimate", "relative error", "seconds"],
           [[r["seed"], f"{r['estimate']:,.0f}", f"{r['rel_error']:+.2%}", f"{r['seconds']:.1f}"]
            for r in rows])
    return rows


def cohort_child(cohort: int, method: str) -> dict[str, Any]:
    """Runs one round for `cohort` clients (in a fresh process); returns time and memory."""
    clients = wf.make_clients(cohort, 5000, seed=cohort)
    encoded = analytics.data.encode_clients(clients, 10)
    with fl.runtime.simulation_context():
        if method == "TrieHH round":
            algo = analytics.TrieHH(max_len=10, max_prefixes=512)
            comp, state = algo.round_computation()
            live = analytics.trie.sort_by_hash([bytes([c]) for c in b"etaoinshrd"], 10)
            table, valid = analytics.trie.prefix_table(live, 10, 512)
            arg = {"prefixes": table, "valid": valid, "length": np.int32(1), "seed": np.uint32(0)}

            def run(datasets: list[Any]) -> Any:
                return comp(datasets, arg, state)
        else:
            comp = analytics.IBLT(max_len=10, capacity=5000).build()

            def run(datasets: list[Any]) -> Any:
                return comp(datasets)

        run(encoded.datasets[:64])  # compile, and let 'auto' decide
        before = _memory.rss_bytes()
        reset = _memory.reset_peak()  # the peak of the round alone, not of the compilation
        start = time.perf_counter()
        run(encoded.datasets)
        seconds = time.perf_counter() - start
        peak = _memory.peak_bytes()
    return {"cohort": cohort, "method": method, "seconds": seconds, "peak_reset": reset,
            "peak_above_before_mb": max(peak - before, 0) / 2**20,
            "data_mb": sum(b["bytes"].nbytes + b["length"].nbytes
                           for d in encoded.datasets for b in d) / 2**20}


def cohorts(quick: bool) -> list[dict[str, Any]]:
    sizes = (250, 500, 1000) if quick else (1000, 2000, 4000, 8000)
    rows = []
    for method in ("TrieHH round", "IBLT sketch round"):
        for n in sizes:
            out = subprocess.run(
                [sys.executable, __file__, "--child", str(n), method],
                check=True, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT / "src")},
            ).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
    print("### Round time and peak memory against the cohort size (5,000 words, 10-200 per client)\n")
    _table(["round", "clients", "seconds", "ms per client", "clients' encoded data (MB)",
            "peak RSS of the round above the warm process (MB)"],
           [[r["method"], f"{r['cohort']:,}", f"{r['seconds']:.2f}",
             f"{1000 * r['seconds'] / r['cohort']:.2f}", f"{r['data_mb']:.1f}",
             f"{r['peak_above_before_mb']:.0f}" + ("" if r["peak_reset"] else " (lifetime peak)")]
            for r in rows])
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes, a few minutes")
    parser.add_argument("--only", choices=["heavy", "hist", "hll", "cohort"], action="append")
    parser.add_argument("--method", choices=["TrieHH", "IBLT"], action="append",
                        help="with heavy hitters: only these methods' rows")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(cohort_child(int(args.child[0]), args.child[1])))
        return {}
    parts = {"heavy": lambda quick: heavy_hitters(quick, args.method), "hist": histograms,
             "hll": hyperloglog, "cohort": cohorts}
    results = {}
    for name in args.only or list(parts):
        results[name] = parts[name](args.quick)
    return results


if __name__ == "__main__":
    main()
