"""Models of S MiB through the deployment, as an operator feels it (issue 40).

For each model size S (MiB) and database, the script runs what docs/deploy.md's
walkthrough runs, each part its own process started the way a user starts it:

* `fedlang serve --db DB` (an SQLite file, or a database of a throwaway PostgreSQL
  cluster with `--key-file`), with `--max-blob-bytes` and `--max-report-bytes` scaled
  to S, `--log-format json --log-level info` (a line per request, with its body size);
* `--clients` `fedlang client` processes, enrolled with the population's token, each
  with a small `.npz` file (`--rows` rows) as its `train` data;
* a driver process (this file, `driver` mode) that builds FedAvg
  (`fedlang.learning.algorithms.build_weighted_fed_avg`) of a Flax model with one Dense
  layer whose float32 kernel is S MiB (`d_in = 256 * S` inputs, 1,024 units), and runs
  `--rounds` rounds of `process.next(state, deploy.client_data("train"))` inside
  `deploy.deployment_context(url, admin_token, population, target=clients)`.

Measured per S and database:

* **round time**: each `process.next` in the driver, and their median. The first round
  also includes the clients' loading (and compiling) of the plan.
* **peak RSS over idle, as a multiple of S**, for the server, each client and the driver:
  a thread of this script reads `/proc/PID/status` (VmRSS, VmHWM) of every process every
  50 ms. The idle baseline is each process's VmRSS once the clients enrolled and checked
  in and the driver has built its initial state (so the driver's idle includes one copy
  of the model), just before the first round; VmHWM is reset then (`clear_refs` 5), and
  the peak is the larger of the last VmHWM read and the largest VmRSS sampled. The pids
  sampled are the Python processes themselves (`/proc/PID/cmdline` is checked).
* **bytes on the wire per client per round**: uploads from the server's own count of
  each request body (its per-request log line, the same count as the `/metrics`
  histogram `fedlang_request_body_bytes`) of the report PUTs; downloads from the
  server's log of blob GETs answered 200 times the size of each blob fetched (read
  afterwards from the server with the admin token: the server counts no response
  bytes). HTTP headers are not counted.
* **database size** after the rounds, with the server still up: SQLite file + WAL;
  PostgreSQL `pg_database_size`.
* **plain copy**: the same bytes a round moved (each client's download, then each
  client's upload, the clients side by side) through plain TCP sockets over loopback
  between this process's threads and a server process that sends from and receives
  into preallocated buffers, run in the same minutes (median of 3); and the ratio
  round time / plain copy.

Every child process dies with this script (PR_SET_PDEATHSIG) and each part has its own
timeout; temporary directories and the PostgreSQL cluster are removed in `finally`. A
size that fails (an HTTP error, a round that fails, memory running out: the script
stops the run when MemAvailable falls under `--min-available` GiB) is a row with the
error instead of numbers.

Run: python bench/big_models.py [--sizes 10,100] [--db sqlite|postgresql|both]
       [--rounds 2] [--clients 3] [--rows 4] [--json PATH] [--keep]
(results in bench/README.md, "Large models through the deployment (issue 40)")
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import datetime
import json
import os
import pathlib
import platform
import queue
import select
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]
SRC = ROOT / "src"
ADMIN = "bench"
POPULATION = "big"
UNITS = 1024  # the Dense layer's units; its kernel is [256 * S, 1024] float32 = S MiB
MIB = 1 << 20
SAMPLE_S = 0.05


# -- processes


def _die_with_parent() -> None:
    """In the child before exec: SIGKILL when this script's process ends (Linux)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def _env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "FEDLANG_ADMIN_TOKEN": ADMIN,
            "PYTHONUNBUFFERED": "1"}


def _fedlang() -> list[str]:
    """The `fedlang` command as a user runs it (the venv's console script: its process
    is the Python interpreter itself, no shell in between)."""
    script = pathlib.Path(sys.executable).parent / "fedlang"
    return [str(script)] if script.exists() else [sys.executable, "-m", "fedlang"]


