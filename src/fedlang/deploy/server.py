"""The task store's HTTP server: FastAPI + uvicorn over a `store.Store`.

Clients only ever connect out: they enroll, check in for a task, download its signed
plan and broadcast value by hash, and upload a report, which is checked
(`aggregation.Folder.check`) and folded into the round's aggregate in one database
transaction. The driver (`http.ServerRounds`) uses the admin endpoints to open rounds
and read their aggregates. A round whose plan has secure aggregations runs the stages
of SecAgg+ instead of taking one report per client (`secure_rounds`, `secure_http`).
Every endpoint is under `/v1` and described in the OpenAPI schema the server serves at
`/openapi.json`; docs/deploy.md is the prose contract.

`Server(db=...)` runs it from Python (`start()` serves on a background thread); `fedlang
serve --db URL` runs it from the command line. TLS is uvicorn's: pass `ssl_keyfile` and
`ssl_certfile` (`--ssl-keyfile/--ssl-certfile`).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import pathlib
import secrets
import socket
import threading
import time
from collections.abc import AsyncIterator, Callable
from typing import Annotated, Any

import fastapi
import uvicorn
from fastapi import responses, security
from starlette import concurrency

from fedlang.core import serialization, signing
from fedlang.deploy import aggregation, async_store, protocol, schemas, secure_rounds
from fedlang.deploy import plan as plan_lib
from fedlang.deploy import store as store_lib

VERSION = "0.1.0"
_bearer = security.HTTPBearer(auto_error=False, description="A bearer token.")
Bearer = Annotated[security.HTTPAuthorizationCredentials | None, fastapi.Depends(_bearer)]
RoundId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The round's id.")]
Population = Annotated[str, fastapi.Path(pattern=schemas.NAME, description="A population name.")]
BlobHash = Annotated[str, fastapi.Path(pattern=protocol.BLOB_HASH, description="SHA-256, hex.")]
BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}},
    }
}
BINARY_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}}}
}
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": schemas.ErrorOut, "description": e.__doc__ or ""}
    for status, e in protocol.ERRORS.items()
}


def _token(auth: security.HTTPAuthorizationCredentials | None, what: str) -> str:
    if auth is None or not auth.credentials:
        raise protocol.Unauthorized(
            f"Expected an 'Authorization: Bearer ...' header with {what}, found none."
        )
    return auth.credentials


async def _read_limited(request: fastapi.Request, limit: int) -> bytes:
    """The request body, refused before it is read whole if it exceeds `limit` bytes."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise protocol.TooLarge(f"Expected at most {limit} bytes, found {declared}.")
    parts, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise protocol.TooLarge(f"Expected at most {limit} bytes, found more.")
        parts.append(chunk)
    return b"".join(parts)


def _binary(data: bytes, h: str | None = None) -> responses.Response:
    headers = {}
    if h is not None:  # content-addressed: a blob never changes
        headers = {"ETag": f'"{h}"', "Cache-Control": "private, max-age=31536000, immutable"}
    return responses.Response(data, media_type=protocol.BINARY, headers=headers)


def load_key(key: Any, store: store_lib.Store) -> Any:
    """The server's Ed25519 signing key: `key` itself, a key file (32 raw bytes, created
    if missing), or (None) the key kept in the database, created on first start."""
    if key is None:
        return signing.load_private_key(
            store.setdefault_meta("signing_key", signing.private_key_bytes(signing.generate_key()))
        )
    if isinstance(key, str | os.PathLike):
        path = pathlib.Path(key)
        if not path.exists():
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(signing.private_key_bytes(signing.generate_key()))
        return signing.load_private_key(path.read_bytes())
    return key


