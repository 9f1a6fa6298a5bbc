"""A population of up to 10^6 enrolled clients against one `fedlang serve` (issue 24,
pace steering at population scale).

Two measurements:

* **Server** (`fedlang serve` on SQLite in its own process, a fresh one per size): the
  time to enroll N clients in bulk (`Admin.enroll_bulk`, 100,000 a request, credentials
  streamed to a file) and the server's RSS after it; then, on a fresh server of the
  same database, its RSS when idle and after the check-ins, and the latency of
  check-ins (p50, p99) by 16 concurrent asyncio clients whose credentials are drawn
  uniformly from the N (reservoir sampling over the file), with a round open that a
  quarter of them are assigned to.
* **Fleet** (in this process, the real store on SQLite, a simulated clock): devices
  that behave as `Client.run` does (check in, wait what they are told, report after
  5-15 s of training and check in again at once) over R rounds opened by a driver as
  soon as the last one closed. Selection is uniform when each device's count of rounds
  has binomial dispersion (variance / (R p (1 - p)) ~ 1, p = a round's share of the
  population; a chi-square over devices gives the same statistic times N - 1), and
  pace steering keeps its rate when the mean check-ins per second stay near
  `--checkins-per-second` and the busiest second is not a herd.

Run: python bench/population.py [--sizes 10000,100000,1000000] [--fleet 1000,10000]
(results in bench/README.md, "Populations at scale"); `--enroll-only URL` times only
the store's bulk enrollment, in this process, on any database (e.g. PostgreSQL).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import heapq
import json
import os
import pathlib
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import numpy as np

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.deploy import protocol
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.plans import execution, folding
from fedlang.deploy.store import bulk
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import shards as shards_lib
from fedlang.deploy.store import store as store_lib

ROOT = pathlib.Path(__file__).resolve().parents[1]
CONCURRENCY = 16


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _proc_mb(pid: int, field: str) -> float:
    for line in pathlib.Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


@contextlib.contextmanager
def server_process(db: pathlib.Path, rate: float) -> Any:
    """`fedlang serve` on a fresh port; yields (url, pid)."""
    port = _port()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLANG_ADMIN_TOKEN": "bench"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "serve", "--db", str(db), "--port", str(port),
         "--checkins-per-second", str(rate)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        end = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited ({proc.returncode})")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/v1/status", timeout=2).status_code == 200:
                    break
            if time.monotonic() > end:
                raise RuntimeError(f"{url} did not come up")
            time.sleep(0.1)
        yield url, proc.pid
    finally:
        proc.terminate()
        proc.wait(timeout=60)


class _Capture:
    def run_round(self, plan: Any, broadcast: bytes) -> Any:
        self.plan, self.broadcast = plan, broadcast
        raise StopIteration


def small_round() -> tuple[Any, bytes]:
    """(plan, broadcast) of a round summing each client's float32[3] rows."""
    element = fl.TensorType(np.float32, [3])

    @fl.jax_computation(fl.SequenceType(element))
    def local(ds: Any) -> Any:
        return ds.reduce(np.zeros(3, np.float32), lambda s, x: s + x)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(element)))
    def total(data: Any) -> Any:
        return fl.federated_sum(fl.federated_map(local, data))

    runner = _Capture()
    bounds = deploy.ReportBounds(ranges={"[0]": (-1e3, 1e3)})  # each client sums a row of ones
    ctx = deploy.DeploymentContext(runner, bounds=bounds)
    with contextlib.suppress(StopIteration), context.with_context(ctx):
        total(deploy.client_data("train"))
    return runner.plan, runner.broadcast


def sample_credentials(path: pathlib.Path, k: int, seed: int = 0) -> list[str]:
    """`k` credentials drawn uniformly from the file, read line by line (reservoir)."""
    rng, chosen = random.Random(seed), []
    with open(path, "rb") as f:
        for i, doc in enumerate(admin_lib.read_credentials(f)):
            if i < k:
                chosen.append(doc["credential"])
            elif (j := rng.randrange(i + 1)) < k:
                chosen[j] = doc["credential"]
    return chosen


