"""Metrics as summed statistics: empty batches count as nothing."""

import jax.numpy as jnp
import numpy as np
import optax

from fedlang.learning import algorithms, models

SPEC = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}
BATCH = {"x": np.array([[1, 2], [0, 1], [1, 0]], np.float32), "y": np.array([0, 1, 1], np.int32)}
EMPTY = {"x": np.zeros([0, 2], np.float32), "y": np.zeros([0], np.int32)}


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.eye(2, dtype=jnp.float32)},
        apply_fn=lambda p, x: x @ p["w"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC, metrics=[models.Accuracy(), models.MeanMetric(
            lambda p, y: jnp.abs(p[:, 0] - y.astype(jnp.float32)), name="gap")])


def test_a_batch_of_zero_examples_changes_no_metric():
    evaluator = algorithms.build_fed_eval(model_fn)
    state = evaluator.initialize()
    with_empty = evaluator.next(state, [[BATCH, EMPTY], [EMPTY]]).metrics
    without = evaluator.next(state, [[BATCH]]).metrics
    a = with_empty["client_work"]["eval"]["current_round_metrics"]
    b = without["client_work"]["eval"]["current_round_metrics"]
    for key in ("loss", "accuracy", "gap", "num_examples", "num_batches"):
        np.testing.assert_allclose(a[key], b[key], rtol=1e-6, err_msg=key)
    assert float(a["accuracy"]) == np.float32(1 / 3)  # only [0, 1] -> 1 is right
