"""`compose_learning_process`: a learning process from its parts, checked against each other.

    weights@SERVER --distributor--> weights@CLIENTS --client work--> ClientResults
      --model aggregator--> update@SERVER --finalizer--> new weights@SERVER
      --non-trainable update (the clients' BatchNorm statistics...)--> weights@SERVER

Client work may keep per-client state across rounds (`ClientWorkProcess` with an
`initial_client_state`): the composed `next(state, client_data, client_states)` then
passes the cohort's states to it and returns their new values
(`StatefulLearningProcessOutput`), declared with `fedlang.with_client_state`.

Every part but the last is a measured process; the composed state holds each one's
state, and the metrics each one's measurements, under the part's name, plus
`metrics['traffic']`: the bits this round broadcast to and aggregated from the clients
(`fedlang.learning.traffic`). Before anything is traced, each part's type signature is
checked against its neighbours'; a mismatch names both parts and the differing fields.
"""

from __future__ import annotations

from typing import Any, cast

import jax.numpy as jnp
import numpy as np

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import client_state, computation, operators, tracing, traffic, types
from fedlang.core import processes as core_processes
from fedlang.learning import non_trainable, optimizers, templates, type_checks
from fedlang.learning.models import model as model_lib


def _check_kind(part: Any, cls: type, name: str) -> None:
    if not isinstance(part, cls):
        raise TypeError(f"Expected {name} to be a {cls.__name__}, found {type(part).__name__}.")


def _param(comp: computation.Computation, i: int) -> types.Type:
    return cast(types.StructType, comp.type_signature.parameter)[i]


def _result(comp: computation.Computation, name: str) -> types.Type:
    return cast(types.StructType, comp.type_signature.result)[name]


def _member(t: types.Type) -> types.Type:
    return t.member if isinstance(t, types.FederatedType) else t


def check_parts(
    weights_t: types.Type,
    distributor: templates.DistributionProcess,
    client_work: templates.ClientWorkProcess,
    aggregator: core_processes.AggregationProcess,
    finalizer: templates.FinalizerProcess,
) -> types.StructType:
    """Checks that each part accepts what its neighbour produces.

    Args:
      weights_t: the model weights' type (what the initial weights function returns).
      distributor, client_work, aggregator, finalizer: the parts.

    Returns:
      The type of one client's `ClientResult`.

    Raises:
      TypeError: naming the two parts and the fields that differ.
    """
    fits = type_checks.check_fits
    fits(_param(distributor.next, 1), types.type_at_server(weights_t),
         "model_weights_distributor's weights parameter to accept the initial model weights")
    sent = _result(distributor.next, "result")
    fits(_param(client_work.next, 1), sent,
         "client_work's weights parameter to accept what model_weights_distributor sends",
         "Build both parts for the same model weights type.")
    result_t = _member(_result(client_work.next, "result"))
    if not (isinstance(result_t, types.StructType)
            and {"update", "update_weight"} <= set(result_t.names)):
        raise TypeError(
            "Expected client_work's result to be a ClientResult(update, update_weight, "
            f"non_trainable) at CLIENTS, found {_result(client_work.next, 'result')}."
        )
    fits(aggregator.value_type, result_t["update"],
         "model_update_aggregator's value type to accept client_work's update",
         "Create the aggregator for the update's type: factory.create(update_type[, float32]).")
    if aggregator.is_weighted:
        fits(cast(types.Type, aggregator.weight_type), result_t["update_weight"],
             "model_update_aggregator's weight type to accept client_work's update_weight")
    fits(_param(finalizer.next, 1), types.type_at_server(weights_t),
         "model_finalizer's weights parameter to accept the model weights")
    fits(_param(finalizer.next, 2), _result(aggregator.next, "result"),
         "model_finalizer's update parameter to accept model_update_aggregator's result")
    fits(types.type_at_server(weights_t), _result(finalizer.next, "result"),
         "model_finalizer's result to be the model weights (it replaces them in the state)")
    return result_t


