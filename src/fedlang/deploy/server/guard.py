"""What every request passes before any route reads its body (issue 23, item 1).

A route's body parameters are parsed by FastAPI before the route's own code runs, so a
check written in the route comes after the server has read, held and parsed whatever a
stranger sent. `Guard`, an ASGI middleware in front of every route, does two things
first, in this order:

1. a request for an admin route (`/v1/admin/...`) must carry the admin token, or it is
   refused (401) before a byte of its body is read;
2. a request for any route but the binary uploads is read up to `JSON_LIMIT` bytes and
   refused (413) past it, from its declared length or as it streams in. The binary
   uploads (reports, secure-aggregation answers, blobs) read their own bodies with the
   limit of their task (`intake.read_limited`), after checking their caller.

So no request without a credential costs the server more than its headers and
`JSON_LIMIT` bytes, and the answer to a tokenless admin request is 401 whatever its body
(counted apart from the refused reports, as `admin_refused:unauthorized`: `admin_refused`
in `GET /v1/status`, `fedlang_admin_requests_refused_total` in `/metrics`). Every other
admin request that may change something (not GET) is recorded in the audit table with
its answer's status (`Store.audit`, read at `GET /v1/admin/audit`), and logged.

A body that stalls (nothing of it arrives for `body_timeout` seconds, e.g. an upload
sent half and held) is answered 408 and its connection closed, for every route: the
`receive` every route reads its body from is wrapped here. (Headers that never end are
the server's own: `serve.HeaderTimeout`.)
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections.abc import Iterable

from fastapi import responses, routing
from starlette import concurrency, datastructures
from starlette import routing as starlette_routing
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fedlang.deploy import protocol
from fedlang.deploy.server import auth
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import metrics as metrics_lib

# The largest body of a JSON route: every one holds a few names, hashes and numbers.
JSON_LIMIT = 64 << 10
ADMIN = f"{protocol.API}/admin/"
audit_log = logging.getLogger("fedlang.deploy.server.audit")


def refusal(e: protocol.ProtocolError) -> responses.JSONResponse:
    """The answer to a refused request: its status, the message and the reason (and,
    for a rate limit, `Retry-After`: whole seconds, rounded up)."""
    headers = None
    if isinstance(e, protocol.RateLimited):
        headers = {"Retry-After": str(max(1, math.ceil(e.retry_after)))}
    return responses.JSONResponse({"detail": str(e), "reason": e.reason}, status_code=e.status,
                                  headers=headers)


class Guard:
    """The checks before any body is read (see the module docstring)."""

    def __init__(
        self, app: ASGIApp, server: state_lib.ServerState, binary: Iterable[routing.APIRoute],
        body_timeout: float = 30.0,
    ) -> None:
        self.app, self.server, self.binary = app, server, tuple(binary)
        self.body_timeout = body_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        receive = _stall_bounded(receive, self.body_timeout)
        admin = scope["path"].startswith(ADMIN)
        try:
            if admin:
                headers = datastructures.Headers(scope=scope)
                try:
                    auth.admin_header(self.server, headers.get("authorization"))
                except protocol.Unauthorized:
                    await concurrency.run_in_threadpool(
                        metrics_lib.count_admin_refusal, self.server.store, "unauthorized")
                    raise
            if not self._reads_own_body(scope):
                receive = await _bounded(scope, receive)
        except protocol.ProtocolError as e:
            if admin and not isinstance(e, protocol.Unauthorized):
                await self._audit(scope, e.status)
            await refusal(e)(scope, receive, send)
            return
        if not admin or scope["method"] in ("GET", "HEAD"):
            await self.app(scope, receive, send)
            return

        async def sending(message: Message) -> None:
            # recorded before the caller sees the answer, so the log's order is the
            # order in which the admin saw its requests answered
            if message["type"] == "http.response.start":
                await self._audit(scope, message["status"])
            await send(message)

        await self.app(scope, receive, sending)

    async def _audit(self, scope: Scope, status: int) -> None:
        """Records an admin request that may change something (the audit table)."""
        client = scope.get("client")
        remote = f"{client[0]}:{client[1]}" if client else ""
        await concurrency.run_in_threadpool(
            self.server.store.audit, scope["method"], scope["path"], status, remote)
        audit_log.info(  # and in the server's log, with the request's id
            "admin action: %s %s answered %d (from %s)", scope["method"], scope["path"], status,
            remote, extra={"audit": True, "method": scope["method"], "path": scope["path"],
                           "status": status, "remote": remote},
        )

    def _reads_own_body(self, scope: Scope) -> bool:
        return any(r.matches(scope)[0] == starlette_routing.Match.FULL for r in self.binary)


async def _bounded(scope: Scope, receive: Receive) -> Receive:
    """Reads the whole body, at most `JSON_LIMIT` bytes, and returns a `receive` that
    gives it to the route (then whatever the client sends next, e.g. a disconnect).

    Raises:
      TooLarge: a declared or actual length above the limit.
    """
    declared = datastructures.Headers(scope=scope).get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > JSON_LIMIT:
        raise protocol.TooLarge(f"Expected a body of at most {JSON_LIMIT} bytes, found {declared}.")
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] != "http.request":  # the client went away
            return _replay([message], receive)
        size += len(message.get("body", b""))
        if size > JSON_LIMIT:
            raise protocol.TooLarge(f"Expected a body of at most {JSON_LIMIT} bytes, found more.")
        chunks.append(message.get("body", b""))
        if not message.get("more_body", False):
            break
    return _replay([{"type": "http.request", "body": b"".join(chunks), "more_body": False}], receive)


def _stall_bounded(receive: Receive, timeout: float) -> Receive:
    """`receive`, raising `Timeout` when the next part of the body takes more than
    `timeout` seconds to arrive (once the body is whole, waits are not bounded: a long
    poll waits for the client to go away)."""
    whole = False

    async def bounded() -> Message:
        nonlocal whole
        if whole:
            return await receive()
        try:
            async with asyncio.timeout(timeout):  # a timer, not a task per chunk
                message = await receive()
        except TimeoutError:
            raise protocol.Timeout(
                f"Expected the request's body to go on arriving, found nothing for "
                f"{timeout:g} s; send it again."
            ) from None
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return bounded


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
