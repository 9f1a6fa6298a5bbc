"""Mime Lite (Karimireddy et al., 2021): clients use the server's optimizer state.

The server keeps a base optimizer's state (e.g. momentum) and sends it with the
model. Clients take local steps with the base optimizer *without updating its state*
and also compute the full-batch gradient at the server weights. The server averages
the model deltas (applied with `server_optimizer`) and updates the base optimizer's
state with the averaged full gradient.
"""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang import aggregators
from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import client_works, model_update_aggregator, optimizers, templates
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import SERVER_SGD, ModelFn
from fedlang.learning.models import model as model_lib


def _mime_client_work(
    model: model_lib.Model, base_optimizer: optax.GradientTransformation, weighting: str,
    full_gradient_aggregator: aggregators.WeightedAggregationFactory,
) -> templates.ClientWorkProcess:
    weights_t = model.weights_type()
    trainable_t = cast(types.StructType, weights_t)["trainable"]  # ModelWeights: a struct
    data_t = types.SequenceType(model.input_spec)
    zeros = tools.zeros(trainable_t)
    initial_state = jax.tree.map(np.asarray, base_optimizer.init(zeros))
    state_t = types.to_type(initial_state)
    metrics = model.metrics
    grad_agg = full_gradient_aggregator.create(trainable_t, np.float32)

    @jax_backend.jax_computation(weights_t, state_t, data_t)
    def client_update(initial_weights, opt_state, dataset):
        w0 = initial_weights.trainable
        zero_grads = jax.tree.map(jnp.zeros_like, w0)

        def step(carry, batch, padding):
            weights, grad_sum, stats = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)

            new, _, loss, preds = client_works.train_step(  # the base state stays frozen
                model, base_optimizer, weights, opt_state, x, y, mask)
            loss_fn = client_works.train_loss(model, weights.non_trainable, x, y, mask)
            full_grads = jax.grad(lambda t: loss_fn(t)[0])(w0)
            n = jnp.sum(mask)
            new = jax.tree.map(lambda a, b: jnp.where(n > 0, a, b), new, weights)
            grad_sum = jax.tree.map(lambda s, g: s + g * n.astype(g.dtype), grad_sum, full_grads)
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            return new, grad_sum, stats

        final, grad_sum, stats = dataset.reduce(
            (initial_weights, zero_grads, metrics_lib.zero_stats(metrics)), step, masked=True
        )
        update = jax.tree.map(lambda a, b: a - b, w0, final.trainable)
        out = client_works.client_output(
            model, update, stats["num_examples"], weighting, stats,
            client_works.float_leaves(final.non_trainable),
        )
        n = jnp.maximum(stats["num_examples"], 1).astype(jnp.float32)
        full = jax.tree.map(lambda g: g / n.astype(g.dtype), grad_sum)
        finite = client_works.tree_is_finite(full) & (out["update_weight"] > 0)
        out["full_gradient"] = client_works.zero_where(finite, full)
        out["full_gradient_weight"] = jnp.where(finite, n, jnp.float32(0))
        return out

    to_result = client_works.build_to_result(client_update.type_signature.result)

    @jax_backend.jax_computation(state_t, trainable_t, result_type=state_t)
    def update_state(opt_state, full_gradient):
        _, new_state = base_optimizer.update(full_gradient, opt_state)
        ok = client_works.tree_is_finite(full_gradient)
        return jax.tree.map(lambda a, b: jnp.where(ok, a, b), new_state, opt_state)

    @jax_backend.jax_computation()
    def initial_state_fn():
        return initial_state

    @tracing.federated_computation()
    def initialize():
        return operators.federated_zip(
            {
                "optimizer_state": operators.federated_eval(initial_state_fn, types.SERVER),
                "full_gradient_aggregator": grad_agg.initialize(),
            }
        )

    @tracing.federated_computation(
        initialize.type_signature.result, types.type_at_clients(weights_t),
        types.type_at_clients(data_t),
    )
    def next_fn(state, weights, client_data):
        opt_state = state.optimizer_state
        outputs = operators.federated_map(
            client_update, (weights, operators.federated_broadcast(opt_state), client_data)
        )
        agg = grad_agg.next(
            state.full_gradient_aggregator, outputs.full_gradient, outputs.full_gradient_weight
        )
        new_state = operators.federated_zip(
            {
                "optimizer_state": operators.federated_map(update_state, (opt_state, agg.result)),
                "full_gradient_aggregator": agg.state,
            }
        )
        measurements = client_works.measurements(model, outputs)
        return core_processes.MeasuredProcessOutput(
            new_state, operators.federated_map(to_result, outputs), measurements
        )

    return templates.ClientWorkProcess(
        initialize, next_fn, optimizers.get_state_hparams,
        lambda state, hparams: optimizers.set_state_hparams(state, hparams, "base"))


@common.tff_keywords
def build_mime_lite(
    model_fn: ModelFn,
    base_optimizer: optax.GradientTransformation,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    full_gradient_aggregator: aggregators.WeightedAggregationFactory | None = None,
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Mime Lite: local steps with the server's (frozen) base optimizer state.

    Args:
      model_fn: a no-argument function returning a model.
      base_optimizer: an Optax transformation whose `update` does not need the params
        (sgd, momentum, adam, yogi, adagrad...); its state lives on the server.
      server_optimizer: applied to the averaged model delta (default `optax.sgd(1.0)`).
      client_weighting: 'num_examples' (default) or 'uniform'.
      full_gradient_aggregator: a weighted factory averaging the full gradients
        (default `MeanFactory()`, weighted by examples).
      model_distributor: replaces the broadcast of the weights.
      model_aggregator: an aggregation factory for the model deltas.
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess`; the base optimizer's state is in `state.client_work`.

    Raises:
      TypeError: when `base_optimizer` is not an Optax transformation, or
        `model_aggregator` is unweighted with `client_weighting` other than 'uniform'.
    """
    if not isinstance(base_optimizer, optax.GradientTransformation):
        raise TypeError(
            f"Expected base_optimizer to be an optax.GradientTransformation, found "
            f"{type(base_optimizer).__name__}."
        )
    model = common.make_model(model_fn)
    grad_agg = full_gradient_aggregator or aggregators.MeanFactory()
    if not isinstance(grad_agg, aggregators.WeightedAggregationFactory):
        raise TypeError(
            "Expected full_gradient_aggregator to be a WeightedAggregationFactory, found "
            f"{type(grad_agg).__name__}."
        )
    weighting = client_works.check_client_weighting(client_weighting)
    work = _mime_client_work(model, base_optimizer, weighting, grad_agg)
    common.check_weighted_aggregator(model_aggregator, weighting, "build_mime_lite")
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )
