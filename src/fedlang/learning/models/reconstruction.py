"""Reconstruction models: a model whose weights are split into global and local parts.

Federated Reconstruction (Singhal et al., "Federated Reconstruction: Partially Local
Federated Learning", NeurIPS 2021; TFF's `tff.learning.models.ReconstructionModel`)
trains the *global* weights federatedly, while the *local* ones (a user's embedding,
a per-user bias) are reconstructed on each client from its own data every round and
never leave it. A `ReconstructionModel` is any fedlang model plus which entries of its
weights are local: keys of a dict (`{'item_embeddings': ..., 'user_embedding': ...}`)
or positions in a list (Keras's weight lists), separately for the trainable and the
non-trainable weights.

How a client's batches are used in each stage is a `DatasetSplit`
(`ReconstructionModel.build_dataset_split_fn(...)`, TFF's arguments).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Any, NamedTuple

import jax

from fedlang.core import types
from fedlang.learning.models import model as model_lib


class DatasetSplit(NamedTuple):
    """Which of a client's batches each stage uses (TFF's `build_dataset_split_fn`).

    Batches are numbered 0, 1, ... in the client's dataset. With `split_dataset`, even
    batches reconstruct and odd batches train (or evaluate); otherwise both stages use
    every batch. Each stage passes over the dataset `*_epochs` times and stops after
    `*_steps_max` batches in all (None: no limit).
    """

    recon_epochs: int = 1
    recon_steps_max: int | None = None
    post_recon_epochs: int = 1
    post_recon_steps_max: int | None = None
    split_dataset: bool = False


def _check_split(split: DatasetSplit) -> DatasetSplit:
    for name in ("recon_epochs", "post_recon_epochs"):
        v = getattr(split, name)
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"Expected {name} to be a positive integer, found {v!r}.")
    for name in ("recon_steps_max", "post_recon_steps_max"):
        v = getattr(split, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ValueError(f"Expected {name} to be None or a positive integer, found {v!r}.")
    return split


class _Partition:
    """Local entries of one weights container (a dict, list or tuple)."""

    def __init__(self, container: model_lib.Params, local: Sequence[Hashable], what: str):
        self.local = tuple(local)
        self.sequence_type: type = tuple
        if isinstance(container, dict):
            names = list(container)
            self.kind = "dict"
        elif isinstance(container, list | tuple):
            names = list(range(len(container)))
            self.kind, self.sequence_type = "list", type(container)
        else:
            raise TypeError(
                f"Expected the model's {what} weights to be a dict or a list to pick local "
                f"entries from, found {type(container).__name__}."
            )
        unknown = [k for k in self.local if k not in names]
        if unknown or len(set(self.local)) != len(self.local):
            raise ValueError(
                f"Expected local {what} entries among {names} (each once), found {list(local)}."
            )
        self.names = names
        self.global_names = [k for k in names if k not in self.local]

    def split(self, container: model_lib.Params) -> tuple[model_lib.Params, model_lib.Params]:
        if self.kind == "dict":
            return ({k: container[k] for k in self.global_names},
                    {k: container[k] for k in self.local})
        items: Any = list(container)
        seq = self.sequence_type
        return seq(items[i] for i in self.global_names), seq(items[i] for i in self.local)

    def merge(
        self, global_part: model_lib.Params, local_part: model_lib.Params
    ) -> model_lib.Params:
        if self.kind == "dict":
            return {**global_part, **local_part}
        by_index = dict(zip(self.global_names, global_part))
        by_index.update(zip(self.local, local_part))
        return self.sequence_type(by_index[i] for i in self.names)


class ReconstructionModel:
    """A model with local weights, reconstructed on each client (module docstring).

    Args:
      model: a `fedlang.learning.models.Model` (its loss, metrics and input spec are
        the reconstruction model's).
      local_trainable: the keys (dict weights) or positions (list weights) of the
        trainable weights that are local.
      local_non_trainable: the same for the non-trainable weights.

    Raises:
      TypeError: when `model` is not a model; ValueError: when a local entry does not
        exist (the message lists those that do).

    Example:
      >>> import jax.numpy as jnp, numpy as np, optax
      >>> from fedlang.learning import models
      >>> model = models.FunctionalModel(
      ...     init_fn=lambda rng: {'w': jnp.zeros([3, 2]), 'user_bias': jnp.zeros([2])},
      ...     apply_fn=lambda p, x: x @ p['w'] + p['user_bias'],
      ...     loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
      ...         logits, y).mean(),
      ...     input_spec={'x': (np.float32, [None, 3]), 'y': (np.int32, [None])})
      >>> recon = models.ReconstructionModel(model, local_trainable=['user_bias'])
      >>> print(recon.global_weights_type())
      <trainable=<w=float32[3,2]>,non_trainable=<>>
    """

    def __init__(
        self,
        model: model_lib.Model,
        local_trainable: Sequence[Hashable] = (),
        local_non_trainable: Sequence[Hashable] = (),
    ):
        if not isinstance(model, model_lib.Model):
            raise TypeError(
                "Expected a fedlang.learning.models.Model (FunctionalModel, from_keras_model, "
                f"from_flax), found {type(model).__name__}."
            )
        self.model = model
        self.input_spec = model.input_spec
        self.metrics = model.metrics
        shapes = jax.eval_shape(model.initial_weights, jax.random.key(0))
        self._trainable = _Partition(shapes.trainable, local_trainable, "trainable")
        self._non_trainable = _Partition(shapes.non_trainable, local_non_trainable, "non-trainable")

    def split(self, weights: model_lib.ModelWeights) -> tuple[
            model_lib.ModelWeights, model_lib.ModelWeights]:
        """`(global, local)` parts of full weights, each a `ModelWeights`."""
        gt, lt = self._trainable.split(weights.trainable)
        gn, ln = self._non_trainable.split(weights.non_trainable)
        return model_lib.ModelWeights(gt, gn), model_lib.ModelWeights(lt, ln)

    def split_non_trainable(
        self, non_trainable: model_lib.Params
    ) -> tuple[model_lib.Params, model_lib.Params]:
        """`(global, local)` parts of the non-trainable weights (what `apply` returns)."""
        return self._non_trainable.split(non_trainable)

    def merge(self, global_weights: model_lib.ModelWeights,
              local_weights: model_lib.ModelWeights) -> model_lib.ModelWeights:
        """The full weights from their global and local parts."""
        return model_lib.ModelWeights(
            self._trainable.merge(global_weights.trainable, local_weights.trainable),
            self._non_trainable.merge(global_weights.non_trainable, local_weights.non_trainable),
        )

    def has_local_trainable(self) -> bool:
        """Whether there is anything to reconstruct (TFF skips reconstruction otherwise)."""
        return bool(self._trainable.local)

    def global_weights_type(self) -> types.Type:
        """The fedlang type of the global `ModelWeights` (what the server holds)."""
        shapes = jax.eval_shape(lambda k: self.split(self.model.initial_weights(k))[0],
                                jax.random.key(0))
        return types.to_type(shapes)

    @classmethod
    def from_keras_model_and_layers(
        cls,
        keras_model: Any,
        *,
        global_layers: Sequence[Any],
        local_layers: Sequence[Any],
        loss: Any,
        input_spec: Any,
        metrics: Any = None,
    ) -> ReconstructionModel:
        """TFF's `ReconstructionModel.from_keras_model_and_layers`, for a built Keras 3
        model (`pip install 'fedlang[keras]'`): the variables of `local_layers` are local.

        Args:
          keras_model: a built Keras model (see `models.from_keras_model`).
          global_layers, local_layers: its layers; every variable of the model must be in
            exactly one of the two groups (as TFF checks).
          loss, input_spec, metrics: as for `models.from_keras_model`.

        Raises:
          ValueError: when a layer's variables are not the model's, a variable is in both
            groups or in neither.
        """
        from fedlang.learning.models import keras_model as keras_lib

        model = keras_lib.from_keras_model(keras_model, loss, input_spec, metrics)
        local: dict[str, list[int]] = {}
        for kind in ("trainable", "non_trainable"):
            variables = getattr(keras_model, f"{kind}_variables")
            position = {id(v): i for i, v in enumerate(variables)}
            groups = {}
            for group, layers in (("global", global_layers), ("local", local_layers)):
                found = [v for layer in layers for v in getattr(layer, f"{kind}_variables")]
                missing = [v.path for v in found if id(v) not in position]
                if missing:
                    raise ValueError(
                        f"Expected the {group} layers to be keras_model's layers, found "
                        f"{kind} variables that are not the model's: {missing}.")
                groups[group] = {position[id(v)] for v in found}
            both = groups["global"] & groups["local"]
            neither = set(range(len(variables))) - groups["global"] - groups["local"]
            if both or neither:
                names = [variables[i].path for i in sorted(both or neither)]
                raise ValueError(
                    f"Expected every {kind} variable in exactly one of global_layers and "
                    f"local_layers, found {names} in {'both' if both else 'neither'}.")
            local[kind] = sorted(groups["local"])
        return cls(model, local_trainable=local["trainable"],
                   local_non_trainable=local["non_trainable"])

    @staticmethod
    def build_dataset_split_fn(
        recon_epochs: int = 1,
        recon_steps_max: int | None = None,
        post_recon_epochs: int = 1,
        post_recon_steps_max: int | None = None,
        split_dataset: bool = False,
    ) -> DatasetSplit:
        """TFF's `ReconstructionModel.build_dataset_split_fn`, as a `DatasetSplit`.

        Raises:
          ValueError: for epochs below 1 or step limits below 1.
        """
        return _check_split(DatasetSplit(recon_epochs, recon_steps_max, post_recon_epochs,
                                         post_recon_steps_max, bool(split_dataset)))

    # TFF's simple_dataset_split_fn: both stages use all the client's data, once.
    simple_dataset_split_fn = DatasetSplit()


def check_dataset_split(split: Any) -> DatasetSplit:
    """`split` if it is a valid `DatasetSplit`.

    Raises:
      TypeError: for anything else (a TFF-style function of a dataset cannot run on a
        fedlang client dataset, which is consumed by a reduce); ValueError: for bad values.
    """
    if not isinstance(split, DatasetSplit):
        raise TypeError(
            "Expected dataset_split_fn to be a DatasetSplit made by "
            "ReconstructionModel.build_dataset_split_fn(...) (or "
            "ReconstructionModel.simple_dataset_split_fn), found "
            f"{type(split).__name__}. A function of a dataset cannot run on fedlang's client "
            "datasets, which are consumed batch by batch."
        )
    return _check_split(split)
