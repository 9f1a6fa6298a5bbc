"""The routes of buffered sessions through edge aggregators, at the root: an edge, by its
token, lists the open buffered sessions of its population, joins one, and forwards its
clients' reports in batches (`BatchUploads`, through the intake). See
`store/edge_sessions.py`, and `edge/sessions.py` for the edge's side."""

from __future__ import annotations

from typing import Annotated, Any

import fastapi
import pydantic

from fedlang.deploy import protocol
from fedlang.deploy.plans import batch as batch_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import edges, intake, routing
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import edge_sessions as edge_sessions_lib
from fedlang.deploy.store import sessions as sessions_lib

router = fastapi.APIRouter(prefix=protocol.API)
SessionId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The session's id.")]
# Bytes a report may hold beyond its tensors (the value format's typed headers).
REPORT_HEADERS = 1 << 16
BatchNumber = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The edge's batch number.")]


class EdgeSessionOut(pydantic.BaseModel):
    """An open buffered session as an edge sees it."""

    id: int
    state: str
    plan: str = pydantic.Field(description="The root-signed plan's blob.")
    version: int = pydantic.Field(description="The current model version.")
    weights: str = pydantic.Field(description="The blob of the current version's weights.")
    buffer_size: int
    max_staleness: int
    pending: int = pydantic.Field(description="Reports in the buffer, not applied yet.")


class EdgeSessionsOut(pydantic.BaseModel):
    population: str
    public_key: str = pydantic.Field(description="The root's plan-signing key (base64).")
    sessions: list[EdgeSessionOut]


class BatchInfo(pydantic.BaseModel):
    session: int
    edge: str
    batch: int
    digest: str
    reports: int
    stale: int


class BatchOut(pydantic.BaseModel):
    session: int
    batch: int
    accepted: int = pydantic.Field(description="Reports of the batch stored for the driver.")
    stale: int = pydantic.Field(description="Reports refused as staler than max_staleness.")
    replay: bool = pydantic.Field(description="This batch had been accepted before.")


def _session_out(s: sessions_lib.Session) -> EdgeSessionOut:
    return EdgeSessionOut(id=s.id, state=s.state, plan=s.plan, version=s.version,
                          weights=s.weights, buffer_size=s.buffer_size,
                          max_staleness=s.max_staleness, pending=s.pending)


def _edge_sessions(server: state_lib.ServerState) -> edge_sessions_lib.EdgeSessions:
    return edge_sessions_lib.EdgeSessions(server.sessions)


class BatchUploads:
    """An edge's batches of reports of a buffered session, as the intake takes them:
    each report in the batch is checked as a client's report straight to the root would
    be (the session's plan: type, size, finite values; then its bounds), and the batch
    is accepted whole or not at all (`EdgeSessions.accept`)."""

    def __init__(self, server: state_lib.ServerState):
        self.server = server
        self.edge_sessions = _edge_sessions(server)

    def target(self, task_id: int) -> sessions_lib.Session:
        return self.server.sessions.session(task_id)

    def _report_limit(self, target: sessions_lib.Session) -> int:
        """The bytes one report of the batch may have: its tensors and their headers
        (the plan's check then reads it with the exact limit)."""
        return self.server.verified.buffered(target.plan).max_report_bytes + REPORT_HEADERS

    def limit(self, target: sessions_lib.Session, slot: int) -> int:
        return batch_lib.max_bytes(target.buffer_size, self._report_limit(target)) + (1 << 20)

    def precheck(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
        return self.edge_sessions.precheck(target.id, upload.client, upload.population,
                                           upload.slot, upload.digest)

    def check(self, target: sessions_lib.Session, upload: intake.Upload) -> Any:
        """The batch's (version, digest, bytes) items, each report checked by the plan
        and its bounds here: a batch holds several reports, where the intake's bounds
        step (`bounded`) sees one."""
        plan = self.server.verified.buffered(target.plan)
        items = []
        for version, data in batch_lib.decode(upload.body, target.buffer_size,
                                              self._report_limit(target)):
            report = plan.check(data)
            if plan.bounds is not None:
                folding.check_bounds(plan.bounds, plan.leaves(report))
            items.append((version, protocol.blob_hash(data), data))
        return items

    def bounded(self, target: sessions_lib.Session, upload: intake.Upload) -> None:
        """None: `check` bounded each report of the batch."""
        return None

    def accept(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
        return self.edge_sessions.accept(
            target.id, upload.client, upload.population, upload.slot, upload.digest,
            len(upload.body), upload.checked,
        )

    def count_refusal(self, reason: str, target: sessions_lib.Session) -> None:
        self.edge_sessions.count_refusal(reason, target.id)


@router.get("/admin/sessions/{session_id}/edges", tags=["admin"])
def session_batches(session_id: SessionId, auth: auth_lib.Bearer, server: State) -> list[BatchInfo]:
    """The batches edges forwarded to a session: their reports accepted and stale."""
    auth_lib.admin(server, auth)
    server.sessions.session(session_id)  # 404 for an unknown session
    return [BatchInfo(**b.to_json()) for b in _edge_sessions(server).batches(session_id)]


@router.get("/edge/sessions", tags=["edge"])
def edge_sessions(auth: auth_lib.Bearer, server: State) -> EdgeSessionsOut:
    """The open buffered sessions of the edge's population."""
    _, population = edges.edge(server, auth)
    return EdgeSessionsOut(
        population=population, public_key=plan_lib.b64(server.public_key),
        sessions=[_session_out(s) for s in _edge_sessions(server).open_sessions(population)],
    )


@router.post("/edge/sessions/{session_id}/join", tags=["edge"])
def join_session(session_id: SessionId, auth: auth_lib.Bearer, server: State) -> EdgeSessionOut:
    """The open buffered session of the edge's population it mirrors for its clients."""
    name, population = edges.edge(server, auth)
    return _session_out(_edge_sessions(server).join(name, population, session_id))


@router.put("/edge/sessions/{session_id}/batches/{batch}", tags=["edge"],
            openapi_extra=routing.BINARY_BODY)
async def upload_batch(
    session_id: SessionId, batch: BatchNumber, request: fastapi.Request,
    auth: auth_lib.Bearer, server: State,
) -> BatchOut:
    """Uploads the edge's batch `batch` of its clients' reports (`plans.batch`: each
    report with the version it trained). Taken whole or not at all: 503 `buffer_full`
    when its reports do not fit the buffer's free room (send it again after the next
    version). Reports staler than the session's maximum are counted as refused.
    Idempotent: the same bytes again change nothing; other bytes get 409."""
    new = await intake.take(server, request, auth, BatchUploads(server), session_id, batch,
                            authenticate=edges.edge)
    name, _ = edges.edge(server, auth)
    taken = _edge_sessions(server).batch(session_id, name, batch)
    assert taken is not None
    return BatchOut(session=session_id, batch=batch, accepted=taken.reports,
                    stale=taken.stale, replay=not new)
