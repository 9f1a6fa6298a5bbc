"""Optax optimizers for clients and servers: round-indexed schedules, hparams, TFF's formulas.

An optimizer argument is an Optax `GradientTransformation`; a no-argument function
returning one (TFF's habit: `lambda: optax.sgd(0.1)`); or a function
`round_num -> GradientTransformation` called in JAX code with the round number (an
int32 scalar carried in the state), e.g. `lambda r: optax.sgd(0.1 * 0.99 ** r)`: a
learning rate indexed by round. The state structure must not depend on the round.

`build_sgdm`, `build_adam`, `build_adagrad` and `build_yogi` are TFF's optimizers
(`tff.learning.optimizers`, TFF 0.87) with TFF's names, defaults and update rules, as
Optax transformations. They differ from Optax's namesakes where TFF's formulas do:
TFF's Adam and Yogi fold the bias correction into the step size and add epsilon
outside the square root (`lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`),
Optax's add it to the bias-corrected root (`lr * m_hat / (sqrt(v_hat) + eps)`), and
Optax's Yogi has no bias correction. Use them to reproduce a TFF experiment's numbers
(docs/from-tff.md). Their hyperparameters carry TFF's names (`learning_rate`,
`beta_1`, `beta_2`, `epsilon`, ...) and are settable with `set_hparams`.

Hyperparameters of a transformation built with `optax.inject_hyperparams` (e.g.
`optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)`) are read and written by the
processes' `get_hparams` / `set_hparams`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, TypeAlias, cast

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fedlang.learning.models import model as model_lib

# Optax's names: an optimizer's state, and the gradients or model updates it turns into
# steps (pytrees shaped like the params they move). Aliases of Any, for the reader.
OptState = Any
Updates = Any
# An `inject_hyperparams` state's hyperparameters, by name.
Hparams = dict[str, Any]

# An optimizer argument: an Optax transformation, a no-argument function returning one,
# or `round_num -> transformation` (see `as_optimizer_fn`).
Optimizer: TypeAlias = optax.GradientTransformation | Callable[..., optax.GradientTransformation]
# `round_num -> transformation`: the optimizer of a round (an int32 scalar in JAX code).
OptimizerFn = Callable[[jax.Array], optax.GradientTransformation]


def _positional_arity(fn: Callable[..., Any]) -> int | None:
    """How many positional arguments `fn` requires (None: it takes any number)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: assume round_num
        return 1
    if any(p.kind is p.VAR_POSITIONAL for p in params):
        return None
    return sum(
        p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        for p in params
    )


def as_optimizer_fn(optimizer: Any, name: str) -> OptimizerFn:
    """`round_num -> GradientTransformation` for an optimizer argument.

    Accepts a transformation, a no-argument function returning one (called once,
    now), or a function of the round number.

    Raises:
      TypeError: for anything else, showing the accepted forms.
    """
    forms = (
        f"Pass {name} as an optax.GradientTransformation (optax.sgd(0.1)), a no-argument "
        "function returning one (lambda: optax.sgd(0.1)), or a function of the round number "
        "(lambda round_num: optax.sgd(0.1 * 0.99 ** round_num))."
    )
    if isinstance(optimizer, optax.GradientTransformation):
        return lambda round_num: optimizer
    if not callable(optimizer):
        raise TypeError(f"Expected an optimizer, found {type(optimizer).__name__}. {forms}")
    arity = _positional_arity(optimizer)
    if arity == 0:
        made = optimizer()
        if not isinstance(made, optax.GradientTransformation):
            raise TypeError(
                f"Expected {name}() to return an optax.GradientTransformation, found "
                f"{type(made).__name__}. {forms}"
            )
        return lambda round_num: made
    if arity in (1, None):
        return cast(OptimizerFn, optimizer)
    raise TypeError(f"Expected an optimizer function of at most one argument, found {arity}. {forms}")


