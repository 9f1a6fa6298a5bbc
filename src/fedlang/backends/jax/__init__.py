"""Local computations written in JAX."""

from fedlang.backends.jax.computation import JaxComputation as JaxComputation
from fedlang.backends.jax.computation import jax_computation as jax_computation
