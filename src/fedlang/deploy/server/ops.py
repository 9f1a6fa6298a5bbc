"""The operator's routes (admin token): released metrics, the overview the dashboard
and `fedlang rounds` read, stopping a round, and `/metrics` for Prometheus.

* `POST /v1/admin/populations/{name}/metrics`: the driver releases a round's metrics
  (`{"round": r, "metrics": {"train": {...}, "eval": {...}}}`; `store.metrics`).
* `GET /v1/admin/populations/{name}/metrics?since=`: the released metrics, by round, kind
  and name (those released after `since`, a time the previous answer showed).
* `GET /v1/admin/overview`: populations (enrolled, seen in the last hour), the latest
  rounds and buffered sessions with their progress and refusals by reason, the totals of
  `GET /v1/status`, and the check-in and report rates of the last hour, per minute.
* `POST /v1/admin/rounds/{id}/stop`: ends an open round now, as failed (its driver is
  told it was stopped). A session stops with `POST /v1/admin/sessions/{id}/close`.
* `GET /metrics`: Prometheus' text format (`telemetry`), with the admin token
  (`fedlang serve --metrics-port` also serves it without one, on loopback only).
"""

from __future__ import annotations

from typing import Annotated

import fastapi
from fastapi import responses

from fedlang.deploy import protocol
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import routing, schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import metrics as metrics_lib
from fedlang.deploy.store import rounds as rounds_lib

router = fastapi.APIRouter(prefix=protocol.API)
metrics_router = fastapi.APIRouter()  # `/metrics`, where Prometheus looks by default
PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"
HOUR = 3600.0


def overview(server: state_lib.ServerState, rounds: int = 20, sessions: int = 10) -> schemas.Overview:
    """What `GET /v1/admin/overview` answers (see the module docstring)."""
    now = server.store.clock()
    seen = metrics_lib.seen_since(server.store, now - HOUR)
    round_rows = server.rounds.rounds(rounds)
    session_rows = server.sessions.sessions(sessions)
    refused = metrics_lib.refusals(
        server.store,
        [f"round:{r.id}" for r in round_rows] + [f"session:{s.id}" for s in session_rows],
    )
    return schemas.Overview(
        now=now,
        populations=[
            schemas.OverviewPopulation(name=p["name"], enrolled=p["clients"],
                               seen_last_hour=seen.get(p["name"], 0), finished=p["finished"],
                               created=p["created"])
            for p in server.store.populations()
        ],
        rounds=[_round(r, refused[f"round:{r.id}"], now) for r in round_rows],
        sessions=[
            schemas.OverviewSession(
                **server.sessions.status(s), refused_by_reason=refused[f"session:{s.id}"],
                created=s.created, updated=s.updated,
                duration=(s.updated if s.state != "open" else now) - s.created,
            )
            for s in session_rows
        ],
        totals=state_lib.totals(server.store.counters()),
        rates=schemas.Rates(**server.telemetry.rate_series()),
    )


def _round(r: rounds_lib.Round, refused: dict[str, int], now: float) -> schemas.OverviewRound:
    return schemas.OverviewRound(
        id=r.id, population=r.population, kind=r.kind, state=r.state, stage=r.stage,
        reports=r.reports, target=r.target, quorum=r.quorum, assigned=r.assigned,
        dropouts=r.dropped, late=r.late, refused=r.refused, refused_by_reason=refused,
        created=r.created, closed=r.closed,
        duration=(r.closed if r.closed is not None else now) - r.created, failure=r.failure,
    )


@router.post("/admin/populations/{name}/metrics", status_code=201, tags=["admin"])
def release_metrics(
    name: routing.Population, body: schemas.MetricsIn, auth: auth_lib.Bearer, server: State
) -> schemas.MetricsStored:
    """Releases a round's metrics (replacing what was released for the same round, kind
    and name): what the dashboard plots over rounds."""
    auth_lib.admin(server, auth)
    try:
        return schemas.MetricsStored(stored=metrics_lib.release(server.store, name, body.round, body.metrics))
    except ValueError as e:
        raise protocol.BadRequest(str(e)) from e


@router.get("/admin/populations/{name}/metrics", tags=["admin"])
def released_metrics(
    name: routing.Population, auth: auth_lib.Bearer, server: State,
    since: Annotated[float | None, fastapi.Query(ge=0, le=1e12)] = None,
) -> schemas.ReleasedMetrics:
    """The population's released metrics by round, kind and name; with `since`, only
    those released after that time."""
    auth_lib.admin(server, auth)
    rows = metrics_lib.released(server.store, name, since)
    return schemas.ReleasedMetrics(population=name, metrics=[schemas.ReleasedMetric(**r) for r in rows])


@router.get("/admin/overview", tags=["admin"])
def admin_overview(
    auth: auth_lib.Bearer, server: State,
    rounds: Annotated[int, fastapi.Query(ge=1, le=1000)] = 20,
    sessions: Annotated[int, fastapi.Query(ge=1, le=1000)] = 10,
) -> schemas.Overview:
    """Populations, the latest `rounds` rounds and `sessions` buffered sessions with
    their progress, the server's totals, and the rates of the last hour."""
    auth_lib.admin(server, auth)
    return overview(server, rounds, sessions)


@router.post("/admin/rounds/{round_id}/stop", tags=["admin"])
def stop_round(
    round_id: routing.RoundId, auth: auth_lib.Bearer, server: State
) -> schemas.RoundOut:
    """Ends an open round now, as failed: its clients still assigned count as dropped,
    its later reports are refused, and its driver is told the operator stopped it."""
    auth_lib.admin(server, auth)
    failure = f"Round {round_id} was stopped by the operator (POST /v1/admin/rounds/{round_id}/stop)."
    r = server.rounds.round(round_id)
    if r.kind == rounds_lib.SECURE:
        server.secure.stop(round_id, failure)
    else:
        server.rounds.stop(round_id, failure)
    return schemas.RoundOut(**server.rounds.round(round_id).to_json())


@metrics_router.get("/metrics", tags=["status"], response_class=responses.Response,
                    responses={200: {"content": {PROMETHEUS: {"schema": {"type": "string"}}}}})
def prometheus_metrics(auth: auth_lib.Bearer, server: State) -> responses.Response:
    """The server's metrics in Prometheus' text format (the admin token: scrape with
    `authorization: {credentials: ...}`, or use `fedlang serve --metrics-port`)."""
    auth_lib.admin(server, auth)
    return responses.Response(server.telemetry.exposition(), media_type=PROMETHEUS)
