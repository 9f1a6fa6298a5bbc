"""The routes of edge aggregators, at the root: the admin makes and revokes edges'
credentials; an edge, by its token, lists the open plain rounds of its population (and
its secure rounds, which its edges run: `store/edges.py`),
joins one (its share: seats and a target), reads the round's blobs, and forwards its
partial aggregate (`PartialUploads`, through the intake). See `store/edges.py`, and
`deploy/edge/` for the edge's side."""

from __future__ import annotations

import asyncio
from typing import Annotated, Any

import fastapi
import pydantic
from fastapi import responses, security
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, routing, schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import rounds as rounds_lib

router = fastapi.APIRouter(prefix=protocol.API)
EdgeName = Annotated[str, fastapi.Path(pattern=schemas.NAME, description="An edge's name.")]


class EdgeIn(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(pattern=schemas.NAME, description="1-64 of A-Z a-z 0-9 _ . -")]
    population: Annotated[str, pydantic.Field(pattern=schemas.NAME)]


class EdgeOut(pydantic.BaseModel):
    name: str
    population: str
    token: str = pydantic.Field(description="The edge's token (shown only here).")
    public_key: str = pydantic.Field(description="The root's plan-signing key (base64).")


class EdgeInfo(pydantic.BaseModel):
    name: str
    population: str
    created: float
    revoked: float | None


class ShareOut(pydantic.BaseModel):
    round: int
    edge: str
    state: str
    target: int
    capacity: int
    digest: str | None
    reports: int
    dropped: int


class EdgeRoundOut(pydantic.BaseModel):
    """An open round as an edge sees it (and its share, once it joined); its plan says
    whether it is secure."""

    id: int
    plan: str = pydantic.Field(description="The root-signed plan's blob.")
    broadcast: str
    seconds_left: float
    target: int
    capacity: int
    quorum: int
    share: ShareOut | None = None


class EdgeRoundsOut(pydantic.BaseModel):
    population: str
    finished: bool
    public_key: str = pydantic.Field(description="The root's plan-signing key (base64).")
    rounds: list[EdgeRoundOut]


def edge(server: state_lib.ServerState, auth: security.HTTPAuthorizationCredentials | None
         ) -> tuple[str, str]:
    """(edge name, population) of the edge token of a request (counted when refused).

    Raises:
      Unauthorized: no token, or an unknown or revoked one.
    """
    return server.edges.authenticate(auth_lib.token(auth, "an edge token"))


class PartialUploads:
    """An edge's partial aggregates, as the intake takes them: one per edge and round
    it joined, checked (`Folder.check_partial`) and merged (`Folder.merge_partial`) by the
    round's folder."""

    def __init__(self, server: state_lib.ServerState):
        self.server = server

    def target(self, task_id: int) -> rounds_lib.Round:
        return self.server.rounds.round(task_id)

    def limit(self, target: rounds_lib.Round, slot: int) -> int:
        return self.server.verified.folder(target.plan).max_partial_bytes + (1 << 20)

    def precheck(self, target: rounds_lib.Round, upload: intake.Upload) -> bool:
        return self.server.edges.precheck(target.id, upload.client, upload.population,
                                          upload.digest)

    def check(self, target: rounds_lib.Round, upload: intake.Upload) -> Any:
        return self.server.verified.folder(target.plan).check_partial(upload.body)

    def bounded(self, target: rounds_lib.Round, upload: intake.Upload) -> None:
        """None: a partial is no one client's report. The edge checked each of its
        clients' reports against the same signed plan's bounds (its intake is this one);
        the partial itself is checked for finite values and its counts (`check`), and
        comes from an edge the root's admin made (its token)."""
        return None

    def accept(self, target: rounds_lib.Round, upload: intake.Upload) -> bool:
        folder = self.server.verified.folder(target.plan)
        partial: folding.Partial = upload.checked
        return self.server.edges.accept(
            target.id, upload.client, upload.population, upload.digest, len(upload.body),
            partial.reports, partial.dropped,
            lambda aggregate: folder.merge_partial(aggregate, partial.value),
        )

    def count_refusal(self, reason: str, target: rounds_lib.Round) -> None:
        self.server.edges.count_refusal(reason, target.id)


# -- admin


@router.post("/admin/edges", status_code=201, tags=["admin"])
def create_edge(body: EdgeIn, auth: auth_lib.Bearer, server: State) -> EdgeOut:
    """Makes an edge aggregator's credential for a population (its token is shown only
    here; the root keeps its hash). `fedlang serve --upstream URL --upstream-token TOKEN`
    runs the edge."""
    auth_lib.admin(server, auth)
    token = server.edges.create(body.name, body.population)
    return EdgeOut(name=body.name, population=body.population, token=token,
                   public_key=plan_lib.b64(server.public_key))


