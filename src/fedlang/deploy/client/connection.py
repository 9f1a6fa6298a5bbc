"""HTTP to a task store server, as a client and the driver both speak it: bearer
tokens, error answers turned back into `protocol` errors, and retries with exponential
backoff and jitter while the server is unreachable (e.g. restarting).

A value (a model, an aggregate) is downloaded by `Connection.download`: streamed into
one buffer of its announced size, its hash checked as it arrives, and a transfer cut
part way resumed from the bytes received (`Range`), not started over;
`Connection.download_into` hands the bytes to a reader as they arrive instead (a
client's broadcast, read into the model's own tensors). A large body is sent in pieces
(`Body`): HTTP/1.1's writer joins each piece it is given into new bytes, so a body
given whole would be copied whole.
"""

from __future__ import annotations

import hashlib
import random
import re
import time
import typing
import urllib.parse
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar

import httpx

from fedlang.deploy import protocol

_RETRY_STATUS = {408, 429, 502, 503, 504}
PIECE = 1 << 20  # bytes of a body handed to the HTTP writer at a time


class Reader(Protocol):
    """What `Connection.download_into` hands a value's bytes to, in order."""

    def feed(self, data: Any) -> None: ...


R = TypeVar("R", bound=Reader)


class _Buffer:
    """A value's bytes in one buffer of its announced size (grown when none was)."""

    def __init__(self, size: int | None):
        self.data, self.got = bytearray(size or 0), 0

    def feed(self, data: Any) -> None:
        n = len(data)
        self.data[self.got:self.got + n] = data  # in place (past the end: grows)
        self.got += n


class Body:
    """A request's body of bytes as views of `PIECE` bytes (re-iterable: a retry sends
    it again): `content=body, headers={**body.headers, ...}` (with its `Content-Length`:
    httpx sends an iterable of unknown length chunked)."""

    def __init__(self, data: Any):
        self.data = memoryview(data).cast("B")

    def __iter__(self) -> Iterator[memoryview]:
        for start in range(0, len(self.data), PIECE):
            yield self.data[start:start + PIECE]

    @property
    def headers(self) -> dict[str, str]:
        return {"Content-Length": str(len(self.data))}


class ServerUnavailable(ConnectionError):
    """The server could not be reached (or kept answering 'unavailable') for too long."""


class ServerError(RuntimeError):
    """The server failed on a request (HTTP 5xx): a bug or a broken database."""


def check_url(url: str) -> str:
    """`url` without a trailing slash, if it is an http(s) URL with a host.

    Raises:
      ValueError: otherwise (a typo such as `htp://`, or no scheme), at once: no retry
        makes such a URL reachable.
    """
    parts = urllib.parse.urlsplit(url)
    if parts.scheme in ("http", "https") and parts.hostname:
        return url.rstrip("/")
    rest = url.split("://", 1)[-1].lstrip("/")
    hint = f"http://{rest}" if rest and urllib.parse.urlsplit(f"http://{rest}").hostname else (
        "http://127.0.0.1:8000")
    raise ValueError(
        f"Expected the server's URL as http://HOST:PORT or https://HOST:PORT, found {url!r}; "
        f"did you mean {hint}?"
    )


