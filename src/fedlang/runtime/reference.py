"""The reference runtime: a direct interpreter of the IR, the oracle for every test.

Clients are Python lists: a CLIENTS-placed argument is passed as a list with one entry
per client, an all-equal value as a single value. Client datasets may be any iterable
of batches (lazy generators included); they are consumed as streams. Intrinsics run
the reference semantics of `fedlang.core.intrinsics.TABLE`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping, Sized
from typing import Any, cast

from fedlang.core import client_state, computation, intrinsics, ir, local, structure, types

# The values the interpreter holds, named for readers. They alias `Any`: which one a
# value is follows its fedlang type, and the code reads the type.

#: A value of any type: a local value in internal form (`fedlang.core.structure`), a
#: struct of values as a tuple, a SERVER value as its member's value, a CLIENTS value
#: `PerClient`, a function as a `Function`, a placement.
Value = Any
#: A CLIENTS value as the interpreter holds it: a list with one value per client
#: (all-equal values too), or a `ClientStates` binding the caller passed for one. (The
#: simulation runtime makes it a lazy graph, `lazy.ClientsValue`.)
PerClient = Any
#: A function value: a `Closure`, an intrinsic, or a local computation.
Function = Any
#: Applies a function value to an argument (`Interpreter.call`).
Call = Callable[[Function, Value], Value]
#: The values of the names in scope.
Env = dict[str, Value]
#: A value as users pass and receive it: in the container its type remembers
#: (`structure.to_python`), a CLIENTS value as a list with one entry per client.
PythonValue = Any
#: Why a runtime cannot run an intrinsic at a type, or None when it can.
Refuse = Callable[[intrinsics.IntrinsicDef, types.FunctionType], str | None]


@dataclasses.dataclass
class Closure:
    fn: ir.Lambda
    env: Env


@dataclasses.dataclass
class _IntrinsicFn:
    definition: intrinsics.IntrinsicDef
    type_signature: types.FunctionType


class Interpreter:
    """Evaluates IR with a known number of clients (see `ReferenceContext`)."""

    def __init__(self, num_clients: int | None):
        self._num_clients = num_clients

    @property
    def num_clients(self) -> int:
        if self._num_clients is None:
            raise ValueError(
                "The number of clients is unknown: no CLIENTS-placed argument was given. Pass one, or "
                "run in fedlang.runtime.reference_context(num_clients=N)."
            )
        return self._num_clients

    def call(self, fn: Function, arg: Value) -> Value:
        if isinstance(fn, Closure):
            env = dict(fn.env)
            if fn.fn.parameter_name is not None:
                env[fn.fn.parameter_name] = arg
            return self.eval(fn.fn.result, env)
        if isinstance(fn, _IntrinsicFn):
            return fn.definition.impl(arg, fn.type_signature.parameter, self)  # type: ignore[arg-type]
        if local.is_local(fn):
            return fn.invoke(arg)
        raise TypeError(f"Cannot call {fn!r}: it is not a function value.")

    def eval(self, node: ir.Node, env: Env) -> Value:
        if isinstance(node, ir.Reference):
            if node.name not in env:
                raise NameError(f"Unbound reference {node.name!r} in the IR.")
            return env[node.name]
        if isinstance(node, ir.Block):
            env = dict(env)
            for name, value in node.locals:
                env[name] = self.eval(value, env)
            return self.eval(node.result, env)
        if isinstance(node, ir.Call):
            fn = self.eval(node.function, env)
            arg = None if node.argument is None else self.eval(node.argument, env)
            return self.call(fn, arg)
        if isinstance(node, ir.Lambda):
            return Closure(node, env)
        if isinstance(node, ir.Selection):
            return self.eval(node.source, env)[node.index]
        if isinstance(node, ir.Struct):
            return tuple(self.eval(v, env) for _, v in node.elements)
        if isinstance(node, ir.Intrinsic):
            return _IntrinsicFn(intrinsics.lookup(node.uri), node.type_signature)  # type: ignore[arg-type]
        if isinstance(node, ir.Literal):
            return node.value
        if isinstance(node, ir.PlacementLiteral):
            return node.placement
        if isinstance(node, ir.Local):
            return node.computation
        if isinstance(node, ir.Data):
            raise ValueError(
                f"The reference runtime cannot resolve {node}; pass the data as an argument."
            )
        raise TypeError(f"Unknown IR node {node!r}.")


# ----------------------------------------------------------------------------
# Converting federated arguments and results


def _where(path: str) -> str:
    return path or "the argument"


def count_clients(
    value: PythonValue, t: types.Type | None, path: str, found: dict[str, int]
) -> None:
    """Records the number of entries of every per-client (non-all-equal CLIENTS) value."""
    if t is None:
        return
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            if isinstance(value, client_state.ClientStates):
                found[path or "the argument"] = len(value)
                return
            if (
                isinstance(value, str | bytes | Mapping)
                or not isinstance(value, Iterable)
                or hasattr(value, "element_spec")
            ):
                raise TypeError(
                    f"Expected {_where(path)} of type {t} to be a list with one entry per client, found "
                    f"{types.describe(value)}."
                )
            found[path or "the argument"] = (
                len(cast(Sized, value)) if hasattr(value, "__len__") else -1
            )
        return
    if isinstance(t, types.StructType) and types.contains_federated(t):
        for i, (n, et, v) in enumerate(structure.match_fields(value, t, path)):
            count_clients(v, et, f"{path}{structure.field_path(n, i)}", found)


def infer_num_clients(value: PythonValue, t: types.Type | None, default: int | None) -> int | None:
    found: dict[str, int] = {}
    count_clients(value, t, "", found)
    counts = {p: c for p, c in found.items() if c >= 0}
    if len(set(counts.values())) > 1:
        listing = ", ".join(f"{p} has {c}" for p, c in counts.items())
        raise ValueError(
            f"CLIENTS-placed arguments have different numbers of clients: {listing}. Pass one entry per client in each."
        )
    if counts:
        return next(iter(counts.values()))
    return default


def to_internal(value: PythonValue, t: types.Type | None, n: int | None, path: str = "") -> Value:
    """Validates a Python argument against `t` and converts it for the interpreter."""
    if t is None:
        return None
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            if isinstance(value, client_state.ClientStates):
                # A binding to client states: the runtime reads it where it reads client data.
                client_state.check_binding(value, t, path)
                return value
            values = list(value)
            return [
                structure.to_internal(v, t.member, f"{path}[client {i}]")
                for i, v in enumerate(values)
            ]
        member = structure.to_internal(value, t.member, path)
        if t.placement is types.CLIENTS:
            if n is None:
                raise ValueError(
                    f"Cannot place {_where(path)} ({t}) at every client: the number of clients is unknown. "
                    "Pass a per-client argument or use reference_context(num_clients=N)."
                )
            return [member] * n
        return member
    if isinstance(t, types.FunctionType):
        if not isinstance(value, computation.Computation) or not t.is_assignable_from(
            value.type_signature
        ):
            found = getattr(value, "type_signature", None) or types.describe(value)
            raise TypeError(
                f"Expected a computation of type {t} for {_where(path)}, found {found}."
            )
        node = value.to_ir()
        return Closure(node, {}) if isinstance(node, ir.Lambda) else node.computation
    if isinstance(t, types.StructType) and (
        types.contains_federated(t) or any(isinstance(x, types.FunctionType) for x in t)
    ):
        return tuple(
            to_internal(v, et, n, f"{path}{structure.field_path(nm, i)}")
            for i, (nm, et, v) in enumerate(structure.match_fields(value, t, path))
        )
    return structure.to_internal(value, t, path)


def to_python(value: Value, t: types.Type) -> PythonValue:
    """Converts an interpreter result to what users see."""
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS:
            if t.all_equal:
                return structure.to_python(value[0], t.member) if value else None
            return [structure.to_python(v, t.member) for v in value]
        return structure.to_python(value, t.member)
    if isinstance(t, types.StructType):
        return structure.build_container([to_python(v, et) for v, et in zip(value, t.types)], t)
    if isinstance(t, types.FunctionType):
        raise TypeError(f"A computation cannot return a function ({t}) to Python.")
    return structure.to_python(value, t)


def check_runtime_supports(ctx: Any, comp: computation.Computation) -> None:
    """Refuses, before anything runs, a computation using an intrinsic `ctx` cannot run.

    A context that cannot run some intrinsics sets `refuse(definition, fn_type) -> reason
    or None`; the reference and simulation runtimes run them all (`refuse` is None).
    """
    refuse = getattr(ctx, "refuse", None)
    if refuse is not None:
        intrinsics.check_supported(comp.to_ir(), ctx.name, refuse)


class ReferenceContext:
    """Runs computations with the reference interpreter.

    Args:
      num_clients: the number of clients to use when no CLIENTS-placed argument says
        (e.g. a computation that only broadcasts and sums).
    """

    name = "reference"
    refuse: Refuse | None = None  # runs every intrinsic, by its reference semantics

    def __init__(self, num_clients: int | None = None):
        self.num_clients = num_clients

    def invoke(self, comp: computation.Computation, arg: PythonValue) -> PythonValue:
        # Client-state bindings are read whole, and written back and committed whole.
        return client_state.invoke_plainly(self._invoke, comp, arg)

    def _invoke(self, comp: computation.Computation, arg: PythonValue) -> PythonValue:
        check_runtime_supports(self, comp)
        t = comp.type_signature
        n = infer_num_clients(arg, t.parameter, self.num_clients)
        internal = to_internal(arg, t.parameter, n)
        interp = Interpreter(n)
        node = comp.to_ir()
        fn = interp.eval(node, {}) if isinstance(node, ir.Lambda) else node.computation
        return to_python(interp.call(fn, internal), t.result)
