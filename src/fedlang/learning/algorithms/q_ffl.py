"""q-FFL by q-FedAvg (Li, Sanjabi, Beirami and Smith, "Fair Resource Allocation in
Federated Learning", ICLR 2020; Flower's `QFedAvg`).

q-FFL minimizes `sum_k p_k F_k(w)^(q+1) / (q+1)`: the larger `q`, the more weight on
the clients whose loss is high (q = 0 is FedAvg's objective). q-FedAvg (the paper's
Algorithm 3, as its code `fair_flearn/flearn/trainers/qffedavg.py` runs it) takes a
round as:

1. each client k computes `F_k(w^t)`, its mean loss at the server's weights, then runs
   local SGD with step `eta` from `w^t` to `w_k`;
2. with the Lipschitz estimate `L = 1 / eta`, it reports
   `Delta_k = F_k^q * L (w^t - w_k)` and
   `h_k = q F_k^(q-1) ||L (w^t - w_k)||^2 + L F_k^q` (`F_k` plus 1e-10, as the
   paper's code, so q < 1 never divides by zero);
3. the server steps `w^(t+1) = w^t - sum_k Delta_k / sum_k h_k`.

Step 3 is a weighted mean: each client sends `Delta_k / h_k` with weight `h_k`, and the
model aggregator (`MeanFactory()` by default, weighted by `h_k`) gives
`sum Delta / sum h`; the finalizer's `optax.sgd(1.0)` subtracts it. So DP, secure or
compressed means compose as for FedAvg, while a robust (unweighted) aggregator would
drop the `h_k` weights and is refused.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import optax

from fedlang import aggregators
from fedlang.learning import client_works, model_update_aggregator, optimizers, templates
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import SERVER_SGD, ModelFn
from fedlang.learning.models import model as model_lib

# The paper's code adds it to each client's loss before raising it to q or q - 1.
LOSS_EPSILON = 1e-10


def _q_ffl_client_work(
    model: model_lib.Model, q: float, learning_rate: float, lipschitz: float
) -> templates.ClientWorkProcess:
    optimizer_fn = optimizers.as_optimizer_fn(optax.sgd(learning_rate), "client_optimizer")
    metrics = model.metrics

    def client_update(initial_weights, client_state, dataset):
        opt = optimizer_fn(client_state["round_num"])
        w0 = initial_weights

        def step(carry, batch, padding):
            weights, opt_state, stats, start_loss_sum = carry
            x, y, mask = model_lib.batch_fields(batch)
            mask = model_lib.combine_masks(mask, padding)

            new, new_opt_state, loss, preds = client_works.train_step(
                model, opt, weights, opt_state, x, y, mask)
            # F_k(w^t): the loss of the round's starting weights on the same examples.
            start_preds, _ = model.apply(w0, x, training=False)
            n = jnp.sum(mask)
            start_loss_sum = start_loss_sum + model.loss(start_preds, y, mask) * n
            stats = metrics_lib.accumulate_stats(metrics, stats, loss, preds, y, mask)
            new, new_opt_state = jax.tree.map(
                lambda a, b: jnp.where(n > 0, a, b), (new, new_opt_state), (weights, opt_state))
            return new, new_opt_state, stats, start_loss_sum

        final, _, stats, start_loss_sum = dataset.reduce(
            (w0, opt.init(w0.trainable), metrics_lib.zero_stats(metrics), jnp.float32(0)), step,
            masked=True,
        )
        count = jnp.maximum(stats["num_examples"], 1).astype(jnp.float32)
        f = start_loss_sum / count + LOSS_EPSILON
        scaled = jax.tree.map(lambda a, b: lipschitz * (a - b), w0.trainable, final.trainable)
        f_q = jnp.power(f, q)
        squared_norm = sum(jnp.sum(jnp.square(x)) for x in jax.tree.leaves(scaled))
        h = q * jnp.power(f, q - 1.0) * squared_norm + lipschitz * f_q
        update = jax.tree.map(lambda d: d * (f_q / h).astype(d.dtype), scaled)  # Delta_k / h_k
        out = client_works.client_output(
            model, update, stats["num_examples"], "uniform", stats,
            client_works.float_leaves(final.non_trainable))
        ok = (out["update_weight"] > 0) & jnp.isfinite(h) & (h > 0)
        out["update_weight"] = jnp.where(ok, h, jnp.float32(0))
        return out

    return client_works.build_client_work_process(model, client_update, optimizer_fn)


def build_q_fed_avg(
    model_fn: ModelFn,
    q: float,
    client_learning_rate: float,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    lipschitz: float | None = None,
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """q-FedAvg (module docstring): fair federated learning, `q = 0` being FedAvg's
    objective (uniformly weighted).

    Args:
      model_fn: a no-argument function returning a model.
      q: the fairness parameter, >= 0 (the paper tunes it in {0.001, 0.01, 0.1, 1, 2,
        5, 10, 15}).
      client_learning_rate: `eta`, the step of the clients' local SGD.
      server_optimizer: applied to `sum Delta / sum h` (default `optax.sgd(1.0)`: the
        paper's step).
      lipschitz: `L`, the Lipschitz estimate of the losses' gradients; default
        `1 / client_learning_rate` (the paper's).
      model_distributor: replaces the broadcast of the weights.
      model_aggregator: a weighted aggregation factory (default `MeanFactory()`),
        weighted by `h_k`.
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess`; training metrics as FedAvg's, with the clients' update
      weights `h_k`.

    Raises:
      ValueError: for a negative `q` or a non-positive learning rate or `lipschitz`;
      TypeError: when `model_aggregator` is not a weighted aggregation factory.
    """
    q_value = float(q)
    if not q_value >= 0:
        raise ValueError(f"Expected q >= 0 (0 is FedAvg's objective), found {q!r}.")
    lr = float(client_learning_rate)
    if not lr > 0:
        raise ValueError(f"Expected client_learning_rate > 0, found {client_learning_rate!r}.")
    big_l = 1.0 / lr if lipschitz is None else float(lipschitz)
    if not big_l > 0:
        raise ValueError(f"Expected lipschitz > 0, found {lipschitz!r}.")
    if model_aggregator is not None and not isinstance(
        model_aggregator, aggregators.WeightedAggregationFactory
    ):
        raise TypeError(
            "Expected model_aggregator to be a WeightedAggregationFactory (q-FedAvg's step "
            "is the mean of Delta_k / h_k weighted by h_k, e.g. MeanFactory()), found "
            f"{type(model_aggregator).__name__}."
        )
    model = common.make_model(model_fn)
    work = _q_ffl_client_work(model, q_value, lr, big_l)
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )
