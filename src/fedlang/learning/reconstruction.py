"""TFF's older reconstruction names (`tff.learning.reconstruction`), answered with fedlang's.

TFF first published Federated Reconstruction as `tff.learning.reconstruction`
(`build_training_process`, `build_federated_evaluation`, `Model`, ...) and later moved
it to `tff.learning.algorithms.build_fed_recon` and `tff.learning.models`; tutorials
use both. fedlang has only the newer names: this module holds none, and an old name
raises an `AttributeError` naming its replacement.

Example:
  >>> import fedlang.learning as learning
  >>> learning.reconstruction.build_training_process  # doctest: +ELLIPSIS
  Traceback (most recent call last):
  ...
  AttributeError: fedlang.learning.reconstruction has no build_training_process (TFF's tff.learning.reconstruction.build_training_process, renamed in TFF too); fedlang's is fedlang.learning.algorithms.build_fed_recon(model_fn, ...).
"""

from __future__ import annotations

import sys
from typing import Any

_RECON = "fedlang.learning.models.ReconstructionModel"
# TFF's old name -> fedlang's spelling.
RENAMED = {
    "build_training_process": "fedlang.learning.algorithms.build_fed_recon(model_fn, ...)",
    "build_federated_evaluation": "fedlang.learning.algorithms.build_fed_recon_eval(model_fn, ...)",
    "Model": _RECON,
    "ReconstructionModel": _RECON,
    "from_keras_model": f"{_RECON}.from_keras_model_and_layers(keras_model, global_layers=, "
                        "local_layers=, loss=, input_spec=)",
    "build_dataset_split_fn": f"{_RECON}.build_dataset_split_fn(...)",
    "simple_dataset_split_fn": f"{_RECON}.simple_dataset_split_fn",
    "DatasetSplitFn": "fedlang.learning.models.DatasetSplit",
}


def __getattr__(name: str) -> Any:
    if name in RENAMED:
        raise AttributeError(
            f"{__name__} has no {name} (TFF's tff.learning.reconstruction.{name}, renamed in "
            f"TFF too); fedlang's is {RENAMED[name]}.", name=name, obj=sys.modules[__name__])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}", name=name,
                         obj=sys.modules[__name__])
