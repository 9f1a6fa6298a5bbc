"""Algorithm correctness against centralized JAX math, on the runtime
sample (tests/conftest.py)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, evaluation, models

pytestmark = pytest.mark.usefixtures("runtime")

SPEC = {"x": (np.float32, [None, 3]), "y": (np.int32, [None])}
W0 = {"b": np.array([0.1, -0.2, 0.05], np.float32),
      "w": np.linspace(-0.5, 0.5, 9, dtype=np.float32).reshape(3, 3)}


def loss_fn(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {k: jnp.asarray(v) for k, v in W0.items()},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=loss_fn,
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


def batch(n, seed):
    r = np.random.default_rng(seed)
    return {"x": r.normal(size=(n, 3)).astype(np.float32), "y": r.integers(0, 3, n).astype(np.int32)}


def central_loss(params, data):
    return loss_fn(data["x"] @ params["w"] + params["b"], data["y"])


def sgd_step(params, b, lr):
    g = jax.grad(central_loss)(params, b)
    return {k: params[k] - lr * g[k] for k in params}


def union(*batches):
    return {k: np.concatenate([b[k] for b in batches]) for k in ("x", "y")}


# Processes are runtime-independent: build each once for the whole module.
@functools.cache
def process(name):
    builders = {
        "fedavg": lambda: algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5)),
        "unweighted": lambda: algorithms.build_unweighted_fed_avg(model_fn, optax.sgd(0.5)),
        "fedsgd": lambda: algorithms.build_fed_sgd(model_fn, optax.sgd(0.5)),
        "mime_sgd": lambda: algorithms.build_mime_lite(model_fn, optax.sgd(0.5)),
        "fedprox0": lambda: algorithms.build_fed_prox(model_fn, 0.0, optax.sgd(0.5)),
        "eval": lambda: algorithms.build_fed_eval(model_fn),
    }
    return builders[name]()


def run_round(name, data):
    p = process(name)
    out = p.next(p.initialize(), data)
    return p.get_model_weights(out.state).trainable, out.metrics


def assert_tree_close(a, b, **kw):
    for k in b:
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6, **kw)


def test_fed_avg_one_client_one_step_is_one_sgd_step():
    b = batch(8, 0)
    weights, metrics = run_round("fedavg", [[b]])
    assert_tree_close(weights, sgd_step(W0, b, 0.5))
    train = metrics["client_work"]["train"]
    assert int(train["num_examples"]) == 8 and int(train["num_batches"]) == 1
    np.testing.assert_allclose(train["loss"], central_loss(W0, b), rtol=1e-5)


def test_fed_sgd_with_the_whole_cohort_is_one_large_batch_sgd_step():
    batches = [batch(4, 1), batch(7, 2), batch(2, 3)]
    data = [[b] for b in batches]
    weights, metrics = run_round("fedsgd", data)
    assert_tree_close(weights, sgd_step(W0, union(*batches), 0.5))
    assert int(metrics["client_work"]["train"]["num_examples"]) == 13


def test_weighted_and_unweighted_fed_avg_differ_exactly_as_defined():
    b1, b2 = batch(2, 4), batch(10, 5)
    client = [sgd_step(W0, b1, 0.5), sgd_step(W0, b2, 0.5)]
    weighted, _ = run_round("fedavg", [[b1], [b2]])
    unweighted, _ = run_round("unweighted", [[b1], [b2]])
    assert_tree_close(weighted, {k: (2 * client[0][k] + 10 * client[1][k]) / 12 for k in W0})
    assert_tree_close(unweighted, {k: (client[0][k] + client[1][k]) / 2 for k in W0})


def test_training_metrics_are_summed_then_finalized_over_examples():
    b1, b2 = batch(3, 6), batch(9, 7)
    _, metrics = run_round("fedavg", [[b1], [b2]])
    train = metrics["client_work"]["train"]
    u = union(b1, b2)
    logits = u["x"] @ W0["w"] + W0["b"]
    per_example = optax.softmax_cross_entropy_with_integer_labels(logits, u["y"])
    np.testing.assert_allclose(train["loss"], per_example.mean(), rtol=1e-5)
    np.testing.assert_allclose(train["accuracy"], np.mean(np.argmax(logits, -1) == u["y"]), rtol=1e-6)
    assert int(train["num_examples"]) == 12


def test_a_non_finite_client_is_excluded_and_counted():
    good, bad = batch(5, 8), batch(4, 9)
    bad = {"x": np.full_like(bad["x"], np.nan), "y": bad["y"]}
    weights, metrics = run_round("fedavg", [[good], [bad]])
    assert_tree_close(weights, sgd_step(W0, good, 0.5))
    diag = metrics["client_work"]["diagnostics"]
    assert int(diag["num_nonfinite"]) == 1 and int(diag["num_clients"]) == 2
    assert int(metrics["client_work"]["train"]["num_examples"]) == 5
    assert np.isfinite(metrics["client_work"]["train"]["loss"])


def test_all_clients_non_finite_keeps_the_model():
    bad = {"x": np.full([3, 3], np.inf, np.float32), "y": np.zeros([3], np.int32)}
    weights, metrics = run_round("fedavg", [[bad]])
    assert_tree_close(weights, W0)
    assert int(metrics["client_work"]["diagnostics"]["num_nonfinite"]) == 1


def test_mime_lite_with_stateless_sgd_equals_fed_avg_and_fed_prox_zero_too():
    data = [[batch(4, 10), batch(4, 11)], [batch(6, 12)]]
    fedavg, _ = run_round("fedavg", data)
    assert_tree_close(run_round("mime_sgd", data)[0], fedavg)
    assert_tree_close(run_round("fedprox0", data)[0], fedavg)


def test_fed_eval_equals_centralized_evaluation_of_the_union():
    b1, b2 = batch(3, 13), batch(5, 14)
    _, metrics = run_round("eval", [[b1], [b2]])
    current = metrics["client_work"]["eval"]["current_round_metrics"]
    central = evaluation.evaluate(model_fn(), models.ModelWeights(W0, ()), [union(b1, b2)])
    for k in ("loss", "accuracy"):
        np.testing.assert_allclose(current[k], central[k], rtol=1e-5)
    assert int(current["num_examples"]) == int(central["num_examples"]) == 8
