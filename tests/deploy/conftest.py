"""Fixtures of the task store tests: databases (SQLite, a throwaway PostgreSQL cluster),
servers on loopback (in this process or as a process to kill), and small round plans."""

import contextlib
import itertools
import os
import pathlib
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time

import httpx
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.deploy.plans import bounds as bounds_lib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _as_postgres_user(args):
    """PostgreSQL refuses to run as root: run its tools as `nobody` then."""
    if os.geteuid() == 0:
        return ["runuser", "-u", "nobody", "--", *args]
    return args


@pytest.fixture(scope="session")
def postgres_cluster():
    """A throwaway PostgreSQL cluster on a free loopback port: its base URL (no database)."""
    if shutil.which("initdb") is None or shutil.which("pg_ctl") is None:
        pytest.skip("PostgreSQL's initdb/pg_ctl are not on the PATH; install PostgreSQL 15 to "
                    "run the PostgreSQL task store tests.")
    psycopg = pytest.importorskip("psycopg")
    base = pathlib.Path(tempfile.mkdtemp(prefix="fedlang-pg-"))
    data = base / "data"
    if os.geteuid() == 0:
        shutil.chown(base, "nobody")
    port = _free_port()
    subprocess.run(_as_postgres_user(["initdb", "-D", str(data), "-U", "postgres", "--auth=trust",
                                      "--no-sync"]),
                   check=True, capture_output=True, timeout=120)
    started = False
    try:
        subprocess.run(
            _as_postgres_user(["pg_ctl", "-D", str(data), "-l", str(base / "log"), "-w", "-t", "60",
                               "-o", f"-k {data} -p {port} -h 127.0.0.1 -F", "start"]),
            check=True, capture_output=True, timeout=120,
        )
        started = True
        url = f"postgresql://postgres@127.0.0.1:{port}"
        with psycopg.connect(f"{url}/postgres", autocommit=True) as conn:
            conn.execute("SELECT 1")
        yield url
    finally:
        if started:
            subprocess.run(_as_postgres_user(["pg_ctl", "-D", str(data), "stop", "-m", "immediate"]),
                           capture_output=True, timeout=60)
        shutil.rmtree(base, ignore_errors=True)


_databases = itertools.count()


@pytest.fixture(params=["sqlite", "postgresql"])
def db_url(request, tmp_path):
    """A new, empty task store database: SQLite in a file, or a database of the cluster."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'store.db'}"
        return
    import psycopg

    base = request.getfixturevalue("postgres_cluster")
    name = f"store_{os.getpid()}_{next(_databases)}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {name}")
    yield f"{base}/{name}"
    with psycopg.connect(f"{base}/postgres", autocommit=True) as conn:
        conn.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")


class _Capture:
    """A round runner that keeps the first round's plan and broadcast and stops."""

    def run_round(self, plan, broadcast):
        self.plan, self.broadcast = plan, broadcast
        raise _Captured


class _Captured(Exception):
    pass


def capture(comp, *args, bounds=None):
    """The (plan, broadcast bytes) of the first round `comp(*args)` runs on clients, its
    reports bounded by `bounds` (default: what `BOUNDS` declares for `comp`, else the
    drivers' default, `plans.bounds.DEFAULT`)."""
    runner = _Capture()
    ctx = deploy.DeploymentContext(runner, bounds=bounds_of(comp, bounds))
    with contextlib.suppress(_Captured), context.with_context(ctx):
        comp(*args)
    return runner.plan, runner.broadcast


def bounds_of(comp, bounds=None):
    """`bounds`, or the bounds this file declares for its computation `comp` (`BOUNDS`),
    or the drivers' default."""
    if bounds is not None:
        return bounds
    return BOUNDS.get(comp, bounds_lib.DEFAULT)


@fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [3])))
def _total(ds):
    return ds.reduce(np.zeros(3, np.float32), lambda s, x: s + x)


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [3]))))
def vector_sum(data):
    """The sum over clients of each client's sum of float32[3] elements."""
    return fl.federated_sum(fl.federated_map(_total, data))


@pytest.fixture(scope="session")
def sum_round():
    """(plan, broadcast) of `vector_sum`: each client reports the sum of its float32[3] rows."""
    return capture(vector_sum, deploy.client_data("train"))  # (its `BOUNDS`)


