"""Flax Linen modules as fedlang models (`pip install 'fedlang[flax]'`).

The variables `module.init` returns are split: the `params` collection is trainable;
every other collection (`batch_stats`...) is non-trainable and, in training, updated
by `module.apply(..., mutable=...)`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax

from fedlang.aggregators import tools
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.models import model as model_lib


class FlaxModel(model_lib.Model):
    """A fedlang model around a Flax Linen module (see `from_flax`)."""

    def __init__(
        self, module: nn.Module, loss_fn: Callable[[model_lib.Predictions, Any], Any],
        input_spec: Any,
        metrics: Any = (), train_argument: str | None = "auto",
    ):
        if not isinstance(module, nn.Module):
            raise TypeError(f"Expected a flax.linen.Module, found {type(module).__name__}.")
        if not callable(loss_fn):
            raise TypeError(f"Expected loss_fn(predictions, y) -> loss, found {type(loss_fn).__name__}.")
        self.module = module
        self._loss_fn = loss_fn
        self.input_spec = model_lib.check_input_spec(input_spec)
        self.metrics = metrics_lib.as_metrics(metrics)
        if train_argument == "auto":
            params = inspect.signature(type(module).__call__).parameters
            train_argument = next((n for n in ("train", "training") if n in params), None)
        self._train_arg = train_argument

    def _kwargs(self, training: bool) -> dict[str, Any]:
        return {} if self._train_arg is None else {self._train_arg: training}

    def initial_weights(self, rng: jax.Array) -> model_lib.ModelWeights:
        x = tools.zeros(model_lib.x_type(self.input_spec), unknown_dim=1)  # to run init
        variables = dict(self.module.init(rng, x, **self._kwargs(False)))
        params = variables.pop("params", {})
        return model_lib.ModelWeights(
            model_lib._canonical(params), model_lib._canonical(dict(sorted(variables.items())))
        )

    def apply(self, weights: model_lib.ModelWeights, x: Any,
              training: bool) -> tuple[model_lib.Predictions, model_lib.Params]:
        nt = dict(weights.non_trainable) if weights.non_trainable else {}
        variables = {"params": weights.trainable, **nt}
        if training and nt:
            preds, updates = self.module.apply(
                variables, x, mutable=sorted(nt), **self._kwargs(True)
            )
            return preds, model_lib._canonical({**nt, **dict(updates)})
        return self.module.apply(variables, x, **self._kwargs(training)), weights.non_trainable

    def loss(self, predictions: model_lib.Predictions, y: Any,
             mask: model_lib.Mask | None = None) -> jax.Array:
        return model_lib.masked_mean_loss(self._loss_fn, predictions, y, mask)


def from_flax(
    module: nn.Module, loss_fn: Callable[[model_lib.Predictions, Any], Any], input_spec: Any,
    metrics: Any = (),
    *, train_argument: str | None = "auto",
) -> FlaxModel:
    """A fedlang model from a Flax Linen module.

    Args:
      module: a `flax.linen.Module`; `module.init(rng, x)` makes the weights.
      loss_fn: `loss_fn(predictions, y) -> scalar`, the batch mean (as for
        `FunctionalModel`).
      input_spec: one batch: a struct with fields `x` and `y`.
      metrics: `Metric`s or functions `(predictions, y) -> per-example values`.
      train_argument: the keyword of `__call__` saying whether it trains (e.g. for
        BatchNorm's `use_running_average=not train`); 'auto' finds `train` or
        `training` in the signature; None passes nothing.

    Returns:
      A `fedlang.learning.models.Model`.

    Raises:
      TypeError: when `module` is not a Linen module or the input spec has no `x`/`y`.
    """
    return FlaxModel(module, loss_fn, input_spec, metrics, train_argument)
