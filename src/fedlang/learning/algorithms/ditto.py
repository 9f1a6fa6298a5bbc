"""Ditto (Li et al., "Ditto: Fair and Robust Federated Learning Through
Personalization", ICML 2021): a global model by FedAvg, and a personal model per
client kept near it.

Each client keeps its personal model `v_k` as client state (it never leaves the
client). In a round (the paper's Algorithm 1) each sampled client receives the
global model `w^t` and, in one pass over its batches, trains

* a copy of `w^t` with the client optimizer, exactly as FedAvg's clients do: the
  update `w^t - w_k` is averaged by the server (with the server optimizer);
* its personal model on the same batches with the personal optimizer, on the
  regularized objective `F_k(v) + lam/2 * ||v - w^t||^2`, i.e. each gradient gets
  `lam * (v - w^t)` added (the proximal term pulls toward the round's global model,
  not toward the client's moving copy of it).

`lam = 0` trains purely local models; a large `lam` keeps every personal model at
the global one. A client seen for the first time starts from the initial global
weights `w^0` (`v_k^0 = w^0`, as in the paper).
"""

from __future__ import annotations

from typing import cast

import jax
import jax.numpy as jnp

from fedlang import aggregators
from fedlang.core import computation, operators, tracing, types
from fedlang.learning import (
    client_works,
    evaluation,
    model_update_aggregator,
    optimizers,
    templates,
)
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import SERVER_SGD, ModelFn
from fedlang.learning.models import model as model_lib


def _ditto_client_work(
    model: model_lib.Model, optimizer_fn: optimizers.OptimizerFn,
    personal_fn: optimizers.OptimizerFn, lam: float, weighting: str, seed: int,
) -> templates.ClientWorkProcess:
    weights_t = model.weights_type()
    metrics = model.metrics

    def client_update(initial_weights, state, dataset, personal):
        opt, popt = optimizer_fn(state["round_num"]), personal_fn(state["round_num"])
        w0 = initial_weights.trainable

        def step(carry, batch, padding):
            weights, opt_state, mine, my_opt_state, stats, my_stats = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)
            new, new_opt_state, loss, preds = client_works.train_step(
                model, opt, weights, opt_state, x, y, mask)
            # the pull toward the round's global model, not toward the moving copy of it
            new_mine, new_my_opt_state, my_loss, my_preds = client_works.train_step(
                model, popt, mine, my_opt_state, x, y, mask, proximal_strength=lam, anchor=w0)
            keep = jnp.sum(mask) > 0  # an all-padding batch changes nothing
            moved = jax.tree.map(lambda a, b: jnp.where(keep, a, b),
                                 (new, new_opt_state, new_mine, new_my_opt_state),
                                 (weights, opt_state, mine, my_opt_state))
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            my_stats = metrics_lib.accumulate_stats(metrics, my_stats, my_loss, my_preds, y, mask)
            return (*moved, stats, my_stats)

        zero = metrics_lib.zero_stats(metrics)
        final, _, mine, _, stats, my_stats = dataset.reduce(
            (initial_weights, opt.init(w0), personal, popt.init(personal.trainable), zero, zero),
            step, masked=True)
        update = jax.tree.map(lambda a, b: a - b, w0, final.trainable)
        out = client_works.client_output(
            model, update, stats["num_examples"], weighting, stats,
            client_works.float_leaves(final.non_trainable))
        ok = client_works.tree_is_finite(mine)
        out["client_state"] = jax.tree.map(lambda a, b: jnp.where(ok, a, b), mine, personal)
        out["personal_stats"] = metrics_lib.scale_stats(my_stats, ok)
        return out

    def measure(outputs: templates.ClientValue) -> templates.ServerValue:
        base = client_works.measurements(model, outputs)
        output_t = cast(types.StructType, cast(types.FederatedType, outputs.type_signature).member)
        finalize = evaluation.build_finalize(model, output_t["personal_stats"])
        personal = operators.federated_map(finalize, operators.federated_sum(outputs.personal_stats))
        return operators.federated_zip(
            {"train": base.train, "personal": personal, "diagnostics": base.diagnostics})

    return client_works.build_stateful_client_work(
        model, weights_t, weights_t, client_update, common.initial_weights_fn(model, seed), measure)


