"""The server's FastAPI application: the routers of every role, the refusals as JSON, and
the tick that closes rounds and stages whose time is up.

`create_app(state)` includes the routers of `common` (populations, blobs, enrollment,
check-in, status), `rounds`, `secure`, `sessions` and `ops` (the operator's: released
metrics, the overview, `/metrics`); each route module exports its
`router` and reads the server's state through `routing.State`. Nothing imports this
module but `serve`. Every endpoint is under `/v1` and described in the OpenAPI schema the
server serves at `/openapi.json`; docs/deploy.md is the prose contract.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import fastapi
from fastapi import responses
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.server import (
    bulk,
    common,
    guard,
    ops,
    rounds,
    routing,
    schemas,
    secure,
    sessions,
    telemetry,
)
from fedlang.deploy.server import state as state_lib

ROUTERS = (common.router, rounds.router, secure.router, sessions.router, bulk.router,
           ops.router, ops.metrics_router)
ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    status: {"model": schemas.ErrorOut, "description": e.__doc__ or ""}
    for status, e in protocol.ERRORS.items()
}


def create_app(
    server: state_lib.ServerState, tick: float = 1.0, body_timeout: float = 30.0,
    body_min_rate: float = 0.0, body_rate_window: float = 10.0,
) -> fastapi.FastAPI:
    """The FastAPI application of `server`; `tick` is how often deadlines are checked,
    `body_timeout` how long a request's body may stall, `body_min_rate` the bytes/s it
    must arrive at over every `body_rate_window` seconds (`guard.Guard`)."""

    @contextlib.asynccontextmanager
    async def lifespan(_: fastapi.FastAPI) -> AsyncIterator[None]:
        async def close_due() -> None:
            while True:
                await asyncio.sleep(tick)
                # On its own task: cancelling the loop at shutdown must not leave a
                # transaction running on a worker thread while the store is closed.
                running = asyncio.ensure_future(concurrency.run_in_threadpool(server.close_due))
                try:
                    await asyncio.shield(running)
                except asyncio.CancelledError:
                    with contextlib.suppress(Exception):
                        await running
                    raise
                except Exception:  # a database hiccup: try next tick
                    pass

        task = asyncio.create_task(close_due())
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = fastapi.FastAPI(
        title="fedlang task store",
        version=state_lib.VERSION,
        description="Clients pull tasks, run them on their own data and push reports. "
        "See docs/deploy.md, 'The protocol'.",
        lifespan=lifespan,
        responses=ERROR_RESPONSES,
    )
    app.state.server = server  # what `routing.State` gives each route

    @app.exception_handler(protocol.ProtocolError)
    async def refused(_: fastapi.Request, e: protocol.ProtocolError) -> responses.JSONResponse:
        return guard.refusal(e)

    for router in ROUTERS:
        app.include_router(router)
    binary = [
        r for router in ROUTERS for r in router.routes
        if isinstance(r, fastapi.routing.APIRoute)
        and (r.openapi_extra or {}).get("requestBody") == routing.BINARY_BODY["requestBody"]
    ]
    bodied = [  # the routes with a JSON body (every other route takes none)
        r for router in ROUTERS for r in router.routes
        if isinstance(r, fastapi.routing.APIRoute) and r.body_field is not None
    ]
    app.add_middleware(guard.Guard, server=server, binary=binary, body_timeout=body_timeout,
                       body_rate=(body_min_rate, body_rate_window), bodied=bodied)
    app.add_middleware(telemetry.Observe, telemetry=server.telemetry)  # outermost: request ids
    return app


def build_routes(app: fastapi.FastAPI) -> None:
    """Builds every included router's routes now, in the thread that made the app.

    FastAPI (0.16x) builds an included router's routes on the first request that reaches
    it, from the route modules' shared objects. Several servers in one process (a root
    and its edges in the tests, each on its own thread) then built them at once, and one
    run's request failed inside that build (pydantic's UnsupportedFieldAttributeWarning
    on a shared `Query`, a 500). Built here, each app's routes are ready before its
    server answers anything. A FastAPI without this lazy building has nothing to build.
    """
    for route in app.router.routes:
        for build in ("effective_candidates", "effective_low_priority_routes"):
            method = getattr(route, build, None)
            if callable(method):
                method()
