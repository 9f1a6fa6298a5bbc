"""HTTP to a task store server, as a client and the driver both speak it: bearer
tokens, error answers turned back into `protocol` errors, and retries with exponential
backoff and jitter while the server is unreachable (e.g. restarting).
"""

from __future__ import annotations

import random
import time
import urllib.parse
from collections.abc import Callable
from typing import Any

import httpx

from fedlang.deploy import protocol

_RETRY_STATUS = {408, 429, 502, 503, 504}


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
    ):
        self.url = check_url(url)
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
        first_failure: float | None = None
        attempt = 0
        while True:
            try:
                resp = self.http.request(method, path, headers=headers, **kwargs)
            except httpx.TransportError as e:
                problem: str = f"{type(e).__name__}: {e}"
            else:
                if resp.status_code < 400 or resp.status_code == 304:
                    return resp
                if resp.status_code not in _RETRY_STATUS:
                    raise _error(resp)
                problem = f"HTTP {resp.status_code}"
                told = _retry_after(resp)
                if told is not None:  # 429 (or 503) with Retry-After: wait what it says
                    now = self.clock()
                    first_failure = now if first_failure is None else first_failure
                    left = first_failure + self.patience - now
                    if retry and told <= left:
                        self.sleep(told + self._rng.uniform(0, min(told, 1.0) / 4))
                        continue
            now = self.clock()
            first_failure = now if first_failure is None else first_failure
            left = first_failure + self.patience - now
            if not retry or left <= 0:
                raise ServerUnavailable(
                    f"Expected the server at {self.url} to answer {method} {path}, found "
                    f"{problem} for {now - first_failure:.0f} s (patience {self.patience:g} "
                    "s); check that it runs and that the URL is right."
                )
            first, largest = self.backoff
            # the last wait ends at the deadline, so `patience` is the seconds it retries
            grown = first * 2.0 ** min(attempt, 64)  # capped: 2**1024 would overflow a float
            self.sleep(min(left, self._rng.uniform(0, min(largest, grown))))
            attempt += 1

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def close(self) -> None:
        self.http.close()


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