def injected_hparams(opt_state: OptState) -> Hparams:
    """The hyperparameters held in an `inject_hyperparams` state ({} for other states)."""
    hp = getattr(opt_state, "hyperparams", None)
    return dict(hp) if isinstance(hp, dict) else {}


def with_hparams(opt_state: OptState, hparams: Hparams) -> OptState:
    """`opt_state` with its injected hyperparameters replaced by `hparams` (JAX code)."""
    if not hparams:
        return opt_state
    new = dict(opt_state.hyperparams)
    for k, v in hparams.items():
        new[k] = jnp.asarray(v, dtype=jnp.asarray(new[k]).dtype)
    return opt_state._replace(hyperparams=new)


def check_hparams(current: Hparams, hparams: Mapping[str, Any] | None, what: str) -> Hparams:
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


def get_state_hparams(state: Mapping[str, Any]) -> Hparams:
    """The injected hyperparameters of `state['optimizer_state']` (a part's server state
    holding an optimizer's state: a finalizer's, Mime's base optimizer's)."""
    return injected_hparams(state["optimizer_state"])


def set_state_hparams(
    state: Mapping[str, Any], hparams: Mapping[str, Any] | None, what: str
) -> Mapping[str, Any]:
    """`state` with the injected hyperparameters of `state['optimizer_state']` set.

    Raises:
      ValueError: for a name that is not one of the optimizer's (`what` says which
        optimizer, e.g. 'server').
    """
    opt_state = state["optimizer_state"]
    new = check_hparams(injected_hparams(opt_state), hparams, what)
    if not new:
        return state
    return {**state, "optimizer_state": opt_state._replace(hyperparams=new)}


# -- TFF's optimizers (tff.learning.optimizers, TFF 0.87) ---------------------------------


class TFFAdaptiveState(NamedTuple):
    """The state of `build_adam` / `build_yogi`: step count and the two moments."""

    step: jax.Array
    accumulator: model_lib.Params
    preconditioner: model_lib.Params


class TFFPreconditionerState(NamedTuple):
    """The state of `build_adagrad`, and of `build_sgdm` (its velocity) with momentum."""

    preconditioner: model_lib.Params


def _leafwise(fn: Callable[..., Any], *trees: Any) -> Any:
    return jax.tree.map(fn, *trees)


def _adaptive(learning_rate: Any, beta_1: Any, beta_2: Any, epsilon: Any,
              initial_preconditioner_value: float, second_moment: Callable[[Any, Any, Any], Any]
              ) -> optax.GradientTransformation:
    """Adam and Yogi as TFF writes them: bias correction folded into the step size."""

    def init(params: model_lib.Params) -> TFFAdaptiveState:
        return TFFAdaptiveState(
            jnp.int32(0), _leafwise(jnp.zeros_like, params),
            _leafwise(lambda p: jnp.full_like(p, initial_preconditioner_value), params))

    def update(grads: Updates, state: TFFAdaptiveState,
               params: model_lib.Params = None) -> tuple[Updates, TFFAdaptiveState]:
        del params
        step = state.step + 1
        t = step.astype(jnp.float32)
        acc = _leafwise(lambda a, g: a + (g - a) * (1 - beta_1), state.accumulator, grads)
        pre = _leafwise(lambda s, g: second_moment(s, g, beta_2), state.preconditioner, grads)
        lr = learning_rate * jnp.sqrt(1 - beta_2**t) / (1 - beta_1**t)
        updates = _leafwise(
            lambda a, s: (-lr * a / (jnp.sqrt(s) + epsilon)).astype(a.dtype), acc, pre)
        return updates, TFFAdaptiveState(step, acc, pre)

    return optax.GradientTransformation(init, update)


def _adam_moment(s: jax.Array, g: jax.Array, beta_2: Any) -> jax.Array:
    return s + (jnp.square(g) - s) * (1 - beta_2)