@router.get("/admin/edges", tags=["admin"])
def list_edges(auth: auth_lib.Bearer, server: State) -> list[EdgeInfo]:
    """The edges, revoked ones too."""
    auth_lib.admin(server, auth)
    return [EdgeInfo(**e) for e in server.edges.edges()]


@router.delete("/admin/edges/{name}", tags=["admin"])
def revoke_edge(name: EdgeName, auth: auth_lib.Bearer, server: State) -> EdgeInfo:
    """Revokes an edge: its token gets 401 from now on; a round it joined counts its
    seats as dropouts unless it forwarded before."""
    auth_lib.admin(server, auth)
    server.edges.revoke(name)
    return next(EdgeInfo(**e) for e in server.edges.edges() if e["name"] == name)


@router.get("/admin/rounds/{round_id}/edges", tags=["admin"])
def round_shares(round_id: routing.RoundId, auth: auth_lib.Bearer, server: State) -> list[ShareOut]:
    """The edges' shares of a round: seats, target, and what each forwarded."""
    auth_lib.admin(server, auth)
    return [ShareOut(**s.to_json()) for s in server.edges.shares(round_id)]


# -- edges


def _round_out(server: state_lib.ServerState, r: rounds_lib.Round,
               share: edges_lib.Share | None) -> EdgeRoundOut:
    return EdgeRoundOut(
        id=r.id, plan=r.plan, broadcast=r.broadcast,
        seconds_left=max(0.0, r.deadline - server.store.clock()), target=r.target,
        capacity=r.capacity, quorum=r.quorum,
        share=None if share is None else ShareOut(**share.to_json()),
    )


@router.get("/edge/rounds", tags=["edge"])
async def edge_rounds(
    auth: auth_lib.Bearer, server: State, wait: routing.Wait = 0.0
) -> EdgeRoundsOut:
    """The open plain rounds of the edge's population, and its secure rounds run by its
    edges; with `wait`, answers once there
    is one the edge has not joined, or after `wait` seconds (long polling)."""
    name, population = await concurrency.run_in_threadpool(edge, server, auth)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while True:
        rounds = await concurrency.run_in_threadpool(server.edges.open_rounds, name, population)
        if loop.time() >= end or any(share is None for _, share in rounds):
            break
        await asyncio.sleep(min(0.5, max(0.0, end - loop.time())))  # a new round: within 0.5 s
    populations = await concurrency.run_in_threadpool(server.store.populations)
    finished = any(p["name"] == population and p["finished"] for p in populations)
    return EdgeRoundsOut(population=population, finished=finished,
                         public_key=plan_lib.b64(server.public_key),
                         rounds=[_round_out(server, r, s) for r, s in rounds])


@router.post("/edge/rounds/{round_id}/join", tags=["edge"])
def join_round(round_id: routing.RoundId, auth: auth_lib.Bearer, server: State) -> EdgeRoundOut:
    """The edge's share of an open plain round of its population (made on the first
    call: seats and a target, each the round's divided by the population's edges), or
    of a secure round its edges run (split evenly, at least 2 seats)."""
    name, population = edge(server, auth)
    r, share = server.edges.join(name, population, round_id)
    return _round_out(server, r, share)


@router.get("/edge/blobs/{blob}", tags=["edge"], responses=routing.BINARY_RESPONSE,
            response_class=responses.Response)
def edge_blob(blob: routing.BlobHash, auth: auth_lib.Bearer, server: State) -> responses.Response:
    """A blob a round of the edge's population names (its root-signed plan, its
    broadcast); 404 for any other."""
    _, population = edge(server, auth)
    if not server.store.names_blob(population, blob):
        raise protocol.NotFound(
            f"Expected the hash of a blob a task of population {population!r} names, "
            f"found {blob!r}."
        )
    return routing.binary(server.store.get_blob(blob), blob)


@router.put("/edge/rounds/{round_id}/partial", tags=["edge"], openapi_extra=routing.BINARY_BODY)
async def upload_partial(
    round_id: routing.RoundId, request: fastapi.Request, auth: auth_lib.Bearer, server: State
) -> schemas.ReportOut:
    """Uploads the edge's partial aggregate of a round it joined (the binary value
    format, of type `<reports=int64,dropped=int64,aggregate=A>`, A the plan's aggregate
    type). Idempotent: the same bytes again change nothing; other bytes get 409."""
    new = await intake.take(server, request, auth, PartialUploads(server), round_id,
                            authenticate=edge)
    return schemas.ReportOut(round=round_id, accepted=True, replay=not new)
