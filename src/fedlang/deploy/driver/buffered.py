"""The driver of a buffered (asynchronous, FedBuff) session on a task store server.

`BufferedDriver` runs a `BufferedProcess` (e.g. `fedlang.learning.algorithms.
build_fed_buff(...)`) against real clients: it opens a session whose clients train the
process's `train` on the current model version (`plans.buffered.BufferedPlan`), then reads
the accepted reports in the order the server stored them, folds each into the process's
buffer (`process.fold(state, report, version)`) and, when the buffer is full
(`process.is_full`), applies it (`process.apply`) and publishes the next version with
the new server state and the last report folded (`store.sessions.Sessions.publish`).

Restarts lose nothing: the server stores every accepted report before acknowledging it,
and a version is published with the state that applied its reports. A driver that starts
on an existing session (the same `request_id`, or `session=`) loads the last published
state and folds again exactly the reports accepted since: the buffer is rebuilt, and no
report is lost or counted twice. The driver keeps no other state; the server may be
killed and restarted at any moment (its requests retry while it is down).
"""

from __future__ import annotations

import base64
import dataclasses
import time
import uuid
from collections.abc import Callable
from typing import Any

from fedlang.core import processes, serialization
from fedlang.deploy import protocol
from fedlang.deploy.client import connection as connection_lib
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.driver import metrics as metrics_lib
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import buffered as buffered_plan


@dataclasses.dataclass(frozen=True)
class Step:
    """One server step of the session: the version it published and what it applied."""

    version: int
    through: int  # the last report (sequence number) in its buffer
    metrics: Any
    seconds: float


