"""A secure round over HTTP next to a plain round of the same cohort.

    PYTHONPATH=src .venv/bin/python bench/secagg_http.py            # cohorts 10 and 100
    PYTHONPATH=src .venv/bin/python bench/secagg_http.py --quick    # cohort 5, a few seconds

`fedlang serve` (SQLite) runs in its own process (a fresh one per round); the clients
are lightweight in-process HTTP clients (`httpx.AsyncClient`, 16 connections), as in
`bench/deploy.py`. Every client holds a vector of `length` int32 values below 2^16:

* plain: the round sums them with `federated_sum`; each client checks in, downloads the
  plan and the broadcast, and uploads its report (the vector's int64 partial);
* secure: the round sums them with `federated_secure_sum_bitwidth(x, 16)`; each client
  checks in, downloads, then takes part in the four stages of SecAgg+ (`SecAggClient`),
  polling for each stage's request as the server says (`--min-retry 0.05`).

Per round: wall time (round opened -> closed), client CPU per client (the protocol's
work: `SecAggClient` calls and building the messages; for the plain round, serializing
the report; the local computation, the same in both, is left out), bytes a client sends
(request bodies), server CPU (user + system time of the server process over the
round, polling included) and the server's peak RSS. Each secure round's sum is checked.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import importlib.util
import json
import os
import pathlib
import tempfile
import time
from typing import Any

import httpx
import jax.numpy as jnp
import numpy as np

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization
from fedlang.deploy import protocol, secagg
from fedlang.deploy.plans import execution

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONCURRENCY = 16
BITS = 16


def _bench_deploy() -> Any:
    spec = importlib.util.spec_from_file_location("bench_deploy", ROOT / "bench" / "deploy.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


BENCH = _bench_deploy()  # its server process, RSS reader and round capture


def plans(length: int) -> dict[str, tuple[Any, bytes]]:
    """(plan, broadcast) of the plain and the secure round over int32[length] vectors."""
    element = fl.TensorType(np.int32, [length])

    @fl.jax_computation(fl.SequenceType(element))
    def local(ds: Any) -> Any:
        return ds.reduce(jnp.zeros(length, np.int32), lambda s, x: s + x)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(element)))
    def plain(data: Any) -> Any:
        return fl.federated_sum(fl.federated_map(local, data))

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(element)))
    def secure(data: Any) -> Any:
        return fl.federated_secure_sum_bitwidth(fl.federated_map(local, data), BITS)

    out = {}
    # the plain sum's vectors are drawn below 2**12 plus a cohort's size: declared as a user
    # would (the secure round's input travels masked: no plain leaf to bound)
    plain_bounds = deploy.ReportBounds(ranges={"[0]": (0, 1 << 20)})
    for name, comp, bounds in (("plain", plain, plain_bounds), ("secure", secure, None)):
        runner = BENCH.Capture()
        with contextlib.suppress(StopIteration), context.with_context(
            deploy.DeploymentContext(runner, bounds=bounds or deploy.ReportBounds())
        ):
            comp(deploy.client_data("train"))
        out[name] = (runner.plan, runner.broadcast)
    return out


def server_cpu(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Cohort:
    """One client's contribution (its report also decoded, to time its serialization) and
    its costs."""

    def __init__(self, plan: Any, parts: execution.ClientReport):
        self.parts = parts
        self.report_type = plan.report_type
        self.report_value = serialization.deserialize_value(parts.report,
                                                            expected_type=self.report_type)
        self.cpu = 0.0
        self.sent = 0


async def _client(h: httpx.AsyncClient, credential: str, me: Cohort, kind: str,
                  client_id: str) -> None:
    auth = {"Authorization": f"Bearer {credential}"}

    async def send(path: str, body: bytes) -> None:
        me.sent += len(body)
        r = await h.put(path, content=body, headers={**auth, **protocol.task_header(task)})
        assert r.status_code == 200, r.text

    while True:
        answer = (await h.post("/v1/checkin", headers=auth)).json()
        if answer["task"]:
            break
        await asyncio.sleep(answer["retry_after"])
    task = answer["task"]
    for blob in (task["plan"], task["broadcast"]):
        (await h.get(f"/v1/blobs/{blob}", headers=auth)).raise_for_status()
    if kind == "plain":
        t = time.process_time()
        report = serialization.serialize_value(me.report_value, me.report_type)
        me.cpu += time.process_time() - t
        await send(f"/v1/rounds/{task['round']}/report", report)
        return
    path = f"/v1/rounds/{task['round']}/secagg"
    sa = None
    while True:
        step = (await h.get(path, headers=auth)).json()
        if step["finished"]:
            return
        if step["request"] is None:
            await asyncio.sleep(step["retry_after"])
            continue
        stage, request = step["stage"], base64.b64decode(step["request"])
        t = time.process_time()
        if stage == 1:
            sa = secagg.SecAggClient(client_id, request)
            message = sa.advertise_keys()
        elif stage == 2:
            message = sa.share_keys(request)  # type: ignore[union-attr]
        elif stage == 3:
            masked = sa.masked_input(request, me.parts.secure)  # type: ignore[union-attr]
            message = protocol.pack_masked_input(me.parts.report, masked)
        else:
            message = sa.unmask(request)  # type: ignore[union-attr]
        me.cpu += time.process_time() - t
        await send(f"{path}/{stage}", message)


async def _round(url: str, pid: int, plan: Any, broadcast: bytes, cohort: list[Cohort],
                 kind: str) -> dict[str, Any]:
    n = len(cohort)
    with deploy.Admin(url, "bench") as admin:
        token = admin.create_population("pop")
        plan_hash, broadcast_hash = admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast)
    limits = httpx.Limits(max_connections=CONCURRENCY)
    async with httpx.AsyncClient(base_url=url, timeout=300, limits=limits) as h:
        enrolled = [(await h.post("/v1/populations/pop/enroll",
                                  headers={"Authorization": f"Bearer {token}"})).json()
                    for _ in range(n)]
        with deploy.Admin(url, "bench") as admin:
            cpu, start = server_cpu(pid), time.perf_counter()
            created = admin.create_round("pop", plan_hash, broadcast_hash, target=n,
                                         deadline=3600, stage_timeout=600)
        await asyncio.gather(*(_client(h, e["credential"], me, kind, e["client_id"])
                               for e, me in zip(enrolled, cohort)))
        with deploy.Admin(url, "bench") as admin:
            while (r := admin.round(created["id"], wait=5))["state"] == "open":
                pass
            seconds, cpu = time.perf_counter() - start, server_cpu(pid) - cpu
            aggregate = admin.aggregate(created["id"])
    assert r["state"] == "closed" and r["reports"] == n, r
    return {"seconds": seconds, "server_cpu": cpu, "aggregate": aggregate,
            "client_cpu": sum(c.cpu for c in cohort) / n,
            "client_bytes": sum(c.sent for c in cohort) / n}


def run(cohorts: list[int], length: int) -> list[dict[str, Any]]:
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-secagg-http-"))
    rounds = plans(length)
    base = np.random.default_rng(0).integers(0, 2**12, length).astype(np.int32)
    rows = []
    for n in cohorts:
        vectors = [base + i for i in range(n)]
        row: dict[str, Any] = {"clients": n, "elements": length}
        for kind, (plan, broadcast) in rounds.items():
            cohort = [Cohort(plan, execution.run_plan_parts(plan, broadcast, {"train": [v]}))
                      for v in vectors]
            with BENCH.server_process(work / f"{kind}{n}.db") as (url, pid):
                got = asyncio.run(_round(url, pid, plan, broadcast, cohort, kind))
                got["peak_rss_mb"] = BENCH.peak_rss_mb(pid)
            (total,) = deploy.Folder(plan).results(got.pop("aggregate"))
            want = np.sum(vectors, axis=0, dtype=np.int64)
            assert np.array_equal(np.asarray(total, np.int64), want), f"wrong {kind} sum"
            row[kind] = got
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| clients | elements | round | plain | client CPU | plain | bytes sent / client | "
        "plain | server CPU | plain | server peak RSS | plain |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        s, p = r["secure"], r["plain"]
        lines.append(
            f"| {r['clients']:,} | {r['elements']:,} | {s['seconds']:.2f} s | {p['seconds']:.2f} s "
            f"| {s['client_cpu'] * 1e3:.2f} ms | {p['client_cpu'] * 1e3:.3f} ms "
            f"| {s['client_bytes'] / 1e3:.1f} kB | {p['client_bytes'] / 1e3:.1f} kB "
            f"| {s['server_cpu']:.2f} s | {p['server_cpu']:.2f} s "
            f"| {s['peak_rss_mb']:.0f} MB | {p['peak_rss_mb']:.0f} MB |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="Cohort 5, 1,000 elements.")
    parser.add_argument("--length", type=int, default=10_000)
    args = parser.parse_args(argv)
    rows = run([5], 1000) if args.quick else run([10, 100], args.length)
    print(table(rows))
    return rows


if __name__ == "__main__":
    main()
