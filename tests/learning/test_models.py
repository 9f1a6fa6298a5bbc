"""Model adapters: Keras, Flax and plain JAX train to the same weights; weight copies."""

import os

os.environ.setdefault("KERAS_BACKEND", "jax")

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models

try:  # Keras is an extra: its tests skip where it is not installed (the GPU check machine)
    import keras
except ImportError:
    keras = None
needs_keras = pytest.mark.skipif(keras is None, reason="Keras is not installed")

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
        m, models.ModelWeights([KERNEL1, BIAS1, KERNEL2, BIAS2], []))
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


@needs_keras
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


@needs_keras
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
    models.assign_weights_to_keras_model(target, weights)
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


@needs_keras
def test_bad_inputs_fail_with_expected_found():
    with pytest.raises(TypeError, match=r"Expected input_spec to describe one batch"):
        models.FunctionalModel(lambda r: {}, lambda p, x: x, xent, {"features": np.float32})
    with pytest.raises(TypeError, match=r"Expected a built Keras model"):
        models.from_keras_model(keras.Sequential([keras.layers.Dense(2)]), xent, SPEC)
    with pytest.raises(ValueError, match=r"Expected 4 trainable weights"):
        models.assign_weights_to_keras_model(keras_model(), models.ModelWeights([KERNEL1], []))
    with pytest.raises(TypeError, match=r"Expected model_fn to be a no-argument function"):
        algorithms.build_weighted_fed_avg(jax_fn(), optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"Expected client_weighting"):
        algorithms.build_weighted_fed_avg(jax_fn, optax.sgd(0.1), client_weighting="bytes")


# -- a TFF user's first day (issue 16, items 1-6) -------------------------------------------

XS = RNG.normal(size=(10, 4)).astype(np.float32)
YS = RNG.integers(0, 3, 10).astype(np.int32)


def _linear(input_spec):
    return lambda: models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.asarray(KERNEL1[:, :3])},
        apply_fn=lambda p, x: x @ p["w"], loss_fn=xent, input_spec=input_spec,
        metrics=[models.Accuracy()])


def test_an_element_spec_with_a_fixed_batch_size_trains_and_evaluates():
    # arrange: TFF's habit, input_spec=dataset.element_spec after batch(drop_remainder=True)
    from fedlang.simulation import Dataset

    ds = Dataset.from_tensor_slices({"x": XS, "y": YS}).batch(4, drop_remainder=True)
    assert str(ds.element_spec) == "<x=float32[4,4],y=int32[4]>"
    model_fn = _linear(ds.element_spec)
    # act: training and evaluation, with a last batch of another size too
    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1))
    out = process.next(process.initialize(), [ds, Dataset.from_tensor_slices({"x": XS, "y": YS}).batch(3)])
    evaluator = algorithms.build_fed_eval(model_fn)
    evaluated = evaluator.next(evaluator.initialize(), [ds])
    # assert
    assert str(model_fn().input_spec) == "<x=float32[?,4],y=int32[?]>"
    assert int(out.metrics["client_work"]["train"]["num_examples"]) == 8 + 10
    assert int(evaluated.metrics["client_work"]["eval"]["current_round_metrics"]["num_examples"]) == 8


def test_tuple_batches_train_like_dict_batches():
    # arrange: (x, y) pairs, as two of TFF's four tutorials batch them
    from fedlang.simulation import Dataset

    pairs = Dataset.from_tensor_slices((XS, YS)).batch(5)
    dicts = [{"x": XS[i:i + 5], "y": YS[i:i + 5]} for i in (0, 5)]
    # act
    tuple_process = algorithms.build_weighted_fed_avg(_linear(pairs.element_spec), optax.sgd(0.1))
    dict_process = algorithms.build_weighted_fed_avg(_linear(SPEC), optax.sgd(0.1))
    a = tuple_process.next(tuple_process.initialize(), [pairs])
    b = dict_process.next(dict_process.initialize(), [dicts])
    # assert
    np.testing.assert_allclose(tuple_process.get_model_weights(a.state).trainable["w"],
                               dict_process.get_model_weights(b.state).trainable["w"], rtol=1e-6)
    with pytest.raises(TypeError, match=r"or a pair \(x, y\)"):
        models.FunctionalModel(lambda r: {}, lambda p, x: x, xent, ((np.float32, [None, 4]),) * 3)


@needs_keras
def test_a_keras_model_built_inside_a_computation():
    # TFF's tutorials call model_fn() inside computations; Keras's weights are then traced.
    import jax

    import fedlang as fl

    def model_fn():
        m = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3)])
        return models.from_keras_model(
            m, keras.losses.SparseCategoricalCrossentropy(from_logits=True), SPEC)

    @fl.jax_computation()
    def initial_weights():
        return model_fn().initial_weights(jax.random.key(0))

    weights = initial_weights()
    assert [np.shape(w) for w in weights.trainable] == [(4, 3), (3,)]


