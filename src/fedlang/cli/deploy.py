"""`fedlang serve`, `fedlang client`, `fedlang status URL`, `fedlang revoke`,
`fedlang rotate-token`, `fedlang device-tokens` and `fedlang enroll-bulk`: the
deployment's commands.

FastAPI, uvicorn and httpx (`pip install 'fedlang[deploy]'`) are imported only when a
command runs; `fedlang.cli.NEEDS` lists which each needs, checked before it runs.
"""

from __future__ import annotations

import base64
import contextlib
import json
import logging
import os
import pathlib
import signal
import urllib.parse
from collections.abc import Iterator
from typing import Annotated, Any, NoReturn

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedlang.cli import console


def serve(
    db: Annotated[str, typer.Option(metavar="URL", help="sqlite:///PATH, a file path, or postgresql://...")]
    = "fedlang.db",
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", help="Port (0: any free port).")] = 8000,
    admin_token: Annotated[str | None, typer.Option(
        envvar="FEDLANG_ADMIN_TOKEN", metavar="TOKEN", help="The admin token; the database keeps only its hash (default: the one set before, or a new one, shown once).")]
    = None,
    key_file: Annotated[pathlib.Path | None, typer.Option(
        metavar="PATH", help="The plan-signing key file (made, mode 0600, if missing; default: DB.key next to an SQLite database; needed with PostgreSQL).")]
    = None,
    population: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="Create this population if it is new and print its enrollment token (repeatable).")]
    = None,
    min_retry: Annotated[float, typer.Option(metavar="SECONDS", help="Shortest wait between client check-ins.")]
    = 1.0,
    checkins_per_second: Annotated[float, typer.Option(
        metavar="RATE", help="Check-ins a second pace steering asks of each population (clients wait about its size / RATE seconds).")]
    = 100.0,
    max_retry: Annotated[float, typer.Option(metavar="SECONDS", help="Longest wait between client check-ins.")]
    = 86400.0,
    credential_ttl: Annotated[float, typer.Option(metavar="SECONDS", help="Seconds a client credential lasts.")]
    = 30 * 86400,
    ssl_keyfile: Annotated[str | None, typer.Option(metavar="PATH", help="TLS private key (PEM).")] = None,
    ssl_certfile: Annotated[str | None, typer.Option(metavar="PATH", help="TLS certificate (PEM).")] = None,
    browser: Annotated[bool, typer.Option(
        help="Serve the browser client at /browser/fedlang.js (with onnxruntime-web).")] = False,
    demo_page: Annotated[bool, typer.Option(
        help="Serve a demo page at /demo/ that trains in the browser (implies --browser).")]
    = False,
    header_timeout: Annotated[float, typer.Option(
        metavar="SECONDS", help="Seconds a request's headers may take (then 408).")] = 10.0,
    body_timeout: Annotated[float, typer.Option(
        metavar="SECONDS", help="Seconds a request's body may stall (then 408).")] = 30.0,
    keep_alive: Annotated[float, typer.Option(
        metavar="SECONDS", help="Seconds an idle connection stays open.")] = 5.0,
    max_connections: Annotated[int, typer.Option(
        metavar="N", help="Connections and requests at once (more get 503; clients retry).")]
    = 1000,
    max_connections_per_address: Annotated[int, typer.Option(
        metavar="N", help="Connections one address may hold open at once; one more gets 503 and is closed at once (0: no cap; trusted proxies, --forwarded-allow-ips, are not capped).")]
    = 100,
    max_unfinished_per_address: Annotated[int, typer.Option(
        metavar="N", help="Connections of one address whose request headers have not ended; one more gets 503 and is closed at once (0: no cap).")]
    = 10,
    body_min_rate: Annotated[float, typer.Option(
        metavar="BYTES", help="Bytes per second a request's body must arrive at, over every --body-rate-window seconds (slower: 408 and the connection closed; 0: no minimum).")]
    = 1024.0,
    body_rate_window: Annotated[float, typer.Option(
        metavar="SECONDS", help="The window of --body-min-rate: how long a trickling body holds its connection.")]
    = 10.0,
    log_format: Annotated[str, typer.Option(
        metavar="FORMAT", help="Logs on stderr: text (human-readable) or json (one object a line, with a request id).")]
    = "text",
    log_level: Annotated[str, typer.Option(
        metavar="LEVEL", help="Least severe log level: warning, or info for a line per request.")]
    = "warning",
    metrics_port: Annotated[int | None, typer.Option(
        metavar="N", help="Also serve /metrics (Prometheus) without a token on 127.0.0.1:N (0: any free port).")]
    = None,
    upstream: Annotated[str | None, typer.Option(
        metavar="URL", help="Run as an edge aggregator of this root server: serve its rounds and buffered sessions to this server's clients, forwarding one partial aggregate per round and batches of session reports.")]
    = None,
    upstream_token: Annotated[str | None, typer.Option(
        envvar="FEDLANG_UPSTREAM_TOKEN", metavar="TOKEN", help="The edge's token, made by the root's admin (POST /v1/admin/edges).")]
    = None,
    upstream_key: Annotated[str | None, typer.Option(
        metavar="KEY", help="The root's public key (base64) to pin (default: the one it shows on first contact).")]
    = None,
    ephemeral: Annotated[bool, typer.Option(
        help="An edge whose store is temporary (removed when it stops): a killed edge's clients count as dropouts at the root.")]
    = False,
    client_rate: Annotated[float, typer.Option(
        metavar="R", help="Requests per second each enrolled client may make (more get 429 with Retry-After; 0: no limit).")]
    = 50.0,
    client_burst: Annotated[int, typer.Option(
        metavar="B", help="Requests one client may make at once, above --client-rate.")] = 200,
    enroll_rate: Annotated[float, typer.Option(
        metavar="R", help="Failed enrollments per second one address may make (then 429; 0: no limit).")]
    = 1.0,
    enroll_burst: Annotated[int, typer.Option(
        metavar="B", help="Failed enrollments one address may make at once.")] = 20,
    admin_rate: Annotated[float, typer.Option(
        metavar="R", help="Requests with a wrong admin token per second one address may make (then 429, even with the right one; 0: no limit).")]
    = 1.0,
    admin_burst: Annotated[int, typer.Option(
        metavar="B", help="Requests with a wrong admin token one address may make at once.")] = 20,
    workers: Annotated[int | None, typer.Option(
        metavar="N", help="Serve from N worker processes on one PostgreSQL database (one port; a worker that dies is replaced).")]
    = None,
    max_blob_bytes: Annotated[str, typer.Option(
        metavar="SIZE", help="The largest blob (a plan, a model) the driver may upload, e.g. 4G or 1500M (more get 413).")]
    = "1G",
    max_report_bytes: Annotated[str, typer.Option(
        metavar="SIZE", help="The largest upload (a report, an edge's partial aggregate), e.g. 4G (more get 413; a round whose reports may be larger is refused).")]
    = "1G",
    stream_report_bytes: Annotated[str, typer.Option(
        metavar="SIZE", help="Reports larger than this (a large model's) are checked as they arrive and stored, then folded when their round closes, never held (0: every report a sum can take).")]
    = "64M",
    forwarded_allow_ips: Annotated[str, typer.Option(
        metavar="ADDRESSES", help="Reverse proxies whose X-Forwarded-For (the client's address, which the per-address limits count) and X-Forwarded-Proto are believed: comma-separated addresses or networks, * for any, '' for none.")]
    = "127.0.0.1,::1",
) -> None:
    """Serve a task store: clients check in for tasks; the driver opens rounds.

    With --workers N (PostgreSQL only) this process binds the port and N worker processes
    serve it, as several `fedlang serve` on one database do.

    With --upstream URL it is an edge aggregator: its clients enroll with its own
    population token and pin its key; it serves the root's rounds and forwards their
    partial aggregates to the root.

    Ctrl-C or SIGTERM stops it (exit status 130 or 143) once the requests in progress
    end; it says where the acknowledged reports are kept. It refuses a port in use and
    an SQLite database another server holds.
    """
    _check_roles(upstream, upstream_token, ephemeral, workers, db, metrics_port)
    if not ephemeral:  # an ephemeral edge's store is made in a new temporary directory
        _check_directory(db)
    with _signals() as (stopped, made):
        from fedlang.deploy.server import serve as server_lib
        from fedlang.deploy.store import store as store_lib

        temporary = None
        if ephemeral:
            import tempfile

            temporary = tempfile.TemporaryDirectory(prefix="fedlang-edge-")
            db = str(pathlib.Path(temporary.name) / "edge.db")
        try:  # (a pace, limits or sizes that cannot be kept: ValueError)
            sizes = {"max_blob_bytes": parse_size(max_blob_bytes, "--max-blob-bytes"),
                     "max_report_bytes": parse_size(max_report_bytes, "--max-report-bytes"),
                     "stream_report_bytes": parse_size(stream_report_bytes,
                                                       "--stream-report-bytes")}
            options: dict[str, Any] = dict(
                pace=store_lib.Pace(checkins_per_second, min_retry, max_retry),
                credential_ttl=credential_ttl, ssl_keyfile=ssl_keyfile,
                ssl_certfile=ssl_certfile, browser=browser, demo_page=demo_page,
                limits=server_lib.Limits(header_timeout, body_timeout, keep_alive,
                                         max_connections, client_rate, client_burst,
                                         enroll_rate, enroll_burst, **sizes,
                                         max_connections_per_address=max_connections_per_address,
                                         max_unfinished_per_address=max_unfinished_per_address,
                                         body_min_rate=body_min_rate,
                                         body_rate_window=body_rate_window,
                                         admin_rate=admin_rate, admin_burst=admin_burst),
                # the defaults keep uvicorn's own logging, as before --log-format
                log_format=None if (log_format, log_level) == ("text", "warning") else log_format,
                log_level=log_level.lower(), forwarded_allow_ips=forwarded_allow_ips,
            )
            server = server_lib.Server(  # with --workers: binds the port, sets up the database
                db, host, port, admin_token, key_file, **options,
                metrics_port=metrics_port if workers is None else None,
            )
        except (OSError, ValueError, ImportError, server_lib.DatabaseInUse) as e:
            console.fail(e)
        _announce(server, db, admin_token, demo_page)
        running: Any = server
        if upstream is not None:
            running = _edge(server, upstream, upstream_token or "", upstream_key)
            population = [p for p in population or [] if p != running.population]
        _create_populations(server, population or [], demo_page)
        if workers is not None:  # the workers read the token's hash and the key the parent set
            from fedlang.deploy.server import workers as workers_lib

            running = workers_lib.Workers(server, workers, {
                **options, "db": db, "key": key_file, "metrics_port": metrics_port})
        made.append(running)
        if stopped:  # before `made` had it
            running.request_stop()
        try:
            running.serve()  # returns at once if asked to stop
        except RuntimeError as e:  # with --workers: one ended before it served (WorkerFailed)
            if workers is None:
                raise
            console.fail(e)
        finally:
            if temporary is not None:
                temporary.cleanup()
        if stopped:
            _say_stopped(stopped[0], db, ephemeral, log_format)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str, flag: str) -> int:
    """Bytes from a size as a user writes it: `1048576`, `512K`, `1500M`, `4G`, `4GiB`
    (binary units; a trailing `B` or `iB` is allowed).

    Raises:
      ValueError: naming `flag` and what was found.
    """
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    number, unit = (t[:-1], t[-1]) if t[-1:] in ("K", "M", "G", "T") else (t, "")
    try:
        value = float(number)
    except ValueError:
        value = -1.0
    if not value >= 0 or not number:
        raise ValueError(f"Expected {flag} as a size in bytes such as 4G, 1500M or 1048576, "
                         f"found {text!r}.")
    return int(value * _UNITS[unit])


