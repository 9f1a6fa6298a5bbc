"""What every route module of the server shares: the server's state as a dependency,
path parameters, binary bodies and answers, the long poll, and static files for
browsers (the browser client, the dashboard)."""

from __future__ import annotations

import asyncio
import pathlib
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import fastapi
from fastapi import responses
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.server import schemas
from fedlang.deploy.server import state as state_lib

T = TypeVar("T")
# The MIME types browsers require of modules and wasm (and the pages' other files).
STATIC_TYPES = {".js": "text/javascript", ".mjs": "text/javascript", ".wasm": "application/wasm",
                ".svg": "image/svg+xml", ".html": "text/html; charset=utf-8", ".css": "text/css",
                ".txt": "text/plain"}


async def _state(request: fastapi.Request) -> state_lib.ServerState:
    return request.app.state.server  # type: ignore[no-any-return]


# A route's `server: State` parameter: the state `app.create_app` was given.
State = Annotated[state_lib.ServerState, fastapi.Depends(_state)]
RoundId = Annotated[int, fastapi.Path(ge=1, le=2**62, description="The round's id.")]
Population = Annotated[str, fastapi.Path(pattern=schemas.NAME, description="A population name.")]
BlobHash = Annotated[str, fastapi.Path(pattern=protocol.BLOB_HASH, description="SHA-256, hex.")]
Wait = Annotated[float, fastapi.Query(ge=0, le=60)]
Seen = Annotated[int, fastapi.Query(ge=-1, le=2**62)]
BINARY_BODY = {
    "requestBody": {
        "required": True,
        "content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}},
    }
}
BINARY_RESPONSE: dict[int | str, dict[str, Any]] = {
    200: {"content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}}}
}


def binary(data: bytes, h: str | None = None) -> responses.Response:
    """A binary answer; `h`: the blob's hash (content-addressed, so cached forever)."""
    headers = {}
    if h is not None:
        headers = {"ETag": f'"{h}"', "Cache-Control": "private, max-age=31536000, immutable"}
    return responses.Response(data, media_type=protocol.BINARY, headers=headers)


async def long_poll(
    read: Callable[[], T], done: Callable[[T, T], bool], wait: float, interval: float
) -> T:
    """`read()` (a row, read on a worker thread) once `done(first, latest)` holds, or after
    `wait` seconds, polling every `interval` seconds: how the driver waits for a round or
    a session to change without asking again and again."""
    end = time.monotonic() + wait
    first = None
    while True:
        row = await concurrency.run_in_threadpool(read)
        first = row if first is None else first
        if done(first, row) or time.monotonic() >= end:
            return row
        await asyncio.sleep(min(interval, max(0.0, end - time.monotonic())))


def static_files(directory: pathlib.Path, cache: str, headers: dict[str, str] | None = None) -> Any:
    """An ASGI app serving `directory`'s files (`index.html` for a directory) with the
    types of `STATIC_TYPES`, `cache` as their cache-control, and `headers` (e.g. a
    content-security policy): mount it on the app."""
    from starlette import staticfiles

    extra = {"cache-control": cache, **(headers or {})}

    class Static(staticfiles.StaticFiles):
        def file_response(self, full_path: Any, *args: Any, **kwargs: Any) -> Any:
            response = super().file_response(full_path, *args, **kwargs)
            suffix = pathlib.Path(str(full_path)).suffix
            if suffix in STATIC_TYPES:
                response.headers["content-type"] = STATIC_TYPES[suffix]
            response.headers.update(extra)
            return response

    return Static(directory=directory, html=True)