def _yogi_moment(s: jax.Array, g: jax.Array, beta_2: Any) -> jax.Array:
    g2 = jnp.square(g)
    return s + (1 - beta_2) * jnp.sign(g2 - s) * g2


def _check_rate(name: str, value: float, low: float = 0.0, high: float | None = None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (
            high is not None and value >= high):
        bound = f"in [{low}, {high})" if high is not None else f">= {low}"
        raise ValueError(f"Expected {name} {bound}, found {value!r}.")


def build_sgdm(learning_rate: float = 0.01, momentum: float | None = None,
               nesterov: bool = False) -> optax.GradientTransformation:
    """TFF's `build_sgdm`: SGD, with momentum when `momentum` is given.

    `w -= lr * g`; with momentum `m`: `v = m * v + g`, `w -= lr * v` (Nesterov:
    `w -= lr * (g + m * v)`). The same numbers as `optax.sgd(lr, momentum, nesterov)`.

    Args:
      learning_rate: the step size (>= 0).
      momentum: None (plain SGD) or a float in [0, 1].
      nesterov: Nesterov momentum (needs `momentum`).

    Returns:
      An Optax transformation with hparams `learning_rate` (and `momentum`).

    Raises:
      ValueError: on out-of-range arguments.
    """
    _check_rate("learning_rate", learning_rate)
    if momentum is None:
        if nesterov:
            raise ValueError("Expected a momentum in (0, 1] with nesterov=True, found None.")

        def sgd(learning_rate: Any) -> optax.GradientTransformation:
            return optax.stateless(
                lambda g, params=None: _leafwise(lambda x: (-learning_rate * x).astype(x.dtype), g))

        return optax.inject_hyperparams(sgd)(learning_rate=learning_rate)
    _check_rate("momentum", momentum, 0.0, 1.0 + 1e-12)

    def sgdm(learning_rate: Any, momentum: Any) -> optax.GradientTransformation:
        def init(params: model_lib.Params) -> TFFPreconditionerState:
            return TFFPreconditionerState(_leafwise(jnp.zeros_like, params))

        def update(grads: Updates, state: TFFPreconditionerState,
                   params: model_lib.Params = None) -> tuple[Updates, TFFPreconditionerState]:
            del params
            v = _leafwise(lambda a, g: momentum * a + g, state.preconditioner, grads)
            step = _leafwise(lambda g, a: g + momentum * a, grads, v) if nesterov else v
            return _leafwise(lambda x: (-learning_rate * x).astype(x.dtype), step), (
                TFFPreconditionerState(v))

        return optax.GradientTransformation(init, update)

    return optax.inject_hyperparams(sgdm)(learning_rate=learning_rate, momentum=momentum)


def build_adam(learning_rate: float, beta_1: float = 0.9, beta_2: float = 0.999,
               epsilon: float = 1e-7) -> optax.GradientTransformation:
    """TFF's `build_adam` (its formula, not Optax's; see the module docstring).

    `m = b1 m + (1 - b1) g`, `v = b2 v + (1 - b2) g^2`,
    `w -= lr * sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + eps)`.

    Args:
      learning_rate: the step size (>= 0).
      beta_1: the first moment's decay, in [0, 1).
      beta_2: the second moment's decay, in [0, 1).
      epsilon: added to `sqrt(v)` (TFF's default 1e-7).

    Returns:
      An Optax transformation with hparams `learning_rate`, `beta_1`, `beta_2`, `epsilon`.

    Raises:
      ValueError: on out-of-range arguments.

    Example:
      >>> import jax.numpy as jnp
      >>> opt = build_adam(0.1)
      >>> updates, _ = opt.update(jnp.array([2.0]), opt.init(jnp.array([0.0])))
      >>> round(float(updates[0]), 5)  # the first step is -lr * g / (|g| + eps)
      -0.1
    """
    for name, v, high in (("beta_1", beta_1, 1.0), ("beta_2", beta_2, 1.0)):
        _check_rate(name, v, 0.0, high)
    _check_rate("learning_rate", learning_rate)
    _check_rate("epsilon", epsilon)

    def adam(learning_rate: Any, beta_1: Any, beta_2: Any, epsilon: Any) -> Any:
        return _adaptive(learning_rate, beta_1, beta_2, epsilon, 0.0, _adam_moment)

    return optax.inject_hyperparams(adam)(
        learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)


def build_yogi(learning_rate: float, beta_1: float = 0.9, beta_2: float = 0.999,
               epsilon: float = 1e-3, initial_preconditioner_value: float = 1e-6,
               ) -> optax.GradientTransformation:
    """TFF's `build_yogi`: Adam's update with Yogi's additive second moment.

    `v = v + (1 - b2) * sign(g^2 - v) * g^2` from `v = initial_preconditioner_value`,
    and the step of `build_adam` (bias correction in the step size; Optax's `yogi`
    has none).

    Args:
      learning_rate: the step size (>= 0); TFF suggests 10x Adam's.
      beta_1, beta_2: the moments' decays, in [0, 1).
      epsilon: added to `sqrt(v)` (TFF's default 1e-3).
      initial_preconditioner_value: the second moment's initial value (> 0).

    Returns:
      An Optax transformation with hparams `learning_rate`, `beta_1`, `beta_2`, `epsilon`.

    Raises:
      ValueError: on out-of-range arguments.
    """
    for name, v, high in (("beta_1", beta_1, 1.0), ("beta_2", beta_2, 1.0)):
        _check_rate(name, v, 0.0, high)
    _check_rate("learning_rate", learning_rate)
    _check_rate("epsilon", epsilon)
    _check_rate("initial_preconditioner_value", initial_preconditioner_value)
    init_v = float(initial_preconditioner_value)

    def yogi(learning_rate: Any, beta_1: Any, beta_2: Any, epsilon: Any) -> Any:
        return _adaptive(learning_rate, beta_1, beta_2, epsilon, init_v, _yogi_moment)

    return optax.inject_hyperparams(yogi)(
        learning_rate=learning_rate, beta_1=beta_1, beta_2=beta_2, epsilon=epsilon)


def build_adagrad(learning_rate: float, initial_preconditioner_value: float = 0.1,
                  epsilon: float = 1e-7) -> optax.GradientTransformation:
    """TFF's `build_adagrad`: `v += g^2`, `w -= lr * g / sqrt(v + eps)`, `v` from 0.1.

    The same numbers as `optax.adagrad(lr, initial_accumulator_value=0.1, eps=1e-7)`.

    Args:
      learning_rate: the step size (>= 0).
      initial_preconditioner_value: the accumulator's initial value (>= 0).
      epsilon: added inside the square root.

    Returns:
      An Optax transformation with hparams `learning_rate`, `epsilon`.

    Raises:
      ValueError: on out-of-range arguments.
    """
    _check_rate("learning_rate", learning_rate)
    _check_rate("initial_preconditioner_value", initial_preconditioner_value)
    _check_rate("epsilon", epsilon)
    init_v = float(initial_preconditioner_value)

    def adagrad(learning_rate: Any, epsilon: Any) -> optax.GradientTransformation:
        def init(params: model_lib.Params) -> TFFPreconditionerState:
            return TFFPreconditionerState(_leafwise(lambda p: jnp.full_like(p, init_v), params))

        def update(grads: Updates, state: TFFPreconditionerState,
                   params: model_lib.Params = None) -> tuple[Updates, TFFPreconditionerState]:
            del params
            v = _leafwise(lambda s, g: s + jnp.square(g), state.preconditioner, grads)
            updates = _leafwise(
                lambda g, s: (-learning_rate * g / jnp.sqrt(s + epsilon)).astype(g.dtype), grads, v)
            return updates, TFFPreconditionerState(v)

        return optax.GradientTransformation(init, update)

    return optax.inject_hyperparams(adagrad)(learning_rate=learning_rate, epsilon=epsilon)