class BufferedDriver:
    """Runs a buffered process on the clients of a server's population (see the module
    docstring).

    Args:
      process: the buffered learning process.
      url: the server.
      admin_token: its admin token.
      population: the population whose clients train.
      data_name: the client dataset `train` reads.
      session: resume this session (default: the one made for `request_id`, or a new one).
      request_id: names the session, so a restarted driver resumes it.
      patience: seconds to keep retrying while the server is unreachable.
      release: release each server step's metrics to the server (for the dashboard;
        `driver.metrics`), with the version as the round.
      bounds: what a report may hold, declared in the plan and checked by the server
        (`plans.bounds.ReportBounds`; default: the defaults for the learning
        algorithms; None: no bounds).
      connection: more options of `connection.Connection`.
    """

    def __init__(
        self,
        process: processes.BufferedProcess,
        url: str,
        admin_token: str,
        population: str,
        *,
        data_name: str = "train",
        session: int | None = None,
        request_id: str | None = None,
        patience: float = 300.0,
        release: bool = True,
        bounds: bounds_lib.ReportBounds | None = bounds_lib.DEFAULT,
        **connection: Any,
    ):
        self.process = process
        self.release = release
        self.connection = connection_lib.Connection(url, patience=patience, **connection)
        self.admin = admin_lib.Admin(self.connection, admin_token)
        self.token = admin_token
        self.population = population
        self.plan = buffered_plan.BufferedPlan.build(process.train, data_name, bounds)
        # The server enforces the process's bounds: it refuses stale reports (the client
        # is told) and holds at most K unapplied reports, so every report it accepts is
        # one the process folds into the current buffer.
        self.buffer_size, self.max_staleness = process.buffer_size, process.max_staleness
        self.request_id = request_id or uuid.uuid4().hex
        self.session_id = session
        self.state: Any = None
        self.version = -1
        self.folded_through = 0  # the last report folded into `state`
        self.applied_through = 0  # the last report applied into a published version
        self.steps: list[Step] = []
        # Where `start` found the session: (version, last applied report); the reports
        # after it were folded again (`refolded` of them, with any new arrivals).
        self.resumed: tuple[int, int] | None = None
        self.refolded = 0

    # -- requests

    def _json(self, method: str, path: str, **kwargs: Any) -> Any:
        return self.connection.json(method, protocol.API + path, token=self.token, **kwargs)

    def _put_value(self, value: Any, t: Any = None) -> str:
        return self.admin.put_blob(serialization.serialize_value(value, t))

    def session(self, wait: float = 0.0, seen: int = -1) -> dict[str, Any]:
        """The session's row (long polling with `wait`, see the endpoint)."""
        return self._json(
            "GET", f"/admin/sessions/{self.session_id}", params={"wait": wait, "seen": seen},
            timeout=(self.connection.http.timeout.read or 60.0) + wait,
        )

    # -- starting and resuming

    def start(self) -> dict[str, Any]:
        """Opens the session, or resumes it: loads its last published state and folds
        the reports accepted since (the buffer the server held when it stopped)."""
        if self.session_id is None:
            state = self.process.initialize()
            weights, version = self.process.client_model(state)
            s = self._json("POST", "/admin/sessions", json={
                "population": self.population,
                "plan": self.admin.put_blob(self.plan.to_bytes()),
                "weights": self._put_value(weights, self.plan.weights_type),
                "version": int(version),
                "buffer_size": self.buffer_size,
                "max_staleness": self.max_staleness,
                "request_id": self.request_id,
            })
            self.session_id = s["id"]
        s = self.session()
        self._check_plan(s["plan"])
        if s["server_state"]:
            blob = self.connection.request(
                "GET", f"{protocol.API}/blobs/{s['server_state']}", token=self.token
            ).content
            self.state = serialization.deserialize_value(blob)
        else:
            self.state = self.process.initialize()
        self.version = int(s["version"])
        _, own = self.process.client_model(self.state)
        if int(own) != self.version:
            raise RuntimeError(
                f"Expected the stored state to be at the session's version {self.version}, "
                f"found version {own}; was session {self.session_id} made by another process?"
            )
        self.folded_through = self.applied_through = int(s["applied_through"])
        self.resumed = (self.version, self.applied_through)
        self.refolded = self._fold_new(s)
        return s

    def _check_plan(self, signed_hash: str) -> None:
        """Refuses to resume a session whose clients train another model."""
        key = base64.b64decode(self._json("GET", "/status")["server"]["public_key"])
        blob = self.connection.request(
            "GET", f"{protocol.API}/blobs/{signed_hash}", token=self.token
        ).content
        theirs = buffered_plan.load(blob, key)
        ours = self.plan
        if (theirs.weights_type, theirs.report_type, theirs.data_name) != (
            ours.weights_type, ours.report_type, ours.data_name
        ):
            raise ValueError(
                f"Expected session {self.session_id} to train this process's model "
                f"({ours.weights_type} -> {ours.report_type} on {ours.data_name!r}), found "
                f"({theirs.weights_type} -> {theirs.report_type} on {theirs.data_name!r}); "
                "use another request_id for another process."
            )

    # -- the loop

    def _fold_new(self, s: dict[str, Any]) -> int:
        """Folds the reports accepted after `folded_through`, applying and publishing
        each time the buffer fills; returns how many it folded."""
        folded = 0
        while self.folded_through < int(s["reports"]):
            items = self._json("GET", f"/admin/sessions/{self.session_id}/reports",
                               params={"after": self.folded_through})
            if not items:
                break
            for item in items:
                report = serialization.deserialize_value(
                    base64.b64decode(item["data"]), expected_type=self.plan.report_type
                )
                self.state = self.process.fold(self.state, report, int(item["version"]))
                self.folded_through = int(item["seq"])
                folded += 1
                if self.process.is_full(self.state):
                    self._apply()
        pending = self.folded_through - self.applied_through
        if pending >= self.buffer_size and not self.process.is_full(self.state):
            raise RuntimeError(
                f"The server holds {pending} reports for this buffer (its buffer size is "
                f"{self.buffer_size}) but the process's buffer is not full; was session "
                f"{self.session_id} made for another process?"
            )
        return folded

    def poll(self) -> int:
        """Folds the reports accepted since the last fold (applying and publishing each
        full buffer), without waiting; returns how many it folded."""
        if self.state is None:
            self.start()
        return self._fold_new(self.session())

    def _apply(self) -> None:
        start = time.perf_counter()
        self.state, metrics = self.process.apply(self.state)
        weights, version = self.process.client_model(self.state)
        if int(version) != self.version + 1:
            raise RuntimeError(
                f"Expected process.apply to advance the version to {self.version + 1}, found "
                f"{version}."
            )
        self._json("POST", f"/admin/sessions/{self.session_id}/versions", json={
            "version": int(version),
            "weights": self._put_value(weights, self.plan.weights_type),
            "server_state": self._put_value(self.state),
            "through": self.folded_through,
        })
        self.version = int(version)
        self.applied_through = self.folded_through
        self.steps.append(Step(self.version, self.folded_through, metrics,
                               time.perf_counter() - start))
        if self.release and (form := metrics_lib.release_form(metrics_lib.round_record(metrics))):
            self.admin.release_metrics(self.population, self.version, form)

    def run(
        self,
        steps: int,
        on_step: Callable[[Any, Step], None] | None = None,
        timeout: float | None = None,
    ) -> Any:
        """Runs until `steps` more server steps are applied; returns the state.

        Args:
          steps: server steps (published versions) to run.
          on_step: called with (state, step) after each step (e.g. to evaluate).
          timeout: give up (TimeoutError) after this many seconds.
        """
        if self.state is None:
            self.start()
        goal = self.version + steps
        end = None if timeout is None else time.monotonic() + timeout
        seen_steps = len(self.steps)
        while self.version < goal:
            if end is not None and time.monotonic() > end:
                raise TimeoutError(
                    f"Expected {steps} server steps within {timeout} s, found "
                    f"{len(self.steps) - seen_steps}; are enough clients checking in?"
                )
            s = self.session(wait=5.0, seen=self.folded_through)
            if s["state"] != protocol.SessionState.OPEN:
                raise RuntimeError(f"Session {self.session_id} was closed.")
            before = len(self.steps)
            self._fold_new(s)
            if on_step is not None:
                for step in self.steps[before:]:
                    on_step(self.state, step)
        return self.state

    def status(self) -> dict[str, Any]:
        """The process's own status (version, buffer fill, staleness, refusals)."""
        return self.process.status(self.state)

    def close_session(self) -> None:
        """Closes the session: its clients get no more tasks."""
        self._json("POST", f"/admin/sessions/{self.session_id}/close")

    def close(self) -> None:
        """Closes the connection to the server."""
        self.connection.close()

    def __enter__(self) -> BufferedDriver:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
