"""FedBuff (Nguyen et al., 2022): FedAvg's parts, composed as a buffered process.

Clients train asynchronously from the model version they downloaded; the server
steps its optimizer whenever `buffer_size` reports arrived, each down-weighted by
its staleness. See `fedlang.learning.buffered` and docs/learning.md.
"""

from __future__ import annotations

from fedlang import aggregators
from fedlang.learning import buffered, client_works, finalizers, model_update_aggregator, optimizers
from fedlang.learning.algorithms import common, fed_avg


@common.tff_keywords
def build_fed_buff(
    model_fn: fed_avg.ModelFn,
    client_optimizer_fn: optimizers.Optimizer,
    server_optimizer_fn: optimizers.Optimizer = fed_avg.SERVER_SGD,
    *,
    buffer_size: int = 10,
    max_staleness: int = 100,
    staleness_weight: buffered.StalenessWeight | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    client_weighting: str = "num_examples",
    seed: int = 0,
) -> buffered.BufferedLearningProcess:
    """Buffered asynchronous FedAvg (FedBuff).

    Args:
      model_fn: a no-argument function returning a `fedlang.learning.models.Model`.
      client_optimizer_fn: an Optax transformation (or `round_num -> transformation`;
        clients always train with round 0's).
      server_optimizer_fn: steps the server model with the mean of each buffer
        (`optax.sgd(1.0)`: plain averaging).
      buffer_size: K, the reports per server step.
      max_staleness: reports trained from a model more than this many versions old
        are refused (and counted in `status(state)['refused_stale']`).
      staleness_weight: `tau -> weight`, multiplying a report's update; default
        `1 / sqrt(1 + tau)` (`buffered.polynomial_staleness(0.5)`).
      model_aggregator: an aggregation factory for each buffer (default
        `MeanFactory()`); DP and robust aggregators apply per buffer of K reports.
        A secure aggregator is refused (the server holds each report on its own).
      client_weighting: 'num_examples' (default) or 'uniform'.
      seed: the seed of the model's initial weights.

    Returns:
      A `BufferedLearningProcess`.

    Raises:
      ValueError: for bad sizes or weights, or a secure aggregator (the message says
        what to use instead); TypeError: for parts that are not what they should be.

    Example:
      >>> process = build_fed_buff(model_fn, optax.sgd(0.1), buffer_size=10)  # doctest: +SKIP
      >>> state = process.initialize()  # doctest: +SKIP
      >>> weights, version = process.client_model(state)  # doctest: +SKIP
      >>> report = process.train(weights, client_dataset)  # doctest: +SKIP
      >>> state = process.fold(state, report, version)  # doctest: +SKIP
      >>> if process.is_full(state):  # doctest: +SKIP
      ...     state, metrics = process.apply(state)
    """
    model = common.make_model(model_fn)
    work = client_works.build_model_delta_client_work(model, client_optimizer_fn, client_weighting)
    init_fn = common.initial_weights_fn(model, seed)
    finalizer = finalizers.build_apply_optimizer_finalizer(
        server_optimizer_fn, init_fn.type_signature.result)
    factory = aggregators.MeanFactory() if model_aggregator is None else model_aggregator
    return buffered.compose_buffered_learning_process(
        init_fn, work, factory, finalizer, buffer_size=buffer_size,
        max_staleness=max_staleness, staleness_weight=staleness_weight,
    )
