"""SCAFFOLD (Karimireddy et al., "SCAFFOLD: Stochastic Controlled Averaging for
Federated Learning", ICML 2020): local steps corrected by control variates.

The server keeps the model `x` and a control variate `c`; each client keeps its own
control variate `c_i` between rounds, as client state (so it never leaves the
client). In a round (the paper's Algorithm 1), each sampled client starts from
`y_i = x` and takes `K` SGD steps on its batches,

    y_i <- y_i - lr_l * (g_i(y_i) - c_i + c),

then updates its control variate with option II,

    c_i+ = c_i - c + (x - y_i) / (K * lr_l),

keeps `c_i+` and reports `x - y_i` and `c_i+ - c_i`. The server averages both over
the sampled clients `S` and steps

    x <- x - lr_g * mean(x - y_i)        (that is, x + lr_g * mean(y_i - x))
    c <- c + (|S| / N) * mean(c_i+ - c_i) = c + sum(c_i+ - c_i) / N,

where `N` is the number of clients of the whole population. `K` is each client's
number of local steps (its non-empty batches), so clients with more data take more
steps, as in the paper's per-client `K` when data sizes differ.
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
from fedlang.learning import client_works, model_update_aggregator, templates
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import ModelFn
from fedlang.learning.models import model as model_lib


def _scaffold_client_work(
    model: model_lib.Model, learning_rate: float, total_clients: int, weighting: str
) -> templates.ClientWorkProcess:
    weights_t = model.weights_type()
    trainable_t = cast(types.StructType, weights_t)["trainable"]  # ModelWeights: a struct
    data_t = types.SequenceType(model.input_spec)
    zeros = tools.zeros(trainable_t)
    server_state_t = types.to_type({"control_variate": zeros})
    metrics = model.metrics
    lr = float(learning_rate)

    @jax_backend.jax_computation(weights_t, trainable_t, data_t, trainable_t)
    def client_update(initial_weights, c, dataset, c_i):
        x = initial_weights.trainable
        correction = jax.tree.map(lambda server, own: server - own, c, c_i)

        def step(carry, batch, padding):
            weights, stats, k = carry
            xs, ys, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)

            loss_fn = client_works.train_loss(model, weights.non_trainable, xs, ys, mask)
            (loss, (preds, nt)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                weights.trainable)
            trained = jax.tree.map(lambda w, g, d: w - lr * (g + d),
                                   weights.trainable, grads, correction)
            keep = jnp.sum(mask) > 0  # an all-padding batch is no step
            new = jax.tree.map(lambda a, b: jnp.where(keep, a, b),
                               model_lib.ModelWeights(trained, nt), weights)
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, ys, mask)
            return new, stats, k + keep.astype(jnp.int32)

        final, stats, k = dataset.reduce(
            (initial_weights, metrics_lib.zero_stats(metrics), jnp.int32(0)), step, masked=True)
        update = jax.tree.map(lambda a, b: a - b, x, final.trainable)
        steps = jnp.maximum(k, 1).astype(jnp.float32)
        # Option II; a client without a step keeps its control variate.
        c_new = jax.tree.map(
            lambda own, server, u: jnp.where(k > 0, own - server + u / (steps * lr), own),
            c_i, c, update)
        out = client_works.client_output(
            model, update, stats["num_examples"], weighting, stats,
            client_works.float_leaves(final.non_trainable))
        ok = client_works.tree_is_finite(update) & client_works.tree_is_finite(c_new)
        out["delta_c"] = client_works.zero_where(ok, jax.tree.map(lambda a, b: a - b, c_new, c_i))
        out["client_state"] = jax.tree.map(lambda a, b: jnp.where(ok, a, b), c_new, c_i)
        return out

    to_result = client_works.build_to_result(client_update.type_signature.result)

    @jax_backend.jax_computation(server_state_t, trainable_t)
    def update_control_variate(state, delta_sum):
        # c + |S|/N * mean(delta c_i) = c + sum(delta c_i) / N
        return {"control_variate": jax.tree.map(
            lambda c, d: c + d / jnp.float32(total_clients), state["control_variate"], delta_sum)}

    @jax_backend.jax_computation()
    def initial_server_state():
        return {"control_variate": zeros}

    @jax_backend.jax_computation()
    def initial_client_state():
        return zeros

    @tracing.federated_computation()
    def initialize():
        return operators.federated_eval(initial_server_state, types.SERVER)

    @tracing.federated_computation(
        types.type_at_server(server_state_t), types.type_at_clients(weights_t),
        types.type_at_clients(data_t), types.type_at_clients(trainable_t))
    def next_fn(state, weights, client_data, client_states):
        c = operators.federated_broadcast(state.control_variate)
        outputs = operators.federated_map(client_update, (weights, c, client_data, client_states))
        delta_sum = operators.federated_sum(outputs.delta_c)
        new_state = operators.federated_map(update_control_variate, (state, delta_sum))
        return core_processes.MeasuredProcessOutput(
            new_state, operators.federated_map(to_result, outputs),
            client_works.measurements(model, outputs))

    return templates.ClientWorkProcess(initialize, next_fn,
                                       initial_client_state=initial_client_state)


def build_scaffold(
    model_fn: ModelFn,
    client_learning_rate: float,
    server_learning_rate: float = 1.0,
    *,
    total_clients: int,
    client_weighting: str = "uniform",
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """SCAFFOLD with option II control variates (see the module docstring).

    Each client's control variate `c_i` is client state: drive the process with
    `next(state, client_data, client_states)`, the states from a
    `fedlang.simulation.ClientStateStore` (`store.cohort(client_ids)`; first-seen
    clients start from `c_i = 0`) or a list, and `run_training(...,
    client_state_store=...)` does it for you. The server's `c` is in
    `state.client_work['control_variate']`.

    Args:
      model_fn: a no-argument function returning a model.
      client_learning_rate: `lr_l`, the clients' SGD step size.
      server_learning_rate: `lr_g`: the server moves by `lr_g` times the clients'
        average model change (1: to their average).
      total_clients: `N`, the number of clients in the population (the server's
        control variate moves by `sum(c_i+ - c_i) / N` per round).
      client_weighting: how `model_aggregator` weighs the updates when it is a
        weighted factory: 'uniform' (the paper's average) or 'num_examples'.
      model_distributor: replaces the broadcast of the weights.
      model_aggregator: an aggregation factory for the model updates (default
        `UnweightedMeanFactory()`: the paper's plain average over sampled clients).
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess` with client state (`process.client_state`); training
      metrics are under `metrics['client_work']['train']`.

    Raises:
      ValueError: for a non-positive learning rate or population size.
    """
    if client_learning_rate <= 0:
        raise ValueError(f"Expected client_learning_rate > 0, found {client_learning_rate}.")
    if not isinstance(total_clients, int | np.integer) or total_clients < 1:
        raise ValueError(
            f"Expected total_clients, the population size N, to be a positive int, found "
            f"{total_clients!r}.")
    model = common.make_model(model_fn)
    weighting = client_works.check_client_weighting(client_weighting)
    work = _scaffold_client_work(model, client_learning_rate, int(total_clients), weighting)
    return common.build_process(
        model, work, optax.sgd(server_learning_rate), model_distributor, model_aggregator,
        aggregators.UnweightedMeanFactory(), seed,
    )