class Children:
    """The child processes of one run; `stop_all` ends each, by its id."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[Any]] = []

    def start(self, args: list[str], log: pathlib.Path, **kwargs: Any) -> subprocess.Popen[Any]:
        with open(log, "wb") as out:
            kwargs.setdefault("stdout", out)
            proc = subprocess.Popen(args, stderr=out, env=_env(), preexec_fn=_die_with_parent,
                                    **kwargs)
        self.procs.append(proc)
        return proc

    def stop_all(self, grace: float = 10.0) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        end = time.monotonic() + grace
        for p in self.procs:
            try:
                p.wait(timeout=max(0.1, end - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=30)


def _is_python(pid: int) -> bool:
    """Whether `pid` runs Python itself (not a shell or a wrapper in front of it)."""
    try:
        return "python" in pathlib.Path(os.readlink(f"/proc/{pid}/exe")).name
    except OSError:
        return False


# -- memory


def _status(pid: int) -> dict[str, int]:
    """VmRSS and VmHWM of `pid` in bytes ({} once it is gone)."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmRSS:", "VmHWM:")):
                    out[line[:5]] = int(line.split()[1]) * 1024
    except OSError:
        return {}
    return out


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


class Sampler(threading.Thread):
    """Reads VmRSS/VmHWM of the registered processes every 50 ms; calls `on_low` once if
    MemAvailable falls under `min_available` bytes."""

    def __init__(self, min_available: int, on_low: Callable[[int], None]):
        super().__init__(daemon=True)
        self.min_available, self.on_low = min_available, on_low
        self.pids: dict[str, int] = {}
        self.idle: dict[str, int] = {}  # name -> VmRSS at the baseline
        self.max_rss: dict[str, int] = {}  # since the baseline
        self.hwm: dict[str, int] = {}  # the last VmHWM read (reset at the baseline)
        self.reset_ok = True
        self.low: int | None = None
        self.lowest_available = mem_available()
        self._lock = threading.Lock()
        self._halt = threading.Event()

    def add(self, name: str, pid: int) -> None:
        if not _is_python(pid):
            raise RuntimeError(f"Expected {name} (pid {pid}) to be a Python process, found "
                               f"{pathlib.Path(f'/proc/{pid}/cmdline').read_bytes()!r}.")
        with self._lock:
            self.pids[name] = pid

    def baseline(self) -> None:
        """Each process's VmRSS now is its idle; its peak counts from now."""
        with self._lock:
            for name, pid in self.pids.items():
                self.idle[name] = _status(pid).get("VmRSS", 0)
                self.max_rss[name] = self.idle[name]
                try:
                    pathlib.Path(f"/proc/{pid}/clear_refs").write_text("5")
                except OSError:
                    self.reset_ok = False
                self.hwm[name] = _status(pid).get("VmHWM", 0)

    def run(self) -> None:
        while not self._halt.wait(SAMPLE_S):
            self.sample()
            available = mem_available()
            self.lowest_available = min(self.lowest_available, available)
            if available < self.min_available and self.low is None:
                self.low = available
                self.on_low(available)

    def sample(self) -> None:
        with self._lock:
            for name, pid in self.pids.items():
                if name not in self.idle:
                    continue
                s = _status(pid)
                if s:
                    self.max_rss[name] = max(self.max_rss[name], s["VmRSS"])
                    if self.reset_ok:
                        self.hwm[name] = s["VmHWM"]

    def peaks(self) -> dict[str, dict[str, int]]:
        """{name: {idle, peak}} in bytes."""
        self.sample()
        with self._lock:
            return {n: {"idle": self.idle[n],
                        "peak": max(self.max_rss[n], self.hwm[n] if self.reset_ok else 0)}
                    for n in self.idle}

    def stop(self) -> None:
        self._halt.set()


# -- the driver (its own process: what a user's driver script does)


def model_shape(size_mib: int) -> tuple[int, int]:
    """(inputs, units) of the Dense layer whose float32 kernel is `size_mib` MiB."""
    return 256 * size_mib, UNITS


def driver(cfg: dict[str, Any]) -> None:
    """Builds FedAvg of the wide Dense model and runs the rounds; talks to the bench on
    stdin/stdout (one JSON object a line): says `ready` once the initial state is built,
    waits for `go`, prints each round's seconds, then `done`, and waits for `finish`
    before telling the clients there is no more work."""
    import flax.linen as nn
    import numpy as np
    import optax

    from fedlang import deploy
    from fedlang.learning import algorithms, models

    def say(doc: dict[str, Any]) -> None:
        print(json.dumps(doc), flush=True)

    def wait_for(word: str, timeout: float) -> None:
        ready, _, _ = select.select([sys.stdin], [], [], timeout)
        line = sys.stdin.readline().strip() if ready else ""
        if line != word:
            raise SystemExit(f"driver: expected {word!r} on stdin within {timeout:.0f} s, "
                             f"found {line!r}")

    d_in, units = model_shape(cfg["size"])

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x: Any) -> Any:
            return nn.Dense(units)(x)

    def xent(logits: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

    def model_fn() -> Any:
        return models.from_flax(Wide(), xent, {"x": (np.float32, [None, d_in]),
                                               "y": (np.int32, [None])})

    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.01))
    state = process.initialize()
    say({"ready": True})
    wait_for("go", cfg["timeout"])
    with deploy.deployment_context(cfg["url"], cfg["admin"], cfg["population"],
                                   target=cfg["clients"], deadline=cfg["deadline"]) as ctx:
        try:
            for r in range(cfg["rounds"]):
                start = time.perf_counter()
                state, _ = process.next(state, deploy.client_data("train"))
                say({"round": r, "seconds": time.perf_counter() - start})
            say({"done": True})
            wait_for("finish", cfg["timeout"])
        except Exception as e:
            say({"error": f"{type(e).__name__}: {e}"})
            raise
        finally:
            with contextlib.suppress(Exception):
                ctx.runner.finish()  # the clients stop at their next check-in


class Lines(threading.Thread):
    """A child's stdout, one JSON object a line, into a queue."""

    def __init__(self, stream: Any):
        super().__init__(daemon=True)
        self.stream, self.queue = stream, queue.Queue()  # type: ignore[var-annotated]

    def run(self) -> None:
        for line in self.stream:
            with contextlib.suppress(ValueError):
                self.queue.put(json.loads(line))
        self.queue.put(None)


# -- the plain copy over loopback


def copy_server(port_file: str) -> None:
    """Sends from and receives into preallocated buffers: per connection, requests of
    one byte ('D' download, 'U' upload) and an 8-byte length; an upload is acknowledged
    with one byte."""
    import socketserver

    chunk = bytes(4 * MIB)

    class Handler(socketserver.BaseRequestHandler):
        def handle(self) -> None:
            sock = self.request
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sink = bytearray(4 * MIB)
            view = memoryview(sink)
            while True:
                head = _recv_exact(sock, 9)
                if head is None:
                    return
                n = int.from_bytes(head[1:], "little")
                if head[:1] == b"D":
                    while n:
                        k = min(n, len(chunk))
                        sock.sendall(memoryview(chunk)[:k])
                        n -= k
                else:
                    while n:
                        k = sock.recv_into(view, min(n, len(sink)))
                        if not k:
                            return
                        n -= k
                    sock.sendall(b"k")

    socketserver.ThreadingTCPServer.daemon_threads = True
    with socketserver.ThreadingTCPServer(("127.0.0.1", 0), Handler) as server:
        pathlib.Path(port_file).write_text(str(server.server_address[1]))
        server.timeout = 600
        server.serve_forever()


def _recv_exact(sock: socket.socket, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        part = sock.recv(n - len(buf))
        if not part:
            return None
        buf += part
    return buf


def plain_copy(port: int, download: int, upload: int, clients: int) -> float:
    """Seconds for `clients` side-by-side downloads of `download` bytes, then as many
    uploads of `upload` bytes, over loopback TCP (connections made before the clock)."""
    socks = [socket.create_connection(("127.0.0.1", port)) for _ in range(clients)]
    for s in socks:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    out = bytes(4 * MIB)

    def down(s: socket.socket) -> None:
        s.sendall(b"D" + download.to_bytes(8, "little"))
        sink, n = bytearray(4 * MIB), download
        view = memoryview(sink)
        while n:
            k = s.recv_into(view, min(n, len(sink)))
            if not k:
                raise RuntimeError("the copy server closed the connection")
            n -= k

    def up(s: socket.socket) -> None:
        s.sendall(b"U" + upload.to_bytes(8, "little"))
        n = upload
        while n:
            k = min(n, len(out))
            s.sendall(memoryview(out)[:k])
            n -= k
        if _recv_exact(s, 1) != b"k":
            raise RuntimeError("the copy server did not acknowledge an upload")

    def side_by_side(fn: Callable[[socket.socket], None]) -> None:
        errors: list[BaseException] = []

        def run(s: socket.socket) -> None:
            try:
                fn(s)
            except BaseException as e:  # reported below, in the caller's thread
                errors.append(e)

        threads = [threading.Thread(target=run, args=(s,)) for s in socks]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=600)
        if errors:
            raise errors[0]

    try:
        start = time.perf_counter()
        side_by_side(down)
        side_by_side(up)
        return time.perf_counter() - start
    finally:
        for s in socks:
            s.close()


def measure_copy(work: pathlib.Path, download: int, upload: int, clients: int,
                 repeats: int = 3) -> float:
    """The median of `repeats` plain copies (a fresh copy-server process)."""
    children = Children()
    port_file = work / "copy.port"
    try:
        children.start([sys.executable, __file__, "copy-server", str(port_file)],
                       work / "copy.log")
        end = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text():
            if time.monotonic() > end:
                raise RuntimeError("the copy server did not start")
            time.sleep(0.05)
        port = int(port_file.read_text())
        return statistics.median(plain_copy(port, download, upload, clients)
                                 for _ in range(repeats))
    finally:
        children.stop_all(grace=5)


# -- one run


def _http() -> Any:
    import httpx

    return httpx


def _wait_line(path: pathlib.Path, prefix: str, proc: subprocess.Popen[Any],
               timeout: float) -> str:
    """The rest of the first line of `path` starting with `prefix` (a child's output)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for line in path.read_text(errors="replace").splitlines():
            if line.startswith(prefix):
                return line[len(prefix):].strip()
        if proc.poll() is not None:
            raise RuntimeError(f"{path.stem} exited ({proc.returncode}): {_tail(path)}")
        time.sleep(0.1)
    raise RuntimeError(f"no line {prefix!r} in {path.name} within {timeout:.0f} s: {_tail(path)}")


def _tail(path: pathlib.Path, lines: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").strip().splitlines()[-lines:])
    return ""


def _server_log(path: pathlib.Path) -> list[dict[str, Any]]:
    out = []
    for line in path.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            doc = json.loads(line)
            if isinstance(doc, dict):
                out.append(doc)
    return out


def _server_errors(path: pathlib.Path) -> list[str]:
    """The server's warnings and errors, and every request answered 4xx/5xx."""
    out = []
    for doc in _server_log(path):
        status = doc.get("status") or 0
        if doc.get("level") in ("error", "critical") or status >= 400:
            exc = (doc.get("exc_info") or doc.get("exception") or "").strip().splitlines()
            out.append(doc.get("message", "") + (f" ({exc[-1]})" if exc else ""))
    return out


def _blob_size(url: str, h: str) -> int:
    """The size of blob `h`, read from the server with the admin token (streamed)."""
    httpx = _http()
    with httpx.stream("GET", f"{url}/v1/blobs/{h}", timeout=600,
                      headers={"Authorization": f"Bearer {ADMIN}"}) as r:
        r.raise_for_status()
        if r.headers.get("content-length", "").isdigit():
            return int(r.headers["content-length"])
        return sum(len(c) for c in r.iter_raw())


def wire_bytes(url: str, log: pathlib.Path) -> dict[str, Any]:
    """Bytes uploaded (report PUTs, the server's count of each body) and downloaded
    (blob GETs answered 200, times each blob's size) in all; the report PUTs by
    status, and the longest."""
    up: list[int] = []
    gets: list[str] = []
    statuses: dict[int, int] = {}
    longest = 0.0
    for doc in _server_log(log):
        path, status = doc.get("path", ""), int(doc.get("status") or 0)
        if doc.get("method") == "PUT" and path.endswith("/report"):
            statuses[status] = statuses.get(status, 0) + 1
            longest = max(longest, float(doc.get("duration", 0)))
            if status == 200:  # a retried upload (a replay) is answered 200 too
                up.append(int(doc.get("bytes", 0)))
        elif doc.get("method") == "GET" and path.startswith("/v1/blobs/") and status == 200:
            gets.append(path.rsplit("/", 1)[1])
    sizes = {h: _blob_size(url, h) for h in set(gets)}
    return {"upload": sum(up), "uploads": len(up), "report_puts": statuses,
            "longest_put_s": longest, "download": sum(sizes[h] for h in gets),
            "blob_gets": len(gets), "blob_sizes": sorted(sizes.values())}


