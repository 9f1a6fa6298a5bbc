"""Models: functional (`init`, `apply`, `loss`, metrics, `input_spec`) and adapters.

`from_keras_model` needs `pip install 'fedlang[keras]'` (Keras 3, JAX backend) and
`from_flax` needs `pip install 'fedlang[flax]'`; both are imported only when called.
"""

import os
from typing import Any

from fedlang.learning.metrics import Accuracy as Accuracy
from fedlang.learning.metrics import MeanMetric as MeanMetric
from fedlang.learning.metrics import Metric as Metric
from fedlang.learning.models.model import FunctionalModel as FunctionalModel
from fedlang.learning.models.model import Model as Model
from fedlang.learning.models.model import ModelWeights as ModelWeights
from fedlang.learning.models.reconstruction import DatasetSplit as DatasetSplit
from fedlang.learning.models.reconstruction import ReconstructionModel as ReconstructionModel

# Keras picks its backend when it is first imported: choose JAX now (cheaply, without
# importing Keras) so that `import fedlang` followed by `import keras` works without
# TensorFlow. An explicit KERAS_BACKEND is respected (and refused at use if not jax).
os.environ.setdefault("KERAS_BACKEND", "jax")


def from_keras_model(keras_model: Any, loss: Any, input_spec: Any, metrics: Any = None) -> Model:
    """A fedlang model from a built Keras 3 model (see `keras_model.from_keras_model`)."""
    from fedlang.learning.models import keras_model as _keras

    return _keras.from_keras_model(keras_model, loss, input_spec, metrics)


def weights_from_keras_model(keras_model: Any) -> ModelWeights:
    """A Keras model's current weights as `ModelWeights` (e.g. pretrained weights)."""
    from fedlang.learning.models import keras_model as _keras

    return _keras.weights_from_keras_model(keras_model)


def assign_weights_to_keras_model(keras_model: Any, weights: Any) -> None:
    """Copies `ModelWeights` (e.g. `process.get_model_weights(state)`) into a Keras model
    (TFF's argument order: the model first)."""
    from fedlang.learning.models import keras_model as _keras

    _keras.assign_weights_to_keras_model(keras_model, weights)


def from_flax(module: Any, loss_fn: Any, input_spec: Any, metrics: Any = (), **kwargs: Any) -> Model:
    """A fedlang model from a Flax Linen module (see `flax_model.from_flax`)."""
    from fedlang.learning.models import flax_model as _flax

    return _flax.from_flax(module, loss_fn, input_spec, metrics, **kwargs)
