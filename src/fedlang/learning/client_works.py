"""Client work: local training on each client's data, and its metrics.

`build_model_delta_client_work` trains with a client optimizer (FedAvg, FedProx) and
returns the model delta; `build_gradient_client_work` returns the mean gradient at the
broadcast weights (FedSGD). Both are `ClientWorkProcess`es whose client side is one
`jax_computation` consuming the dataset with `dataset.reduce`, so runtimes run the
local loop as a scan or a loop of jitted steps, never Python per batch. Other
algorithms build theirs from the same parts: `train_step` (one optimizer step on a
batch), `client_output`, `measurements`, and `build_stateful_client_work` for clients
that keep state across rounds (Ditto, FedPer).

Every client also reports summed sufficient statistics (loss sum, examples, batches,
each metric's statistics), finalized once on the server, and a finite flag: a client
whose update has a NaN or Inf gets weight 0, a zero update and zero statistics, and
is counted in `diagnostics/num_nonfinite`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, processes, tracing, types
from fedlang.learning import evaluation, optimizers
from fedlang.learning import metrics as metrics_lib
from fedlang.learning import templates as learning_templates
from fedlang.learning.models import model as model_lib

CLIENT_WEIGHTINGS = ("num_examples", "uniform")


def check_client_weighting(client_weighting: str) -> str:
    """Raises ValueError unless `client_weighting` is 'num_examples' or 'uniform'."""
    if client_weighting not in CLIENT_WEIGHTINGS:
        raise ValueError(
            f"Expected client_weighting in {CLIENT_WEIGHTINGS}, found {client_weighting!r}."
        )
    return client_weighting


def tree_is_finite(tree: Any) -> jax.Array:
    """A boolean scalar: every entry of every leaf is finite."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def zero_where(keep: jax.Array, tree: Any) -> Any:
    """`tree` where `keep`, zeros elsewhere (NaN-safe: uses `where`, not multiplication)."""
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def client_output(
    model: model_lib.Model, update: optimizers.Updates, num_examples: jax.Array, weighting: str,
    stats: metrics_lib.Stats, non_trainable: model_lib.Params,
) -> learning_templates.ClientOutput:
    """The client side's result: the (guarded) update, its weight, stats and diagnostics."""
    finite = tree_is_finite(update)
    weight = (
        num_examples.astype(jnp.float32) if weighting == "num_examples" else jnp.float32(1)
    )
    return {
        "update": zero_where(finite, update),
        "update_weight": jnp.where(finite, weight, jnp.float32(0)),
        "non_trainable": non_trainable,
        "stats": metrics_lib.scale_stats(stats, finite),
        "diagnostics": {
            "num_clients": jnp.int32(1),
            "num_nonfinite": jnp.where(finite, 0, 1).astype(jnp.int32),
            "update_norm_sum": jnp.where(finite, tools.global_norm(update), jnp.float32(0)),
        },
        "update_norm": jnp.where(finite, tools.global_norm(update), jnp.float32(0)),
    }


def float_leaves(tree: model_lib.Params) -> list[jax.Array]:
    """The floating leaves of a pytree, as a list (non-trainable weights that average)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def measurements(
    model: model_lib.Model, outputs: learning_templates.ClientValue, name: str = "train"
) -> learning_templates.ServerValue:
    """Server-side measurements from the clients' outputs: `{name: metrics, 'diagnostics'}`."""
    output_t = cast(types.StructType, cast(types.FederatedType, outputs.type_signature).member)
    finalize = evaluation.build_finalize(model, output_t["stats"])
    diag_t = output_t["diagnostics"]

    @jax_backend.jax_computation(diag_t, np.float32)
    def finalize_diagnostics(diag, max_norm):
        ok = diag["num_clients"] - diag["num_nonfinite"]
        return {
            "num_clients": diag["num_clients"],
            "num_nonfinite": diag["num_nonfinite"],
            "update_norm_mean": diag["update_norm_sum"] / jnp.maximum(ok, 1).astype(jnp.float32),
            # federated_max of no clients is the dtype's lowest value: say 0 instead
            "update_norm_max": jnp.where(diag["num_clients"] > 0, max_norm, jnp.float32(0)),
        }

    train = operators.federated_map(finalize, operators.federated_sum(outputs.stats))
    diag = operators.federated_map(
        finalize_diagnostics,
        (operators.federated_sum(outputs.diagnostics), operators.federated_max(outputs.update_norm)),
    )
    return operators.federated_zip({name: train, "diagnostics": diag})


