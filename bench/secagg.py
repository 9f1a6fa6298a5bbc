"""SecAgg+ cost next to a plain upload: client CPU and bytes per client, server CPU.

    .venv/bin/python bench/secagg.py            # the table in bench/README.md (~5 min on 2 cores)
    .venv/bin/python bench/secagg.py --quick    # small sizes, a few seconds (a test runs it)

Every client sums a vector of `length` integers modulo 2**32 (e.g. 22-bit quantized
values with 10 bits of headroom for 1,000 clients). Clients are simulated in process by
`fedlang.deploy.secagg.run_round`; unless said otherwise no client drops out. Times are CPU seconds
(`time.process_time`), per client (mean over the cohort: all four stages) and for the
server (the whole round). Bytes are what a client sends, all four messages.

The plain upload is the same vector, unmasked: the client serializes it with
`fedlang.serialize_value` (uint32), the server deserializes it and adds it to a running
sum. The ratios (SecAgg / plain) are the figures.

SecAgg+ uses the default neighbour degree (O(log n)). For the largest cohort an extra row
drops `--dropped` of the clients after they share their keys: the server then rebuilds
their mask keys and removes the pairwise masks their neighbours added (the client columns
are the survivors', and the plain upload has as many clients as survive). The full-graph rows are the
original SecAgg (degree n - 1), measured end to end where that fits the time budget; at
cohort 1,000 only `--samples` clients run their share-keys stage for real and their
masked-input stage is estimated as (n - 1) x the measured cost of one pairwise mask of
that length (key agreement, PRG expansion, addition), plus the self mask and the
decryption of n - 1 shares; the server time is not measured there.
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import numpy as np

import fedlang
from fedlang.deploy import secagg
from fedlang.deploy.secagg import crypto, masks, messages

MODULUS = 2**32


def _inputs(length: int):
    base = np.random.default_rng(0).integers(0, 2**22, length, dtype=np.int64)

    def inputs(cid: str) -> list[np.ndarray]:
        return [base + int(cid[1:])]  # cheap to make: the cost measured is the protocol's

    return base, inputs


def secagg_row(n: int, length: int, degree: int | None, dropped: float = 0.0) -> dict:
    base, inputs = _inputs(length)
    ids = [f"c{i}" for i in range(n)]
    gone = ids[: int(n * dropped)]  # they vanish after sharing keys: their masks are removed
    start = time.perf_counter()
    report = secagg.run_round(
        inputs,
        [secagg.Segment(length, MODULUS)],
        client_ids=ids,
        degree=degree,
        drop={secagg.Stage.MASKED_INPUT: gone},
    )
    wall = time.perf_counter() - start
    survivors = [int(c[1:]) for c in report.survivors]
    expected = base.astype(np.uint64) * np.uint64(len(survivors)) + np.uint64(sum(survivors))
    assert np.array_equal(report.sum[0], expected % np.uint64(MODULUS)), "wrong sum"
    graph = "full" if degree is not None else "SecAgg+"
    if degree is None and report.degree == n - 1:
        graph += " = full"
    if gone:
        graph += f", {dropped:.0%} dropped"
    return {
        "clients": n,
        "survivors": len(survivors),
        "length": length,
        "graph": graph,
        "degree": report.degree,
        "threshold": report.threshold,
        "client_s": float(np.mean([report.client_seconds[c] for c in report.survivors])),
        "client_bytes": float(np.mean([report.client_bytes[c] for c in report.survivors])),
        "server_s": report.server_seconds,
        "wall_s": wall,
        "how": "measured",
    }


def sampled_full_graph_row(n: int, length: int, samples: int) -> dict:
    """Full-graph SecAgg at a size too slow to run whole (see the module docstring)."""
    segment = secagg.Segment(length, MODULUS)
    srv = secagg.SecAggServer([segment], degree=2 * n)
    clients, advertise_s, advertise_bytes = {}, [], []
    for i in range(n):
        cid = f"c{i}"
        t = time.process_time()
        clients[cid] = secagg.SecAggClient(cid, srv.request_for(cid))
        msg = clients[cid].advertise_keys()
        advertise_s.append(time.process_time() - t)
        advertise_bytes.append(len(msg))
        srv.receive(cid, msg)
    srv.advance()
    share_s, share_bytes = [], []
    for cid in list(clients)[:samples]:
        request = srv.request_for(cid)
        t = time.process_time()
        msg = clients[cid].share_keys(request)
        share_s.append(time.process_time() - t)
        share_bytes.append(len(msg))
    # One pairwise mask and one share decryption, as the client's masked-input stage does
    # them, timed over a few repetitions.
    a, b = crypto.generate_private_key(), crypto.generate_private_key()
    peer = crypto.public_bytes(b)
    acc = masks.Accumulator(np.zeros(length, np.uint64), segment)
    reps = 5 if length >= 10**6 else 50
    t = time.process_time()
    for _ in range(reps):
        seed = crypto.agree(a, peer, crypto.PAIR_SEED_INFO, srv.round_id)
        acc.add(seed, 0, 1)
    per_mask = (time.process_time() - t) / reps
    key, ad = bytes(32), b"ad"
    sealed = crypto.encrypt(key, bytes(66), ad)
    t = time.process_time()
    for _ in range(200):
        crypto.decrypt(key, sealed, ad, "a share")
    per_decrypt = (time.process_time() - t) / 200
    masked_s = n * per_mask + (n - 1) * per_decrypt  # self mask + n - 1 pairwise masks
    masked_bytes = len(
        messages.masked_input(srv.round_id, "c0", [np.zeros(length, np.uint64)], [segment])
    )
    ids = sorted(clients)
    unmask_bytes = len(messages.unmask(srv.round_id, "c0", ids, [0] * n, [], []))
    return {
        "clients": n,
        "length": length,
        "graph": "full",
        "degree": srv.degree,
        "threshold": srv.threshold,
        "client_s": float(np.mean(advertise_s) + np.mean(share_s) + masked_s),
        "client_bytes": float(
            np.mean(advertise_bytes) + np.mean(share_bytes) + masked_bytes + unmask_bytes
        ),
        "server_s": None,
        "wall_s": None,
        "how": f"estimated ({samples} sampled clients)",
    }


def plain_row(n: int, length: int) -> dict:
    _, inputs = _inputs(length)
    client_s, sizes, server_s = 0.0, 0, 0.0
    total = np.zeros(length, np.uint64)
    for i in range(n):
        x = inputs(f"c{i}")[0]
        t = time.process_time()
        data = fedlang.serialize_value(x.astype(np.uint32))
        client_s += time.process_time() - t
        sizes += len(data)
        t = time.process_time()
        np.add(total, fedlang.deserialize_value(data), out=total)
        server_s += time.process_time() - t
    np.remainder(total, np.uint64(MODULUS), out=total)
    return {"client_s": client_s / n, "client_bytes": sizes / n, "server_s": server_s}


def run(cohorts, lengths, full_whole_max: int, samples: int, dropped: float) -> list[dict]:
    rows = []
    for length in lengths:
        for n in cohorts:
            plain = plain_row(n, length)
            variants = [secagg_row(n, length, None)]
            if n <= full_whole_max:
                if variants[0]["degree"] < n - 1:
                    variants.append(secagg_row(n, length, 2 * n))
            else:
                variants.append(sampled_full_graph_row(n, length, samples))
            if n == max(cohorts) and dropped > 0:
                variants.append(secagg_row(n, length, None, dropped))
            for row in variants:
                m = row.get("survivors", n)
                row["plain"] = plain if m == n else plain_row(m, length)
                rows.append(row)
                print(_line(row), flush=True)
    return rows


HEADER = (
    "| clients | elements | graph | k / t | client CPU | plain | ratio | bytes sent / client "
    "| plain | ratio | server CPU | plain | ratio |\n"
    "|---:|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
)


def _line(r: dict) -> str:
    p = r["plain"]
    server = "n/a" if r["server_s"] is None else _secs(r["server_s"])
    server_ratio = "n/a" if r["server_s"] is None else f"{r['server_s'] / p['server_s']:.0f}x"
    graph = r["graph"] + ("" if r["how"] == "measured" else " (est.)")
    return (
        f"| {r['clients']:,} | {r['length']:,} | {graph} | {r['degree']} / {r['threshold']} "
        f"| {_secs(r['client_s'])} | {_secs(p['client_s'])} | {r['client_s'] / p['client_s']:.0f}x "
        f"| {_size(r['client_bytes'])} | {_size(p['client_bytes'])} "
        f"| {r['client_bytes'] / p['client_bytes']:.2f}x "
        f"| {server} | {_secs(p['server_s'])} | {server_ratio} |"
    )


def _secs(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 1 else f"{s:.2f} s"


def _size(b: float) -> str:
    return f"{b / 1e6:.2f} MB" if b >= 1e6 else f"{b / 1e3:.1f} kB"


def main(argv: list[str] | None = None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="cohorts 5 and 20, 1,000 elements")
    parser.add_argument("--samples", type=int, default=3, help="sampled clients in estimated rows")
    parser.add_argument(
        "--dropped", type=float, default=0.1, help="fraction dropped in the extra last row"
    )
    parser.add_argument("--json", help="also write the rows to this file")
    args = parser.parse_args(argv)
    if args.quick:
        cohorts, lengths, full_whole_max = (5, 20), (1000,), 5
    else:
        cohorts, lengths, full_whole_max = (10, 100, 1000), (10**4, 10**6), 100
    print(f"# {platform.processor() or platform.machine()}, Python {platform.python_version()}")
    print(HEADER)
    start = time.perf_counter()
    rows = run(cohorts, lengths, full_whole_max, args.samples, args.dropped)
    print(f"# total {time.perf_counter() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
