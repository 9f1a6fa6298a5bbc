"""FedAvg on digits (non-IID, 10 clients per round) reaches 90% on held-out clients."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang.simulation as sim
from fedlang.learning import algorithms, evaluation, models

SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"kernel": jnp.zeros([64, 10]), "bias": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["kernel"] + p["bias"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


@pytest.mark.slow
def test_fed_avg_on_non_iid_digits_reaches_90_percent_on_held_out_clients():
    digits = sim.datasets.digits(num_clients=50, partition="dirichlet", alpha=0.5, seed=0)
    train, test = sim.train_test_client_split(digits, num_test_clients=10, seed=0)
    train = train.preprocess(lambda ds: ds.repeat(2).shuffle(128, seed=0).batch(16))
    sampler = sim.UniformSampler(train.client_ids, 10, seed=0)
    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5))
    state = process.initialize()
    held_out = [b for c in test.client_ids for b in test.create_dataset_for_client(c).batch(64)]
    evaluate = evaluation.build_centralized_evaluation(model_fn)
    accuracy = 0.0
    for round_num in range(50):
        cohort = sampler.sample_round(round_num)
        state, _ = process.next(state, [train.create_dataset_for_client(c) for c in cohort])
        if round_num % 10 == 9:
            accuracy = float(evaluate(process.get_model_weights(state), held_out)["accuracy"])
            if accuracy >= 0.9:
                break
    assert accuracy >= 0.9, accuracy
