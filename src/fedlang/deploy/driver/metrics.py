"""Releasing a driver's metrics to the server, where the dashboard plots them over rounds
(TFF's release managers; `server/ops.py`, `store/metrics.py`).

`release_metrics(url, admin_token, population, round, metrics)` releases one round's;
`ServerMetricsWriter` is a metrics writer of the experiment driver
(`fedlang.simulation.writers.MetricsWriter`) that releases every round it is given
(`fedlang train --metrics-server URL`); `BufferedDriver` releases each server step's by
itself.

Both ways release a round under the same kinds, those the dashboard draws a line each:
the experiment driver's record of a round is `{'train': what
process.next returned, 'eval': the evaluation, 'round_time_s': ...}`, and a round loop's
`ServerRounds.release_metrics(round, metrics, evaluation)` (and `BufferedDriver`, each
server step) releases `round_record(metrics, evaluation)`, the same shape. So a learning
process's parts are names under `train` (`client_work/train/loss`,
`traffic/broadcast_bits`), never kinds of their own.

A round's metrics are a nested mapping of numbers and arrays: `release_form` makes them
`{kind: {name: number}}` for the server. A top-level mapping is a kind (`train`, `eval`,
...); deeper mappings become `a/b` names; a top-level number goes under the kind `round`
(e.g. `round_time_s`). Only finite scalars are released (an array of more than one
number, a string, a NaN are left out: there is nothing to plot).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedlang.deploy.driver import admin as admin_lib

TOP_LEVEL = "round"  # the kind of a top-level number
TRAIN, EVAL = "train", "eval"  # the kinds of a process's metrics and of an evaluation's


def round_record(metrics: Any, evaluation: Any = None) -> dict[str, Any]:
    """A round's metrics as the experiment driver records them
    (`fedlang.simulation.run_training`): `metrics` (what `process.next` returned) under
    `train`, and `evaluation`, when given, under `eval`.

    Example:
      >>> release_form(round_record({"client_work": {"train": {"loss": 0.5}}}, {"loss": 0.7}))
      {'train': {'client_work/train/loss': 0.5}, 'eval': {'loss': 0.7}}
    """
    record = {TRAIN: metrics}
    if evaluation is not None:
        record[EVAL] = evaluation
    return record


def release_form(metrics: Any) -> dict[str, dict[str, float]]:
    """`metrics` (nested mappings, namedtuples, dataclasses of numbers or arrays) as
    `{kind: {name: number}}` (see the module docstring).

    Example:
      >>> release_form({"train": {"loss": 0.5, "per_class": [1, 2]}, "round_time_s": 2})
      {'train': {'loss': 0.5}, 'round': {'round_time_s': 2.0}}
    """
    out: dict[str, dict[str, float]] = {}

    def walk(node: Any, kind: str, prefix: str) -> None:
        for key, value in _items(node):
            name = f"{prefix}/{key}" if prefix else str(key)
            if _items(value) is not None and not isinstance(value, str | bytes):
                walk(value, kind, name)
            elif (number := _scalar(value)) is not None:
                out.setdefault(kind, {})[name] = number

    for key, value in _items(metrics) or ():
        if _items(value) is not None and not isinstance(value, str | bytes):
            walk(value, str(key), "")
        elif (number := _scalar(value)) is not None:
            out.setdefault(TOP_LEVEL, {})[str(key)] = number
    return out


def _items(node: Any) -> Any:
    """The (key, value) pairs of a mapping, namedtuple or dataclass; None otherwise."""
    if isinstance(node, Mapping):
        return list(node.items())
    if hasattr(node, "_asdict"):
        return list(node._asdict().items())
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        return [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    return None


def _scalar(value: Any) -> float | None:
    if isinstance(value, str | bytes) or value is None:
        return None
    try:
        array = np.asarray(value)
    except Exception:
        return None
    if array.size != 1 or array.dtype.kind not in "biuf":
        return None
    number = float(array.reshape(()).astype(np.float64))
    return number if math.isfinite(number) else None


def release_metrics(
    url: str, admin_token: str, population: str, round_num: int, metrics: Any, **connection: Any
) -> int:
    """Releases round `round_num`'s `metrics` of `population` to the server at `url`
    (`release_form`); returns how many were stored.

    Example:
      >>> release_metrics(url, token, "phones", 3, {"train": {"loss": 0.4}})  # doctest: +SKIP
      1
    """
    with admin_lib.Admin(url, admin_token, **connection) as admin:
        return admin.release_metrics(population, round_num, release_form(metrics))


class ServerMetricsWriter:
    """A metrics writer (`fedlang.simulation.writers.MetricsWriter`) that releases each
    round's metrics to a server's population.

    Args:
      url: the server.
      admin_token: its admin token.
      population: the population the metrics belong to (it must exist).
      connection: more options of `connection.Connection` (e.g. `patience`).
    """

    def __init__(self, url: str, admin_token: str, population: str, **connection: Any):
        self.admin = admin_lib.Admin(url, admin_token, **connection)
        self.population = population

    def write(self, round_num: int, metrics: Mapping[str, Any]) -> None:
        form = release_form(metrics)
        if form:
            self.admin.release_metrics(self.population, round_num, form)

    def truncate(self, round_num: int) -> None:
        """Nothing to do: a resumed run releases its rounds again, replacing them."""

    def close(self) -> None:
        self.admin.close()
