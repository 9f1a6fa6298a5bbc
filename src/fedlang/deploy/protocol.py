"""The task store's wire contract, which the server, its clients and the driver all
import: the paths, the kinds of task and their states, blob hashes, the body of a secure
round's masked input, and the errors both sides name.

Every refusal the server gives is one of the `ProtocolError`s below: an HTTP status, a
short machine-readable `reason` (counted in `GET /v1/status`) and a sentence for people.
The JSON body of an error response is `{"detail": sentence, "reason": reason}`. Each
error also subclasses the builtin that fits, so Python callers can catch it as usual.
See docs/deploy.md, "The protocol".
"""

from __future__ import annotations

import enum
import hashlib
import json
import struct
from collections.abc import Mapping
from typing import Any

API = "/v1"
BLOB_HASH = r"^[0-9a-f]{64}$"  # blobs are named by the SHA-256 of their bytes, in hex
BINARY = "application/octet-stream"
NDJSON = "application/x-ndjson"  # one JSON document a line (bulk enrollment's answer)


class TaskKind(enum.StrEnum):
    """What a client's task asks of it (`kind` of a check-in's task and of a round)."""

    AGGREGATE = "aggregate"  # a plain round: upload one report
    SECURE = "secure"  # a secure round: take part in the four stages of SecAgg+
    BUFFERED = "buffered"  # a buffered asynchronous (FedBuff) session: one report a version


class RoundState(enum.StrEnum):
    """A round's state: open until its target, quorum or deadline; then closed or failed."""

    OPEN = "open"
    CLOSED = "closed"
    FAILED = "failed"


class SessionState(enum.StrEnum):
    """A buffered session's state: open until the driver closes it."""

    OPEN = "open"
    CLOSED = "closed"


TICKET_FIELDS = ("round", "session", "kind", "plan", "broadcast", "version")


def ticket_payload(task: Mapping[str, Any]) -> bytes:
    """What the server signs of a task it hands out (the task's `ticket`): its round or
    session, kind, signed plan's hash, broadcast's hash and version, as canonical JSON.
    A client checks the ticket against the task before it downloads anything, so the
    broadcast (the model's weights) is covered by the server's signature too, not only
    named in the check-in's answer."""
    return json.dumps({k: task.get(k) for k in TICKET_FIELDS}, sort_keys=True,
                      separators=(",", ":")).encode()


# Every upload names the task it was computed for in this header (`task_header`); the
# intake refuses one computed for another task (409 `stale`) before reading its body.
TASK_HEADER = "Fedlang-Task"
TASK_FIELDS = ("round", "session", "version")


def task_of(task: Mapping[str, Any]) -> dict[str, int | None]:
    """The task an upload answers, as `TASK_HEADER` names it: its round, or its session
    and (a client's report to a buffered session) the model version it trained; the
    other fields None. A round's broadcast and a version's weights never change, so
    these name them too.

    Example:
      >>> task_of({"round": 3, "kind": "aggregate", "plan": "ab12"})
      {'round': 3, 'session': None, 'version': None}
    """
    return {k: task.get(k) for k in TASK_FIELDS}


def task_header(task: Mapping[str, Any]) -> dict[str, str]:
    """The header that binds an upload to the task it was computed for (`task_of`: a
    check-in's task, or the same fields of an edge's root task), as canonical JSON.

    Example:
      >>> task_header({"session": 5, "version": 2})
      {'Fedlang-Task': '{"round":null,"session":5,"version":2}'}
    """
    return {TASK_HEADER: json.dumps(task_of(task), sort_keys=True, separators=(",", ":"))}


def read_task_header(value: str | None, expected: Mapping[str, int | None]) -> None:
    """Checks that an upload's `TASK_HEADER` names the task it is uploaded to (`expected`,
    `task_of` of the server's task), before its body is read.

    Raises:
      BadRequest: no header, or one that is not such JSON (reason `unbound`), saying
        what to send.
      Conflict: an upload computed for another task: another round, session or version
        (reason `stale`).
    """
    if value is None:
        raise BadRequest(f"Expected a header {TASK_HEADER} naming the task this upload was "
                         f"computed for, found none; {_fix(expected)}.", reason="unbound")
    try:
        found = json.loads(value)
    except ValueError:
        found = None
    if (not isinstance(found, dict)
            or any(type(found.get(k)) not in (int, type(None)) for k in TASK_FIELDS)):
        raise BadRequest(f"Expected the header {TASK_HEADER} to be a JSON object of integers "
                         f"or nulls, found {value[:200]!r}; {_fix(expected)}.",
                         reason="unbound")
    if any(found.get(k) != expected.get(k) for k in TASK_FIELDS):
        raise Conflict(
            f"Expected an upload computed for {_named(expected)}, found one computed for "
            f"{_named(task_of(found))} ({TASK_HEADER}); an upload answers only the task it "
            "was computed for: check in for the current task and compute it anew.",
            reason="stale")


