"""Federated Averaging on scikit-learn's digits, with each round's clients on Ray.

The driver loop is the simulation runtime's, unchanged; only the context differs:
`fedlang.runtime.ray_context()` starts a local Ray instance (or joins a cluster with
`address=`), and each round's cohort is cut into tasks that Ray actors run, each with
the simulation runtime, returning partial aggregates that are merged before the driver.

The clients' data are written once to an on-disk store (`fedlang.simulation.store`);
the driver passes each client's `Dataset`, a recipe (the store's path and the client's
id), and the workers read the examples themselves. On a cluster, put the store where
every machine reads it at the same path (a shared file system).

Run it:  python examples/ray_digits.py [--rounds 10] [--clients 20] [--workers 2]
"""

from __future__ import annotations

import argparse
import pathlib
import tempfile
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

import fedlang as fl
from fedlang import simulation as sim
from fedlang.learning import algorithms, models

SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def model_fn() -> models.Model:
    """Multinomial logistic regression, 64 pixels -> 10 digits."""
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([64, 10]), "b": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


def write_clients(path: pathlib.Path, num_clients: int, seed: int = 0) -> dict[str, np.ndarray]:
    """Writes the clients' shares of the digits (mostly two digits each) to a store at
    `path`; returns the held-out test set."""
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    shares: list[list[int]] = [[] for _ in range(num_clients)]
    for i in train:
        # the clients that hold this digit (any client when none does: few clients)
        holders = [c for c in range(num_clients) if y[i] in (c % 10, (c * 3 + 1) % 10)]
        if rng.random() < 0.2 or not holders:  # a fifth of the examples go to anyone
            shares[rng.integers(num_clients)].append(int(i))
        else:  # the rest to one of the two clients that hold this digit
            shares[holders[rng.integers(len(holders))]].append(int(i))
    sim.store.write(path, {
        f"client{c}": [{"x": x[i], "y": y[i]} for i in idx] for c, idx in enumerate(shares)
    }, overwrite=True)
    return {"x": x[test], "y": y[test]}


def accuracy(weights: Any, test: dict[str, np.ndarray]) -> float:
    logits = test["x"] @ np.asarray(weights.trainable["w"]) + np.asarray(weights.trainable["b"])
    return float(np.mean(np.argmax(logits, axis=1) == test["y"]))


def run(rounds: int = 10, num_clients: int = 20, num_workers: int | None = None,
        workdir: pathlib.Path | None = None, address: str | None = None,
        verbose: bool = True) -> dict[str, Any]:
    """Trains FedAvg through Ray; returns the final state, the process, the accuracy
    after each round and the clients' datasets."""
    workdir = pathlib.Path(workdir or tempfile.mkdtemp(prefix="fedlang-ray-digits-"))
    test = write_clients(workdir / "digits_store", num_clients)
    client_data = sim.ClientData.from_store(workdir / "digits_store")
    datasets = [client_data.create_dataset_for_client(c).batch(20) for c in client_data.client_ids]
    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5))
    history = []
    with fl.runtime.ray_context(address, num_cpus=num_workers, num_workers=num_workers) as ctx:
        state = process.initialize()
        for round_num in range(1, rounds + 1):
            state, _ = process.next(state, datasets)
            history.append(accuracy(process.get_model_weights(state), test))
            if verbose:
                t = ctx.last_transfers
                print(f"round {round_num:2d}: held-out accuracy {history[-1]:.3f} "
                      f"({t.tasks} tasks, {t.to_workers / 1e3:.0f} kB to the workers, "
                      f"{t.from_workers / 1e3:.0f} kB back)")
    return {"state": state, "process": process, "accuracy": history, "datasets": datasets}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--workers", type=int, default=None, help="default: one per CPU")
    parser.add_argument("--address", default=None, help="a Ray cluster to join")
    args = parser.parse_args()
    result = run(args.rounds, args.clients, args.workers, address=args.address)
    print(f"final held-out accuracy: {result['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
