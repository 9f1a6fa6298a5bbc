"""The one upload pipeline: every upload of every mode is taken here.

A plain round's report (`PUT /v1/rounds/{round}/report`), a secure round's answer to a
stage (`PUT /v1/rounds/{round}/secagg/{stage}`), a buffered session's report for a
model version (`PUT /v1/sessions/{session}/reports/{version}`), and an edge aggregator's
uploads, which stand for its clients' reports (a round's partial aggregate, `PUT
/v1/edge/rounds/{round}/partial`; a session's batch, `PUT
/v1/edge/sessions/{session}/batches/{batch}`), go through the same steps (`take`):

1. authenticate the uploader (401; counted as `refused:unauthorized` or `expired`): a
   client by its credential, an edge by its token (`auth.Uploader`);
2. find the task in the uploader's population, its plan, and the largest body it can
   take (404 for no such task, or one of another population: nothing read, not counted);
   then check that the upload was computed for this task, by the task its header
   `Fedlang-Task` names (`protocol.read_task_header`: its round, or its session and
   version, `Uploads.task`): one computed for another round, session or version is
   refused (409 `stale`), one without the header too (400 `unbound`, naming what to
   send), both before a byte of the body is read, and counted;
3. read the body, refused (413) as soon as it exceeds that limit or the server's limit
   on every upload (`fedlang serve --max-report-bytes`), the refusal naming which. A
   large model's report (`Uploads.scan`: a round whose reports are sums and may hold
   more than `--stream-report-bytes`) is never held: each piece is checked as it
   arrives (`folding.ReportScan`: its header before any tensor, each tensor's length,
   finiteness and summary for the bounds) and written to storage in chunks
   (`values.Staging`), and a refusal comes as soon as a piece is wrong;
4. admit it (`store.admission`: a replay is accepted again and changes nothing; 409
   another upload, 403 not assigned, 410 closed, and the mode's own refusals), before
   anything is decoded;
5. check it against the plan (400 with the reason: `malformed`, `too_large`,
   `non_finite`, `not_one_client`, or the protocol's `secagg`), then against the
   bounds the plan declares (`plans.bounds`: per leaf a range, L2 norms of groups of
   leaves; 400 `out_of_bounds` naming the leaf and the bound), here for every mode (each
   report of a batch; a partial aggregate is no one client's report: its edge bounded
   each of its clients' reports by the same signed plan);
6. accept it in one transaction, which admits it again with the task locked and folds
   (a round: with the other uploads waiting, into this process's shard of its aggregate,
   `store.shards`) or stores (a session) it, answering only once it is committed; an
   upload that would make a round's aggregate overflow to infinity is refused there (400
   `overflow`), and nothing of it is kept;

and every refusal from the task's header on is counted (`refused:REASON` in `GET
/v1/status`, and in the task: `Uploads.count_refusal`).

A mode is an `Uploads`: how to find its tasks, which task an upload answers, its limit,
its admission, its check and how it accepts (`rounds.ReportUploads`, `secure.AnswerUploads`,
`sessions.ReportUploads`), for its clients and its edges alike. A new mode writes one; a
check every upload must pass (a bound the plan declares, a limit) is added here, once,
not in the modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import typing
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent import futures
from typing import Annotated, Any, Generic, Protocol, TypeVar

import fastapi
from fastapi import security
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import values

T = TypeVar("T")
# Every upload route's `Fedlang-Task` header (`protocol.TASK_HEADER`), declared in its
# OpenAPI schema and passed to `take`, which refuses an upload without it (400
# `unbound`, counted, with the header to send: not FastAPI's 422).
TaskHeader = Annotated[str | None, fastapi.Header(
    alias=protocol.TASK_HEADER,
    description="The task this upload was computed for: canonical JSON of its round, "
    "session and version (protocol.task_header: the fields of the check-in's task; an "
    "edge: the root task's round, or its session). Required: an upload computed for another "
    "task is refused (409, reason `stale`), one without it (400, `unbound`), both before "
    "its body is read.",
    examples=['{"round":3,"session":null,"version":null}'],
)]
# (server, the request's bearer) -> the uploader; raises Unauthorized.
Authenticate = Callable[
    [state_lib.ServerState, security.HTTPAuthorizationCredentials | None], auth_lib.Uploader
]


@dataclasses.dataclass(frozen=True)
class Upload:
    """One upload as the intake took it.

    Attributes:
      uploader: who uploads (a client, or an edge for its clients).
      slot: which of the task's uploads it is: 0 for a round's report, a secure round's
        stage, a buffered session's model version (an edge's batch: its number).
      body: the bytes (b"" for an upload taken as it arrived: `staging`).
      size: how many bytes it has.
      digest: their SHA-256 (hex), by which replays are recognized.
      checked: what the mode's `check` made of them (e.g. the decoded report).
      scan: for an upload taken as it arrived (`Uploads.scan`), its check, fed every
        byte; `staging`: where its bytes were written.
    """

    uploader: auth_lib.Uploader
    slot: int
    body: bytes = b""
    size: int = 0
    digest: str = ""
    checked: Any = None
    scan: folding.ReportScan | None = None
    staging: values.Staging | None = None

    @property
    def client(self) -> str:
        """The uploader's id: a client's, or an edge's (`edge:NAME`)."""
        return self.uploader.id


