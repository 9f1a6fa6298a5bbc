"""Runs examples/image_classification.py on small settings and checks that it learns."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")


def test_keras_fedavg_on_digits_then_federated_evaluation_on_held_out_clients(load_script):
    result = load_script("examples/image_classification.py").main(
        rounds=6, clients_per_round=8, verbose=False
    )
    assert result["num_examples"] > 100
    assert result["accuracy"] > 0.35  # chance is 0.1
