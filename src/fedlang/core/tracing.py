"""Tracing Python functions into IR: `federated_computation` and symbolic `Value`s.

A federated computation's body runs once, at trace time, on symbolic `Value`s. Every
intrinsic or computation it calls is recorded as a local of a `Block`; Python control
flow runs at trace time. Anything else (arithmetic on federated values, JAX ops, Python
`if` on a traced value) fails at trace time with a `TypeError` that says what to do.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fedlang.core import (
    computation,
    context,
    intrinsic_defs,
    intrinsics,
    ir,
    local,
    type_format,
    types,
)


class TracingContext:
    """Records calls made while tracing one federated computation."""

    _ids = itertools.count()

    def __init__(self, name: str):
        self.name = name
        self.locals: list[tuple[str, ir.Node]] = []
        self._counter = itertools.count()
        self.id = next(self._ids)

    def bind(self, node: ir.Node) -> Value:
        """Binds `node` to a fresh local and returns a Value referring to it."""
        if isinstance(node, ir.Reference | ir.Literal | ir.PlacementLiteral):
            return Value(node, self)
        name = f"v{next(self._counter)}"
        self.locals.append((name, node))
        return Value(ir.Reference(name, node.type_signature), self)

    def invoke(self, comp: Any, arg: Any) -> Value:
        fn = ir_of(comp, None if arg is None else to_node(arg).type_signature)
        arg_node = None if arg is None else to_node(arg)
        fn_type = fn.type_signature
        assert isinstance(fn_type, types.FunctionType)
        if (
            arg_node is not None
            and fn_type.parameter is not None
            and not fn_type.parameter.is_assignable_from(arg_node.type_signature)
        ):
            hint = ""
            at = arg_node.type_signature
            if types.contains_federated(at) and not types.contains_federated(fn_type.parameter):
                hint = " The function is local: apply it to a federated value with federated_map(fn, value)."
            raise TypeError(
                f"{getattr(comp, 'name', 'computation')} expects an argument of type "
                f"{type_format.expected_found(fn_type.parameter, at)}.{hint}"
            )
        return self.bind(ir.Call(fn, arg_node))


def current_tracing_context(what: str) -> TracingContext:
    """The trace being recorded on this thread; `what` names the caller in the error."""
    stack = context.current_stack()
    ctx = stack[-1] if stack else None
    if not isinstance(ctx, TracingContext):
        raise RuntimeError(
            f"{what} can only be used inside a @fedlang.federated_computation; "
            "wrap the code that calls it in one."
        )
    return ctx


def call_intrinsic(uri: str, arg: Any) -> Value:
    """Type-checks `arg` against the rule of the intrinsic `uri` (in `intrinsics.TABLE`)
    and records the call in the trace being recorded on this thread."""
    ctx = current_tracing_context(uri)
    node = to_node(arg)
    result_type = intrinsics.lookup(uri).type_rule(node.type_signature)
    fn = ir.Intrinsic(uri, types.FunctionType(node.type_signature, result_type))
    return ctx.bind(ir.Call(fn, node))


_OPS = {
    "__add__": "add",
    "__radd__": "add",
    "__sub__": "subtract",
    "__rsub__": "subtract",
    "__mul__": "multiply",
    "__rmul__": "multiply",
    "__truediv__": "divide",
    "__rtruediv__": "divide",
    "__floordiv__": "divide",
    "__pow__": "raise",
    "__matmul__": "multiply",
    "__neg__": "negate",
    "__lt__": "compare",
    "__le__": "compare",
    "__gt__": "compare",
    "__ge__": "compare",
    "__mod__": "take the modulus of",
    "__abs__": "take the absolute value of",
}


def _op_error(self: Value, other: Any = None, op: str = "combine") -> TypeError:
    mine = self.type_signature
    theirs = to_node(other).type_signature if isinstance(other, Value) else None
    if theirs is not None:
        what = f"cannot {op} {mine} and {theirs}"
    else:
        what = f"cannot {op} {mine}" + ("" if other is None else f" and {types.describe(other)}")
    placements = {t.placement.name for t in (mine, theirs) if isinstance(t, types.FederatedType)}
    if len(placements) == 2:
        fix = "broadcast (federated_broadcast) or aggregate (federated_sum, federated_mean) first"
    else:
        fix = "do the arithmetic in a @fedlang.jax_computation and apply it with federated_map"
    return TypeError(f"{what} inside a federated computation; {fix}.")


def _make_op(name: str, op: str) -> Callable:
    def method(self: Value, other: Any = None) -> Any:
        raise _op_error(self, other, op)

    method.__name__ = name
    return method


class Value:
    """A symbolic value inside a federated computation being traced."""

    __slots__ = ("_ctx", "_node")
    _ctx: TracingContext
    _node: ir.Node

    def __init__(self, node: ir.Node, ctx: TracingContext):
        object.__setattr__(self, "_node", node)
        object.__setattr__(self, "_ctx", ctx)

    @property
    def type_signature(self) -> types.Type:
        return self._node.type_signature

    def __repr__(self) -> str:
        return f"<fedlang.Value {self._node}: {self.type_signature}>"

    def _select(self, key: str | int) -> Value:
        t = self.type_signature
        if isinstance(t, types.StructType):
            return self._ctx.bind(ir.Selection(self._node, key))
        if isinstance(t, types.FederatedType) and isinstance(t.member, types.StructType):
            # `value.key` on a federated struct: a federated_map of the field selection.
            selector = ir.Lambda("x", t.member, ir.Selection(ir.Reference("x", t.member), key))
            return call_intrinsic(intrinsic_defs.FEDERATED_MAP.uri, (NodeRef(selector), self))
        raise AttributeError(f"Cannot select {key!r} from a value of type {t}; it is not a struct.")

    def __getattr__(self, name: str) -> Value:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._select(name)

    def __getitem__(self, key: str | int) -> Value:
        if not isinstance(key, str | int | np.integer):
            raise TypeError(f"Struct fields are selected by name or integer index, found {key!r}.")
        return self._select(key)

    def __len__(self) -> int:
        t = self.type_signature
        member = t.member if isinstance(t, types.FederatedType) else t
        if isinstance(member, types.StructType):
            return len(member)
        raise TypeError(f"A value of type {t} has no length; only structs do.")

    def __iter__(self) -> Any:
        return (self[i] for i in range(len(self)))

    def __call__(self, *args: Any, **kwargs: Any) -> Value:
        t = self.type_signature
        if not isinstance(t, types.FunctionType):
            raise TypeError(f"A value of type {t} is not a function.")
        arg = computation.pack_args(
            t.parameter, ["arg"] if t.parameter else [], args, kwargs, str(self._node)
        )
        return self._ctx.invoke(_FunctionValue(self), arg)

    def __setattr__(self, name: str, value: Any) -> None:
        raise TypeError("Traced values are immutable; build a new struct (e.g. a dict) instead.")

    def __bool__(self) -> bool:
        raise TypeError(
            f"Python control flow cannot depend on a traced value ({self.type_signature}): the body of a "
            "federated computation runs once, at trace time. Branch inside a jax_computation "
            "(jax.lax.cond / jnp.where) instead."
        )

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"Cannot use NumPy or JAX on {self.type_signature} inside a federated computation; write the "
            "math in a @fedlang.jax_computation and apply it with federated_map (or call it on a local value)."
        )

    __hash__ = None  # type: ignore[assignment]

    def __eq__(self, other: object) -> bool:  # type: ignore[override]
        raise _op_error(self, other, "compare")

    def __ne__(self, other: object) -> bool:  # type: ignore[override]
        raise _op_error(self, other, "compare")


for _name, _op in _OPS.items():
    setattr(Value, _name, _make_op(_name, _op))


class NodeRef:
    """Wraps a ready IR node so `to_node` passes it through unchanged."""

    def __init__(self, node: ir.Node):
        self.node = node


class _FunctionValue:
    """Adapts a function-typed Value so TracingContext.invoke can call it."""

    def __init__(self, value: Value):
        self.value = value
        self.name = str(value._node)


def to_node(value: Any) -> ir.Node:
    """Converts a traced value, computation, constant or container of them to an IR node."""
    if isinstance(value, Value):
        ctx = context.innermost(TracingContext)
        if ctx is not None and value._ctx is not ctx:
            raise TypeError(
                f"A value of type {value.type_signature} from an enclosing computation was captured; pass "
                "it to the inner computation as an argument instead."
            )
        return value._node
    if isinstance(value, _FunctionValue):
        return value.value._node
    if isinstance(value, NodeRef):
        return value.node
    if isinstance(value, computation.Computation):
        return value.to_ir()
    if local.is_local(value):  # a backend's local computation that is not a Computation
        return ir.Local(value)
    if isinstance(value, types.Placement):
        return ir.PlacementLiteral(value)
    if isinstance(value, str):  # a string constant (TFF: federated_value('Hello', SERVER))
        return ir.Literal(np.asarray(value, dtype=types.STRING), types.TensorType(types.STRING))
    if isinstance(value, bool | int | float | np.generic):
        return ir.Literal(value, types.to_type(value))  # type: ignore[arg-type]
    if hasattr(value, "dtype") and hasattr(value, "shape") and not isinstance(value, type):
        arr = np.asarray(value)
        if arr.dtype.kind in "UT":
            arr = arr.astype(types.STRING)
        if arr.dtype.kind in "biufcT":
            return ir.Literal(arr, types.to_type(arr))  # type: ignore[arg-type]
    if types.is_container(value):
        elements = [(n, to_node(v)) for n, v in types.struct_items(value)]
        return ir.Struct(elements, container=types.container_of(value))
    if callable(value):
        raise TypeError(
            f"Cannot use the Python function {getattr(value, '__name__', value)!r} in a federated "
            "computation; decorate it with @fedlang.jax_computation (local JAX code) or "
            "@fedlang.federated_computation."
        )
    raise TypeError(
        f"Cannot use {types.describe(value)} in a federated computation; expected a traced value, a "
        "computation, a placement, a number or NumPy array, or a container of these."
    )


def to_value(value: Any) -> Value:
    """Like `to_node`, but returns a bound `Value` in the current trace."""
    if isinstance(value, Value):
        to_node(value)
        return value
    ctx = current_tracing_context("This operation")
    return ctx.bind(to_node(value))


def ir_of(comp: Any, arg_type: types.Type | None) -> ir.Node:
    """The IR to call for a computation, concretizing polymorphic ones at `arg_type`."""
    if isinstance(comp, _FunctionValue):
        return comp.value._node
    if isinstance(comp, Polymorphic):
        return comp.concretize_for(arg_type).to_ir()
    if isinstance(comp, computation.Computation):
        return comp.to_ir()
    return to_node(comp)


class Polymorphic:
    """A computation traced once per distinct argument type (made when no types are given).

    Calling it infers the argument type (from traced values inside a computation, from
    Python values otherwise) and runs the concrete computation for that type.
    """

    def __init__(
        self,
        fn: Callable,
        make: Callable[[Callable, tuple[types.Type, ...]], computation.Computation],
    ):
        self.fn = fn
        self._make = make
        self.name = getattr(fn, "__name__", "computation")
        self.parameter_names = computation.parameter_names_of(fn)
        self._cache: dict[types.Type | None, computation.Computation] = {}
        functools.update_wrapper(self, fn)  # type: ignore[arg-type]

    @property
    def type_signature(self) -> types.FunctionType:
        raise TypeError(
            f"{self.name} is polymorphic (no parameter types were given), so it has no single type "
            f"signature; give types to the decorator, or use {self.name}.concretize(*types)."
        )

    def concretize(self, *param_types: Any) -> computation.Computation:
        """The concrete computation for the given parameter types."""
        t = computation.parameter_type_for(param_types, self.parameter_names, self.name)
        return self.concretize_for(t)

    def concretize_for(self, arg_type: types.Type | None) -> computation.Computation:
        if arg_type not in self._cache:
            if arg_type is None:
                param_types: tuple = ()
            elif len(self.parameter_names) > 1:
                if not isinstance(arg_type, types.StructType) or len(arg_type) != len(
                    self.parameter_names
                ):
                    raise TypeError(
                        f"{self.name} takes {len(self.parameter_names)} arguments, found {arg_type}."
                    )
                param_types = arg_type.types
            else:
                param_types = (arg_type,)
            self._cache[arg_type] = self._make(self.fn, param_types)
        return self._cache[arg_type]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        n = len(self.parameter_names)
        names = self.parameter_names if n > 1 else (["arg"] if n == 1 else [])
        dummy_param = types.StructType([]) if n else None
        arg = computation.pack_args(dummy_param, names, args, kwargs, self.name)
        ctx = context.get_context()
        if isinstance(ctx, TracingContext):
            return ctx.invoke(self, arg)
        arg_type = None if arg is None else types.to_type(arg)
        if n > 1:
            arg_type = types.StructType(
                [
                    (name, t)
                    for name, t in zip(self.parameter_names, cast(types.StructType, arg_type))
                ]
            )
        try:
            concrete = self.concretize_for(arg_type)
        except TypeError as e:
            # Placements cannot be inferred from Python values: make the likely mistake clear.
            raise TypeError(
                f"{e} Note: {self.name} is polymorphic and was traced for the Python argument's type "
                f"{arg_type}; placements (CLIENTS/SERVER) cannot be inferred from Python values, so "
                f"give types to the decorator or call {self.name}.concretize(...)."
            ) from None
        return ctx.invoke(concrete, arg)

    def __repr__(self) -> str:
        return f"<polymorphic computation {self.name}>"


def trace(
    fn: Callable, param_types: tuple[Any, ...], name: str | None = None
) -> computation.IRComputation:
    """Traces `fn` with symbolic arguments of `param_types` into an `IRComputation`."""
    name = name or cast(str, getattr(fn, "__name__", "computation"))
    names = computation.parameter_names_of(fn)
    param = computation.parameter_type_for(param_types, names, name)
    ctx = TracingContext(name)
    with context.with_context(ctx):
        if param is None:
            args: tuple = ()
        else:
            arg_value = Value(ir.Reference("arg", param), ctx)
            args = (
                tuple(arg_value[i] for i in range(len(names))) if len(names) > 1 else (arg_value,)
            )
        try:
            result = fn(*args)
        except TypeError as e:
            if "tracing.Value" not in str(e):
                raise
            raise TypeError(
                f"Cannot use NumPy or JAX on a traced federated value in {name}; write the math in a "
                "@fedlang.jax_computation and apply it with federated_map (or call it on a local value). "
                f"(JAX said: {e})"
            ) from None
        if result is None:
            raise TypeError(
                f"The federated computation {name} returned None; it must return a value."
            )
        result_node = to_node(result)
    body = ir.Block(ctx.locals, result_node)
    lam = ir.Lambda("arg" if param is not None else None, param, body)
    return computation.IRComputation(lam, name, names)


def federated_computation(*param_types: Any) -> Any:
    """Decorator: traces a Python function into a federated computation.

    Args:
      *param_types: one type spec per parameter (anything `fedlang.to_type` accepts,
        e.g. `fedlang.type_at_clients(np.float32)`). With no types the computation is
        polymorphic: it is traced once per distinct argument type when called.

    Returns:
      A `Computation` (or a polymorphic computation) whose `type_signature` is, e.g.,
      `({float32}@CLIENTS -> float32@SERVER)`.

    Raises:
      TypeError: at trace time, naming the offending types and suggesting a fix.

    Example:
      >>> import numpy as np, fedlang as fl
      >>> @fl.federated_computation(fl.type_at_clients(np.float32))
      ... def get_average_temperature(t):
      ...   return fl.federated_mean(t)
      >>> str(get_average_temperature.type_signature)
      '({float32}@CLIENTS -> float32@SERVER)'
    """
    return decorator(param_types, lambda fn, ts: trace(fn, ts))


def decorator(param_types: tuple[Any, ...], build: Callable[[Callable, tuple], Any]) -> Any:
    """The forms shared by the computation decorators.

    `@deco` and `@deco()` on a function with parameters make it polymorphic (built
    once per argument type); `@deco(T1, T2)` builds it for those types; a function
    without parameters is built at once. `build(fn, param_types)` makes the computation.
    """
    if (
        len(param_types) == 1
        and callable(param_types[0])
        and not isinstance(param_types[0], type | types.Type)
        and not hasattr(param_types[0], "dtype")
    ):
        return decorator((), build)(param_types[0])

    def decorate(fn: Callable) -> Any:
        if not param_types and computation.parameter_names_of(fn):
            return Polymorphic(fn, build)
        return build(fn, param_types)

    return decorate