def build_ditto(
    model_fn: ModelFn,
    client_optimizer: optimizers.Optimizer,
    lam: float,
    personal_optimizer: optimizers.Optimizer | None = None,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Ditto: FedAvg for the global model, and a personal model per client (see the
    module docstring).

    The personal models are client state: drive the process with `next(state,
    client_data, client_states)` (a `fedlang.simulation.ClientStateStore`'s
    `cohort(client_ids)`, or a list of `ModelWeights`), or with `run_training(...,
    client_state_store=...)`. Evaluate them with `build_ditto_eval`.

    Args:
      model_fn: a no-argument function returning a model.
      client_optimizer: trains the clients' copies of the global model (an Optax
        transformation, or `round_num -> transformation`), as in FedAvg.
      lam: `lambda >= 0`, the strength of the pull of personal models toward the
        global one (`lam/2 * ||v - w||^2`).
      personal_optimizer: trains the personal models (default: `client_optimizer`).
        Fresh optimizer state each round, as for the client optimizer.
      server_optimizer: applied to the averaged update of the global model.
      client_weighting: 'num_examples' (default) or 'uniform'.
      model_distributor, model_aggregator, seed: as for `build_weighted_fed_avg`.

    Returns:
      A `LearningProcess` with client state (`process.client_state`: the personal
      `ModelWeights`). Metrics: `metrics['client_work']['train']` (the global model's
      local training), `['personal']` (the personal models' training loss and
      metrics, summed over the cohort's examples), `['diagnostics']`.

    Raises:
      ValueError: for a negative `lam`.
    """
    if lam < 0:
        raise ValueError(f"Expected lam >= 0, found {lam}.")
    model = common.make_model(model_fn)
    optimizer_fn = optimizers.as_optimizer_fn(client_optimizer, "client_optimizer")
    personal_fn = optimizers.as_optimizer_fn(
        client_optimizer if personal_optimizer is None else personal_optimizer,
        "personal_optimizer")
    weighting = client_works.check_client_weighting(client_weighting)
    work = _ditto_client_work(model, optimizer_fn, personal_fn, float(lam), weighting, seed)
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )


def build_ditto_eval(model_fn: ModelFn) -> computation.Computation:
    """Personalized evaluation of Ditto: the global and each client's personal model
    on the clients' data.

    Returns:
      A federated computation `(model_weights@SERVER, {ModelWeights}@CLIENTS,
      {sequence}@CLIENTS) -> {'global': metrics, 'personal': metrics}@SERVER`: pass
      `process.get_model_weights(state)`, the clients' personal models (a store's
      `cohort(client_ids)`: read, never written) and their (held-out) data. Metrics
      are summed over the clients' examples, as federated evaluation's.
    """
    model = common.make_model(model_fn)
    weights_t = model.weights_type()
    local = evaluation.build_local_evaluation(model)
    finalize = evaluation.build_finalize(model, local.type_signature.result)

    @tracing.federated_computation(
        types.type_at_server(weights_t), types.type_at_clients(weights_t),
        types.type_at_clients(types.SequenceType(model.input_spec)))
    def evaluate(model_weights, personal_models, client_data):
        global_stats = operators.federated_map(
            local, (operators.federated_broadcast(model_weights), client_data))
        personal_stats = operators.federated_map(local, (personal_models, client_data))
        return {
            "global": operators.federated_map(finalize, operators.federated_sum(global_stats)),
            "personal": operators.federated_map(finalize, operators.federated_sum(personal_stats)),
        }

    return evaluate