def _check_roles(upstream: str | None, upstream_token: str | None, ephemeral: bool,
                 workers: int | None, db: str, metrics_port: int | None) -> None:
    """Refuses (status 2) options of `serve` that do not go together: an edge's, and
    --workers' (PostgreSQL only, no edge, no --metrics-port)."""
    if (upstream is None) != (upstream_token is None):
        console.fail("Expected --upstream URL and --upstream-token TOKEN together (an edge "
                     "aggregator), found only one; give both, or neither.", 2)
    if ephemeral and upstream is None:
        console.fail("Expected --upstream URL with --ephemeral (an edge aggregator), found "
                     "none; give the root's URL and --upstream-token.", 2)
    if workers is not None:
        from fedlang.deploy.server import workers as workers_lib

        try:
            workers_lib.check(db, workers, metrics_port=metrics_port, upstream=upstream)
        except ValueError as e:
            console.fail(e, 2)


@contextlib.contextmanager
def _signals() -> Iterator[tuple[list[int], list[Any]]]:
    """Ctrl-C and SIGTERM noted from the start (imports take seconds): each asks what was
    made (the second list, filled by the caller) to stop; the first list holds the
    signals seen. While a server serves, uvicorn takes them, and raises them again once
    it stops. The handlers are put back as they were on the way out (a command run
    in-process, e.g. by a test, leaves no trace)."""
    stopped: list[int] = []
    made: list[Any] = []

    def note(signum: int, frame: Any) -> None:
        stopped.append(signum)
        for s in made:
            s.request_stop()

    previous = {signum: signal.signal(signum, note) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopped, made
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _announce(server: Any, db: str, admin_token: str | None, demo_page: bool) -> None:
    """What a starting server says: where it is, its dashboard, its admin token (a new
    one shown only now), its public key, where its metrics are."""
    print(f"fedlang task store at {server.url} (database {db})", flush=True)
    _print_dashboard(server.url)
    if demo_page:
        print(f"demo page: {server.url}/demo/", flush=True)
    if server.admin_token is not None and admin_token is None:
        print(f"admin token: {server.admin_token} (new: shown only now; the database keeps "
              "its hash)", flush=True)
    elif admin_token is None:
        print("admin token: the one set before (the database keeps only its hash; "
              "--admin-token sets another)", flush=True)
    else:
        print("admin token: the one given (--admin-token or FEDLANG_ADMIN_TOKEN)", flush=True)
    print(f"public key: {base64.b64encode(server.public_key).decode()}", flush=True)
    if server.metrics_url is not None:
        print(f"metrics: {server.metrics_url} (no token; loopback only)", flush=True)


def _create_populations(server: Any, names: list[str], demo_page: bool) -> None:
    """Creates each population of `--population` that is new, printing its token."""
    from fedlang.deploy import protocol

    for name in names:
        try:
            token = server.store.create_population(name)
            print(f"population {name} token: {token}", flush=True)
            if demo_page:
                print(f"  train in a browser: {server.url}/demo/#population={name}&token={token}",
                      flush=True)
        except protocol.Conflict:
            print(f"population {name} exists (its token was printed when it was made)", flush=True)


def _say_stopped(signum: int, db: str, ephemeral: bool, log_format: str) -> NoReturn:
    """Ends `serve` stopped by a signal, saying what was kept."""
    if ephemeral:
        what = ("the ephemeral edge stopped and its store is removed: the root counts "
                "its clients as dropouts of the rounds it held")
    else:
        what = (f"the server stopped; every report it acknowledged is kept in "
                f"{_database(db)} (the same command serves it again); clients retry "
                "until it is back, for their --patience")
    if log_format == "json":  # the last line too is one JSON object
        logging.getLogger("fedlang.deploy.server").warning("%s.", what)
        raise typer.Exit(128 + signum)
    _stopped(signum, what)


def _print_dashboard(url: str) -> None:
    from fedlang.deploy.server import dashboard

    lacking = dashboard.missing()
    print(f"dashboard: {url}{dashboard.PATH} (log in with the admin token)"
          + (f"; without charts: uPlot's files {lacking} are missing (python -m "
             "fedlang.deploy.assets)" if lacking else ""), flush=True)


def _edge(server: Any, upstream: str, token: str, key: str | None) -> Any:
    """The edge aggregator serving `server`'s clients for the root at `upstream`, after
    its first contact; prints its population's token when made now."""
    from fedlang.deploy import protocol
    from fedlang.deploy.edge import sync as edge_lib
    try:  # the root unreachable (ServerUnavailable is an OSError), the token refused, a bad key
        pinned = None if key is None else base64.b64decode(key, validate=True)
        edge = edge_lib.Edge(server, upstream, token, upstream_key=pinned)
        name = edge.connect()
    except (ValueError, OSError, RuntimeError, protocol.ProtocolError) as e:
        server.close()
        console.fail(f"Expected the root at {upstream} to take this edge, found: {e}")
    print(f"edge aggregator of {edge.link.url}, population {name}", flush=True)
    token_made = edge.create_population()
    if token_made is not None:
        print(f"population {name} token: {token_made}", flush=True)
    else:
        print(f"population {name} exists (its token was printed when it was made)", flush=True)
    return edge


def _stopped(signum: int, what: str) -> NoReturn:
    """Ends a command stopped by a signal: status 128 + the signal's number, as shells
    report it (130 for Ctrl-C, 143 for SIGTERM), and one line saying what was kept."""
    label = "Interrupted" if signum == signal.SIGINT else "Terminated"
    console.fail(f"{what}.", 128 + signum, label=label)


def _check_directory(db: str) -> None:
    """Refuses (status 1) an SQLite `--db` in a directory that does not exist: a typo
    there would start a second, empty deployment with a new admin token."""
    path = db.removeprefix("sqlite:///")
    if "://" in path:
        return  # postgresql://... (a server's database), or a URL the store refuses
    parent = pathlib.Path(path).parent
    if path == ":memory:" or parent.is_dir():
        return
    if parent.exists():
        console.fail(f"Expected the directory of --db {db} to be a directory, found {parent} "
                     "a file; give --db a file in a directory.")
    console.fail(f"Expected the directory {parent} of --db {db} to exist, found none; create "
                 f"it first (mkdir -p {parent}), or give --db a file in a directory that "
                 "exists.")


def _database(db: str) -> str:
    """The database a `--db` names, as said to a user: an SQLite file, or a PostgreSQL
    URL without its password."""
    if db.startswith(("postgresql://", "postgres://")):
        parts = urllib.parse.urlsplit(db)
        if parts.password is not None:
            netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
            db = urllib.parse.urlunsplit(parts._replace(netloc=netloc))
        return f"the PostgreSQL database {db}"
    return f"the SQLite database {pathlib.Path(db.removeprefix('sqlite:///')).resolve()}"


def _data_value(path: str, batch_size: int) -> Any:
    """A `--data` path as the client's dataset; checked now, before the client enrolls."""
    from fedlang.deploy.client import data as data_lib

    p = pathlib.Path(path)
    if not p.exists():
        raise FileNotFoundError(
            f"Expected client data at {p} (an .npz file of arrays or a store directory of one "
            f"client), found nothing there (in {pathlib.Path.cwd()}); check the path."
        )
    if p.is_dir():  # a store of one client
        from fedlang.simulation import store

        opened = store.open_store(p)
        ids = opened.client_ids
        if len(ids) != 1:
            raise ValueError(
                f"Expected a store of one client at {p}, found {len(ids)} clients; write each "
                "client's data to its own store (or .npz file)."
            )
        return opened.read_client(ids[0]).batch(batch_size)
    if p.suffix != ".npz":
        raise ValueError(
            f"Expected client data as an .npz file of arrays (e.g. x and y) or a store "
            f"directory of one client, found {p}; convert it with numpy.savez (arrays) or "
            "`fedlang data convert` (a store)."
        )
    return data_lib.NpzDataset(p, batch_size)  # checks the file's arrays


def client(
    server: Annotated[str, typer.Option(metavar="URL", help="The server's URL.")],
    population: Annotated[str, typer.Option(metavar="NAME", help="The population to enroll in.")],
    data: Annotated[list[str], typer.Option(
        metavar="NAME=PATH", help="NAME=PATH: a dataset by name, an .npz file of arrays (e.g. x, y) or a store "
             "directory of one client (repeatable).")],
    token: Annotated[str | None, typer.Option(envvar="FEDLANG_TOKEN", metavar="TOKEN",
                                              help="The population's enrollment token.")] = None,
    batch_size: Annotated[int, typer.Option(metavar="N", help="Rows per batch.")] = 20,
    credential_file: Annotated[pathlib.Path | None, typer.Option(
        metavar="PATH", help="Keep the credential and the pinned server key here between runs.")] = None,
    max_tasks: Annotated[int | None, typer.Option(metavar="N", help="Stop after this many reports.")] = None,
    patience: Annotated[float, typer.Option(metavar="SECONDS", help="Seconds to retry an unreachable server.")]
    = 300.0,
    verbose: Annotated[bool, typer.Option(help="Log each step.")] = True,
    state_dir: Annotated[pathlib.Path | None, typer.Option(
        metavar="DIR", help="Keep this device's client states here (tasks with client state "
                            "need it; the states never leave the device).")] = None,
) -> None:
    """Run a client: check in, run tasks on local data, upload reports (connects out only).

    Every --data path is checked before the client enrolls. Ctrl-C or SIGTERM stops it
    after the task in progress (a second one: at once), with exit status 130 or 143.
    """
    from fedlang.core import status as status_lib
    from fedlang.deploy import protocol
    from fedlang.deploy.client import client as client_lib
    from fedlang.deploy.client import connection as http

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per task is enough
    named = {}
    for item in data:  # all of them, before anything connects
        name, sep, path = item.partition("=")
        try:
            if not sep or not name.isidentifier() or not path:
                raise ValueError(f"Expected --data NAME=PATH (e.g. train=client.npz), found {item!r}.")
            named[name] = _data_value(path, batch_size)
        except (OSError, ValueError) as e:  # a store's StoreError is a ValueError
            console.fail(e, 1, "" if not sep else f"(--data {item})")
    kept = (f"its credential is kept in {credential_file} (the same command rejoins as the "
            "same client)" if credential_file is not None else
            "it kept nothing (run again, it enrolls as a new client; --credential-file F "
            "keeps its credential)")

    def stop_now() -> None:
        """A second Ctrl-C: exit at once (raising inside JAX can crash or hang)."""
        signum = interrupts.signum or signal.SIGINT
        label = "Interrupted" if signum == signal.SIGINT else "Terminated"
        os.write(2, f"\n{label}: the client stopped at once (the server counts its task in "
                    f"progress as a dropout); {kept}.\n".encode())
        os._exit(128 + signum)

    try:
        with client_lib.Client(
            server, population, token, named, batch_size=batch_size,
            credential_file=credential_file, max_tasks=max_tasks, patience=patience,
            state_dir=state_dir,
        ) as c, status_lib.defer_interrupts(
            "stopping after the task in progress (Ctrl-C again to stop now)", stop_now,
            on_request=c.stop, sigterm=True,
        ) as interrupts:
            done = c.run()
    except (protocol.ProtocolError, http.ServerUnavailable, OSError, ValueError, KeyError) as e:
        console.fail(e)
    if interrupts.requested() and interrupts.signum is not None:
        _stopped(interrupts.signum, f"the client stopped after {done} tasks; {kept}")
    console.out.print(f"{done} tasks done.")


def status(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    patience: Annotated[float, typer.Option(metavar="SECONDS", help="Seconds to retry an unreachable server.")]
    = 5.0,
    as_json: Annotated[bool, typer.Option("--json/--tables", help="Print the status as JSON.")]
    = False,
) -> None:
    """Print a server's status: rounds, check-ins, reports accepted and refused, dropouts.

    Written to a file or a pipe, the tables keep their full width (nothing is cut to the
    80 columns of no terminal); --json prints the server's answer as it is.
    """
    from fedlang.deploy.client import connection as http

    try:
        connection = http.Connection(url, patience=patience)
        doc = connection.json("GET", "/v1/status")
        connection.close()
    except (http.ServerUnavailable, http.ServerError, ValueError) as e:
        console.fail(e)
    if as_json:
        print(json.dumps(doc, indent=2))
    elif console.out.is_terminal:
        console.out.print(status_tables(doc))
    else:  # a file or a pipe: as wide as the tables need, not 80 columns
        Console(width=1000).print(status_tables(doc), crop=False)


def status_tables(doc: dict[str, Any]) -> Table:
    """The status as one table of counters and one of the latest rounds."""
    outer = Table.grid(padding=(1, 0))
    counts = Table(title="Task store", box=box.SIMPLE_HEAVY, show_header=False)
    counts.add_column("what")
    counts.add_column("count", justify="right")
    reports = doc["reports"]

    def by_reason(counts: dict[str, int]) -> str:  # "3 (late 1, stale 2)"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"
        return f"{sum(counts.values())} ({reasons})"

    rows = [
        ("populations", ", ".join(f"{p['name']} ({p['clients']} clients)"
                                  for p in doc["populations"]) or "none"),
        ("enrollments", doc["enrollments"]),
        ("check-ins", doc["checkins"]),
        ("reports accepted", reports["accepted"]),
        ("reports and client requests refused", by_reason(reports["refused"])),
        # absent from an older server's status
        ("admin requests refused", by_reason(doc.get("admin_refused", {}))),
        # absent from an older server's status: no row then
        *([("connections refused", by_reason(doc["connections_refused"]))]
          if "connections_refused" in doc else []),
        ("late reports", reports["late"]),
        ("dropouts", doc["dropouts"]),
        ("rounds closed / failed", f"{doc['rounds_closed']} / {doc['rounds_failed']}"),
    ]
    for name, value in rows:
        counts.add_row(name, escape(str(value)))
    rounds = Table(title="Latest rounds", box=box.SIMPLE_HEAVY)
    for col in ("round", "population", "state", "reports", "target", "quorum", "assigned",
                "late", "dropped", "refused", "seconds"):
        rounds.add_column(col, justify="left" if col in ("population", "state") else "right")
    for r in doc["rounds"]:
        seconds = (r["closed"] - r["created"]) if r["closed"] else None
        state = r["state"] + (f" (secure, stage {r['stage']})" if r.get("stage") else "")
        rounds.add_row(
            str(r["id"]), escape(r["population"]), state, str(r["reports"]), str(r["target"]),
            str(r["quorum"]), str(r["assigned"]), str(r["late"]), str(r["dropped"]),
            str(r["refused"]), "" if seconds is None else f"{seconds:.1f}",
        )
    outer.add_row(counts)
    outer.add_row(rounds)
    if doc.get("sessions"):
        outer.add_row(session_table(doc["sessions"]))
    return outer


def session_table(sessions: list[dict[str, Any]]) -> Table:
    """The buffered (FedBuff) sessions: version, buffer fill n/K, staleness histogram
    of accepted reports (staleness: count), refused stale reports."""
    table = Table(title="Buffered sessions", box=box.SIMPLE_HEAVY)
    for col in ("session", "population", "state", "version", "buffer", "accepted",
                "refused stale", "max staleness", "staleness histogram"):
        table.add_column(col, justify="left" if col in ("population", "state") else "right")
    for s in sessions:
        histogram = ", ".join(f"{t}: {n}" for t, n in s["staleness_histogram"].items())
        table.add_row(
            str(s["id"]), escape(s["population"]), s["state"], str(s["version"]),
            f"{s['buffer_fill']}/{s['buffer_size']}", str(s["accepted"]),
            str(s["refused_stale"]), str(s["max_staleness"]), histogram or "none",
        )
    return table


AdminToken = Annotated[str, typer.Option(
    envvar="FEDLANG_ADMIN_TOKEN", metavar="TOKEN", help="The server's admin token.")]


def _admin_call(url: str, admin_token: str, call: Any) -> Any:
    """`call(admin)` on the server at `url`; a refusal or an unreachable server fails
    the command with the server's sentence."""
    from fedlang.deploy import protocol
    from fedlang.deploy.client import connection as http
    from fedlang.deploy.driver import admin as admin_lib

    try:
        with admin_lib.Admin(url, admin_token, patience=5.0) as admin:
            return call(admin)
    except (protocol.ProtocolError, http.ServerUnavailable, http.ServerError, ValueError) as e:
        console.fail(e)


def revoke(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    client_id: Annotated[str, typer.Argument(metavar="CLIENT", help="The client's id (c-...).")],
    admin_token: AdminToken,
) -> None:
    """Revoke a client: its credential stops working at once (rotate its population's
    token too if the device still holds it)."""
    population = _admin_call(url, admin_token, lambda a: a.revoke_client(client_id))
    console.out.print(f"revoked client {escape(client_id)} of population {escape(population)}")


def rotate_token(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    population: Annotated[str, typer.Argument(metavar="POPULATION", help="The population.")],
    admin_token: AdminToken,
    max_enrollments: Annotated[int | None, typer.Option(
        min=1, metavar="N", help="How many clients the new token may enroll (default: any).")]
    = None,
) -> None:
    """Print a new enrollment token for a population; the old one stops enrolling."""
    token = _admin_call(url, admin_token, lambda a: a.rotate_token(population, max_enrollments))
    console.out.print(f"enrollment token for {escape(population)}: {token}")


def device_tokens(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    population: Annotated[str, typer.Argument(metavar="POPULATION", help="The population.")],
    admin_token: AdminToken,
    count: Annotated[int, typer.Option(min=1, max=1000, metavar="N", help="How many.")] = 1,
) -> None:
    """Print single-use enrollment tokens for a population, one a line (one per device)."""
    for token in _admin_call(url, admin_token, lambda a: a.device_tokens(population, count)):
        console.out.print(token, soft_wrap=True)


def enroll_bulk(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    population: Annotated[str, typer.Argument(metavar="POPULATION", help="The population.")],
    count: Annotated[int, typer.Argument(min=1, metavar="N", help="How many clients.")],
    admin_token: AdminToken,
    out: Annotated[pathlib.Path, typer.Option(
        metavar="FILE", help="A new file for the credentials (NDJSON, readable by you only).")],
) -> None:
    """Enroll N clients of a population at once and write their credentials to a new file
    (shown once: the server keeps only their hashes)."""
    try:
        fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        console.fail(f"Expected --out to name a new file (credentials are never "
                     f"overwritten), found {out}: {e.strerror}; pick another name.")
    with os.fdopen(fd, "wb") as f:
        try:
            done = _admin_call(url, admin_token, lambda a: a.enroll_bulk(population, count, f))
        except typer.Exit:
            if f.tell() == 0:  # nothing enrolled: no file left behind (a partial one is kept)
                out.unlink()
            raise
    console.out.print(f"enrolled {done} clients of {escape(population)}; their credentials "
                      f"are in {escape(str(out))}")


def register(app: typer.Typer) -> None:
    """Adds `fedlang serve`, `client`, `status`, `revoke`, `rotate-token`,
    `device-tokens` and `enroll-bulk` to the `fedlang` app."""
    app.command()(serve)
    app.command()(client)
    app.command()(status)
    app.command()(revoke)
    app.command("rotate-token")(rotate_token)
    app.command("device-tokens")(device_tokens)
    app.command("enroll-bulk")(enroll_bulk)

