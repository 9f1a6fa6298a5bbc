"""What every route module of the server shares: the server's state as a dependency,
path parameters, binary bodies and answers (stored values streamed, in ranges), the long
poll, and static files for browsers (the browser client, the dashboard)."""

from __future__ import annotations

import asyncio
import pathlib
import re
import time
from collections.abc import Callable
from typing import Annotated, Any, TypeVar

import fastapi
from fastapi import responses
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy.server import schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import values

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
    200: {"content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}}},
    206: {"description": "The part of the value its `Range` asks for (`Content-Range`).",
          "content": {protocol.BINARY: {"schema": {"type": "string", "format": "binary"}}}},
    416: {"model": schemas.ErrorOut,
          "description": "A `Range` that starts past the value's end (`Content-Range: bytes */SIZE`)."},
}
# A binary answer's `Range` and `If-Range` headers (`binary`).
Range = Annotated[str | None, fastapi.Header(
    alias="range", description="`bytes=START-`, `bytes=START-END` or `bytes=-LENGTH`: a part.")]
IfRange = Annotated[str | None, fastapi.Header(
    alias="if-range", description="The ETag the part is of (another: the whole value).")]
_RANGE = re.compile(r"bytes=(\d*)-(\d*)")


def binary(
    store: values.Transactions, value: values.Value, byte_range: str | None = None,
    if_range: str | None = None, *, immutable: bool = False,
) -> responses.Response:
    """A stored value as a binary answer, streamed from its chunks (`values.chunks`: each
    read on the thread pool as the answer is sent, so a download holds one chunk, never
    the value), with its length, its ETag (its SHA-256: a blob's hash) and
    `Accept-Ranges: bytes`. A `byte_range` (the `Range` header: `bytes=START-`,
    `bytes=START-END`, `bytes=-LENGTH`) gets that part, 206 with `Content-Range` (a
    download cut off resumes), or 416 when it starts past the end; one of another form
    (several ranges, other units) and one whose `If-Range` names another ETag get the
    whole. `immutable`: content-addressed (a blob), cached forever."""
    etag = f'"{value.sha256}"'
    headers = {"ETag": etag, "Accept-Ranges": "bytes"}
    if immutable:
        headers["Cache-Control"] = "private, max-age=31536000, immutable"
    part = None if byte_range is None or if_range not in (None, etag) else _span(
        byte_range, value.size)
    if part == ():
        return responses.JSONResponse(
            {"detail": f"Expected a range that starts within the value's {value.size} bytes, "
                       f"found {byte_range!r}; ask for `bytes=START-` with START below "
                       f"{value.size}.", "reason": protocol.RangeNotSatisfiable.reason},
            status_code=protocol.RangeNotSatisfiable.status, headers={**headers, "Content-Range": f"bytes */{value.size}"})
    start, stop = part or (0, value.size)
    headers["Content-Length"] = str(stop - start)
    if part:
        headers["Content-Range"] = f"bytes {start}-{stop - 1}/{value.size}"
    return responses.StreamingResponse(
        values.chunks(store, value, start, stop), status_code=206 if part else 200,
        media_type=protocol.BINARY, headers=headers)


def _span(byte_range: str, size: int) -> tuple[int, int] | tuple[()] | None:
    """The bytes `start:stop` a `Range` header asks of a value of `size` bytes; `()`
    when it cannot be satisfied; None for a header to ignore (not one range of bytes)."""
    match = _RANGE.fullmatch(byte_range.strip())
    if match is None or match[1] == match[2] == "":
        return None
    if match[1] == "":  # the last LENGTH bytes
        length = int(match[2])
        return (max(0, size - length), size) if length > 0 and size > 0 else ()
    start = int(match[1])
    if match[2] != "" and int(match[2]) < start:
        return None  # END before START: not a valid range, ignored (RFC 9110)
    if start >= size:
        return ()
    return start, size if match[2] == "" else min(int(match[2]) + 1, size)


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
