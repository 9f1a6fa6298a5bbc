"""The endpoints of buffered (asynchronous, FedBuff) sessions (see `async_store`, and
docs/deploy.md, "Asynchronous rounds (FedBuff)").

Admin (the driver, `async_driver`):

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
plan's report type). Idempotent: the same bytes again change nothing.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import threading
import time
from typing import Annotated

import fastapi
import pydantic
from starlette import concurrency

from fedlang.core import serialization, signing
from fedlang.deploy import aggregation, async_plan, async_store, protocol, schemas
from fedlang.deploy import server as server_lib

SessionId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The session's id.")]
VersionPath = Annotated[int, fastapi.Path(ge=0, le=2**62, description="The model version.")]


class SessionIn(pydantic.BaseModel):
    population: Annotated[str, pydantic.Field(pattern=schemas.NAME)]
    plan: schemas.Hash = pydantic.Field(
        description="The blob of the unsigned plan (BufferedPlan.to_bytes)."
    )
    weights: schemas.Hash = pydantic.Field(description="The blob of the first version's weights.")
    version: int = pydantic.Field(default=0, ge=0, le=2**62, description="The first version.")
    buffer_size: int = pydantic.Field(ge=1, le=10**6, description="K: reports per server step.")
    max_staleness: int = pydantic.Field(
        ge=0, le=2**31, description="Reports staler than this many versions are refused."
    )
    request_id: str | None = pydantic.Field(
        default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="Makes the request idempotent: a retry returns the same session.",
    )


class SessionOut(pydantic.BaseModel):
    id: int
    population: str
    state: str = pydantic.Field(description="open or closed.")
    plan: str = pydantic.Field(description="The blob of the signed plan clients download.")
    version: int = pydantic.Field(description="The current model version.")
    weights: str = pydantic.Field(description="The blob of the current version's weights.")
    server_state: str = pydantic.Field(
        description="The blob of the driver's state at this version ('' before the first step)."
    )
    buffer_size: int
    max_staleness: int
    applied_through: int = pydantic.Field(
        description="The last report (sequence number) applied into a published version."
    )
    reports: int = pydantic.Field(description="Reports accepted (the last sequence number).")
    refused_stale: int
    created: float
    updated: float


class ReportItem(pydantic.BaseModel):
    seq: int
    client: str
    version: int = pydantic.Field(description="The version the client trained.")
    staleness: int = pydantic.Field(description="Versions published since, when it was accepted.")
    data: str = pydantic.Field(description="The report (the binary value format, base64).")


class VersionIn(pydantic.BaseModel):
    version: int = pydantic.Field(ge=1, le=2**62, description="The next version.")
    weights: schemas.Hash = pydantic.Field(description="The blob of its weights.")
    server_state: schemas.Hash = pydantic.Field(description="The blob of the driver's state.")
    through: int = pydantic.Field(
        ge=0, le=2**62, description="The last report sequence number this version applied."
    )


class AsyncReportOut(pydantic.BaseModel):
    session: int
    version: int
    accepted: bool
    replay: bool = pydantic.Field(description="This report had been accepted before.")


class Plans:
    """The verified plans of sessions, by signed blob hash (a few kept)."""

    def __init__(self, app: server_lib.App):
        self.app = app
        self._cache: collections.OrderedDict[str, async_plan.BufferedPlan] = (
            collections.OrderedDict()
        )
        self._lock = threading.Lock()

    def get(self, signed_hash: str) -> async_plan.BufferedPlan:
        with self._lock:
            if signed_hash in self._cache:
                self._cache.move_to_end(signed_hash)
                return self._cache[signed_hash]
        plan = async_plan.load(self.app.store.get_blob(signed_hash), self.app.public_key)
        with self._lock:
            self._cache[signed_hash] = plan
            while len(self._cache) > 8:
                self._cache.popitem(last=False)
        return plan


def _check_weights(app: server_lib.App, plan: async_plan.BufferedPlan, h: str) -> None:
    try:
        serialization.deserialize_value(app.store.get_blob(h), expected_type=plan.weights_type)
    except serialization.SerializationError as e:
        raise protocol.BadRequest(f"Expected blob {h} to be the plan's model weights: {e}") from e


def create_session(app: server_lib.App, body: SessionIn) -> async_store.Session:
    plan_bytes = app.store.get_blob(body.plan)
    try:
        plan = async_plan.BufferedPlan.from_bytes(plan_bytes)
    except serialization.SerializationError as e:
        raise protocol.BadRequest(
            f"Expected blob {body.plan} to be a buffered plan (BufferedPlan.to_bytes()): {e}"
        ) from e
    _check_weights(app, plan, body.weights)
    signed = app.store.put_blob(signing.sign(plan_bytes, app.key))
    return app.sessions.create(
        body.population, signed, body.weights, version=body.version,
        buffer_size=body.buffer_size, max_staleness=body.max_staleness,
        request_id=body.request_id,
    )


async def upload(
    app: server_lib.App, plans: Plans, request: fastapi.Request, session_id: int,
    version: int, client_id: str,
) -> bool:
    s = await concurrency.run_in_threadpool(app.sessions.session, session_id)
    plan = await concurrency.run_in_threadpool(plans.get, s.plan)
    try:
        data = await server_lib._read_limited(request, plan.max_report_bytes + (1 << 20))
        digest = protocol.blob_hash(data)
        if await concurrency.run_in_threadpool(
            app.sessions.precheck, session_id, client_id, version, digest
        ):
            return False
        try:
            await concurrency.run_in_threadpool(plan.check, data)
        except aggregation.ReportError as e:
            raise protocol.BadRequest(str(e), reason=e.reason) from e
        return await concurrency.run_in_threadpool(
            app.sessions.accept, session_id, client_id, version, digest, data
        )
    except protocol.ProtocolError as e:
        await concurrency.run_in_threadpool(app.sessions.count_refusal, e.reason, session_id)
        raise


def add_routes(router: fastapi.APIRouter, app: server_lib.App) -> None:
    """Adds the buffered sessions' endpoints to the `/v1` router."""
    plans = Plans(app)

    @router.post("/admin/sessions", status_code=201, tags=["admin"])
    def open_session(body: SessionIn, auth: server_lib.Bearer) -> SessionOut:
        """Opens a buffered session: the server signs the plan; checking-in clients get
        the current version's task at once. A repeated `request_id` returns its session."""
        app.check_admin(auth)
        return SessionOut(**create_session(app, body).to_json())

    @router.get("/admin/sessions/{session_id}", tags=["admin"])
    async def session_state(
        session_id: SessionId,
        auth: server_lib.Bearer,
        wait: Annotated[float, fastapi.Query(ge=0, le=60)] = 0.0,
        seen: Annotated[int, fastapi.Query(ge=-1, le=2**62)] = -1,
    ) -> SessionOut:
        """A session; with `wait`, answers when its accepted report count differs from
        `seen`, when it is closed, or after `wait` seconds (long polling)."""
        app.check_admin(auth)
        end = time.monotonic() + wait
        while True:
            s = await concurrency.run_in_threadpool(app.sessions.session, session_id)
            if s.reports != seen or s.state != async_store.OPEN or time.monotonic() >= end:
                return SessionOut(**s.to_json())
            await asyncio.sleep(min(0.05, max(0.0, end - time.monotonic())))

    @router.get("/admin/sessions/{session_id}/reports", tags=["admin"])
    def session_reports(
        session_id: SessionId,
        auth: server_lib.Bearer,
        after: Annotated[int, fastapi.Query(ge=0, le=2**62)] = 0,
        limit: Annotated[int, fastapi.Query(ge=1, le=10000)] = 1000,
    ) -> list[ReportItem]:
        """Accepted reports after sequence number `after`, in order."""
        app.check_admin(auth)
        app.sessions.session(session_id)  # 404 for an unknown session
        return [
            ReportItem(seq=r.seq, client=r.client, version=r.version, staleness=r.staleness,
                       data=base64.b64encode(r.data).decode())
            for r in app.sessions.reports(session_id, after, limit)
        ]

    @router.post("/admin/sessions/{session_id}/versions", tags=["admin"])
    def publish_version(session_id: SessionId, body: VersionIn,
                        auth: server_lib.Bearer) -> SessionOut:
        """Publishes the next model version, with the driver's state and the last report
        its buffer applied (idempotent for the same version and report)."""
        app.check_admin(auth)
        s = app.sessions.session(session_id)
        _check_weights(app, plans.get(s.plan), body.weights)
        if not app.store.has_blob(body.server_state):
            raise protocol.NotFound(
                f"Expected the hash of a stored blob (the server state), found "
                f"{body.server_state!r}; upload it first (POST /v1/admin/blobs)."
            )
        s = app.sessions.publish(session_id, body.version, body.weights, body.server_state,
                                 body.through)
        return SessionOut(**s.to_json())

    @router.post("/admin/sessions/{session_id}/close", tags=["admin"])
    def close_session(session_id: SessionId, auth: server_lib.Bearer) -> SessionOut:
        """Closes a session: no more tasks; later reports are refused."""
        app.check_admin(auth)
        return SessionOut(**app.sessions.close(session_id).to_json())

    @router.put("/sessions/{session_id}/reports/{version}", tags=["client"],
                openapi_extra=server_lib.BINARY_BODY)
    async def upload_report(
        session_id: SessionId, version: VersionPath, request: fastapi.Request,
        auth: server_lib.Bearer,
    ) -> AsyncReportOut:
        """Uploads this client's report for the version it trained (the binary value
        format, of the plan's report type). Refused (410, `stale`) when the version is
        more than the session's maximum staleness behind; 503 (`buffer_full`, retry) while
        the buffer waits to be applied. Idempotent."""
        client_id, _ = await concurrency.run_in_threadpool(app.client, auth)
        new = await upload(app, plans, request, session_id, version, client_id)
        return AsyncReportOut(session=session_id, version=version, accepted=True,
                              replay=not new)
