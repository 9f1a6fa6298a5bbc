"""CPU per step of the intake, one report after another in one thread (no concurrency):
what the intake's own work costs, apart from serving it (bench/README.md, "Scaling").

A real `fedlang serve` (SQLite) opens a round and checks `N` clients in (bench/load.py's
`_prepare`), then stops; this process opens the same database as a `ServerState` and
times each step of `intake.take` for each client's report with `time.thread_time`
(`--accept` also accepts them, each alone in its group commit).

Run: python bench/intake_steps.py [--reports 400] [--size 80K] [--accept]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import pathlib
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from fastapi import security

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

import load  # bench/load.py: the round and its clients

import deploy as deploy_bench  # bench/deploy.py: servers, plans
from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, serve
from fedlang.deploy.server import rounds as server_rounds
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import store as store_lib


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reports", type=int, default=400)
    parser.add_argument("--size", default="80K", choices=list(load.SIZES))
    parser.add_argument("--accept", action="store_true", help="Also time accepting each.")
    args = parser.parse_args()
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-steps-"))
    db, key = str(work / "steps.db"), work / "signing.key"
    plan, broadcast, report = deploy_bench.update_round(load.SIZES[args.size])
    with deploy_bench.server_process(db, ["--key-file", str(key)]) as (url, _):
        round_id, targets = asyncio.run(load._prepare([url], plan, broadcast, args.reports))
    store = store_lib.Store(db)
    server = state_lib.ServerState(store, serve.load_key(str(key), store, db),
                                   store_lib.secret_hash("bench"))
    uploads = server_rounds.ReportUploads(server)
    times: dict[str, list[float]] = {}

    def timed(step: str, fn: Callable[..., Any], *args: Any) -> Any:
        start = time.thread_time()
        value = fn(*args)
        times.setdefault(step, []).append(1e6 * (time.thread_time() - start))
        return value

    try:
        for _, _, _, credential in targets:
            auth = security.HTTPAuthorizationCredentials(scheme="Bearer", credentials=credential)
            client, population = timed("authenticate (a read transaction)",
                                       auth_lib.client, server, auth)
            target = timed("find the round (a read transaction)",
                           uploads.target, round_id)
            timed("its limit (the plan's folder, cached)", uploads.limit, target, 0)
            upload = intake.Upload(client, population, 0, report)
            digest = timed("SHA-256 of the body", protocol.blob_hash, report)
            upload = dataclasses.replace(upload, digest=digest)
            timed("precheck (a read transaction)", uploads.precheck, target, upload)
            checked = timed("check (decode, finite, one client)",
                            uploads.check, target, upload)
            upload = dataclasses.replace(upload, checked=checked)
            timed("bounds", folding.check_bounds,
                  *uploads.bounded(target, upload))
            if args.accept:
                timed("accept (its own group commit)", uploads.accept, target, upload)
    finally:
        server.shards.close()
        store.close()
    print(f"{args.size} reports, SQLite, {args.reports} reports: CPU µs per report (median)")
    print("| step | µs |\n|---|---:|")
    for step, values in times.items():
        print(f"| {step} | {statistics.median(values):.0f} |")
    total = sum(statistics.median(v) for v in times.values())
    print(f"| **sum** | **{total:.0f}** |")


if __name__ == "__main__":
    main()
