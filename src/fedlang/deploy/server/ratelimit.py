"""Rate limits: token buckets per enrolled client and per address that fails to enroll.

An enrolled client is trusted with its own tasks, not with the server's time: each
client id has a bucket of `burst` requests, refilled at `rate` per second, taken from
by every request its credential authenticates (`auth.client`); an empty bucket answers
429 with `Retry-After` (the seconds until a request fits), counted as
`refused:rate_limited`. Honest clients poll with backoff (at most one check-in every
`--min-retry` seconds, a few downloads and uploads per task), far below the defaults.

Enrollment tokens are guessed by strangers, so the enroll route has a bucket per
remote address, taken from by each *failed* attempt: an address with no tokens left is
refused (429) before its token is even looked at, so a guesser learns nothing more,
while a whole class of devices behind one NAT enrolls with a good token unhindered.
(Behind a reverse proxy every address is the proxy's: limit there.)

Buckets live in memory, per server process (several processes behind one PostgreSQL
each count their own requests); full buckets are dropped when there are more than
`max_keys`, so a flood of addresses costs bounded memory.
"""

from __future__ import annotations

import dataclasses
import math
import threading
import time
from collections.abc import Callable

from fedlang.deploy import protocol


@dataclasses.dataclass(frozen=True)
class Rate:
    """`rate` requests per second on average, `burst` at once."""

    rate: float
    burst: int

    def __post_init__(self) -> None:
        if not (self.rate > 0 and math.isfinite(self.rate)):
            raise ValueError(f"Expected a rate > 0 requests per second, found {self.rate}.")
        if self.burst < 1:
            raise ValueError(f"Expected a burst >= 1 request, found {self.burst}.")


class Buckets:
    """Token buckets by key (see the module docstring); thread-safe.

    Args:
      rate: the refill rate and size of each bucket.
      what: what a key is, for the refusal's message ("client", "address").
      clock: seconds (monotonic).
      max_keys: how many buckets to keep before dropping full ones.
    """

    def __init__(self, rate: Rate, what: str, clock: Callable[[], float] = time.monotonic,
                 max_keys: int = 100_000):
        self.rate, self.what, self.clock, self.max_keys = rate, what, clock, max_keys
        self._buckets: dict[str, tuple[float, float]] = {}  # key -> (tokens, when)
        self._lock = threading.Lock()

    def _tokens(self, key: str, now: float) -> float:
        tokens, when = self._buckets.get(key, (float(self.rate.burst), now))
        return min(float(self.rate.burst), tokens + (now - when) * self.rate.rate)

    def wait(self, key: str) -> float:
        """Seconds until `key` may make a request (0: now), taking nothing."""
        with self._lock:
            tokens = self._tokens(key, self.clock())
        return 0.0 if tokens >= 1 else (1 - tokens) / self.rate.rate

    def take(self, key: str) -> float:
        """Takes one request from `key`'s bucket; returns 0, or the seconds until one
        fits when the bucket is empty (then nothing is taken)."""
        with self._lock:
            now = self.clock()
            tokens = self._tokens(key, now)
            if tokens < 1:
                self._buckets[key] = (tokens, now)
                return (1 - tokens) / self.rate.rate
            self._buckets[key] = (tokens - 1, now)
            if len(self._buckets) > self.max_keys:
                self._drop_full(now)
            return 0.0

    def _drop_full(self, now: float) -> None:
        for key in [k for k in self._buckets if self._tokens(k, now) >= self.rate.burst]:
            del self._buckets[key]

    def refuse(self, key: str, seconds: float) -> protocol.RateLimited:
        """The 429 for `key`, told to come back in `seconds`."""
        return protocol.RateLimited(
            f"Expected at most {self.rate.rate:g} requests per second from one {self.what} "
            f"(bursts of {self.rate.burst}), found more; retry after {seconds:.2f} s "
            "(Retry-After).", retry_after=seconds)

    def check(self, key: str) -> None:
        """`take`, refusing an empty bucket.

        Raises:
          RateLimited: the bucket is empty (429, with the seconds to wait).
        """
        seconds = self.take(key)
        if seconds > 0:
            raise self.refuse(key, seconds)
