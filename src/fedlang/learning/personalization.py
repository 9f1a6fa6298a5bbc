"""Personalization strategies: how a client adapts the global model to its own data.

`fedlang.learning.algorithms.build_personalization_eval` evaluates each strategy on
each client (TFF's `build_personalization_eval_computation`). A strategy is JAX code
the runtimes run batch by batch, in three parts (the `PersonalizationStrategy`
Protocol): `initial_state(model, weights)`, `step(model, state, batch, mask)` applied
to each batch of the client's training data for `num_epochs` passes, and
`weights(state)`, the personalized weights then evaluated on the client's test data.

`finetune(optimizer, num_epochs)` is the usual strategy: local training of all the
trainable weights from the global ones (train fewer weights with an Optax mask, e.g.
`optax.multi_transform` or `optax.masked`).
"""

from __future__ import annotations

from typing import Any, Protocol, runtime_checkable

import jax
import jax.numpy as jnp

from fedlang.learning import client_works, optimizers
from fedlang.learning.models import model as model_lib

# A strategy's training state on one client: a pytree of arrays (`finetune`'s: the
# weights and the optimizer's state).
TrainingState = Any


@runtime_checkable
class PersonalizationStrategy(Protocol):
    """What `build_personalization_eval` uses of a strategy (all methods are JAX code).

    Attributes:
      num_epochs: passes over the client's training data (>= 0).
    """

    num_epochs: int

    def initial_state(
        self, model: model_lib.Model, weights: model_lib.ModelWeights
    ) -> TrainingState:
        """The training state, from the global weights (a pytree of arrays)."""

    def step(self, model: model_lib.Model, state: TrainingState, batch: model_lib.Batch,
             mask: model_lib.Mask) -> TrainingState:
        """One batch: `mask` is float32, one 0/1 per example (0 for padding); a batch of
        only padding must leave the state unchanged."""

    def weights(self, state: TrainingState) -> model_lib.ModelWeights:
        """The personalized weights held in `state`."""


class Finetune:
    """Fine-tuning: `num_epochs` passes of local training with `optimizer` (see `finetune`)."""

    def __init__(self, optimizer: optimizers.Optimizer, num_epochs: int = 1):
        self.optimizer = optimizers.as_optimizer_fn(optimizer, "optimizer")(jnp.int32(0))
        if isinstance(num_epochs, bool) or not isinstance(num_epochs, int) or num_epochs < 0:
            raise ValueError(f"Expected num_epochs to be an integer >= 0, found {num_epochs!r}.")
        self.num_epochs = num_epochs

    def initial_state(
        self, model: model_lib.Model, weights: model_lib.ModelWeights
    ) -> TrainingState:
        del model
        return weights, self.optimizer.init(weights.trainable)

    def step(self, model: model_lib.Model, state: TrainingState, batch: model_lib.Batch,
             mask: model_lib.Mask) -> TrainingState:
        weights, opt_state = state
        x, y, batch_mask = model_lib.batch_fields(batch)
        mask = model_lib.combine_masks(batch_mask, mask)

        new_weights, new_opt, _, _ = client_works.train_step(
            model, self.optimizer, weights, opt_state, x, y, mask)
        new = (new_weights, new_opt)
        keep = jnp.sum(mask) > 0
        return jax.tree.map(lambda a, b: jnp.where(keep, a, b), new, state)

    def weights(self, state: TrainingState) -> model_lib.ModelWeights:
        return state[0]

    def __repr__(self) -> str:
        return f"finetune({self.optimizer!r}, num_epochs={self.num_epochs})"


def finetune(optimizer: optimizers.Optimizer, num_epochs: int = 1) -> Finetune:
    """A strategy training the model on the client's training data, from the global weights.

    Args:
      optimizer: an Optax transformation (or a no-argument function returning one); a
        fresh state per client.
      num_epochs: passes over the client's training data (0: no training).

    Returns:
      A `PersonalizationStrategy`.

    Raises:
      TypeError: for an optimizer that is not one; ValueError: for a negative
        `num_epochs`.

    Example:
      >>> import optax
      >>> from fedlang.learning import personalization
      >>> personalization.finetune(optax.sgd(0.1), num_epochs=2).num_epochs
      2
    """
    return Finetune(optimizer, num_epochs)
