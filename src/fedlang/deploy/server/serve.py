"""Running the task store's server: `Server(db=...)` from Python (`start()` serves on a
background thread), `fedlang serve --db URL` from the command line. TLS is uvicorn's:
pass `ssl_keyfile` and `ssl_certfile` (`--ssl-keyfile/--ssl-certfile`).

Clients only ever connect out: they enroll, check in for a task, download its signed
plan and broadcast value by hash, and upload a report, which is checked and folded into
the round's aggregate in one database transaction (`intake`). The driver
(`driver.rounds.ServerRounds`, `driver.buffered.BufferedDriver`) uses the admin endpoints
to open rounds and sessions and read their results. The application itself is
`app.create_app`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import errno
import fcntl
import ipaddress
import json
import math
import os
import pathlib
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import uvicorn
from uvicorn.protocols.http import h11_impl

from fedlang.core import signing
from fedlang.deploy.server import app as app_lib
from fedlang.deploy.server import ratelimit, telemetry
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib


class DatabaseInUse(RuntimeError):
    """Another server holds this SQLite task store (its lock file is locked)."""


def hold_database(db: str | os.PathLike[str]) -> Any:
    """Locks an SQLite task store for one server: an exclusive `flock` on `DB.lock` next
    to the database file, held until the returned file is closed (None for PostgreSQL,
    which several servers share, and for `:memory:`).

    Two servers on one SQLite file would both fold reports and close rounds: refused.
    The kernel releases the lock when the process ends, even on kill -9, so a restarted
    server never finds a stale lock; the lock file itself stays (it holds the pid of the
    server that last held it).

    Raises:
      DatabaseInUse: another process holds the lock.
    """
    dialect = sql.dialect(db)
    if not isinstance(dialect, sql.SQLite) or dialect.path == ":memory:":
        return None
    path = pathlib.Path(dialect.path).resolve()
    lock = path.with_name(path.name + ".lock")
    f = open(lock, "a+")  # noqa: SIM115 (held open for the server's life)
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip()
        f.close()
        raise DatabaseInUse(
            f"Expected no other server on the task store {path}, found one holding it "
            f"({f'pid {holder}, ' if holder.isdigit() else ''}lock file {lock}); stop that "
            "server first, or give this one its own database (--db)."
        ) from None
    except BaseException:
        f.close()
        raise
    f.truncate(0)
    f.write(str(os.getpid()))
    f.flush()
    return f


def default_key_file(db: str | os.PathLike[str]) -> pathlib.Path | None:
    """Where the plan-signing key of a task store is kept by default: `DB.key` next to an
    SQLite database (None for `:memory:` and for PostgreSQL, which needs `--key-file`)."""
    dialect = sql.dialect(db)
    if not isinstance(dialect, sql.SQLite) or dialect.path == ":memory:":
        return None
    path = pathlib.Path(dialect.path).resolve()
    return path.with_name(path.name + ".key")


def _write_secret(path: pathlib.Path, data: bytes) -> None:
    """Writes a new file readable by its owner only (mode 0600), whole or not at all."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.link(tmp, path)  # fails if the file appeared meanwhile: never overwritten
    finally:
        os.unlink(tmp)


def load_key(key: Any, store: store_lib.Store, db: str | os.PathLike[str] = "") -> Any:
    """The server's Ed25519 signing key: `key` itself, or a key file (32 raw bytes, made
    with mode 0600 if missing): `key`, or by default `default_key_file(db)`. The key is
    never kept in the database, whose backups would then let anyone sign plans; a key an
    older fedlang kept there is moved to the key file (so clients' pinned key stays).

    Raises:
      ValueError: no key file for a PostgreSQL database, or a key file that disagrees
        with the key an older fedlang kept in the database.
    """
    if key is not None and not isinstance(key, str | os.PathLike):
        return key
    path = pathlib.Path(key) if key is not None else default_key_file(db)
    legacy = store.get_meta("signing_key")
    if path is None:
        dialect = sql.dialect(db)
        if isinstance(dialect, sql.SQLite):  # in memory: the key lives as long as the data
            return signing.load_private_key(legacy) if legacy else signing.generate_key()
        raise ValueError(
            "Expected a key file for the plan-signing key with a PostgreSQL database, found "
            "none; pass --key-file PATH (Server(key=PATH)): it is made, readable by its owner "
            "only, if missing, and must be the same file for every server of the database."
        )
    if legacy is not None:
        if not path.exists():
            _write_secret(path, legacy)
        elif path.read_bytes() != legacy:
            raise ValueError(
                f"Expected the key file {path} to hold the signing key this database kept "
                "(an older fedlang kept it in the database), found another key; move that "
                "file away to keep the database's key (clients pinned it), or delete the "
                "database's copy to switch keys."
            )
        store.delete_meta("signing_key")
    if not path.exists():
        with contextlib.suppress(FileExistsError):  # another server made it first
            _write_secret(path, signing.private_key_bytes(signing.generate_key()))
    return signing.load_private_key(path.read_bytes())


