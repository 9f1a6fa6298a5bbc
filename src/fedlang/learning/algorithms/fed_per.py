"""FedPer-style partial models (Arivazhagan et al., "Federated Learning with
Personalization Layers", 2019): shared layers averaged by FedAvg, local layers kept
on each client.

The model's trainable weights are split by `local_layers` into *shared* ones (the
base layers) and *local* ones (the personalization layers, e.g. the head). The
server holds the shared weights and broadcasts only them (with the non-trainable
weights); each client keeps its local weights as client state, so they are never
sent, aggregated or seen by the server. In a round each sampled client joins the
broadcast shared weights with its own local ones, trains the whole model with the
client optimizer on its data, keeps the trained local weights, and reports the
change of the shared ones, which the server averages and applies with the server
optimizer. A client seen for the first time starts from the initial model's local
weights. (The server's copy of the local layers stays at its initial value: it is
only the starting point of new clients, never trained.)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, cast

import jax
import jax.numpy as jnp

from fedlang import aggregators
from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import (
    client_works,
    evaluation,
    finalizers,
    model_update_aggregator,
    optimizers,
    templates,
)
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import SERVER_SGD, ModelFn
from fedlang.learning.models import model as model_lib

LocalLayers = Iterable[str] | str | Callable[[str], bool]


def _key_name(key: Any) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


class Partition:
    """The trainable weights split into shared and local leaves (as lists).

    Args:
      trainable_type: the type of the model's trainable weights.
      local_layers: which leaves are local: names of layers (a leaf is local when its
        '/'-joined path, e.g. 'head/kernel', is a name or starts with one and '/'),
        or a predicate on paths.

    Raises:
      ValueError: when a name matches no leaf, or no leaf (or every leaf) is local.
    """

    def __init__(self, trainable_type: types.Type, local_layers: LocalLayers):
        zeros = tools.zeros(trainable_type)
        pairs, self.treedef = jax.tree_util.tree_flatten_with_path(zeros)
        self.paths = ["/".join(_key_name(k) for k in path) for path, _ in pairs]
        if callable(local_layers):
            self.is_local = [bool(local_layers(p)) for p in self.paths]
        else:
            names = [local_layers] if isinstance(local_layers, str) else list(local_layers)
            def match(p: str, n: str) -> bool:
                return p == n or p.startswith(n + "/")
            unknown = [n for n in names if not any(match(p, n) for p in self.paths)]
            if unknown:
                raise ValueError(
                    f"Expected local_layers to name layers of the model, found {unknown}; its "
                    f"trainable weights are {self.paths}.")
            self.is_local = [any(match(p, n) for n in names) for p in self.paths]
        if all(self.is_local) or not any(self.is_local):
            which = "every" if all(self.is_local) else "no"
            raise ValueError(
                f"Expected local_layers to select some but not all trainable weights, found "
                f"{which} weight local (weights: {self.paths}).")
        leaves = [leaf for _, leaf in pairs]
        self.shared_type = types.to_type(self.split_leaves(leaves)[0])
        self.local_type = types.to_type(self.split_leaves(leaves)[1])
        self.initial_zeros = leaves

    def split_leaves(self, leaves: list[Any]) -> tuple[list[Any], list[Any]]:
        shared = [x for x, loc in zip(leaves, self.is_local) if not loc]
        local = [x for x, loc in zip(leaves, self.is_local) if loc]
        return shared, local

    def split(self, trainable: model_lib.Params) -> tuple[list[Any], list[Any]]:
        """(shared leaves, local leaves) of a trainable-weights pytree."""
        return self.split_leaves(jax.tree.leaves(trainable))

    def join(self, shared: Iterable[Any], local: Iterable[Any]) -> model_lib.Params:
        """The trainable-weights pytree from its shared and local leaves."""
        shared_it, local_it = iter(list(shared)), iter(list(local))
        leaves = [next(local_it) if loc else next(shared_it) for loc in self.is_local]
        return jax.tree.unflatten(self.treedef, leaves)


def _distributor(partition: Partition, weights_t: types.Type) -> templates.DistributionProcess:
    """Broadcasts the shared weights and the non-trainable ones, never the local layers."""

    @jax_backend.jax_computation(weights_t)
    def shared_part(weights):
        return {"shared": partition.split(weights.trainable)[0],
                "non_trainable": weights.non_trainable}

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value((), types.SERVER)

    @tracing.federated_computation(types.type_at_server(()), types.type_at_server(weights_t))
    def next_fn(state, weights):
        sent = operators.federated_broadcast(operators.federated_map(shared_part, weights))
        return core_processes.MeasuredProcessOutput(
            state, sent, operators.federated_value({}, types.SERVER))

    return templates.DistributionProcess(initialize, next_fn)


def _client_work(model: model_lib.Model, partition: Partition, sent_t: types.Type,
                 optimizer_fn: optimizers.OptimizerFn, weighting: str,
                 seed: int) -> templates.ClientWorkProcess:
    metrics = model.metrics

    def client_update(sent, state, dataset, local):
        opt = optimizer_fn(state["round_num"])
        initial = model_lib.ModelWeights(partition.join(sent["shared"], local),
                                         sent["non_trainable"])

        def step(carry, batch, padding):
            weights, opt_state, stats = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)
            new, new_opt_state, loss, preds = client_works.train_step(
                model, opt, weights, opt_state, x, y, mask)
            keep = jnp.sum(mask) > 0  # an all-padding batch changes nothing
            new, new_opt_state = jax.tree.map(lambda a, b: jnp.where(keep, a, b),
                                              (new, new_opt_state), (weights, opt_state))
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            return new, new_opt_state, stats

        final, _, stats = dataset.reduce(
            (initial, opt.init(initial.trainable), metrics_lib.zero_stats(metrics)), step,
            masked=True)
        shared, trained_local = partition.split(final.trainable)
        update = [a - b for a, b in zip(sent["shared"], shared)]
        out = client_works.client_output(
            model, update, stats["num_examples"], weighting, stats,
            client_works.float_leaves(final.non_trainable))
        ok = client_works.tree_is_finite(trained_local)
        out["client_state"] = [jnp.where(ok, a, b) for a, b in zip(trained_local, local)]
        return out

    @jax_backend.jax_computation()
    def initial_local():
        return partition.split(model.initial_weights(jax.random.key(seed)).trainable)[1]

    return client_works.build_stateful_client_work(
        model, sent_t, partition.local_type, client_update, initial_local)


def _finalizer(partition: Partition, server_optimizer: optimizers.Optimizer,
               weights_t: types.Type) -> templates.FinalizerProcess:
    """Applies the server optimizer to the shared weights (the update's), leaving the
    server's copy of the local layers as it is."""

    def with_shared(
        weights: model_lib.ModelWeights, shared: model_lib.Params
    ) -> model_lib.ModelWeights:
        local = partition.split(weights.trainable)[1]
        return model_lib.ModelWeights(partition.join(shared, local), weights.non_trainable)

    return finalizers.build_optimizer_finalizer(
        optimizers.as_optimizer_fn(server_optimizer, "server_optimizer"), weights_t,
        partition.shared_type, lambda weights: partition.split(weights.trainable)[0], with_shared)


def build_fed_per(
    model_fn: ModelFn,
    client_optimizer: optimizers.Optimizer,
    local_layers: LocalLayers,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """FedPer-style partial-model training (see the module docstring).

    The local layers are client state: drive the process with `next(state,
    client_data, client_states)` (a `fedlang.simulation.ClientStateStore`'s
    `cohort(client_ids)`, or a list of local-weight lists), or with `run_training(...,
    client_state_store=...)`. Evaluate the personalized models with
    `build_fed_per_eval`.

    Args:
      model_fn: a no-argument function returning a model.
      client_optimizer: trains the whole model on each client (an Optax
        transformation, or `round_num -> transformation`).
      local_layers: the layers each client keeps: names (a trainable leaf whose
        '/'-joined path is a name, or starts with one and '/', is local, e.g.
        `['head']`), or a predicate `path -> bool`.
      server_optimizer: applied to the averaged change of the shared weights.
      client_weighting: 'num_examples' (default) or 'uniform'.
      model_aggregator: an aggregation factory for the shared weights' updates
        (default `MeanFactory()`).
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess` with client state (`process.client_state`: the list of
      local leaves, in the trainable weights' flattening order). The state's
      `global_model_weights` hold the shared weights (and the local layers' initial
      values).

    Raises:
      ValueError: when `local_layers` names no layer of the model, or selects none or
        all of its trainable weights.
    """
    model = common.make_model(model_fn)
    init_fn = common.initial_weights_fn(model, seed)
    weights_t = init_fn.type_signature.result
    partition = Partition(cast(types.StructType, weights_t)["trainable"], local_layers)
    distributor = _distributor(partition, weights_t)
    sent_t = cast(types.FederatedType, distributor.next.type_signature.result["result"]).member  # type: ignore[index]
    optimizer_fn = optimizers.as_optimizer_fn(client_optimizer, "client_optimizer")
    weighting = client_works.check_client_weighting(client_weighting)
    work = _client_work(model, partition, sent_t, optimizer_fn, weighting, seed)
    return common.build_process(
        model, work, server_optimizer, distributor, model_aggregator, aggregators.MeanFactory(),
        seed, update_type=partition.shared_type,
        model_finalizer=_finalizer(partition, server_optimizer, weights_t),
    )


def build_fed_per_eval(model_fn: ModelFn, local_layers: LocalLayers) -> computation.Computation:
    """Personalized evaluation of FedPer: each client's model (the server's shared
    weights with the client's own local layers) on the client's data.

    Returns:
      A federated computation `(model_weights@SERVER, {local}@CLIENTS,
      {sequence}@CLIENTS) -> metrics@SERVER`: pass `process.get_model_weights(state)`,
      the clients' local layers (a store's `cohort(client_ids)`: read, never written)
      and their (held-out) data. Metrics are summed over the clients' examples.
    """
    model = common.make_model(model_fn)
    weights_t = model.weights_type()
    partition = Partition(cast(types.StructType, weights_t)["trainable"], local_layers)
    local = evaluation.build_local_evaluation(model)
    stats_t = local.type_signature.result
    data_t = types.SequenceType(model.input_spec)

    @jax_backend.jax_computation(weights_t, partition.local_type)
    def personalize(weights, own):
        shared = partition.split(weights.trainable)[0]
        return model_lib.ModelWeights(partition.join(shared, own), weights.non_trainable)

    finalize = evaluation.build_finalize(model, stats_t)

    @tracing.federated_computation(types.type_at_server(weights_t),
                                   types.type_at_clients(partition.local_type),
                                   types.type_at_clients(data_t))
    def evaluate(model_weights, client_states, client_data):
        personal = operators.federated_map(
            personalize, (operators.federated_broadcast(model_weights), client_states))
        stats = operators.federated_map(local, (personal, client_data))
        return operators.federated_map(finalize, operators.federated_sum(stats))

    return evaluate
