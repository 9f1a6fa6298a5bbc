"""q-FedAvg against a plain-NumPy transcription of the paper's algorithm, on the runtime
sample (tests/conftest.py)."""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang import aggregators
from fedlang.learning import algorithms, models

SPEC = {"x": (np.float32, [None, 3]), "y": (np.int32, [None])}
W0 = {"b": np.array([0.1, -0.2, 0.05], np.float32),
      "w": np.linspace(-0.5, 0.5, 9, dtype=np.float32).reshape(3, 3)}
LR = 0.3


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {k: jnp.asarray(v) for k, v in W0.items()},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean(),
        input_spec=SPEC)


def clients():
    rng = np.random.default_rng(3)
    sizes = [[4, 2], [5], [3, 3, 1]]
    out = []
    for k, client in enumerate(sizes):
        # client 2's labels follow another rule: a high loss, more weight for q > 0
        out.append([{"x": rng.normal(size=(n, 3)).astype(np.float32),
                     "y": ((np.arange(n) + k) % 3).astype(np.int32)} for n in client])
    return out


# --- the paper's Algorithm 3 (q-FedAvg), as fair_flearn's qffedavg.py runs it ---------


def np_loss_and_grad(p, x, y):
    logits = x.astype(np.float64) @ p["w"] + p["b"]
    logits = logits - logits.max(1, keepdims=True)
    prob = np.exp(logits) / np.exp(logits).sum(1, keepdims=True)
    loss = -np.mean(np.log(prob[np.arange(len(y)), y]))
    g = prob.copy()
    g[np.arange(len(y)), y] -= 1.0
    g /= len(y)
    return loss, {"w": x.T.astype(np.float64) @ g, "b": g.sum(0)}


def np_q_fedavg_round(w, data, q, lr):
    big_l = 1.0 / lr
    deltas, hs = [], []
    for batches in data:
        x = np.concatenate([b["x"] for b in batches])
        y = np.concatenate([b["y"] for b in batches])
        f = np_loss_and_grad(w, x, y)[0]  # F_k(w^t) on the client's data
        wk = dict(w)
        for b in batches:  # one epoch of local SGD
            _, g = np_loss_and_grad(wk, b["x"], b["y"])
            wk = {k: wk[k] - lr * g[k] for k in wk}
        grads = {k: big_l * (w[k] - wk[k]) for k in w}
        fq = np.float_power(f + 1e-10, q)
        deltas.append({k: fq * g for k, g in grads.items()})
        norm2 = sum(np.sum(g ** 2) for g in grads.values())
        hs.append(q * np.float_power(f + 1e-10, q - 1) * norm2 + big_l * fq)
    total_h = sum(hs)
    return {k: w[k] - sum(d[k] for d in deltas) / total_h for k in w}


@functools.cache
def process(q):
    return algorithms.build_q_fed_avg(model_fn, q, LR)


@pytest.mark.usefixtures("runtime")
@pytest.mark.parametrize("q", [0.5, 2.0])
def test_two_rounds_equal_the_papers_algorithm_step_for_step(q):
    data = clients()
    p = process(q)
    state = p.initialize()
    expected = {k: v.astype(np.float64) for k, v in W0.items()}
    for _ in range(2):
        state, metrics = p.next(state, data)
        expected = np_q_fedavg_round(expected, data, q, LR)
        got = p.get_model_weights(state).trainable
        for k in W0:
            np.testing.assert_allclose(got[k], expected[k], rtol=2e-5, atol=2e-6)
    assert int(metrics["client_work"]["train"]["num_examples"]) == 18


def test_q_zero_is_unweighted_fed_avg():
    data = clients()
    fedavg = algorithms.build_unweighted_fed_avg(model_fn, optax.sgd(LR))
    expected = fedavg.get_model_weights(fedavg.next(fedavg.initialize(), data).state).trainable
    p = process(0.0)
    got = p.get_model_weights(p.next(p.initialize(), data).state).trainable
    for k in W0:
        np.testing.assert_allclose(got[k], expected[k], rtol=1e-5, atol=1e-6)


def test_a_larger_q_moves_the_model_towards_the_worst_client():
    data = clients()
    worst = data[2]

    def loss_after(q):
        p = process(q)
        w = p.get_model_weights(p.next(p.initialize(), data).state).trainable
        x = np.concatenate([b["x"] for b in worst])
        y = np.concatenate([b["y"] for b in worst])
        return np_loss_and_grad({k: v.astype(np.float64) for k, v in w.items()}, x, y)[0]

    assert loss_after(5.0) < loss_after(0.0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="q >= 0"):
        algorithms.build_q_fed_avg(model_fn, -1.0, LR)
    with pytest.raises(ValueError, match="client_learning_rate"):
        algorithms.build_q_fed_avg(model_fn, 1.0, 0.0)
    with pytest.raises(ValueError, match="lipschitz"):
        algorithms.build_q_fed_avg(model_fn, 1.0, LR, lipschitz=-2.0)
    with pytest.raises(TypeError, match="WeightedAggregationFactory"):
        algorithms.build_q_fed_avg(model_fn, 1.0, LR, model_aggregator=aggregators.MedianFactory())
