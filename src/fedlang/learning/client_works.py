"""Client work: local training on each client's data, and its metrics.

`build_model_delta_client_work` trains with a client optimizer (FedAvg, FedProx) and
returns the model delta; `build_gradient_client_work` returns the mean gradient at the
broadcast weights (FedSGD). Both are `ClientWorkProcess`es whose client side is one
`jax_computation` consuming the dataset with `dataset.reduce`, so runtimes run the
local loop as a scan or a loop of jitted steps, never Python per batch.

Every client also reports summed sufficient statistics (loss sum, examples, batches,
each metric's statistics), finalized once on the server, and a finite flag: a client
whose update has a NaN or Inf gets weight 0, a zero update and zero statistics, and
is counted in `diagnostics/num_nonfinite`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, types
from fedlang.learning import metrics as metrics_lib
from fedlang.learning import optimizers
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


def tree_is_finite(tree: Any) -> Any:
    """A boolean scalar: every entry of every leaf is finite."""
    flags = [jnp.all(jnp.isfinite(x)) for x in jax.tree.leaves(tree)]
    return jnp.all(jnp.stack(flags)) if flags else jnp.bool_(True)


def zero_where(keep: Any, tree: Any) -> Any:
    """`tree` where `keep`, zeros elsewhere (NaN-safe: uses `where`, not multiplication)."""
    return jax.tree.map(lambda x: jnp.where(keep, x, jnp.zeros_like(x)), tree)


def client_output(
    model: model_lib.Model, update: Any, num_examples: Any, weighting: str, stats: Any,
    non_trainable: Any,
) -> dict[str, Any]:
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


def float_leaves(tree: Any) -> list[Any]:
    """The floating leaves of a pytree, as a list (non-trainable weights that average)."""
    return [x for x in jax.tree.leaves(tree) if jnp.issubdtype(x.dtype, jnp.floating)]


def measurements(model: model_lib.Model, outputs: Any, name: str = "train") -> Any:
    """Server-side measurements from the clients' outputs: `{name: metrics, 'diagnostics'}`."""
    stats_t = outputs.type_signature.member["stats"]
    diag_t = outputs.type_signature.member["diagnostics"]

    @jax_backend.jax_computation(stats_t)
    def finalize(stats):
        return metrics_lib.finalize_stats(model.metrics, stats)

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


def _client_state(optimizer_fn: optimizers.OptimizerFn, weights_t: types.Type) -> dict[str, Any]:
    zeros = model_lib.ModelWeights(*tools.zeros(weights_t))
    hp = optimizers.injected_hparams(optimizer_fn(jnp.int32(0)).init(zeros.trainable))
    return {"round_num": np.int32(0), "optimizer_hparams": {k: np.asarray(v) for k, v in hp.items()}}


def build_client_work_process(
    model: model_lib.Model,
    client_fn: Callable[[Any, Any, Any], dict[str, Any]],
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

    @jax_backend.jax_computation(client_update.type_signature.result)
    def to_result(out):
        return learning_templates.ClientResult(
            out["update"], out["update_weight"], out["non_trainable"]
        )

    from fedlang.core import tracing

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

    def get_hparams(state: Any) -> dict[str, Any]:
        return dict(state["optimizer_hparams"])

    def set_hparams(state: Any, hparams: Any) -> Any:
        current = dict(state["optimizer_hparams"])
        return {**state, "optimizer_hparams": optimizers.check_hparams(current, hparams, "client")}

    return learning_templates.ClientWorkProcess(
        initialize, next_fn, get_hparams, set_hparams,
        client_fn=client_fn, measure=lambda outputs: measurements(model, outputs),
    )


def _train_loss(model: model_lib.Model, non_trainable: Any, x: Any, y: Any, mask: Any) -> Callable:
    def loss_fn(trainable: Any) -> Any:
        preds, nt = model.apply(model_lib.ModelWeights(trainable, non_trainable), x, training=True)
        return model.loss(preds, y, mask), (preds, nt)

    return loss_fn


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
            loss_fn = _train_loss(model, weights.non_trainable, x, y, mask)
            (loss, (preds, nt)), grads = jax.value_and_grad(loss_fn, has_aux=True)(weights.trainable)
            if mu:
                grads = jax.tree.map(
                    lambda g, w, w0: g + mu * (w - w0), grads, weights.trainable, initial_trainable
                )
            updates, new_opt_state = opt.update(grads, opt_state, weights.trainable)
            new = model_lib.ModelWeights(optax.apply_updates(weights.trainable, updates), nt)
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
            loss_fn = _train_loss(model, nt, x, y, mask)
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
