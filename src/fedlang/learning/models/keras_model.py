"""Keras 3 models (JAX backend) as fedlang models, and weight copies in and out.

Needs `pip install 'fedlang[keras]'`. Keras must run on JAX: importing fedlang sets
`KERAS_BACKEND=jax` when it is not set (Keras reads it when it is first imported), and
a Keras already imported with another backend raises an `ImportError` that says what
to set.

The model is used through `stateless_call(trainable, non_trainable, x, training)`, a
pure function: its variables are never mutated by training, and the weights travel as
lists of arrays in `ModelWeights(trainable, non_trainable)` (Keras's own order).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")

import jax
import jax.numpy as jnp
import keras
import numpy as np

from fedlang.learning import metrics as metrics_lib
from fedlang.learning.models import model as model_lib

if keras.backend.backend() != "jax":
    raise ImportError(
        f"Expected Keras on the JAX backend, found Keras already imported with the "
        f"{keras.backend.backend()!r} backend (KERAS_BACKEND={os.environ.get('KERAS_BACKEND')!r}). "
        "Start Python with the environment variable KERAS_BACKEND=jax (`export "
        "KERAS_BACKEND=jax`, or os.environ['KERAS_BACKEND'] = 'jax' before the first `import "
        "keras`), or import fedlang before keras."
    )


class KerasMetric(metrics_lib.Metric):
    """A Keras metric (whose variables are sums, e.g. `SparseCategoricalAccuracy`,
    `Mean`, `AUC`) as summed statistics, finalized with `stateless_result`."""

    def __init__(self, metric: keras.metrics.Metric):
        self.metric = metric
        self.name = metric.name
        self._zero = [np.zeros(v.shape, v.dtype) for v in metric.variables]

    def zero(self) -> metrics_lib.Stats:
        return [jnp.asarray(z) for z in self._zero]

    def accumulate(self, stats: metrics_lib.Stats, predictions: model_lib.Predictions, y: Any,
                   mask: model_lib.Mask) -> metrics_lib.Stats:
        weights = _per_element(mask, y)
        return list(self.metric.stateless_update_state(stats, y, predictions, sample_weight=weights))

    def finalize(self, stats: metrics_lib.Stats) -> Any:
        return self.metric.stateless_result(stats)


def _per_element(mask: model_lib.Mask, y: Any) -> jax.Array:
    """The per-example mask broadcast to the labels' shape (e.g. one label per token)."""
    y0 = jax.tree.leaves(y)[0]
    return jnp.broadcast_to(jnp.reshape(mask, (-1,) + (1,) * (y0.ndim - 1)), y0.shape)


def _metrics(metrics: Any) -> tuple[metrics_lib.Metric, ...]:
    if metrics is None:
        return ()
    if not isinstance(metrics, Sequence):
        metrics = [metrics]
    return metrics_lib.as_metrics(
        [KerasMetric(m) if isinstance(m, keras.metrics.Metric) else m for m in metrics]
    )


def _value(variable: Any) -> Any:
    """A variable's value as a NumPy array, or as it is when it is being traced (a model
    built inside a computation holds tracers, which cannot become NumPy arrays)."""
    value = variable.value
    try:
        return np.asarray(value)
    except jax.errors.TracerArrayConversionError:
        return value


def weights_from_keras_model(keras_model: keras.Model) -> model_lib.ModelWeights:
    """The model's current weights (e.g. after pretraining) as `ModelWeights`.

    The arrays are NumPy arrays, except for a model built inside a computation (a
    `jax_computation` calling `model_fn()`, as TFF's tutorials build models inside
    `tff.tf_computation`s), whose weights are that computation's traced values.

    Raises:
      TypeError: when `keras_model` is not a built Keras model.
    """
    _check_model(keras_model)
    return model_lib.ModelWeights(
        [_value(v) for v in keras_model.trainable_variables],
        [_value(v) for v in keras_model.non_trainable_variables],
    )


def assign_weights_to_keras_model(keras_model: keras.Model, weights: Any) -> None:
    """Copies `ModelWeights` (e.g. `process.get_model_weights(state)`) into `keras_model`.

    The argument order is TFF's (`tff.learning.assign_weights_to_keras_model(
    keras_model, weights)`).

    Raises:
      TypeError: when `keras_model` is not a built Keras model (e.g. the arguments
        are in the other order).
      ValueError: when the number or shapes of the weights do not match the model's.
    """
    if isinstance(weights, keras.Model) and not isinstance(keras_model, keras.Model):
        raise TypeError(
            f"Expected (keras_model, weights) as in TFF, found ({type(keras_model).__name__}, "
            f"{type(weights).__name__}). Swap the arguments: "
            "assign_weights_to_keras_model(keras_model, weights)."
        )
    _check_model(keras_model)
    w = model_lib.to_numpy_weights(weights)
    for part, variables, values in (
        ("trainable", keras_model.trainable_variables, w.trainable),
        ("non_trainable", keras_model.non_trainable_variables, w.non_trainable),
    ):
        values = list(values)
        if len(values) != len(variables):
            raise ValueError(
                f"Expected {len(variables)} {part} weights for {keras_model.name}, found {len(values)}."
            )
        for v, x in zip(variables, values):
            if tuple(v.shape) != tuple(np.shape(x)):
                raise ValueError(
                    f"Expected {part} weight {v.path} of shape {tuple(v.shape)}, found {np.shape(x)}."
                )
            v.assign(x)


