"""Runs examples/custom_fedavg_lr_decay.py: the learning rate decays in the server state."""

import importlib.util
import pathlib

import numpy as np

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "custom_fedavg_lr_decay.py"


def _load():
    spec = importlib.util.spec_from_file_location("custom_fedavg_lr_decay", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_client_learning_rate_decays_each_round():
    rates = _load().main(rounds=3, verbose=False)
    np.testing.assert_allclose(rates, [0.5, 0.45, 0.405], rtol=1e-5)
