"""What the server tells its operator besides its API: Prometheus metrics, the check-in
and report rates of the overview, and one log line per request with a request id.

`Telemetry` belongs to one server (`state.ServerState.telemetry`): its own
`prometheus_client.CollectorRegistry`, never the global one, so several servers in one
process (tests) keep their numbers apart. Two kinds of metrics are in it:

* the task store's counters, read from the database at each scrape (`StoreCollector`):
  check-ins, assignments, enrollments, reports accepted and refused by reason, admin
  requests refused by reason, connections refused by a connection budget by reason
  (`Refusals`: counted in memory, written within a second), dropouts, rounds ended, and a histogram of the ended
  rounds' durations. They are the numbers `GET /v1/status` shows, the same for every
  server process sharing a database;
* this process's own: the latency of its database transactions (`Store.on_transaction`)
  and the sizes of the request bodies it read (`Observe`).

The overview's rates (`Rates`) come from the same counters: the server notes their values
once a minute, as requests arrive, and a minute's rate is the difference to the next note.
They live in memory (the last hour) and start empty when the server starts.

`Observe`, the outermost ASGI middleware, gives every request an id (a sane incoming
`X-Request-Id`, or a new one), returns it as `X-Request-Id`, and logs one line when the
answer is sent: method, path, status, duration, body size (`fedlang.deploy.server.requests`,
level INFO). `configure_logging` makes the log human-readable or one JSON object a line
(`fedlang serve --log-format json`), each with the request id it was written under.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import contextvars
import datetime
import json
import logging
import re
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import prometheus_client
from prometheus_client import core as prometheus_core
from prometheus_client import registry as prometheus_registry
from starlette import concurrency, datastructures
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fedlang.deploy.store import metrics as metrics_lib
from fedlang.deploy.store import store as store_lib

# Round durations: from a few seconds (a test) to a day (devices that train at night).
ROUND_BUCKETS = (1.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0, 21600.0, 86400.0)
TX_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)
SIZE_BUCKETS = tuple(float(1 << k) for k in range(6, 31, 2))  # 64 B .. 1 GiB, times 4
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:-]{1,64}$")
WINDOW = 60  # minutes of rates kept
LEVELS = ("debug", "info", "warning", "error", "critical")

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")
requests_log = logging.getLogger("fedlang.deploy.server.requests")
log = logging.getLogger(__name__)

# The store's counters as Prometheus counters: (counter, metric name, help).
_COUNTERS = (
    ("checkins", "fedlang_checkins", "Client check-ins."),
    ("assignments", "fedlang_assignments", "Tasks assigned to clients (rounds and sessions)."),
    ("enrollments", "fedlang_enrollments", "Clients enrolled."),
    ("reports:accepted", "fedlang_reports_accepted", "Reports accepted (every mode)."),
    ("dropouts", "fedlang_dropouts", "Clients assigned to a round that ended without them."),
)


def _by_reason(name: str, doc: str, counts: dict[str, int]) -> Any:
    """A counter family labelled by `reason`, one sample per entry of `counts`."""
    family = prometheus_core.CounterMetricFamily(name, doc, labels=["reason"])
    for reason, value in counts.items():
        family.add_metric([reason], value)
    return family


class StoreCollector(prometheus_registry.Collector):
    """The task store's counters and round durations, read at each scrape."""

    def __init__(self, store: store_lib.Store):
        self.store = store

    def describe(self) -> list[Any]:
        return []  # read the database only when scraped

    def collect(self) -> Iterator[Any]:
        counters = self.store.counters()
        for key, name, doc in _COUNTERS:
            yield prometheus_core.CounterMetricFamily(name, doc, value=counters.get(key, 0))
        reports, admin = metrics_lib.refusal_counts(counters)
        yield _by_reason(
            "fedlang_reports_refused",
            "Reports and client requests refused, by reason (late, stale, unauthorized, ...).",
            reports)
        yield _by_reason(
            "fedlang_admin_requests_refused",
            "Requests for admin routes refused, by reason (unauthorized: without the admin token).",
            admin)
        yield _by_reason(
            "fedlang_connections_refused",
            "Connections closed and requests cut by a connection budget, by limit "
            "(connections_per_address, unfinished_per_address, header_timeout, body_stall, "
            "body_rate, body_not_allowed).",
            metrics_lib.connection_refusals(counters))
        ended = prometheus_core.CounterMetricFamily(
            "fedlang_rounds_ended", "Rounds ended, by state (closed, failed).", labels=["state"]
        )
        for state in ("closed", "failed"):
            ended.add_metric([state], counters.get(f"rounds:{state}", 0))
        yield ended
        durations = metrics_lib.round_durations(self.store)
        yield prometheus_core.HistogramMetricFamily(
            "fedlang_round_duration_seconds", "Seconds each ended round took.",
            buckets=_buckets(durations, ROUND_BUCKETS), sum_value=sum(durations),
        )


