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

from typing import Annotated, Any

import fastapi
import pydantic
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


class MetricsIn(pydantic.BaseModel):
    round: Annotated[int, pydantic.Field(ge=0, le=2**62, description="The round (or a buffered session's version).")]
    metrics: Annotated[dict[str, Any], pydantic.Field(
        description="{kind: {name: number}} (kinds: train, eval, or any); deeper mappings "
        "are flattened into 'a/b' names. Finite numbers only.")]


class MetricsStored(pydantic.BaseModel):
    stored: int


class ReleasedMetric(pydantic.BaseModel):
    round: int
    kind: str
    name: str
    value: float
    released: float  # when (epoch seconds); pass the latest as `since` to get only newer


class ReleasedMetrics(pydantic.BaseModel):
    population: str
    metrics: list[ReleasedMetric]


class OverviewPopulation(pydantic.BaseModel):
    name: str
    enrolled: int
    seen_last_hour: int  # enrolled clients that checked in during the last hour
    finished: bool
    created: float


class OverviewRound(pydantic.BaseModel):
    id: int
    population: str
    kind: str
    state: str
    stage: int  # a secure round's SecAgg+ stage; 0 for plain rounds
    reports: int
    target: int
    quorum: int
    assigned: int
    dropouts: int
    late: int
    refused: int
    refused_by_reason: dict[str, int]
    created: float
    closed: float | None
    duration: float  # seconds from creation to its end, or to now while open
    failure: str


class OverviewSession(pydantic.BaseModel):
    id: int
    population: str
    state: str
    version: int
    buffer_fill: int
    buffer_size: int
    max_staleness: int
    accepted: int
    refused_stale: int
    refused_by_reason: dict[str, int]
    staleness_histogram: dict[str, int]
    created: float
    updated: float
    duration: float


class Rates(pydantic.BaseModel):
    checkins: list[list[float]]  # [[minute start (epoch seconds), check-ins in it], ...]
    reports: list[list[float]]  # [[minute start, reports accepted in it], ...]


class Overview(pydantic.BaseModel):
    now: float
    populations: list[OverviewPopulation]
    rounds: list[OverviewRound]
    sessions: list[OverviewSession]
    totals: dict[str, Any]  # the counters of GET /v1/status (check-ins, reports, ...)
    rates: Rates


def overview(server: state_lib.ServerState, rounds: int = 20, sessions: int = 10) -> Overview:
    """What `GET /v1/admin/overview` answers (see the module docstring)."""
    now = server.store.clock()
    seen = metrics_lib.seen_since(server.store, now - HOUR)
    round_rows = server.rounds.rounds(rounds)
    session_rows = server.sessions.sessions(sessions)
    refused = metrics_lib.refusals(
        server.store,
        [f"round:{r.id}" for r in round_rows] + [f"session:{s.id}" for s in session_rows],
    )
    return Overview(
        now=now,
        populations=[
            OverviewPopulation(name=p["name"], enrolled=p["clients"],
                               seen_last_hour=seen.get(p["name"], 0), finished=p["finished"],
                               created=p["created"])
            for p in server.store.populations()
        ],
        rounds=[_round(r, refused[f"round:{r.id}"], now) for r in round_rows],
        sessions=[
            OverviewSession(
                **server.sessions.status(s), refused_by_reason=refused[f"session:{s.id}"],
                created=s.created, updated=s.updated,
                duration=(s.updated if s.state != "open" else now) - s.created,
            )
            for s in session_rows
        ],
        totals=state_lib.totals(server.store.counters()),
        rates=Rates(**server.telemetry.rate_series()),
    )


def _round(r: rounds_lib.Round, refused: dict[str, int], now: float) -> OverviewRound:
    return OverviewRound(
        id=r.id, population=r.population, kind=r.kind, state=r.state, stage=r.stage,
        reports=r.reports, target=r.target, quorum=r.quorum, assigned=r.assigned,
        dropouts=r.dropped, late=r.late, refused=r.refused, refused_by_reason=refused,
        created=r.created, closed=r.closed,
        duration=(r.closed if r.closed is not None else now) - r.created, failure=r.failure,
    )


@router.post("/admin/populations/{name}/metrics", status_code=201, tags=["admin"])
def release_metrics(
    name: routing.Population, body: MetricsIn, auth: auth_lib.Bearer, server: State
) -> MetricsStored:
    """Releases a round's metrics (replacing what was released for the same round, kind
    and name): what the dashboard plots over rounds."""
    auth_lib.admin(server, auth)
    try:
        return MetricsStored(stored=metrics_lib.release(server.store, name, body.round, body.metrics))
    except ValueError as e:
        raise protocol.BadRequest(str(e)) from e


@router.get("/admin/populations/{name}/metrics", tags=["admin"])
def released_metrics(
    name: routing.Population, auth: auth_lib.Bearer, server: State,
    since: Annotated[float | None, fastapi.Query(ge=0, le=1e12)] = None,
) -> ReleasedMetrics:
    """The population's released metrics by round, kind and name; with `since`, only
    those released after that time."""
    auth_lib.admin(server, auth)
    rows = metrics_lib.released(server.store, name, since)
    return ReleasedMetrics(population=name, metrics=[ReleasedMetric(**r) for r in rows])


@router.get("/admin/overview", tags=["admin"])
def admin_overview(
    auth: auth_lib.Bearer, server: State,
    rounds: Annotated[int, fastapi.Query(ge=1, le=1000)] = 20,
    sessions: Annotated[int, fastapi.Query(ge=1, le=1000)] = 10,
) -> Overview:
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