@pytest.fixture
def server_factory(tmp_path):
    """Starts in-process servers on 127.0.0.1 (stopped at the end of the test)."""
    servers = []

    def make(db=None, **kwargs):
        kwargs.setdefault("key", tmp_path / "signing.key")  # PostgreSQL needs one
        kwargs.setdefault("pace", deploy.Pace(min_retry=0.05, max_retry=0.2))
        kwargs.setdefault("tick", 0.05)
        server = deploy.Server(db=db or tmp_path / "server.db", port=0, **kwargs)
        servers.append(server)
        return server.start()

    yield make
    for s in servers:
        s.stop()


def wait_for(predicate, what, timeout=120.0):
    """`predicate()`'s first true value, polled every 50 ms; fails after `timeout` s."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        value = predicate()
        if value:
            return value
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def run_driver(url, admin_token, result, computation, **options):
    """`computation(client_data("train"))` in a deployment context of population "pop" at
    `url`: its value in `result["value"]`, the rounds in `result["rounds"]`, or the error
    in `result["error"]`."""
    options.setdefault("bounds", bounds_of(computation))
    ctx = deploy.deployment_context(url, admin_token, "pop", patience=120, backoff=(0.05, 0.5),
                                    **options)
    try:
        with context.with_context(ctx):
            result["value"] = computation(deploy.client_data("train"))
        result["rounds"] = ctx.rounds
    except Exception as e:
        result["error"] = e
    finally:
        ctx.runner.close()


class ServerProcess:
    """`fedlang serve` as a process (to kill -9 and restart on the same database)."""

    def __init__(self, db, tmp_path, admin_token="admin-token", min_retry=0.05, extra_args=()):
        self.db, self.port, self.admin_token = str(db), _free_port(), admin_token
        self.min_retry, self.extra_args = min_retry, list(extra_args)
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        self.key_file = tmp_path / "signing.key"
        self.proc = None

    def start(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLANG_ADMIN_TOKEN": self.admin_token}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fedlang", "serve", "--db", self.db, "--port", str(self.port),
                 "--min-retry", str(self.min_retry), "--key-file", str(self.key_file),
                 *self.extra_args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/v1/status", timeout=2).status_code == 200:
                    return self
            time.sleep(0.1)
        raise AssertionError(f"the server did not start:\n{self.log.read_text()}")

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture
def server_process(tmp_path):
    """Makes `fedlang serve` processes; each is killed at the end of the test."""
    made = []

    def make(db, **options):
        p = ServerProcess(db, tmp_path, **options)
        made.append(p)
        return p

    yield make
    for p in made:
        p.kill()


POINT = fl.to_type({"a": np.float32, "n": np.int32})


@fl.jax_computation(fl.SequenceType(POINT))
def _ints(ds):
    return ds.reduce(
        {"q": np.int32(0), "r": np.zeros(3, np.int32)},
        lambda st, p: {"q": st["q"] + p["n"], "r": st["r"] + p["n"] * jnp.arange(3, dtype=np.int32)},
    )


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(POINT)))
def secure_and_plain(data):
    """Per client q = sum of n and r = sum of n * [0, 1, 2], summed three ways: by
    SecAgg+ with 6 bits, modulo 7, and in the clear (the secure rounds' tests compare them)."""
    ints = fl.federated_map(_ints, data)
    return {
        "bits": fl.federated_secure_sum_bitwidth(ints, 6),
        "mod": fl.federated_secure_modular_sum(ints, 7),
        "plain": fl.federated_sum(ints),
    }


BATCH = fl.to_type({"x": fl.TensorType(np.float32, [None, 3])})


@fl.jax_computation(fl.SequenceType(BATCH))
def _batch_total(ds):
    return ds.reduce(np.zeros(3, np.float32), lambda s, b: s + b["x"].sum(axis=0))


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(BATCH)))
def batch_sum(data):
    """The sum over clients of their rows of x (batches of float32[?,3], as from .npz files)."""
    return fl.federated_sum(fl.federated_map(_batch_total, data))


# The bounds of these computations' reports, declared as a user declares those of a leaf
# of their own (no bound is derivable for a sum of the user's floats or ints):
BOUNDS = {
    # `vector_sum`'s one leaf: the intake's tests send up to 3e38 (its overflow check) and
    # NaN (its finiteness check) through it; their point is elsewhere, so any finite value
    vector_sum: deploy.ReportBounds(unbounded=("[0]",)),
    # the tests' rows of x are small (|x| < 1e3, a few hundred rows a client at most)
    batch_sum: deploy.ReportBounds(ranges={"[0]": (-1e6, 1e6)}),
    # the plain sum of the points' q = sum(n) and r = sum(n * [0, 1, 2]): the tests' clients
    # hold a few points with |n| < 100
    secure_and_plain: deploy.ReportBounds(ranges={"[2].q": (-10**4, 10**4),
                                                  "[2].r": (-10**4, 10**4)}),
}