def _buckets(values: list[float], bounds: tuple[float, ...]) -> list[tuple[str, float]]:
    """Cumulative histogram buckets of `values` (Prometheus' `le` labels)."""
    ordered = sorted(values)
    out = [(repr(b), float(bisect.bisect_right(ordered, b))) for b in bounds]
    return [*out, ("+Inf", float(len(ordered)))]


class Rates:
    """Per-minute rates of counters, from notes of their values (see the module
    docstring). Thread-safe."""

    def __init__(self, names: tuple[str, ...] = ("checkins", "reports:accepted")):
        self.names = names
        self._notes: dict[int, tuple[int, ...]] = {}  # minute -> the counters then
        self._first: int | None = None  # the minute of the first note (the server's start)
        self._lock = threading.Lock()

    def due(self, now: float) -> bool:
        """Whether this minute has no note yet."""
        return int(now // 60) not in self._notes

    def note(self, now: float, counters: dict[str, int]) -> None:
        """Notes the counters' values (once a minute: the first note of a minute stays)."""
        minute = int(now // 60)
        with self._lock:
            self._notes.setdefault(minute, tuple(counters.get(n, 0) for n in self.names))
            self._first = minute if self._first is None else self._first
            for old in [m for m in self._notes if m < minute - WINDOW]:
                del self._notes[old]

    def series(self, now: float, counters: dict[str, int]) -> dict[str, list[list[float]]]:
        """For each counter, `[[minute start (epoch seconds), count in that minute], ...]`
        over the last hour (since the first note, when it is more recent); what happened
        between two notes counts in the minute of the first (no requests came in the
        minutes between)."""
        self.note(now, counters)
        current = tuple(counters.get(n, 0) for n in self.names)
        with self._lock:
            notes = sorted(self._notes.items())
            first = self._first if self._first is not None else notes[0][0]
        last = int(now // 60)
        known = dict(notes)
        out: dict[str, list[list[float]]] = {n: [] for n in self.names}
        for minute in range(max(first, last - WINDOW + 1), last + 1):
            later = [m for m, _ in notes if m > minute]
            after = known[later[0]] if later else current
            for i, name in enumerate(self.names):
                count = after[i] - known[minute][i] if minute in known else 0
                out[name].append([minute * 60.0, float(count)])
        return out


class Refusals:
    """Refusals that a stranger can make by the thousand, by reason: connections and
    requests refused by a connection budget (`serve.Limits`; the counters
    `connections_refused:REASON`) or admin requests refused (`admin_refused:REASON`).
    Counted in memory as they happen (on the event loop, in `note`) and added to the
    store's counters (`prefix` + reason) at most `delay` seconds later, in one
    transaction: a flood of them costs the database one write a second, not one each.
    Thread-safe."""

    def __init__(self, store: store_lib.Store, prefix: str, delay: float = 1.0):
        self.store, self.prefix, self.delay = store, prefix, delay
        self._counts: dict[str, int] = {}
        self._scheduled = False
        self._lock = threading.Lock()

    def note(self, reason: str, loop: asyncio.AbstractEventLoop) -> None:
        """Counts one refusal; the count reaches the store within `delay` seconds (a
        flush on `loop`'s thread pool)."""
        with self._lock:
            self._counts[reason] = self._counts.get(reason, 0) + 1
            if self._scheduled:
                return
            self._scheduled = True
        self._schedule(loop)

    def pending(self) -> dict[str, int]:
        """What `flush` would write now."""
        with self._lock:
            return dict(self._counts)

    def flush(self) -> None:
        """Adds the refusals counted so far to the store's counters (kept for the next
        flush if the database fails)."""
        with self._lock:
            counts, self._counts, self._scheduled = self._counts, {}, False
        if not counts:
            return
        try:
            metrics_lib.count_refusals(self.store, self.prefix, counts)
        except BaseException:
            with self._lock:
                for reason, n in counts.items():
                    self._counts[reason] = self._counts.get(reason, 0) + n
            raise

    def _flush_quietly(self, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self.flush()
        except Exception as e:  # a database hiccup: try again later (the store closed: not)
            log.warning("Could not count %sREASON yet (%s); trying again.", self.prefix, e)
            with self._lock:
                if self._scheduled or not self._counts:
                    return
                self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop closed: the server stopped
                loop.call_soon_threadsafe(self._schedule, loop)

    def _schedule(self, loop: asyncio.AbstractEventLoop) -> None:
        loop.call_later(self.delay, lambda: loop.run_in_executor(None, self._flush_quietly, loop))


class Telemetry:
    """One server's Prometheus registry and rates (see the module docstring)."""

    def __init__(self, store: store_lib.Store):
        self.store = store
        self.registry = prometheus_client.CollectorRegistry(auto_describe=True)
        self.registry.register(StoreCollector(store))
        self.transaction_seconds = prometheus_client.Histogram(
            "fedlang_db_transaction_seconds",
            "Seconds each database transaction of this process took, from its start to its "
            "commit or rollback.", ["kind"], buckets=TX_BUCKETS, registry=self.registry,
        )
        self.request_bytes = prometheus_client.Histogram(
            "fedlang_request_body_bytes", "Bytes of each request body this process read.",
            buckets=SIZE_BUCKETS, registry=self.registry,
        )
        self.rates = Rates()
        # refused by a connection budget, and admin requests refused
        self.connections = Refusals(store, metrics_lib.CONNECTIONS_REFUSED)
        self.admin_refusals = Refusals(store, metrics_lib.ADMIN_REFUSED)
        store.on_transaction = self._transaction

    def _transaction(self, write: bool, seconds: float) -> None:
        self.transaction_seconds.labels("write" if write else "read").observe(seconds)

    def exposition(self) -> bytes:
        """The metrics in Prometheus' text format (reads the database)."""
        return bytes(prometheus_client.generate_latest(self.registry))

    def rate_series(self) -> dict[str, list[list[float]]]:
        """`{"checkins": [[t, n], ...], "reports": [[t, n], ...]}` per minute, last hour."""
        series = self.rates.series(self.store.clock(), self.store.counters())
        return {"checkins": series["checkins"], "reports": series["reports:accepted"]}


class Observe:
    """The outermost middleware: request ids, body sizes and a log line per request."""

    def __init__(self, app: ASGIApp, telemetry: Telemetry) -> None:
        self.app, self.telemetry = app, telemetry

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        given = datastructures.Headers(scope=scope).get("x-request-id", "")
        rid = given if REQUEST_ID.match(given) else uuid.uuid4().hex
        token = request_id.set(rid)
        telemetry, size, status = self.telemetry, 0, 0
        now = telemetry.store.clock()
        if telemetry.rates.due(now):
            counters = await concurrency.run_in_threadpool(telemetry.store.counters)
            telemetry.rates.note(now, counters)

        async def counted() -> Message:
            nonlocal size
            message = await receive()
            if message["type"] == "http.request":
                size += len(message.get("body", b""))
            return message

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers = datastructures.MutableHeaders(scope=message)
                headers["X-Request-Id"] = rid
            await send(message)

        try:
            await self.app(scope, counted, sending)
        except BaseException:
            status = status or 500  # what the server's error handler outside will answer
            raise
        finally:
            telemetry.request_bytes.observe(size)
            seconds = time.perf_counter() - start
            method, path = scope["method"], scope["path"]
            requests_log.info(
                "%s %s %d %.1f ms", method, path, status, seconds * 1000,
                extra={"method": method, "path": path, "status": status,
                       "duration": round(seconds, 6), "bytes": size},
            )
            request_id.reset(token)


def serve_metrics(telemetry: Telemetry, port: int) -> Any:
    """Serves `telemetry`'s metrics without a token at `http://127.0.0.1:PORT/metrics`
    (0: any free port) on a thread; returns the HTTP server (`server_port`,
    `shutdown()`, `server_close()`). Loopback only: anyone who can reach it reads it.

    Raises:
      OSError: the port is in use.
    """
    try:
        server, _ = prometheus_client.start_http_server(
            port, addr="127.0.0.1", registry=telemetry.registry)
    except OSError as e:
        raise OSError(
            e.errno, f"Expected port {port} on 127.0.0.1 to be free for the metrics, found it "
            f"in use ({e.strerror}); pick another --metrics-port, or 0 for any free port."
        ) from e
    return server


# -- logging


class _RequestId(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        if not getattr(record, "request_id", ""):
            record.request_id = request_id.get()
        return True


class _TextFormatter(logging.Formatter):
    """`TIME LEVEL LOGGER: MESSAGE [request ID]` (the id only under a request)."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        rid = getattr(record, "request_id", "")
        return f"{text} [request {rid}]" if rid else text


_STANDARD = set(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JSONFormatter(logging.Formatter):
    """One JSON object a line: time (ISO 8601, UTC), level, logger, message, request id,
    and the record's extra fields (method, path, status, duration, ...)."""

    def format(self, record: logging.LogRecord) -> str:
        doc: dict[str, Any] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
            "request_id": getattr(record, "request_id", "") or None,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and key not in doc and not key.startswith("_"):
                doc[key] = value if isinstance(value, str | int | float | bool) else str(value)
        if record.exc_info:
            doc["exception"] = self.formatException(record.exc_info)
        return json.dumps(doc)


def configure_logging(log_format: str = "text", level: str = "info") -> None:
    """Sends the server's logs (its own and uvicorn's) to stderr: human-readable
    (`text`) or one JSON object a line (`json`), each with its request id.

    Raises:
      ValueError: another format, or an unknown level.
    """
    if log_format not in ("text", "json"):
        raise ValueError(f"Expected a log format 'text' or 'json', found {log_format!r}.")
    if level.lower() not in LEVELS:
        raise ValueError(f"Expected a log level of {', '.join(LEVELS)}, found {level!r}.")
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_RequestId())
    handler.setFormatter(
        JSONFormatter() if log_format == "json" else _TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        logger.handlers.clear()
        logger.propagate = True
    logging.getLogger("uvicorn.access").disabled = True  # `Observe` logs each request
    logging.getLogger("httpx").setLevel(logging.WARNING)