class App:
    """The endpoints over a store (see the module docstring).

    Args:
      store: the task store.
      key: the Ed25519 key that signs plans.
      admin_token: the bearer token of the admin endpoints.
      credential_ttl: seconds a client credential stays valid.
      max_blob_bytes: the largest blob the admin may upload.
    """

    def __init__(
        self,
        store: store_lib.Store,
        key: Any,
        admin_token: str,
        credential_ttl: float = 30 * 86400,
        max_blob_bytes: int = 1 << 30,
    ):
        self.store = store
        self.key = key
        self.public_key = signing.public_key_bytes(key)
        self.admin_token = admin_token
        self.credential_ttl = credential_ttl
        self.max_blob_bytes = max_blob_bytes
        self._folders: collections.OrderedDict[str, aggregation.Folder] = collections.OrderedDict()
        self._folders_lock = threading.Lock()
        self.secure = secure_rounds.SecureRounds(store, self.folder)
        self.sessions = async_store.Sessions(store)  # buffered (FedBuff) sessions

    def folder(self, signed_plan_hash: str) -> aggregation.Folder:
        """The round's folder, from its signed plan (cached: a plan is read once)."""
        with self._folders_lock:
            if signed_plan_hash in self._folders:
                self._folders.move_to_end(signed_plan_hash)
                return self._folders[signed_plan_hash]
        signed = self.store.get_blob(signed_plan_hash)
        folder = aggregation.Folder(signing.verify(signed, self.public_key))
        with self._folders_lock:
            self._folders[signed_plan_hash] = folder
            while len(self._folders) > 8:
                self._folders.popitem(last=False)
        return folder

    def check_admin(self, auth: security.HTTPAuthorizationCredentials | None) -> None:
        token = _token(auth, "the server's admin token")
        if not secrets.compare_digest(token.encode(), self.admin_token.encode()):
            raise protocol.Unauthorized(
                "Expected the server's admin token, found another token; it is printed when "
                "the server starts (or set with --admin-token)."
            )

    def client(self, auth: security.HTTPAuthorizationCredentials | None) -> tuple[str, str]:
        try:
            return self.store.authenticate(_token(auth, "a client credential"))
        except protocol.Unauthorized as e:
            self.store.count_refusal(e.reason)
            raise

    # -- admin

    def create_round(self, body: schemas.RoundIn) -> store_lib.Round:
        try:
            options = store_lib.CohortOptions(
                body.target, body.over_selection, body.quorum, body.deadline, body.stage_timeout
            )
        except ValueError as e:
            raise protocol.BadRequest(str(e)) from e
        plan_bytes = self.store.get_blob(body.plan)
        try:
            round_plan = plan_lib.RoundPlan.from_bytes(plan_bytes)
        except serialization.SerializationError as e:
            raise protocol.BadRequest(
                f"Expected blob {body.plan} to be a round plan (RoundPlan.to_bytes()): {e}"
            ) from e
        try:
            serialization.deserialize_value(
                self.store.get_blob(body.broadcast), expected_type=round_plan.broadcast_type
            )
        except serialization.SerializationError as e:
            raise protocol.BadRequest(
                f"Expected blob {body.broadcast} to be the plan's broadcast value: {e}"
            ) from e
        kind, on_create = store_lib.AGGREGATE, None
        if round_plan.secure:  # its secure inputs go only through SecAgg+
            kind, on_create = store_lib.SECURE, self.secure.prepare(round_plan, options)
        signed = self.store.put_blob(signing.sign(plan_bytes, self.key))
        empty = aggregation.Folder(round_plan).empty()
        return self.store.create_round(
            body.population, signed, body.broadcast, options, empty, body.request_id, kind,
            on_create,
        )

    def close_due(self) -> None:
        """Closes the rounds, and the secure rounds' stages, whose time is up."""
        self.store.close_due_rounds()
        self.secure.close_due()

    # -- clients

    async def report(self, request: fastapi.Request, round_id: int, client_id: str) -> bool:
        r = await concurrency.run_in_threadpool(self.store.round, round_id)
        folder = await concurrency.run_in_threadpool(self.folder, r.plan)
        limit = folder.max_report_bytes + (1 << 20)
        try:
            data = await _read_limited(request, limit)
            digest = protocol.blob_hash(data)
            if await concurrency.run_in_threadpool(
                self.store.precheck_report, round_id, client_id, digest
            ):
                return False  # a replay of an accepted report
            try:
                checked = await concurrency.run_in_threadpool(folder.check, data)
            except aggregation.ReportError as e:
                raise protocol.BadRequest(str(e), reason=e.reason) from e
            return await concurrency.run_in_threadpool(
                self.store.accept_report,
                round_id,
                client_id,
                digest,
                len(data),
                lambda aggregate: folder.fold(aggregate, checked),
            )
        except protocol.ProtocolError as e:
            await concurrency.run_in_threadpool(self.store.count_refusal, e.reason, round_id)
            raise

    def status(self) -> dict[str, Any]:
        counters = self.store.counters()
        refused = {k.split(":", 1)[1]: v for k, v in counters.items() if k.startswith("refused:")}
        return {
            "server": {"version": VERSION, "public_key": plan_lib.b64(self.public_key)},
            "populations": self.store.populations(),
            "rounds": [r.to_json() for r in self.store.rounds()],
            "enrollments": counters.get("enrollments", 0),
            "checkins": counters.get("checkins", 0),
            "assignments": counters.get("assignments", 0),
            "reports": {
                "accepted": counters.get("reports:accepted", 0),
                "refused": refused,
                "late": refused.get("late", 0),
            },
            "dropouts": counters.get("dropouts", 0),
            "rounds_closed": counters.get("rounds:closed", 0),
            "rounds_failed": counters.get("rounds:failed", 0),
            "sessions": [self.sessions.status(s) for s in self.sessions.sessions()],
        }




def _round_out(r: store_lib.Round) -> dict[str, Any]:
    return r.to_json()


def create_app(server: App, tick: float = 1.0) -> fastapi.FastAPI:
    """The FastAPI application of `server`; `tick` is how often deadlines are checked."""

    @contextlib.asynccontextmanager
    async def lifespan(_: fastapi.FastAPI) -> AsyncIterator[None]:
        async def close_due() -> None:
            while True:
                await asyncio.sleep(tick)
                with contextlib.suppress(Exception):  # a database hiccup: try next tick
                    await concurrency.run_in_threadpool(server.close_due)

        task = asyncio.create_task(close_due())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = fastapi.FastAPI(
        title="fedlang task store",
        version=VERSION,
        description="Clients pull tasks, run them on their own data and push reports. "
        "See docs/deploy.md, 'The protocol'.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )

    @app.exception_handler(protocol.ProtocolError)
    async def refused(_: fastapi.Request, e: protocol.ProtocolError) -> responses.JSONResponse:
        return responses.JSONResponse({"detail": str(e), "reason": e.reason}, status_code=e.status)

    v1 = fastapi.APIRouter(prefix=protocol.API)

    # -- admin: the driver

    @v1.post("/admin/populations", status_code=201, tags=["admin"])
    def create_population(body: schemas.PopulationIn, auth: Bearer) -> schemas.PopulationOut:
        """Creates a population; the answer holds its enrollment token (shown only here)."""
        server.check_admin(auth)
        return schemas.PopulationOut(name=body.name, token=server.store.create_population(body.name))

    @v1.get("/admin/populations", tags=["admin"])
    def list_populations(auth: Bearer) -> list[schemas.PopulationInfo]:
        """The populations with their enrolled client counts."""
        server.check_admin(auth)
        return [schemas.PopulationInfo(**p) for p in server.store.populations()]

    @v1.post("/admin/populations/{name}/finish", tags=["admin"])
    def finish_population(name: Population, auth: Bearer) -> schemas.PopulationInfo:
        """Marks a population finished: its clients stop at their next check-in."""
        server.check_admin(auth)
        server.store.finish_population(name)
        return next(schemas.PopulationInfo(**p) for p in server.store.populations()
                    if p["name"] == name)

    @v1.post("/admin/blobs", status_code=201, tags=["admin"], openapi_extra=BINARY_BODY)
    async def upload_blob(request: fastapi.Request, auth: Bearer) -> schemas.BlobOut:
        """Stores a blob (a plan, a broadcast value) under the SHA-256 of its bytes."""
        server.check_admin(auth)
        data = await _read_limited(request, server.max_blob_bytes)
        h = await concurrency.run_in_threadpool(server.store.put_blob, data)
        return schemas.BlobOut(hash=h, size=len(data))

    @v1.post("/admin/rounds", status_code=201, tags=["admin"])
    def create_round(body: schemas.RoundIn, auth: Bearer) -> schemas.RoundOut:
        """Opens a round: the server signs the plan, clients can be assigned at once.
        A repeated `request_id` returns the round it made (safe to retry)."""
        server.check_admin(auth)
        return schemas.RoundOut(**_round_out(server.create_round(body)))

    @v1.get("/admin/rounds/{round_id}", tags=["admin"])
    async def round_status(
        round_id: RoundId,
        auth: Bearer,
        wait: Annotated[float, fastapi.Query(ge=0, le=60)] = 0.0,
        seen: Annotated[int, fastapi.Query(ge=-1, le=2**62)] = -1,
    ) -> schemas.RoundOut:
        """A round's state; with `wait`, answers when the round is no longer open, when
        its report count differs from `seen`, when a secure round's stage changes, or after
        `wait` seconds (long polling)."""
        server.check_admin(auth)
        end = time.monotonic() + wait
        stage = None
        while True:
            r = await concurrency.run_in_threadpool(server.store.round, round_id)
            stage = r.stage if stage is None else stage
            if (r.state != store_lib.OPEN or r.reports != seen or r.stage != stage
                    or time.monotonic() >= end):
                return schemas.RoundOut(**_round_out(r))
            await asyncio.sleep(min(0.1, max(0.0, end - time.monotonic())))

    @v1.get("/admin/rounds/{round_id}/aggregate", tags=["admin"], responses=BINARY_RESPONSE,
            response_class=responses.Response)
    def round_aggregate(round_id: RoundId, auth: Bearer) -> responses.Response:
        """The aggregate of a closed round (the binary value format, of the plan's
        report type): every accepted report folded in."""
        server.check_admin(auth)
        r, data = server.store.aggregate(round_id)
        if r.state == store_lib.FAILED:
            raise protocol.Conflict(r.failure, reason="failed")
        if r.state != store_lib.CLOSED:
            raise protocol.Conflict(
                f"Expected a closed round, found round {round_id} open ({r.reports} of "
                f"{r.target} reports); wait for it with GET /v1/admin/rounds/{round_id}?wait=30."
            )
        return _binary(data)

    # -- clients

    @v1.post("/populations/{name}/enroll", status_code=201, tags=["client"])
    def enroll(name: Population, auth: Bearer) -> schemas.EnrollOut:
        """Enrolls a client with the population's token. Keep the credential; pin the
        server's public key: every plan the client runs must be signed by it."""
        client_id, credential, expires = server.store.enroll(
            name, _token(auth, "the population's enrollment token"), server.credential_ttl
        )
        return schemas.EnrollOut(
            client_id=client_id,
            credential=credential,
            expires=expires,
            public_key=plan_lib.b64(server.public_key),
        )

    @v1.post("/checkin", tags=["client"])
    def checkin(auth: Bearer) -> schemas.CheckinOut:
        """A task, or how many seconds to wait before checking in again (pace steering),
        or `finished` when the population has no more work."""
        client_id, population = server.client(auth)
        got = server.store.checkin(client_id, population)
        if got is None:
            return schemas.CheckinOut(finished=True)
        if not isinstance(got, store_lib.Task):  # no round task: a buffered session's?
            buffered = server.sessions.checkin(client_id, population)
            if buffered is not None:
                return schemas.CheckinOut(task=schemas.TaskOut(
                    round=buffered.session, plan=buffered.plan, broadcast=buffered.weights,
                    deadline=0.0, seconds_left=0.0, kind=async_store.KIND,
                    version=buffered.version,
                ))
        if isinstance(got, store_lib.Task):
            return schemas.CheckinOut(task=schemas.TaskOut(
                round=got.round, plan=got.plan, broadcast=got.broadcast, deadline=got.deadline,
                seconds_left=max(0.0, got.deadline - server.store.clock()), kind=got.kind,
            ))
        return schemas.CheckinOut(retry_after=got)

    @v1.get("/blobs/{blob}", tags=["client"], responses=BINARY_RESPONSE,
            response_class=responses.Response)
    def download_blob(
        blob: BlobHash,
        auth: Bearer,
        if_none_match: Annotated[str | None, fastapi.Header()] = None,
    ) -> responses.Response:
        """A blob by hash (immutable: cache it; `If-None-Match` gives 304)."""
        try:
            server.check_admin(auth)
        except protocol.Unauthorized:
            server.client(auth)
        if if_none_match is not None and if_none_match.strip('"') == blob:
            if not server.store.has_blob(blob):
                raise protocol.NotFound(f"Expected the hash of a stored blob, found {blob!r}.")
            return responses.Response(status_code=304, headers={"ETag": f'"{blob}"'})
        return _binary(server.store.get_blob(blob), blob)

    @v1.put("/rounds/{round_id}/report", tags=["client"], openapi_extra=BINARY_BODY)
    async def upload_report(
        round_id: RoundId, request: fastapi.Request, auth: Bearer
    ) -> schemas.ReportOut:
        """Uploads this client's report for its task (the binary value format, of the
        plan's report type). Idempotent: the same bytes again change nothing."""
        client_id, _ = await concurrency.run_in_threadpool(server.client, auth)
        new = await server.report(request, round_id, client_id)
        return schemas.ReportOut(round=round_id, accepted=True, replay=not new)

    # -- public

    @v1.get("/status", tags=["status"])
    def status() -> schemas.StatusOut:
        """Rounds, check-ins, reports accepted and refused (by reason), late reports and
        dropouts."""
        return schemas.StatusOut(**server.status())

    from fedlang.deploy import secure_http  # it builds on this module's helpers

    secure_http.add_routes(v1, server)
    from fedlang.deploy import async_http  # likewise

    async_http.add_routes(v1, server)
    app.include_router(v1)
    return app


def _free_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


class Server:
    """A task store server, from Python (see the module docstring).

    Args:
      db: the database: `sqlite:///PATH`, a file path, or `postgresql://...`.
      host: the address to listen on.
      port: the port (0: any free port; see `url`).
      admin_token: the admin endpoints' bearer token (default: one kept in the database,
        made on first start).
      key: the plan-signing key: an Ed25519 private key, a key file (made if missing), or
        None for one kept in the database, made on first start and never regenerated.
      pace: pace steering of check-ins (`store.Pace`).
      credential_ttl: seconds a client credential stays valid.
      ssl_keyfile, ssl_certfile: serve HTTPS (uvicorn's TLS).
      clock: the time (tests pass their own).
      tick: seconds between checks of round deadlines.
      browser: also serve the browser client (`/browser/fedlang.js` and onnxruntime-web,
        `fedlang.deploy.browser.routes`).
      demo_page: also serve the demo page at `/demo/` (implies `browser`).
      log_level: uvicorn's log level.
      access_log: log one line per request (uvicorn's access log: method, path, status;
        never a body).

    Example:
      >>> with Server(db="/tmp/fl.db", port=0) as server:  # doctest: +SKIP
      ...     print(server.url, server.admin_token)
    """

    def __init__(
        self,
        db: str | os.PathLike[str] = "fedlang.db",
        host: str = "127.0.0.1",
        port: int = 8000,
        admin_token: str | None = None,
        key: Any = None,
        *,
        pace: store_lib.Pace | None = None,
        credential_ttl: float = 30 * 86400,
        max_blob_bytes: int = 1 << 30,
        ssl_keyfile: str | None = None,
        ssl_certfile: str | None = None,
        clock: Callable[[], float] = time.time,
        tick: float = 1.0,
        log_level: str = "warning",
        browser: bool = False,
        demo_page: bool = False,
        access_log: bool = False,
    ):
        self.store = store_lib.Store(db, clock=clock, pace=pace)
        if admin_token is None:
            admin_token = self.store.setdefault_meta(
                "admin_token", secrets.token_urlsafe(24).encode()
            ).decode()
        self.admin_token = admin_token
        self.app_state = App(self.store, load_key(key, self.store), admin_token, credential_ttl,
                             max_blob_bytes)
        self.public_key = self.app_state.public_key
        self.app = create_app(self.app_state, tick)
        if browser or demo_page:
            from fedlang.deploy.browser import routes

            routes.mount(self.app, demo=demo_page)
        self.host = host
        self._sock = _free_socket(host, port)
        self.port = self._sock.getsockname()[1]
        scheme = "https" if ssl_certfile else "http"
        shown = f"[{host}]" if ":" in host else host
        self.url = f"{scheme}://{shown}:{self.port}"
        self._config = uvicorn.Config(
            self.app, log_level=log_level, access_log=access_log, ssl_keyfile=ssl_keyfile,
            ssl_certfile=ssl_certfile, timeout_graceful_shutdown=5,
        )
        self._uvicorn = uvicorn.Server(self._config)
        self._thread: threading.Thread | None = None

    def serve(self) -> None:
        """Serves until interrupted (Ctrl-C or SIGTERM)."""
        try:
            self._uvicorn.run(sockets=[self._sock])
        finally:
            self.close()

    def start(self, timeout: float = 30.0) -> Server:
        """Serves on a background thread; returns once the server accepts requests."""
        self._thread = threading.Thread(
            target=self._uvicorn.run, kwargs={"sockets": [self._sock]}, daemon=True,
            name="fedlang-server",
        )
        self._thread.start()
        end = time.monotonic() + timeout
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > end:
                self.stop()
                raise RuntimeError(f"Expected the server to start within {timeout} s; it did not.")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        """Stops serving and closes the database."""
        self._uvicorn.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        self.close()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._sock.close()
        self.store.close()

    def __enter__(self) -> Server:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()
