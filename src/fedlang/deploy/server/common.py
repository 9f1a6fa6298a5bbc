"""The routes every mode shares: populations, edges and blobs (admin), enrollment,
check-in and blob downloads (clients; an edge's check-in: the tasks it may hold seats
in), and the status (public)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Annotated, Any

import fastapi
from fastapi import responses
from starlette import concurrency

from fedlang.core import signing
from fedlang.deploy import protocol
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import rounds as rounds_routes
from fedlang.deploy.server import routing, schemas
from fedlang.deploy.server import sessions as sessions_routes
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import values

router = fastapi.APIRouter(prefix=protocol.API)

# -- admin: the driver


@router.post("/admin/populations", status_code=201, tags=["admin"])
def create_population(
    body: schemas.PopulationIn, auth: auth_lib.Bearer, server: State
) -> schemas.PopulationOut:
    """Creates a population; the answer holds its enrollment token (shown only here)."""
    auth_lib.admin(server, auth)
    token = server.store.create_population(body.name, body.max_enrollments)
    return schemas.PopulationOut(name=body.name, token=token)


@router.get("/admin/populations", tags=["admin"])
def list_populations(auth: auth_lib.Bearer, server: State) -> list[schemas.PopulationInfo]:
    """The populations with their enrolled client counts."""
    auth_lib.admin(server, auth)
    return [schemas.PopulationInfo(**p) for p in server.store.populations()]


@router.post("/admin/populations/{name}/finish", tags=["admin"])
def finish_population(
    name: routing.Population, auth: auth_lib.Bearer, server: State
) -> schemas.PopulationInfo:
    """Marks a population finished: its clients stop at their next check-in."""
    auth_lib.admin(server, auth)
    server.store.finish_population(name)
    return next(schemas.PopulationInfo(**p) for p in server.store.populations()
                if p["name"] == name)


@router.get("/admin/audit", tags=["admin"])
def audit_log(
    auth: auth_lib.Bearer, server: State,
    after: Annotated[int, fastapi.Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, fastapi.Query(ge=1, le=1000)] = 100,
) -> list[schemas.AuditEntry]:
    """The audit log: every request made with the admin token that may change something
    (not GET), oldest first, after sequence number `after`."""
    auth_lib.admin(server, auth)
    return [schemas.AuditEntry(**e) for e in server.store.audit_log(after, limit)]


@router.post("/admin/populations/{name}/token", tags=["admin"])
def rotate_token(
    name: routing.Population, body: schemas.TokenIn, auth: auth_lib.Bearer, server: State
) -> schemas.PopulationOut:
    """A new enrollment token for the population (shown only here); the old one stops
    enrolling at once, and clients it enrolled keep their credentials."""
    auth_lib.admin(server, auth)
    return schemas.PopulationOut(name=name, token=server.store.rotate_token(name, body.max_enrollments))


@router.post("/admin/populations/{name}/device-tokens", status_code=201, tags=["admin"])
def device_tokens(
    name: routing.Population, body: schemas.DeviceTokensIn, auth: auth_lib.Bearer, server: State
) -> schemas.DeviceTokensOut:
    """Single-use enrollment tokens of the population, one per device (shown only here):
    each enrolls one client, then never again."""
    auth_lib.admin(server, auth)
    return schemas.DeviceTokensOut(population=name, tokens=server.store.device_tokens(name, body.count))


@router.delete("/admin/clients/{client_id}", tags=["admin"])
def revoke_client(
    client_id: Annotated[str, fastapi.Path(pattern=schemas.NAME, description="A client's id.")],
    auth: auth_lib.Bearer, server: State,
) -> schemas.RevokedOut:
    """Revokes a client: its credential is deleted, so its requests get 401 from now on.
    A client holding its population's token can enroll again: rotate the token too."""
    auth_lib.admin(server, auth)
    return schemas.RevokedOut(client_id=client_id, population=server.store.revoke_client(client_id))


@router.post("/admin/blobs", status_code=201, tags=["admin"], openapi_extra=routing.BINARY_BODY)
async def upload_blob(
    request: fastapi.Request, auth: auth_lib.Bearer, server: State
) -> schemas.BlobOut:
    """Stores a blob (a plan, a broadcast value) under the SHA-256 of its bytes, written
    to the store as it arrives, a chunk at a time (never held whole); it exists once it
    arrived whole, and nothing of an upload cut off is kept. Above the server's limit
    (`fedlang serve --max-blob-bytes`) it is refused (413): before a byte is read when
    its `Content-Length` says so."""
    auth_lib.admin(server, auth)
    limit = server.max_blob_bytes
    declared = request.headers.get("content-length")
    size = int(declared) if declared is not None and declared.isdigit() else None
    if size is not None and size > limit:
        raise _blob_too_large(limit, str(size))
    writer = server.store.blob_writer(size)
    try:
        buffer = bytearray()  # what arrived, handed to the store a chunk or more at a time
        async for part in request.stream():
            if writer.size + len(buffer) + len(part) > limit:
                raise _blob_too_large(limit, f"at least {writer.size + len(buffer) + len(part)}")
            buffer += part
            if len(buffer) >= values.CHUNK:
                await concurrency.run_in_threadpool(writer.write, buffer)
                buffer = bytearray()
        await concurrency.run_in_threadpool(writer.write, buffer)
        h = await concurrency.run_in_threadpool(writer.commit)
    except Exception:
        with contextlib.suppress(Exception):  # (what is left, the tick sweeps)
            await concurrency.run_in_threadpool(writer.discard)
        raise
    return schemas.BlobOut(hash=h, size=writer.size)