def compose_learning_process(
    initial_model_weights_fn: computation.Computation,
    model_weights_distributor: templates.DistributionProcess,
    client_work: templates.ClientWorkProcess,
    model_update_aggregator: core_processes.AggregationProcess,
    model_finalizer: templates.FinalizerProcess,
    non_trainable_update: computation.Computation | None = None,
) -> templates.LearningProcess:
    """Composes the parts into a `LearningProcess`, after checking they fit together.

    Args:
      initial_model_weights_fn: a computation `( -> ModelWeights)` (local).
      model_weights_distributor: a `DistributionProcess`.
      client_work: a `ClientWorkProcess`.
      model_update_aggregator: an `AggregationProcess` (weighted or not) of the updates.
      model_finalizer: a `FinalizerProcess`.
      non_trainable_update: how the clients' `ClientResult.non_trainable` reach the
        server's weights (`fedlang.learning.non_trainable`); default: their mean
        weighted by the update weights (`build_weighted_mean_update`).

    Returns:
      A `LearningProcess` whose state is a `LearningAlgorithmState`.

    Raises:
      TypeError: when a part has the wrong kind, or its types do not fit its
        neighbours' (the message names both parts and the differing fields).
    """
    _check_kind(model_weights_distributor, templates.DistributionProcess,
                "model_weights_distributor")
    _check_kind(client_work, templates.ClientWorkProcess, "client_work")
    _check_kind(model_update_aggregator, core_processes.AggregationProcess,
                "model_update_aggregator")
    _check_kind(model_finalizer, templates.FinalizerProcess, "model_finalizer")
    weights_t = initial_model_weights_fn.type_signature.result
    distributor, aggregator, finalizer = (
        model_weights_distributor, model_update_aggregator, model_finalizer)
    result_t = check_parts(weights_t, distributor, client_work, aggregator, finalizer)
    nt_t = result_t["non_trainable"] if "non_trainable" in result_t.names else types.StructType([])
    nt_update = non_trainable_update or non_trainable.build_weighted_mean_update(weights_t, nt_t)
    type_checks.check_fits(
        types.FunctionType(
            types.StructType([types.type_at_server(weights_t), types.type_at_clients(nt_t),
                              types.type_at_clients(np.float32)]),
            types.type_at_server(weights_t)),
        nt_update.type_signature,
        "non_trainable_update to be (<weights@SERVER,{non_trainable}@CLIENTS,"
        "{float32}@CLIENTS> -> weights@SERVER) for client_work's non_trainable results")
    data_t = _param(client_work.next, 2)
    states_t = _client_states_type(client_work, result_t)

    @tracing.federated_computation()
    def initialize():
        return operators.federated_zip(
            templates.LearningAlgorithmState(
                operators.federated_eval(initial_model_weights_fn, types.SERVER),
                distributor.initialize(),
                client_work.initialize(),
                aggregator.initialize(),
                finalizer.initialize(),
            )
        )

    def round_body(state, client_data, client_states=None):
        weights = state.global_model_weights
        sent = distributor.next(state.distributor, weights)
        if client_states is None:
            work = client_work.next(state.client_work, sent.result, client_data)
        else:
            work = client_work.next(state.client_work, sent.result, client_data, client_states)
        results = work.result
        if aggregator.is_weighted:
            agg = aggregator.next(state.aggregator, results.update, results.update_weight)
        else:
            agg = aggregator.next(state.aggregator, results.update)
        fin = finalizer.next(state.finalizer, weights, agg.result)
        nt = results.non_trainable if "non_trainable" in result_t.names else (
            operators.federated_value((), types.CLIENTS))
        new_weights = nt_update(fin.result, nt, results.update_weight)
        new_state = operators.federated_zip(
            templates.LearningAlgorithmState(new_weights, sent.state, work.state, agg.state, fin.state)
        )
        metrics = {
            "distributor": sent.measurements,
            "client_work": work.measurements,
            "aggregator": agg.measurements,
            "finalizer": fin.measurements,
        }
        if client_states is None:
            return templates.LearningProcessOutput(new_state, metrics), results.update_weight
        return (templates.StatefulLearningProcessOutput(new_state, metrics, results.client_state),
                results.update_weight)

    state_t = initialize.type_signature.result
    if states_t is None:
        @tracing.federated_computation(state_t, data_t)
        def round_fn(state, client_data):
            return round_body(state, client_data)

        next_fn = traffic_measured(round_fn)
    else:
        @tracing.federated_computation(state_t, data_t, states_t)
        def stateful_round_fn(state, client_data, client_states):
            return round_body(state, client_data, client_states)

        next_fn = client_state.with_client_state(
            traffic_measured(stateful_round_fn),
            cast(computation.Computation, client_work.initial_client_state),
            parameter="client_states", result="client_states",
        )

    def get_hparams(state: templates.ServerState) -> optimizers.Hparams:
        return {
            "client_work": client_work.get_hparams(state.client_work),
            "finalizer": finalizer.get_hparams(state.finalizer),
        }

    def set_hparams(
        state: templates.ServerState, hparams: optimizers.Hparams
    ) -> templates.ServerState:
        unknown = set(hparams) - {"client_work", "finalizer"}
        if unknown:
            raise ValueError(
                f"Expected hparams with keys 'client_work' and/or 'finalizer' (as get_hparams "
                f"returns), found {sorted(unknown)}."
            )
        if "client_work" in hparams:
            state = state._replace(
                client_work=client_work.set_hparams(state.client_work, hparams["client_work"])
            )
        if "finalizer" in hparams:
            state = state._replace(
                finalizer=finalizer.set_hparams(state.finalizer, hparams["finalizer"])
            )
        return state

    process = templates.LearningProcess(
        initialize, next_fn, get_model_weights, set_model_weights, get_hparams, set_hparams
    )
    return process


