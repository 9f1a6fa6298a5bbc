"""`fedlang serve --workers N`: one listening socket served by N worker processes, on
one PostgreSQL database.

The parent process binds the socket once (its `serve.Server`, which also sets the admin
token and makes the signing key of a new database, so that the workers find them), then
starts N workers, each a fresh interpreter (multiprocessing's `spawn`, as uvicorn's own
`--workers`) running a `serve.Server` on that socket: the kernel hands each new
connection to one of them. As far as the database goes each worker is a server process
of its own, as several `fedlang serve` on several hosts are: its own connections, its
own report shards (`store.shards`: the shard id is made in the process) and writer, its
own deadline ticks. Reports, check-ins and round closes are exact across processes
(`store.shards`, `store.admission`).

The parent checks its workers a few times a second. A worker that dies (kill -9, a
crash) is replaced by a new one: every report it acknowledged is in the database, a
report in flight was never acknowledged and its client sends it again. A worker that
dies before it ever served (an unreachable database, a bad TLS file) stops them all:
the next one would fail the same way. SIGINT or SIGTERM to the parent sends SIGTERM to
each worker, which stops once its requests in progress end (committing the reports its
writer holds); the parent returns once they all ended. Workers ignore SIGINT (a Ctrl-C in
a terminal reaches the whole process group: the parent decides), and a worker whose
parent vanished (kill -9) stops by itself.

Per process, so N times what one `fedlang serve` has: `--max-connections`, the
per-client and enrollment rate limits (each worker counts what reaches it), and the
dashboard's per-minute rates (each worker's since it started). `--metrics-port` (one
port, one process) is refused with several workers, and SQLite (one process holds it)
with any.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

POLL = 0.1  # seconds between checks of the workers (and of a worker's parent)
STOP_TIMEOUT = 60.0  # seconds a stopping worker may take before it is killed

_spawn = multiprocessing.get_context("spawn")
log = logging.getLogger("fedlang.deploy.server.workers")


class WorkerFailed(RuntimeError):
    """A worker ended before it ever served."""


def check(db: str, workers: int, *, metrics_port: int | None = None,
          upstream: str | None = None) -> None:
    """Whether `fedlang serve --workers N` can run with these options.

    Raises:
      ValueError: N < 1, an SQLite database, `--metrics-port` with several workers, or
        an edge aggregator (`--upstream`), each saying what to do instead.
    """
    from fedlang.deploy.store import sql

    if workers < 1:
        raise ValueError(f"Expected --workers N with N >= 1 (server processes), found {workers}.")
    if isinstance(sql.dialect(db), sql.SQLite):
        raise ValueError(
            f"Expected a PostgreSQL database with --workers (several server processes on one "
            f"database), found the SQLite database {db}: SQLite is one process's (one server "
            "holds it); use --db postgresql://..., or drop --workers to serve SQLite from one "
            "process."
        )
    if metrics_port is not None and workers > 1:
        raise ValueError(
            f"Expected no --metrics-port with --workers {workers}, found --metrics-port "
            f"{metrics_port}: one port cannot serve {workers} processes' metrics; scrape "
            "GET /metrics with the admin token (any worker answers the store's counters), or "
            "run one `fedlang serve --metrics-port` per process."
        )
    if upstream is not None:
        raise ValueError(
            "Expected no --upstream with --workers, found both: an edge aggregator is one "
            "process (its link to the root); run the edge without --workers."
        )


def _worker_main(options: dict[str, Any], sock: socket.socket, parent: int, ready: Any) -> None:
    """A worker process: serves `sock` until SIGTERM, or until its parent is gone."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides on a Ctrl-C
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda signum, frame: stop.append(signum))
    from fedlang.deploy.server import serve as serve_lib

    server = serve_lib.Server(sock=sock, **options)
    try:
        server.start()
        extra = f"; metrics: {server.metrics_url}" if server.metrics_url else ""
        print(f"worker pid {os.getpid()} serving {server.url}{extra}", file=sys.stderr,
              flush=True)
        ready.set()
        while not stop and os.getppid() == parent:
            time.sleep(POLL)
    finally:
        server.stop()  # commits the reports its writer holds


