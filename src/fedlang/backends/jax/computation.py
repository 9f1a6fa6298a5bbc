"""Alias of `fedlang.core.jax_computation`, where local JAX computations are defined.

They live in the core so that libraries written with the core (learning,
aggregators) depend on the core alone; this backend package holds what runtimes
need beyond that (export to StableHLO).
"""

from fedlang.core.jax_computation import (  # noqa: F401
    MASK_TYPE,
    DatasetStandIn,
    JaxComputation,
    JaxLocal,
    _concrete_shape,
    abstract_args,
    batch_size,
    full_mask,
    jax_computation,
)
