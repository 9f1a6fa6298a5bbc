"""Functional models: `init`, `apply`, `loss`, metrics and an `input_spec`.

A model is a value, not a container of variables: its weights are a `ModelWeights`
pytree passed in and out of pure functions, so the same model trains on a client, is
averaged on the server and is evaluated centrally without copies or mutation.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.backends.jax import computation as jax_computation
from fedlang.core import tff_names, types
from fedlang.learning import metrics as metrics_lib

# Names for the pytrees that models and algorithms pass around, as Optax names its
# `Params` and `Updates`: aliases of Any, for the reader.

# A pytree of arrays: one part of a model's weights (`ModelWeights.trainable` or
# `.non_trainable`), or a tree of the same structure.
Params = Any
# One batch of a client's data: a dict or namedtuple with fields `x`, `y` and optionally
# `mask`, or a pair `(x, y)` (see `batch_fields`).
Batch = Any
# float32, one entry per example of a batch: 1 where the example counts, 0 where it does
# not (the runtime's padding, or the batch's own `mask`).
Mask = Any
# What `Model.apply` returns for a batch's `x`, and what the loss and metrics take.
Predictions = Any


class ModelWeights(NamedTuple):
    """A model's weights: `trainable` (changed by the optimizer) and `non_trainable`.

    Non-trainable weights are what the model updates itself (BatchNorm statistics,
    random-number states); either part may be any pytree, `()` when empty.
    """

    trainable: Params
    non_trainable: Params = ()

    def __getattr__(self, name: str) -> Any:
        # Called only when normal lookup fails: TFF's spellings get fedlang's name.
        raise tff_names.missing(self, name, {
            "assign_weights_to": "models.assign_weights_to_keras_model(keras_model, weights) "
            "(the Keras model first)",
        })


def batch_fields(batch: Batch) -> tuple[Any, Any, Mask | None]:
    """`(x, y, mask)` of a batch, in the forms Keras accepts.

    A batch is a dict or namedtuple with fields `x`, `y` and an optional per-example
    `mask`, or a pair `(x, y)` (TFF's tutorials use both). The mask is float32 with
    one 0/1 entry per example, or None when absent; with it, runtimes may pad batches
    and mask the padding out.

    Raises:
      TypeError: when the batch is none of these.
    """
    if isinstance(batch, dict):
        get = batch.get
    elif types.is_namedtuple(batch):
        def get(k: str, default: Any = None) -> Any:
            return getattr(batch, k, default)
    elif isinstance(batch, tuple | list) and len(batch) == 2:
        return batch[0], batch[1], None
    else:
        raise TypeError(
            "Expected a batch as a dict or namedtuple with fields 'x' and 'y' (and optionally "
            f"'mask'), or a pair (x, y); found {types.describe(batch)}."
        )
    x, y, mask = get("x"), get("y"), get("mask")
    if x is None or y is None:
        raise TypeError("Expected a batch with fields 'x' and 'y' (as in TFF's tutorials).")
    return x, y, None if mask is None else jnp.asarray(mask).astype(jnp.float32)


def combine_masks(batch_mask: Mask | None, padding_mask: Mask) -> Mask:
    """The examples that count: the runtime's padding mask (from `dataset.reduce(...,
    masked=True)`) times the batch's own `mask` field when it has one."""
    if batch_mask is None:
        return padding_mask
    return batch_mask * padding_mask


class Model(abc.ABC):
    """The interface algorithms use. Subclass it, or build one with `FunctionalModel`,
    `from_keras_model` or `from_flax`.

    Attributes:
      input_spec: the fedlang type of one batch, a struct with fields `x` and `y` (and
        optionally a per-example `mask`).
      metrics: the `Metric`s reported besides the loss.
    """

    input_spec: types.Type
    metrics: tuple[metrics_lib.Metric, ...]

    @abc.abstractmethod
    def initial_weights(self, rng: jax.Array) -> ModelWeights:
        """Fresh weights from a JAX PRNG key (pure; called under tracing)."""

    @abc.abstractmethod
    def apply(self, weights: ModelWeights, x: Any, training: bool) -> tuple[Predictions, Params]:
        """`(predictions, new_non_trainable)` for inputs `x` (pure JAX)."""

    @abc.abstractmethod
    def loss(self, predictions: Predictions, y: Any, mask: Mask | None = None) -> jax.Array:
        """The mean loss over the batch, or over the examples where `mask` is 1 (a scalar)."""

    def weights_type(self) -> types.Type:
        """The fedlang type of `ModelWeights` (computed by tracing, without running)."""
        shapes = jax.eval_shape(self.initial_weights, jax.random.key(0))
        return types.to_type(_canonical(shapes))


def _canonical(tree: Params) -> Params:
    """Dicts with sorted keys, as every JAX tree operation returns them."""
    return jax.tree.map(lambda x: x, tree)


def check_input_spec(input_spec: Any) -> types.Type:
    """The type of one batch, with any batch dimension: checks the spec names `x` and `y`.

    Accepted: a struct with fields `x` and `y` (and optionally `mask`), or a pair
    `(x, y)`, of anything `fedlang.to_type` accepts, e.g. a dataset's `element_spec`.
    The leading (batch) dimension of every tensor becomes unknown (`?`): a spec taken
    from data batched with a fixed size (`batch(20, drop_remainder=True)`) describes
    batches of any size, so the last, smaller batch and the runtimes' padded batches
    fit it too.

    Raises:
      TypeError: when the spec is neither form, or has a 64-bit field while JAX runs
        in 32 bits (`check_32_bit`).
    """
    t = types.to_type(input_spec)
    named = isinstance(t, types.StructType) and {"x", "y"} <= set(t.names)
    pair = isinstance(t, types.StructType) and len(t) == 2 and t.names == (None, None)
    if not (named or pair):
        raise TypeError(
            "Expected input_spec to describe one batch as a struct with fields 'x' and 'y' or a "
            "pair (x, y), e.g. {'x': (np.float32, [None, 784]), 'y': (np.int32, [None])} or a "
            f"dataset's element_spec; found {t}."
        )
    t = _any_batch_size(t)
    check_32_bit(t)
    return t


def check_32_bit(input_spec: types.Type) -> None:
    """Checks that no field of `input_spec` is 64-bit while JAX runs in 32 bits.

    Tracing would fail later, in an inner computation's parameter; this names the
    field. TFF ports hit it first: TFF's ids and labels are `tf.int64`.

    Raises:
      TypeError: naming the field (e.g. `input_spec['y']`), its type and the 32-bit
        dtype to use.
    """
    for path, leaf in _leaves_with_paths(input_spec, "input_spec"):
        if not jax_computation.needs_x64(leaf):
            continue
        dt = cast(np.dtype, leaf.dtype)  # type: ignore[attr-defined]  # a tensor type's
        narrow = np.dtype(f"{dt.kind}{dt.itemsize // 2}").name
        tff = (f" (TFF's tf.{dt.name} becomes {narrow} in fedlang; see 'Coming from "
               "TensorFlow Federated' in fedlang's documentation)" if dt.kind in "iu" else "")
        raise TypeError(
            f"Expected 32-bit types in the model's input_spec (JAX runs in 32 bits), found "
            f"{path} of type {leaf}. Use {narrow}{tff}, or enable jax_enable_x64.")


def _leaves_with_paths(t: types.Type, path: str) -> list[tuple[str, types.Type]]:
    if not isinstance(t, types.StructType):
        return [(path, t)]
    return [leaf for i, (name, e) in enumerate(t.elements)
            for leaf in _leaves_with_paths(e, f"{path}[{name!r}]" if name else f"{path}[{i}]")]


def _any_batch_size(t: types.Type) -> types.Type:
    if isinstance(t, types.StructType):
        return types.StructType(
            [(n, _any_batch_size(e)) for n, e in t.elements], container=t.container
        )
    if isinstance(t, types.TensorType) and t.shape:
        return types.TensorType(t.dtype, (None, *t.shape[1:]))
    return t


def x_type(input_spec: types.Type) -> types.Type:
    """The type of the features `x` of a batch type from `check_input_spec`."""
    t = cast(types.StructType, input_spec)
    return t["x"] if "x" in t.names else t[0]


class FunctionalModel(Model):
    """A model from plain JAX functions.

    Args:
      init_fn: `init_fn(rng) -> params`, a pytree (all trainable) or a `ModelWeights`.
      apply_fn: `apply_fn(params, x) -> predictions`, where `params` is what `init_fn`
        returns (a pytree, or `ModelWeights`).
      loss_fn: `loss_fn(predictions, y) -> scalar`, the mean loss over the batch.
      input_spec: one batch: a struct with fields `x` and `y` of `fedlang.TensorType`s
        or anything `fedlang.to_type` accepts (e.g. `jax.ShapeDtypeStruct`s).
      metrics: `Metric`s, or functions `(predictions, y) -> per-example values`.

    Raises:
      TypeError: when the input spec has no `x` and `y`, or a metric is not a metric.

    Example:
      >>> import jax, jax.numpy as jnp, numpy as np, optax
      >>> from fedlang.learning import models
      >>> model = models.FunctionalModel(
      ...     init_fn=lambda rng: {'w': jnp.zeros([3, 2]), 'b': jnp.zeros([2])},
      ...     apply_fn=lambda p, x: x @ p['w'] + p['b'],
      ...     loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
      ...         logits, y).mean(),
      ...     input_spec={'x': (np.float32, [None, 3]), 'y': (np.int32, [None])},
      ...     metrics=[models.Accuracy()])
      >>> print(model.weights_type())
      <trainable=<b=float32[2],w=float32[3,2]>,non_trainable=<>>
    """

    def __init__(
        self,
        init_fn: Callable[[jax.Array], Params | ModelWeights],
        apply_fn: Callable[[Params | ModelWeights, Any], Predictions],
        loss_fn: Callable[[Predictions, Any], Any],
        input_spec: Any,
        metrics: Sequence[Any] | Any = (),
    ):
        for name, fn in (("init_fn", init_fn), ("apply_fn", apply_fn), ("loss_fn", loss_fn)):
            if not callable(fn):
                raise TypeError(f"Expected {name} to be a function, found {type(fn).__name__}.")
        self._init_fn, self._apply_fn, self._loss_fn = init_fn, apply_fn, loss_fn
        self.input_spec = check_input_spec(input_spec)
        self.metrics = metrics_lib.as_metrics(metrics)
        self._returns_model_weights: bool | None = None

    def initial_weights(self, rng: jax.Array) -> ModelWeights:
        params = self._init_fn(rng)
        self._returns_model_weights = isinstance(params, ModelWeights)
        if isinstance(params, ModelWeights):
            return ModelWeights(_canonical(params.trainable), _canonical(params.non_trainable))
        return ModelWeights(_canonical(params), ())

    def apply(self, weights: ModelWeights, x: Any, training: bool) -> tuple[Predictions, Params]:
        del training
        if self._returns_model_weights is None:
            self.weights_type()
        params = weights if self._returns_model_weights else weights.trainable
        return self._apply_fn(params, x), weights.non_trainable

    def loss(self, predictions: Predictions, y: Any, mask: Mask | None = None) -> jax.Array:
        return masked_mean_loss(self._loss_fn, predictions, y, mask)


def masked_mean_loss(
    loss_fn: Callable[[Predictions, Any], Any], predictions: Predictions, y: Any, mask: Mask | None
) -> jax.Array:
    """`loss_fn(predictions, y)` (a batch mean) restricted to the examples where `mask` is 1.

    Without a mask this is `loss_fn` itself; with one, the loss is taken per example
    (`loss_fn` on batches of one) and averaged over the unmasked examples.
    """
    if mask is None:
        return jnp.asarray(loss_fn(predictions, y), jnp.float32)
    per_example = jax.vmap(
        lambda p, t: loss_fn(jax.tree.map(lambda a: a[None], p), jax.tree.map(lambda a: a[None], t))
    )(predictions, y)
    return jnp.sum(per_example.astype(jnp.float32) * mask) / jnp.maximum(jnp.sum(mask), 1.0)


def to_numpy_weights(weights: Any) -> ModelWeights:
    """Any `(trainable, non_trainable)` pair of pytrees as a `ModelWeights` of NumPy arrays.

    Raises:
      TypeError: when `weights` has no `trainable` and `non_trainable` parts.
    """
    if not (hasattr(weights, "trainable") and hasattr(weights, "non_trainable")):
        raise TypeError(
            f"Expected ModelWeights(trainable, non_trainable), found {type(weights).__name__}."
        )
    return ModelWeights(
        jax.tree.map(np.asarray, weights.trainable), jax.tree.map(np.asarray, weights.non_trainable)
    )
