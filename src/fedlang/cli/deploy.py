"""`fedlang serve`, `fedlang client` and `fedlang status URL`: the deployment's commands.

FastAPI, uvicorn and httpx (`pip install 'fedlang[deploy]'`) are imported only when a
command runs.
"""

from __future__ import annotations

import base64
import logging
import pathlib
import signal
from typing import Annotated, Any

import typer
from rich import box
from rich.markup import escape
from rich.table import Table

from fedlang.cli import console


def serve(
    db: Annotated[str, typer.Option(metavar="URL", help="sqlite:///PATH, a file path, or postgresql://...")]
    = "fedlang.db",
    host: Annotated[str, typer.Option(metavar="ADDRESS", help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(metavar="N", help="Port (0: any free port).")] = 8000,
    admin_token: Annotated[str | None, typer.Option(
        envvar="FEDLANG_ADMIN_TOKEN", metavar="TOKEN", help="The admin token (default: kept in the database).")]
    = None,
    key_file: Annotated[pathlib.Path | None, typer.Option(
        metavar="PATH", help="The plan-signing key file (made if missing; default: kept in the database).")]
    = None,
    population: Annotated[list[str] | None, typer.Option(
        metavar="NAME", help="Create this population if it is new and print its enrollment token (repeatable).")]
    = None,
    min_retry: Annotated[float, typer.Option(metavar="SECONDS", help="Shortest wait between client check-ins.")]
    = 1.0,
    credential_ttl: Annotated[float, typer.Option(metavar="SECONDS", help="Seconds a client credential lasts.")]
    = 30 * 86400,
    ssl_keyfile: Annotated[str | None, typer.Option(metavar="PATH", help="TLS private key (PEM).")] = None,
    ssl_certfile: Annotated[str | None, typer.Option(metavar="PATH", help="TLS certificate (PEM).")] = None,
    browser: Annotated[bool, typer.Option(
        help="Serve the browser client at /browser/fedlang.js (with onnxruntime-web).")] = False,
    demo_page: Annotated[bool, typer.Option(
        help="Serve a demo page at /demo/ that trains in the browser (implies --browser).")]
    = False,
) -> None:
    """Serve a task store: clients check in for tasks; the driver opens rounds."""
    from fedlang.deploy import protocol
    from fedlang.deploy.server import serve as server_lib
    from fedlang.deploy.store import store as store_lib

    try:
        server = server_lib.Server(
            db, host, port, admin_token, key_file, pace=store_lib.Pace(min_retry=min_retry),
            credential_ttl=credential_ttl, ssl_keyfile=ssl_keyfile, ssl_certfile=ssl_certfile,
            browser=browser, demo_page=demo_page,
        )
    except (OSError, ValueError, ImportError) as e:
        console.fail(e)
    print(f"fedlang task store at {server.url} (database {db})", flush=True)
    if demo_page:
        print(f"demo page: {server.url}/demo/", flush=True)
    print(f"admin token: {server.admin_token}", flush=True)
    print(f"public key: {base64.b64encode(server.public_key).decode()}", flush=True)
    for name in population or []:
        try:
            token = server.store.create_population(name)
            print(f"population {name} token: {token}", flush=True)
            if demo_page:
                print(f"  train in a browser: {server.url}/demo/#population={name}&token={token}",
                      flush=True)
        except protocol.Conflict:
            print(f"population {name} exists (its token was printed when it was made)", flush=True)
    # SIGTERM stops the server like Ctrl-C (uvicorn handles both in the main thread).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    server.serve()


def _data_value(path: str, batch_size: int) -> Any:
    p = pathlib.Path(path)
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
    return str(p)


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
    """Run a client: check in, run tasks on local data, upload reports (connects out only)."""
    from fedlang.deploy import protocol
    from fedlang.deploy.client import client as client_lib
    from fedlang.deploy.client import connection as http

    logging.basicConfig(level=logging.INFO if verbose else logging.WARNING,
                        format="%(asctime)s %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per task is enough
    try:
        named = {}
        for item in data:
            name, sep, path = item.partition("=")
            if not sep or not name.isidentifier() or not path:
                raise ValueError(f"Expected --data NAME=PATH (e.g. train=client.npz), found {item!r}.")
            named[name] = _data_value(path, batch_size)
        with client_lib.Client(
            server, population, token, named, batch_size=batch_size,
            credential_file=credential_file, max_tasks=max_tasks, patience=patience,
            state_dir=state_dir,
        ) as c:
            done = c.run()
    except (protocol.ProtocolError, http.ServerUnavailable, OSError, ValueError, KeyError) as e:
        console.fail(e)
    console.out.print(f"{done} tasks done.")


def status(
    url: Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")],
    patience: Annotated[float, typer.Option(metavar="SECONDS", help="Seconds to retry an unreachable server.")]
    = 5.0,
) -> None:
    """Print a server's status: rounds, check-ins, reports accepted and refused, dropouts."""
    from fedlang.deploy.client import connection as http

    try:
        connection = http.Connection(url, patience=patience)
        doc = connection.json("GET", "/v1/status")
        connection.close()
    except (http.ServerUnavailable, http.ServerError, ValueError) as e:
        console.fail(e)
    console.out.print(status_tables(doc))


def status_tables(doc: dict[str, Any]) -> Table:
    """The status as one table of counters and one of the latest rounds."""
    outer = Table.grid(padding=(1, 0))
    counts = Table(title="Task store", box=box.SIMPLE_HEAVY, show_header=False)
    counts.add_column("what")
    counts.add_column("count", justify="right")
    reports = doc["reports"]
    refused = ", ".join(f"{k} {v}" for k, v in sorted(reports["refused"].items())) or "none"
    rows = [
        ("populations", ", ".join(f"{p['name']} ({p['clients']} clients)"
                                  for p in doc["populations"]) or "none"),
        ("enrollments", doc["enrollments"]),
        ("check-ins", doc["checkins"]),
        ("reports accepted", reports["accepted"]),
        ("reports refused", f"{sum(reports['refused'].values())} ({refused})"),
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


def register(app: typer.Typer) -> None:
    """Adds `fedlang serve`, `fedlang client` and `fedlang status` to the `fedlang` app."""
    app.command()(serve)
    app.command()(client)
    app.command()(status)

