"""Runs examples/custom_fedavg_lr_decay.py: the learning rate decays in the server state."""

import numpy as np


def test_client_learning_rate_decays_each_round(load_script):
    rates = load_script("examples/custom_fedavg_lr_decay.py").main(rounds=3, verbose=False)
    np.testing.assert_allclose(rates, [0.5, 0.45, 0.405], rtol=1e-5)
