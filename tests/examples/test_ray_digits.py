"""examples/ray_digits.py: FedAvg on the digits through Ray equals the simulation runtime."""

import jax
import numpy as np
import pytest

import fedlang as fl

pytest.importorskip("ray")


@pytest.mark.slow  # about 35 s on the shared 2-core machine (Ray start, 2 actors, 3+3 rounds)
@pytest.mark.timeout(600)
def test_fedavg_through_ray_learns_and_equals_the_simulation(load_script, tmp_path, ray_session):
    example = load_script("examples/ray_digits.py")
    rounds = 3
    result = example.run(rounds=rounds, num_clients=10, num_workers=2, workdir=tmp_path,
                         verbose=False)
    assert result["accuracy"][-1] > 0.5, result["accuracy"]  # chance is 0.1
    process = result["process"]
    with fl.runtime.simulation_context():
        state = process.initialize()
        for _ in range(rounds):
            state, _ = process.next(state, result["datasets"])
    on_ray = process.get_model_weights(result["state"])
    simulated = process.get_model_weights(state)
    for a, b in zip(jax.tree.leaves(on_ray), jax.tree.leaves(simulated)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