def _client_state(
    optimizer_fn: optimizers.OptimizerFn, weights_t: types.Type
) -> learning_templates.ServerState:
    zeros = model_lib.ModelWeights(*tools.zeros(weights_t))
    hp = optimizers.injected_hparams(optimizer_fn(jnp.int32(0)).init(zeros.trainable))
    return {"round_num": np.int32(0), "optimizer_hparams": {k: np.asarray(v) for k, v in hp.items()}}


def build_client_work_process(
    model: model_lib.Model,
    client_fn: Callable[
        [model_lib.ModelWeights, learning_templates.ServerState, Any],
        learning_templates.ClientOutput,
    ],
    optimizer_fn: optimizers.OptimizerFn,
) -> learning_templates.ClientWorkProcess:
    """A `ClientWorkProcess` around `client_fn(weights, client_state, dataset) -> output`.

    The server state is `{'round_num', 'optimizer_hparams'}`: it is broadcast, the
    round number increments every round, and the client optimizer's injected
    hyperparameters are exposed as hparams.
    """
    weights_t = model.weights_type()
    data_t = types.SequenceType(model.input_spec)
    initial_state = _client_state(optimizer_fn, weights_t)
    state_t = types.to_type(initial_state)

    client_update = jax_backend.jax_computation(weights_t, state_t, data_t)(client_fn)

    @jax_backend.jax_computation()
    def initial_state_fn():
        return initial_state

    @jax_backend.jax_computation(state_t)
    def next_round(state):
        return {"round_num": state["round_num"] + 1, "optimizer_hparams": state["optimizer_hparams"]}

    to_result = build_to_result(client_update.type_signature.result)

    @tracing.federated_computation()
    def initialize():
        return operators.federated_eval(initial_state_fn, types.SERVER)

    @tracing.federated_computation(
        types.type_at_server(state_t), types.type_at_clients(weights_t), types.type_at_clients(data_t)
    )
    def next_fn(state, weights, client_data):
        outputs = operators.federated_map(
            client_update, (weights, operators.federated_broadcast(state), client_data)
        )
        result = operators.federated_map(to_result, outputs)
        return processes.MeasuredProcessOutput(
            operators.federated_map(next_round, state), result, measurements(model, outputs)
        )

    def get_hparams(state: learning_templates.ServerState) -> optimizers.Hparams:
        return dict(state["optimizer_hparams"])

    def set_hparams(
        state: learning_templates.ServerState, hparams: optimizers.Hparams
    ) -> learning_templates.ServerState:
        current = dict(state["optimizer_hparams"])
        return {**state, "optimizer_hparams": optimizers.check_hparams(current, hparams, "client")}

    return learning_templates.ClientWorkProcess(
        initialize, next_fn, get_hparams, set_hparams,
        client_fn=client_fn, measure=lambda outputs: measurements(model, outputs),
    )


def build_to_result(output_type: types.Type) -> computation.Computation:
    """`output -> ClientResult`: the fields of a client's output that the composer reads.

    A `StatefulClientResult` when the output (a `client_output` dict, with what the
    client work adds) has a `client_state`, the client's new state.
    """
    stateful = "client_state" in cast(types.StructType, output_type).names

    @jax_backend.jax_computation(output_type)
    def to_result(out):
        if stateful:
            return learning_templates.StatefulClientResult(
                out["update"], out["update_weight"], out["non_trainable"], out["client_state"])
        return learning_templates.ClientResult(
            out["update"], out["update_weight"], out["non_trainable"])

    return to_result


