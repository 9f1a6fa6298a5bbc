"""Runs examples/image_classification.py on small settings and checks that it learns."""

import importlib.util
import os
import pathlib

os.environ.setdefault("KERAS_BACKEND", "jax")

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "image_classification.py"


def _load():
    spec = importlib.util.spec_from_file_location("image_classification", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_keras_fedavg_on_digits_then_federated_evaluation_on_held_out_clients():
    result = _load().main(rounds=6, clients_per_round=8, verbose=False)
    assert result["num_examples"] > 100
    assert result["accuracy"] > 0.35  # chance is 0.1
