"""The JAX backend: local computations written in JAX (`jax_computation`).

Importing it registers what JAX needs to know about fedlang values (`SparseTensor` as a
pytree) and the "jax" codec of `fedlang.core.wire` (exported StableHLO).
Runtimes use these computations only through the local-program contract of
`fedlang.core.local`.
"""

from fedlang.backends.jax import computation as computation
from fedlang.backends.jax import export as export
from fedlang.backends.jax import pytrees as _pytrees  # noqa: F401 - registers SparseTensor
from fedlang.backends.jax import strings as strings
from fedlang.backends.jax.computation import JaxComputation as JaxComputation
from fedlang.backends.jax.computation import jax_computation as jax_computation
