"""Federated evaluation: metrics of the server's weights on the clients' data."""

from __future__ import annotations

from typing import Any

import jax

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, tracing, types
from fedlang.learning import composers, distributors, evaluation, templates
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import ModelFn
from fedlang.learning.models import model as model_lib


@common.tff_keywords
def build_fed_eval(
    model_fn: ModelFn,
    *,
    model_distributor: templates.DistributionProcess | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Federated evaluation (TFF's `build_fed_eval`).

    `next(state, client_data)` evaluates the state's weights on each client's data and
    sums the statistics over clients (metrics weighted by examples). Set the weights
    to evaluate with `process.set_model_weights(state, weights)`.

    Metrics: `metrics['client_work']['eval']['current_round_metrics']` (this call's
    clients) and `['total_rounds_metrics']` (all calls so far on this state), each
    `{'loss', <metrics>, 'num_examples', 'num_batches'}`; `metrics['traffic']` as for
    training processes.

    Args:
      model_fn: a no-argument function returning a model.
      model_distributor: replaces the broadcast of the weights.
      seed: the seed of the initial weights (usually replaced with set_model_weights).

    Returns:
      A `LearningProcess`; the weights never change.
    """
    model = common.make_model(model_fn)
    init_weights = common.initial_weights_fn(model, seed)
    weights_t = init_weights.type_signature.result
    local = evaluation.build_local_evaluation(model)
    stats_t = local.type_signature.result
    distributor = model_distributor or distributors.build_broadcast_process(weights_t)
    data_t = types.type_at_clients(types.SequenceType(model.input_spec))

    @jax_backend.jax_computation()
    def zero():
        return metrics_lib.zero_stats(model.metrics)

    @jax_backend.jax_computation(stats_t, stats_t, result_type=stats_t)
    def add(a, b):
        return jax.tree.map(lambda x, y: x + y, a, b)

    @jax_backend.jax_computation(stats_t)
    def finalize(stats):
        return metrics_lib.finalize_stats(model.metrics, stats)

    @tracing.federated_computation()
    def initialize():
        return operators.federated_zip(
            templates.LearningAlgorithmState(
                operators.federated_eval(init_weights, types.SERVER),
                distributor.initialize(),
                operators.federated_eval(zero, types.SERVER),
                operators.federated_value((), types.SERVER),
                operators.federated_value((), types.SERVER),
            )
        )

    @tracing.federated_computation(initialize.type_signature.result, data_t)
    def round_fn(state, client_data):
        sent = distributor.next(state.distributor, state.global_model_weights)
        client_stats = operators.federated_map(local, (sent.result, client_data))
        stats = operators.federated_sum(client_stats)
        total = operators.federated_map(add, (state.client_work, stats))
        new_state = operators.federated_zip(
            templates.LearningAlgorithmState(
                state.global_model_weights, sent.state, total, state.aggregator, state.finalizer
            )
        )
        eval_metrics = {
            "current_round_metrics": operators.federated_map(finalize, stats),
            "total_rounds_metrics": operators.federated_map(finalize, total),
        }
        metrics = {
            "distributor": sent.measurements,
            "client_work": {"eval": eval_metrics},
            "aggregator": operators.federated_value({}, types.SERVER),
            "finalizer": operators.federated_value({}, types.SERVER),
        }
        return templates.LearningProcessOutput(new_state, metrics), client_stats.num_examples

    next_fn = composers.traffic_measured(round_fn)

    def get_model_weights(state: Any) -> model_lib.ModelWeights:
        return model_lib.ModelWeights(*state.global_model_weights)

    def set_model_weights(state: Any, weights: Any) -> Any:
        return state._replace(global_model_weights=model_lib.to_numpy_weights(weights))

    return templates.LearningProcess(initialize, next_fn, get_model_weights, set_model_weights)