def db_size(db: str) -> int:
    if db.startswith("postgresql"):
        import psycopg

        base, name = db.rsplit("/", 1)
        with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
            row = conn.execute("SELECT pg_database_size(%s)", (name,)).fetchone()
            return int(row[0]) if row else 0
    return sum(p.stat().st_size for p in (pathlib.Path(db), pathlib.Path(db + "-wal"))
               if p.exists())


def _status_json(url: str) -> dict[str, Any]:
    httpx = _http()
    r = httpx.get(f"{url}/v1/status", headers={"Authorization": f"Bearer {ADMIN}"}, timeout=30)
    r.raise_for_status()
    return r.json()


def run_one(size: int, db: str, args: argparse.Namespace, work: pathlib.Path) -> dict[str, Any]:
    """One deployment run of a model of `size` MiB on database `db` (a path or URL)."""
    import numpy as np

    row: dict[str, Any] = {"size_mib": size,
                           "db": "PostgreSQL" if db.startswith("postgresql") else "SQLite"}
    timeout = args.timeout or 300 + 3 * size * args.rounds
    limit = f"{max(1024, 3 * size + 64)}M"  # a float64 report is about twice the model
    children = Children()
    stop_reason: list[str] = []

    def on_low(available: int) -> None:
        stop_reason.append(f"stopped by the bench: MemAvailable fell to "
                           f"{available / 2**30:.2f} GiB (under --min-available)")
        for p in children.procs:
            if p.poll() is None:
                p.kill()

    sampler = Sampler(int(args.min_available * 2**30), on_low)
    sampler.start()
    try:
        # the server
        extra = ["--key-file", str(work / "signing.key")] if db.startswith("postgresql") else []
        server_log = work / "server.log"
        server = children.start(
            [*_fedlang(), "serve", "--db", db, "--port", "0", "--population", POPULATION,
             "--min-retry", "0.1", "--max-blob-bytes", limit, "--max-report-bytes", limit,
             "--log-format", "json", "--log-level", "info", *extra],
            server_log)
        url = _wait_line(server_log, "fedlang task store at ", server, 120).split()[0]
        token = _wait_line(server_log, f"population {POPULATION} token: ", server, 60)
        sampler.add("server", server.pid)

        # the clients, each with its .npz file
        d_in, units = model_shape(size)
        rng = np.random.default_rng(0)
        for i in range(args.clients):
            np.savez(work / f"client{i}.npz",
                     x=rng.normal(size=(args.rows, d_in)).astype(np.float32),
                     y=rng.integers(0, units, args.rows).astype(np.int32))
            proc = children.start(
                [*_fedlang(), "client", "--server", url, "--population", POPULATION,
                 "--token", token, "--data", f"train={work / f'client{i}.npz'}",
                 "--batch-size", str(args.rows), "--patience", "120"],
                work / f"client{i}.log")
            sampler.add(f"client{i}", proc.pid)

        # the driver, up to its initial state
        cfg = {"url": url, "admin": ADMIN, "population": POPULATION, "size": size,
               "clients": args.clients, "rounds": args.rounds, "deadline": timeout,
               "timeout": timeout}
        drv = children.start([sys.executable, __file__, "driver", json.dumps(cfg)],
                             work / "driver.log", stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
        lines = Lines(drv.stdout)
        lines.start()
        sampler.add("driver", drv.pid)

        def next_line(what: str, until: float) -> dict[str, Any]:
            while True:
                if stop_reason:
                    raise RuntimeError(stop_reason[0])
                for i, p in enumerate(children.procs[:1 + args.clients]):
                    if p.poll() is not None:  # the round would wait for its deadline
                        name = f"client{i - 1}" if i else "server"
                        raise RuntimeError(f"{name} exited ({p.returncode}) before {what}: "
                                           f"{_tail(work / f'{name}.log', 1)}")
                try:
                    doc = lines.queue.get(timeout=min(1.0, max(0.01, until - time.monotonic())))
                except queue.Empty:
                    if time.monotonic() > until:
                        raise RuntimeError(f"no {what} from the driver within the timeout "
                                           f"({timeout:.0f} s)") from None
                    continue
                if doc is None:
                    drv.wait(timeout=30)
                    raise RuntimeError(f"the driver exited ({drv.returncode}) before {what}: "
                                       f"{_tail(work / 'driver.log', 3)}")
                if "error" in doc:
                    raise RuntimeError(doc["error"])
                return doc

        deadline = time.monotonic() + timeout
        next_line("its initial state", deadline)
        while True:  # every client enrolled and checked in once: all are idle
            s = _status_json(url)
            if s["enrollments"] >= args.clients and s["checkins"] >= args.clients:
                break
            for i, p in enumerate(children.procs[1:1 + args.clients]):
                if p.poll() is not None:
                    raise RuntimeError(f"client{i} exited ({p.returncode}): "
                                       f"{_tail(work / f'client{i}.log', 3)}")
            if time.monotonic() > deadline:
                raise RuntimeError("the clients did not enroll and check in")
            time.sleep(0.2)
        time.sleep(1.0)

        # the rounds
        sampler.baseline()
        assert drv.stdin is not None
        drv.stdin.write("go\n")
        drv.stdin.flush()
        seconds = [next_line(f"round {r + 1}", deadline)["seconds"] for r in range(args.rounds)]
        next_line("the end of the rounds", deadline)
        peaks = sampler.peaks()
        row["rounds_s"] = seconds
        row["round_s"] = statistics.median(seconds)
        row["memory"] = peaks
        row["hwm_reset"] = sampler.reset_ok
        row["db_bytes"] = db_size(db)
        s = _status_json(url)
        row["rounds_closed"], row["reports"] = s["rounds_closed"], s["reports"]["accepted"]
        wire = wire_bytes(url, server_log)
        row["wire"] = wire
        per = args.clients * args.rounds
        row["down_per_client_round"] = wire["download"] / per
        row["up_per_client_round"] = wire["upload"] / per

        drv.stdin.write("finish\n")
        drv.stdin.flush()
        drv.wait(timeout=120)
        for p in children.procs[1:1 + args.clients]:
            p.wait(timeout=120)  # told by the driver: the population is finished
        if db.endswith(".db"):
            server.terminate()
            server.wait(timeout=60)
            row["db_bytes_after_stop"] = db_size(db)
    except Exception as e:
        reason = stop_reason[0] if stop_reason else f"{type(e).__name__}: {e}"
        row["error"] = reason
        row["server_errors"] = _server_errors(work / "server.log")[:5]
        row["client_logs"] = [_tail(work / f"client{i}.log", 2) for i in range(args.clients)]
        row["driver_log"] = _tail(work / "driver.log", 4)
        with contextlib.suppress(Exception):
            row["memory"] = sampler.peaks()
    finally:
        sampler.stop()
        children.stop_all()
    row["lowest_available"] = sampler.lowest_available
    if "error" not in row:
        row["copy_s"] = measure_copy(work, int(row["down_per_client_round"]),
                                     int(row["up_per_client_round"]), args.clients)
        row["ratio"] = row["round_s"] / row["copy_s"]
    return row


# -- the table


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    total = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                total = int(line.split()[1]) * 1024
    return {"cpus": os.cpu_count(), "cpu": model, "ram_gib": round(total / 2**30, 1),
            "python": platform.python_version(), "load": os.getloadavg()}


def revision() -> str:
    """The checkout's commit, read from .git (no git command), or FEDLANG_REV."""
    if os.environ.get("FEDLANG_REV"):
        return os.environ["FEDLANG_REV"]
    git = ROOT / ".git"
    with contextlib.suppress(OSError):
        if git.is_file():  # a worktree: "gitdir: PATH"
            git = pathlib.Path(git.read_text().split(":", 1)[1].strip())
        head = (git / "HEAD").read_text().strip()
        if not head.startswith("ref:"):
            return head[:7]
        ref = head.split(":", 1)[1].strip()
        common = pathlib.Path((git / "commondir").read_text().strip()) if (
            git / "commondir").exists() else git
        common = common if common.is_absolute() else git / common
        for base in (git, common):
            if (base / ref).exists():
                return (base / ref).read_text().strip()[:7]
        for line in (common / "packed-refs").read_text().splitlines():
            if line.endswith(" " + ref):
                return line[:7]
    return "unknown"


def _x(row: dict[str, Any], name: str) -> str:
    m = row.get("memory", {}).get(name)
    if not m:
        return "-"
    return f"{(m['peak'] - m['idle']) / (row['size_mib'] * MIB):.1f}"


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| S MiB | db | round s (each) | round s (median) | peak RSS over idle / S: server "
             "| clients (each) | driver | idle RSS MiB: server / client / driver "
             "| down MiB / client / round | up MiB / client / round | DB MiB | plain copy s "
             "| round / copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        clients = [k for k in r.get("memory", {}) if k.startswith("client")]
        idle = r.get("memory", {})
        idles = " / ".join(f"{idle[k]['idle'] / MIB:.0f}" if k in idle else "-"
                           for k in ("server", "client0", "driver"))
        if "error" in r:
            lines.append(
                f"| {r['size_mib']} | {r['db']} | **failed**: {r['error']} | | {_x(r, 'server')} "
                f"| {', '.join(_x(r, c) for c in clients) or '-'} | {_x(r, 'driver')} "
                f"| {idles} | | | | | |")
            continue
        lines.append(
            f"| {r['size_mib']} | {r['db']} | {', '.join(f'{s:.2f}' for s in r['rounds_s'])} "
            f"| {r['round_s']:.2f} | {_x(r, 'server')} | {', '.join(_x(r, c) for c in clients)} "
            f"| {_x(r, 'driver')} | {idles} | {r['down_per_client_round'] / MIB:.1f} "
            f"| {r['up_per_client_round'] / MIB:.1f} | {r['db_bytes'] / MIB:.1f} "
            f"| {r['copy_s']:.3f} | {r['ratio']:.1f}x |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="10,100", help="Model sizes in MiB, e.g. 10,100,1000.")
    parser.add_argument("--db", default="sqlite", choices=["sqlite", "postgresql", "both"])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--clients", type=int, default=3)
    parser.add_argument("--rows", type=int, default=4, help="Rows of each client's .npz file.")
    parser.add_argument("--timeout", type=float, default=0,
                        help="Seconds one size may take (0: 300 + 3 s per MiB per round).")
    parser.add_argument("--min-available", type=float, default=1.0,
                        help="Stop a run when MemAvailable falls under this many GiB.")
    parser.add_argument("--json", type=pathlib.Path, help="Also write the rows here.")
    parser.add_argument("--keep", action="store_true", help="Keep the work directories.")
    args = parser.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    kinds = ["sqlite", "postgresql"] if args.db == "both" else [args.db]
    info = {**machine(), "revision": revision(),
            "date": datetime.datetime.now().astimezone().isoformat(timespec="minutes")}
    print(f"machine: {info['cpus']} CPUs ({info['cpu']}), {info['ram_gib']} GiB RAM, "
          f"Python {info['python']}, load {info['load'][0]:.1f}; revision {info['revision']}; "
          f"{info['date']}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally blocks
    rows = []
    with contextlib.ExitStack() as stack:
        cluster = None
        for kind in kinds:
            for size in sizes:
                work = pathlib.Path(tempfile.mkdtemp(prefix=f"fedlang-bench-big-{size}-"))
                if not args.keep:
                    stack.callback(shutil.rmtree, work, ignore_errors=True)
                if kind == "sqlite":
                    db = str(work / "store.db")
                else:
                    if cluster is None:
                        sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
                        import load as load_bench  # bench/load.py: a throwaway cluster

                        cluster = stack.enter_context(load_bench.postgres_cluster())
                        new_database = load_bench.new_database
                    db = new_database(cluster, f"big_{size}_{int(time.time())}")
                row = run_one(size, db, args, work)
                rows.append(row)
                print(json.dumps(row), flush=True)
                if args.keep:
                    print(f"kept {work}", flush=True)
    info["load_end"] = os.getloadavg()
    print(table(rows))
    if args.json:
        args.json.write_text(json.dumps({"machine": info, "rows": rows}, indent=1))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "driver":
        driver(json.loads(sys.argv[2]))
    elif len(sys.argv) > 1 and sys.argv[1] == "copy-server":
        copy_server(sys.argv[2])
    else:
        main()
