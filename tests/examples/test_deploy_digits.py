"""examples/deploy_digits.py: a server and 20 client processes train FedAvg on the digits,
and the weights equal the simulation runtime's on the same clients; with --secure, 10
client processes train with secure aggregation (SecAgg+ over HTTP), also equal to the
simulation runtime's."""

import jax
import numpy as np
import pytest

import fedlang as fl
from fedlang.deploy.client import data as data_lib


@pytest.mark.parametrize("num_clients", [1, 3, 9, 10, 20])
def test_the_partition_gives_every_training_example_to_one_client(load_script, num_clients):
    # With fewer than 10 clients some digits had no holder (`high <= 0`).
    example = load_script("examples/deploy_digits.py")
    clients, test = example.partition(num_clients)
    assert len(clients) == num_clients
    assert sum(len(c["y"]) for c in clients) + len(test["y"]) == 1797
    assert all(len(c["y"]) for c in clients)


def test_the_partition_refuses_a_number_of_clients_it_cannot_serve(load_script):
    example = load_script("examples/deploy_digits.py")
    with pytest.raises(ValueError, match=r"between 1 and 1438 clients.*found 0; pass another --clients"):
        example.partition(0)


@pytest.mark.slow
def test_fedavg_on_3_client_processes(load_script, tmp_path):
    # About 25 s: three client processes start, enroll and train two rounds.
    example = load_script("examples/deploy_digits.py")
    result = example.run(rounds=2, num_clients=3, workdir=tmp_path, verbose=False)
    assert [r.reports for r in result["rounds"]] == [3, 3]
    assert result["accuracy"][-1] > 0.5, result["accuracy"]  # chance is 0.1


@pytest.mark.slow
def test_fedavg_on_20_client_processes_reaches_85_percent_and_equals_the_simulation(
    load_script, tmp_path
):
    example = load_script("examples/deploy_digits.py")
    rounds = 6
    result = example.run(rounds=rounds, num_clients=20, workdir=tmp_path, verbose=False)
    assert result["accuracy"][-1] >= 0.85, result["accuracy"]
    assert [r.reports for r in result["rounds"]] == [20] * rounds
    # the same rounds in the simulation runtime, on the clients' own batches
    process = result["process"]
    batches = [list(data_lib.NpzDataset(f, batch_size=20)) for f in result["files"]]
    with fl.runtime.simulation_context():
        state = process.initialize()
        for _ in range(rounds):
            state, _ = process.next(state, batches)
    deployed = process.get_model_weights(result["state"])
    simulated = process.get_model_weights(state)
    for a, b in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_fedavg_with_secure_aggregation_on_client_processes_equals_the_simulation(
    load_script, tmp_path
):
    # About 2 minutes: 10 client processes each compile the two secure rounds' tasks.
    example = load_script("examples/deploy_digits.py")
    rounds = 1
    result = example.run(rounds=rounds, num_clients=10, workdir=tmp_path, verbose=False,
                         secure=True)
    details = [r.details for r in result["rounds"]]
    assert len(details) == 2 * rounds  # the adaptive bounds' round, then the updates'
    assert all((d["kind"], d["state"], d["reports"]) == ("secure", "closed", 10) for d in details)
    process = result["process"]
    batches = [list(data_lib.NpzDataset(f, batch_size=20)) for f in result["files"]]
    with fl.runtime.simulation_context():
        state = process.initialize()
        for _ in range(rounds):
            state, _ = process.next(state, batches)
    deployed = process.get_model_weights(result["state"])
    simulated = process.get_model_weights(state)
    for a, b in zip(jax.tree.leaves(deployed), jax.tree.leaves(simulated)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)
    assert result["accuracy"][-1] > 0.5, result["accuracy"]  # chance is 0.1