class Uploads(Protocol, Generic[T]):
    """One mode's uploads, as the intake takes them (see the module docstring). `T` is
    the mode's task (its row: a round, a session)."""

    def target(self, task_id: int, uploader: auth_lib.Uploader) -> T:
        """The task uploads go to. Raises NotFound (also for a task of another
        population than the uploader's)."""

    def task(self, target: T, upload: Upload) -> dict[str, int | None]:
        """The task the upload must have been computed for (`protocol.task_of`: round,
        session, version), which its `Fedlang-Task` header must name."""

    def limit(self, target: T, upload: Upload) -> int:
        """The largest body the upload (its uploader and slot known, not its body) may
        have, in bytes."""

    def scan(self, target: T, upload: Upload) -> folding.ReportScan | None:
        """A check to feed the upload's bytes as they arrive, when it is taken so (a
        large model's report: never held, written to storage as it arrives); None to
        read it whole."""

    def precheck(self, target: T, upload: Upload) -> bool:
        """Whether this upload was accepted before (a replay); raises what `accept` would."""

    def check(self, target: T, upload: Upload) -> Any:
        """The upload's body, decoded and checked against the plan (and its bounds,
        where the upload holds several reports). Raises ReportError."""

    def bounded(self, target: T, upload: Upload) -> tuple[bounds_lib.Bounds, dict[str, Any]] | None:
        """The plan's report bounds and the checked upload's report leaves by path (as
        the bounds name them); None when the upload holds no one client's plain report."""

    def accept(self, target: T, upload: Upload) -> bool | futures.Future[bool]:
        """Accepts the checked upload in one transaction; False for a replay. A mode
        that commits uploads in groups (a round's: `store.shards`) answers a future of
        that, resolved once its group is committed, which `take` awaits on the event
        loop: the thread is free for the next upload meanwhile."""

    def count_refusal(self, reason: str, target: T) -> None:
        """Counts a refused upload (`refused:REASON`, and in the task)."""


class Owned(Protocol):
    """A task's row, as far as `visible` reads it."""

    @property
    def id(self) -> int: ...

    @property
    def population(self) -> str: ...


TaskT = TypeVar("TaskT", bound=Owned)


def visible(task: TaskT, who: auth_lib.Uploader, what: str) -> TaskT:
    """`task` (a round, a session: `what`), if it is of the population of `who`; else
    NotFound, as for no such task: populations are isolated."""
    if task.population != who.population:
        raise protocol.NotFound(f"Expected an existing {what} id, found {task.id}.")
    return task


@dataclasses.dataclass(frozen=True)
class Limit:
    """The largest body an upload may have, and what sets it (said in a refusal)."""

    most: int
    source: str

    def refuse(self, found: str) -> protocol.TooLarge:
        return protocol.TooLarge(
            f"Expected an upload of at most {self.most} bytes ({self.source}), found {found}.")


def upload_limit(server: state_lib.ServerState, task_limit: int) -> Limit:
    """The smaller of what a task's plan lets an upload hold and the server's limit on
    every upload (`fedlang serve --max-report-bytes`)."""
    if server.max_report_bytes < task_limit:
        return Limit(server.max_report_bytes, "fedlang serve --max-report-bytes raises it")
    return Limit(task_limit, "what the task's plan lets it hold")


async def read_limited(request: fastapi.Request, limit: int | Limit) -> bytes:
    """The request body, refused before it is read whole if it exceeds `limit` bytes:
    before reading anything when its declared length does.

    Raises:
      TooLarge: a declared or actual length above `limit`, naming what sets it.
    """
    if not isinstance(limit, Limit):
        limit = Limit(limit, "this route's limit")
    # one buffer of the declared size, filled as the body arrives (chunks then their
    # join held a body twice)
    body = bytearray(_declared(request, limit))
    size = 0
    async for chunk in _limited(request, limit):
        body[size:size + len(chunk)] = chunk  # in place (past the end, undeclared: grows)
        size += len(chunk)
    del body[size:]
    return typing.cast(bytes, body)  # a bytearray: every reader of bytes here takes it


def _declared(request: fastapi.Request, limit: Limit) -> int:
    """The body's declared length (0 if none), refused (413) above `limit`."""
    declared = request.headers.get("content-length")
    if declared is None or not declared.isdigit():
        return 0
    if int(declared) > limit.most:
        raise limit.refuse(f"{declared} bytes")
    return int(declared)


async def _limited(request: fastapi.Request, limit: Limit) -> AsyncIterator[bytes]:
    """The body's pieces as they arrive, refused (413) once they pass `limit` (its
    declared length is checked first: `_declared`)."""
    size = 0
    async for piece in request.stream():
        size += len(piece)
        if size > limit.most:
            raise limit.refuse("more")
        yield piece


