"""A custom algorithm from the learning building blocks (TFF's tutorial 4).

FedAvg whose client learning rate lives in the server state and decays every round.
Only the client work is new; the distributor, aggregator and finalizer are the
library's, and `compose_learning_process` puts the four parts together:

    weights --broadcast--> clients --local SGD at lr--> deltas --mean--> server SGD

The client work's state is `{'learning_rate': float32}`: it is broadcast with the
model, clients train with `optax.sgd(learning_rate)` inside one `jax_computation`
(the dataset consumed with `dataset.reduce`), and the server multiplies it by `decay`.

Run it with `python examples/custom_fedavg_lr_decay.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

import fedlang as fl
import fedlang.simulation as sim
from fedlang import aggregators
from fedlang.learning import (
    client_works,
    composers,
    distributors,
    finalizers,
    models,
    templates,
)
from fedlang.learning import metrics as metrics_lib

INPUT_SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def model_fn() -> models.Model:
    return models.FunctionalModel(
        init_fn=lambda rng: {"kernel": jnp.zeros([64, 10]), "bias": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["kernel"] + p["bias"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=INPUT_SPEC,
        metrics=[models.Accuracy()],
    )


def build_decaying_lr_client_work(
    model: models.Model, initial_lr: float, decay: float
) -> templates.ClientWorkProcess:
    """Local SGD at the server's learning rate, which decays by `decay` each round."""
    weights_t = model.weights_type()
    data_t = fl.SequenceType(model.input_spec)
    state_t = fl.to_type({"learning_rate": np.float32})

    @fl.jax_computation(weights_t, state_t, data_t)
    def client_update(weights, state, dataset):
        opt = optax.sgd(state["learning_rate"])

        def step(carry, batch, padding):
            w, opt_state, stats = carry
            x, y, _ = models.model.batch_fields(batch)

            def loss_fn(trainable):
                preds, _ = model.apply(models.ModelWeights(trainable, ()), x, training=True)
                return model.loss(preds, y, padding), preds

            (loss, preds), grads = jax.value_and_grad(loss_fn, has_aux=True)(w)
            updates, opt_state = opt.update(grads, opt_state, w)
            stats = metrics_lib.accumulate_stats(model.metrics, stats, loss, preds, y, padding)
            return optax.apply_updates(w, updates), opt_state, stats

        initial = (weights.trainable, opt.init(weights.trainable), metrics_lib.zero_stats(model.metrics))
        final, _, stats = dataset.reduce(initial, step, masked=True)
        update = jax.tree.map(lambda a, b: a - b, weights.trainable, final)
        return client_works.client_output(model, update, stats["num_examples"], "num_examples", stats, [])

    @fl.jax_computation(client_update.type_signature.result)
    def to_result(out):
        return templates.ClientResult(out["update"], out["update_weight"], out["non_trainable"])

    @fl.jax_computation(state_t)
    def decay_lr(state):
        return {"learning_rate": state["learning_rate"] * decay}

    @fl.federated_computation()
    def initialize():
        return fl.federated_value({"learning_rate": np.float32(initial_lr)}, fl.SERVER)

    @fl.federated_computation(fl.type_at_server(state_t), fl.type_at_clients(weights_t),
                              fl.type_at_clients(data_t))
    def next_fn(state, weights, client_data):
        outputs = fl.federated_map(client_update, (weights, fl.federated_broadcast(state), client_data))
        return fl.templates.MeasuredProcessOutput(
            fl.federated_map(decay_lr, state),
            fl.federated_map(to_result, outputs),
            client_works.measurements(model, outputs),
        )

    return templates.ClientWorkProcess(
        initialize, next_fn, get_hparams_fn=lambda s: dict(s),
        set_hparams_fn=lambda s, h: {**s, **{k: np.float32(v) for k, v in h.items()}},
    )


def build_fedavg_with_lr_decay(initial_lr: float = 0.5, decay: float = 0.9) -> templates.LearningProcess:
    model = model_fn()
    weights_t = model.weights_type()

    @fl.jax_computation()
    def initial_weights():
        return model.initial_weights(jax.random.key(0))

    return composers.compose_learning_process(
        initial_weights,
        distributors.build_broadcast_process(weights_t),
        build_decaying_lr_client_work(model, initial_lr, decay),
        aggregators.MeanFactory().create(weights_t["trainable"], np.float32),
        finalizers.build_apply_optimizer_finalizer(optax.sgd(1.0), weights_t),
    )


def main(rounds: int = 10, clients_per_round: int = 5, seed: int = 0, verbose: bool = True) -> list[float]:
    """Trains; returns the client learning rate used in each round."""
    train = sim.datasets.digits(num_clients=20, partition="dirichlet", alpha=0.5, seed=seed)
    train = train.preprocess(lambda ds: ds.shuffle(128, seed=seed).batch(16))
    sampler = sim.UniformSampler(train.client_ids, clients_per_round, seed=seed)
    process = build_fedavg_with_lr_decay()
    state = process.initialize()
    rates = []
    for round_num in range(rounds):
        rates.append(float(process.get_hparams(state)["client_work"]["learning_rate"]))
        cohort = sampler.sample_round(round_num)
        state, metrics = process.next(state, [train.create_dataset_for_client(c) for c in cohort])
        if verbose:
            m = metrics["client_work"]["train"]
            print(f"round {round_num + 1:2d}  client lr {rates[-1]:.3f}  loss {float(m['loss']):.3f}  "
                  f"accuracy {float(m['accuracy']):.3f}")
    return rates


if __name__ == "__main__":
    main()
