"""The benchmark's models, FedAvg written with fedlang's core, and the centralized baseline.

* W1: logistic regression 784 -> 10 on flattened pixels.
* W2: the CNN of the FedAvg paper (McMahan et al. 2017): conv5x5x32, maxpool 2,
  conv5x5x64, maxpool 2, dense 512, dense 10 (ReLU between).

FedAvg: client SGD (lr 0.1) over one epoch of batches of 20 with `dataset.reduce`,
server SGD (lr 1.0) on the example-weighted mean of the client deltas.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

import fedlang as fl

CLIENT_LR = 0.1
SERVER_LR = 1.0


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    flat: bool  # x is float32[?,784] (True) or float32[?,28,28]
    init: Callable[[jax.Array], dict[str, jax.Array]]
    apply: Callable[[dict[str, jax.Array], jax.Array], jax.Array]

    def batch_spec(self) -> dict[str, Any]:
        x_shape = [None, 784] if self.flat else [None, 28, 28]
        return {"x": (np.float32, x_shape), "y": (np.int32, [None])}

    def params_spec(self) -> dict[str, Any]:
        params = jax.eval_shape(self.init, jax.random.key(0))
        return {k: (np.float32, list(v.shape)) for k, v in params.items()}


def _logreg_init(key: jax.Array) -> dict[str, jax.Array]:
    del key
    return {"kernel": jnp.zeros((784, 10), jnp.float32), "bias": jnp.zeros((10,), jnp.float32)}


def _logreg_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    return x @ p["kernel"] + p["bias"]


def _glorot(key: jax.Array, shape: tuple[int, ...], fan_in: int, fan_out: int) -> jax.Array:
    limit = np.sqrt(6.0 / (fan_in + fan_out))
    return jax.random.uniform(key, shape, jnp.float32, -limit, limit)


def _cnn_init(key: jax.Array) -> dict[str, jax.Array]:
    k = jax.random.split(key, 4)
    return {
        "conv1_w": _glorot(k[0], (5, 5, 1, 32), 25, 25 * 32),
        "conv1_b": jnp.zeros((32,), jnp.float32),
        "conv2_w": _glorot(k[1], (5, 5, 32, 64), 25 * 32, 25 * 64),
        "conv2_b": jnp.zeros((64,), jnp.float32),
        "dense1_w": _glorot(k[2], (7 * 7 * 64, 512), 7 * 7 * 64, 512),
        "dense1_b": jnp.zeros((512,), jnp.float32),
        "dense2_w": _glorot(k[3], (512, 10), 512, 10),
        "dense2_b": jnp.zeros((10,), jnp.float32),
    }


def _conv(x: jax.Array, w: jax.Array, b: jax.Array) -> jax.Array:
    y = lax.conv_general_dilated(x, w, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    return jax.nn.relu(y + b)


def _maxpool(x: jax.Array) -> jax.Array:
    return lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")


def _cnn_apply(p: dict[str, jax.Array], x: jax.Array) -> jax.Array:
    x = x[..., None]
    x = _maxpool(_conv(x, p["conv1_w"], p["conv1_b"]))
    x = _maxpool(_conv(x, p["conv2_w"], p["conv2_b"]))
    x = x.reshape(x.shape[0], -1)
    x = jax.nn.relu(x @ p["dense1_w"] + p["dense1_b"])
    return x @ p["dense2_w"] + p["dense2_b"]


LOGREG = Model("logreg", True, _logreg_init, _logreg_apply)
CNN = Model("cnn", False, _cnn_init, _cnn_apply)
MODELS = {"logreg": LOGREG, "cnn": CNN}


def loss_fn(model: Model, params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> jax.Array:
    logits = model.apply(params, batch["x"])
    log_probs = jax.nn.log_softmax(logits)
    return -jnp.mean(jnp.take_along_axis(log_probs, batch["y"][:, None], axis=1))


def sgd_step(model: Model, lr: float = CLIENT_LR) -> Callable:
    """(params, batch) -> (params, loss): one SGD step; keeps the params' key order."""
    grad_fn = jax.value_and_grad(lambda p, b: loss_fn(model, p, b))

    def step(params: dict[str, jax.Array], batch: dict[str, jax.Array]) -> tuple[Any, jax.Array]:
        loss, grads = grad_fn(params, batch)
        return {k: w - lr * grads[k] for k, w in params.items()}, loss

    return step