def _blob_too_large(limit: int, found: str) -> protocol.TooLarge:
    return protocol.TooLarge(
        f"Expected a blob of at most {limit} bytes (fedlang serve --max-blob-bytes), "
        f"found {found}.")


@router.post("/admin/edges", status_code=201, tags=["admin"])
def create_edge(body: schemas.EdgeIn, auth: auth_lib.Bearer, server: State) -> schemas.EdgeOut:
    """Makes an edge aggregator's credential for a population (its token is shown only
    here; the root keeps its hash). `fedlang serve --upstream URL --upstream-token TOKEN`
    runs the edge."""
    auth_lib.admin(server, auth)
    token = server.edges.create(body.name, body.population)
    return schemas.EdgeOut(name=body.name, population=body.population, token=token,
                           public_key=plan_lib.b64(server.public_key))


@router.get("/admin/edges", tags=["admin"])
def list_edges(auth: auth_lib.Bearer, server: State) -> list[schemas.EdgeInfo]:
    """The edges, revoked ones too."""
    auth_lib.admin(server, auth)
    return [schemas.EdgeInfo(**e) for e in server.edges.edges()]


@router.delete("/admin/edges/{name}", tags=["admin"])
def revoke_edge(
    name: Annotated[str, fastapi.Path(pattern=schemas.NAME, description="An edge's name.")],
    auth: auth_lib.Bearer, server: State,
) -> schemas.EdgeInfo:
    """Revokes an edge: its token gets 401 from now on; a round it holds seats in counts
    them as dropouts unless it forwarded before."""
    auth_lib.admin(server, auth)
    server.edges.revoke(name)
    return next(schemas.EdgeInfo(**e) for e in server.edges.edges() if e["name"] == name)


# -- clients


@router.post("/populations/{name}/enroll", status_code=201, tags=["client"])
def enroll(name: routing.Population, auth: auth_lib.Bearer, server: State,
           request: fastapi.Request) -> schemas.EnrollOut:
    """Enrolls a client with the population's token. Keep the credential; pin the
    server's public key: every plan the client runs must be signed by it. An address
    that failed too often is refused (429) for a while."""
    client_id, credential, expires = auth_lib.enrollment(
        server, request.client.host if request.client else "",
        lambda: server.store.enroll(
            name, auth_lib.token(auth, "the population's enrollment token"),
            server.credential_ttl))
    return schemas.EnrollOut(
        client_id=client_id,
        credential=credential,
        expires=expires,
        public_key=plan_lib.b64(server.public_key),
    )


def _round_task(server: state_lib.ServerState, t: rounds_lib.Task) -> schemas.TaskOut:
    return schemas.TaskOut(
        kind=t.kind, round=t.round, plan=t.plan, broadcast=t.broadcast, deadline=t.deadline,
        seconds_left=max(0.0, t.deadline - server.store.clock()),
    )


def _session_task(server: state_lib.ServerState, t: sessions_lib.BufferedTask) -> schemas.TaskOut:
    return schemas.TaskOut(kind=t.kind, session=t.session, plan=t.plan, broadcast=t.weights,
                           version=t.version, deadline=0.0, seconds_left=0.0)


# How a task of each kind is told to its client (`TaskOut`); a new mode adds its entry.
TASKS: dict[protocol.TaskKind, Callable[[state_lib.ServerState, Any], schemas.TaskOut]] = {
    protocol.TaskKind.AGGREGATE: _round_task,
    protocol.TaskKind.SECURE: _round_task,
    protocol.TaskKind.BUFFERED: _session_task,
}


@router.post("/checkin", tags=["client"])
def checkin(auth: auth_lib.Bearer, server: State) -> schemas.CheckinOut:
    """A task, or how many seconds to wait before checking in again (pace steering),
    or `finished` when the population has no more work. A seat in a round comes first;
    without one, the current version of the population's buffered session."""
    client_id, population = auth_lib.client(server, auth)
    offer: rounds_lib.Task | sessions_lib.BufferedTask | float | None = server.rounds.checkin(
        client_id, population)
    if offer is None:
        return schemas.CheckinOut(finished=True)
    if isinstance(offer, float):  # no seat in a round (the wait pace steering asks)
        offer = server.sessions.checkin(client_id, population) or offer
    if isinstance(offer, float):
        return schemas.CheckinOut(retry_after=offer)
    return schemas.CheckinOut(task=_signed(server, TASKS[offer.kind](server, offer)))


