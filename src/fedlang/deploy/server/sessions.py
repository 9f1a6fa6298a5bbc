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

Client: a check-in may return a task of kind `buffered` (`round` is the session id,
`broadcast` the version's weights, `version` the version); the client uploads its report
with `PUT /v1/sessions/{session}/reports/{version}` (the binary value format, of the
plan's report type), through the intake (`ReportUploads`). Idempotent: the same bytes
again change nothing.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import fastapi

from fedlang.deploy import protocol
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, plans, routing, schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import sessions as sessions_lib

SessionId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The session's id.")]
VersionPath = Annotated[int, fastapi.Path(ge=0, le=2**62, description="The model version.")]
router = fastapi.APIRouter(prefix=protocol.API)


class ReportUploads:
    """A buffered session's reports, as the intake takes them: one per client and model
    version, checked by the session's plan and stored as they came for the driver."""

    def __init__(self, server: state_lib.ServerState):
        self.server = server

    def target(self, task_id: int) -> sessions_lib.Session:
        return self.server.sessions.session(task_id)

    def limit(self, target: sessions_lib.Session, slot: int) -> int:
        return self.server.verified.buffered(target.plan).max_report_bytes + (1 << 20)

    def precheck(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
        return self.server.sessions.precheck(target.id, upload.client, upload.slot, upload.digest)

    def check(self, target: sessions_lib.Session, upload: intake.Upload) -> Any:
        return self.server.verified.buffered(target.plan).check(upload.body)

    def bounded(self, target: sessions_lib.Session, upload: intake.Upload) -> Any:
        plan = self.server.verified.buffered(target.plan)
        if plan.bounds is None:
            return None
        return plan.bounds, plan.leaves(upload.checked)

    def accept(self, target: sessions_lib.Session, upload: intake.Upload) -> bool:
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
    auth: auth_lib.Bearer, server: State,
) -> schemas.AsyncReportOut:
    """Uploads this client's report for the version it trained (the binary value
    format, of the plan's report type). Refused (410, `stale`) when the version is
    more than the session's maximum staleness behind; 503 (`buffer_full`, retry) while
    the buffer waits to be applied. Idempotent."""
    new = await intake.take(server, request, auth, ReportUploads(server), session_id, version)
    return schemas.AsyncReportOut(session=session_id, version=version, accepted=True,
                                  replay=not new)