# ----------------------------------------------------------------------------
# FedAvg with fedlang's core


def build_fedavg(model: Model) -> fl.templates.IterativeProcess:
    """`initialize() -> params@SERVER`; `next(params, data) -> <params, train_loss>`."""
    params_type = fl.to_type(model.params_spec())
    batch_type = fl.to_type(model.batch_spec())
    step = sgd_step(model)

    @fl.jax_computation()
    def initialize_model():
        # Sorted keys: the order jax.eval_shape (and so params_spec) gives.
        return dict(sorted(model.init(jax.random.key(0)).items()))

    @fl.jax_computation(params_type, fl.SequenceType(batch_type))
    def client_update(initial, dataset):
        def reduce_step(state, batch):
            params, loss = step(state["params"], batch)
            n = jnp.float32(batch["y"].shape[0])
            return {
                "params": params,
                "num_examples": state["num_examples"] + n,
                "loss_sum": state["loss_sum"] + loss * n,
            }

        zero = {"params": initial, "num_examples": jnp.float32(0), "loss_sum": jnp.float32(0)}
        final = dataset.reduce(zero, reduce_step)
        return {
            "delta": {k: final["params"][k] - w for k, w in initial.items()},
            "num_examples": final["num_examples"],
            "loss": final["loss_sum"] / jnp.maximum(final["num_examples"], 1.0),
        }

    @fl.jax_computation(params_type, params_type)
    def server_update(params, mean_delta):
        # Server SGD with lr SERVER_LR on the pseudo-gradient -mean_delta.
        return {k: w + SERVER_LR * mean_delta[k] for k, w in params.items()}

    @fl.federated_computation()
    def initialize():
        return fl.federated_eval(initialize_model, fl.SERVER)

    @fl.federated_computation(
        fl.type_at_server(params_type), fl.type_at_clients(fl.SequenceType(batch_type))
    )
    def next_fn(params, client_data):
        outputs = fl.federated_map(client_update, (fl.federated_broadcast(params), client_data))
        mean_delta = fl.federated_mean(outputs.delta, weight=outputs.num_examples)
        new_params = fl.federated_map(server_update, (params, mean_delta))
        train_loss = fl.federated_mean(outputs.loss, weight=outputs.num_examples)
        return new_params, train_loss

    return fl.templates.IterativeProcess(initialize, next_fn)


def make_accuracy(model: Model) -> Callable[[Any, dict[str, np.ndarray]], float]:
    @jax.jit
    def correct(params: Any, x: jax.Array, y: jax.Array) -> jax.Array:
        return jnp.sum(jnp.argmax(model.apply(params, x), -1) == y)

    def accuracy(params: Any, test: dict[str, np.ndarray]) -> float:
        params = {k: jnp.asarray(v) for k, v in params.items()}
        n = len(test["y"])
        total = sum(
            int(correct(params, test["x"][i : i + 1000], test["y"][i : i + 1000]))
            for i in range(0, n, 1000)
        )
        return total / n

    return accuracy


# ----------------------------------------------------------------------------
# Centralized training in plain JAX (the baseline)


class Centralized:
    """SGD with batch 20 over given batches: a jitted `lax.scan`, or a loop of jitted steps."""

    def __init__(self, model: Model):
        self.model = model
        step = sgd_step(model)
        self.step = jax.jit(lambda p, b: step(p, b)[0])

        def scan(params: Any, xs: jax.Array, ys: jax.Array) -> Any:
            def body(p: Any, b: tuple[jax.Array, jax.Array]) -> tuple[Any, None]:
                return step(p, {"x": b[0], "y": b[1]})[0], None

            return lax.scan(body, params, (xs, ys))[0]

        self.scan = jax.jit(scan)

    def run_scan(self, params: Any, xs: np.ndarray, ys: np.ndarray) -> Any:
        return jax.block_until_ready(self.scan(params, jnp.asarray(xs), jnp.asarray(ys)))

    def run_loop(self, params: Any, batches: list[dict[str, np.ndarray]]) -> Any:
        for b in batches:
            params = self.step(params, b)
        return jax.block_until_ready(params)


