"""Personalization evaluation: TFF 0.87's per-client results (tff_reference/) on every
runtime, the sampling beyond max_num_clients, and the strategy contract."""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models, personalization

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "tff_reference" / "tff_reference.json").read_text()
)["personalization_eval"]
INITIAL = {k: np.asarray(v, np.float32) for k, v in REFERENCE["initial"].items()}
WEIGHTS = models.ModelWeights(INITIAL, ())


def model_fn():
    """TFF's Dense(3) Keras model: logits = x @ kernel + bias."""
    return models.FunctionalModel(
        init_fn=lambda rng: {k: jnp.asarray(v) for k, v in INITIAL.items()},
        apply_fn=lambda p, x: x @ p["kernel"] + p["bias"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean(),
        input_spec={"x": (np.float32, [None, 3]), "y": (np.int32, [None])},
        metrics=[models.Accuracy()])


def batches(data, size):
    x, y = np.asarray(data["x"], np.float32), np.asarray(data["y"], np.int32)
    return [{"x": x[i:i + size], "y": y[i:i + size]} for i in range(0, len(y), size)]


def reference_inputs():
    size = REFERENCE["batch_size"]
    return [{"train_data": batches(c["train"], size), "test_data": batches(c["test"], size)}
            for c in REFERENCE["clients"]]


@functools.cache
def evaluation(max_num_clients=10):
    strategies = {name: personalization.finetune(optax.sgd(s["learning_rate"]), s["num_epochs"])
                  for name, s in REFERENCE["strategies"].items()}
    return algorithms.build_personalization_eval(model_fn, strategies, max_num_clients)


@pytest.mark.usefixtures("runtime")
def test_baseline_and_fine_tuned_metrics_per_client_equal_tff():
    got = evaluation()(WEIGHTS, reference_inputs())
    expected = REFERENCE["metrics"]
    assert list(got) == ["baseline_metrics", "sgd_1_epoch", "sgd_3_epochs"]
    for name, metrics in expected.items():
        for key, values in metrics.items():
            np.testing.assert_allclose(got[name][key], values, rtol=1e-5, atol=1e-6,
                                       err_msg=f"{name}/{key}")


def simple_client(n, seed):
    rng = np.random.default_rng(seed)
    data = {"x": rng.normal(size=(n, 3)).astype(np.float32),
            "y": rng.integers(0, 3, n).astype(np.int32)}
    return {"train_data": batches(data, 2), "test_data": batches(data, 2)}


@pytest.mark.usefixtures("runtime")
def test_beyond_max_num_clients_a_seeded_subset_is_collected_in_client_order():
    inputs = [simple_client(n, n) for n in (1, 2, 3, 4, 5)]  # told apart by num_examples
    got = evaluation(max_num_clients=3)(WEIGHTS, inputs)
    rows = np.sort(np.asarray(jax.random.choice(jax.random.key(0), 5, (3,), replace=False)))
    for name in got:
        np.testing.assert_array_equal(got[name]["num_examples"], rows + 1)


def test_a_strategy_with_no_epochs_reports_the_baseline_and_an_empty_cohort_nothing():
    evaluate = algorithms.build_personalization_eval(
        model_fn, {"none": personalization.finetune(optax.sgd(1.0), num_epochs=0)})
    got = evaluate(WEIGHTS, [simple_client(5, 0), simple_client(3, 1)])
    for key in got["baseline_metrics"]:
        np.testing.assert_array_equal(got["none"][key], got["baseline_metrics"][key])
    empty = evaluate(WEIGHTS, [])
    assert empty["baseline_metrics"]["loss"].shape == (0,)


class BiasOnly:
    """A user-written strategy: plain gradient steps on the bias alone."""

    num_epochs = 2

    def initial_state(self, model, weights):
        return weights

    def step(self, model, weights, batch, mask):
        def loss(bias):
            p = {**weights.trainable, "bias": bias}
            return model.loss(model.apply(models.ModelWeights(p, ()), batch["x"], True)[0],
                              batch["y"], mask)

        bias = weights.trainable["bias"] - 0.5 * jax.grad(loss)(weights.trainable["bias"])
        return models.ModelWeights({**weights.trainable, "bias": bias}, ())

    def weights(self, weights):
        return weights


def test_a_user_written_strategy_equals_fine_tuning_with_a_masked_optimizer():
    masked = optax.multi_transform({"train": optax.sgd(0.5), "freeze": optax.set_to_zero()},
                                   {"bias": "train", "kernel": "freeze"})
    evaluate = algorithms.build_personalization_eval(model_fn, {
        "mine": BiasOnly(), "masked": personalization.finetune(masked, num_epochs=2)})
    got = evaluate(WEIGHTS, [simple_client(5, 0), simple_client(4, 1)])
    np.testing.assert_allclose(got["mine"]["loss"], got["masked"]["loss"], rtol=1e-6)
    assert not np.allclose(got["mine"]["loss"], got["baseline_metrics"]["loss"])


def test_bad_arguments_say_what_to_pass():
    ft = personalization.finetune(optax.sgd(0.1))
    with pytest.raises(ValueError, match="baseline_metrics"):
        algorithms.build_personalization_eval(model_fn, {"baseline_metrics": ft})
    with pytest.raises(TypeError, match="personalization strategy"):
        algorithms.build_personalization_eval(model_fn, {"a": lambda: 6})
    with pytest.raises(TypeError, match="map names"):
        algorithms.build_personalization_eval(model_fn, [ft])
    with pytest.raises(ValueError, match="max_num_clients"):
        algorithms.build_personalization_eval(model_fn, {"a": ft}, max_num_clients=0)
    with pytest.raises(ValueError, match="num_epochs"):
        personalization.finetune(optax.sgd(0.1), num_epochs=-1)