def _check_model(keras_model: Any) -> None:
    if not isinstance(keras_model, keras.Model):
        raise TypeError(f"Expected a keras.Model, found {type(keras_model).__name__}.")
    if not keras_model.built or not keras_model.weights:
        raise TypeError(
            f"Expected a built Keras model (with weights), found {keras_model.name} unbuilt. Build "
            "it with keras.Input(...) in a Sequential/functional model, or call model.build(shape)."
        )


class KerasModel(model_lib.Model):
    """A fedlang model around a built Keras 3 model (see `from_keras_model`)."""

    def __init__(self, keras_model: keras.Model, loss: Any, input_spec: Any, metrics: Any = None):
        _check_model(keras_model)
        if not callable(loss):
            raise TypeError(
                "Expected loss to be a Keras loss (e.g. keras.losses.SparseCategoricalCrossentropy())"
                f" or a function (y_true, y_pred) -> loss, found {type(loss).__name__}."
            )
        self.keras_model = keras_model
        self._loss = loss
        self.input_spec = model_lib.check_input_spec(input_spec)
        self.metrics = _metrics(metrics)
        self._initial = weights_from_keras_model(keras_model)

    def initial_weights(self, rng: jax.Array) -> model_lib.ModelWeights:
        del rng  # the Keras model's own (e.g. pretrained) weights
        return model_lib.ModelWeights(
            [jnp.asarray(x) for x in self._initial.trainable],
            [jnp.asarray(x) for x in self._initial.non_trainable],
        )

    def apply(self, weights: model_lib.ModelWeights, x: Any,
              training: bool) -> tuple[model_lib.Predictions, model_lib.Params]:
        preds, nt = self.keras_model.stateless_call(
            list(weights.trainable), list(weights.non_trainable), x, training=training
        )
        return preds, list(nt)

    def loss(self, predictions: model_lib.Predictions, y: Any,
             mask: model_lib.Mask | None = None) -> jax.Array:
        if mask is None:
            return jnp.asarray(self._loss(y, predictions), jnp.float32)
        if isinstance(self._loss, keras.losses.Loss):
            weights = _per_element(mask, y)
            total = jnp.asarray(self._loss(y, predictions, sample_weight=weights), jnp.float32)
            if self._loss.reduction == "sum_over_batch_size":
                return total * weights.size / jnp.maximum(jnp.sum(weights), 1.0)
            return total
        values = jnp.asarray(self._loss(y, predictions), jnp.float32)
        if values.ndim == 0:
            return model_lib.masked_mean_loss(lambda p, t: self._loss(t, p), predictions, y, mask)
        values = metrics_lib.per_example_mean(values)
        return jnp.sum(values * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def from_keras_model(
    keras_model: keras.Model, loss: Any, input_spec: Any, metrics: Any = None
) -> KerasModel:
    """A fedlang model from a built Keras 3 model (Sequential, functional or subclassed).

    Trainable and non-trainable weights (BatchNorm statistics, RNG seed states) are kept
    apart; training runs `stateless_call(..., training=True)`, so BatchNorm statistics
    update on the clients and are averaged on the server. The process starts from the
    model's current weights: wrap a pretrained model to start from its weights.

    Args:
      keras_model: a built `keras.Model`.
      loss: a `keras.losses.Loss` or a function `(y_true, y_pred) -> loss`.
      input_spec: one batch: a struct with fields `x` and `y` (see `FunctionalModel`).
      metrics: Keras metrics (their variables are summed over clients, then
        `stateless_result` gives the value), fedlang `Metric`s, or functions.

    Returns:
      A `fedlang.learning.models.Model`.

    Raises:
      TypeError: for an unbuilt model, a bad loss or input spec.

    Example:
      >>> model = keras.Sequential([keras.Input((64,)), keras.layers.Dense(10)])
      >>> fl_model = from_keras_model(
      ...     model, keras.losses.SparseCategoricalCrossentropy(from_logits=True),
      ...     {'x': (np.float32, [None, 64]), 'y': (np.int32, [None])},
      ...     metrics=[keras.metrics.SparseCategoricalAccuracy(name='accuracy')])
      >>> print(fl_model.weights_type())
      <trainable=<float32[64,10],float32[10]>,non_trainable=<>>
    """
    return KerasModel(keras_model, loss, input_spec, metrics)
