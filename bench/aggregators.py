"""Aggregator measurements on digits: robustness to attackers, and compression savings.

    .venv/bin/python bench/aggregators.py            # both tables, as in bench/README.md

FedAvg on scikit-learn's digits (10 clients, Dirichlet 0.5 split, all clients every
round, batch 20, client SGD 0.1, server SGD 1.0). The MLP 64-200-64-10 has 26,514
parameters, two of its tensors above the 10,000-element quantization threshold.
Attackers: the first 20% of clients scale their features by 1000 and shuffle their
labels, so their updates are ~1000x larger (finite, so not zeroed by client work).
"""

from __future__ import annotations

import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang import aggregators
from fedlang.learning import models
from fedlang.learning.algorithms import fed_avg
from fedlang.learning.encoded_broadcast import build_encoded_broadcast_process
from fedlang.simulation.datasets import generated

SIZES = (64, 200, 64, 10)


def _init(rng):
    keys = jax.random.split(rng, len(SIZES) - 1)
    params = {}
    for i, (k, a, b) in enumerate(zip(keys, SIZES[:-1], SIZES[1:])):
        params[f"b{i}"] = jnp.zeros([b], jnp.float32)
        params[f"w{i}"] = jax.random.normal(k, (a, b), jnp.float32) * jnp.sqrt(2.0 / a)
    return params


def _apply(p, x):
    n = len(SIZES) - 1
    for i in range(n):
        x = x @ p[f"w{i}"] + p[f"b{i}"]
        if i < n - 1:
            x = jax.nn.relu(x)
    return x


def model_fn():
    return models.FunctionalModel(
        _init, _apply,
        lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        {"x": (np.float32, [None, 64]), "y": (np.int32, [None])})


def client_datasets(num_clients=10, attackers=0.0, seed=0):
    """Lists of batches per client; the first `attackers` fraction is poisoned."""
    cd = generated.digits(num_clients, seed=seed)
    rng = np.random.default_rng(seed)
    out = []
    for i, cid in enumerate(cd.client_ids):
        ex = list(cd.create_dataset_for_client(cid))
        x = np.stack([e["x"] for e in ex]).astype(np.float32)
        y = np.asarray([e["y"] for e in ex], np.int32)
        if i < round(attackers * num_clients):
            x, y = x * 1000.0, rng.permutation(y)
        out.append([{"x": x[s:s + 20], "y": y[s:s + 20]} for s in range(0, len(y), 20)])
    return out


def accuracy(weights):
    cd = generated.digits(10)
    ex = [e for cid in cd.client_ids for e in cd.create_dataset_for_client(cid)]
    x = np.stack([e["x"] for e in ex]).astype(np.float32)
    y = np.asarray([e["y"] for e in ex])
    logits = np.asarray(_apply(dict(weights.trainable), x))
    return float(np.mean(np.argmax(logits, 1) == y)) if np.all(np.isfinite(logits)) else 0.0


def train(aggregator=None, *, rounds=15, attackers=0.0, broadcast_encoder=None):
    """Returns (final accuracy, per-round metrics)."""
    distributor = None
    if broadcast_encoder is not None:
        weights_t = models.ModelWeights(*model_fn().weights_type())
        distributor = build_encoded_broadcast_process(
            model_fn().weights_type(), broadcast_encoder, seed=0) if weights_t else None
    # The robust aggregators (median, trimmed mean, ...) weigh every client equally.
    build = (fed_avg.build_unweighted_fed_avg
             if isinstance(aggregator, aggregators.UnweightedAggregationFactory)
             else fed_avg.build_weighted_fed_avg)
    process = build(model_fn, optax.sgd(0.1), optax.sgd(1.0), model_aggregator=aggregator,
                    model_distributor=distributor)
    data = client_datasets(attackers=attackers)
    state, history = process.initialize(), []
    for _ in range(rounds):
        state, metrics = process.next(state, data)
        history.append(metrics)
    return accuracy(process.get_model_weights(state)), history


def _bits(metrics, key):
    for part in ("aggregator", "distributor"):
        m = metrics.get(part, {})
        stack = [m]
        while stack:
            d = stack.pop()
            if isinstance(d, dict):
                if key in d:
                    return float(d[key])
                stack.extend(d.values())
    return None


def main() -> None:
    rows = {}
    t = time.perf_counter()
    for name, agg, att in [
        ("mean, no attack", None, 0.0),
        ("mean, 20% attackers", None, 0.2),
        ("median, 20% attackers", aggregators.MedianFactory(), 0.2),
        ("trimmed mean 0.2, 20% attackers", aggregators.TrimmedMeanFactory(0.2), 0.2),
        ("geometric median, 20% attackers", aggregators.GeometricMedianFactory(), 0.2),
    ]:
        acc, _ = train(agg, attackers=att)
        rows[name] = {"accuracy": acc}
    for name, enc in [("uncompressed (identity)", aggregators.Encoder.identity()),
                      ("8-bit quantization", aggregators.Encoder.quantize(8)),
                      ("4-bit + Hadamard", aggregators.Encoder.quantize(4, rotation="hadamard"))]:
        agg = aggregators.MeanFactory(value_sum_factory=aggregators.EncodedSumFactory(enc, seed=0))
        acc, hist = train(agg, broadcast_encoder=enc)
        rows[name] = {"accuracy": acc, "aggregated_bits": _bits(hist[-1], "aggregated_bits"),
                      "broadcast_bits": _bits(hist[-1], "broadcast_bits")}
    rows["seconds"] = time.perf_counter() - t
    json.dump(rows, sys.stdout, indent=1)


if __name__ == "__main__":
    main()
