"""Federated evaluation: metrics of the server's weights on the clients' data."""

from __future__ import annotations

from collections.abc import Callable

import jax

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, tracing, types
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
    local = evaluation.build_local_evaluation(model)
    distributor = model_distributor or distributors.build_broadcast_process(
        init_weights.type_signature.result)

    def client_stats(
        weights: templates.ClientValue, client_data: templates.ClientValue
    ) -> templates.ClientValue:
        return operators.federated_map(local, (weights, client_data))

    return build_eval_process(model, init_weights, distributor, client_stats)


def build_eval_process(
    model: model_lib.Model,
    initial_weights_fn: computation.Computation,
    distributor: templates.DistributionProcess,
    client_stats: Callable[[templates.ClientValue, templates.ClientValue], templates.ClientValue],
) -> templates.LearningProcess:
    """An evaluation process around `client_stats(weights@CLIENTS, data@CLIENTS) ->
    stats@CLIENTS`, the clients' summed statistics of `model` (`metrics.zero_stats`'s).

    `next(state, client_data)` distributes the state's weights, sums the clients'
    statistics and adds them to the running total kept as the client work's state; its
    metrics are `build_fed_eval`'s. Federated Reconstruction's evaluation is one too,
    with statistics taken after reconstructing each client's local weights.

    Args:
      model: the model evaluated (its input spec types the clients' data).
      initial_weights_fn: `( -> ModelWeights)`, the weights the state starts with.
      distributor: sends the weights to the clients.
      client_stats: traced in the round's federated computation.

    Returns:
      A `LearningProcess` whose weights never change.
    """
    data_t = types.type_at_clients(types.SequenceType(model.input_spec))

    @jax_backend.jax_computation()
    def zero():
        return metrics_lib.zero_stats(model.metrics)

    stats_t = zero.type_signature.result

    @jax_backend.jax_computation(stats_t, stats_t, result_type=stats_t)
    def add(a, b):
        return jax.tree.map(lambda x, y: x + y, a, b)

    finalize = evaluation.build_finalize(model, stats_t)

    @tracing.federated_computation()
    def initialize():
        return operators.federated_zip(
            templates.LearningAlgorithmState(
                operators.federated_eval(initial_weights_fn, types.SERVER),
                distributor.initialize(),
                operators.federated_eval(zero, types.SERVER),
                operators.federated_value((), types.SERVER),
                operators.federated_value((), types.SERVER),
            )
        )

    @tracing.federated_computation(initialize.type_signature.result, data_t)
    def round_fn(state, client_data):
        sent = distributor.next(state.distributor, state.global_model_weights)
        stats_at_clients = client_stats(sent.result, client_data)
        stats = operators.federated_sum(stats_at_clients)
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
        return templates.LearningProcessOutput(new_state, metrics), stats_at_clients.num_examples

    return templates.LearningProcess(
        initialize, composers.traffic_measured(round_fn), composers.get_model_weights,
        composers.set_model_weights)