@dataclasses.dataclass
class _Worker:
    index: int
    process: Any  # a multiprocessing SpawnProcess
    ready: Any  # a multiprocessing Event, set once it serves
    announced: bool = False


class Workers:
    """Serves `server`'s listening socket from `n` worker processes (see the module
    docstring); `server` itself (the parent's) serves nothing and is closed at the end.

    Args:
      server: the parent's `serve.Server` (its socket bound, its database set up).
      n: the number of workers.
      options: the keyword arguments of each worker's `serve.Server` (its `db`, `key`,
        limits, ...; never `host`, `port` or `sock`).
      say: where the parent's lines go (a worker started, died, replaced).
    """

    def __init__(self, server: Any, n: int, options: dict[str, Any],
                 say: Callable[[str], None] | None = None):
        if n < 1:
            raise ValueError(f"Expected n >= 1 worker processes, found {n}.")
        self.server = server
        self.n = n
        self.options = options
        self.say = say or (lambda line: print(line, flush=True))
        self.workers: list[_Worker] = []
        self._stopping = False  # set by a signal handler: a plain flag, no lock

    def request_stop(self) -> None:
        """Asks `serve()` to stop its workers and return; safe in a signal handler, and
        before `serve()` starts (it then returns at once)."""
        self._stopping = True

    @property
    def pids(self) -> list[int]:
        """The workers' process ids now."""
        return [w.process.pid for w in self.workers]

    def serve(self) -> None:
        """Runs the workers until `request_stop`, replacing any that dies.

        Raises:
          WorkerFailed: a worker ended before it served (the others are stopped).
        """
        try:
            for i in range(self.n):
                if self._stopping:
                    break
                self.workers.append(self._start(i))
            while not self._stopping:
                for slot, w in enumerate(self.workers):
                    self._watch(slot, w)
                time.sleep(POLL)
        finally:
            self._stop_all()
            self.server.close()

    def _start(self, index: int) -> _Worker:
        ready = _spawn.Event()
        process = _spawn.Process(
            target=_worker_main, name=f"fedlang-worker-{index + 1}",
            args=(self.options, self.server.listening_socket, os.getpid(), ready),
        )
        process.start()
        return _Worker(index, process, ready)

    def _watch(self, slot: int, w: _Worker) -> None:
        if not w.announced and w.ready.is_set():
            w.announced = True
            self.say(f"worker {w.index + 1} of {self.n} started (pid {w.process.pid})")
        if w.process.is_alive() or self._stopping:
            return
        w.process.join()
        code = w.process.exitcode
        how = f"killed by signal {-code}" if code is not None and code < 0 else f"exit status {code}"
        if not w.ready.is_set():
            raise WorkerFailed(
                f"Expected worker {w.index + 1} of {self.n} to start serving, found it ended "
                f"first ({how}); its error is above (the database unreachable? a TLS file "
                "missing?): fix it and start again."
            )
        self.say(f"worker {w.index + 1} of {self.n} (pid {w.process.pid}) ended ({how}); "
                 "starting another (every report it acknowledged is in the database)")
        self.workers[slot] = self._start(w.index)

    def _stop_all(self) -> None:
        for w in self.workers:
            if w.process.is_alive():
                with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                    os.kill(w.process.pid, signal.SIGTERM)
        end = time.monotonic() + STOP_TIMEOUT
        for w in self.workers:
            if w.process.pid is None:
                continue
            w.process.join(max(0.0, end - time.monotonic()))
            if w.process.is_alive():
                log.warning("worker pid %s did not stop within %g s: killed", w.process.pid,
                            STOP_TIMEOUT)
                w.process.kill()
                w.process.join()

