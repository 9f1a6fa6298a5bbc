"""The task store server under load from lightweight in-process HTTP clients.

Measures, against `fedlang serve` (SQLite) in its own process:

* reports/s accepted for updates of 10^4 and 10^6 float32 values, and the payload MB/s
  next to a plain FastAPI echo server's for the same payloads (same client, same
  concurrency): the ratio is the cost of checking, folding and committing a report;
* round latency (round opened -> closed) for cohorts of 10, 100 and 1,000 clients that
  each check in, download the plan and broadcast, and upload a 10^4-float report;
* the server's peak RSS for each cohort (a fresh server per cohort).

Run: python bench/deploy.py [--quick]   (results in bench/README.md, "Deployment")
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
from collections.abc import Sequence
from typing import Any

import fastapi
import httpx
import numpy as np
import uvicorn

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.deploy.plans import execution

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"  # the fedlang the server processes run (bench/load.py --src)
CONCURRENCY = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def server_process(db: pathlib.Path | str, extra: Sequence[str] = ()) -> Any:
    """`fedlang serve` on a fresh port (database: a path or URL; `extra` arguments);
    yields (url, pid)."""
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(SRC), "FEDLANG_ADMIN_TOKEN": "bench"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "serve", "--db", str(db), "--port", str(port),
         "--min-retry", "0.05", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    try:
        _wait_up(f"http://127.0.0.1:{port}/v1/status", proc)
        yield f"http://127.0.0.1:{port}", proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@contextlib.contextmanager
def echo_process() -> Any:
    port = _port()
    proc = subprocess.Popen([sys.executable, __file__, "echo-server", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _wait_up(f"http://127.0.0.1:{port}/ping", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _wait_up(url: str, proc: subprocess.Popen[Any]) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError(f"the server exited ({proc.returncode})")
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def echo_server(port: int) -> None:
    """A plain FastAPI app that reads an upload and answers its size (the baseline)."""
    app = fastapi.FastAPI()

    @app.get("/ping")
    def ping() -> dict[str, bool]:
        return {"ok": True}

    @app.put("/echo")
    async def echo(request: fastapi.Request) -> dict[str, int]:
        return {"size": len(await request.body())}

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", access_log=False)


def peak_rss_mb(pid: int) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


class Capture:
    def run_round(self, plan: Any, broadcast: bytes) -> Any:
        self.plan, self.broadcast = plan, broadcast
        raise StopIteration


def update_round(n: int) -> tuple[Any, bytes, bytes]:
    """(plan, broadcast, one client's report) of a round summing float32[n] updates."""
    element = fl.TensorType(np.float32, [n])

    @fl.jax_computation(fl.SequenceType(element))
    def local(ds: Any) -> Any:
        return ds.reduce(np.zeros(n, np.float32), lambda s, x: s + x)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(element)))
    def total(data: Any) -> Any:
        return fl.federated_sum(fl.federated_map(local, data))

    runner = Capture()
    # a norm bound on the update, so each report also passes the bounds check (issue 23)
    bounds = deploy.ReportBounds(norms={("[0]",): 1e9})
    with contextlib.suppress(StopIteration), \
            context.with_context(deploy.DeploymentContext(runner, bounds=bounds)):
        total(deploy.client_data("train"))
    rng = np.random.default_rng(0)
    report = execution.run_plan(runner.plan, runner.broadcast,
                                {"train": [rng.normal(size=n).astype(np.float32)]})
    return runner.plan, runner.broadcast, report


async def gather(n: int, fn: Any) -> list[Any]:
    gate = asyncio.Semaphore(CONCURRENCY)

    async def one(i: int) -> Any:
        async with gate:
            return await fn(i)

    return await asyncio.gather(*(one(i) for i in range(n)))


async def _enroll(h: httpx.AsyncClient, token: str, n: int) -> list[str]:
    async def enroll(_: int) -> str:
        r = await h.post("/v1/populations/pop/enroll", headers={"Authorization": f"Bearer {token}"})
        r.raise_for_status()
        return r.json()["credential"]

    return await gather(n, enroll)


def _open_round(url: str, plan: Any, broadcast: bytes, target: int) -> tuple[str, int, str]:
    with deploy.Admin(url, "bench") as admin:
        token = admin.create_population("pop")
        created = admin.create_round("pop", admin.put_blob(plan.to_bytes()),
                                     admin.put_blob(broadcast), target=target, deadline=3600)
    return token, created["id"], created["plan"]


async def _throughput(url: str, plan: Any, broadcast: bytes, report: bytes, m: int) -> float:
    """Seconds for `m` assigned clients to upload their reports (accepted)."""
    token, round_id, _ = _open_round(url, plan, broadcast, m)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as h:
        creds = await _enroll(h, token, m)

        async def checkin(i: int) -> None:
            r = await h.post("/v1/checkin", headers={"Authorization": f"Bearer {creds[i]}"})
            assert r.json()["task"]["round"] == round_id

        await gather(m, checkin)

        async def upload(i: int) -> None:
            r = await h.put(f"/v1/rounds/{round_id}/report", content=report,
                            headers={"Authorization": f"Bearer {creds[i]}",
                                     **deploy.protocol.task_header({"round": round_id})})
            assert r.status_code == 200 and not r.json()["replay"], r.text

        start = time.perf_counter()
        await gather(m, upload)
        return time.perf_counter() - start


async def _echo(url: str, report: bytes, m: int) -> float:
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=CONCURRENCY)) as h:
        async def upload(_: int) -> None:
            (await h.put("/echo", content=report)).raise_for_status()

        start = time.perf_counter()
        await gather(m, upload)
        return time.perf_counter() - start


async def _round_latency(url: str, plan: Any, broadcast: bytes, report: bytes, n: int) -> float:
    """Seconds from opening a round of cohort `n` until it closes, every client checking
    in, downloading the plan and broadcast and uploading its report."""
    limits = httpx.Limits(max_connections=CONCURRENCY)
    with deploy.Admin(url, "bench") as admin:
        token = admin.create_population("pop")
        plan_hash, broadcast_hash = admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast)
    async with httpx.AsyncClient(base_url=url, timeout=120, limits=limits) as h:
        creds = await _enroll(h, token, n)
        with deploy.Admin(url, "bench") as admin:
            start = time.perf_counter()
            created = admin.create_round("pop", plan_hash, broadcast_hash, target=n, deadline=3600)

        async def client(i: int) -> None:
            auth = {"Authorization": f"Bearer {creds[i]}"}
            while True:
                answer = (await h.post("/v1/checkin", headers=auth)).json()
                if answer["task"]:
                    break
                await asyncio.sleep(answer["retry_after"])
            task = answer["task"]
            for blob in (task["plan"], task["broadcast"]):
                (await h.get(f"/v1/blobs/{blob}", headers=auth)).raise_for_status()
            r = await h.put(f"/v1/rounds/{task['round']}/report", content=report,
                            headers={**auth, **deploy.protocol.task_header(task)})
            r.raise_for_status()

        await gather(n, client)
        with deploy.Admin(url, "bench") as admin:
            while admin.round(created["id"], wait=5)["state"] == "open":
                pass
        return time.perf_counter() - start


def run(quick: bool = False) -> dict[str, Any]:
    results: dict[str, Any] = {"throughput": [], "latency": []}
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-deploy-"))
    sizes = [(10**4, 100 if quick else 1000), (10**6, 10 if quick else 100)]
    for n, m in sizes:
        plan, broadcast, report = update_round(n)
        with server_process(work / f"throughput{n}.db") as (url, _):
            seconds = asyncio.run(_throughput(url, plan, broadcast, report, m))
        with echo_process() as url:
            echo = asyncio.run(_echo(url, report, m))
        mb = len(report) * m / 1e6
        row = {"floats": n, "reports": m, "report_bytes": len(report),
               "reports_per_s": m / seconds, "mb_per_s": mb / seconds,
               "echo_mb_per_s": mb / echo, "ratio": echo / seconds}
        results["throughput"].append(row)
        print(json.dumps(row), flush=True)
    plan, broadcast, report = update_round(10**4)
    for n in [10, 100] if quick else [10, 100, 1000]:
        with server_process(work / f"latency{n}.db") as (url, pid):
            seconds = asyncio.run(_round_latency(url, plan, broadcast, report, n))
            row = {"cohort": n, "seconds": seconds, "peak_rss_mb": peak_rss_mb(pid)}
        results["latency"].append(row)
        print(json.dumps(row), flush=True)
    return results


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "echo-server":
        echo_server(int(sys.argv[2]))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Fewer reports, cohorts 10 and 100.")
    args = parser.parse_args()
    run(args.quick)


if __name__ == "__main__":
    main()
