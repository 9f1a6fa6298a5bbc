"""The driver's side of the task store protocol: rounds run by a server over HTTP.

`ServerRounds` is a `context.RoundRunner`: each round's plan and broadcast value are
uploaded as blobs, the server opens a round with the cohort options, and the driver
waits (long polling, with a progress line) until the round closes, then reads its
aggregate. `deployment_context(url, ...)` is the `DeploymentContext` on it: the user's
ordinary driver loop, run against real clients.

`Connection` is the HTTP plumbing both the driver and the clients use: bearer tokens,
errors turned back into `protocol` errors, and retries with exponential backoff and
jitter while the server is unreachable (e.g. restarting).
"""

from __future__ import annotations

import random
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

import httpx

from fedlang.deploy import context, protocol
from fedlang.deploy import plan as plan_lib

_RETRY_STATUS = {502, 503, 504}


class ServerUnavailable(ConnectionError):
    """The server could not be reached (or kept answering 'unavailable') for too long."""


class ServerError(RuntimeError):
    """The server failed on a request (HTTP 5xx): a bug or a broken database."""


class RoundFailedError(RuntimeError):
    """A round failed: its deadline passed with fewer reports than its quorum."""


class Connection:
    """HTTP to a task store server, retrying while it is unreachable.

    Args:
      url: the server, e.g. `http://127.0.0.1:8000`.
      patience: seconds to keep retrying an unreachable server before giving up.
      timeout: seconds for one request (long polls add their wait).
      verify: TLS verification (True, False, or a CA bundle path).
      backoff: (first, largest) wait between retries; each wait is drawn uniformly up to
        min(largest, first * 2^attempt) ("full jitter"), so restarting servers are not
        met by a stampede.
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
    ):
        self.url = url.rstrip("/")
        self.patience = patience
        self.backoff = backoff
        self.sleep = sleep
        self.http = httpx.Client(base_url=self.url, timeout=timeout, verify=verify)
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
            now = time.monotonic()
            first_failure = now if first_failure is None else first_failure
            if not retry or now - first_failure > self.patience:
                raise ServerUnavailable(
                    f"Expected the server at {self.url} to answer {method} {path}, found "
                    f"{problem} for {now - first_failure:.0f} s; check that it runs and that "
                    "the URL is right."
                )
            first, largest = self.backoff
            self.sleep(self._rng.uniform(0, min(largest, first * 2**attempt)))
            attempt += 1

    def json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.request(method, path, **kwargs).json()

    def close(self) -> None:
        self.http.close()


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


class Admin:
    """The admin endpoints (bearer admin token)."""

    def __init__(self, url: str | Connection, admin_token: str, **connection: Any):
        self.connection = url if isinstance(url, Connection) else Connection(url, **connection)
        self.token = admin_token

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.connection.json(method, protocol.API + path, token=self.token, **kwargs)

    def create_population(self, name: str) -> str:
        """Creates a population; returns its enrollment token."""
        return self._json("POST", "/admin/populations", json={"name": name})["token"]

    def populations(self) -> list[dict[str, Any]]:
        return self._json("GET", "/admin/populations")

    def finish_population(self, name: str) -> None:
        """Tells the population's clients to stop at their next check-in."""
        self._json("POST", f"/admin/populations/{name}/finish")

    def put_blob(self, data: bytes) -> str:
        """Uploads a blob; returns its hash."""
        return self._json(
            "POST", "/admin/blobs", content=data, headers={"Content-Type": protocol.BINARY}
        )["hash"]

    def create_round(self, population: str, plan: str, broadcast: str, **options: Any) -> Any:
        body = {"population": population, "plan": plan, "broadcast": broadcast, **options}
        return self._json("POST", "/admin/rounds", json=body)

    def round(self, round_id: int, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        return self._json(
            "GET", f"/admin/rounds/{round_id}", params={"wait": wait, "seen": seen},
            timeout=(self.connection.http.timeout.read or 60.0) + wait,
        )

    def aggregate(self, round_id: int) -> bytes:
        return self.connection.request(
            "GET", f"{protocol.API}/admin/rounds/{round_id}/aggregate", token=self.token
        ).content

    def status(self) -> dict[str, Any]:
        return self.connection.json("GET", f"{protocol.API}/status")

    def close(self) -> None:
        self.connection.close()

    def __enter__(self) -> Admin:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


class ServerRounds:
    """Runs each round on the clients of a server's population (a `RoundRunner`).

    Args:
      url: the server.
      admin_token: its admin token.
      population: the population whose clients run the rounds.
      target: reports per round; the round closes when this many arrived.
      over_selection: extra clients assigned, as a fraction of `target`.
      quorum: the fewest reports a round may close with at its deadline (default:
        `target`).
      deadline: seconds a round may take.
      stage_timeout: seconds each of stages 2-4 of a secure round waits for its last
        clients; stage 1 (check-in, training, keys) may use the rest of the deadline
        (default: a quarter of the deadline).
      progress: show a progress line (default: when stderr is a terminal).
      patience: seconds to keep retrying while the server is unreachable.
    """

    def __init__(
        self,
        url: str,
        admin_token: str,
        population: str,
        *,
        target: int,
        over_selection: float = 0.0,
        quorum: int | None = None,
        deadline: float = 600.0,
        stage_timeout: float | None = None,
        progress: bool | None = None,
        patience: float = 300.0,
        **connection: Any,
    ):
        self.admin = Admin(Connection(url, patience=patience, **connection), admin_token)
        self.population = population
        self.options = {
            "target": target, "over_selection": over_selection, "quorum": quorum,
            "deadline": deadline, "stage_timeout": stage_timeout,
        }
        self.progress = sys.stderr.isatty() if progress is None else progress

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> context.RoundResult:
        start = time.perf_counter()
        plan_hash = self.admin.put_blob(plan.to_bytes())
        broadcast_hash = self.admin.put_blob(broadcast)
        r = self.admin.create_round(
            self.population, plan_hash, broadcast_hash, request_id=uuid.uuid4().hex,
            **self.options,
        )
        with _Progress(self.progress, r) as shown:
            while r["state"] == "open":
                r = self.admin.round(r["id"], wait=10.0, seen=r["reports"])
                shown.update(r, time.perf_counter() - start)
        if r["state"] != "closed":
            raise RoundFailedError(r["failure"] or f"Round {r['id']} {r['state']}.")
        aggregate = self.admin.aggregate(r["id"])
        return context.RoundResult(aggregate, r["reports"], time.perf_counter() - start, r)

    def finish(self) -> None:
        """Tells the population's clients that there is no more work."""
        self.admin.finish_population(self.population)

    def close(self) -> None:
        """Closes the connection to the server."""
        self.admin.close()


_STAGES = {1: "advertise keys", 2: "share keys", 3: "masked input", 4: "unmasking",
           5: "done", 6: "failed"}


class _Progress:
    """A one-line progress display: reports received / target, a secure round's stage,
    round time."""

    def __init__(self, enabled: bool, r: dict[str, Any]):
        self.enabled = enabled
        self.bar: Any = None
        self.first = r

    def __enter__(self) -> _Progress:
        if self.enabled:
            from rich import progress

            self.bar = progress.Progress(
                progress.TextColumn("round {task.fields[round]}"),
                progress.BarColumn(),
                progress.TextColumn("{task.completed}/{task.total} reports"),
                progress.TextColumn("{task.fields[assigned]} assigned"),
                progress.TextColumn("{task.fields[stage]}"),
                progress.TimeElapsedColumn(),
                transient=False,
            )
            self.bar.start()
            self.task = self.bar.add_task(
                "", total=self.first["target"], round=self.first["id"], assigned=0,
                stage=_stage(self.first),
            )
        return self

    def update(self, r: dict[str, Any], seconds: float) -> None:
        if self.bar is not None:
            self.bar.update(
                self.task, completed=r["reports"], assigned=r["assigned"], stage=_stage(r)
            )

    def __exit__(self, *exc: Any) -> None:
        if self.bar is not None:
            self.bar.stop()


def _stage(r: dict[str, Any]) -> str:
    """A secure round's stage, as the progress line shows it ("" for other rounds)."""
    stage = r.get("stage") or 0
    return f"secure: {_STAGES.get(stage, stage)}" if stage else ""


def deployment_context(
    url: str, admin_token: str, population: str, *, browser: bool = False, **options: Any
) -> context.DeploymentContext:
    """A deployment context whose rounds run on the clients of a server's population.

    `options` are `ServerRounds`'s (`target`, `over_selection`, `quorum`, `deadline`,
    `progress`, ...). With `browser=True` the population has browser clients: each round's
    plan also carries their ONNX programs, made and checked against JAX by the preflight
    before the first round of each task (`fedlang.deploy.browser`; needs the `browser`
    extra), so a computation browsers cannot run is refused before any round starts.

    Example:
      >>> with deployment_context("http://127.0.0.1:8000", token, "digits", target=20):  # doctest: +SKIP
      ...     state, metrics = process.next(state, fedlang.deploy.client_data("train"))
    """
    tasks = None
    if browser:
        from fedlang.deploy import browser as browser_lib

        tasks = browser_lib.BrowserTasks()
    return context.DeploymentContext(ServerRounds(url, admin_token, population, **options), tasks)
