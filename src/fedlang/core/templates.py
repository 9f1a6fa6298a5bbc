"""`IterativeProcess`: a pair of computations driven by a Python loop."""

from __future__ import annotations

from fedlang.core import computation, types


class IterativeProcess:
    """`initialize() -> state` and `next(state, ...) -> state` (or `<state, ...>`).

    Both are computations; the state type returned by `initialize` must be accepted by
    the first parameter of `next`, and `next` must return that state type (alone, or
    first in a struct). Drive it with a plain Python loop::

        state = process.initialize()
        for round_num in range(10):
            state, metrics = process.next(state, client_data)

    Raises:
      TypeError: when the two computations do not fit together.
    """

    def __init__(self, initialize_fn: computation.Computation, next_fn: computation.Computation):
        for name, fn in (("initialize_fn", initialize_fn), ("next_fn", next_fn)):
            if not isinstance(fn, computation.Computation):
                raise TypeError(
                    f"{name} must be a computation (a traced function), found {types.describe(fn)}."
                )
        init_t = initialize_fn.type_signature
        if init_t.parameter is not None:
            raise TypeError(f"initialize_fn must take no parameter, found {init_t}.")
        state_t = init_t.result
        next_t = next_fn.type_signature
        param = next_t.parameter
        if param is None:
            raise TypeError(f"next_fn must take the state as its first parameter, found {next_t}.")
        first = (
            param.types[0]
            if len(next_fn.parameter_names) > 1 and isinstance(param, types.StructType)
            else param
        )
        if not first.is_assignable_from(state_t):
            raise TypeError(
                f"next_fn's first parameter has type {first}, but initialize_fn returns the state type {state_t}."
            )
        result = next_t.result
        returned_state = result
        if (
            not state_t.is_assignable_from(result)
            and isinstance(result, types.StructType)
            and len(result)
        ):
            returned_state = result.types[0]
        if not state_t.is_assignable_from(returned_state):
            raise TypeError(
                f"next_fn must return the state type {state_t} (alone or first in a struct), found {result}."
            )
        self.initialize = initialize_fn
        self.next = next_fn
        self.state_type = state_t

    def __repr__(self) -> str:
        return f"IterativeProcess(initialize: {self.initialize.type_signature}, next: {self.next.type_signature})"