class Connection:
    """HTTP to a task store server, retrying while it is unreachable.

    Args:
      url: the server, e.g. `http://127.0.0.1:8000` (a malformed URL raises ValueError
        at once).
      patience: seconds to keep retrying an unreachable server before giving up,
        counted from the first failure; waits between retries end at that deadline, and
        a connection attempt gives up after at most `max(patience, 1)` seconds.
      timeout: seconds for one request (long polls add their wait).
      verify: TLS verification (True, False, or a CA bundle path).
      backoff: (first, largest) wait between retries; each wait is drawn uniformly up to
        min(largest, first * 2^attempt) ("full jitter"), so restarting servers are not
        met by a stampede. A 429 (rate limited) with `Retry-After` is retried after the
        seconds it says (and a quarter of them at most, at random).
      say: where to say, once each, that a request's server stopped answering (and for
        how long it is retried) and that it answers again (a client passes its log);
        default: nowhere.
    """

    def __init__(
        self,
        url: str,
        *,
        patience: float = 300.0,
        timeout: float = 60.0,
        verify: Any = True,
        backoff: tuple[float, float] = (0.2, 10.0),
        sleep: Callable[[float], None] = time.sleep,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] | None = None,
    ):
        self.url = check_url(url)
        self.say = say
        self.patience = patience
        self.backoff = backoff
        self.sleep = sleep
        self.clock = clock
        # an unreachable host that drops packets: no attempt outlasts the patience
        limits = httpx.Timeout(timeout, connect=min(timeout, max(patience, 1.0)))
        self.http = httpx.Client(base_url=self.url, timeout=limits, verify=verify)
        self._rng = random.Random()

    def request(
        self,
        method: str,
        path: str,
        *,
        token: str | None = None,
        retry: bool = True,
        **kwargs: Any,
    ) -> httpx.Response:
        """Sends a request; returns a 2xx/304 response.

        Raises:
          protocol.ProtocolError: the server refused the request (4xx).
          ServerError: the server failed (5xx other than 502-504).
          ServerUnavailable: unreachable for longer than `patience`.
        """
        headers = dict(kwargs.pop("headers", {}) or {})
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        stream = kwargs.pop("stream", False)
        waits = _Waits(self, f"{method} {path}", retry)
        while True:
            try:
                resp = self.http.send(
                    self.http.build_request(method, path, headers=headers, **kwargs),
                    stream=stream)
            except httpx.TransportError as e:
                problem: str = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 400 or resp.status_code == 304:
                    waits.answered()
                    return resp
                if stream:
                    resp.read()
                    resp.close()
                if resp.status_code not in _RETRY_STATUS:
                    waits.answered()  # a refusal is an answer too
                    raise _error(resp)
                problem = f"HTTP {resp.status_code}"
                told = _retry_after(resp)
                if told is not None and waits.wait_told(told):  # 429 (or 503) + Retry-After
                    continue
            waits.wait(problem)

    def download(self, path: str, *, token: str | None = None,
                 expected_hash: str | None = None) -> bytes:
        """GETs a value (a blob, an aggregate) as a stream into one buffer of its announced
        size. A transfer cut part way is resumed from the bytes received (`Range`; a
        server that answers it with the whole value again starts it over), retried as
        `request` retries. With `expected_hash` (a blob's), the bytes' SHA-256 is checked.
        Returns the buffer itself (a `bytearray`, which every reader of bytes here
        takes), not a copy of a model-sized value.

        Raises:
          BadRequest: bytes of another hash than `expected_hash`.
          what `request` raises.
        """
        buffer = self.download_into(path, _Buffer, token=token, expected_hash=expected_hash)
        del buffer.data[buffer.got:]
        return typing.cast(bytes, buffer.data)

    def download_into(self, path: str, reader: Callable[[int | None], R], *,
                      token: str | None = None, expected_hash: str | None = None) -> R:
        """`download`, handing the bytes to `reader(size)` (the announced size, if any)
        as they arrive instead of holding them; a value sent again from its start goes
        to a new reader. Returns the reader, fed every byte once.

        Raises:
          what `download` raises, and what the reader raises.
        """
        made: R | None = None
        digest, got = hashlib.sha256(), 0
        waits = _Waits(self, f"GET {path}", True)
        while True:
            headers = {"Range": f"bytes={got}-"} if got else {}
            resp = self.request("GET", path, token=token, headers=headers, stream=True)
            try:
                start, total = _content_range(resp)
                if start == 0 and got:  # the whole value again: start over
                    made, digest, got = None, hashlib.sha256(), 0
                elif start != got:
                    raise protocol.BadRequest(
                        f"Expected {path} from byte {got} (as asked), found it from byte "
                        f"{start}.")
                if made is None:
                    made = reader(total)
                for chunk in resp.iter_bytes():
                    made.feed(chunk)
                    digest.update(chunk)
                    got += len(chunk)
                if total is None or got == total:
                    break
                problem = f"the body ending after {got} of {total} bytes"
            except httpx.TransportError as e:
                problem = f"{type(e).__name__}: {e}"
            finally:
                resp.close()
            waits.what = f"GET {path} (cut after {got} bytes)"
            waits.wait(problem)
        waits.answered()
        if expected_hash is not None and digest.hexdigest() != expected_hash:
            raise protocol.BadRequest(
                f"Expected the bytes of blob {expected_hash} from {self.url}{path}, found "
                "bytes of another hash; the server or the path to it changed them.")
        assert made is not None  # made by the first answer
        return made

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def close(self) -> None:
        self.http.close()