def get_model_weights(state: templates.ServerState) -> model_lib.ModelWeights:
    """The model weights held in a `LearningAlgorithmState`."""
    return model_lib.ModelWeights(*state.global_model_weights)


def set_model_weights(state: templates.ServerState, weights: Any) -> templates.ServerState:
    """A `LearningAlgorithmState` holding `weights` (as NumPy arrays).

    Raises:
      TypeError: when `weights` has no `trainable` and `non_trainable` parts.
    """
    return state._replace(global_model_weights=model_lib.to_numpy_weights(weights))


def _client_states_type(
    client_work: templates.ClientWorkProcess, result_t: types.StructType
) -> types.Type | None:
    """`{S}@CLIENTS` when `client_work` keeps client state (checked), else None."""
    init = client_work.initial_client_state
    if init is None:
        return None
    n = len(client_work.next.parameter_names)
    if n != 4:
        raise TypeError(
            "Expected client_work with an initial_client_state to take (state, weights, "
            f"client_data, client_states), found {n} parameters: {client_work.next.type_signature}."
        )
    states_t = _param(client_work.next, 3)
    state_t = init.type_signature.result
    type_checks.check_fits(states_t, types.type_at_clients(state_t),
                           "client_work's client_states parameter to take its initial_client_state")
    if "client_state" not in result_t.names:
        raise TypeError(
            "Expected client_work with client state to return a StatefulClientResult (with a "
            f"client_state field), found {result_t}."
        )
    type_checks.check_fits(state_t, result_t["client_state"],
                           "client_work's client_state result to be its client state's type")
    return states_t


def traffic_measured(round_fn: computation.Computation) -> computation.Computation:
    """`next(state, data) -> LearningProcessOutput` adding `metrics['traffic']` to a round.

    Args:
      round_fn: `(state, client_data) -> <LearningProcessOutput(state, metrics),
        {x}@CLIENTS>`, where the second result holds one value per client (to count
        them). Its metrics must be a struct of server values. A round of client work
        with client state takes `(state, client_data, client_states)` and returns a
        `StatefulLearningProcessOutput` first; so does the measured round.

    Returns:
      The round with `traffic = {'num_clients', 'broadcast_bits', 'aggregated_bits'}`
      (int32, int32, float32) in its metrics: the per-client bits of the round
      (`traffic.per_client_bits`, the count's own int32 included) times the clients.
      Client states are read and written where the clients are: they are no traffic.
    """
    sizes = traffic.per_client_bits(round_fn)
    count_t = cast(types.StructType, round_fn.type_signature.result)[1]
    down, up = float(sizes.broadcast_bits), float(sizes.aggregated_bits + 32)

    @jax_backend.jax_computation(_member(count_t))
    def one(value):
        del value
        return jnp.int32(1)

    @jax_backend.jax_computation(np.int32)
    def bits(n):
        f = n.astype(jnp.float32)
        return {"num_clients": n, "broadcast_bits": f * down, "aggregated_bits": f * up}

    def measured(
        out: tracing.Value, per_client: templates.ClientValue
    ) -> dict[str, templates.ServerValue]:
        n = operators.federated_sum(operators.federated_map(one, per_client))
        # the round's metrics are a dict: every field has a name
        names = cast(tuple[str, ...], cast(types.StructType, out.metrics.type_signature).names)
        metrics = {name: out.metrics[name] for name in names}
        metrics["traffic"] = operators.federated_map(bits, n)
        return metrics

    param_types = cast(types.StructType, round_fn.type_signature.parameter).types
    if len(param_types) == 3:
        @tracing.federated_computation(*param_types)
        def stateful_next_fn(state, client_data, client_states):
            out, per_client = round_fn(state, client_data, client_states)
            return templates.StatefulLearningProcessOutput(
                out.state, measured(out, per_client), out.client_states)

        return stateful_next_fn

    state_t, data_t = param_types

    @tracing.federated_computation(state_t, data_t)
    def next_fn(state, client_data):
        out, per_client = round_fn(state, client_data)
        return templates.LearningProcessOutput(out.state, measured(out, per_client))

    return next_fn
