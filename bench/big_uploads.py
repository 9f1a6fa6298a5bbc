"""Many large reports at once into one `fedlang serve` (issue 40): the server's memory
must not grow with the uploads in flight.

Ten training clients of a 1,000 MiB model do not fit a 24 GB machine, so a load
generator (this script's threads) replays valid reports instead. For each size S (MiB)
and database:

* `fedlang serve --db DB` (an SQLite file, or a database of a throwaway PostgreSQL
  cluster), as a user starts it, with `--max-report-bytes` above S;
* a round of a plan whose report is one float32 tensor of S MiB summed over clients
  (`federated_sum` of each client's float32[S MiB] total: the aggregation FedAvg's
  update goes through, alone), opened through the admin API with `target = --uploads`;
* `--uploads` clients enrolled and checked in, then all their reports sent at once,
  each from its own thread over its own connection, made as they are sent (1 MiB at a
  time: this process holds no report), each client's tensor all `i + 1`.

Measured: the server's peak RSS over its idle (VmHWM reset when the uploads start,
sampled every 50 ms as `bench/big_models.py` does), as a multiple of S; the time from
the first byte sent to the last answer (the last answer comes once the round's close has
folded every stored report into its aggregate: the writer closes the round before it
answers the report that reached the target); the database's size after the round; the
time to move the same bytes through plain TCP sockets over loopback (`big_models`'s
plain copy, median of 3, the uploads side by side) and the ratio. The aggregate is
read back (streamed) and its SHA-256 compared with the one it must have (every element
the sum of the clients' values), so the run also checks the result.

Run: python bench/big_uploads.py [--sizes 100,1000] [--uploads 10] [--db sqlite|postgresql|both]
(results in bench/README.md, "Large models through the deployment (issue 40)")
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import hashlib
import json
import os
import pathlib
import shutil
import signal
import sys
import tempfile
import threading
import time
from typing import Any

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
import big_models as big

MIB = 1 << 20


def _plan(size: int) -> tuple[Any, bytes]:
    """(plan, broadcast) of the sum over clients of a float32 tensor of `size` MiB."""
    import numpy as np

    import fedlang as fl
    from fedlang import deploy
    from fedlang.core import context

    n = size * MIB // 4
    row = fl.TensorType(np.float32, [n])

    @fl.jax_computation(fl.SequenceType(row))
    def total(ds: Any) -> Any:
        return ds.reduce(np.zeros(n, np.float32), lambda s, x: s + x)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(row)))
    def vector_sum(data: Any) -> Any:
        return fl.federated_sum(fl.federated_map(total, data))

    class Capture:
        def run_round(self, plan: Any, broadcast: bytes) -> Any:
            self.found = (plan, broadcast)
            raise StopIteration

    runner = Capture()
    # the uploads fill the sum with i + 1, for upload i: declared as a user would
    bounds = deploy.ReportBounds(ranges={"[0]": (0.0, 1e6)})
    ctx = deploy.DeploymentContext(runner, bounds=bounds)  # type: ignore[arg-type]
    with contextlib.suppress(StopIteration), context.with_context(ctx):
        vector_sum(deploy.client_data("train"))
    return runner.found


def _report(layout: Any, value: float) -> Any:
    """The frame of a report whose every element is `value`, made 1 MiB at a time."""
    import numpy as np

    (n,) = layout.lengths
    block = np.full(MIB // 4, value, np.float32).tobytes()
    tensor = (block[:min(len(block), n - s)] for s in range(0, n, len(block)))
    for part in layout.parts([tensor]):
        yield bytes(part)


def _expected_sha(layout: Any, total: float) -> str:
    import numpy as np

    (n,) = layout.lengths
    block = np.full(MIB // 8, total, np.float64).tobytes()
    digest = hashlib.sha256()
    for part in layout.parts([(block[:min(len(block), n - s)] for s in range(0, n, len(block)))]):
        digest.update(part)
    return digest.hexdigest()


def run_one(size: int, db: str, args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    httpx = big._http()
    from fedlang.core import serialization
    from fedlang.deploy.plans import folding

    row: dict[str, Any] = {"size_mib": size, "uploads": args.uploads,
                           "db": "PostgreSQL" if db.startswith("postgresql") else "SQLite"}
    children = big.Children()
    stop_reason: list[str] = []

    def on_low(available: int) -> None:
        stop_reason.append(f"stopped by the bench: MemAvailable fell to "
                           f"{available / 2**30:.2f} GiB")
        for p in children.procs:
            if p.poll() is None:
                p.kill()

    sampler = big.Sampler(int(args.min_available * 2**30), on_low)
    sampler.start()
    try:
        extra = ["--key-file", str(work / "signing.key")] if db.startswith("postgresql") else []
        limit = f"{size + 64}M"
        log = work / "server.log"
        server = children.start(
            [*big._fedlang(), "serve", "--db", db, "--port", "0", "--population",
             big.POPULATION, "--max-report-bytes", limit, "--max-blob-bytes", limit,
             "--body-timeout", "600", *extra], log)
        url = big._wait_line(log, "fedlang task store at ", server, 120).split()[0]
        token = big._wait_line(log, f"population {big.POPULATION} token: ", server, 60)
        sampler.add("server", server.pid)

        plan, broadcast = _plan(size)
        folder = folding.Folder(plan)
        report_layout = serialization.dense_layout(folder.report_type)
        admin = {"Authorization": f"Bearer {big.ADMIN}"}
        timeout = httpx.Timeout(60.0, read=1800.0)
        with httpx.Client(base_url=url, timeout=timeout) as http:
            def blob(data: bytes) -> str:
                r = http.post("/v1/admin/blobs", content=data, headers=admin)
                r.raise_for_status()
                return str(r.json()["hash"])

            clients = []
            for _ in range(args.uploads):
                r = http.post(f"/v1/populations/{big.POPULATION}/enroll",
                              headers={"Authorization": f"Bearer {token}"})
                r.raise_for_status()
                clients.append({"Authorization": f"Bearer {r.json()['credential']}"})
            r = http.post("/v1/admin/rounds", headers=admin, json={
                "population": big.POPULATION, "plan": blob(plan.to_bytes()),
                "broadcast": blob(broadcast), "target": args.uploads, "deadline": 3600})
            r.raise_for_status()
            round_id = r.json()["id"]
            for c in clients:
                http.post("/v1/checkin", headers=c).raise_for_status()

            time.sleep(1.0)
            sampler.baseline()
            answers: list[Any] = [None] * args.uploads

            def upload(i: int) -> None:
                with httpx.Client(base_url=url, timeout=timeout) as own:
                    try:
                        answers[i] = own.put(f"/v1/rounds/{round_id}/report",
                                             content=_report(report_layout, float(i + 1)),
                                             headers={**clients[i], "Fedlang-Task":
                                                      f'{{"round":{round_id},"session":null,'
                                                      '"version":null}'}).status_code
                    except Exception as e:  # reported in the row
                        answers[i] = f"{type(e).__name__}: {e}"

            start = time.perf_counter()
            threads = [threading.Thread(target=upload, args=(i,)) for i in range(args.uploads)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            row["seconds"] = time.perf_counter() - start
            row["answers"] = answers
            state = http.get(f"/v1/admin/rounds/{round_id}", headers=admin).json()
            row["round"] = {k: state.get(k) for k in ("state", "reports", "refused")}
            row["memory"] = sampler.peaks()
            row["db_bytes"] = big.db_size(db)
            digest = hashlib.sha256()
            with http.stream("GET", f"/v1/admin/rounds/{round_id}/aggregate",
                             headers=admin) as got:
                got.raise_for_status()
                for chunk in got.iter_bytes(MIB):
                    digest.update(chunk)
            total = args.uploads * (args.uploads + 1) / 2
            row["aggregate_ok"] = digest.hexdigest() == _expected_sha(
                serialization.dense_layout(folder.aggregate_type), total)
        if stop_reason:
            row["error"] = stop_reason[0]
    except Exception as e:  # a failing size is a row with its error
        row["error"] = stop_reason[0] if stop_reason else f"{type(e).__name__}: {e}"
    finally:
        sampler.stop()
        children.stop_all()
    if "error" not in row:
        row["copy_s"] = big.measure_copy(work, 0, size * MIB, args.uploads)
        row["ratio"] = row["seconds"] / row["copy_s"]
    return row


def table(rows: list[dict[str, Any]]) -> str:
    out = ["| S MiB | db | uploads at once | answers | server peak over idle / S |"
           " idle RSS MiB | uploads + close s | plain copy s | ratio | DB MiB | aggregate |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            out.append(f"| {r['size_mib']} | {r['db']} | {r['uploads']} | {r['error']} |"
                       " | | | | | | |")
            continue
        m = r["memory"]["server"]
        answers = ", ".join(sorted({str(a) for a in r["answers"]}))
        out.append(
            f"| {r['size_mib']} | {r['db']} | {r['uploads']} | {answers} |"
            f" {(m['peak'] - m['idle']) / (r['size_mib'] * MIB):.2f} | {m['idle'] / MIB:.0f} |"
            f" {r['seconds']:.1f} | {r['copy_s']:.2f} | {r['ratio']:.1f}x |"
            f" {r['db_bytes'] / MIB:,.0f} | {'equal' if r['aggregate_ok'] else 'DIFFERS'} |")
    return "\n".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100,1000")
    parser.add_argument("--uploads", type=int, default=10)
    parser.add_argument("--db", default="sqlite", choices=["sqlite", "postgresql", "both"])
    parser.add_argument("--min-available", type=float, default=1.0)
    parser.add_argument("--json", type=pathlib.Path)
    args = parser.parse_args()
    info = {**big.machine(), "revision": big.revision(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes")}
    print(f"machine: {info['cpus']} CPUs ({info['cpu']}), {info['ram_gib']} GiB RAM, "
          f"Python {info['python']}, load {info['load'][0]:.1f}; revision {info['revision']}; "
          f"{info['date']}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    kinds = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    rows = []
    with contextlib.ExitStack() as stack:
        cluster = None
        for kind in kinds:
            for size in (int(s) for s in args.sizes.split(",")):
                work = pathlib.Path(tempfile.mkdtemp(prefix=f"fedlang-bench-uploads-{size}-"))
                stack.callback(shutil.rmtree, work, ignore_errors=True)
                if kind == "sqlite":
                    db = str(work / "store.db")
                else:
                    if cluster is None:
                        import load as load_bench  # bench/load.py: a throwaway cluster

                        cluster = stack.enter_context(load_bench.postgres_cluster())
                    db = load_bench.new_database(cluster, f"uploads_{size}_{int(time.time())}")
                row = run_one(size, db, args, work)
                rows.append(row)
                print(json.dumps(row), flush=True)
    info["load_end"] = os.getloadavg()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
