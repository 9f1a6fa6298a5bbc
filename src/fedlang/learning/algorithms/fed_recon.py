"""Federated Reconstruction (TFF's `build_fed_recon`, `build_fed_recon_eval`).

Singhal, Sidahmed, Garrett, Wu, Rush and Prakash, "Federated Reconstruction: Partially
Local Federated Learning", NeurIPS 2021. TFF 0.87's `fed_recon.py` and
`fed_recon_eval.py` are the specification. Each round, on each client:

1. **reconstruction**: the local weights start from the model's initial values and
   are trained on the reconstruction batches with `reconstruction_optimizer_fn` (a
   fresh state), the global weights frozen; skipped when nothing local is trainable;
2. **post-reconstruction**: the global trainable weights are trained on the
   post-reconstruction batches with `client_optimizer_fn` (a fresh state), the local
   weights frozen; loss and metrics are those of these batches only, each computed
   before its step; the client's weight is the number of these examples
   (`client_weighting='num_examples'`) or 1 (`'uniform'`);
3. the client sends `initial - trained` global trainable weights; the local weights
   never leave it (nothing of them is in any value the client sends). An update with
   a NaN or Inf is zeroed with weight 0.

The server averages the updates (`model_aggregator_factory`, `MeanFactory()` by
default) and applies `server_optimizer_fn`; the global non-trainable weights do not
change. Evaluation (`build_fed_recon_eval`) reconstructs the same way, then evaluates
(`training=False`) on the post-reconstruction batches.

Which batches each stage uses is a `DatasetSplit` (`dataset_split_fn`; default, as in
TFF, `ReconstructionModel.build_dataset_split_fn(split_dataset=True)`: even batches
reconstruct, odd batches train or evaluate). A stage with several epochs passes over
the client's dataset several times: each pass is one `federated_map` over the
clients, the weights and optimizer state threaded from one to the next at the
clients. Departures from TFF are listed in docs/from-tff.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang import aggregators
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, processes, tracing, types
from fedlang.learning import (
    client_works,
    composers,
    distributors,
    finalizers,
    model_update_aggregator,
    optimizers,
    templates,
)
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import fed_eval
from fedlang.learning.models import model as model_lib
from fedlang.learning.models import reconstruction

ReconstructionModel = reconstruction.ReconstructionModel
ModelFn = Callable[[], ReconstructionModel]

# TFF's defaults: sgdm(1.0) on the server, sgdm(0.1) on clients and for reconstruction.
SERVER_SGD = optax.sgd(1.0)
CLIENT_SGD = optax.sgd(0.1)
RECONSTRUCTION_SGD = optax.sgd(0.1)
DEFAULT_SPLIT = reconstruction.DatasetSplit(split_dataset=True)


def _make_model(model_fn: Any) -> ReconstructionModel:
    if isinstance(model_fn, ReconstructionModel) or not callable(model_fn):
        raise TypeError(
            "Expected model_fn to be a no-argument function returning a ReconstructionModel, "
            f"found {type(model_fn).__name__}."
        )
    model = model_fn()
    if not isinstance(model, ReconstructionModel):
        raise TypeError(
            "Expected model_fn() to return a fedlang.learning.models.ReconstructionModel (a "
            "model and its local weights), found "
            f"{type(model).__name__}; wrap it: ReconstructionModel(model, local_trainable=[...])."
        )
    model_lib.check_32_bit(model.input_spec)  # a Model subclass sets input_spec itself
    return model


def _optimizer(optimizer: optimizers.Optimizer, name: str) -> optax.GradientTransformation:
    """An Optax transformation, or a no-argument function returning one (TFF's habit)."""
    return optimizers.as_optimizer_fn(optimizer, name)(jnp.int32(0))


class _Stages:
    """The client side of a reconstruction round: local computations chained at the clients.

    Each stage pass is one `jax_computation` consuming the client's dataset once; the
    first pass of a stage makes its starting state, the others continue it.
    """

    def __init__(self, recon_model: ReconstructionModel, split: reconstruction.DatasetSplit,
                 recon_optimizer: optax.GradientTransformation, seed: int):
        self.recon = recon_model
        self.model = recon_model.model
        self.split = split
        self.recon_optimizer = recon_optimizer
        self.global_t = recon_model.global_weights_type()
        self.data_t = types.SequenceType(self.model.input_spec)
        full = self.model.initial_weights(jax.random.key(seed))
        self.initial_global, self.initial_local = jax.tree.map(
            np.asarray, recon_model.split(full))

    def initial_weights_fn(self) -> computation.Computation:
        """`( -> ModelWeights)`: the model's initial global weights (what the server holds)."""
        initial_global = self.initial_global

        @jax_backend.jax_computation()
        def initial_weights():
            return jax.tree.map(jnp.asarray, initial_global)

        return initial_weights

    # --- batch selection -----------------------------------------------------------------

    def selected(self, parity: int, index: jax.Array, steps: jax.Array, steps_max: int | None,
                 real: jax.Array) -> jax.Array:
        """Whether batch `index` (real batches counted from 0) is one of the stage's."""
        ok = real
        if self.split.split_dataset:
            ok = ok & (index % 2 == parity)
        if steps_max is not None:
            ok = ok & (steps < steps_max)
        return ok

    def _full(self, global_w: model_lib.ModelWeights,
              local: model_lib.ModelWeights) -> model_lib.ModelWeights:
        return self.recon.merge(global_w, local)

    # --- reconstruction --------------------------------------------------------------------

    def reconstruct(
        self, weights: templates.ClientValue, client_data: templates.ClientValue
    ) -> templates.ClientValue:
        """Traced in a federated computation: the reconstructed local weights @CLIENTS."""
        model, opt, split = self.model, self.recon_optimizer, self.split
        local0 = self.initial_local
        if not self.recon.has_local_trainable():

            @jax_backend.jax_computation(self.global_t)
            def initial_local(global_w):
                del global_w
                return jax.tree.map(jnp.asarray, local0)

            return operators.federated_map(initial_local, weights)

        def run(global_w: model_lib.ModelWeights, carry: tuple[Any, ...], dataset: Any) -> tuple[
                model_lib.ModelWeights, optimizers.OptState, jax.Array]:
            def step(c, batch, padding):
                local, opt_state, steps, index = c
                x, y, mask = model_lib.batch_fields(batch)
                mask = model_lib.combine_masks(mask, padding)
                real = jnp.sum(padding) > 0
                use = self.selected(0, index, steps, split.recon_steps_max, real)

                def loss_fn(trainable: model_lib.Params) -> tuple[jax.Array, model_lib.Params]:
                    full = self._full(global_w, model_lib.ModelWeights(trainable, local.non_trainable))
                    preds, nt = model.apply(full, x, training=True)
                    return model.loss(preds, y, mask), nt

                (_, nt), grads = jax.value_and_grad(loss_fn, has_aux=True)(local.trainable)
                updates, new_opt = opt.update(grads, opt_state, local.trainable)
                new = model_lib.ModelWeights(optax.apply_updates(local.trainable, updates),
                                             self.recon.split_non_trainable(nt)[1])
                new, new_opt = jax.tree.map(
                    lambda a, b: jnp.where(use, a, b), (new, new_opt), (local, opt_state))
                return new, new_opt, steps + use.astype(jnp.int32), index + real.astype(jnp.int32)

            local, opt_state, steps, _ = dataset.reduce((*carry, jnp.int32(0)), step, masked=True)
            return local, opt_state, steps

        @jax_backend.jax_computation(self.global_t, self.data_t)
        def first_pass(global_w, dataset):
            local = jax.tree.map(jnp.asarray, local0)
            return run(global_w, (local, opt.init(local.trainable), jnp.int32(0)), dataset)

        carry = operators.federated_map(first_pass, (weights, client_data))
        if split.recon_epochs > 1:
            carry_t = first_pass.type_signature.result

            @jax_backend.jax_computation(self.global_t, carry_t, self.data_t)
            def next_pass(global_w, carry, dataset):
                return run(global_w, tuple(carry), dataset)

            for _ in range(split.recon_epochs - 1):
                carry = operators.federated_map(next_pass, (weights, carry, client_data))

        @jax_backend.jax_computation(first_pass.type_signature.result)
        def local_weights(carry):
            return carry[0]

        return operators.federated_map(local_weights, carry)

    # --- post-reconstruction: training or evaluation ---------------------------------------

    def post_reconstruction(self, weights: templates.ClientValue, local: templates.ClientValue,
                            client_data: templates.ClientValue, *, train: bool,
                            optimizer: optax.GradientTransformation | None = None,
                            finish: Callable[[model_lib.ModelWeights, tuple[Any, ...]],
                                             templates.ClientOutput] | None = None,
                            ) -> templates.ClientValue:
        """Traced: `finish(global_w, (trainable, opt_state, steps, stats))` @CLIENTS after
        the post-reconstruction passes (training the global trainable weights, or only
        accumulating evaluation statistics)."""
        model, split, metrics = self.model, self.split, self.model.metrics
        local_t = types.to_type(self.initial_local)
        opt = optimizer or optax.identity()

        def run(global_w: model_lib.ModelWeights, local: model_lib.ModelWeights,
                carry: tuple[Any, ...], dataset: Any) -> tuple[Any, ...]:
            def step(c, batch, padding):
                trainable, opt_state, steps, stats, index = c
                x, y, mask = model_lib.batch_fields(batch)
                mask = model_lib.combine_masks(mask, padding)
                real = jnp.sum(padding) > 0
                use = self.selected(1, index, steps, split.post_recon_steps_max, real)

                def loss_fn(t: model_lib.Params) -> tuple[jax.Array, model_lib.Predictions]:
                    full = self._full(model_lib.ModelWeights(t, global_w.non_trainable), local)
                    preds, _ = model.apply(full, x, training=train)
                    return model.loss(preds, y, mask), preds

                if train:
                    (loss, preds), grads = jax.value_and_grad(loss_fn, has_aux=True)(trainable)
                    updates, new_opt = opt.update(grads, opt_state, trainable)
                    new = optax.apply_updates(trainable, updates)
                else:
                    loss, preds = loss_fn(trainable)
                    new, new_opt = trainable, opt_state
                new_stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
                new, new_opt, new_stats = jax.tree.map(
                    lambda a, b: jnp.where(use, a, b), (new, new_opt, new_stats),
                    (trainable, opt_state, stats))
                return new, new_opt, steps + use.astype(jnp.int32), new_stats, index + real.astype(
                    jnp.int32)

            out = dataset.reduce((*carry, jnp.int32(0)), step, masked=True)
            return out[:4]

        @jax_backend.jax_computation(self.global_t, local_t, self.data_t)
        def first_pass(global_w, local, dataset):
            t = global_w.trainable
            start = (t, opt.init(t), jnp.int32(0), metrics_lib.zero_stats(metrics))
            return run(global_w, local, start, dataset)

        carry = operators.federated_map(first_pass, (weights, local, client_data))
        carry_t = first_pass.type_signature.result
        if split.post_recon_epochs > 1:

            @jax_backend.jax_computation(self.global_t, local_t, carry_t, self.data_t)
            def next_pass(global_w, local, carry, dataset):
                return run(global_w, local, tuple(carry), dataset)

            for _ in range(split.post_recon_epochs - 1):
                carry = operators.federated_map(next_pass, (weights, local, carry, client_data))

        @jax_backend.jax_computation(self.global_t, carry_t)
        def finished(global_w, carry):
            return finish(global_w, tuple(carry)) if finish else carry[3]

        return operators.federated_map(finished, (weights, carry))


def _client_work(stages: _Stages, optimizer: optax.GradientTransformation,
                 weighting: str) -> templates.ClientWorkProcess:
    model = stages.model

    def finish(global_w: model_lib.ModelWeights, carry: tuple[Any, ...]) -> templates.ClientOutput:
        trainable, _, _, stats = carry
        update = jax.tree.map(lambda a, b: a - b, global_w.trainable, trainable)
        return client_works.client_output(model, update, stats["num_examples"], weighting, stats, ())

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value((), types.SERVER)

    @tracing.federated_computation(
        initialize.type_signature.result, types.type_at_clients(stages.global_t),
        types.type_at_clients(stages.data_t),
    )
    def next_fn(state, weights, client_data):
        local = stages.reconstruct(weights, client_data)
        outputs = stages.post_reconstruction(
            weights, local, client_data, train=True, optimizer=optimizer, finish=finish)

        to_result = client_works.build_to_result(outputs.type_signature.member)
        result = operators.federated_map(to_result, outputs)
        return processes.MeasuredProcessOutput(
            state, result, client_works.measurements(model, outputs))

    return templates.ClientWorkProcess(initialize, next_fn)


def build_fed_recon(
    model_fn: ModelFn,
    *,
    server_optimizer_fn: optimizers.Optimizer = SERVER_SGD,
    client_optimizer_fn: optimizers.Optimizer = CLIENT_SGD,
    reconstruction_optimizer_fn: optimizers.Optimizer = RECONSTRUCTION_SGD,
    dataset_split_fn: reconstruction.DatasetSplit | None = None,
    client_weighting: str | None = None,
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator_factory: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Federated Reconstruction training (module docstring), TFF's arguments.

    Args:
      model_fn: a no-argument function returning a `ReconstructionModel` (its model's
        loss and metrics are used: TFF's `loss_fn` and `metrics_fn`).
      server_optimizer_fn: applied to the averaged update (default `optax.sgd(1.0)`).
      client_optimizer_fn: trains the global weights after reconstruction (default
        `optax.sgd(0.1)`).
      reconstruction_optimizer_fn: reconstructs the local weights (default
        `optax.sgd(0.1)`).
      dataset_split_fn: a `DatasetSplit` (default: even batches reconstruct, odd
        batches train).
      client_weighting: 'num_examples' (default: the post-reconstruction examples) or
        'uniform'.
      model_distributor: replaces the broadcast of the global weights.
      model_aggregator_factory: an aggregation factory for the updates (default
        `MeanFactory()`); an unweighted one requires `client_weighting='uniform'`.
      seed: the seed of the model's initial weights (global, and the local ones every
        client starts its reconstruction from).

    Returns:
      A `LearningProcess` over the global weights; training metrics under
      `metrics['client_work']['train']` (post-reconstruction batches only).

    Raises:
      TypeError: for a model_fn, optimizer, split or aggregator of the wrong kind;
      ValueError: for a bad weighting, or an unweighted aggregator with weighting other
        than 'uniform' (as TFF).
    """
    recon_model = _make_model(model_fn)
    weighting = client_works.check_client_weighting(client_weighting or "num_examples")
    factory = aggregators.MeanFactory() if model_aggregator_factory is None else (
        model_aggregator_factory)
    if isinstance(factory, aggregators.UnweightedAggregationFactory) and weighting != "uniform":
        raise ValueError(
            "Expected client_weighting='uniform' with an unweighted model_aggregator_factory "
            f"(it ignores the clients' weights), found {weighting!r}."
        )
    split = reconstruction.check_dataset_split(
        DEFAULT_SPLIT if dataset_split_fn is None else dataset_split_fn)
    stages = _Stages(recon_model, split,
                     _optimizer(reconstruction_optimizer_fn, "reconstruction_optimizer_fn"), seed)
    work = _client_work(stages, _optimizer(client_optimizer_fn, "client_optimizer_fn"), weighting)
    initial_weights = stages.initial_weights_fn()
    weights_t = initial_weights.type_signature.result
    aggregator = model_update_aggregator.create_aggregator(
        factory, weights_t["trainable"], "model_aggregator_factory")  # type: ignore[index]
    return composers.compose_learning_process(
        initial_weights,
        model_distributor or distributors.build_broadcast_process(weights_t),
        work,
        aggregator,
        finalizers.build_apply_optimizer_finalizer(server_optimizer_fn, weights_t),
    )


def build_fed_recon_eval(
    model_fn: ModelFn,
    *,
    reconstruction_optimizer_fn: optimizers.Optimizer = RECONSTRUCTION_SGD,
    dataset_split_fn: reconstruction.DatasetSplit | None = None,
    model_distributor: templates.DistributionProcess | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Evaluation of a reconstruction model (module docstring), TFF's arguments.

    `next(state, client_data)` reconstructs each client's local weights, then evaluates
    the global and reconstructed weights on the post-reconstruction batches. Set the
    global weights to evaluate with `set_model_weights(state, weights)` (e.g. a trained
    process's `get_model_weights(state)`).

    Args:
      model_fn: a no-argument function returning a `ReconstructionModel`.
      reconstruction_optimizer_fn: reconstructs the local weights (default
        `optax.sgd(0.1)`).
      dataset_split_fn: a `DatasetSplit` (default: even batches reconstruct, odd batches
        evaluate).
      model_distributor: replaces the broadcast of the global weights.
      seed: the seed of the initial weights (the local ones clients start from).

    Returns:
      A `LearningProcess` whose weights never change; metrics under
      `metrics['client_work']['eval']['current_round_metrics']` and
      `['total_rounds_metrics']` (`loss`, the model's metrics, `num_examples`,
      `num_batches`), as `build_fed_eval`'s.
    """
    recon_model = _make_model(model_fn)
    split = reconstruction.check_dataset_split(
        DEFAULT_SPLIT if dataset_split_fn is None else dataset_split_fn)
    stages = _Stages(recon_model, split,
                     _optimizer(reconstruction_optimizer_fn, "reconstruction_optimizer_fn"), seed)
    initial_weights = stages.initial_weights_fn()
    distributor = model_distributor or distributors.build_broadcast_process(
        initial_weights.type_signature.result)

    def client_stats(
        weights: templates.ClientValue, client_data: templates.ClientValue
    ) -> templates.ClientValue:
        local = stages.reconstruct(weights, client_data)
        return stages.post_reconstruction(weights, local, client_data, train=False)

    return fed_eval.build_eval_process(stages.model, initial_weights, distributor, client_stats)
