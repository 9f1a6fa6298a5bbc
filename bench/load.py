"""A load generator for the task store: reports/s and MB/s of real `fedlang serve`
processes against a plain FastAPI/uvicorn echo server, with the same clients, in the
same minutes.

For each database (SQLite, PostgreSQL in a throwaway cluster), each number of server
processes (1, 2: several `fedlang serve` on one PostgreSQL database, on their own ports;
`edges`: a root and 2 edge aggregators, `fedlang serve --upstream ROOT`, each on its own
SQLite database, half of the clients at each edge; bench/edges.py's processes)
and each report size (8 KB, 80 KB, 800 KB, 8 MB: the float64 partial sums of float32
updates of 10^3 .. 10^6 values), it opens one round of cohort `m`, enrolls and checks in `m` clients (not timed),
then times `m` report uploads from `--procs` load processes (each an asyncio loop of
plain HTTP/1.1 keep-alive connections over raw sockets, no HTTP library: the cheapest
client Python has), spread evenly over the server processes; then the same uploads of
the same bytes to as many echo processes. The ratio is echo seconds / fedlang seconds
(1.0: the server costs nothing beyond reading the bytes).

The load processes are never the server's. Each row also gives the CPU seconds the load
processes and the server processes spent (per report: the server processes' user +
system CPU from /proc over the uploads; with edges, the root's and both edges', from the
uploads' start to the root's close of the round): the generator is not the bottleneck
when the echo runs faster than fedlang with the same generator (it then had idle time
during fedlang's run). With edges, the uploads go to the edges (as many echo processes),
and "close s" is how long after the last upload was acknowledged the root closed the
round (the edges' forwarding of their partials).

Run: python bench/load.py [--quick] [--db sqlite,postgresql] [--servers 1,2,edges]
       [--sizes 8K,80K,800K,8M] [--concurrency 64] [--procs 2] [--src DIR]
(results in bench/README.md, "Scaling")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import multiprocessing
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import httpx

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import edges as edges_bench  # (bench/edges.py: root and edge processes)

import deploy as deploy_bench  # (bench/deploy.py: servers, echo, plans)

SIZES = {"8K": 10**3, "80K": 10**4, "800K": 10**5, "8M": 10**6}
# Reports per run at each size: enough for a few seconds of uploads.
REPORTS = {"8K": 4000, "80K": 3000, "800K": 600, "8M": 60}
QUICK_REPORTS = {"8K": 1000, "80K": 800, "800K": 150, "8M": 20}


# -- the load processes: raw HTTP/1.1 over asyncio streams


async def _put(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, head: bytes,
               body: bytes) -> int:
    """One PUT on a keep-alive connection; returns the status (the answer is read whole)."""
    writer.write(head)
    writer.write(body)
    await writer.drain()
    status_line = await reader.readline()
    length = 0
    while True:
        line = await reader.readline()
        if line in (b"\r\n", b""):
            break
        name, _, value = line.partition(b":")
        if name.strip().lower() == b"content-length":
            length = int(value)
    if length:
        await reader.readexactly(length)
    return int(status_line.split()[1])


async def _upload_all(targets: list[tuple[str, int, str, str]], body: bytes,
                      concurrency: int) -> int:
    """Uploads `body` once per target (host, port, path, bearer) over `concurrency`
    connections, each to one server taking that server's targets (an edge knows only its
    own clients); returns how many were answered 200."""
    ports = sorted({(t[0], t[1]) for t in targets})
    queues: dict[tuple[str, int], asyncio.Queue[tuple[str, int, str, str]]] = {
        p: asyncio.Queue() for p in ports}
    for t in targets:
        queues[t[0], t[1]].put_nowait(t)
    ok = 0

    async def worker(host: str, port: int) -> None:
        nonlocal ok
        queue = queues[host, port]
        reader, writer = await asyncio.open_connection(host, port)
        try:
            while True:
                try:
                    _, _, path, bearer = queue.get_nowait()
                except asyncio.QueueEmpty:
                    return
                parts = path.split("/")  # /v1/rounds/{round}/report (or /echo)
                task = parts[3] if len(parts) > 3 else "null"
                head = (f"PUT {path} HTTP/1.1\r\nHost: {host}:{port}\r\n"
                        f"Authorization: Bearer {bearer}\r\n"
                        f'Fedlang-Task: {{"round":{task},"session":null,"version":null}}\r\n'
                        "Content-Type: application/octet-stream\r\n"
                        f"Content-Length: {len(body)}\r\n\r\n").encode()
                status = await _put(reader, writer, head, body)
                if status != 200:
                    raise RuntimeError(f"upload to {path} answered {status}")
                ok += 1
        finally:
            writer.close()

    await asyncio.gather(*(worker(*ports[i % len(ports)]) for i in range(concurrency)))
    return ok


def _load_process(targets: list[tuple[str, int, str, str]], body_path: str, concurrency: int,
                  ready: Any, go: Any, out: Any) -> None:
    body = pathlib.Path(body_path).read_bytes()
    ready.set()
    go.wait()
    t0, c0 = time.time(), time.process_time()
    try:
        ok = asyncio.run(_upload_all(targets, body, concurrency))
    except Exception as e:  # told to the parent, which fails the run with it
        out.put({"error": f"{type(e).__name__}: {e}"})
        return
    out.put({"start": t0, "end": time.time(), "cpu": time.process_time() - c0, "ok": ok})


def run_load(targets: list[tuple[str, int, str, str]], body: bytes, concurrency: int,
             procs: int, work: pathlib.Path) -> dict[str, float]:
    """Uploads from `procs` processes (targets dealt round-robin, `concurrency` connections
    in all); returns the wall seconds from the first start to the last end and the
    load processes' CPU seconds."""
    body_path = work / "body.bin"
    body_path.write_bytes(body)
    mp = multiprocessing.get_context("spawn")
    ready = [mp.Event() for _ in range(procs)]
    go, out = mp.Event(), mp.Queue()
    workers = [
        mp.Process(target=_load_process,
                   args=(targets[i::procs], str(body_path), max(1, concurrency // procs),
                         ready[i], go, out))
        for i in range(procs)
    ]
    for w in workers:
        w.start()
    try:
        for e in ready:
            if not e.wait(120):
                raise RuntimeError("a load process did not start")
        go.set()
        results = [out.get(timeout=600) for _ in workers]
    finally:
        for w in workers:
            w.join(timeout=30)
            if w.is_alive():
                w.kill()
    errors = [r["error"] for r in results if "error" in r]
    if errors:
        raise RuntimeError(f"a load process failed: {errors[0]}")
    if sum(r["ok"] for r in results) != len(targets):
        raise RuntimeError("not every upload was accepted")
    return {"seconds": max(r["end"] for r in results) - min(r["start"] for r in results),
            "load_cpu": sum(r["cpu"] for r in results)}


# -- servers


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (from /proc)."""
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def servers(db: str, n: int, work: pathlib.Path) -> Iterator[list[tuple[str, int]]]:
    """`n` `fedlang serve` processes on database `db` (one signing key); yields
    [(url, pid)]."""
    key = ["--key-file", str(work / "signing.key")]
    with contextlib.ExitStack() as stack:
        made = [stack.enter_context(deploy_bench.server_process(db, key))]
        for _ in range(n - 1):
            made.append(stack.enter_context(deploy_bench.server_process(db, key)))
        yield made


@contextlib.contextmanager
def echoes(n: int) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield [stack.enter_context(deploy_bench.echo_process()) for _ in range(n)]


def _as_postgres_user(args: list[str]) -> list[str]:
    """PostgreSQL refuses to run as root: run its tools as `nobody` then."""
    return ["runuser", "-u", "nobody", "--", *args] if os.geteuid() == 0 else args


@contextlib.contextmanager
def postgres_cluster() -> Iterator[str]:
    """A throwaway PostgreSQL cluster on a free loopback port (fsync on, as a real one):
    its base URL, no database. (tests/deploy/conftest.py starts its own, with fsync off.)"""
    if shutil.which("initdb") is None:
        raise RuntimeError("PostgreSQL's initdb/pg_ctl are not on the PATH; install PostgreSQL.")
    base = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-pg-"))
    data = base / "data"
    if os.geteuid() == 0:
        shutil.chown(base, "nobody")
    port = deploy_bench._port()
    subprocess.run(_as_postgres_user(["initdb", "-D", str(data), "-U", "postgres",
                                      "--auth=trust"]), check=True, capture_output=True)
    subprocess.run(_as_postgres_user(
        ["pg_ctl", "-D", str(data), "-l", str(base / "log"), "-w", "-t", "60",
         "-o", f"-k {data} -p {port} -h 127.0.0.1 -c max_connections=200", "start"]),
        check=True, capture_output=True)
    try:
        yield f"postgresql://postgres@127.0.0.1:{port}"
    finally:
        subprocess.run(_as_postgres_user(["pg_ctl", "-D", str(data), "stop", "-m", "immediate"]),
                       capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


def new_database(cluster: str, name: str) -> str:
    import psycopg

    with psycopg.connect(f"{cluster}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    return f"{cluster}/{name}"


# -- one measurement


async def _prepare(urls: list[str], plan: Any, broadcast: bytes, m: int
                   ) -> tuple[int, list[tuple[str, int, str, str]]]:
    """Opens a round of target `m`, enrolls `m` clients and checks each in at one of the
    servers (round-robin: a client uploads where it checked in); returns the round's id
    and the upload targets."""
    token, round_id, _ = deploy_bench._open_round(urls[0], plan, broadcast, m)
    clients = [httpx.AsyncClient(base_url=u, timeout=120) for u in urls]
    try:
        creds = await deploy_bench._enroll(clients[0], token, m)

        async def checkin(i: int) -> None:
            r = await clients[i % len(urls)].post(
                "/v1/checkin", headers={"Authorization": f"Bearer {creds[i]}"})
            assert r.json()["task"]["round"] == round_id, r.text

        await deploy_bench.gather(m, checkin)
    finally:
        for c in clients:
            await c.aclose()
    targets = []
    for i, cred in enumerate(creds):
        host, port = urls[i % len(urls)].removeprefix("http://").split(":")
        targets.append((host, int(port), f"/v1/rounds/{round_id}/report", cred))
    return round_id, targets


def _wait_closed(url: str, round_id: int) -> None:
    import fedlang as fl

    with fl.deploy.Admin(url, "bench") as admin:
        while admin.round(round_id, wait=5)["state"] == "open":
            pass


@contextlib.contextmanager
def edge_tier(db: str, work: pathlib.Path, edges: int = 2) -> Iterator[tuple[Any, list[Any]]]:
    """A root on database `db` and `edges` edge aggregators (bench/edges.py's `Process`,
    each with its own SQLite database; population 'pop'); yields (root, [edge])."""
    edges_bench.ROOT = deploy_bench.SRC.parent  # the sources the other servers run
    made = [edges_bench.Process(db, "--key-file",  # type: ignore[arg-type]  # or a URL
                                str(work / "root.key"))]
    try:
        with edges_bench.deploy.Admin(made[0].url, edges_bench.ADMIN) as admin:
            admin.create_population("pop")
            tokens = [admin.create_edge(f"edge{i}", "pop") for i in range(edges)]
        for i, token in enumerate(tokens):
            made.append(edges_bench.Process(work / f"edge{i}.db", "--upstream", made[0].url,
                                            "--upstream-token", token))
        yield made[0], made[1:]
    finally:
        for p in made:
            p.stop()


async def _prepare_edges(root: Any, edges: list[Any], plan: Any, broadcast: bytes, m: int
                         ) -> tuple[int, list[tuple[str, int, str, str]]]:
    """Enrolls `m` clients, half at each edge, opens a round of target `m` at the root,
    waits until every edge mirrored it and checks each client in at its edge; returns the
    round's id and the upload targets."""
    creds: list[tuple[str, str]] = []
    for i, edge in enumerate(edges):
        with edges_bench.deploy.Admin(edge.url, edges_bench.ADMIN) as admin:
            token = admin.rotate_token("pop")  # the edge made its population at start
        share = m // len(edges) + (1 if i < m % len(edges) else 0)
        creds += await edges_bench._enroll(edge.url, token, share)
    with edges_bench.deploy.Admin(root.url, edges_bench.ADMIN) as admin:
        round_id = admin.create_round("pop", admin.put_blob(plan.to_bytes()),
                                      admin.put_blob(broadcast), target=m, deadline=3600)["id"]
    clients = {e.url: httpx.AsyncClient(base_url=e.url, timeout=120) for e in edges}
    try:
        async def checkin(i: int) -> str:
            url, credential = creds[i]
            while True:
                r = await clients[url].post("/v1/checkin",
                                            headers={"Authorization": f"Bearer {credential}"})
                task = r.json()["task"]
                if task:  # the edge's mirror of the root's round
                    return f"/v1/rounds/{task['round']}/report"
                await asyncio.sleep(r.json()["retry_after"])

        paths = await deploy_bench.gather(m, checkin)
    finally:
        for c in clients.values():
            await c.aclose()
    targets = []
    for (url, cred), path in zip(creds, paths):
        host, port = url.removeprefix("http://").split(":")
        targets.append((host, int(port), path, cred))
    return round_id, targets


def _measure_edges(db: str, plan: Any, broadcast: bytes, report: bytes, m: int, concurrency: int,
                   procs: int, work: pathlib.Path) -> tuple[dict[str, float], float, float]:
    """(the load's result, all servers' CPU seconds, seconds from the last acknowledged
    upload to the root's close) for root + 2 edges."""
    with edge_tier(db, work) as (root, edges):
        round_id, targets = asyncio.run(_prepare_edges(root, edges, plan, broadcast, m))
        every = [root, *edges]
        cpu0 = sum(p.cpu() for p in every)
        fed = run_load(targets, report, concurrency, procs, work)
        uploaded = time.monotonic()
        _wait_closed(root.url, round_id)
        closing = time.monotonic() - uploaded
        return fed, sum(p.cpu() for p in every) - cpu0, closing


def measure(db: str, n_servers: int | str, size: str, m: int, concurrency: int, procs: int,
            work: pathlib.Path) -> dict[str, Any]:
    plan, broadcast, report = deploy_bench.update_round(SIZES[size])
    closing, label = 0.0, str(n_servers)
    if n_servers == "edges":
        fed, server_cpu, closing = _measure_edges(db, plan, broadcast, report, m, concurrency,
                                                  procs, work)
        n_servers, label = 2, "root + 2 edges"  # as many echo processes as edges
    else:
        n_servers = int(n_servers)
        with servers(db, n_servers, work) as made:
            urls = [u for u, _ in made]
            round_id, targets = asyncio.run(_prepare(urls, plan, broadcast, m))
            cpu0 = sum(cpu_seconds(pid) for _, pid in made)
            fed = run_load(targets, report, concurrency, procs, work)
            server_cpu = sum(cpu_seconds(pid) for _, pid in made) - cpu0
            _wait_closed(urls[0], round_id)
    with echoes(n_servers) as echo_urls:
        hosts = [u.removeprefix("http://").split(":") for u in echo_urls]
        spread = [(hosts[i % n_servers][0], int(hosts[i % n_servers][1]), "/echo", "x")
                  for i in range(m)]
        echo = run_load(spread, report, concurrency, procs, work)
    mb = len(report) * m / 1e6
    return {
        "db": "PostgreSQL" if db.startswith("postgresql") else "SQLite",
        "servers": label, "close_s": closing, "size": size, "report_bytes": len(report), "reports": m,
        "reports_per_s": m / fed["seconds"], "mb_per_s": mb / fed["seconds"],
        "echo_reports_per_s": m / echo["seconds"], "echo_mb_per_s": mb / echo["seconds"],
        "ratio": echo["seconds"] / fed["seconds"],
        "server_cpu_ms_per_report": 1000 * server_cpu / m,
        "load_cpu_s": fed["load_cpu"], "echo_load_cpu_s": echo["load_cpu"],
        "seconds": fed["seconds"], "echo_seconds": echo["seconds"],
    }


def _rate(x: float) -> str:
    return f"{x:.1f}" if x < 100 else f"{x:.0f}"


def _closed(row: dict[str, Any]) -> str:
    """With edges: how long after the last acknowledged upload the root closed the round."""
    return f" (closed +{row['close_s']:.1f} s)" if row.get("close_s") else ""


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| db | servers | report | reports/s | MB/s | echo reports/s | echo MB/s | ratio "
             "| server CPU ms/report | load CPU s (fedlang / echo) |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['db']} | {r['servers']}{_closed(r)} | {r['size']} | {_rate(r['reports_per_s'])} | "
            f"{r['mb_per_s']:.1f} | {_rate(r['echo_reports_per_s'])} | {r['echo_mb_per_s']:.1f} | "
            f"{r['ratio']:.2f} | {r['server_cpu_ms_per_report']:.2f} | "
            f"{r['load_cpu_s']:.1f} / {r['echo_load_cpu_s']:.1f} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Fewer reports per run.")
    parser.add_argument("--db", default="sqlite,postgresql", help="sqlite, postgresql or both.")
    parser.add_argument("--servers", default="1,2,edges",
                        help="Numbers of server processes (2 and more: PostgreSQL only), or "
                        "'edges': a root (on the --db) and 2 edges (on SQLite).")
    parser.add_argument("--sizes", default=",".join(SIZES), help="Report sizes: 8K,80K,800K,8M.")
    parser.add_argument("--reports", type=int, default=0, help="Reports per run (0: by size).")
    parser.add_argument("--concurrency", type=int, default=64, help="Connections in all.")
    parser.add_argument("--procs", type=int, default=2, help="Load processes.")
    parser.add_argument("--json", type=pathlib.Path, help="Also write the rows here.")
    parser.add_argument("--src", type=pathlib.Path,
                        help="The fedlang sources the servers run (default: this checkout's; "
                        "e.g. an export of main, to measure it with the same generator).")
    args = parser.parse_args()
    if args.src:
        deploy_bench.SRC = args.src.resolve()
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-load-"))
    counts = QUICK_REPORTS if args.quick else REPORTS
    rows = []
    with contextlib.ExitStack() as stack:
        cluster = None
        for db_kind in args.db.split(","):
            for n in args.servers.split(","):
                if db_kind == "sqlite" and n not in ("1", "edges"):
                    continue  # SQLite is one server process (its DB.lock)
                for size in args.sizes.split(","):
                    tag = f"{db_kind}{n}_{size.lower()}"
                    if db_kind == "sqlite":
                        db = str(work / f"{tag}.db")
                    else:
                        cluster = cluster or stack.enter_context(postgres_cluster())
                        db = new_database(cluster, f"load_{tag}")
                    row = measure(db, n if n == "edges" else int(n), size, args.reports or counts[size], args.concurrency,
                                  args.procs, work)
                    rows.append(row)
                    print(json.dumps(row), flush=True)
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