def _fix(expected: Mapping[str, int | None]) -> str:
    """What to send instead (said in a refusal)."""
    want = task_header(expected)[TASK_HEADER]
    return (f"send the header {TASK_HEADER}: {want}, the round, session and version of the "
            "task (the check-in's answer) the upload was computed for")


def _named(task: Mapping[str, int | None]) -> str:
    """A task in words: `round 3`, `version 2 of session 5`, `session 5`."""
    if task.get("round") is not None and task.get("session") is None:
        return f"round {task['round']}"
    if task.get("session") is not None and task.get("round") is None:
        version = task.get("version")
        return (f"session {task['session']}" if version is None
                else f"version {version} of session {task['session']}")
    return json.dumps(dict(task), sort_keys=True, separators=(",", ":"))


def blob_hash(data: bytes) -> str:
    """The name of a blob: the SHA-256 of its bytes, 64 lowercase hex digits."""
    return hashlib.sha256(data).hexdigest()


_LENGTH = struct.Struct("<Q")


def pack_masked_input(report: bytes, masked_input: bytes) -> bytes:
    """The body of a secure round's masked-input message: the client's plain report and
    its SecAgg+ masked input, so the server accepts both or neither.

    The layout is the report's length (u64, little-endian), the report (the binary value
    format), then the masked-input message (a SecAgg+ frame).

    Example:
      >>> unpack_masked_input(pack_masked_input(b"report", b"masked"))
      (b'report', b'masked')
    """
    return _LENGTH.pack(len(report)) + report + masked_input


def unpack_masked_input(body: bytes) -> tuple[bytes, bytes]:
    """(plain report, masked input) of a `pack_masked_input` body.

    Raises:
      BadRequest: the body is not of that form.
    """
    if len(body) < _LENGTH.size:
        raise BadRequest(
            f"Expected a masked-input body (u64 report length, report, masked input), found "
            f"{len(body)} bytes."
        )
    (n,) = _LENGTH.unpack_from(body)
    if n > len(body) - _LENGTH.size:
        raise BadRequest(
            f"Expected a plain report of at most {len(body) - _LENGTH.size} bytes after the "
            f"length, found a length of {n}."
        )
    start = _LENGTH.size
    return bytes(body[start : start + n]), bytes(body[start + n :])


class ProtocolError(Exception):
    """A request the server refuses; `status` is its HTTP status."""

    status = 400
    reason = "bad_request"

    def __init__(self, message: str, reason: str | None = None):
        super().__init__(message)
        if reason is not None:
            self.reason = reason


class BadRequest(ProtocolError, ValueError):
    """The request is malformed (or a report is not one client's valid contribution)."""


class Unauthorized(ProtocolError, PermissionError):
    """A missing, unknown or expired token or credential."""

    status = 401
    reason = "unauthorized"


class Forbidden(ProtocolError, PermissionError):
    """The caller is known but may not do this (e.g. report for a task it was not given)."""

    status = 403
    reason = "not_assigned"


class NotFound(ProtocolError, LookupError):
    """No such population, round or blob."""

    status = 404
    reason = "not_found"


class Conflict(ProtocolError, ValueError):
    """The request contradicts the stored state (another report for the same task, a
    population that exists, a round that is not closed yet)."""

    status = 409
    reason = "conflict"


class Gone(ProtocolError, ValueError):
    """A report for a round that has closed: late reports are refused and counted (and,
    with reason `deleted`, a closed round's aggregate no longer kept)."""

    status = 410
    reason = "late"


class TooLarge(ProtocolError, ValueError):
    """An upload larger than the limit."""

    status = 413
    reason = "too_large"


class RangeNotSatisfiable(ProtocolError, ValueError):
    """A part of a value (`Range`) that starts past its end."""

    status = 416
    reason = "range"


class Timeout(ProtocolError):
    """A request whose body stalled: nothing of it arrived for the server's body timeout
    (`fedlang serve --body-timeout`). Clients retry it."""

    status = 408
    reason = "timeout"


class BufferFull(ProtocolError):
    """A buffered session's current buffer holds its K reports and the driver has not
    applied it yet: retry shortly (HTTP clients retry a 503 by themselves)."""

    status = 503
    reason = "buffer_full"


class RateLimited(ProtocolError):
    """Too many requests from one client (or failed enrollments from one address):
    retry after `retry_after` seconds (the answer's `Retry-After` header; clients wait
    that long by themselves)."""

    status = 429
    reason = "rate_limited"

    def __init__(self, message: str, reason: str | None = None, retry_after: float = 1.0):
        super().__init__(message, reason)
        self.retry_after = retry_after


# The refusals any route may give, by status (the OpenAPI schema lists them on every
# route). `BufferFull` is not one: only a buffered upload gives it, and clients retry it.
ERRORS: dict[int, type[ProtocolError]] = {
    e.status: e
    for e in (BadRequest, Unauthorized, Forbidden, NotFound, Conflict, Gone, TooLarge, Timeout,
              RangeNotSatisfiable)
}


def error_for(status: int, message: str, reason: str | None = None) -> ProtocolError:
    """The error a client raises for an error response of the server."""
    return ERRORS.get(status, ProtocolError)(message, reason)