class Gated:
    """A dataset whose batches are given only once `release` is set (a slow client)."""

    def __init__(self, rows):
        import threading

        self.rows = np.asarray(rows, np.float32)
        self.release = threading.Event()

    def __iter__(self):
        assert self.release.wait(120), "the test never released this client"
        yield {"x": self.rows}


@pytest.fixture
def client_threads():
    """Runs `deploy.Client`s on threads; stops and joins them at the end of the test."""
    import threading

    running = []

    def start(client):
        errors = []

        def run():
            try:
                client.run()
            except Exception as e:  # shown by the test that checks `errors`
                errors.append(e)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        running.append((client, t))
        return errors

    yield start
    for client, _ in running:
        client.stop()
    for client, t in running:
        t.join(timeout=60)
        client.close()


class Gate:
    """A reverse proxy in front of a server on 127.0.0.1, for fault injection in secure
    rounds. It forwards every request, except a secure round's stage messages (`PUT
    /v1/rounds/N/secagg/STAGE`) when told otherwise: `hold(stage)` keeps them until
    `release(stage, n)` lets `n` through; `drop(stage)` never forwards them (the client
    vanishes before its message reaches the server; kill it while it waits). `waiting`
    counts the messages held or dropped so far, by stage. An unreachable server gives
    502, which clients retry."""

    _STAGE = re.compile(r"/v1/rounds/\d+/secagg/(\d)")

    def __init__(self, upstream):
        import collections

        import uvicorn
        from starlette import applications, routing

        self.upstream = upstream
        self.rules = {}  # stage -> "drop", or how many of its messages may pass
        self.waiting = collections.Counter()
        self._passed = collections.Counter()
        self._lock = threading.Lock()
        self._closing = False
        app = applications.Starlette(routes=[routing.Route(
            "/{path:path}", self._forward, methods=["GET", "POST", "PUT", "DELETE"])])
        self._sock = socket.socket()
        self._sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._sock.getsockname()[1]}"
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False,
                                                     lifespan="off"))
        self._thread = threading.Thread(target=self._server.run,
                                        kwargs={"sockets": [self._sock]}, daemon=True)
        self._thread.start()
        end = time.monotonic() + 30
        while not self._server.started:
            assert time.monotonic() < end, "the gate did not start"
            time.sleep(0.01)

    def hold(self, stage):
        with self._lock:
            self.rules[stage] = 0

    def release(self, stage, n=10**9):
        with self._lock:
            self.rules[stage] += n

    def drop(self, stage):
        with self._lock:
            self.rules[stage] = "drop"

    async def _wait(self, stage):
        """Whether the message may go on (False: dropped)."""
        import asyncio

        with self._lock:
            self.waiting[stage] += 1
        while not self._closing:
            with self._lock:
                rule = self.rules[stage]
                if rule != "drop" and self._passed[stage] < rule:
                    self._passed[stage] += 1
                    return True
            await asyncio.sleep(0.02)
        return False

    async def _forward(self, request):
        from starlette import responses

        body = await request.body()
        match = self._STAGE.fullmatch(request.url.path)
        held = request.method == "PUT" and match and int(match[1]) in self.rules
        if held and not await self._wait(int(match[1])):
            return responses.Response(status_code=503)
        headers = {k: v for k, v in request.headers.items()
                   if k.lower() in ("authorization", "content-type", "if-none-match",
                                    "fedlang-task")}
        try:
            async with httpx.AsyncClient(base_url=self.upstream, timeout=120) as h:
                r = await h.request(request.method, request.url.path, params=request.query_params,
                                    content=body, headers=headers)
        except httpx.TransportError:
            return responses.Response(status_code=502)
        kept = {k: v for k, v in r.headers.items()
                if k.lower() in ("content-type", "etag", "cache-control")}
        return responses.Response(r.content, status_code=r.status_code, headers=kept)

    def stop(self):
        self._closing = True
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._sock.close()


@pytest.fixture
def gates():
    """Makes `Gate`s in front of servers; stops them at the end of the test."""
    made = []

    def make(upstream):
        made.append(Gate(upstream))
        return made[-1]

    yield make
    for g in made:
        g.stop()
