"""Model adapters: Keras, Flax and plain JAX train to the same weights; weight copies."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import flax.linen as nn
import jax.numpy as jnp
import keras
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models

SPEC = {"x": (np.float32, [None, 4]), "y": (np.int32, [None])}
RNG = np.random.default_rng(0)
KERNEL1, BIAS1 = RNG.normal(size=(4, 5)).astype(np.float32) * 0.5, np.zeros(5, np.float32)
KERNEL2, BIAS2 = RNG.normal(size=(5, 3)).astype(np.float32) * 0.5, np.full(3, 0.1, np.float32)
DATA = [
    [{"x": RNG.normal(size=(6, 4)).astype(np.float32), "y": RNG.integers(0, 3, 6).astype(np.int32)}
     for _ in range(k)]
    for k in (2, 1)
]


def xent(logits, y):
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def keras_model():
    inputs = keras.Input((4,))
    hidden = keras.layers.Dense(5, activation="relu")(inputs)
    return keras.Model(inputs, keras.layers.Dense(3)(hidden))  # the functional API


class FlaxMLP(nn.Module):
    @nn.compact
    def __call__(self, x):
        hidden = nn.relu(nn.Dense(5)(x))
        return nn.Dense(3)(hidden)


def jax_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"k1": jnp.asarray(KERNEL1), "b1": jnp.asarray(BIAS1),
                             "k2": jnp.asarray(KERNEL2), "b2": jnp.asarray(BIAS2)},
        apply_fn=lambda p, x: jnp.maximum(x @ p["k1"] + p["b1"], 0) @ p["k2"] + p["b2"],
        loss_fn=xent, input_spec=SPEC)


def keras_fn():
    m = keras_model()
    models.assign_weights_to_keras_model(
        models.ModelWeights([KERNEL1, BIAS1, KERNEL2, BIAS2], []), m)
    return models.from_keras_model(
        m, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SPEC,
        metrics=[keras.metrics.SparseCategoricalAccuracy(name="accuracy")])


def flax_fn():
    return models.from_flax(FlaxMLP(), xent, SPEC, metrics=[models.Accuracy()])


def train(model_fn, initial=None):
    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.3))
    state = process.initialize()
    if initial is not None:
        state = process.set_model_weights(state, initial)
    for _ in range(2):
        state, metrics = process.next(state, DATA)
    return process.get_model_weights(state), metrics["client_work"]["train"]


def test_keras_flax_and_jax_train_to_the_same_weights():
    jax_w, jax_m = train(jax_fn)
    keras_w, keras_m = train(keras_fn)
    flax_initial = models.ModelWeights(
        {"Dense_0": {"bias": BIAS1, "kernel": KERNEL1}, "Dense_1": {"bias": BIAS2, "kernel": KERNEL2}}, {})
    flax_w, flax_m = train(flax_fn, flax_initial)
    expected = [jax_w.trainable[k] for k in ("k1", "b1", "k2", "b2")]
    flax_list = [flax_w.trainable["Dense_0"]["kernel"], flax_w.trainable["Dense_0"]["bias"],
                 flax_w.trainable["Dense_1"]["kernel"], flax_w.trainable["Dense_1"]["bias"]]
    for a, b, c in zip(expected, keras_w.trainable, flax_list):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(c, a, rtol=1e-5, atol=1e-6)
    for m in (keras_m, flax_m):
        np.testing.assert_allclose(m["loss"], jax_m["loss"], rtol=1e-5)
    np.testing.assert_allclose(keras_m["accuracy"], flax_m["accuracy"])


def test_keras_batchnorm_statistics_are_trained_and_copied_back():
    def fn():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(5),
                              keras.layers.BatchNormalization(), keras.layers.Dense(3)])
        return models.from_keras_model(
            m, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SPEC)

    model = fn()
    assert str(model.weights_type()).endswith("non_trainable=<float32[5],float32[5]>>")
    weights, _ = train(fn)
    moving_mean, moving_var = weights.non_trainable
    assert np.all(moving_mean != 0) and np.all(moving_var != 1)
    target = fn().keras_model
    models.assign_weights_to_keras_model(weights, target)
    np.testing.assert_allclose(np.asarray(target.non_trainable_variables[0].value), moving_mean)
    np.testing.assert_allclose(models.weights_from_keras_model(target).trainable[0],
                               weights.trainable[0])


def test_flax_batch_stats_are_non_trainable():
    class BN(nn.Module):
        @nn.compact
        def __call__(self, x, train=False):
            return nn.Dense(3)(nn.BatchNorm(use_running_average=not train)(x))

    model = models.from_flax(BN(), xent, SPEC)
    assert "non_trainable=<batch_stats=<BatchNorm_0=<mean=float32[4],var=float32[4]>>>" in str(
        model.weights_type())


def test_bad_inputs_fail_with_expected_found():
    with pytest.raises(TypeError, match=r"Expected input_spec to describe one batch"):
        models.FunctionalModel(lambda r: {}, lambda p, x: x, xent, {"features": np.float32})
    with pytest.raises(TypeError, match=r"Expected a built Keras model"):
        models.from_keras_model(keras.Sequential([keras.layers.Dense(2)]), xent, SPEC)
    with pytest.raises(ValueError, match=r"Expected 4 trainable weights"):
        models.assign_weights_to_keras_model(models.ModelWeights([KERNEL1], []), keras_model())
    with pytest.raises(TypeError, match=r"Expected model_fn to be a no-argument function"):
        algorithms.build_weighted_fed_avg(jax_fn(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"Expected client_weighting"):
        algorithms.build_weighted_fed_avg(jax_fn, optax.sgd(0.1), client_weighting="bytes")
