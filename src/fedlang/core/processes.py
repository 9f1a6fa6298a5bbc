"""Process templates: `IterativeProcess`, `MeasuredProcess`, `AggregationProcess`, and the
`BufferedProcess` protocol of asynchronous (buffered) training."""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

from fedlang.core import client_state, computation, types


class IterativeProcess:
    """`initialize() -> state` and `next(state, ...) -> state` (or `<state, ...>`).

    Both are computations; the state type returned by `initialize` must be accepted by
    the first parameter of `next`, and `next` must return that state type (alone, or
    first in a struct). Drive it with a plain Python loop::

        state = process.initialize()
        for round_num in range(10):
            state, metrics = process.next(state, client_data)

    A process whose clients keep state across rounds has a `next` made by
    `fedlang.with_client_state`; `client_state` is then its `ClientStateSpec` (the
    state type and the initial state), else None.

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
        self.client_state = client_state.spec_of(next_fn)

    def __repr__(self) -> str:
        return f"IterativeProcess(initialize: {self.initialize.type_signature}, next: {self.next.type_signature})"


class MeasuredProcessOutput(NamedTuple):
    """What `MeasuredProcess.next` returns: the new state, the result and measurements."""

    state: Any
    result: Any
    measurements: Any


def _next_result_fields(next_fn: computation.Computation) -> types.StructType:
    result = next_fn.type_signature.result
    if not (
        isinstance(result, types.StructType) and result.names == ("state", "result", "measurements")
    ):
        raise TypeError(
            "Expected next_fn to return <state=...,result=...,measurements=...> (a "
            f"fedlang.templates.MeasuredProcessOutput), found {result}. Return "
            "MeasuredProcessOutput(state, result, measurements)."
        )
    return result


class MeasuredProcess(IterativeProcess):
    """An iterative process whose `next` returns `MeasuredProcessOutput(state, result, measurements)`.

    `measurements` report what the process did (placed at the server); `result` is what
    the caller uses. Processes compose by nesting: an outer process calls an inner
    process's `next` inside its own `next` and reports the inner measurements under
    its own.

    Raises:
      TypeError: when `next` does not return a `MeasuredProcessOutput`, or the
        computations do not fit together.
    """

    def __init__(self, initialize_fn: computation.Computation, next_fn: computation.Computation):
        super().__init__(initialize_fn, next_fn)
        _next_result_fields(next_fn)

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(initialize: {self.initialize.type_signature}, "
            f"next: {self.next.type_signature})"
        )


class AggregationProcess(MeasuredProcess):
    """A measured process that aggregates client values into one server value.

    `initialize() -> S@SERVER` and `next(state, client_values[, client_weights]) ->
    MeasuredProcessOutput(S@SERVER, V@SERVER, M@SERVER)`, where `client_values` is
    `{V}@CLIENTS` and the optional `client_weights` is `{W}@CLIENTS`. Called directly,
    client values (and weights) are lists with one entry per client.

    Raises:
      TypeError: when the state is not at SERVER, the values are not at CLIENTS, or the
        result or measurements are not at SERVER.
    """

    def __init__(self, initialize_fn: computation.Computation, next_fn: computation.Computation):
        super().__init__(initialize_fn, next_fn)
        if not _at(self.state_type, types.SERVER):
            raise TypeError(f"Expected the aggregation state at SERVER, found {self.state_type}.")
        param = next_fn.type_signature.parameter
        n = len(next_fn.parameter_names)
        if not isinstance(param, types.StructType) or n not in (2, 3):
            raise TypeError(
                "Expected next_fn(state, client_values[, client_weights]), found "
                f"{next_fn.type_signature}."
            )
        for t in param.types[1:]:
            if not _at(t, types.CLIENTS):
                raise TypeError(f"Expected client values placed at CLIENTS, found {t}.")
        result = _next_result_fields(next_fn)
        for name in ("result", "measurements"):
            if not _at(result[name], types.SERVER):
                raise TypeError(
                    f"Expected the aggregation's {name} at SERVER, found {result[name]}."
                )
        self.value_type = param.types[1].member  # type: ignore[attr-defined]
        self.weight_type = param.types[2].member if n == 3 else None  # type: ignore[attr-defined]

    @property
    def is_weighted(self) -> bool:
        """True when `next` takes client weights."""
        return self.weight_type is not None


def _at(t: types.Type, placement: types.Placement) -> bool:
    return isinstance(t, types.FederatedType) and t.placement is placement


class BufferedProcess(Protocol):
    """A buffered (asynchronous) training process, as the virtual-clock simulator
    (`fedlang.simulation.run_async`) and the deployment's `BufferedDriver` use it; the
    learning library's `BufferedLearningProcess` (`build_fed_buff`) is one.

    A client downloads `client_model(state)` (weights and their version), runs `train`
    (a local computation `(model_weights, dataset) -> report` of type `report_type`),
    and the server folds its report with `fold(state, report, version)`; when
    `is_full(state)`, `apply(state)` steps the server and publishes the next version.
    `status(state)` holds at least the ints `'version'`, `'buffer_size'`,
    `'buffer_fill'` and `'refused_stale'`.
    """

    train: computation.Computation
    report_type: types.Type
    buffer_size: int  # K: reports per server step
    max_staleness: int  # reports staler than this are refused and counted

    def initialize(self) -> Any: ...

    def client_model(self, state: Any) -> tuple[Any, int]: ...

    def fold(self, state: Any, report: Any, version: int) -> Any: ...

    def is_full(self, state: Any) -> bool: ...

    def apply(self, state: Any) -> tuple[Any, Any]: ...

    def status(self, state: Any) -> dict[str, Any]: ...

    def get_model_weights(self, state: Any) -> Any: ...
