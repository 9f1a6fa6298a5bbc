"""Evaluation of model weights on data: one client's dataset, or a centralized one.

`build_local_evaluation(model)` is the `jax_computation` that federated evaluation
maps over clients (it returns summed statistics); `build_centralized_evaluation` and
`evaluate` run it on a held-out dataset on the server side and finalize the metrics.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, types
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.models import model as model_lib


def build_local_evaluation(model: model_lib.Model) -> computation.Computation:
    """`(ModelWeights, sequence<batch>) -> stats`: summed evaluation statistics.

    The model runs with `training=False`; the stats are those of
    `metrics.zero_stats` (loss sum, examples, batches, each metric), ready to be summed
    over clients and finalized with `metrics.finalize_stats`.
    """
    weights_t = model.weights_type()
    data_t = types.SequenceType(model.input_spec)
    metrics = model.metrics

    @jax_backend.jax_computation(weights_t, data_t)
    def evaluate_client(weights, dataset):
        def step(stats, batch, padding):
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)
            preds, _ = model.apply(weights, x, training=False)
            loss = model.loss(preds, y, mask)
            return metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)

        return dataset.reduce(metrics_lib.zero_stats(metrics), step, masked=True)

    return evaluate_client


def build_finalize(model: model_lib.Model, stats_type: types.Type) -> computation.Computation:
    """`stats -> metrics`: finalizes `model`'s summed statistics of type `stats_type`
    (`metrics.finalize_stats`), e.g. on the server after a `federated_sum`."""

    @jax_backend.jax_computation(stats_type)
    def finalize(stats):
        return metrics_lib.finalize_stats(model.metrics, stats)

    return finalize


def build_centralized_evaluation(
    model_fn: Callable[[], model_lib.Model] | model_lib.Model,
) -> Callable[[Any, Iterable[model_lib.Batch]], metrics_lib.MetricValues]:
    """A function `(weights, dataset) -> metrics` evaluating weights on held-out data.

    Args:
      model_fn: a model, or a no-argument function returning one.

    Returns:
      `evaluate(weights, dataset)`: `weights` a `ModelWeights` (e.g.
      `process.get_model_weights(state)`), `dataset` any iterable of batches; returns
      `{'loss', <metrics>, 'num_examples', 'num_batches'}` as NumPy values. It is
      compiled once and reused.
    """
    model = model_fn if isinstance(model_fn, model_lib.Model) else model_fn()
    local = build_local_evaluation(model)
    finalize = build_finalize(model, local.type_signature.result)

    def evaluate_weights(
        weights: Any, dataset: Iterable[model_lib.Batch]
    ) -> metrics_lib.MetricValues:
        w = model_lib.to_numpy_weights(weights)
        return finalize(local(w, dataset))

    return evaluate_weights


def evaluate(
    model: model_lib.Model, weights: Any, dataset: Iterable[model_lib.Batch]
) -> metrics_lib.MetricValues:
    """Evaluates `weights` of `model` on `dataset` (any iterable of batches), centrally.

    Builds the evaluation each call; keep `build_centralized_evaluation(model)` to
    evaluate repeatedly (e.g. between rounds).
    """
    return build_centralized_evaluation(model)(weights, dataset)


