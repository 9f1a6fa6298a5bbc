"""The driver's side of rounds: rounds run by a server over HTTP.

`ServerRounds` is a `context.RoundRunner` (and a `StreamingRoundRunner`: a large model
is sent from its arrays' memory): each round's plan and broadcast value are uploaded
as blobs, the server opens a round with the cohort options, and the driver
waits (long polling, with a progress line) until the round closes, then makes its
results as its aggregate streams in (`results.read`: a large model's float64 totals are
never held), or reads the aggregate whole where they cannot be made so.
`deployment_context(url, ...)` is the `DeploymentContext` on it: the user's ordinary
driver loop, run against real clients.
"""

from __future__ import annotations

import sys
import time
import uuid
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.client import connection as connection_lib
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.driver import context
from fedlang.deploy.driver import metrics as metrics_lib
from fedlang.deploy.driver import results as results_lib
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib


class RoundFailedError(RuntimeError):
    """A round failed: its deadline passed with fewer reports than its quorum."""


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
        self.admin = admin_lib.Admin(
            connection_lib.Connection(url, patience=patience, **connection), admin_token
        )
        self.population = population
        self.options = {
            "target": target, "over_selection": over_selection, "quorum": quorum,
            "deadline": deadline, "stage_timeout": stage_timeout,
        }
        self.progress = sys.stderr.isatty() if progress is None else progress

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> context.RoundResult:
        """Runs a round of `plan` with `broadcast` on the population's clients; returns its
        results made as the aggregate streams in (`RoundResult.results`, the aggregate
        then `b""`), or its aggregate where they cannot be made so (`results.read`)."""
        start = time.perf_counter()
        plan_hash = self.admin.put_blob(plan.to_bytes())
        return self._run(plan, plan_hash, self.admin.put_blob(broadcast), start)

    def run_round_parts(
        self, plan: plan_lib.RoundPlan, broadcast: context.FrameParts
    ) -> context.RoundResult:
        """`run_round` with the broadcast sent as it is read from its parts (a
        `context.StreamingRoundRunner`); an aggregate read whole is a `bytearray` of its
        own."""
        start = time.perf_counter()
        plan_hash = self.admin.put_blob(plan.to_bytes())
        return self._run(plan, plan_hash, self.admin.put_blob_parts(broadcast, broadcast.size),
                         start)

    def _run(self, plan: plan_lib.RoundPlan, plan_hash: str, broadcast_hash: str,
             start: float) -> context.RoundResult:
        r = self.admin.create_round(
            self.population, plan_hash, broadcast_hash, request_id=uuid.uuid4().hex,
            **self.options,
        )
        with _Progress(self.progress, r) as shown:
            while r["state"] == protocol.RoundState.OPEN:
                r = self.admin.round(r["id"], wait=10.0, seen=r["reports"])
                shown.update(r, time.perf_counter() - start)
        if r["state"] != protocol.RoundState.CLOSED:
            raise RoundFailedError(r["failure"] or f"Round {r['id']} {r['state']}.")
        results = results_lib.read(self.admin, r["id"], folding.Folder(plan))
        aggregate = b"" if results is not None else self.admin.aggregate(r["id"])
        return context.RoundResult(aggregate, r["reports"], time.perf_counter() - start, r,
                                   results)

    def release_metrics(self, round_num: int, metrics: Any, evaluation: Any = None) -> int:
        """Releases round `round_num`'s metrics to the population, where the server's
        dashboard plots them; returns how many were stored.

        Args:
          round_num: the round.
          metrics: what `process.next` returned, released under the kind `train`.
          evaluation: evaluation metrics, released under the kind `eval`.

        The kinds and names are those `fedlang train --metrics-server` releases
        (`driver.metrics.round_record`, `release_form`).
        """
        form = metrics_lib.release_form(metrics_lib.round_record(metrics, evaluation))
        return self.admin.release_metrics(self.population, round_num, form) if form else 0

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
    url: str, admin_token: str, population: str, *, browser: bool = False,
    bounds: bounds_lib.ReportBounds | None = bounds_lib.DEFAULT, **options: Any
) -> context.DeploymentContext:
    """A deployment context whose rounds run on the clients of a server's population.

    `options` are `ServerRounds`'s (`target`, `over_selection`, `quorum`, `deadline`,
    `progress`, ...). With `browser=True` the population has browser clients: each round's
    plan also carries their ONNX programs, made and checked against JAX by the preflight
    before the first round of each task (`fedlang.deploy.browser`; needs the `browser`
    extra), so a computation browsers cannot run is refused before any round starts.
    `bounds` declares what a report may hold (see `DeploymentContext`).

    Example:
      >>> with deployment_context("http://127.0.0.1:8000", token, "digits", target=20):  # doctest: +SKIP
      ...     state, metrics = process.next(state, fedlang.deploy.client_data("train"))
    """
    tasks = None
    if browser:
        from fedlang.deploy import browser as browser_lib

        tasks = browser_lib.BrowserTasks()
    return context.DeploymentContext(
        ServerRounds(url, admin_token, population, **options), tasks, bounds)
