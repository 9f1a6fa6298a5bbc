"""Metrics as sufficient statistics: summed on clients, finalized on the server.

A `Metric` is a pure triple: `zero() -> stats`, `accumulate(stats, predictions, y,
mask) -> stats` and `finalize(stats) -> value`. Stats must be *sums* (of correct
predictions, of examples...) so that the sum over clients, finalized once on the
server, is the metric over the union of the clients' examples, weighted by examples
(not the average of per-client averages).
"""

from __future__ import annotations

import abc
import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, cast

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # for annotations only: the models import this module
    from fedlang.learning.models import model as model_lib

# Sufficient statistics: a pytree of arrays that sums over batches and clients.
Stats = Any
# Finalized metrics by name, e.g. `{'loss', <metrics>, 'num_examples', 'num_batches'}`:
# arrays, or (a round's metrics) dicts of them.
MetricValues = dict[str, Any]


class Metric(abc.ABC):
    """A metric computed from summed sufficient statistics.

    Attributes:
      name: the key the finalized value is reported under.
    """

    name: str

    @abc.abstractmethod
    def zero(self) -> Stats:
        """The statistics of no examples (a pytree of fixed-shape arrays)."""

    @abc.abstractmethod
    def accumulate(self, stats: Stats, predictions: model_lib.Predictions, y: Any,
                   mask: model_lib.Mask) -> Stats:
        """Adds one batch to `stats`; `mask` is a float32 vector of 0/1 per example."""

    @abc.abstractmethod
    def finalize(self, stats: Stats) -> Any:
        """The metric value from (summed) statistics."""


class Accuracy(Metric):
    """The fraction of examples whose `argmax(predictions)` equals the integer label.

    Args:
      name: the key of the metric (default 'accuracy').
    """

    def __init__(self, name: str = "accuracy"):
        self.name = name

    def zero(self) -> Stats:
        return {"correct": jnp.float32(0), "count": jnp.float32(0)}

    def accumulate(self, stats: Stats, predictions: model_lib.Predictions, y: Any,
                   mask: model_lib.Mask) -> Stats:
        labels = jnp.reshape(y, (y.shape[0], *predictions.shape[1:-1]))
        hit = (jnp.argmax(predictions, axis=-1) == labels.astype(jnp.int32)).astype(jnp.float32)
        hit = per_example_mean(hit)
        return {
            "correct": stats["correct"] + jnp.sum(hit * mask),
            "count": stats["count"] + jnp.sum(mask),
        }

    def finalize(self, stats: Stats) -> Any:
        return stats["correct"] / jnp.maximum(stats["count"], 1.0)


class MeanMetric(Metric):
    """The mean over examples of `fn(predictions, y) -> float[batch]` (per-example values).

    Args:
      fn: JAX function of one batch returning one value per example.
      name: the key of the metric (default: the function's name).
    """

    def __init__(self, fn: Callable[[model_lib.Predictions, Any], Any], name: str | None = None):
        self.fn = fn
        self.name = name or cast(str, getattr(fn, "__name__", "metric"))

    def zero(self) -> Stats:
        return {"total": jnp.float32(0), "count": jnp.float32(0)}

    def accumulate(self, stats: Stats, predictions: model_lib.Predictions, y: Any,
                   mask: model_lib.Mask) -> Stats:
        values = jnp.asarray(self.fn(predictions, y), jnp.float32)
        values = per_example_mean(values)
        return {
            "total": stats["total"] + jnp.sum(values * mask),
            "count": stats["count"] + jnp.sum(mask),
        }

    def finalize(self, stats: Stats) -> Any:
        return stats["total"] / jnp.maximum(stats["count"], 1.0)


def per_example_mean(values: jax.Array) -> jax.Array:
    """`values[batch, ...] -> float[batch]`: the mean over each example's entries (e.g.
    tokens). Written without a `-1` dimension, so a batch of 0 examples gives `[]`."""
    size = math.prod(values.shape[1:])
    return jnp.reshape(values, (values.shape[0], size)).mean(axis=1) if size else jnp.zeros(
        values.shape[:1], values.dtype)


def as_metrics(metrics: Any) -> tuple[Metric, ...]:
    """Normalizes a metrics argument: None, a `Metric`, a function, or a sequence of them.

    Functions become `MeanMetric`s; Keras metric objects are wrapped by the Keras
    adapter. Names must be unique.

    Raises:
      TypeError: for anything else; ValueError: for duplicate names.
    """
    if metrics is None:
        return ()
    if isinstance(metrics, Metric) or (callable(metrics) and not isinstance(metrics, Sequence)):
        metrics = [metrics]
    out: list[Metric] = []
    for m in metrics:
        if isinstance(m, Metric):
            out.append(m)
        elif callable(m):
            out.append(MeanMetric(m))
        else:
            raise TypeError(
                "Expected a fedlang.learning.metrics.Metric or a function "
                f"(predictions, y) -> per-example values, found {type(m).__name__}."
            )
    names = [m.name for m in out]
    reserved = {"loss", "num_examples", "num_batches"}
    for n in names:
        if names.count(n) > 1 or n in reserved:
            raise ValueError(
                f"Metric names must be unique and not one of {sorted(reserved)}, found {n!r} "
                f"among {names}. Pass name=... to rename one."
            )
    return tuple(out)


# --- the statistics every model reports, and their finalization -------------------------


def zero_stats(metrics: Sequence[Metric]) -> Stats:
    """Zero statistics for loss, examples, batches and each metric."""
    return {
        "loss_sum": jnp.float32(0),
        "num_examples": jnp.int32(0),
        "num_batches": jnp.int32(0),
        "metrics": {m.name: m.zero() for m in metrics},
    }


def accumulate_stats(
    metrics: Sequence[Metric], stats: Stats, loss: jax.Array, predictions: model_lib.Predictions,
    y: Any, mask: model_lib.Mask,
) -> Stats:
    """Adds one batch (its mean `loss` over unmasked examples) to `stats`."""
    n = jnp.sum(mask)
    return {
        "loss_sum": stats["loss_sum"] + loss * n,
        "num_examples": stats["num_examples"] + n.astype(jnp.int32),
        "num_batches": stats["num_batches"] + (n > 0).astype(jnp.int32),
        "metrics": {
            m.name: m.accumulate(stats["metrics"][m.name], predictions, y, mask) for m in metrics
        },
    }


def scale_stats(stats: Stats, keep: jax.Array) -> Stats:
    """`stats` where `keep` (a boolean scalar), zeros elsewhere (excludes a client)."""
    return jax.tree.map(lambda s: jnp.where(keep, s, jnp.zeros_like(s)), stats)


def finalize_stats(metrics: Sequence[Metric], stats: Stats) -> MetricValues:
    """The reported metrics from (summed) statistics: loss, each metric, counts."""
    out = {"loss": stats["loss_sum"] / jnp.maximum(stats["num_examples"], 1).astype(jnp.float32)}
    for m in metrics:
        out[m.name] = m.finalize(stats["metrics"][m.name])
    out["num_examples"] = stats["num_examples"]
    out["num_batches"] = stats["num_batches"]
    return out
