"""What each step of an upload costs a FastAPI server, one step added at a time: the
echo that issue 24's ratios are measured against, then the same route with the steps
fedlang's intake cannot skip, then `fedlang serve` itself, all driven by bench/load.py's
generator in the same minutes.

Each variant is its own uvicorn process (uvloop and h11, as `fedlang serve` runs),
serving `PUT /up` with an 80 KB body (`--size`):

| variant | the route does |
|---|---|
| echo | reads the body, answers its size (bench/deploy.py's echo) |
| +1 hop | and calls one function on the thread pool (`run_in_threadpool`) |
| +2 hops | and two (the intake's: find the caller and task, then check and accept) |
| +read | the 2 hops; the first runs one SQLite read transaction (a row by key, WAL) |
| +sha | and the second hashes the body (SHA-256) |
| +commit | and hands the upload to a writer thread that commits it with the others waiting (one transaction, a row per upload: its digest and size; group commit) and waits for it |
| +store | and the row holds the body too (a durable append of the report itself) |
| fedlang | `fedlang serve` on SQLite: a plain round's report, every check (bench/load.py) |

Server CPU per upload is the server process's user + system CPU (from /proc) over the
uploads, divided by their number. Ratio = the echo's seconds / the variant's seconds,
as in bench/load.py.

Run: python bench/route_cost.py [--uploads 3000] [--concurrency 1,64] [--size 80K]
(results in bench/README.md, "Scaling")
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import os
import pathlib
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from typing import Any

import fastapi
import uvicorn
from starlette import concurrency

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import load  # bench/load.py: the generator, the fedlang rows

import deploy as deploy_bench  # bench/deploy.py: ports, waiting for a server

VARIANTS = ("echo", "+1 hop", "+2 hops", "+read", "+sha", "+commit", "+store")


def serve_variant(variant: str, port: int, db: str) -> None:
    """Serves `PUT /up` as `variant` does (see the module docstring) until killed."""
    steps = VARIANTS.index(variant)
    store = steps >= VARIANTS.index("+store")
    local = threading.local()

    def connection() -> sqlite3.Connection:
        conn = getattr(local, "conn", None)
        if conn is None:
            conn = local.conn = sqlite3.connect(db, isolation_level=None,
                                                check_same_thread=False)
            conn.execute("PRAGMA journal_mode=WAL")
            conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    setup = connection()
    setup.execute("CREATE TABLE IF NOT EXISTS creds (token TEXT PRIMARY KEY, client TEXT)")
    setup.execute("CREATE TABLE IF NOT EXISTS ups (id INTEGER PRIMARY KEY, digest TEXT, size INT,"
                  " body BLOB)")
    setup.execute("INSERT OR IGNORE INTO creds VALUES ('t', 'c')")

    def find(auth: str) -> str:
        if steps < VARIANTS.index("+read"):
            return auth
        conn = connection()
        conn.execute("BEGIN")
        try:
            return str(conn.execute("SELECT client FROM creds WHERE token = 't'").fetchone()[0])
        finally:
            conn.execute("COMMIT")

    waiting: list[tuple[str, bytes, threading.Event]] = []
    cond = threading.Condition()

    def writer() -> None:
        conn = connection()
        while True:
            with cond:
                while not waiting:
                    cond.wait()
                batch = waiting[:]
                del waiting[:]
            conn.execute("BEGIN IMMEDIATE")
            conn.executemany("INSERT INTO ups (digest, size, body) VALUES (?, ?, ?)",
                             [(d, len(b), b if store else None) for d, b, _ in batch])
            conn.execute("COMMIT")
            for _, _, done in batch:
                done.set()

    if steps >= VARIANTS.index("+commit"):
        threading.Thread(target=writer, daemon=True).start()

    def take(body: bytes) -> int:
        if steps < VARIANTS.index("+sha"):
            return len(body)
        digest = hashlib.sha256(body).hexdigest()
        if steps >= VARIANTS.index("+commit"):
            done = threading.Event()
            with cond:
                waiting.append((digest, body, done))
                cond.notify()
            done.wait()
        return len(body)

    app = fastapi.FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.put("/up")
    async def up(request: fastapi.Request) -> dict[str, int]:
        auth = request.headers.get("authorization", "")
        if steps >= 1:
            await concurrency.run_in_threadpool(find, auth)
        body = await request.body()
        if steps >= 2:
            return {"size": await concurrency.run_in_threadpool(take, body)}
        return {"size": len(body)}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


@contextlib.contextmanager
def variant_process(variant: str, work: pathlib.Path) -> Iterator[tuple[str, int]]:
    """A server process serving `variant`; yields (url, pid)."""
    port = deploy_bench._port()
    db = work / f"variant-{VARIANTS.index(variant)}.db"
    proc = subprocess.Popen([sys.executable, __file__, "serve", variant, str(port), str(db)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deploy_bench._wait_up(f"http://127.0.0.1:{port}/ping", proc)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def measure_variant(variant: str, body: bytes, uploads: int, concurrency: int,
                    work: pathlib.Path) -> dict[str, Any]:
    with variant_process(variant, work) as (url, pid):
        port = int(url.rsplit(":", 1)[1])
        targets = [("127.0.0.1", port, "/up", "t")] * uploads
        cpu = load.cpu_seconds(pid)
        run = load.run_load(targets, body, concurrency, procs_for(concurrency), work)
        cpu = load.cpu_seconds(pid) - cpu
    return {"variant": variant, "seconds": run["seconds"], "cpu_ms": 1000 * cpu / uploads}


def measure_fedlang(body_size: str, uploads: int, concurrency: int,
                    work: pathlib.Path) -> dict[str, Any]:
    """`fedlang serve` on SQLite, one round, as bench/load.py measures it."""
    row = load.measure(str(work / "fedlang.db"), 1, body_size, uploads, concurrency,
                       procs_for(concurrency), work)
    return {"variant": "fedlang", "seconds": uploads / row["reports_per_s"],
            "cpu_ms": row["server_cpu_ms_per_report"]}


def procs_for(concurrency: int) -> int:
    return 1 if concurrency < 4 else 2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--uploads", type=int, default=3000)
    parser.add_argument("--concurrency", default="1,64", help="Connections in all, per run.")
    parser.add_argument("--size", default="80K", choices=list(load.SIZES))
    args = parser.parse_args()
    _, _, report = deploy_bench.update_round(load.SIZES[args.size])
    print(f"{args.size} uploads ({len(report)} bytes), {args.uploads} per row, "
          f"load average {os.getloadavg()[0]:.1f}", flush=True)
    print("| connections | variant | uploads/s | ratio to the echo | server CPU ms/upload |")
    print("|---|---|---:|---:|---:|")
    for connections in [int(c) for c in args.concurrency.split(",")]:
        with tempfile.TemporaryDirectory(prefix="fedlang-bench-route-") as tmp:
            work = pathlib.Path(tmp)
            rows = [measure_variant(v, report, args.uploads, connections, work)
                    for v in VARIANTS]
            rows.append(measure_fedlang(args.size, args.uploads, connections, work))
        echo = rows[0]["seconds"]
        for row in rows:
            print(f"| {connections} | {row['variant']} | {args.uploads / row['seconds']:.0f} | "
                  f"{echo / row['seconds']:.2f} | {row['cpu_ms']:.2f} |", flush=True)
    print(f"(load average {os.getloadavg()[0]:.1f}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())})")


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        serve_variant(sys.argv[2], int(sys.argv[3]), sys.argv[4])
    else:
        main()
