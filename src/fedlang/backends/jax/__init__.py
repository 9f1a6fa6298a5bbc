"""Local computations written in JAX."""

# Registers the "jax" codec of fedlang.core.serialization (exported StableHLO).
from fedlang.backends.jax import export as _export  # noqa: F401
from fedlang.backends.jax.computation import JaxComputation as JaxComputation
from fedlang.backends.jax.computation import jax_computation as jax_computation
