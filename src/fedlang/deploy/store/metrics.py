"""What an operator watches, in the task store: the metrics a driver released per round,
each task's refused uploads by reason, and the queries the overview and `/metrics` read.

A driver **releases** a round's metrics (training and evaluation, or any other kind) to
the server after the round (TFF's release managers; `driver.admin.Admin.release_metrics`):
one row per (population, round, kind, name) in `released_metrics`, so releasing a round's
metrics again replaces them. A buffered session releases per model version (its
`round` is the version). Values are finite numbers; nested names are flattened with `/`
(`{"train": {"client": {"loss": 1}}}` is kind `train`, name `client/loss`).

Refusals are counted globally (`counters`, `refused:REASON`); `task_refusals` also
counts them per task (`round:ID`, `session:ID`) and reason (`Store.count_refusal`), for
the overview's rounds. Refused admin requests (a request for an admin route without
the admin token) are no report and no client's: they are counted apart
(`admin_refused:REASON`, counted through `count_refusals`), and `refusal_counts` splits the counters
into the two.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib

MAX_NAME = 200  # the longest kind or metric name (characters)
MAX_DEPTH = 8  # the deepest nesting of names under a kind


def flatten(metrics: Mapping[str, Any]) -> list[tuple[str, str, float]]:
    """(kind, name, value) of each metric of `{kind: {name: value or {...}}}`, deeper
    mappings flattened into `a/b` names.

    Raises:
      ValueError: a kind that is not a mapping, a value that is not a finite number (a
        bool is not one), a name longer than `MAX_NAME` or nested deeper than
        `MAX_DEPTH`; the message names the key.
    """
    if not isinstance(metrics, Mapping):
        raise ValueError(
            f"Expected metrics as {{kind: {{name: number}}}}, found {type(metrics).__name__}."
        )
    out: list[tuple[str, str, float]] = []

    def walk(kind: str, node: Any, prefix: str, depth: int) -> None:
        if depth > MAX_DEPTH:
            raise ValueError(
                f"Expected metric names nested at most {MAX_DEPTH} deep, found "
                f"{kind}/{prefix[:60]!r}... deeper."
            )
        for key, value in node.items():
            name = f"{prefix}/{key}" if prefix else str(key)
            where = f"{kind}/{name}"
            if len(name) > MAX_NAME:
                raise ValueError(
                    f"Expected metric names of at most {MAX_NAME} characters, found {where[:60]!r}..."
                )
            if isinstance(value, Mapping):
                walk(kind, value, name, depth + 1)
            elif isinstance(value, bool) or not isinstance(value, int | float):
                raise ValueError(
                    f"Expected a number for metric {where!r}, found {type(value).__name__}."
                )
            elif not math.isfinite(value):
                raise ValueError(f"Expected a finite number for metric {where!r}, found {value!r}.")
            else:
                out.append((kind, name, float(value)))

    for kind, values in metrics.items():
        if not isinstance(values, Mapping):
            raise ValueError(
                f"Expected the metrics of kind {kind!r} as {{name: number}}, found "
                f"{type(values).__name__}; put it under a kind, e.g. {{'train': {{{kind!r}: ...}}}}."
            )
        if not 0 < len(str(kind)) <= MAX_NAME:
            raise ValueError(f"Expected a kind of 1 to {MAX_NAME} characters, found {kind!r}.")
        walk(str(kind), values, "", 1)
    return out


def release(
    store: store_lib.Store, population: str, round_num: int, metrics: Mapping[str, Any]
) -> int:
    """Stores the metrics of round `round_num` of `population` (replacing those of the same
    round, kind and name); returns how many.

    Raises:
      ValueError: see `flatten`.
      NotFound: no such population.
    """
    rows = flatten(metrics)
    with store.transaction(write=True) as tx:
        _population(tx, population)
        now = store.clock()
        for kind, name, value in rows:
            tx.run(
                "INSERT INTO released_metrics (population, round, kind, name, value, released)"
                " VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (population, round, kind, name)"
                " DO UPDATE SET value = excluded.value, released = excluded.released",
                (population, round_num, kind, name, value, now),
            )
    return len(rows)


def released(
    store: store_lib.Store, population: str, since: float | None = None
) -> list[dict[str, Any]]:
    """The released metrics of `population` (released after `since`, when given), by
    round, kind and name.

    Raises:
      NotFound: no such population.
    """
    query = "SELECT round, kind, name, value, released FROM released_metrics WHERE population = ?"
    params: tuple[Any, ...] = (population,)
    if since is not None:
        query, params = query + " AND released > ?", (*params, since)
    with store.transaction() as tx:
        _population(tx, population)
        rows = tx.all(query + " ORDER BY round, kind, name", params)
    keys = ("round", "kind", "name", "value", "released")
    return [dict(zip(keys, row)) for row in rows]


def _population(tx: sql.Tx, name: str) -> None:
    if tx.one("SELECT 1 FROM populations WHERE name = ?", (name,)) is None:
        raise protocol.NotFound(f"Expected an existing population, found {name!r}.")


def refusals(store: store_lib.Store, tasks: Iterable[str]) -> dict[str, dict[str, int]]:
    """The refused uploads of each of `tasks` by reason (`{}` for a task with none)."""
    wanted = list(tasks)
    out: dict[str, dict[str, int]] = {t: {} for t in wanted}
    if not wanted:
        return out
    marks = ", ".join("?" * len(wanted))
    with store.transaction() as tx:
        rows = tx.all(
            f"SELECT task, reason, count FROM task_refusals WHERE task IN ({marks})"
            " ORDER BY task, reason",
            tuple(wanted),
        )
    for task, reason, count in rows:
        out[task][reason] = int(count)
    return out


REFUSED = "refused:"  # a refused upload or client request, by reason
ADMIN_REFUSED = "admin_refused:"  # a refused admin request, by reason
# A connection closed, or a request cut, by a connection budget (`serve.Limits`): by the
# limit that did it (`connections_per_address`, `unfinished_per_address`,
# `header_timeout`, `body_stall`, `body_rate`, `body_not_allowed`).
CONNECTIONS_REFUSED = "connections_refused:"
# What an older server counted as `refused:admin_unauthorized`.
_LEGACY_ADMIN = {"admin_unauthorized": "unauthorized"}


def refusal_counts(counters: Mapping[str, int]) -> tuple[dict[str, int], dict[str, int]]:
    """`(reports and client requests refused, admin requests refused)`, each by reason,
    from the store's `counters` (a count kept by an older server as
    `refused:admin_unauthorized` is an admin request's, `unauthorized`).

    Example:
      >>> refusal_counts({"refused:late": 1, "admin_refused:unauthorized": 2, "checkins": 5})
      ({'late': 1}, {'unauthorized': 2})
    """
    refused: dict[str, int] = {}
    admin: dict[str, int] = {}
    for key, value in sorted(counters.items()):
        if key.startswith(ADMIN_REFUSED):
            reason = key.removeprefix(ADMIN_REFUSED)
            admin[reason] = admin.get(reason, 0) + int(value)
        elif key.startswith(REFUSED):
            reason = key.removeprefix(REFUSED)
            if reason in _LEGACY_ADMIN:
                reason = _LEGACY_ADMIN[reason]
                admin[reason] = admin.get(reason, 0) + int(value)
            else:
                refused[reason] = int(value)
    return refused, admin


def count_refusals(store: store_lib.Store, prefix: str, counts: Mapping[str, int]) -> None:
    """Adds refusals by reason to the counters `PREFIX:REASON` (`CONNECTIONS_REFUSED`,
    `ADMIN_REFUSED`), in one transaction (`telemetry.Refusals` gathers them for a second
    first)."""
    with store.transaction(write=True) as tx:
        for reason, n in sorted(counts.items()):
            tx.count(f"{prefix}{reason}", n)


def connection_refusals(counters: Mapping[str, int]) -> dict[str, int]:
    """The connections and requests a connection budget refused, by reason, from the
    store's `counters`.

    Example:
      >>> connection_refusals({"connections_refused:body_rate": 2, "refused:late": 1})
      {'body_rate': 2}
    """
    return {key.removeprefix(CONNECTIONS_REFUSED): int(value)
            for key, value in sorted(counters.items()) if key.startswith(CONNECTIONS_REFUSED)}


def seen_since(store: store_lib.Store, since: float) -> dict[str, int]:
    """Each population's enrolled clients that checked in after time `since`."""
    with store.transaction() as tx:
        rows = tx.all(
            "SELECT population, COUNT(*) FROM clients WHERE last_seen > ? GROUP BY population",
            (since,),
        )
    return {str(p): int(n) for p, n in rows}


def round_durations(store: store_lib.Store) -> list[float]:
    """The seconds each ended round (closed or failed) took, from its creation."""
    with store.transaction() as tx:
        rows = tx.all("SELECT closed - created FROM rounds WHERE closed IS NOT NULL")
    return [float(d) for (d,) in rows]
