"""What an operator does from the command line (Flower users have `flwr ls`, `flwr log`,
`flwr stop`): `fedlang populations`, `fedlang rounds`, `fedlang sessions` (listings from
the server's overview, `GET /v1/admin/overview`; `--json` on each), `fedlang follow`
(a round's progress, live, until it ends), `fedlang stop-round` and `fedlang
stop-session`. (`fedlang revoke` is in `deploy`.)

Written to a file or a pipe, the tables keep their full width, as `fedlang status`'s.
Each needs the server's admin token (`--admin-token` or FEDLANG_ADMIN_TOKEN). httpx and
rich's progress are imported only when a command runs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any

import typer
from rich import box
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from fedlang.cli import console
from fedlang.cli import deploy as deploy_cli

Url = Annotated[str, typer.Argument(metavar="URL", help="The server's URL.")]
AsJson = Annotated[bool, typer.Option("--json/--tables", help="Print the server's answer as JSON.")]
Limit = Annotated[int, typer.Option(min=1, max=1000, metavar="N", help="How many of the latest to list.")]


def _show(table: Table) -> None:
    """A table on stdout: as wide as the terminal, or as wide as it needs in a file."""
    if console.out.is_terminal:
        console.out.print(table)
    else:  # a file or a pipe: as wide as the table needs, not 80 columns
        Console(width=1000).print(table, crop=False)


def _overview(url: str, admin_token: str, rounds: int = 20, sessions: int = 10) -> dict[str, Any]:
    return deploy_cli._admin_call(url, admin_token, lambda a: a.overview(rounds, sessions))


def _refused(by_reason: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(by_reason.items())) or "none"


def _seconds(s: float) -> str:
    return f"{s:.1f}" if s < 120 else f"{s / 60:.1f} min"


def populations(url: Url, admin_token: deploy_cli.AdminToken, as_json: AsJson = False) -> None:
    """List the populations: clients enrolled, and those seen in the last hour."""
    doc = _overview(url, admin_token, 1, 1)["populations"]
    if as_json:
        print(json.dumps(doc, indent=2))
        return
    table = Table(title="Populations", box=box.SIMPLE_HEAVY)
    for col in ("population", "enrolled", "seen last hour", "finished"):
        table.add_column(col, justify="left" if col == "population" else "right")
    for p in doc:
        table.add_row(escape(p["name"]), str(p["enrolled"]), str(p["seen_last_hour"]),
                      "yes" if p["finished"] else "no")
    _show(table)


def rounds_table(rows: list[dict[str, Any]]) -> Table:
    """The rounds: progress, dropouts, late and refused reports by reason, duration."""
    table = Table(title="Rounds", box=box.SIMPLE_HEAVY)
    for col in ("round", "population", "state", "reports", "assigned", "dropouts", "late",
                "refused", "seconds"):
        table.add_column(col, justify="left" if col in ("population", "state", "refused") else "right")
    for r in rows:
        state = r["state"] + (f" (secure, stage {r['stage']})" if r["stage"] else "")
        table.add_row(
            str(r["id"]), escape(r["population"]), state, f"{r['reports']}/{r['target']}",
            str(r["assigned"]), str(r["dropouts"]), str(r["late"]),
            escape(_refused(r["refused_by_reason"])), _seconds(r["duration"]),
        )
    return table


def rounds(
    url: Url, admin_token: deploy_cli.AdminToken,
    population: Annotated[str | None, typer.Option(metavar="NAME", help="Only this population's rounds.")] = None,
    limit: Limit = 20,
    as_json: AsJson = False,
    follow_round: Annotated[int | None, typer.Option(
        "--follow", min=1, metavar="ROUND", help="Follow this round live instead (as `fedlang follow`).")]
    = None,
) -> None:
    """List the latest rounds, newest first: reports of the target, dropouts, late and
    refused reports (by reason), seconds taken."""
    if follow_round is not None:
        follow(url, follow_round, admin_token)
        return
    rows = _overview(url, admin_token, limit, 1)["rounds"]
    rows = [r for r in rows if population is None or r["population"] == population]
    if as_json:
        print(json.dumps(rows, indent=2))
    else:
        _show(rounds_table(rows))


def sessions(
    url: Url, admin_token: deploy_cli.AdminToken, limit: Limit = 10, as_json: AsJson = False
) -> None:
    """List the latest buffered (FedBuff) sessions: version, buffer fill, reports
    accepted and refused (by reason)."""
    rows = _overview(url, admin_token, 1, limit)["sessions"]
    if as_json:
        print(json.dumps(rows, indent=2))
        return
    table = Table(title="Buffered sessions", box=box.SIMPLE_HEAVY)
    for col in ("session", "population", "state", "version", "buffer", "accepted", "refused",
                "seconds"):
        table.add_column(col, justify="left" if col in ("population", "state", "refused") else "right")
    for s in rows:
        table.add_row(
            str(s["id"]), escape(s["population"]), s["state"], str(s["version"]),
            f"{s['buffer_fill']}/{s['buffer_size']}", str(s["accepted"]),
            escape(_refused(s["refused_by_reason"])), _seconds(s["duration"]),
        )
    _show(table)


def _line(r: dict[str, Any]) -> str:
    stage = f", secure stage {r['stage']}" if r.get("stage") else ""
    return (f"round {r['id']} {r['state']}{stage}: {r['reports']}/{r['target']} reports, "
            f"{r['assigned']} assigned, {r['dropped']} dropped, {r['late']} late, "
            f"{r['refused']} refused")


def follow(
    url: Url,
    round_id: Annotated[int, typer.Argument(metavar="ROUND", min=1, help="The round's id.")],
    admin_token: deploy_cli.AdminToken,
) -> None:
    """Follow a round until it ends: a progress bar in a terminal, a line per change
    otherwise. Exits 0 when the round closes, 1 when it fails, 130 on Ctrl-C (the
    round goes on)."""
    from fedlang.deploy import protocol
    from fedlang.deploy.client import connection as http
    from fedlang.deploy.driver import admin as admin_lib

    try:
        with admin_lib.Admin(url, admin_token, patience=30.0) as admin:
            r = admin.round(round_id)
            if console.out.is_terminal:
                r = _follow_bar(admin, r)
            else:
                print(_line(r), flush=True)
                while r["state"] == protocol.RoundState.OPEN:
                    before = r
                    r = admin.round(round_id, wait=10.0, seen=r["reports"])
                    if _line(r) != _line(before):
                        print(_line(r), flush=True)
    except KeyboardInterrupt:
        console.fail(f"stopped following round {round_id}; the round goes on", 130,
                     label="Interrupted")
    except (protocol.ProtocolError, http.ServerUnavailable, http.ServerError, ValueError) as e:
        console.fail(e)
    if r["state"] != protocol.RoundState.CLOSED:
        console.fail(r["failure"] or f"round {round_id} {r['state']}", 1, label="Failed")
    console.out.print(f"round {round_id} closed with {r['reports']} reports in "
                      f"{_seconds(r['closed'] - r['created'])} s", highlight=False)


def follow_columns(target: int) -> tuple[Any, ...]:
    """The columns of `fedlang follow`'s bar: the round's line, cut (…) to what the
    others leave of the terminal's width, a bar, reports/target and the elapsed time,
    which is never cut (rich gave the line every column it wanted)."""
    from rich import progress
    from rich.table import Column

    bar_width, elapsed_width = 10, 8  # H:MM:SS, and 10 hours or more
    counts = 2 * len(str(target)) + 1  # "12/20"
    others = bar_width + counts + elapsed_width + 3  # and a space between columns

    class Line(progress.TextColumn):
        def get_table_column(self) -> Column:  # asked at each refresh: follows a resize
            return Column(no_wrap=True, overflow="ellipsis",
                          max_width=max(8, console.out.width - others))

    return (Line("{task.description}"), progress.BarColumn(bar_width=bar_width),
            progress.MofNCompleteColumn(table_column=Column(no_wrap=True, min_width=counts)),
            progress.TimeElapsedColumn(table_column=Column(no_wrap=True, min_width=elapsed_width,
                                                           justify="right")))


def _follow_bar(admin: Any, r: dict[str, Any]) -> dict[str, Any]:
    from rich import progress

    columns = follow_columns(r["target"])
    with progress.Progress(*columns, console=console.out, transient=False) as bar:
        task = bar.add_task(_line(r), total=r["target"], completed=r["reports"])
        while r["state"] == "open":
            r = admin.round(r["id"], wait=10.0, seen=r["reports"])
            bar.update(task, description=_line(r), completed=r["reports"])
    return r


def stop_round(
    url: Url,
    round_id: Annotated[int, typer.Argument(metavar="ROUND", min=1, help="The round's id.")],
    admin_token: deploy_cli.AdminToken,
) -> None:
    """Stop an open round now: it fails (its driver is told), its clients still
    assigned count as dropped, later reports are refused."""
    r = deploy_cli._admin_call(url, admin_token, lambda a: a.stop_round(round_id))
    console.out.print(f"round {round_id} {r['state']}: {r['reports']}/{r['target']} reports, "
                      f"{r['dropped']} dropped", highlight=False)


def stop_session(
    url: Url,
    session_id: Annotated[int, typer.Argument(metavar="SESSION", min=1, help="The session's id.")],
    admin_token: deploy_cli.AdminToken,
) -> None:
    """Close a buffered session: its clients get no more tasks, later reports are
    refused."""
    s = deploy_cli._admin_call(url, admin_token, lambda a: a.close_session(session_id))
    console.out.print(f"session {session_id} {s['state']} at version {s['version']} with "
                      f"{s['reports']} reports", highlight=False)


def register(app: typer.Typer) -> None:
    """Adds `fedlang populations`, `rounds`, `sessions`, `follow`, `stop-round` and
    `stop-session` to the `fedlang` app."""
    app.command()(populations)
    app.command()(rounds)
    app.command()(sessions)
    app.command()(follow)
    app.command("stop-round")(stop_round)
    app.command("stop-session")(stop_session)