class _Waits:
    """The waits between retries of one request (see `Connection`): exponential backoff
    with full jitter, until `patience` seconds after the first failure."""

    def __init__(self, conn: Connection, what: str, retry: bool):
        self.conn, self.what, self.retry = conn, what, retry
        self.first_failure: float | None = None
        self.attempt = 0
        self.said = False  # that the server is unreachable (`Connection.say`)

    def _left(self) -> float:
        now = self.conn.clock()
        self.first_failure = now if self.first_failure is None else self.first_failure
        return self.first_failure + self.conn.patience - now

    def wait_told(self, told: float) -> bool:
        """Waits the seconds the server told (and a quarter of them at most, at random);
        False when that would outlast the patience."""
        if not (self.retry and told <= self._left()):
            return False
        self.conn.sleep(told + self.conn._rng.uniform(0, min(told, 1.0) / 4))
        return True

    def answered(self) -> None:
        """The request got its answer: says so if its server was said to be unreachable."""
        if self.said and self.conn.say is not None and self.first_failure is not None:
            self.said = False
            self.conn.say(f"server reachable again after "
                          f"{self.conn.clock() - self.first_failure:.1f} s")

    def wait(self, problem: str) -> None:
        """Waits before the next try, or raises ServerUnavailable past the patience."""
        left = self._left()
        if not self.retry or left <= 0:
            assert self.first_failure is not None
            raise ServerUnavailable(
                f"Expected the server at {self.conn.url} to answer {self.what}, found "
                f"{problem} for {self.conn.clock() - self.first_failure:.0f} s (patience "
                f"{self.conn.patience:g} s); check that it runs and that the URL is right."
            )
        if self.conn.say is not None and not self.said:  # once, not at each try
            self.said = True
            self.conn.say(f"server unreachable at {self.conn.url} ({problem}), retrying for "
                          f"up to {self.conn.patience:g} s")
        first, largest = self.conn.backoff
        # the last wait ends at the deadline, so `patience` is the seconds it retries
        grown = first * 2.0 ** min(self.attempt, 64)  # capped: 2**1024 overflows a float
        self.conn.sleep(min(left, self.conn._rng.uniform(0, min(largest, grown))))
        self.attempt += 1


_CONTENT_RANGE = re.compile(r"bytes (\d+)-\d+/(\d+)")


def _content_range(resp: httpx.Response) -> tuple[int, int | None]:
    """(where the body starts in the value, the value's size if announced): from a 206's
    `Content-Range`, else 0 and `Content-Length`."""
    if resp.status_code == 206:
        m = _CONTENT_RANGE.fullmatch(resp.headers.get("content-range", ""))
        if m is None:
            raise protocol.BadRequest(
                f"Expected a Content-Range of bytes START-END/SIZE with a partial answer, "
                f"found {resp.headers.get('content-range')!r}.")
        return int(m.group(1)), int(m.group(2))
    length = resp.headers.get("content-length", "")
    return 0, int(length) if length.isdigit() else None


def _retry_after(resp: httpx.Response) -> float | None:
    """The seconds an answer's `Retry-After` header says to wait (None: none, or a date)."""
    value = resp.headers.get("retry-after", "")
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if 0 <= seconds < 86400 else None


def _error(resp: httpx.Response) -> Exception:
    try:
        body = resp.json()
        detail, reason = body.get("detail"), body.get("reason")
    except ValueError:
        detail, reason = resp.text[:500], None
    if not isinstance(detail, str):  # FastAPI's request validation errors are a list
        detail, reason = f"The request was malformed: {detail}", reason or "invalid"
    if resp.status_code >= 500:
        return ServerError(f"The server failed on {resp.request.method} {resp.request.url.path}"
                           f" (HTTP {resp.status_code}): {detail}")
    return protocol.error_for(resp.status_code, detail, reason)

