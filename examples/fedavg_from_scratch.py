"""Federated Averaging from scratch, with fedlang's core only.

In the style of TFF's "Building your own federated learning algorithm": a softmax
regression model (64 pixels -> 10 digits) is trained on scikit-learn's bundled digits,
split non-IID across clients (each client holds mostly two digits). The algorithm is
written out piece by piece:

* `client_update` (local, JAX): SGD over the client's dataset, written as
  `dataset.reduce(initial_state, step)` so each runtime chooses how to run the loop;
* `server_update` (local, JAX): moves the global model towards the clients' average;
* `initialize` and `next` (federated): broadcast, federated_map(client_update),
  federated_mean weighted by the clients' example counts, server update, metrics;

and wrapped in `fedlang.templates.IterativeProcess`. The driver loop is plain Python:
it samples a cohort of clients each round and evaluates on held-out data.

Run it with `python examples/fedavg_from_scratch.py`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import fedlang as fl

NUM_FEATURES, NUM_CLASSES = 64, 10

# One batch of a client's dataset, and the model's weights.
BATCH_SPEC = {"x": (np.float32, [None, NUM_FEATURES]), "y": (np.int32, [None])}
MODEL_SPEC = {
    "kernel": (np.float32, [NUM_FEATURES, NUM_CLASSES]),
    "bias": (np.float32, [NUM_CLASSES]),
}
BATCH_TYPE = fl.to_type(BATCH_SPEC)
MODEL_TYPE = fl.to_type(MODEL_SPEC)


# ----------------------------------------------------------------------------
# Data: digits, split non-IID across clients


def load_data(
    num_clients: int = 20,
    labels_per_client: int = 2,
    iid_fraction: float = 0.1,
    test_fraction: float = 0.25,
    seed: int = 0,
) -> tuple[list[dict[str, np.ndarray]], dict[str, np.ndarray]]:
    """Splits the digits into non-IID client datasets and a held-out test set.

    Each label is owned by `num_clients * labels_per_client / 10` clients, which share
    all but an `iid_fraction` of its training examples; the rest are spread uniformly
    over all clients. So a client holds mostly `labels_per_client` digits.

    Returns:
      (clients, test): `clients[i] = {'x': float32[n_i,64], 'y': int32[n_i]}` and the
      test set in the same form. Pixels are scaled to [0, 1].
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    n_test = int(len(y) * test_fraction)
    test_idx, train_idx = order[:n_test], order[n_test:]

    owners: dict[int, list[int]] = {label: [] for label in range(NUM_CLASSES)}
    for c in range(num_clients):
        for k in range(labels_per_client):
            owners[(c + k * (NUM_CLASSES // labels_per_client + 1)) % NUM_CLASSES].append(c)
    client_idx: list[list[int]] = [[] for _ in range(num_clients)]
    for label in range(NUM_CLASSES):
        idx = train_idx[y[train_idx] == label]
        to_anyone = rng.random(len(idx)) < iid_fraction
        for i in idx[to_anyone]:
            client_idx[rng.integers(num_clients)].append(int(i))
        owned = idx[~to_anyone]
        holders = owners[label] or list(range(num_clients))
        for part, c in zip(np.array_split(owned, len(holders)), holders):
            client_idx[c].extend(int(i) for i in part)
    clients = []
    for idx in client_idx:
        idx = rng.permutation(np.asarray(idx, dtype=np.int64))
        clients.append({"x": x[idx], "y": y[idx]})
    return clients, {"x": x[test_idx], "y": y[test_idx]}


def make_batches(
    client: dict[str, np.ndarray], batch_size: int, epochs: int, rng: np.random.Generator
) -> list[dict[str, np.ndarray]]:
    """A client's dataset: `epochs` shuffled passes over its examples, in full batches.

    Dropping each pass's last partial batch (as `batch(drop_remainder=True)` would)
    keeps every batch the same shape, so the jitted SGD step compiles once.
    """
    batches = []
    for _ in range(epochs):
        order = rng.permutation(len(client["y"]))
        for i in range(0, len(order) - batch_size + 1, batch_size):
            idx = order[i : i + batch_size]
            batches.append({"x": client["x"][idx], "y": client["y"][idx]})
    return batches


# ----------------------------------------------------------------------------
# The model (plain JAX)


def predict(weights, x):
    return x @ weights["kernel"] + weights["bias"]


def batch_loss(weights, batch):
    logits = predict(weights, batch["x"])
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1))


@fl.jax_computation(MODEL_SPEC, BATCH_SPEC)
def evaluate(weights, data):
    """The accuracy and loss of `weights` on one batch (here: the whole test set)."""
    correct = jnp.argmax(predict(weights, data["x"]), axis=-1) == data["y"]
    return {
        "accuracy": jnp.mean(correct.astype(jnp.float32)),
        "loss": batch_loss(weights, data),
    }


# ----------------------------------------------------------------------------
# The algorithm


def build_fedavg(client_lr: float = 0.5, server_lr: float = 1.0) -> fl.templates.IterativeProcess:
    """Builds FedAvg: `initialize() -> model@SERVER`, `next(model, data) -> <model, metrics>`."""

    @fl.jax_computation()
    def initialize_model():
        return {
            "kernel": jnp.zeros([NUM_FEATURES, NUM_CLASSES], jnp.float32),
            "bias": jnp.zeros([NUM_CLASSES], jnp.float32),
        }

    @fl.jax_computation(MODEL_TYPE, fl.SequenceType(BATCH_TYPE))
    def client_update(initial_weights, dataset):
        """Local SGD over the client's batches; returns the trained weights and stats."""
        grad_fn = jax.value_and_grad(batch_loss)

        def step(state, batch):
            loss, grads = grad_fn(state["weights"], batch)
            n = batch["y"].shape[0]
            return {
                # A dict comprehension keeps the model's field order; jax.tree.map would
                # return the keys sorted, which is a different struct type.
                "weights": {k: w - client_lr * grads[k] for k, w in state["weights"].items()},
                "num_examples": state["num_examples"] + jnp.float32(n),
                "loss_sum": state["loss_sum"] + loss * jnp.float32(n),
            }

        zero = {
            "weights": initial_weights,
            "num_examples": jnp.float32(0),
            "loss_sum": jnp.float32(0),
        }
        final = dataset.reduce(zero, step)
        return {
            "weights": final["weights"],
            "num_examples": final["num_examples"],
            "loss": final["loss_sum"] / jnp.maximum(final["num_examples"], 1.0),
        }

    @fl.jax_computation(MODEL_TYPE, MODEL_TYPE)
    def server_update(weights, mean_client_weights):
        """Moves the server model `server_lr` of the way to the clients' average."""
        return {k: w + server_lr * (mean_client_weights[k] - w) for k, w in weights.items()}

    @fl.federated_computation()
    def initialize():
        return fl.federated_eval(initialize_model, fl.SERVER)

    @fl.federated_computation(
        fl.type_at_server(MODEL_TYPE), fl.type_at_clients(fl.SequenceType(BATCH_TYPE))
    )
    def next_fn(server_weights, client_data):
        client_weights = fl.federated_broadcast(server_weights)
        outputs = fl.federated_map(client_update, (client_weights, client_data))
        mean_weights = fl.federated_mean(outputs.weights, weight=outputs.num_examples)
        new_weights = fl.federated_map(server_update, (server_weights, mean_weights))
        # Zipped, the metrics are one server value <client_loss=...,num_examples=...>@SERVER.
        metrics = fl.federated_zip(
            {
                "client_loss": fl.federated_mean(outputs.loss),
                "num_examples": fl.federated_sum(outputs.num_examples),
            }
        )
        return new_weights, metrics

    return fl.templates.IterativeProcess(initialize, next_fn)


# ----------------------------------------------------------------------------
# The driver loop


def main(
    rounds: int = 15,
    num_clients: int = 20,
    clients_per_round: int = 10,
    epochs: int = 5,
    batch_size: int = 16,
    client_lr: float = 0.5,
    seed: int = 0,
    verbose: bool = True,
) -> list[float]:
    """Trains FedAvg and returns the test accuracy before training and after each round."""
    clients, test = load_data(num_clients=num_clients, seed=seed)
    process = build_fedavg(client_lr=client_lr)
    rng = np.random.default_rng(seed)
    if verbose:
        sizes = [len(c["y"]) for c in clients]
        print(
            f"{num_clients} clients with {min(sizes)}-{max(sizes)} examples each; "
            f"{len(test['y'])} test examples"
        )
        print("client 0 labels:", np.bincount(clients[0]["y"], minlength=NUM_CLASSES).tolist())
        print("initialize:", process.initialize.type_signature)
        print("next:      ", process.next.type_signature)

    state = process.initialize()
    history = [float(evaluate(state, test)["accuracy"])]
    if verbose:
        print(f"round  0  test accuracy {history[0]:.3f}")
    for round_num in range(1, rounds + 1):
        cohort = rng.choice(num_clients, size=clients_per_round, replace=False)
        client_data = [make_batches(clients[c], batch_size, epochs, rng) for c in cohort]
        state, metrics = process.next(state, client_data)
        history.append(float(evaluate(state, test)["accuracy"]))
        if verbose:
            print(
                f"round {round_num:2d}  client loss {float(metrics['client_loss']):.3f}  "
                f"test accuracy {history[-1]:.3f}"
            )
    return history


if __name__ == "__main__":
    main()
