"""Federated image classification with a Keras model (TFF's tutorial 1, on digits).

A Keras model is wrapped with `fedlang.learning.models.from_keras_model` and trained
with Federated Averaging on scikit-learn's 8x8 digits, split non-IID across clients
(a Dirichlet label skew). Each round a new random cohort of training clients is
sampled; at the end the model is evaluated with federated evaluation on held-out
clients it never trained on.

Run it with `python examples/image_classification.py`.
"""

from __future__ import annotations

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import keras
import numpy as np
import optax

import fedlang.simulation as sim
from fedlang.learning import algorithms, models

INPUT_SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def create_keras_model() -> keras.Model:
    return keras.Sequential(
        [keras.Input((64,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(10)]
    )


def model_fn() -> models.Model:
    return models.from_keras_model(
        create_keras_model(),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        input_spec=INPUT_SPEC,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")],
    )


def main(
    rounds: int = 20,
    num_clients: int = 40,
    num_test_clients: int = 8,
    clients_per_round: int = 10,
    batch_size: int = 16,
    epochs: int = 2,
    seed: int = 0,
    verbose: bool = True,
) -> dict[str, float]:
    """Trains, then evaluates on held-out clients; returns the evaluation metrics."""
    digits = sim.datasets.digits(num_clients=num_clients, partition="dirichlet", alpha=0.5, seed=seed)
    train, test = sim.train_test_client_split(digits, num_test_clients, seed=seed)
    train = train.preprocess(lambda ds: ds.repeat(epochs).shuffle(256, seed=seed).batch(batch_size))
    test = test.preprocess(lambda ds: ds.batch(64))
    sampler = sim.UniformSampler(train.client_ids, clients_per_round, seed=seed)

    process = algorithms.build_weighted_fed_avg(model_fn, client_optimizer=optax.sgd(0.1))
    state = process.initialize()
    for round_num in range(rounds):
        cohort = sampler.sample_round(round_num)
        state, metrics = process.next(state, [train.create_dataset_for_client(c) for c in cohort])
        if verbose:
            m = metrics["client_work"]["train"]
            print(f"round {round_num + 1:2d}  loss {float(m['loss']):.3f}  "
                  f"accuracy {float(m['accuracy']):.3f}  examples {int(m['num_examples'])}")

    evaluator = algorithms.build_fed_eval(model_fn)
    eval_state = evaluator.set_model_weights(evaluator.initialize(), process.get_model_weights(state))
    _, eval_metrics = evaluator.next(eval_state, [test.create_dataset_for_client(c) for c in test.client_ids])
    result = {k: float(v) for k, v in eval_metrics["client_work"]["eval"]["current_round_metrics"].items()}
    if verbose:
        print(f"held-out clients: loss {result['loss']:.3f}  accuracy {result['accuracy']:.3f}")
    return result


if __name__ == "__main__":
    main()
