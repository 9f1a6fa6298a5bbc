"""Federated Averaging on real clients: a task store server and 20 client processes.

The walkthrough of docs/deploy.md as one script. It starts a server on 127.0.0.1,
writes each client's share of scikit-learn's digits (non-IID: mostly two digits per
client) to its own .npz file, starts one `fedlang client` process per client, and runs
the ordinary driver loop (`process.next(state, client_data("train"))`) in a deployment
context: each round is a task the clients pull, run on their own data and report. It
prints the held-out accuracy after each round.

With `--secure` the model updates are summed with secure aggregation
(`fedlang.learning.secure_aggregator()`: quantized, clipped and zeroed, summed by
SecAgg+): each client's update leaves it only masked, and the server learns only the
cohort's sums. Each `process.next` is then two secure rounds (the adaptive bounds are
estimated in the first).

Run it:  python examples/deploy_digits.py [--rounds 15] [--clients 20] [--secure]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax
from sklearn.datasets import load_digits

from fedlang import deploy, learning
from fedlang.core import context
from fedlang.learning import algorithms, models

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
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


def build_process(secure: bool = False) -> Any:
    """FedAvg; with `secure`, its model updates are summed by secure aggregation."""
    if secure:
        return algorithms.build_weighted_fed_avg(
            model_fn, optax.sgd(0.5), model_aggregator=learning.secure_aggregator()
        )
    return algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5))


def partition(num_clients: int, seed: int = 0) -> tuple[list[dict[str, np.ndarray]], dict[str, Any]]:
    """Client shares of the digits (each client mostly two digits) and a held-out test set.

    Client c holds the digits c % 10 and (c * 3 + 1) % 10; with fewer than 10 clients,
    a digit no client holds goes to client `digit % num_clients`, so every example has a
    client however few there are.

    Raises:
      ValueError: unless 1 <= num_clients <= the number of training examples (1,438).
    """
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    test, train = order[: len(y) // 5], order[len(y) // 5 :]
    if not 1 <= num_clients <= len(train):
        raise ValueError(
            f"Expected between 1 and {len(train)} clients (the training examples), found "
            f"{num_clients}; pass another --clients."
        )
    holders = {d: [c for c in range(num_clients) if d in (c % 10, (c * 3 + 1) % 10)]
               or [d % num_clients] for d in range(10)}
    shares: list[list[int]] = [[] for _ in range(num_clients)]
    for i in train:
        if rng.random() < 0.2:  # a fifth of the examples go to anyone
            shares[rng.integers(num_clients)].append(int(i))
        else:  # the rest to one of the clients that hold this digit
            owners = holders[int(y[i])]
            shares[owners[rng.integers(len(owners))]].append(int(i))
    clients = [{"x": x[idx], "y": y[idx]} for idx in map(np.asarray, shares)]
    return clients, {"x": x[test], "y": y[test]}


def accuracy(weights: Any, test: dict[str, np.ndarray]) -> float:
    logits = test["x"] @ np.asarray(weights.trainable["w"]) + np.asarray(weights.trainable["b"])
    return float(np.mean(np.argmax(logits, axis=1) == test["y"]))


@contextlib.contextmanager
def client_processes(url: str, token: str, files: list[pathlib.Path], batch_size: int,
                     logs: pathlib.Path) -> Iterator[list[subprocess.Popen[bytes]]]:
    """One `fedlang client` process per data file, each killed on exit if still running."""
    env = {**os.environ, "PYTHONPATH": f"{SRC}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    procs = []
    try:
        for i, path in enumerate(files):
            with open(logs / f"client{i}.log", "wb") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, "-m", "fedlang", "client", "--server", url,
                     "--population", "digits", "--token", token, "--data", f"train={path}",
                     "--batch-size", str(batch_size), "--patience", "120"],
                    stdout=log, stderr=subprocess.STDOUT, env=env,
                ))
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
            p.wait(timeout=30)


def run(rounds: int = 15, num_clients: int = 20, batch_size: int = 20,
        workdir: str | os.PathLike[str] | None = None, verbose: bool = True,
        secure: bool = False) -> dict[str, Any]:
    """Trains on `num_clients` client processes (`secure`: with secure aggregation);
    returns the final state and accuracies."""
    work = pathlib.Path(workdir or tempfile.mkdtemp(prefix="fedlang-deploy-"))
    clients, test = partition(num_clients)
    files = []
    for i, data in enumerate(clients):
        files.append(work / f"client{i}.npz")
        np.savez(files[-1], x=data["x"], y=data["y"])
    process = build_process(secure)
    state = process.initialize()
    history = []
    with deploy.Server(db=work / "store.db", port=0, pace=deploy.Pace(min_retry=0.1)) as server:
        with deploy.Admin(server.url, server.admin_token) as admin:
            token = admin.create_population("digits")
        if verbose:
            print(f"server {server.url}; {num_clients} clients; data and logs in {work}"
                  + ("; secure aggregation" if secure else ""))
        # A secure round's first stage includes the clients' training (and, the first
        # time, compiling it); its later stages are quick exchanges of keys and shares.
        timing = {"deadline": 600, "stage_timeout": 30} if secure else {"deadline": 300}
        rounds_runner = deploy.ServerRounds(server.url, server.admin_token, "digits",
                                            target=num_clients, progress=verbose, **timing)
        with client_processes(server.url, token, files, batch_size, work) as procs:
            ctx = deploy.DeploymentContext(rounds_runner)
            with context.with_context(ctx):
                for round_num in range(1, rounds + 1):
                    start = time.perf_counter()
                    state, _ = process.next(state, deploy.client_data("train"))
                    acc = accuracy(process.get_model_weights(state), test)
                    history.append(acc)
                    if verbose:
                        print(f"round {round_num:2d}: held-out accuracy {acc:.3f} "
                              f"({time.perf_counter() - start:.1f} s)")
            rounds_runner.finish()  # the clients stop at their next check-in
            for p in procs:
                p.wait(timeout=120)
        rounds_runner.close()
    return {"state": state, "process": process, "accuracy": history, "clients": clients,
            "test": test, "files": files, "rounds": ctx.rounds}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--secure", action="store_true",
                        help="Sum the model updates with secure aggregation (SecAgg+).")
    args = parser.parse_args()
    if args.clients < 1:
        parser.error(f"Expected --clients >= 1, found {args.clients}.")
    result = run(args.rounds, args.clients, secure=args.secure)
    print(f"final held-out accuracy: {result['accuracy'][-1]:.3f}")


if __name__ == "__main__":
    main()