def build_stateful_client_work(
    model: model_lib.Model,
    weights_type: types.Type,
    client_state_type: types.Type,
    client_fn: Callable[
        [Any, learning_templates.ServerState, Any, learning_templates.ClientState],
        learning_templates.ClientOutput],
    initial_client_state: computation.Computation,
    measure: (
        Callable[[learning_templates.ClientValue], learning_templates.ServerValue] | None) = None,
) -> learning_templates.ClientWorkProcess:
    """Client work whose clients keep state across rounds, around
    `client_fn(weights, server_state, dataset, client_state) -> output`.

    The server state is `{'round_num'}`: broadcast to the clients and incremented every
    round. The output is a `client_output` dict with the client's new state under
    'client_state' (Ditto's personal model, FedPer's local layers).

    Args:
      model: the model whose data the clients hold.
      weights_type: the type of the weights the clients receive.
      client_state_type: the type of one client's state.
      client_fn: the JAX function each client runs.
      initial_client_state: `( -> client_state)`, the state of a client seen for the
        first time.
      measure: `outputs@CLIENTS -> metrics@SERVER`; default `measurements(model, outputs)`.

    Returns:
      A `ClientWorkProcess` with an `initial_client_state`.
    """
    data_t = types.SequenceType(model.input_spec)
    state_t = types.to_type({"round_num": np.int32(0)})
    client_update = jax_backend.jax_computation(
        weights_type, state_t, data_t, client_state_type)(client_fn)
    to_result = build_to_result(client_update.type_signature.result)

    @jax_backend.jax_computation(state_t)
    def next_round(state):
        return {"round_num": state["round_num"] + 1}

    @jax_backend.jax_computation()
    def initial_state():
        return {"round_num": np.int32(0)}

    @tracing.federated_computation()
    def initialize():
        return operators.federated_eval(initial_state, types.SERVER)

    @tracing.federated_computation(
        types.type_at_server(state_t), types.type_at_clients(weights_type),
        types.type_at_clients(data_t), types.type_at_clients(client_state_type))
    def next_fn(state, weights, client_data, client_states):
        outputs = operators.federated_map(
            client_update,
            (weights, operators.federated_broadcast(state), client_data, client_states))
        return processes.MeasuredProcessOutput(
            operators.federated_map(next_round, state), operators.federated_map(to_result, outputs),
            measure(outputs) if measure else measurements(model, outputs))

    return learning_templates.ClientWorkProcess(
        initialize, next_fn, initial_client_state=initial_client_state)


def train_loss(
    model: model_lib.Model, non_trainable: model_lib.Params, x: Any, y: Any, mask: model_lib.Mask
) -> Callable[[model_lib.Params], tuple[jax.Array, tuple[model_lib.Predictions, model_lib.Params]]]:
    """`trainable -> (loss, (predictions, new_non_trainable))` of one batch in training
    mode: what a training step differentiates (`jax.value_and_grad(..., has_aux=True)`)."""
    def loss_fn(trainable: model_lib.Params) -> tuple[
            jax.Array, tuple[model_lib.Predictions, model_lib.Params]]:
        preds, nt = model.apply(model_lib.ModelWeights(trainable, non_trainable), x, training=True)
        return model.loss(preds, y, mask), (preds, nt)

    return loss_fn


def train_step(
    model: model_lib.Model, optimizer: optax.GradientTransformation,
    weights: model_lib.ModelWeights, opt_state: optimizers.OptState, x: Any, y: Any, mask: model_lib.Mask, *,
    proximal_strength: float = 0.0, anchor: model_lib.Params | None = None,
) -> tuple[model_lib.ModelWeights, optimizers.OptState, jax.Array, model_lib.Predictions]:
    """One optimizer step on one batch: `(new_weights, new_opt_state, loss, predictions)`.

    The loss and predictions are those before the step. With an `anchor` (trainable
    weights), each gradient gets `proximal_strength * (w - anchor)` added: the gradient
    of `proximal_strength / 2 * ||w - anchor||^2` (FedProx's clients, Ditto's personal
    models). A batch of only padding is the caller's to skip.
    """
    loss_fn = train_loss(model, weights.non_trainable, x, y, mask)
    (loss, (preds, nt)), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights.trainable)
    if anchor is not None:
        grads = jax.tree.map(
            lambda g, w, w0: g + proximal_strength * (w - w0), grads, weights.trainable, anchor)
    updates, new_opt_state = optimizer.update(grads, opt_state, weights.trainable)
    new = model_lib.ModelWeights(optax.apply_updates(weights.trainable, updates), nt)
    return new, new_opt_state, loss, preds