async def take(
    server: state_lib.ServerState,
    request: fastapi.Request,
    auth: security.HTTPAuthorizationCredentials | None,
    uploads: Uploads[T],
    task_id: int,
    slot: int = 0,
    authenticate: Authenticate = auth_lib.uploader,
    task: str | None = None,
) -> bool:
    """Takes one upload to `slot` of task `task_id` (see the module docstring); returns
    False for a replay of an accepted upload (nothing changed). `authenticate` says who
    uploads: a client by its credential, by default (an edge by its token: `auth.edge`);
    `task` is the request's `Fedlang-Task` header (`TaskHeader`): the task it was computed
    for.

    Raises:
      ProtocolError: the refusal (counted, from the task's header on).
    """
    # two hops to the thread pool (each costs a thread handoff): the caller and the
    # task in one read transaction, then the admission, check and accept
    target, upload, limit = await concurrency.run_in_threadpool(
        _find, server, auth, authenticate, uploads, task_id, slot
    )
    kept = False
    try:
        # before the body: an upload computed for another task costs nothing more
        protocol.read_task_header(task, uploads.task(target, upload))
        scan = uploads.scan(target, upload)
        if scan is None:
            body = await read_limited(request, limit)
            upload = dataclasses.replace(upload, body=body, size=len(body))
        else:  # written to storage as it arrives (discarded below unless accepted)
            upload = dataclasses.replace(upload, scan=scan,
                                         staging=values.Staging(server.store))
            await _read_into(request, limit, upload)
        accepted = await concurrency.run_in_threadpool(
            _admit_check_accept, uploads, target, upload
        )
        if isinstance(accepted, futures.Future):
            with _as_bad_request():
                accepted = await asyncio.wrap_future(accepted)
        kept = accepted
        return accepted
    except protocol.ProtocolError as e:
        await concurrency.run_in_threadpool(uploads.count_refusal, e.reason, target)
        raise
    finally:
        if upload.staging is not None and not kept:
            await concurrency.run_in_threadpool(upload.staging.discard)


async def _read_into(request: fastapi.Request, limit: Limit, upload: Upload) -> None:
    """Feeds the request body to the upload's check and writes it to its staged value,
    a chunk at a time (the thread pool takes a chunk's check and write: `values.CHUNK`
    bytes, not each piece the network gives), refused (413) as `read_limited` refuses."""
    assert upload.scan is not None and upload.staging is not None
    _declared(request, limit)
    pending = bytearray()
    async for piece in _limited(request, limit):
        pending += piece
        if len(pending) >= values.CHUNK:
            await concurrency.run_in_threadpool(_pass, upload, bytes(pending))
            pending.clear()
    if pending:
        await concurrency.run_in_threadpool(_pass, upload, bytes(pending))


def _pass(upload: Upload, data: bytes) -> None:
    """One chunk of a streamed upload: checked, then written (400 as soon as it is wrong)."""
    assert upload.scan is not None and upload.staging is not None
    with _as_bad_request():
        upload.scan.feed(data)
    upload.staging.write(data)


def _find(
    server: state_lib.ServerState,
    auth: security.HTTPAuthorizationCredentials | None,
    who: Authenticate,
    uploads: Uploads[T],
    task_id: int,
    slot: int,
) -> tuple[T, Upload, Limit]:
    """(task, the upload without its body, its limit), read in one transaction
    (`Store.reading`)."""
    with server.store.reading():
        uploader = who(server, auth)
        target = uploads.target(task_id, uploader)
    upload = Upload(uploader, slot)
    return target, upload, upload_limit(server, uploads.limit(target, upload))


def _admit_check_accept(
    uploads: Uploads[T], target: T, upload: Upload
) -> bool | futures.Future[bool]:
    """Admits, checks and accepts an upload (or submits it: `Uploads.accept`); False
    for a replay."""
    checked = _admit_and_check(uploads, target, upload)
    if checked is None:  # a replay
        return False
    with _as_bad_request():
        return uploads.accept(target, checked)


@contextlib.contextmanager
def _as_bad_request() -> Iterator[None]:
    """folding's refusals as a bad request (400, with their reason): an upload that is
    malformed or out of bounds, or that would make the aggregate overflow (refused on
    accepting it: its transaction left nothing changed)."""
    try:
        yield
    except folding.ReportError as e:
        raise protocol.BadRequest(str(e), reason=e.reason) from e


def _admit_and_check(uploads: Uploads[T], target: T, upload: Upload) -> Upload | None:
    """The upload with its digest and checked value, or None for a replay."""
    digest = upload.staging.sha256 if upload.staging is not None else protocol.blob_hash(upload.body)
    size = upload.staging.size if upload.staging is not None else len(upload.body)
    upload = dataclasses.replace(upload, digest=digest, size=size)
    if uploads.precheck(target, upload):
        return None
    with _as_bad_request():
        upload = dataclasses.replace(upload, checked=uploads.check(target, upload))
        bounded = uploads.bounded(target, upload)
        if bounded is not None:
            folding.check_bounds(*bounded)
    return upload