async def _checkins(url: str, creds: list[str]) -> tuple[list[float], float, int]:
    """Per check-in latency (s), the wall time, and how many were given a task."""
    latencies: list[float] = []
    assigned = 0
    queue = collections.deque(creds)
    async with httpx.AsyncClient(base_url=url, timeout=120,
                                 limits=httpx.Limits(max_connections=CONCURRENCY)) as h:
        async def worker() -> None:
            nonlocal assigned
            while queue:
                cred = queue.popleft()
                start = time.perf_counter()
                r = await h.post("/v1/checkin", headers={"Authorization": f"Bearer {cred}"})
                latencies.append(time.perf_counter() - start)
                r.raise_for_status()
                assigned += r.json()["task"] is not None

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(CONCURRENCY)))
        return latencies, time.perf_counter() - start, assigned


def serve_row(n: int, checkins: int, rate: float, work: pathlib.Path) -> dict[str, Any]:
    """Enrolls `n` clients through one server, then measures check-ins on a fresh one
    (the population as a server restarted after enrolling it serves it: the RSS the
    bulk requests leave behind, about one request's secrets and SQLite's enrollment
    cache, is measured apart)."""
    plan, broadcast = small_round()
    creds_file, db = work / f"creds{n}.ndjson", work / f"pop{n}.db"
    with server_process(db, rate) as (url, pid), \
            deploy.Admin(url, "bench", timeout=600) as admin:
        admin.create_population("pop")
        start = time.perf_counter()
        with open(creds_file, "wb") as f:
            admin.enroll_bulk("pop", n, f)
        enroll = time.perf_counter() - start
        enrolled = _proc_mb(pid, "VmRSS")
    creds = sample_credentials(creds_file, checkins)
    creds_file.unlink()
    with server_process(db, rate) as (url, pid), deploy.Admin(url, "bench") as admin:
        admin.status()
        idle = _proc_mb(pid, "VmRSS")
        target = max(1, checkins // 4)
        admin.create_round("pop", admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast),
                           target=target, deadline=3600)
        latencies, wall, assigned = asyncio.run(_checkins(url, creds))
        after = _proc_mb(pid, "VmRSS")
        peak = _proc_mb(pid, "VmHWM")
    ms = sorted(x * 1e3 for x in latencies)
    return {
        "enrolled": n, "enroll_s": round(enroll, 1), "enroll_per_s": round(n / enroll),
        "db_mb": round(sum(f.stat().st_size for f in work.glob(f"pop{n}.db*")) / 2**20),
        "rss_after_enrolling_mb": round(enrolled),
        "rss_idle_mb": round(idle), "rss_after_checkins_mb": round(after),
        "rss_peak_mb": round(peak), "checkins": len(ms), "assigned": assigned,
        "p50_ms": round(ms[len(ms) // 2], 1), "p99_ms": round(ms[int(len(ms) * 0.99)], 1),
        "checkins_per_s": round(len(ms) / wall),
    }


class _Clock:
    now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


def fleet_row(n: int, target: int, rounds: int, rate: float, deadline: float,
              work: pathlib.Path, seed: int = 0) -> dict[str, Any]:
    """The fleet simulation (see the module docstring) on a fresh SQLite store."""
    clock, rng = _Clock(), random.Random(seed)
    store = store_lib.Store(work / f"fleet{n}-{deadline:g}.db", clock=clock,
                            pace=store_lib.Pace(checkins_per_second=rate),
                            rng=random.Random(seed + 1))
    # reports taken as the server takes them: by the shards, with a real round's folder
    plan, broadcast = small_round()
    folder = folding.Folder(plan)
    body = execution.run_plan(plan, broadcast, {"train": [np.ones(3, np.float32)]})
    checked = folder.check(body)
    rr = rounds_lib.Rounds(store, lambda _: folder)
    writer = shards_lib.ReportShards(rr)
    store.create_population("pop")
    ids: list[str] = []
    bulk.enroll_bulk(store, "pop", n, 1e9, lambda made: ids.extend(i for i, _ in made))
    options = rounds_lib.CohortOptions(target=target, over_selection=0.3, deadline=deadline)
    events: list[tuple[float, int, str, Any]] = []
    seq = 0

    def at(t: float, kind: str, what: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (t, seq, kind, what))

    for device in range(n):
        at(clock.now + rng.uniform(0, store.pace.base(n)), "checkin", device)
    at(clock.now, "open", None)
    selected: collections.Counter[int] = collections.Counter()
    times: list[float] = []
    closed, current = 0, None
    start = time.perf_counter()
    while closed < rounds:
        t, _, kind, what = heapq.heappop(events)
        clock.now = t
        if kind == "open":
            current = rr.create("pop", "plan", "broadcast", options, folder.empty()).id
        elif kind == "checkin":
            times.append(t)
            got = rr.checkin(ids[what], "pop")
            if isinstance(got, rounds_lib.Task):
                selected[what] += 1
                at(t + rng.uniform(5.0, 15.0), "report", (what, got.round))
            else:
                at(t + got, "checkin", what)
        else:
            device, round_id = what
            with contextlib.suppress(protocol.Gone):  # over-selected, too late
                writer.accept(round_id, ids[device], protocol.blob_hash(body), len(body), checked)
            if round_id == current and rr.round(round_id).state != "open":
                closed, current = closed + 1, None
                at(t + 0.1, "open", None)
            at(t, "checkin", device)
    seconds = time.perf_counter() - start
    writer.close()
    store.close()
    counts = [selected[d] for d in range(n)]
    p = sum(counts) / (n * rounds)
    mean = statistics.fmean(counts)
    dispersion = statistics.pvariance(counts) / (rounds * p * (1 - p))
    per_second = collections.Counter(int(x) for x in times)
    return {
        "devices": n, "target": target, "rounds": rounds, "deadline_s": deadline,
        "rate_asked": rate, "mean_selected": round(mean, 2), "dispersion": round(dispersion, 3),
        "never": counts.count(0), "never_expected": round(n * (1 - p) ** rounds, 1),
        "checkins": len(times), "rate_per_s": round(len(times) / (max(times) - min(times)), 1),
        "busiest_second": max(per_second.values()), "sim_s": round(seconds, 1),
    }


def enroll_in_process(url: str, n: int) -> dict[str, Any]:
    """`n` clients through `store.bulk` in this process (no HTTP), 100,000 a call, on
    any database URL: the store's own cost, e.g. on PostgreSQL."""
    store = store_lib.Store(url)
    try:
        name = f"bench-{time.time_ns()}"
        store.create_population(name)
        start, done = time.perf_counter(), 0
        while done < n:
            k = min(bulk.MAX_BULK, n - done)
            bulk.enroll_bulk(store, name, k, 3600.0, lambda made: None)
            done += k
        seconds = time.perf_counter() - start
    finally:
        store.close()
    return {"database": store.dialect.name, "enrolled": n, "enroll_s": round(seconds, 1),
            "enroll_per_s": round(n / seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10000,100000,1000000",
                        help="Enrolled clients of each server run (comma-separated).")
    parser.add_argument("--checkins", type=int, default=4000, help="Check-ins measured per size.")
    parser.add_argument("--fleet", default="1000,10000", help="Devices of each fleet run.")
    parser.add_argument("--rounds", type=int, default=60, help="Rounds of each fleet run.")
    parser.add_argument("--enroll-only", metavar="URL",
                        help="Only enroll max(--sizes) clients in this process on this database.")
    args = parser.parse_args()
    if args.enroll_only:
        n = max(int(x) for x in args.sizes.split(",") if x)
        print(json.dumps(enroll_in_process(args.enroll_only, n)), flush=True)
        return
    work = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-bench-population-"))
    for n in (int(x) for x in args.sizes.split(",") if x):
        print(json.dumps(serve_row(n, min(args.checkins, n), 100.0, work)), flush=True)
    for n in (int(x) for x in args.fleet.split(",") if x):
        target = max(10, n // 100)
        # a 600 s deadline (longer than the wait), then 30 s (shorter: where a wait cut
        # to the deadline gathered a herd)
        for deadline in (600.0, 30.0):
            row = fleet_row(n, target, args.rounds, n / 100, deadline, work)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
