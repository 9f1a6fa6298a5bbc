"""The intrinsic registry: the single source of truth for federated operators.

Each intrinsic is one `IntrinsicDef`: its URI, its kind, its type rule (argument type
-> result type, raising `TypeError` with a fix) and its reference semantics over
internal values (CLIENTS values are Python lists with one entry per client). Tracing
records calls by URI (`tracing.call_intrinsic`); the reference runtime runs the
semantics; every other runtime declares a strategy table `{uri: implementation}` and
falls back to the semantics where that is valid, or refuses an intrinsic before
running anything (`check_supported`).

The standard intrinsics are defined in `intrinsic_defs` (and the sparse family in
`sparse_intrinsics`); a new one is a single `define(...)` call, anywhere:

    >>> import numpy as np
    >>> from fedlang.core import intrinsics, types
    >>> def rule(t):
    ...     member = intrinsics.expect_federated(t, "my_count", types.CLIENTS).member
    ...     return types.FederatedType(types.TensorType(np.int32), types.SERVER)
    >>> d = intrinsics.define(
    ...     "my_count", intrinsics.Kind.AGGREGATE, "({T}@CLIENTS -> int32@SERVER)",
    ...     rule, lambda arg, t, rt: np.int32(len(arg)), replace=True)
    >>> d.kind.name
    'AGGREGATE'
    >>> del intrinsics.TABLE["my_count"]  # (keeps the table as it was)
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np

from fedlang.core import ir, structure, types


class Kind(enum.Enum):
    """What an intrinsic does, which tells a runtime how it may execute it."""

    VALUE = "value"  # places a local value (federated_value, federated_eval)
    BROADCAST = "broadcast"  # SERVER -> CLIENTS
    MAP = "map"  # pointwise at a placement (federated_map, federated_zip)
    AGGREGATE = "aggregate"  # CLIENTS -> SERVER
    SECURE_AGGREGATE = "secure aggregate"  # CLIENTS -> SERVER, only the sum is revealed
    SELECT = "select"  # SERVER data selected per client (federated_select)
    SEQUENCE = "sequence"  # over a dataset, locally or pointwise at a placement


class Runtime(Protocol):
    """What reference semantics need from the runtime executing them."""

    @property
    def num_clients(self) -> int: ...

    def call(self, fn: Any, arg: Any) -> Any:
        """Applies a function value (a local computation or an IR lambda) to an internal arg."""


@dataclasses.dataclass(frozen=True)
class IntrinsicDef:
    """One intrinsic: name, kind, type rule and reference semantics.

    Attributes:
      uri: its name in the IR (e.g. "federated_sum").
      kind: its `Kind`.
      signature: its type signature in TFF notation, for docs and errors.
      type_rule: argument type -> result type; raises `TypeError` naming the fix.
      impl: the reference semantics `impl(arg, arg_type, runtime) -> result` on
        internal values.
      empty: for aggregations, the result over no clients as a function of the member
        type (e.g. zeros for a sum, NaN for a mean); None when it has no such value.
    """

    uri: str
    kind: Kind
    signature: str
    type_rule: Callable[[types.Type], types.Type]
    impl: Callable[[Any, types.Type, Runtime], Any]
    empty: Callable[[types.Type], Any] | None = None


TABLE: dict[str, IntrinsicDef] = {}


def define(
    uri: str,
    kind: Kind,
    signature: str,
    type_rule: Callable[[types.Type], types.Type],
    impl: Callable[[Any, types.Type, Runtime], Any],
    empty: Callable[[types.Type], Any] | None = None,
    replace: bool = False,
) -> IntrinsicDef:
    """Registers an intrinsic; returns its definition.

    Args:
      uri: the name the IR refers to it by.
      kind: what it does (see `Kind`).
      signature: its type signature in TFF notation (for docs and error messages).
      type_rule: argument type -> result type, raising `TypeError` for a wrong argument.
      impl: reference semantics `impl(arg, arg_type, runtime)` over internal values.
      empty: for aggregations, the result over an empty cohort given the member type.
      replace: allow redefining an existing URI (for tests and notebooks).

    Raises:
      ValueError: when `uri` is already defined and `replace` is False.
    """
    if not isinstance(kind, Kind):
        raise TypeError(f"Expected an intrinsics.Kind, found {kind!r}.")
    if uri in TABLE and not replace:
        raise ValueError(f"The intrinsic {uri!r} is already defined; pick another name.")
    definition = IntrinsicDef(uri, kind, signature, type_rule, impl, empty)
    TABLE[uri] = definition
    return definition


def lookup(uri: str) -> IntrinsicDef:
    """The definition of `uri`; raises `ValueError` naming the known intrinsics."""
    if uri not in TABLE:
        raise ValueError(f"Unknown intrinsic {uri!r}; known intrinsics are {sorted(TABLE)}.")
    return TABLE[uri]


class UnsupportedIntrinsicError(TypeError):
    """A runtime cannot execute an intrinsic that a computation uses."""


def check_supported(
    node: ir.Node,
    runtime_name: str,
    refuse: Callable[[IntrinsicDef, types.FunctionType], str | None],
) -> None:
    """Fails before anything runs if `refuse` objects to an intrinsic `node` uses.

    Args:
      node: the computation's IR.
      runtime_name: the runtime, for the message.
      refuse: `(definition, type) -> reason or None` for each intrinsic call site.

    Raises:
      UnsupportedIntrinsicError: naming the intrinsic, its type, the runtime and why.
    """
    for n in ir.walk(node):
        if isinstance(n, ir.Intrinsic):
            fn_type = n.type_signature
            assert isinstance(fn_type, types.FunctionType)
            reason = refuse(lookup(n.uri), fn_type)
            if reason:
                raise UnsupportedIntrinsicError(
                    f"The {runtime_name} runtime cannot run {n.uri} of type {fn_type}: {reason}"
                )


# ----------------------------------------------------------------------------
# Type-rule helpers, for definitions here and elsewhere


def expect_federated(
    t: types.Type, uri: str, placement: types.Placement | None = None, hint: str = ""
) -> types.FederatedType:
    """`t` as a federated type (at `placement`, if given), else a `TypeError` with `hint`."""
    if not isinstance(t, types.FederatedType) or (
        placement is not None and t.placement is not placement
    ):
        where = f"a value placed at {placement}" if placement else "a federated value"
        raise TypeError(f"{uri} expects {where}, found {t}.{(' ' + hint) if hint else ''}")
    return t


def struct_args(t: types.Type, n: int, uri: str) -> tuple[types.Type, ...]:
    """The element types of a struct of `n` arguments."""
    if not isinstance(t, types.StructType) or len(t) != n:
        raise TypeError(f"{uri} expects {n} arguments, found {t}.")
    return t.types


def expect_numeric(t: types.Type, uri: str, kinds: str = "iufc", what: str = "numbers") -> None:
    """Checks that `t` is dense tensors (or structs of them) of the dtype `kinds`."""
    if not types.is_numeric(t, kinds) or any(
        isinstance(x, types.SparseTensorType) for x in types.tensor_leaves(t)
    ):
        raise TypeError(f"{uri} expects {what} (tensors or structs of tensors), found {t}.")


def expect_function(t: types.Type, uri: str, what: str = "a function") -> types.FunctionType:
    """`t` as a function type."""
    if not isinstance(t, types.FunctionType):
        raise TypeError(f"{uri} expects {what}, found a value of type {t}.")
    return t


def check_parameter(fn: types.FunctionType, arg: types.Type, uri: str) -> None:
    """Checks that a function of type `fn` accepts an argument of type `arg`."""
    if fn.parameter is None or not fn.parameter.is_assignable_from(arg):
        raise TypeError(f"{uri}: the function of type {fn} cannot take an argument of type {arg}.")


# ----------------------------------------------------------------------------
# Values the semantics need


def zeros(t: types.Type) -> Any:
    """Zeros of a local type, internal form (unknown dimensions have size 0)."""
    return full(t, 0)


def full(t: types.Type, fill: Any) -> Any:
    """A local type's value filled with `fill` (a scalar, or a function of the dtype)."""

    def leaf(lt: types.TensorType) -> np.ndarray:
        value = fill(lt.dtype) if callable(fill) else fill
        return np.full([d or 0 for d in lt.shape], value, lt.dtype)

    return structure.unflatten([leaf(lt) for lt in structure.leaf_types(t)], t)


def dtype_max(dt: np.dtype) -> Any:
    """The largest value of a real dtype (the identity of a minimum)."""
    return np.finfo(dt).max if dt.kind == "f" else np.iinfo(dt).max


def dtype_min(dt: np.dtype) -> Any:
    """The smallest value of a real dtype (the identity of a maximum)."""
    return np.finfo(dt).min if dt.kind == "f" else np.iinfo(dt).min