def _signed(server: State, task: schemas.TaskOut) -> schemas.TaskOut:
    """The task with its ticket: the server's signature over what it names."""
    payload = protocol.ticket_payload(task.model_dump())
    task.ticket = plan_lib.b64(signing.sign(payload, server.key))
    return task


@router.get("/blobs/{blob}", tags=["client"], responses=routing.BINARY_RESPONSE,
            response_class=responses.Response)
def download_blob(
    blob: routing.BlobHash,
    auth: auth_lib.Bearer,
    server: State,
    if_none_match: Annotated[str | None, fastapi.Header()] = None,
    byte_range: routing.Range = None,
    if_range: routing.IfRange = None,
) -> responses.Response:
    """A blob by hash (immutable: cache it; `If-None-Match` gives 304), streamed; a
    `Range` gets a part of it (206: a download cut off resumes). The admin reads any
    blob; a client only those a task of its own population names (404 otherwise, as
    for a blob that does not exist)."""
    if not auth_lib.is_admin(server, auth):
        _, population = auth_lib.client(server, auth)
        if not server.store.names_blob(population, blob):
            raise protocol.NotFound(
                f"Expected the hash of a blob a task of population {population!r} names, "
                f"found {blob!r}."
            )
    if if_none_match is not None and if_none_match.strip('"') == blob:
        if not server.store.has_blob(blob):
            raise protocol.NotFound(f"Expected the hash of a stored blob, found {blob!r}.")
        return responses.Response(status_code=304, headers={"ETag": f'"{blob}"'})
    return routing.binary(server.store, server.store.open_blob(blob), byte_range, if_range,
                          immutable=True)


# -- edges: clients that hold seats for their own clients


def _edge_tasks(server: state_lib.ServerState, who: auth_lib.Uploader
                ) -> list[schemas.EdgeTaskOut]:
    """The open tasks of the edge's population: the folded rounds (its share of each it
    joined), then the buffered sessions."""
    name = auth_lib.edge_name(who)
    return [*(rounds_routes.edge_task(server, r, share)
              for r, share in server.edges.open_rounds(name, who.population)),
            *(sessions_routes.edge_task(s) for s in server.sessions.open_sessions(who.population))]


@router.get("/edge/tasks", tags=["edge"])
async def edge_tasks(
    auth: auth_lib.Bearer, server: State, wait: routing.Wait = 0.0
) -> schemas.EdgeTasksOut:
    """The edge's check-in: the open plain rounds of its population, its secure rounds
    run by its edges, and its buffered sessions; with `wait`, answers once there is a
    round the edge holds no seats in, or after `wait` seconds (long polling)."""
    who = await concurrency.run_in_threadpool(auth_lib.edge, server, auth)
    loop = asyncio.get_running_loop()
    end = loop.time() + wait
    while True:
        tasks = await concurrency.run_in_threadpool(_edge_tasks, server, who)
        new = any(t.share is None for t in tasks if t.kind != protocol.TaskKind.BUFFERED)
        if loop.time() >= end or new:
            break
        await asyncio.sleep(min(0.5, max(0.0, end - loop.time())))  # a new round: within 0.5 s
    populations = await concurrency.run_in_threadpool(server.store.populations)
    finished = any(p["name"] == who.population and p["finished"] for p in populations)
    return schemas.EdgeTasksOut(population=who.population, finished=finished,
                                public_key=plan_lib.b64(server.public_key), tasks=tasks)


@router.get("/edge/blobs/{blob}", tags=["edge"], responses=routing.BINARY_RESPONSE,
            response_class=responses.Response)
def edge_blob(blob: routing.BlobHash, auth: auth_lib.Bearer, server: State,
              byte_range: routing.Range = None, if_range: routing.IfRange = None
              ) -> responses.Response:
    """A blob a task of the edge's population names (its root-signed plan, its broadcast
    or weights), streamed (a `Range`: a part of it, 206); 404 for any other."""
    who = auth_lib.edge(server, auth)
    if not server.store.names_blob(who.population, blob):
        raise protocol.NotFound(
            f"Expected the hash of a blob a task of population {who.population!r} names, "
            f"found {blob!r}."
        )
    return routing.binary(server.store, server.store.open_blob(blob), byte_range, if_range,
                          immutable=True)


# -- public


@router.get("/status", tags=["status"])
def status(server: State, auth: auth_lib.Bearer) -> schemas.StatusOut:
    """Rounds, check-ins, reports accepted and refused (by reason), late reports and
    dropouts. Without the admin token, nothing that names a plan or a blob: the rounds'
    `plan` and `broadcast` are null."""
    return schemas.StatusOut(**server.status(hashes=auth_lib.is_admin(server, auth)))
