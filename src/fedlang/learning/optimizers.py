"""Optax optimizers for clients and servers, with round-indexed schedules and hparams.

An optimizer argument is either an Optax `GradientTransformation`, or a function
`round_num -> GradientTransformation` called in JAX code with the round number (an
int32 scalar carried in the state), e.g. `lambda r: optax.sgd(0.1 * 0.99 ** r)`: a
learning rate indexed by round. The state structure must not depend on the round.

Hyperparameters of a transformation built with `optax.inject_hyperparams` (e.g.
`optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)`) are read and written by the
processes' `get_hparams` / `set_hparams`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
import optax

OptimizerFn = Callable[[Any], optax.GradientTransformation]


def as_optimizer_fn(optimizer: Any, name: str) -> OptimizerFn:
    """`round_num -> GradientTransformation` for an optimizer argument.

    Raises:
      TypeError: when `optimizer` is neither a transformation nor a function.
    """
    if isinstance(optimizer, optax.GradientTransformation):
        return lambda round_num: optimizer
    if callable(optimizer):
        return optimizer
    raise TypeError(
        f"Expected {name} to be an optax.GradientTransformation (e.g. optax.sgd(0.1)) or a "
        f"function round_num -> GradientTransformation, found {type(optimizer).__name__}."
    )


def injected_hparams(opt_state: Any) -> dict[str, Any]:
    """The hyperparameters held in an `inject_hyperparams` state ({} for other states)."""
    hp = getattr(opt_state, "hyperparams", None)
    return dict(hp) if isinstance(hp, dict) else {}


def with_hparams(opt_state: Any, hparams: dict[str, Any]) -> Any:
    """`opt_state` with its injected hyperparameters replaced by `hparams` (JAX code)."""
    if not hparams:
        return opt_state
    new = dict(opt_state.hyperparams)
    for k, v in hparams.items():
        new[k] = jnp.asarray(v, dtype=jnp.asarray(new[k]).dtype)
    return opt_state._replace(hyperparams=new)


def check_hparams(current: dict[str, Any], hparams: Any, what: str) -> dict[str, Any]:
    """Checks `hparams` names a subset of `current` and converts them to their dtypes.

    Raises:
      ValueError: for an unknown name.
    """
    hparams = dict(hparams or {})
    unknown = set(hparams) - set(current)
    if unknown:
        raise ValueError(
            f"Unknown {what} hyperparameters {sorted(unknown)}; expected some of {sorted(current)}. "
            "Build the optimizer with optax.inject_hyperparams to make its hyperparameters settable."
        )
    out = dict(current)
    for k, v in hparams.items():
        out[k] = np.asarray(v, dtype=np.asarray(current[k]).dtype)
    return out