@dataclasses.dataclass(frozen=True)
class Limits:
    """What one connection may hold of the server, and how long (`fedlang serve`'s
    `--header-timeout`, `--body-timeout`, `--keep-alive`, `--max-connections`, ...).

    Attributes:
      header_timeout: seconds from a connection's first byte (or the end of its last
        answer) to the end of a request's headers; then 408 and the connection closed
        (a slowloris sending a header byte now and then holds nothing for long).
      body_timeout: seconds a request's body may stall (nothing of it arriving); then
        408 (`guard.Guard`).
      keep_alive: seconds an idle connection is kept open after an answer.
      max_connections: connections and requests in progress at once; more get 503, which
        clients retry.
      client_rate, client_burst: requests per second each enrolled client may make on
        average, and at once (`ratelimit`; more get 429 with Retry-After, which
        clients wait out); 0 turns the limit off.
      enroll_rate, enroll_burst: failed enrollments per second one address may make on
        average, and at once (then 429, even with a good token); 0 turns it off.
      admin_rate, admin_burst: requests with a wrong admin token per second one address
        may make on average, and at once (then 429, even with the right token, before
        the token is compared); 0 turns it off (`--admin-rate`, `--admin-burst`).
      max_blob_bytes: the largest blob (a plan, a broadcast value) the admin may upload
        (`--max-blob-bytes`; more get 413 before the body is read).
      max_report_bytes: the largest upload of any kind (a report, an edge's partial
        aggregate or batch; `--max-report-bytes`): a round whose plan lets clients report
        more is refused when it is created, and a larger upload gets 413 before its
        body is read.
      stream_report_bytes: a round whose plan lets a client's report hold more than this
        (a large model's) takes its reports as they arrive: each is checked as it
        passes and written to storage in chunks, then folded when the round closes, a
        slice at a time; no process holds it (`--stream-report-bytes`).
      max_connections_per_address: connections one address may hold open at once
        (`--max-connections-per-address`); one more is answered 503 and closed at once,
        so a single address cannot take the `max_connections` others need. 0: no cap.
      max_unfinished_per_address: connections of one address whose request headers have
        not ended (`--max-unfinished-per-address`; a new connection's have not): one
        more is answered 503 and closed at once (a slowloris from one address holds at
        most this many). 0: no cap. Neither cap applies to the trusted proxies
        (`Server(forwarded_allow_ips=...)`), which cap their clients themselves.
      body_min_rate, body_rate_window: a request's body must arrive at `body_min_rate`
        bytes/s or more, over every `body_rate_window` seconds of waiting for it (once
        it has been awaited that long); a slower one is answered 408 and its connection
        closed (`guard.Guard`), so a trickle holds a connection for `body_rate_window`
        seconds, not for as long as its body takes. Time the server spends on the body
        itself does not count against the client. `body_min_rate` 0: no minimum rate
        (`--body-min-rate`, `--body-rate-window`).
    """

    header_timeout: float = 10.0
    body_timeout: float = 30.0
    keep_alive: float = 5.0
    max_connections: int = 1000
    client_rate: float = 50.0
    client_burst: int = 200
    enroll_rate: float = 1.0
    enroll_burst: int = 20
    max_blob_bytes: int = 1 << 30
    max_report_bytes: int = 1 << 30
    stream_report_bytes: int = 64 << 20
    max_connections_per_address: int = 100
    max_unfinished_per_address: int = 10
    body_min_rate: float = 1024.0
    body_rate_window: float = 10.0
    admin_rate: float = 1.0
    admin_burst: int = 20

    def __post_init__(self) -> None:
        for name in ("max_blob_bytes", "max_report_bytes"):
            if getattr(self, name) < 1 << 16:
                raise ValueError(f"Expected {name} >= 64 KiB, found {getattr(self, name)} bytes.")
        for name in ("header_timeout", "body_timeout", "keep_alive", "body_rate_window"):
            if not getattr(self, name) > 0:
                raise ValueError(f"Expected {name} > 0 seconds, found {getattr(self, name)}.")
        if self.stream_report_bytes < 0:
            raise ValueError(f"Expected stream_report_bytes >= 0, found {self.stream_report_bytes}.")
        if self.max_connections < 1:
            raise ValueError(f"Expected max_connections >= 1, found {self.max_connections}.")
        for name in ("max_connections_per_address", "max_unfinished_per_address",
                     "body_min_rate"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"Expected {name} >= 0 (0: no limit), found {getattr(self, name)}.")
        for which in ("client", "enroll", "admin"):
            self.rate(which)

    def rate(self, which: str) -> ratelimit.Rate | None:
        """The `client`, `enroll` or `admin` rate limit (None when its rate is 0: off)."""
        rate, burst = getattr(self, f"{which}_rate"), getattr(self, f"{which}_burst")
        if rate == 0:
            return None
        try:
            return ratelimit.Rate(rate, burst)
        except ValueError as e:
            raise ValueError(f"Expected {which}_rate > 0 (0: no limit) and {which}_burst >= 1, "
                             f"found {rate:g} and {burst}.") from e


