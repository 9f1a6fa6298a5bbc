"""fedlang: federated learning and analytics with TFF's programming model on JAX.

The public API is exactly what this module re-exports. Importing it does no work: no
JAX backend starts and no thread is made until a computation runs (the default runtime
is created on first use), and the libraries `fl.learning`, `fl.aggregators`,
`fl.analytics` and `fl.simulation` are imported when first used.
"""

import importlib as _importlib
import os as _os
from typing import Any as _Any

from fedlang import runtime as runtime
from fedlang import templates as templates
from fedlang.backends.jax import jax_computation as jax_computation
from fedlang.core import context as _context
from fedlang.core import signing as signing
from fedlang.core.client_state import ClientStates as ClientStates
from fedlang.core.client_state import with_client_state as with_client_state
from fedlang.core.computation import Computation as Computation
from fedlang.core.operators import federated_aggregate as federated_aggregate
from fedlang.core.operators import federated_apply as federated_apply
from fedlang.core.operators import federated_broadcast as federated_broadcast
from fedlang.core.operators import federated_eval as federated_eval
from fedlang.core.operators import federated_map as federated_map
from fedlang.core.operators import federated_max as federated_max
from fedlang.core.operators import federated_mean as federated_mean
from fedlang.core.operators import federated_min as federated_min
from fedlang.core.operators import federated_secure_modular_sum as federated_secure_modular_sum
from fedlang.core.operators import federated_secure_sum_bitwidth as federated_secure_sum_bitwidth
from fedlang.core.operators import federated_select as federated_select
from fedlang.core.operators import federated_sparse_mean as federated_sparse_mean
from fedlang.core.operators import federated_sparse_sum as federated_sparse_sum
from fedlang.core.operators import federated_sum as federated_sum
from fedlang.core.operators import federated_value as federated_value
from fedlang.core.operators import federated_zip as federated_zip
from fedlang.core.operators import sequence_map as sequence_map
from fedlang.core.operators import sequence_reduce as sequence_reduce
from fedlang.core.operators import sequence_sum as sequence_sum
from fedlang.core.serialization import SerializationError as SerializationError
from fedlang.core.serialization import deserialize_value as deserialize_value
from fedlang.core.serialization import serialize_value as serialize_value
from fedlang.core.sparse import SparseTensor as SparseTensor
from fedlang.core.tracing import federated_computation as federated_computation
from fedlang.core.types import CLIENTS as CLIENTS
from fedlang.core.types import SERVER as SERVER
from fedlang.core.types import FederatedType as FederatedType
from fedlang.core.types import FunctionType as FunctionType
from fedlang.core.types import SequenceType as SequenceType
from fedlang.core.types import SparseTensorType as SparseTensorType
from fedlang.core.types import StructType as StructType
from fedlang.core.types import TensorType as TensorType
from fedlang.core.types import Type as Type
from fedlang.core.types import to_type as to_type
from fedlang.core.types import type_at_clients as type_at_clients
from fedlang.core.types import type_at_server as type_at_server
from fedlang.runtime import set_default_context as set_default_context

__version__ = "0.1.0"

_context.set_default_factory(runtime.SimulationContext)

# Keras (an optional model source) must run on JAX; a Keras imported later picks this up.
_os.environ.setdefault("KERAS_BACKEND", "jax")

_LAZY_SUBPACKAGES = ("aggregators", "analytics", "learning", "simulation")


def __getattr__(name: str) -> _Any:
    # `fl.learning` etc. import on first use, so `import fedlang` stays cheap (no Keras,
    # no pyarrow) while TFF-style `fl.simulation.datasets...` works without an import.
    if name in _LAZY_SUBPACKAGES:
        module = _importlib.import_module(f"fedlang.{name}")
        globals()[name] = module
        return module
    raise AttributeError(f"module 'fedlang' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY_SUBPACKAGES])
