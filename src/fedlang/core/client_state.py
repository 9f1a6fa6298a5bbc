"""Client state: per-client values that persist across rounds, keyed by client id.

In the language, client state is an ordinary value of type `{S}@CLIENTS`. A computation
that keeps client state takes the cohort's states as one of its parameters and returns
their new values as one field of its result; `with_client_state` declares which
parameter and which result field those are, and the computation that starts a client
seen for the first time (`( -> S)`, a local computation). Nothing else is new: no
intrinsic reads or writes state, so the IR stays pure, every runtime evaluates it as
it evaluates any computation, and the compiler can split it like any other (the
state parameter is one more client input, the state result one more client output).

Persistence is a *binding* made where the computation is invoked. Instead of a list
with one state per client, the caller passes a `ClientStates`: a cohort's view of a
keyed store (e.g. `fedlang.simulation.ClientStateStore.cohort(client_ids)`), whose
first-seen clients read the declared initial state. A runtime then

* reads the cohort's states from the binding where it reads client data (the
  reference runtime all at once; the simulation runtime chunk by chunk; Ray workers
  on their own clients),
* writes the declared result field back to the binding, chunk by chunk where it
  computes it (`write`, on the binding or one of its `slice`s),
* and commits the written states when the invocation succeeds (`commit`), or
  discards them when it fails (`abort`): a round is all or nothing.

It returns the binding itself in place of the new states. Plain lists still work
everywhere (the states go in and come back as lists), which is how tests compare a
runtime with plain NumPy. Any `{S}@CLIENTS` argument may be given as a binding; only
a computation declared with `with_client_state` writes one back.

A deployment keeps the state on the devices: its binding
(`fedlang.deploy.client_state(name)`) names the state without holding it, each device
reads and writes its own state inside its client task, and the server never sees it
(docs/learning.md, "Client state").

Example:
  >>> import numpy as np, fedlang as fl
  >>> @fl.jax_computation()
  ... def zero():
  ...   return np.float32(0)
  >>> @fl.jax_computation(np.float32, np.float32)
  ... def add(s, x):
  ...   return s + x
  >>> @fl.federated_computation(fl.type_at_clients(np.float32), fl.type_at_clients(np.float32))
  ... def count(x, states):
  ...   new = fl.federated_map(add, fl.federated_zip((states, x)))
  ...   return fl.federated_sum(new), new
  >>> count = fl.with_client_state(count, zero, parameter='states', result=1)
  >>> total, states = count([1.0, 2.0], [10.0, 20.0])
  >>> float(total), [float(s) for s in states]
  (33.0, [11.0, 22.0])
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, cast, runtime_checkable

import numpy as np

from fedlang.core import computation, ir, structure, types


@runtime_checkable
class ClientStates(Protocol):
    """A cohort's client states, bound to where they are kept.

    Passed as the argument of a `{S}@CLIENTS` parameter in place of a list. Leaves
    are the tensors of `structure.flatten` for `state_type`, stacked over clients
    (a leading axis of `stop - start`).

    Attributes:
      state_type: `S`, the local type of one client's state.
    """

    state_type: types.Type

    def __len__(self) -> int:
        """The number of clients in the cohort."""

    def slice(self, start: int, stop: int) -> ClientStates:
        """The binding of clients `start..stop-1` (picklable: runtimes send it to
        workers, which read and write through it)."""

    def read(self, start: int, stop: int) -> list[np.ndarray]:
        """The states of clients `start..stop-1` as stacked leaves; a client without a
        stored state reads the initial state."""

    def begin(self) -> None:
        """Starts a write: called once, where the invocation runs, before any `write`."""

    def write(self, start: int, stop: int, leaves: list[np.ndarray]) -> None:
        """Stages the new states of clients `start..stop-1` (stacked leaves); nothing
        is visible to readers until `commit`."""

    def commit(self) -> None:
        """Makes every staged state the stored one, atomically."""

    def abort(self) -> None:
        """Discards the staged states (the stored ones stay as they were)."""


@dataclasses.dataclass(frozen=True)
class ClientStateSpec:
    """What `with_client_state` declares about a computation.

    Attributes:
      state_type: `S`, one client's state (a local type).
      initialize: a local computation `( -> S)`: the state of a client seen for the
        first time.
      parameter: the index of the `{S}@CLIENTS` parameter (in the parameter struct,
        or 0 when it is the only parameter).
      result: the index of the `{S}@CLIENTS` field of the result struct.
    """

    state_type: types.Type
    initialize: computation.Computation
    parameter: int
    result: int

    def initial_state(self) -> Any:
        """The initial state as a Python value (runs `initialize`)."""
        return self.initialize()


class StatefulComputation(computation.Computation):
    """A computation with a declared client state (made by `with_client_state`).

    It is the wrapped computation (same IR, type signature and parameters) plus
    `client_state`, a `ClientStateSpec`; runtimes read the spec to write the state
    result back to a `ClientStates` binding.
    """

    def __init__(self, inner: computation.Computation, spec: ClientStateSpec):
        self.inner = inner
        self.client_state = spec
        self.name = inner.name
        self.parameter_names = inner.parameter_names

    @property  # type: ignore[override]
    def type_signature(self) -> types.FunctionType:  # type: ignore[override]
        return self.inner.type_signature

    def to_ir(self) -> ir.Lambda | ir.Local:
        return self.inner.to_ir()


def _index(t: types.Type, key: int | str, what: str, fn_name: str) -> int:
    if not isinstance(t, types.StructType):
        raise TypeError(f"Expected {fn_name}'s {what} to be a struct, found {t}.")
    try:
        return t.index_of(key)
    except (AttributeError, IndexError) as e:
        raise TypeError(f"{fn_name}'s {what} has no field {key!r}: {e}") from None


def _check_states(t: types.Type, where: str) -> types.Type:
    if not (isinstance(t, types.FederatedType) and t.placement is types.CLIENTS and not t.all_equal):
        raise TypeError(f"Expected {where} to be client states of type {{S}}@CLIENTS, found {t}.")
    return t.member


def _check_state_type(s: types.Type, fn_name: str) -> None:
    for leaf in types.tensor_leaves(s):
        if (
            not isinstance(leaf, types.TensorType)
            or not leaf.is_fully_defined
            or leaf.dtype.kind not in "biufc"
        ):
            raise TypeError(
                f"Expected {fn_name}'s client state to hold numeric tensors of fully defined "
                f"shapes (a state is stored in a fixed-size record), found {leaf} in {s}."
            )


def with_client_state(
    next_fn: computation.Computation,
    initialize: computation.Computation,
    *,
    parameter: int | str,
    result: int | str,
) -> StatefulComputation:
    """Declares that `next_fn` keeps per-client state across invocations.

    Args:
      next_fn: a federated computation; its parameter `parameter` has type
        `{S}@CLIENTS` (the cohort's states) and its result is a struct whose field
        `result` has type `{S}@CLIENTS` (their new values).
      initialize: a local computation `( -> S)` giving a client's state the first time
        the client is seen.
      parameter: the state parameter, by name or position.
      result: the new-state field of the result, by name or position.

    Returns:
      A `StatefulComputation`: call it with a list of states (the new states come back
      as a list) or with a `ClientStates` binding (runtimes write the new states to
      it, commit them when the call succeeds, and return the binding).

    Raises:
      TypeError: naming the parameter or field whose type is not `{S}@CLIENTS`, or
        an `initialize` that does not return `S`.
    """
    if not isinstance(next_fn, computation.Computation):
        raise TypeError(f"Expected next_fn to be a computation, found {types.describe(next_fn)}.")
    if isinstance(next_fn, StatefulComputation):
        raise TypeError(f"{next_fn.name} already declares its client state.")
    fn_t = next_fn.type_signature
    if fn_t.parameter is None:
        raise TypeError(f"Expected {next_fn.name} to take the client states, found {fn_t}.")
    if len(next_fn.parameter_names) > 1:
        key = parameter
        if isinstance(parameter, str) and parameter in next_fn.parameter_names:
            key = next_fn.parameter_names.index(parameter)
        p_index = _index(fn_t.parameter, key, "parameter", next_fn.name)
        param_t = cast(types.StructType, fn_t.parameter).types[p_index]
    else:
        if parameter not in (0, *next_fn.parameter_names):
            raise TypeError(
                f"{next_fn.name} has one parameter {list(next_fn.parameter_names)}; found "
                f"parameter={parameter!r}."
            )
        p_index, param_t = 0, fn_t.parameter
    state_t = _check_states(param_t, f"{next_fn.name}'s parameter {parameter!r}")
    r_index = _index(fn_t.result, result, "result", next_fn.name)
    result_t = cast(types.StructType, fn_t.result).types[r_index]
    new_t = _check_states(result_t, f"{next_fn.name}'s result field {result!r}")
    if not state_t.is_assignable_from(new_t) or not new_t.is_assignable_from(state_t):
        raise TypeError(
            f"Expected {next_fn.name} to return new client states of the type it takes, "
            f"{state_t}; found {new_t}."
        )
    _check_state_type(state_t, next_fn.name)
    if not isinstance(initialize, computation.Computation):
        raise TypeError(
            f"Expected initialize to be a computation ( -> {state_t}), found "
            f"{types.describe(initialize)}."
        )
    init_t = initialize.type_signature
    if init_t.parameter is not None or not state_t.is_assignable_from(init_t.result):
        raise TypeError(
            f"Expected initialize to be a computation ( -> {state_t}), found {init_t}."
        )
    return StatefulComputation(next_fn, ClientStateSpec(state_t, initialize, p_index, r_index))


def spec_of(comp: Any) -> ClientStateSpec | None:
    """The client state `comp` declares, or None."""
    return comp.client_state if isinstance(comp, StatefulComputation) else None


def _param_value(comp: computation.Computation, arg: Any, index: int) -> Any:
    if len(comp.parameter_names) <= 1:
        return arg
    return arg[index] if isinstance(arg, tuple | list) else None


def bound_states(comp: Any, arg: Any) -> tuple[ClientStateSpec, ClientStates] | None:
    """`(spec, binding)` when `comp` declares client state and `arg` (packed, as
    `Context.invoke` receives it) passes a `ClientStates` for it; else None."""
    spec = spec_of(comp)
    if spec is None:
        return None
    value = _param_value(comp, arg, spec.parameter)
    return (spec, value) if isinstance(value, ClientStates) else None


def check_binding(binding: ClientStates, t: types.FederatedType, path: str) -> None:
    """Checks that a binding passed for a parameter of type `t` holds `t.member`s."""
    if not (t.member.is_assignable_from(binding.state_type) and
            binding.state_type.is_assignable_from(t.member)):
        raise TypeError(
            f"Expected {path or 'the argument'} of type {t}, found client states of type "
            f"{{{binding.state_type}}}@CLIENTS. Use a store made for this computation's state."
        )


def stack_states(values: list[Any], t: types.Type) -> list[np.ndarray]:
    """Per-client Python states -> stacked leaves (the form `ClientStates.write` takes)."""
    leaf_types = structure.leaf_types(t)
    flat = [structure.flatten(structure.to_internal(v, t), t) for v in values]
    return [
        np.stack([np.asarray(f[i], lt.dtype) for f in flat]) if flat
        else np.zeros((0, *[d or 0 for d in lt.shape]), lt.dtype)
        for i, lt in enumerate(leaf_types)
    ]


def unstack_states(leaves: list[np.ndarray], t: types.Type, n: int) -> list[Any]:
    """Stacked leaves of `n` clients -> per-client Python states."""
    return [structure.to_python(structure.unflatten([x[i] for x in leaves], t), t)
            for i in range(n)]


def replace_result(out: Any, t: types.StructType, index: int, value: Any) -> Any:
    """The Python result `out` (of struct type `t`) with field `index` replaced."""
    fields = [v for _, _, v in structure.match_fields(out, t, "")]
    fields[index] = value
    return structure.build_container(fields, t)


def _has_binding(value: Any, t: types.Type | None) -> bool:
    if isinstance(value, ClientStates):
        return True
    if isinstance(t, types.StructType) and types.contains_federated(t):
        try:
            fields = structure.match_fields(value, t, "")
        except TypeError:
            return False  # not this struct: to_internal says what is wrong, with its path
        return any(_has_binding(v, et) for _, et, v in fields)
    return False


def _materialize(value: Any, t: types.Type | None) -> Any:
    """`value` with every `ClientStates` binding read into a list of Python states."""
    if t is None or not _has_binding(value, t):
        return value
    if isinstance(value, ClientStates) and isinstance(t, types.FederatedType):
        check_binding(value, t, "")
        n = len(value)
        return unstack_states(value.read(0, n), value.state_type, n)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(_materialize(v, et) for _, et, v in structure.match_fields(value, t, ""))
    return value


def invoke_plainly(invoke: Any, comp: Any, arg: Any) -> Any:
    """Runs `invoke(comp, arg)` honouring client-state bindings the plain way.

    Every binding in `arg` is read whole into a list; when `comp` declares client
    state and its state argument is a binding, the new states are written to it and
    committed after `invoke` returns (or discarded if it raises), and the result
    holds the binding in their place. The reference runtime runs this way; it is
    the definition the other runtimes' chunked reads and writes are tested against.
    """
    t = comp.type_signature
    bound = bound_states(comp, arg)
    arg = _materialize(arg, t.parameter)
    if bound is None:
        return invoke(comp, arg)
    spec, binding = bound
    binding.begin()
    try:
        out = invoke(comp, arg)
        result_t = cast(types.StructType, t.result)
        new = structure.match_fields(out, result_t, "")[spec.result][2]
        binding.write(0, len(binding), stack_states(list(new), spec.state_type))
        binding.commit()
    except BaseException:
        binding.abort()
        raise
    return replace_result(out, result_t, spec.result, binding)
