"""The routes of buffered (asynchronous, FedBuff) sessions (see `store.sessions`, and
docs/deploy.md, "Buffered asynchronous sessions (FedBuff)").

Admin (the driver, `driver.buffered`):

* `POST /v1/admin/sessions`: opens a session from an unsigned `BufferedPlan` blob and the
  first version's weights blob; the server checks both and signs the plan.
* `GET /v1/admin/sessions/{session}?wait=&seen=`: the session (long poll: answers when
  its accepted report count differs from `seen`, or after `wait` seconds).
* `GET /v1/admin/sessions/{session}/reports?after=`: accepted reports after a sequence
  number, in order (each report's bytes in base64).
* `POST /v1/admin/sessions/{session}/versions`: publishes the next version (its weights
  and the driver's state, by blob hash, and the last report the buffer applied).
* `POST /v1/admin/sessions/{session}/close`.

Client: a check-in may return a task of kind `buffered` (`session` is the session id,
`broadcast` the version's weights, `version` the version); the client uploads its report
with `PUT /v1/sessions/{session}/reports/{version}` (the binary value format, of the
plan's report type), through the intake (`ReportUploads`). Idempotent: the same bytes
again change nothing.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import fastapi
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, plans, routing, schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import sessions as sessions_lib

SessionId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The session's id.")]
VersionPath = Annotated[int, fastapi.Path(ge=0, le=2**62, description="The model version.")]
BatchNumber = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The edge's batch number.")]
# Bytes a report may hold beyond its tensors (the value format's typed headers).
REPORT_HEADERS = 1 << 16
router = fastapi.APIRouter(prefix=protocol.API)


class ReportUploads:
    """A buffered session's uploads, as the intake takes them: a client's report (one
    per client and model version, checked by the session's plan), or an edge's batch of
    its clients' reports (`plans.buffered.decode_batch`: each checked and bounded as if
    its client had uploaded it here), stored as they came for the driver."""

    def __init__(self, server: state_lib.ServerState):
        self.server = server

    def target(self, task_id: int, uploader: auth_lib.Uploader) -> sessions_lib.Session:
        return intake.visible(self.server.sessions.session(task_id), uploader, "session")

    def task(self, target: sessions_lib.Session, upload: intake.Upload
             ) -> dict[str, int | None]:
        """A client's report: the session and the version it trained (the upload's slot);
        an edge's batch: the session (each of its reports names its version)."""
        if upload.uploader.holds_seats:
            return protocol.task_of({"session": target.id})
        return protocol.task_of({"session": target.id, "version": upload.slot})

    def scan(self, target: sessions_lib.Session, upload: intake.Upload) -> None:
        return None  # read whole: a session keeps its reports for the driver

    def _report_limit(self, target: sessions_lib.Session) -> int:
        """The bytes one report may have: its tensors and their headers (the plan's check
        then reads it with the exact limit)."""
        return self.server.verified.buffered(target.plan).max_report_bytes + REPORT_HEADERS

    def limit(self, target: sessions_lib.Session, upload: intake.Upload) -> int:
        if upload.uploader.holds_seats:
            return buffered_plan.max_batch_bytes(target.buffer_size,
                                                 self._report_limit(target)) + (1 << 20)
        return self.server.verified.buffered(target.plan).max_report_bytes + (1 << 20)

    def precheck(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
        if upload.uploader.holds_seats:
            return self.server.sessions.precheck_many(target.id, upload.client, upload.slot,
                                                      upload.digest)
        return self.server.sessions.precheck(target.id, upload.client, upload.slot, upload.digest)

    def check(self, target: sessions_lib.Session, upload: intake.Upload) -> Any:
        """A client's checked report; a batch's (version, digest, bytes) items, each
        report checked by the plan and its bounds here (the intake's bounds step sees
        one report)."""
        plan = self.server.verified.buffered(target.plan)
        if not upload.uploader.holds_seats:
            return plan.check(upload.body)
        items = []
        for version, data in buffered_plan.decode_batch(upload.body, target.buffer_size,
                                                        self._report_limit(target)):
            report = plan.check(data)
            if plan.bounds is not None:
                folding.check_bounds(plan.bounds, plan.leaves(report))
            items.append((version, protocol.blob_hash(data), data))
        return items

    def bounded(self, target: sessions_lib.Session, upload: intake.Upload) -> Any:
        plan = self.server.verified.buffered(target.plan)
        if plan.bounds is None or upload.uploader.holds_seats:  # (`check` bounded a batch's)
            return None
        return plan.bounds, plan.leaves(upload.checked)

    def accept(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
        if upload.uploader.holds_seats:
            return self.server.sessions.accept_many(
                target.id, upload.client, upload.slot, upload.digest, upload.size,
                upload.checked,
            )
        return self.server.sessions.accept(
            target.id, upload.client, upload.slot, upload.digest, upload.body
        )

    def count_refusal(self, reason: str, target: sessions_lib.Session) -> None:
        self.server.sessions.count_refusal(reason, target.id)


def create(server: state_lib.ServerState, body: schemas.SessionIn) -> sessions_lib.Session:
    """Opens the session `body` asks for (or returns the one made for its `request_id`)."""
    _, data = plans.read_plan(
        server, protocol.TaskKind.BUFFERED, body.plan, body.weights, "model weights"
    )
    return server.sessions.create(
        body.population, plans.sign(server, data), body.weights, version=body.version,
        buffer_size=body.buffer_size, max_staleness=body.max_staleness,
        request_id=body.request_id,
    )


@router.post("/admin/sessions", status_code=201, tags=["admin"])
def open_session(
    body: schemas.SessionIn, auth: auth_lib.Bearer, server: State
) -> schemas.SessionOut:
    """Opens a buffered session: the server signs the plan; checking-in clients get
    the current version's task at once. A repeated `request_id` returns its session."""
    auth_lib.admin(server, auth)
    return schemas.SessionOut(**create(server, body).to_json())


@router.get("/admin/sessions/{session_id}", tags=["admin"])
async def session_state(
    session_id: SessionId,
    auth: auth_lib.Bearer,
    server: State,
    wait: routing.Wait = 0.0,
    seen: routing.Seen = -1,
) -> schemas.SessionOut:
    """A session; with `wait`, answers when its accepted report count differs from
    `seen`, when it is closed, or after `wait` seconds (long polling)."""
    auth_lib.admin(server, auth)

    def changed(_: sessions_lib.Session, s: sessions_lib.Session) -> bool:
        return s.reports != seen or s.state != sessions_lib.OPEN

    s = await routing.long_poll(lambda: server.sessions.session(session_id), changed, wait, 0.05)
    return schemas.SessionOut(**s.to_json())


@router.get("/admin/sessions/{session_id}/reports", tags=["admin"])
def session_reports(
    session_id: SessionId,
    auth: auth_lib.Bearer,
    server: State,
    after: Annotated[int, fastapi.Query(ge=0, le=2**62)] = 0,
    limit: Annotated[int, fastapi.Query(ge=1, le=10000)] = 1000,
) -> list[schemas.ReportItem]:
    """Accepted reports after sequence number `after`, in order."""
    auth_lib.admin(server, auth)
    server.sessions.session(session_id)  # 404 for an unknown session
    return [
        schemas.ReportItem(seq=r.seq, client=r.client, version=r.version,
                           staleness=r.staleness, data=base64.b64encode(r.data).decode())
        for r in server.sessions.reports(session_id, after, limit)
    ]


@router.post("/admin/sessions/{session_id}/versions", tags=["admin"])
def publish_version(
    session_id: SessionId, body: schemas.VersionIn, auth: auth_lib.Bearer, server: State
) -> schemas.SessionOut:
    """Publishes the next model version, with the driver's state and the last report
    its buffer applied (idempotent for the same version and report)."""
    auth_lib.admin(server, auth)
    s = server.sessions.session(session_id)
    plans.check_value(server, server.verified.buffered(s.plan), body.weights, "model weights")
    if not server.store.has_blob(body.server_state):
        raise protocol.NotFound(
            f"Expected the hash of a stored blob (the server state), found "
            f"{body.server_state!r}; upload it first (POST /v1/admin/blobs)."
        )
    s = server.sessions.publish(session_id, body.version, body.weights, body.server_state,
                                body.through)
    return schemas.SessionOut(**s.to_json())


@router.post("/admin/sessions/{session_id}/close", tags=["admin"])
def close_session(
    session_id: SessionId, auth: auth_lib.Bearer, server: State
) -> schemas.SessionOut:
    """Closes a session: no more tasks; later reports are refused."""
    auth_lib.admin(server, auth)
    return schemas.SessionOut(**server.sessions.close(session_id).to_json())


@router.put("/sessions/{session_id}/reports/{version}", tags=["client"],
            openapi_extra=routing.BINARY_BODY)
async def upload_report(
    session_id: SessionId, version: VersionPath, request: fastapi.Request,
    auth: auth_lib.Bearer, server: State, task: intake.TaskHeader = None,
) -> schemas.AsyncReportOut:
    """Uploads this client's report for the version it trained (the binary value
    format, of the plan's report type). Refused (410, `stale`) when the version is
    more than the session's maximum staleness behind; 503 (`buffer_full`, retry) while
    the buffer waits to be applied. Idempotent."""
    new = await intake.take(server, request, auth, ReportUploads(server), session_id, version,
                            task=task)
    return schemas.AsyncReportOut(session=session_id, version=version, accepted=True,
                                  replay=not new)


# -- edges: batches of their clients' reports


def edge_task(s: sessions_lib.Session) -> schemas.EdgeTaskOut:
    """A session as an edge sees it (its current version)."""
    return schemas.EdgeTaskOut(
        kind=protocol.TaskKind.BUFFERED, id=s.id, state=s.state, plan=s.plan,
        broadcast=s.weights, version=s.version, buffer_size=s.buffer_size,
        max_staleness=s.max_staleness, pending=s.pending,
    )


@router.post("/edge/sessions/{session_id}/join", tags=["edge"])
def join_session(session_id: SessionId, auth: auth_lib.Bearer, server: State
                 ) -> schemas.EdgeTaskOut:
    """The open buffered session of the edge's population it mirrors for its clients."""
    s = intake.visible(server.sessions.session(session_id), auth_lib.edge(server, auth), "session")
    if s.state != sessions_lib.OPEN:
        raise protocol.Gone(f"Expected an open session, found session {s.id} {s.state}.",
                            reason="closed")
    return edge_task(s)


@router.put("/edge/sessions/{session_id}/batches/{batch}", tags=["edge"],
            openapi_extra=routing.BINARY_BODY)
async def upload_batch(
    session_id: SessionId, batch: BatchNumber, request: fastapi.Request,
    auth: auth_lib.Bearer, server: State, task: intake.TaskHeader = None,
) -> schemas.BatchOut:
    """Uploads the edge's batch `batch` of its clients' reports (`plans.buffered`: each
    report with the version it trained). Taken whole or not at all: 503 `buffer_full`
    when its reports do not fit the buffer's free room (send it again after the next
    version). Reports staler than the session's maximum are counted as refused.
    Idempotent: the same bytes again change nothing; other bytes get 409."""
    who = await concurrency.run_in_threadpool(auth_lib.edge, server, auth)
    new = await intake.take(server, request, auth, ReportUploads(server), session_id, batch,
                            authenticate=lambda *_: who, task=task)
    (taken,) = await concurrency.run_in_threadpool(server.sessions.batches, session_id, who.id,
                                                   batch)
    return schemas.BatchOut(session=session_id, batch=batch, accepted=taken.reports,
                            stale=taken.stale, replay=not new)


@router.get("/admin/sessions/{session_id}/edges", tags=["admin"])
def session_batches(session_id: SessionId, auth: auth_lib.Bearer, server: State
                    ) -> list[schemas.BatchInfo]:
    """The batches edges forwarded to a session: their reports accepted and stale."""
    auth_lib.admin(server, auth)
    server.sessions.session(session_id)  # 404 for an unknown session
    return [schemas.BatchInfo(session=b.session, edge=b.client.removeprefix(edges_lib.HOLDER),
                              batch=b.batch, digest=b.digest, reports=b.reports, stale=b.stale)
            for b in server.sessions.batches(session_id)]