# ----------------------------------------------------------------------------
# Hand-written vmapped FedAvg in plain JAX (the second baseline)


class VmappedFedAvg:
    """One FedAvg round as a few batched programs: clients vmapped, their batches scanned
    (padding batches masked out with `jnp.where`), the example-weighted mean of the
    deltas and the server step in the same program.

    Clients are sorted by length and run `width` at a time; each group is padded to a
    power-of-two number of batches, so a run compiles a few programs
    (`prepare` compiles them outside the clock). This is what a researcher would write
    by hand for speed on an accelerator.
    """

    def __init__(self, model: Model, width: int = 128):
        self.width = width
        step = sgd_step(model)

        def client(params: Any, xs: jax.Array, ys: jax.Array, valid: jax.Array) -> Any:
            def body(p: Any, b: Any) -> tuple[Any, None]:
                x, y, v = b
                new, _ = step(p, {"x": x, "y": y})
                return {k: jnp.where(v, new[k], p[k]) for k in p}, None

            final = lax.scan(body, params, (xs, ys, valid))[0]
            return {k: final[k] - params[k] for k in params}

        def group(params: Any, acc: Any, xs: Any, ys: Any, valid: Any, weights: Any) -> Any:
            deltas = jax.vmap(client, in_axes=(None, 0, 0, 0))(params, xs, ys, valid)
            return {k: acc[k] + jnp.tensordot(weights, deltas[k], axes=1) for k in acc}

        def server(params: Any, acc: Any, total: jax.Array) -> Any:
            return {k: params[k] + SERVER_LR * acc[k] / total for k in params}

        self._group = jax.jit(group)
        self._server = jax.jit(server)
        self._compiled: dict[tuple, Any] = {}

    def _groups(self, clients: list[list[dict[str, np.ndarray]]]) -> list[tuple]:
        order = sorted(range(len(clients)), key=lambda i: len(clients[i]))
        out = []
        for s in range(0, len(order), self.width):
            idx = [i for i in order[s : s + self.width] if clients[i]]
            if not idx:
                continue
            rows = len(idx)
            length = 1 << (max(len(clients[i]) for i in idx) - 1).bit_length()
            first = clients[idx[0]][0]
            xs = np.zeros((rows, length, *first["x"].shape), np.float32)
            ys = np.zeros((rows, length, *first["y"].shape), np.int32)
            valid = np.zeros((rows, length), bool)
            weights = np.zeros((rows,), np.float32)
            for k, i in enumerate(idx):
                n = len(clients[i])
                xs[k, :n] = np.stack([b["x"] for b in clients[i]])
                ys[k, :n] = np.stack([b["y"] for b in clients[i]])
                valid[k, :n] = True
                weights[k] = sum(len(b["y"]) for b in clients[i])
            out.append((xs, ys, valid, weights))
        return out

    def prepare(self, params: Any, clients: list[list[dict[str, np.ndarray]]]) -> list[tuple]:
        """The round's host buffers, with their programs compiled (outside the clock)."""
        groups = self._groups(clients)
        params = {k: jnp.asarray(v) for k, v in params.items()}
        for g in groups:
            shapes = tuple(x.shape for x in g)
            if shapes not in self._compiled:
                self._compiled[shapes] = self._group.lower(params, params, *g).compile()
        return groups

    def run(self, params: Any, groups: list[tuple]) -> Any:
        """The round (transfers included): the new server weights."""
        params = {k: jnp.asarray(v) for k, v in params.items()}
        acc = {k: jnp.zeros_like(v) for k, v in params.items()}
        total = np.float32(sum(float(g[3].sum()) for g in groups))
        for g in groups:
            acc = self._compiled[tuple(x.shape for x in g)](params, acc, *g)
        return jax.block_until_ready(self._server(params, acc, total))
