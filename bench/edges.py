"""Server CPU per report: a root and two edge aggregators against one server.

A round of `cohort` clients, each uploading one report of a `federated_sum` of
float32[10^5] (an 800 KB float64 partial), runs twice, with a fresh database each time:

* one `fedlang serve` (SQLite) takes every report;
* a root `fedlang serve` and two edges (`fedlang serve --upstream ROOT`), each with its
  own SQLite database, half of the clients at each edge; each edge forwards one partial.

Every server is its own process; the clients are lightweight in-process
`httpx.AsyncClient`s (16 concurrent connections). The CPU time (user + system, from
`/proc/PID/stat`) of every server process is measured from the moment the round is open
(and, with edges, mirrored at both) to the moment the root closes it: check-ins,
uploads, folds, the edges' forwarding and the root's merges. The table gives it per
report, the root's own share, and the ratio to one server. The peak resident memory
of each server process (the kernel's `VmHWM` in `/proc/PID/status`, read once the round
closed: the most it held since it started) shows whether a server's memory stays flat
as the cohort grows; the table gives the largest of them, and the root's.

Run: python bench/edges.py [--quick] [--cohort N]   (results in bench/README.md,
"Edge aggregators")
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import pathlib
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from fedlang import deploy

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import deploy as deploy_bench  # bench/deploy.py: the round of float32 updates

ROOT = pathlib.Path(__file__).resolve().parents[1]
ADMIN = "bench"


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """`fedlang serve ARGS` on a fresh port (its url, pid, CPU seconds)."""

    def __init__(self, db: pathlib.Path, *args: str):
        port = _port()
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLANG_ADMIN_TOKEN": ADMIN}
        self.url = f"http://127.0.0.1:{port}"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "fedlang", "serve", "--db", str(db), "--port", str(port),
             "--min-retry", "0.05", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
        )
        end = time.monotonic() + 120
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise RuntimeError(f"fedlang serve {' '.join(args)} exited ({self.proc.returncode})")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/v1/status", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise RuntimeError(f"{self.url} did not come up")

    def cpu(self) -> float:
        fields = pathlib.Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def peak_rss(self) -> int:
        """The most memory the process has held resident since it started (bytes)."""
        for line in pathlib.Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
        raise RuntimeError(f"no VmHWM in /proc/{self.proc.pid}/status")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=30)


async def _enroll(url: str, token: str, n: int) -> list[tuple[str, str]]:
    async with httpx.AsyncClient(base_url=url, timeout=120) as h:
        async def enroll(_: int) -> tuple[str, str]:
            r = await h.post("/v1/populations/pop/enroll",
                             headers={"Authorization": f"Bearer {token}"})
            r.raise_for_status()
            return url, r.json()["credential"]

        return await deploy_bench.gather(n, enroll)


async def _clients(clients: list[tuple[str, str]], report: bytes) -> None:
    """Each client checks in (until it gets a task) and uploads `report`."""
    hosts = {url: httpx.AsyncClient(base_url=url, timeout=120,
                                    limits=httpx.Limits(max_connections=deploy_bench.CONCURRENCY))
             for url in {u for u, _ in clients}}
    try:
        async def client(i: int) -> None:
            url, credential = clients[i]
            h, auth = hosts[url], {"Authorization": f"Bearer {credential}"}
            while True:
                answer = (await h.post("/v1/checkin", headers=auth)).json()
                if answer["task"]:
                    break
                await asyncio.sleep(answer["retry_after"])
            r = await h.put(f"/v1/rounds/{answer['task']['round']}/report", content=report,
                            headers={**auth, **deploy.protocol.task_header(answer["task"])})
            assert r.status_code == 200 and not r.json()["replay"], r.text

        await deploy_bench.gather(len(clients), client)
    finally:
        for h in hosts.values():
            await h.aclose()


def _measure(servers: list[Process], root: Process, clients: list[tuple[str, str]],
             report: bytes, round_id: int) -> dict[str, float]:
    cpu0 = [s.cpu() for s in servers]
    start = time.perf_counter()
    asyncio.run(_clients(clients, report))
    with deploy.Admin(root.url, ADMIN) as admin:
        while (r := admin.round(round_id, wait=5))["state"] == "open":
            pass
    assert r["state"] == "closed" and r["reports"] == len(clients), r
    seconds = time.perf_counter() - start
    cpu = [s.cpu() - c for s, c in zip(servers, cpu0)]
    peaks = [s.peak_rss() for s in servers]
    return {"seconds": seconds, "cpu": sum(cpu), "root_cpu": cpu[0], "peak_rss": max(peaks),
            "root_peak_rss": peaks[0]}


def one_server(work: pathlib.Path, plan: Any, broadcast: bytes, report: bytes,
               cohort: int) -> dict[str, float]:
    server = Process(work / "single.db")
    try:
        with deploy.Admin(server.url, ADMIN) as admin:
            token = admin.create_population("pop")
            clients = asyncio.run(_enroll(server.url, token, cohort))
            round_id = admin.create_round("pop", admin.put_blob(plan.to_bytes()),
                                          admin.put_blob(broadcast), target=cohort,
                                          deadline=3600)["id"]
        return _measure([server], server, clients, report, round_id)
    finally:
        server.stop()


def root_and_edges(work: pathlib.Path, plan: Any, broadcast: bytes, report: bytes,
                   cohort: int, edges: int = 2) -> dict[str, float]:
    root = Process(work / "root.db")
    servers = [root]
    try:
        with deploy.Admin(root.url, ADMIN) as admin:
            admin.create_population("pop")
            tokens = [admin.create_edge(f"edge{i}", "pop") for i in range(edges)]
        for i, token in enumerate(tokens):
            servers.append(Process(work / f"edge{i}.db", "--upstream", root.url,
                                   "--upstream-token", token))
        clients = []
        for i, edge in enumerate(servers[1:]):
            with deploy.Admin(edge.url, ADMIN) as admin:
                token = admin.rotate_token("pop")  # the edge made its population at start
            share = cohort // edges + (1 if i < cohort % edges else 0)
            clients += asyncio.run(_enroll(edge.url, token, share))
        with deploy.Admin(root.url, ADMIN) as admin:
            round_id = admin.create_round("pop", admin.put_blob(plan.to_bytes()),
                                          admin.put_blob(broadcast), target=cohort,
                                          deadline=3600)["id"]
        end = time.monotonic() + 60
        for edge in servers[1:]:  # each edge mirrors the round before the clients come
            while not httpx.get(f"{edge.url}/v1/status", timeout=10).json()["rounds"]:
                assert time.monotonic() < end, "an edge did not mirror the round"
                time.sleep(0.05)
        return _measure(servers, root, clients, report, round_id)
    finally:
        for s in servers:
            s.stop()


def run(cohort: int, floats: int = 10**5) -> list[dict[str, Any]]:
    plan, broadcast, report = deploy_bench.update_round(floats)
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-edges-"))
    rows = []
    single = one_server(work, plan, broadcast, report, cohort)
    edged = root_and_edges(work, plan, broadcast, report, cohort)
    for name, m in (("one server", single), ("root + 2 edges", edged)):
        rows.append({
            "setup": name, "cohort": cohort, "report_kb": len(report) / 1e3,
            "round_s": round(m["seconds"], 2), "server_cpu_s": round(m["cpu"], 2),
            "cpu_ms_per_report": round(1e3 * m["cpu"] / cohort, 1),
            "root_cpu_ms_per_report": round(1e3 * m["root_cpu"] / cohort, 1),
            "vs_one_server": round(m["cpu"] / single["cpu"], 3),
            "peak_rss_mb": round(m["peak_rss"] / 2**20, 1),
            "root_peak_rss_mb": round(m["root_peak_rss"] / 2**20, 1),
        })
        print(json.dumps(rows[-1]), flush=True)
    print()
    print("| setup | cohort | report | round | server CPU | CPU per report | root's CPU per "
          "report | CPU vs one server | peak RSS of a server | root's peak RSS |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['cohort']:,} | {r['report_kb']:.0f} KB | {r['round_s']} s | "
              f"{r['server_cpu_s']} s | {r['cpu_ms_per_report']} ms | "
              f"{r['root_cpu_ms_per_report']} ms | {r['vs_one_server']:.2f} | "
              f"{r['peak_rss_mb']} MB | {r['root_peak_rss_mb']} MB |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="A cohort of 40.")
    parser.add_argument("--cohort", type=int, default=1000, help="Clients in the round.")
    args = parser.parse_args()
    run(40 if args.quick else args.cohort)


if __name__ == "__main__":
    main()
