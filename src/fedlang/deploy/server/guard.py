"""What every request passes before any route reads its body (issue 23, item 1).

A route's body parameters are parsed by FastAPI before the route's own code runs, so a
check written in the route comes after the server has read, held and parsed whatever a
stranger sent. `Guard`, an ASGI middleware in front of every route, does two things
first, in this order:

1. a request for an admin route (`/v1/admin/...`) must carry the admin token, or it is
   refused (401) before a byte of its body is read; an address that sent wrong admin
   tokens too often (`--admin-rate`, `--admin-burst`: `auth._check_admin`, the one
   comparison every route that takes the token makes) is refused (429) before its
   token is even compared, so a guesser gets no answer about its guesses;
2. a request that declares a body (`Content-Length` above 0, or `Transfer-Encoding`)
   to a route that takes none (every GET, check-in, enrollment, the joins, static
   files, no route at all) is refused at once (413, `body_not_allowed`), nothing of
   its body read (issue 36); a request for a route with a JSON body (`bodied`: admin
   routes only, their token checked in 1.) is read up to `JSON_LIMIT` bytes and
   refused (413) past it, from its declared length or as it streams in. The binary
   uploads (reports, secure-aggregation answers, blobs) read their own bodies with the
   limit of their task (`intake.read_limited`), after checking their caller.

So no request without a credential costs the server more than its headers (and, on an
admin route with the admin token, `JSON_LIMIT` bytes), and the answer to a tokenless
admin request is 401 (or 429) whatever its body, counted apart from the refused reports
as `admin_refused:unauthorized` (or `rate_limited`): `admin_refused` in `GET
/v1/status`, `fedlang_admin_requests_refused_total` in `/metrics`. Like the connection
budget's refusals, they are counted in memory and written within a second
(`telemetry.Refusals`): a flood of guesses costs the database a write a second. Every other
admin request that may change something (not GET) is recorded in the audit table with
its answer's status (`Store.audit`, read at `GET /v1/admin/audit`), and logged.

A body that stalls (nothing of it arrives for `body_timeout` seconds, e.g. an upload
sent half and held) or trickles (less than `body_min_rate` bytes/s of it over the last
`body_rate_window` seconds of waiting for it: `_paced`) is answered 408 and its
connection closed, for every route: the `receive` every route reads its body from is
wrapped here. Each of these refusals is counted by reason (`body_not_allowed`,
`body_stall`, `body_rate`: `telemetry.Refusals`). (Headers that never end,
and connections over their address's caps, are the server's own: `serve.HeaderTimeout`.)
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterable

from fastapi import responses, routing
from starlette import concurrency, datastructures, requests
from starlette import routing as starlette_routing
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from fedlang.deploy import protocol
from fedlang.deploy.server import auth
from fedlang.deploy.server import state as state_lib

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
        body_timeout: float = 30.0, body_rate: tuple[float, float] = (0.0, 10.0),
        bodied: Iterable[routing.APIRoute] = (),
    ) -> None:
        self.app, self.server, self.binary = app, server, tuple(binary)
        self.bodied = tuple(bodied)
        self.body_timeout = body_timeout
        self.body_rate = body_rate  # (bytes/s at least, over every this many seconds)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cut: list[str] = []  # why the body was cut, once it is
        loop = asyncio.get_running_loop()

        def note(reason: str) -> None:
            cut.append(reason)
            self.server.telemetry.connections.note(reason, loop)

        receive = _paced(receive, self.body_timeout, *self.body_rate, note)
        send = _closing_when_cut(send, cut)
        admin = scope["path"].startswith(ADMIN)
        try:
            if admin:
                headers = datastructures.Headers(scope=scope)
                try:
                    auth.admin_header(self.server, headers.get("authorization"),
                                      auth.address(scope))
                except (protocol.Unauthorized, protocol.RateLimited) as e:
                    self.server.telemetry.admin_refusals.note(e.reason, loop)
                    raise
            declared = _declared_body(scope)
            if declared is not None and not self._reads_own_body(scope):
                if not self._takes_body(scope):
                    note("body_not_allowed")
                    raise protocol.TooLarge(
                        f"Expected no body on {scope['method']} {scope['path']} (it takes "
                        f"none), found {declared}; send the request without a body.",
                        reason="body_not_allowed")
                receive = await _bounded(scope, receive)
        except protocol.ProtocolError as e:
            if admin and not isinstance(e, protocol.Unauthorized | protocol.RateLimited):
                await self._audit(scope, e.status)
            response = refusal(e)
            response.headers["connection"] = "close"  # its body is not read: not reused
            await response(scope, receive, send)
            return
        if not admin or scope["method"] in ("GET", "HEAD"):
            # a client that went away mid-body (an attacker's dropped trickle) has no one
            # to answer: not an error of the server's to log
            with contextlib.suppress(requests.ClientDisconnect):
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

    def _takes_body(self, scope: Scope) -> bool:
        """Whether the request's route reads a JSON body (`bodied`: every such route is
        an admin route today, its token checked first); not a route that takes none, a
        static file, or no route at all."""
        return any(r.matches(scope)[0] == starlette_routing.Match.FULL for r in self.bodied)


def _declared_body(scope: Scope) -> str | None:
    """What the request's headers say of a body (`Content-Length: N` above 0, or a
    chunked `Transfer-Encoding`); None when it has none."""
    headers = datastructures.Headers(scope=scope)
    length = headers.get("content-length")
    if length is not None and length.strip() not in ("", "0"):
        return f"Content-Length: {length.strip()[:20]}"
    if "transfer-encoding" in headers:
        return f"Transfer-Encoding: {headers['transfer-encoding'][:20]}"
    return None


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


def _paced(
    receive: Receive, timeout: float, min_rate: float, window: float,
    note: Callable[[str], None],
) -> Receive:
    """`receive`, raising `Timeout` when the body stalls (its next part takes more than
    `timeout` seconds to arrive: `body_stall`) or trickles (less than `min_rate` *
    `window` bytes of it arrived over the last `window` seconds of waiting for it, once
    it has been awaited that long: `body_rate`; `min_rate` 0: no minimum). `note` is
    told the reason first. Only the time spent waiting in `receive` counts: a route that
    takes its time over a part does not make its client slow. Once the body is whole,
    waits are not bounded (a long poll waits for the client to go away)."""
    whole = False
    waited = 0.0  # seconds spent waiting for the body so far
    arrivals: collections.deque[tuple[float, int]] = collections.deque()  # (waited, bytes)
    recent = 0  # the bytes of `arrivals`: those that arrived within the last `window`
    need = min_rate * window

    def deadline() -> float:
        """The wait (in `waited` seconds) at which the body is too slow if nothing more
        arrives (inf: never, with no minimum rate)."""
        if need <= 0:
            return math.inf
        left = recent
        for at, size in arrivals:  # oldest first: each leaves the window at `at + window`
            if left < need:
                break
            left -= size
            if left < need:
                return max(window, at + window)
        return max(window, waited) if left < need else math.inf

    def too_slow() -> protocol.Timeout:
        note("body_rate")
        return protocol.Timeout(
            f"Expected the request's body at {min_rate:g} bytes/s or more over {window:g} s, "
            f"found {recent} bytes in the last {window:g} s; send it faster (or ask the "
            "operator to lower --body-min-rate).")

    async def bounded() -> Message:
        nonlocal whole, waited, recent
        if whole:
            return await receive()
        limit = min(timeout, deadline() - waited)
        if limit <= 0:
            raise too_slow()
        start = time.monotonic()
        try:
            async with asyncio.timeout(limit):  # a timer, not a task per part
                message = await receive()
        except TimeoutError:
            waited += time.monotonic() - start
            if limit < timeout:
                raise too_slow() from None
            note("body_stall")
            raise protocol.Timeout(
                f"Expected the request's body to go on arriving, found nothing for "
                f"{timeout:g} s; send it again."
            ) from None
        waited += time.monotonic() - start
        whole = message["type"] != "http.request" or not message.get("more_body", False)
        if need > 0 and not whole:
            size = len(message.get("body", b""))
            arrivals.append((waited, size))
            recent += size
            while arrivals and arrivals[0][0] <= waited - window:
                recent -= arrivals.popleft()[1]
            if waited >= window and recent < need:
                raise too_slow()
        return message

    return bounded


def _closing_when_cut(send: Send, cut: list[str]) -> Send:
    """`send`, closing the connection after an answer given while the body was cut
    (`_paced`): the rest of that body is never read, and the connection is not reused."""

    async def sending(message: Message) -> None:
        if cut and message["type"] == "http.response.start":
            datastructures.MutableHeaders(scope=message)["connection"] = "close"
        await send(message)

    return sending


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        return pending.pop(0) if pending else await receive()

    return replayed
