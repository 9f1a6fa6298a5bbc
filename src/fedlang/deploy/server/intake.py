"""The one upload pipeline: every upload of every mode is taken here.

A plain round's report (`PUT /v1/rounds/{round}/report`), a secure round's answer to a
stage (`PUT /v1/rounds/{round}/secagg/{stage}`) and a buffered session's report for a
model version (`PUT /v1/sessions/{session}/reports/{version}`) go through the same
steps (`take`):

1. authenticate the client (401; counted as `refused:unauthorized` or `expired`);
2. find the task, its plan, and the largest body it can take (404 for no such task);
3. read the body, refused (413) as soon as it exceeds that limit;
4. admit it (`store.admission`: a replay is accepted again and changes nothing; 409
   another upload, 403 not assigned, 410 closed, and the mode's own refusals), before
   anything is decoded;
5. check it against the plan (400 with the reason: `malformed`, `too_large`,
   `non_finite`, `not_one_client`, or the protocol's `secagg`), then against the
   bounds the plan declares (`plans.bounds`: per leaf a range, L2 norms of groups of
   leaves; 400 `out_of_bounds` naming the leaf and the bound), here for every mode;
6. accept it in one transaction, which admits it again with the task locked and folds
   (a round: with the other reports waiting, into this process's shard of its aggregate,
   `store.shards`) or stores (a session) it, answering only once it is committed; a
   report that would make a round's aggregate overflow to infinity is refused there (400
   `overflow`), and nothing of it is kept;

and every refusal from step 3 on is counted (`refused:REASON` in `GET /v1/status`, and
in the task: `Uploads.count_refusal`).

A mode is an `Uploads`: how to find its tasks, its limit, its admission, its check and
how it accepts (`rounds.ReportUploads`, `secure.AnswerUploads`,
`sessions.ReportUploads`, and an edge aggregator's partial aggregate of a round,
`edges.PartialUploads`, whose uploader is an edge authenticated by its token: `take`'s
`authenticate`). A new mode writes one; a check every upload must pass (a bound the
plan declares, a limit) is added here, once, not in the modes.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, Generic, Protocol, TypeVar

import fastapi
from fastapi import security
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import state as state_lib

T = TypeVar("T")
# (server, the request's bearer) -> (uploader, population); raises Unauthorized.
Authenticate = Callable[
    [state_lib.ServerState, security.HTTPAuthorizationCredentials | None], tuple[str, str]
]


@dataclasses.dataclass(frozen=True)
class Upload:
    """One upload as the intake took it.

    Attributes:
      client: the uploading client's id.
      population: its population.
      slot: which of the task's uploads it is: 0 for a round's report, a secure round's
        stage, a buffered session's model version.
      body: the bytes.
      digest: their SHA-256 (hex), by which replays are recognized.
      checked: what the mode's `check` made of them (e.g. the decoded report).
    """

    client: str
    population: str
    slot: int
    body: bytes
    digest: str = ""
    checked: Any = None


class Uploads(Protocol, Generic[T]):
    """One mode's uploads, as the intake takes them (see the module docstring). `T` is
    the mode's task (its row: a round, a session)."""

    def target(self, task_id: int) -> T:
        """The task uploads go to. Raises NotFound."""

    def limit(self, target: T, slot: int) -> int:
        """The largest body an upload to `slot` of the task may have, in bytes."""

    def precheck(self, target: T, upload: Upload) -> bool:
        """Whether this upload was accepted before (a replay); raises what `accept` would."""

    def check(self, target: T, upload: Upload) -> Any:
        """The upload's body, decoded and checked against the plan. Raises ReportError."""

    def bounded(self, target: T, upload: Upload) -> tuple[bounds_lib.Bounds, dict[str, Any]] | None:
        """The plan's report bounds and the checked upload's report leaves by path (as
        the bounds name them); None when the upload holds no plain report."""

    def accept(self, target: T, upload: Upload) -> bool | futures.Future[bool]:
        """Accepts the checked upload in one transaction; False for a replay. A mode
        that commits uploads in groups (a round's reports: `store.shards`) answers a
        future of that, resolved once its group is committed, which `take` awaits on
        the event loop: the thread is free for the next upload meanwhile."""

    def count_refusal(self, reason: str, target: T) -> None:
        """Counts a refused upload (`refused:REASON`, and in the task)."""


async def read_limited(request: fastapi.Request, limit: int) -> bytes:
    """The request body, refused before it is read whole if it exceeds `limit` bytes.

    Raises:
      TooLarge: a declared or actual length above `limit`.
    """
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


async def take(
    server: state_lib.ServerState,
    request: fastapi.Request,
    auth: security.HTTPAuthorizationCredentials | None,
    uploads: Uploads[T],
    task_id: int,
    slot: int = 0,
    authenticate: Authenticate | None = None,
) -> bool:
    """Takes one upload to `slot` of task `task_id` (see the module docstring); returns
    False for a replay of an accepted upload (nothing changed). `authenticate` says who
    uploads (`Upload.client`, `Upload.population`): a client by its credential, by
    default (an edge's partial: the edge by its token).

    Raises:
      ProtocolError: the refusal (counted, from reading the body on).
    """
    who = authenticate or auth_lib.client
    # two hops to the thread pool (each costs a thread handoff): the caller and the
    # task in one read transaction, then the admission, check and accept
    client_id, population, target, limit = await concurrency.run_in_threadpool(
        _find, server, auth, who, uploads, task_id, slot
    )
    try:
        body = await read_limited(request, limit)
        accepted = await concurrency.run_in_threadpool(
            _admit_check_accept, uploads, target, Upload(client_id, population, slot, body)
        )
        if isinstance(accepted, futures.Future):
            with _as_bad_request():
                return await asyncio.wrap_future(accepted)
        return accepted
    except protocol.ProtocolError as e:
        await concurrency.run_in_threadpool(uploads.count_refusal, e.reason, target)
        raise


def _find(
    server: state_lib.ServerState,
    auth: security.HTTPAuthorizationCredentials | None,
    who: Authenticate,
    uploads: Uploads[T],
    task_id: int,
    slot: int,
) -> tuple[str, str, T, int]:
    """(uploader, population, task, limit), read in one transaction (`Store.reading`)."""
    with server.store.reading():
        client_id, population = who(server, auth)
        target = uploads.target(task_id)
    return client_id, population, target, uploads.limit(target, slot)


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
    """folding's refusals as a bad request (400, with their reason): a report that is
    malformed or out of bounds, or that would make the aggregate overflow (refused on
    accepting it: its transaction left nothing changed)."""
    try:
        yield
    except folding.ReportError as e:
        raise protocol.BadRequest(str(e), reason=e.reason) from e


def _admit_and_check(uploads: Uploads[T], target: T, upload: Upload) -> Upload | None:
    """The upload with its digest and checked value, or None for a replay."""
    upload = dataclasses.replace(upload, digest=protocol.blob_hash(upload.body))
    if uploads.precheck(target, upload):
        return None
    with _as_bad_request():
        upload = dataclasses.replace(upload, checked=uploads.check(target, upload))
        bounded = uploads.bounded(target, upload)
        if bounded is not None:
            folding.check_bounds(*bounded)
    return upload