class ConnectionBudget:
    """What each remote address may hold of one server process: its open connections,
    and those whose request headers have not ended (`Limits.max_connections_per_address`,
    `Limits.max_unfinished_per_address`), counted as connections open and close
    (`HeaderTimeout`, on the event loop: no lock). The trusted proxies
    (`forwarded_allow_ips`: addresses or networks, comma-separated; `*` for any) are not
    capped: every client behind a proxy has its address, and the proxy caps each client
    itself (nginx's `limit_conn`). A refusal is counted by reason
    (`telemetry.Refusals`)."""

    def __init__(self, limits: Limits, refusals: telemetry.Refusals,
                 forwarded_allow_ips: str = "") -> None:
        self.max_open = limits.max_connections_per_address
        self.max_unfinished = limits.max_unfinished_per_address
        self.refusals = refusals
        self.open: dict[str, int] = {}
        self.unfinished: dict[str, int] = {}
        given = [part.strip() for part in forwarded_allow_ips.split(",") if part.strip()]
        self._trust_all = "*" in given
        self._trusted: list[Any] = []
        for part in given:
            with contextlib.suppress(ValueError):  # a host name or a socket path: not an address
                self._trusted.append(ipaddress.ip_network(part, strict=False))

    def exempt(self, address: str) -> bool:
        """Whether `address` is a trusted proxy's (not capped)."""
        if self._trust_all:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in network for network in self._trusted)

    def admit(self, address: str) -> str | None:
        """Counts a new connection of `address` (open, its headers unfinished); or the
        reason it is refused, counting nothing."""
        if self.max_open and self.open.get(address, 0) >= self.max_open:
            return "connections_per_address"
        if self.max_unfinished and self.unfinished.get(address, 0) >= self.max_unfinished:
            return "unfinished_per_address"
        self.open[address] = self.open.get(address, 0) + 1
        self.unfinished[address] = self.unfinished.get(address, 0) + 1
        return None

    def begin_headers(self, address: str) -> bool:
        """Counts a request's headers beginning on an open connection of `address`;
        False (nothing counted) when the address has `max_unfinished` already."""
        if self.max_unfinished and self.unfinished.get(address, 0) >= self.max_unfinished:
            return False
        self.unfinished[address] = self.unfinished.get(address, 0) + 1
        return True

    def end_headers(self, address: str) -> None:
        _take(self.unfinished, address)

    def close(self, address: str) -> None:
        _take(self.open, address)

    def detail(self, reason: str) -> str:
        """What a refused connection is told."""
        if reason == "connections_per_address":
            return (f"Expected at most {self.max_open} open connections from one address, "
                    "found that many open from yours; close some and retry, or ask the "
                    "operator to raise --max-connections-per-address.")
        return (f"Expected at most {self.max_unfinished} connections from one address whose "
                "request headers have not ended, found that many from yours; finish their "
                "headers and retry, or ask the operator to raise --max-unfinished-per-address.")


def _take(counts: dict[str, int], address: str) -> None:
    left = counts.get(address, 0) - 1
    if left > 0:
        counts[address] = left
    else:  # an address with nothing open takes no memory
        counts.pop(address, None)


def _answer_and_close(transport: Any, status: bytes, detail: str, reason: str) -> None:
    """Writes a short JSON answer (`HTTP/1.1 STATUS`) and closes the connection."""
    body = json.dumps({"detail": detail, "reason": reason}).encode()
    transport.write(
        b"HTTP/1.1 %s\r\ncontent-type: application/json\r\nconnection: close\r\n"
        b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s" % (status, len(body), body)
    )
    transport.close()


class HeaderTimeout(h11_impl.H11Protocol):
    """uvicorn's HTTP/1.1 protocol, closing a connection whose request headers do not
    end within `header_timeout` seconds (uvicorn bounds only the idle time between
    requests): with a 408 when no request is in progress on it. With a `budget`
    (`ConnectionBudget`), a connection over its address's caps is answered 503 and
    closed as soon as it is made (or as soon as a new request begins on it), before
    uvicorn takes it: it never counts against `max_connections`."""

    header_timeout = 10.0  # set per server by `Server` (a subclass each)
    budget: ConnectionBudget | None = None  # likewise

    def connection_made(self, transport: Any) -> None:  # type: ignore[override]
        self._header_timer: asyncio.TimerHandle | None = None
        self._address: str | None = None  # the address counted by the budget
        self._unfinished = False  # counted as a connection whose headers have not ended
        self._refused = False
        budget = self.budget
        if budget is not None:
            peer = transport.get_extra_info("peername")
            address = peer[0] if isinstance(peer, tuple | list) and peer else None
            if isinstance(address, str) and not budget.exempt(address):
                reason = budget.admit(address)
                if reason is not None:
                    self._refuse(transport, reason)
                    return
                self._address, self._unfinished = address, True
        super().connection_made(transport)
        self._arm()

    def _refuse(self, transport: Any, reason: str) -> None:
        assert self.budget is not None
        self._refused = True
        self.budget.refusals.note(reason, self.loop)
        _answer_and_close(transport, b"503 Service Unavailable", self.budget.detail(reason),
                          reason)

    def _arm(self) -> None:
        if self._header_timer is None:
            self._header_timer = self.loop.call_later(self.header_timeout, self._too_slow)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_ended(self) -> None:
        self._disarm()
        if self._unfinished and self.budget is not None and self._address is not None:
            self.budget.end_headers(self._address)
        self._unfinished = False

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return
        idle = self.cycle is None or self.cycle.response_complete
        if idle:  # bytes of a new request: its headers must end in time
            if not self._unfinished and self._address is not None:
                assert self.budget is not None
                if not self.budget.begin_headers(self._address):
                    self.budget.refusals.note("unfinished_per_address", self.loop)
                    self._disarm()
                    _answer_and_close(self.transport, b"503 Service Unavailable",
                                      self.budget.detail("unfinished_per_address"),
                                      "unfinished_per_address")
                    return
                self._unfinished = True
            self._arm()
        before = self.cycle
        super().data_received(data)
        if self.cycle is not before:  # the headers ended: a request began
            self._headers_ended()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._refused:  # uvicorn never took it
            return
        self._headers_ended()
        if self._address is not None and self.budget is not None:
            self.budget.close(self._address)
            self._address = None
        super().connection_lost(exc)

    def _too_slow(self) -> None:
        self._header_timer = None
        if self.transport.is_closing():
            return
        if self.budget is not None:
            self.budget.refusals.note("header_timeout", self.loop)
        if self.cycle is None or self.cycle.response_complete:
            _answer_and_close(
                self.transport, b"408 Request Timeout",
                f"Expected the request's headers within {self.header_timeout:g} s, found "
                "them unfinished; send the request again.", "timeout")
        self.transport.close()


def _free_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        if e.errno != errno.EADDRINUSE:
            raise
        in_use = OSError(
            f"Expected port {port} on {host} to be free, found it in use (by another "
            "server?); pick another port (--port N), or --port 0 for any free one."
        )
        in_use.errno = e.errno  # still an EADDRINUSE to code that checks
        raise in_use from e
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server:
    """A task store server, from Python (see the module docstring).

    Args:
      db: the database: `sqlite:///PATH`, a file path, or `postgresql://...`.
      host: the address to listen on.
      port: the port (0: any free port; see `url`).
      admin_token: the admin endpoints' bearer token; the database keeps only its SHA-256.
        By default the one set before, or, on a new database, one made now (`admin_token`
        shows it on that first start only).
      key: the plan-signing key: an Ed25519 private key, or a key file (made, mode 0600,
        if missing); by default `DB.key` next to an SQLite database. Never kept in the
        database.
      pace: pace steering of check-ins (`fedlang.deploy.Pace`).
      credential_ttl: seconds a client credential stays valid.
      ssl_keyfile, ssl_certfile: serve HTTPS (uvicorn's TLS).
      clock: the time (tests pass their own).
      tick: seconds between checks of round deadlines.
      browser: also serve the browser client (`/browser/fedlang.js` and onnxruntime-web,
        `fedlang.deploy.browser.routes`).
      demo_page: also serve the demo page at `/demo/` (implies `browser`).
      dashboard: serve the operator's dashboard at `/dashboard/` (`server.dashboard`
        in this package; what it shows needs the admin token).
      log_level: uvicorn's log level.
      access_log: log one line per request (uvicorn's access log: method, path, status;
        never a body).
      limits: timeouts and the connection limit (`Limits`; its defaults by default).
      log_format: `text` or `json`: the server's logs (its own, with a line per request
        and its id, and uvicorn's) go to stderr in this format from `log_level` up
        (`telemetry.configure_logging`); None: uvicorn's own logging, as before.
      metrics_port: also serve `/metrics` without a token on 127.0.0.1 at this port (0:
        any free port; see `metrics_url`), for a Prometheus on the same machine.
      sock: serve this bound, listening socket instead of binding `host`:`port` (a worker
        of `fedlang serve --workers N`, `workers.Workers`, serves its parent's socket).
      forwarded_allow_ips: the proxies whose `X-Forwarded-For` and `X-Forwarded-Proto`
        are believed (comma-separated addresses or networks, `*` for any; uvicorn's):
        a request from one of them has the address the header names as its client's
        (what the per-address limits count). Empty: none (the connection's address).
        By default loopback, as uvicorn's, for a proxy on the same machine.

    Example:
      >>> with Server(db="/tmp/fl.db", port=0) as server:  # doctest: +SKIP
      ...     print(server.url, server.admin_token)
    """

    def __init__(
        self,
        db: str | os.PathLike[str] = "fedlang.db",
        host: str = "127.0.0.1",
        port: int = 8000,
        admin_token: str | None = None,
        key: Any = None,
        *,
        pace: store_lib.Pace | None = None,
        credential_ttl: float = 30 * 86400,
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        clock: Callable[[], float] = time.time,
        tick: float = 1.0,
        log_level: str = "warning",
        browser: bool = False,
        demo_page: bool = False,
        dashboard: bool = True,
        access_log: bool = False,
        limits: Limits | None = None,
        log_format: str | None = None,
        metrics_port: int | None = None,
        sock: socket.socket | None = None,
        forwarded_allow_ips: str = "127.0.0.1,::1",
    ):
        self._metrics: Any = None  # the loopback /metrics server (`metrics_port`)
        self._held = hold_database(db)  # first: before anything reads the database
        try:
            self.store = store_lib.Store(db, clock=clock, pace=pace)
        except BaseException:
            self._release()
            raise
        try:  # what fails below (a port in use, a missing asset) leaves nothing held
            token_hash, made = self.store.admin_token(admin_token)
            # The token, when this start knows it (given, or made now and shown once);
            # None when the database keeps only its hash from an earlier start.
            self.admin_token = admin_token or made
            limits = limits or Limits()
            self.limits = limits
            self.app_state = state_lib.ServerState(
                self.store, load_key(key, self.store, db), token_hash, credential_ttl,
                limits.max_blob_bytes, limits.rate("client"), limits.rate("enroll"),
                max_report_bytes=limits.max_report_bytes,
                stream_report_bytes=limits.stream_report_bytes,
                admin_rate=limits.rate("admin"),
            )
            self.public_key = self.app_state.public_key
            self.app = app_lib.create_app(self.app_state, tick, limits.body_timeout,
                                          limits.body_min_rate, limits.body_rate_window)
            if browser or demo_page:
                from fedlang.deploy.browser import routes

                routes.mount(self.app, demo=demo_page)
            if dashboard:
                from fedlang.deploy.server import dashboard as dashboard_lib

                dashboard_lib.mount(self.app)
            app_lib.build_routes(self.app)
            budget = ConnectionBudget(limits, self.app_state.telemetry.connections,
                                      forwarded_allow_ips)
            protocol = type("HeaderTimeout", (HeaderTimeout,),
                            {"header_timeout": limits.header_timeout, "budget": budget})
            logging_config: dict[str, Any] | None = uvicorn.config.LOGGING_CONFIG
            if log_format is not None:
                telemetry.configure_logging(log_format, log_level)
                logging_config = None  # uvicorn's loggers go to the handler made here
            self._config = uvicorn.Config(
                self.app, log_level=log_level, access_log=access_log, ssl_keyfile=ssl_keyfile,
                log_config=logging_config,
                ssl_certfile=ssl_certfile, timeout_graceful_shutdown=5, http=protocol,
                timeout_keep_alive=max(1, math.ceil(limits.keep_alive)),
                limit_concurrency=limits.max_connections,
                proxy_headers=bool(forwarded_allow_ips.strip()),
                forwarded_allow_ips=forwarded_allow_ips.strip() or None,
            )
            self._uvicorn = uvicorn.Server(self._config)
            self._thread: threading.Thread | None = None
            self.metrics_url: str | None = None
            if metrics_port is not None:  # on loopback only: it answers without a token
                self._metrics = telemetry.serve_metrics(self.app_state.telemetry, metrics_port)
                self.metrics_url = f"http://127.0.0.1:{self._metrics.server_port}/metrics"
            self.host = host
            # last: nothing after it fails
            self._sock = _free_socket(host, port) if sock is None else sock
            if sock is not None:
                self.host = host = sock.getsockname()[0]
            self.port = self._sock.getsockname()[1]
            scheme = "https" if ssl_certfile else "http"
            shown = f"[{host}]" if ":" in host else host
            self.url = f"{scheme}://{shown}:{self.port}"
        except BaseException:
            self._close_metrics()
            self.store.close()
            self._release()
            raise

    @property
    def listening_socket(self) -> socket.socket:
        """The listening socket (what `workers.Workers` hands to its worker processes)."""
        return self._sock

    def serve(self) -> None:
        """Serves until interrupted (Ctrl-C or SIGTERM)."""
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.close()

    def request_stop(self) -> None:
        """Asks `serve()` to stop once the requests in progress end; safe in a signal
        handler, and before `serve()` starts (it then returns at once)."""
        self._uvicorn.should_exit = True

    def start(self, timeout: float = 30.0) -> Server:
        """Serves on a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, daemon=True,
            name="fedlang-server",
        )
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"Expected the server to start within {timeout} s; it did not.")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops serving and closes the database."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.close()

    def close(self) -> None:
        """Closes the socket and the database, and releases the database's lock."""
        with contextlib.suppress(OSError):
            self._sock.close()
        self._close_metrics()
        self.app_state.close()
        for refusals in (self.app_state.telemetry.connections,
                         self.app_state.telemetry.admin_refusals):
            with contextlib.suppress(Exception):  # the refusals of the last second
                refusals.flush()
        self.store.close()
        self._release()

    def _close_metrics(self) -> None:
        if self._metrics is not None:
            self._metrics.shutdown()
            self._metrics.server_close()
            self._metrics = None

    def _release(self) -> None:
        if self._held is not None:
            self._held.close()  # the kernel drops the flock with the file
            self._held = None

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
