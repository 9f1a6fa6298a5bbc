"""Test configuration shared by the whole suite."""

import jax

# Implicit dtype promotion hides bugs (float32 * float64 -> float64 silently): forbid it.
jax.config.update("jax_numpy_dtype_promotion", "strict")
