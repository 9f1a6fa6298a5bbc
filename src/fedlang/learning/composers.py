"""`compose_learning_process`: a learning process from its four parts.

    weights@SERVER --distributor--> weights@CLIENTS --client work--> ClientResults
      --model aggregator--> update@SERVER --finalizer--> new weights@SERVER

Every part is a measured process; the composed state holds each part's state, and
the metrics each part's measurements, under the part's name.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from fedlang.core import computation, operators, tracing, types
from fedlang.core import jax_computation as jax_backend
from fedlang.core import templates as core_templates
from fedlang.learning import templates
from fedlang.learning.models import model as model_lib


def _check(part: Any, cls: type, name: str) -> None:
    if not isinstance(part, cls):
        raise TypeError(f"Expected {name} to be a {cls.__name__}, found {type(part).__name__}.")


def compose_learning_process(
    initial_model_weights_fn: computation.Computation,
    model_weights_distributor: templates.DistributionProcess,
    client_work: templates.ClientWorkProcess,
    model_update_aggregator: core_templates.AggregationProcess,
    model_finalizer: templates.FinalizerProcess,
) -> templates.LearningProcess:
    """Composes the four parts into a `LearningProcess`.

    Floating non-trainable weights the clients report in `ClientResult.non_trainable`
    (BatchNorm statistics) are averaged with the update weights and replace the
    server's; other non-trainable weights keep their server values.

    Args:
      initial_model_weights_fn: a computation `( -> ModelWeights)` (local).
      model_weights_distributor: a `DistributionProcess`.
      client_work: a `ClientWorkProcess`.
      model_update_aggregator: an `AggregationProcess` (weighted or not) of the updates.
      model_finalizer: a `FinalizerProcess`.

    Returns:
      A `LearningProcess` whose state is a `LearningAlgorithmState`.

    Raises:
      TypeError: when a part has the wrong kind.
    """
    _check(model_weights_distributor, templates.DistributionProcess, "model_weights_distributor")
    _check(client_work, templates.ClientWorkProcess, "client_work")
    _check(model_update_aggregator, core_templates.AggregationProcess, "model_update_aggregator")
    _check(model_finalizer, templates.FinalizerProcess, "model_finalizer")
    weights_t = initial_model_weights_fn.type_signature.result
    data_t = client_work.next.type_signature.parameter[2]  # type: ignore[index]
    result_t = client_work.next.type_signature.result["result"].member  # type: ignore[index, union-attr]
    nt_t = result_t["non_trainable"]
    distributor, aggregator, finalizer = model_weights_distributor, model_update_aggregator, model_finalizer

    @jax_backend.jax_computation(nt_t, np.float32)
    def weigh(nt, w):
        return [x * w.astype(x.dtype) for x in nt], w

    @jax_backend.jax_computation(weights_t, (nt_t, np.float32), result_type=weights_t)
    def set_non_trainable(weights, nt_sum):
        import jax

        total, w = nt_sum
        leaves, treedef = jax.tree.flatten(weights.non_trainable)
        it = iter(total)
        new = [
            jnp.where(w > 0, next(it) / jnp.where(w > 0, w, 1).astype(x.dtype), x)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
            for x in leaves
        ]
        return model_lib.ModelWeights(weights.trainable, jax.tree.unflatten(treedef, new))

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

    @tracing.federated_computation(initialize.type_signature.result, data_t)
    def next_fn(state, client_data):
        weights = state.global_model_weights
        sent = distributor.next(state.distributor, weights)
        work = client_work.next(state.client_work, sent.result, client_data)
        results = work.result
        if aggregator.is_weighted:
            agg = aggregator.next(state.aggregator, results.update, results.update_weight)
        else:
            agg = aggregator.next(state.aggregator, results.update)
        fin = finalizer.next(state.finalizer, weights, agg.result)
        new_weights = fin.result
        if len(nt_t):
            nt_sum = operators.federated_sum(
                operators.federated_map(weigh, (results.non_trainable, results.update_weight))
            )
            new_weights = operators.federated_map(set_non_trainable, (new_weights, nt_sum))
        new_state = operators.federated_zip(
            templates.LearningAlgorithmState(new_weights, sent.state, work.state, agg.state, fin.state)
        )
        metrics = {
            "distributor": sent.measurements,
            "client_work": work.measurements,
            "aggregator": agg.measurements,
            "finalizer": fin.measurements,
        }
        return templates.LearningProcessOutput(new_state, metrics)

    def get_model_weights(state: Any) -> model_lib.ModelWeights:
        return model_lib.ModelWeights(*state.global_model_weights)

    def set_model_weights(state: Any, weights: Any) -> Any:
        return state._replace(global_model_weights=model_lib.to_numpy_weights(weights))

    def get_hparams(state: Any) -> dict[str, Any]:
        return {
            "client_work": client_work.get_hparams(state.client_work),
            "finalizer": finalizer.get_hparams(state.finalizer),
        }

    def set_hparams(state: Any, hparams: Any) -> Any:
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

    return templates.LearningProcess(
        initialize, next_fn, get_model_weights, set_model_weights, get_hparams, set_hparams
    )