def test_importing_fedlang_chooses_the_jax_backend_for_a_later_keras_import(monkeypatch):
    import importlib

    from fedlang.learning import models as models_module

    monkeypatch.delenv("KERAS_BACKEND")
    importlib.reload(models_module)
    assert os.environ["KERAS_BACKEND"] == "jax"
    monkeypatch.setenv("KERAS_BACKEND", "numpy")
    importlib.reload(models_module)
    assert os.environ["KERAS_BACKEND"] == "numpy"  # an explicit choice is respected


@needs_keras
@pytest.mark.slow
def test_keras_imported_before_fedlang_works_or_names_what_to_set():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "KERAS_BACKEND"}
    first = subprocess.run(
        [sys.executable, "-c", "import fedlang, keras; print(keras.backend.backend())"],
        capture_output=True, text=True, timeout=120, env=env)
    assert first.returncode == 0, first.stderr[-500:]
    assert first.stdout.strip() == "jax"
    other = subprocess.run(
        [sys.executable, "-c", "import keras, fedlang\n"
         "from fedlang.learning import models\n"
         "models.from_keras_model(keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)]), "
         "None, {'x': ('float32', [None, 2]), 'y': ('int32', [None])})"],
        capture_output=True, text=True, timeout=120, env={**env, "KERAS_BACKEND": "numpy"})
    assert other.returncode != 0
    assert "found Keras already imported with the 'numpy' backend" in other.stderr
    assert "KERAS_BACKEND=jax" in other.stderr


@needs_keras
def test_assign_weights_to_keras_model_takes_tff_argument_order():
    m = keras_model()
    weights = models.ModelWeights([KERNEL1, BIAS1, KERNEL2, BIAS2], [])
    models.assign_weights_to_keras_model(m, weights)
    np.testing.assert_array_equal(np.asarray(m.trainable_variables[0].value), KERNEL1)
    with pytest.raises(TypeError, match=r"Swap the arguments"):
        models.assign_weights_to_keras_model(weights, m)


def test_tffs_assign_weights_to_is_answered_with_fedlangs():
    weights = models.ModelWeights({"w": np.zeros(2)}, ())
    with pytest.raises(AttributeError, match=r"'assign_weights_to' \(TFF's spelling\); fedlang's is "
                                             r"models.assign_weights_to_keras_model\(keras_model, weights\)"):
        weights.assign_weights_to(None)
    assert weights._replace(non_trainable=1).non_trainable == 1  # a NamedTuple still


# -- a newcomer's first hour (issue 37) ---------------------------------------------------

TFF_SPEC = {"x": (np.float32, [None, 4]), "y": (np.int64, [None, 1])}  # TFF's tf.int64 labels
TFF_INT64 = (
    "Expected 32-bit types in the model's input_spec (JAX runs in 32 bits), found "
    "input_spec['y'] of type int64[?,1]. Use int32 (TFF's tf.int64 becomes int32 in fedlang; "
    "see 'Coming from TensorFlow Federated' in fedlang's documentation), or enable "
    "jax_enable_x64.")


def test_a_64_bit_input_spec_field_is_named_not_an_inner_computation():
    # TFF ports failed in tracing: "client_update's parameter has a 64-bit type int64[?,1]"
    with pytest.raises(TypeError) as e:
        algorithms.build_weighted_fed_avg(_linear(TFF_SPEC), optax.sgd(0.1))
    assert str(e.value) == TFF_INT64
    with pytest.raises(TypeError, match=r"found input_spec\['x'\] of type float64\[\?,4\]\. Use "
                                        r"float32, or enable jax_enable_x64\.$"):
        _linear({"x": (np.float64, [None, 4]), "y": (np.int32, [None])})()
    with pytest.raises(TypeError, match=r"found input_spec\[1\] of type uint64\[\?\]\. Use uint32 "):
        _linear(((np.float32, [None, 4]), (np.uint64, [None])))()


def test_a_64_bit_input_spec_is_taken_with_64_bit_jax():
    import jax

    with jax.enable_x64(True):
        assert str(_linear(TFF_SPEC)().input_spec) == "<x=float32[?,4],y=int64[?,1]>"


@needs_keras
def test_a_tff_reconstruction_port_with_int64_ids_names_the_field():
    # TFF's reconstruction tutorial: int64 item ids in, a user embedding kept on clients
    item_ids = keras.Input((1,), dtype="int32")
    items = keras.layers.Flatten()(keras.layers.Embedding(5, 2, name="items")(item_ids))
    users = keras.layers.Dense(2, name="user")(items)
    keras_model = keras.Model(item_ids, keras.layers.Dot(1)([items, users]))
    spec = {"x": (np.int64, [None, 1]), "y": (np.float32, [None, 1])}

    def recon_fn():
        return models.ReconstructionModel.from_keras_model_and_layers(
            keras_model, global_layers=[keras_model.get_layer("items")],
            local_layers=[keras_model.get_layer("user")], loss=keras.losses.MeanSquaredError(),
            input_spec=spec)

    with pytest.raises(TypeError, match=r"found input_spec\['x'\] of type int64\[\?,1\]\. Use "
                                        r"int32 \(TFF's tf\.int64 becomes int32 in fedlang"):
        algorithms.build_fed_recon(recon_fn)