def build_model_delta_client_work(
    model: model_lib.Model,
    client_optimizer: Any,
    client_weighting: str = "num_examples",
    proximal_strength: float = 0.0,
) -> learning_templates.ClientWorkProcess:
    """Local training with `client_optimizer`; the update is `initial - final` weights.

    Args:
      model: a `fedlang.learning.models.Model`.
      client_optimizer: an Optax transformation, or `round_num -> transformation`. A
        fresh optimizer state is made on each client every round.
      client_weighting: 'num_examples' or 'uniform' (the update weight).
      proximal_strength: FedProx's mu: adds `mu/2 * ||w - w_initial||^2` to each
        step's loss (its gradient, `mu * (w - w_initial)`, to each gradient).

    Returns:
      A `ClientWorkProcess`.

    Raises:
      TypeError: for an optimizer that is not one; ValueError: for a bad weighting or
        a negative proximal strength.
    """
    optimizer_fn = optimizers.as_optimizer_fn(client_optimizer, "client_optimizer")
    weighting = check_client_weighting(client_weighting)
    if proximal_strength < 0:
        raise ValueError(f"Expected proximal_strength >= 0, found {proximal_strength}.")
    mu = float(proximal_strength)
    metrics = model.metrics

    def client_update(initial_weights, client_state, dataset):
        opt = optimizer_fn(client_state["round_num"])
        opt_state = optimizers.with_hparams(
            opt.init(initial_weights.trainable), client_state["optimizer_hparams"]
        )
        initial_trainable = initial_weights.trainable

        def step(carry, batch, padding):
            weights, opt_state, stats = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)
            new, new_opt_state, loss, preds = train_step(
                model, opt, weights, opt_state, x, y, mask, proximal_strength=mu,
                anchor=initial_trainable if mu else None)
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            keep = jnp.sum(mask) > 0  # an all-padding batch changes nothing
            new, new_opt_state = jax.tree.map(
                lambda a, b: jnp.where(keep, a, b), (new, new_opt_state), (weights, opt_state)
            )
            return new, new_opt_state, stats

        final, _, stats = dataset.reduce(
            (initial_weights, opt_state, metrics_lib.zero_stats(metrics)), step, masked=True
        )
        update = jax.tree.map(lambda a, b: a - b, initial_trainable, final.trainable)
        return client_output(
            model, update, stats["num_examples"], weighting, stats,
            float_leaves(final.non_trainable),
        )

    return build_client_work_process(model, client_update, optimizer_fn)


def build_gradient_client_work(
    model: model_lib.Model, client_weighting: str = "num_examples"
) -> learning_templates.ClientWorkProcess:
    """FedSGD's client work: the mean gradient over the client's examples at the
    broadcast weights (the weights do not move on the client).

    With 'num_examples' weighting, the weighted mean over clients is the gradient of
    the mean loss over the union of their examples: one large-batch SGD step.
    """
    weighting = check_client_weighting(client_weighting)
    metrics = model.metrics

    def client_update(initial_weights, client_state, dataset):
        del client_state
        zero_grads = jax.tree.map(jnp.zeros_like, initial_weights.trainable)

        def step(carry, batch, padding):
            grad_sum, nt, stats = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)
            loss_fn = train_loss(model, nt, x, y, mask)
            (loss, (preds, new_nt)), grads = jax.value_and_grad(loss_fn, has_aux=True)(
                initial_weights.trainable
            )
            n = jnp.sum(mask)
            grad_sum = jax.tree.map(lambda s, g: s + g * n.astype(g.dtype), grad_sum, grads)
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            new_nt = jax.tree.map(lambda a, b: jnp.where(n > 0, a, b), new_nt, nt)
            return grad_sum, new_nt, stats

        grad_sum, nt, stats = dataset.reduce(
            (zero_grads, initial_weights.non_trainable, metrics_lib.zero_stats(metrics)), step,
            masked=True,
        )
        n = jnp.maximum(stats["num_examples"], 1).astype(jnp.float32)
        mean_grad = jax.tree.map(lambda g: g / n.astype(g.dtype), grad_sum)
        return client_output(model, mean_grad, stats["num_examples"], weighting, stats,
                             float_leaves(nt))

    return build_client_work_process(model, client_update, optimizers.as_optimizer_fn(
        optax.identity(), "optimizer"))
