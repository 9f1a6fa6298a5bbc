"""Finalizers: how the server applies the aggregated update to its model."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import client_works, optimizers, templates
from fedlang.learning.models import model as model_lib


def build_apply_optimizer_finalizer(
    server_optimizer: Any, weights_type: Any
) -> templates.FinalizerProcess:
    """Applies the aggregated update with an Optax server optimizer.

    The update points like a gradient (initial minus trained weights), so
    `optax.sgd(1.0)` moves the model to the clients' average, and `optax.adam`,
    `optax.yogi`, `optax.adagrad` give FedAdam, FedYogi and FedAdagrad. A non-finite
    aggregate (every client excluded) leaves the model and optimizer state unchanged;
    the measurements say so, as TFF's: `{'update_non_finite': 1}` (else 0, int32).

    Args:
      server_optimizer: an Optax transformation, or `round_num -> transformation`.
      weights_type: the local type of the `ModelWeights`.

    Returns:
      A `FinalizerProcess` with state `{'round_num', 'optimizer_state'}` and
      measurements `{'update_non_finite'}`; its hparams are the optimizer's injected
      hyperparameters (`optax.inject_hyperparams`).
    """
    optimizer_fn = optimizers.as_optimizer_fn(server_optimizer, "server_optimizer")
    weights_t = types.to_type(weights_type)
    trainable_t = cast(types.StructType, weights_t)["trainable"]  # ModelWeights: a struct
    return build_optimizer_finalizer(
        optimizer_fn, weights_t, trainable_t, lambda weights: weights.trainable,
        lambda weights, trainable: model_lib.ModelWeights(trainable, weights.non_trainable))


def build_optimizer_finalizer(
    optimizer_fn: optimizers.OptimizerFn,
    weights_type: types.Type,
    params_type: types.Type,
    get_params: Callable[[model_lib.ModelWeights], model_lib.Params],
    set_params: Callable[[model_lib.ModelWeights, model_lib.Params], model_lib.ModelWeights],
) -> templates.FinalizerProcess:
    """Applies the aggregated update with an Optax server optimizer to a part of the
    weights: `build_apply_optimizer_finalizer`'s (the trainable weights), or FedPer's
    (the shared layers).

    Args:
      optimizer_fn: `round_num -> transformation` (`optimizers.as_optimizer_fn`).
      weights_type: the local type of the `ModelWeights`.
      params_type: the type of the part the optimizer steps, and of the update.
      get_params: `weights -> params`, the part (JAX code).
      set_params: `(weights, params) -> weights` with the part replaced (JAX code).

    Returns:
      A `FinalizerProcess` as `build_apply_optimizer_finalizer`'s.
    """
    zeros = tools.zeros(params_type)
    initial_state = {
        "round_num": np.int32(0),
        "optimizer_state": jax.tree.map(np.asarray, optimizer_fn(jnp.int32(0)).init(zeros)),
    }
    state_t = types.to_type(initial_state)
    # TFF's measurement: 1 when the update had a NaN or Inf (and was not applied), else 0.
    measurements_t = types.to_type({"update_non_finite": np.int32})

    @jax_backend.jax_computation()
    def initial_state_fn():
        return initial_state

    @jax_backend.jax_computation(
        state_t, weights_type, params_type, result_type=(state_t, weights_type, measurements_t))
    def apply_update(state, weights, update):
        opt = optimizer_fn(state["round_num"])
        params = get_params(weights)
        updates, opt_state = opt.update(update, state["optimizer_state"], params)
        new_params = optax.apply_updates(params, updates)
        ok = client_works.tree_is_finite(update)
        new_params, opt_state = jax.tree.map(
            lambda new, old: jnp.where(ok, new, old),
            (new_params, opt_state),
            (params, state["optimizer_state"]),
        )
        new_state = {"round_num": state["round_num"] + 1, "optimizer_state": opt_state}
        non_finite = {"update_non_finite": jnp.where(ok, 0, 1).astype(jnp.int32)}
        return new_state, set_params(weights, new_params), non_finite

    @tracing.federated_computation()
    def initialize():
        return operators.federated_eval(initial_state_fn, types.SERVER)

    @tracing.federated_computation(
        types.type_at_server(state_t), types.type_at_server(weights_type),
        types.type_at_server(params_type),
    )
    def next_fn(state, weights, update):
        out = operators.federated_map(apply_update, (state, weights, update))
        return core_processes.MeasuredProcessOutput(out[0], out[1], out[2])

    return templates.FinalizerProcess(
        initialize, next_fn, optimizers.get_state_hparams,
        lambda state, hparams: optimizers.set_state_hparams(state, hparams, "server"))
