"""The type system of federated computations.

Types print the way TensorFlow Federated users read them::

    float32                 a scalar tensor
    float32[?,784]          a tensor with an unknown leading dimension
    <x=float32,y=int32>     a struct with named fields
    sequence<float32[?]>    a stream of elements (a client's dataset)
    float32@SERVER          one value at the server
    {float32}@CLIENTS       one value per client
    float32@CLIENTS         one value shared by all clients (all-equal)
    (float32@CLIENTS -> float32@SERVER)
    sparse<float32[1000000,16]>

Python containers (dict, list, tuple, namedtuple, dataclass) map to `StructType`,
which remembers the container so values come back in the same shape.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

# ----------------------------------------------------------------------------
# Placements


@dataclasses.dataclass(frozen=True)
class Placement:
    """Where a federated value lives: `CLIENTS` or `SERVER`."""

    name: str
    default_all_equal: bool

    def __str__(self) -> str:
        return self.name

    def __repr__(self) -> str:
        return f"fedlang.{self.name}"


CLIENTS = Placement("CLIENTS", default_all_equal=False)
SERVER = Placement("SERVER", default_all_equal=True)
PLACEMENTS = {p.name: p for p in (CLIENTS, SERVER)}


# ----------------------------------------------------------------------------
# Types


class Frozen(abc.ABC):
    """Base of immutable values compared by structure: the types below, and IR nodes
    (`fedlang.core.ir.Node`).

    A subclass sets its attributes in `__init__`, then calls `_freeze()`; setting one
    afterwards raises `AttributeError`. Two values are equal when they are of the same
    class with equal `_key()`s, and hash alike; `repr` is the class name around `str`.
    """

    # What the immutability error calls the class, before its name (IR nodes: "IR node ").
    _label = ""

    @abc.abstractmethod
    def _key(self) -> tuple: ...

    @abc.abstractmethod
    def __str__(self) -> str: ...

    def __eq__(self, other: object) -> bool:
        return type(self) is type(other) and self._key() == other._key()  # type: ignore[attr-defined]

    def __hash__(self) -> int:
        return hash((type(self).__name__, self._key()))

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self})"

    def __setattr__(self, name: str, value: Any) -> None:
        if getattr(self, "_frozen", False):
            raise AttributeError(f"{self._label}{type(self).__name__} is immutable")
        object.__setattr__(self, name, value)

    def _freeze(self) -> None:
        object.__setattr__(self, "_frozen", True)


class Type(Frozen):
    """Base class of all fedlang types. Types are immutable values."""

    @abc.abstractmethod
    def is_assignable_from(self, source: Type) -> bool:
        """Whether a value of type `source` may be used where `self` is expected."""

    def children(self) -> Iterator[Type]:
        return iter(())

    def formatted_representation(self) -> str:
        """The type on several lines, one struct field per line (TFF's method of this
        name); `str(t)` is the one-line form.

        Example:
          >>> import numpy as np
          >>> print(to_type({'x': np.float32, 'y': {'z': (np.int32, [2])}})
          ...       .formatted_representation())
          <
            x=float32,
            y=<
              z=int32[2]
            >
          >
        """
        return "\n".join(line.rstrip() for line in _lines(self))


#: The string dtype: variable-width UTF-8 (NumPy's `StringDType`), printed `str` as in TFF.
STRING: np.dtype = np.dtypes.StringDType()


def is_string_dtype(dtype: Any) -> bool:
    """Whether `dtype` is fedlang's string dtype (`str`)."""
    return isinstance(dtype, np.dtype) and dtype.kind == "T"


def _dtype_name(dtype: np.dtype) -> str:
    if dtype.kind == "T":
        return "str"
    return "bool" if dtype == np.bool_ else dtype.name


def to_dtype(spec: Any) -> np.dtype:
    """Converts a dtype spec (np.float32, 'float32', jnp.int32, float, str...) to np.dtype.

    `str` (or `'str'`, or any NumPy unicode dtype) is the string dtype `STRING`.
    """
    if spec is str or (isinstance(spec, str) and spec == "str"):
        return STRING
    if spec is float:
        return np.dtype(np.float32)
    if spec is int:
        return np.dtype(np.int32)
    if spec is bool:
        return np.dtype(np.bool_)
    try:
        dtype = np.dtype(spec)
    except TypeError as e:
        raise TypeError(f"Expected a dtype (such as np.float32 or 'int32'), found {spec!r}.") from e
    if dtype.kind in "UT":
        # NumPy's fixed-width unicode ('<U5') and StringDType variants are all one type.
        return STRING
    if dtype.kind not in "biufc" and dtype.name not in _EXTRA_DTYPES:
        raise TypeError(
            f"Expected a numeric, boolean or string dtype, found {dtype}. Use `str` for text "
            "and decode bytes to str first."
        )
    return dtype


_EXTRA_DTYPES = {"bfloat16", "float8_e4m3fn", "float8_e5m2"}


Shape = tuple[int | None, ...]


def _to_shape(shape: Any) -> Shape:
    if shape is None:
        raise TypeError("A tensor shape must be a sequence of dimensions; use () for a scalar.")
    if isinstance(shape, int | np.integer):
        shape = (shape,)
    dims: list[int | None] = []
    for d in shape:
        if d is None or d == -1:
            dims.append(None)
        elif isinstance(d, int | np.integer) and d >= 0:
            dims.append(int(d))
        else:
            raise TypeError(
                f"Expected a dimension (a non-negative int, or None for unknown), found {d!r}."
            )
    return tuple(dims)


def _shape_str(shape: Shape) -> str:
    return ",".join("?" if d is None else str(d) for d in shape)


def _shape_assignable(target: Shape, source: Shape) -> bool:
    return len(target) == len(source) and all(t is None or t == s for t, s in zip(target, source))


class TensorType(Type):
    """A dense tensor: a dtype and a shape whose dimensions may be unknown (`None`)."""

    def __init__(self, dtype: Any, shape: Any = ()):
        self.dtype = to_dtype(dtype)
        self.shape: Shape = _to_shape(shape)
        self._freeze()

    def _key(self) -> tuple:
        return (self.dtype.str, self.shape)

    def __str__(self) -> str:
        name = _dtype_name(self.dtype)
        return f"{name}[{_shape_str(self.shape)}]" if self.shape else name

    @property
    def is_fully_defined(self) -> bool:
        return all(d is not None for d in self.shape)

    def is_assignable_from(self, source: Type) -> bool:
        return (
            isinstance(source, TensorType)
            and source.dtype == self.dtype
            and _shape_assignable(self.shape, source.shape)
        )


class SparseTensorType(Type):
    """A sparse tensor in COO form: int64 `indices[nnz, rank]`, `values[nnz]`, a dense shape."""

    def __init__(self, dtype: Any, dense_shape: Any):
        self.dtype = to_dtype(dtype)
        self.dense_shape: Shape = _to_shape(dense_shape)
        self._freeze()

    def _key(self) -> tuple:
        return (self.dtype.str, self.dense_shape)

    def __str__(self) -> str:
        return f"sparse<{_dtype_name(self.dtype)}[{_shape_str(self.dense_shape)}]>"

    def is_assignable_from(self, source: Type) -> bool:
        return (
            isinstance(source, SparseTensorType)
            and source.dtype == self.dtype
            and _shape_assignable(self.dense_shape, source.dense_shape)
        )


@dataclasses.dataclass(frozen=True)
class ContainerSpec:
    """How to rebuild the Python container a struct came from.

    `kind` is one of 'dict', 'list', 'tuple', 'namedtuple', 'dataclass'; `cls` is the
    class for namedtuples and dataclasses (None after deserialization in a process
    that does not have it, in which case a namedtuple with the same fields is used).
    """

    kind: str
    cls: Any = None
    name: str = ""


class StructType(Type):
    """An ordered struct of (name or None, type) fields.

    Args:
      elements: a sequence of types, of (name, type) pairs, or a mapping of name -> type.
        Each type may be anything `to_type` accepts.
      container: the Python container values of this type convert back into. It does
        not take part in equality.
    """

    def __init__(self, elements: Any, container: ContainerSpec | None = None):
        if isinstance(elements, Mapping):
            items = list(elements.items())
        else:
            items = []
            for e in elements:
                if isinstance(e, tuple) and len(e) == 2 and (e[0] is None or isinstance(e[0], str)):
                    items.append(e)
                else:
                    items.append((None, e))
        names = [n for n, _ in items if n is not None]
        if len(set(names)) != len(names):
            raise TypeError(f"Struct field names must be unique, found {names}.")
        self.elements: tuple[tuple[str | None, Type], ...] = tuple(
            (n, to_type(t)) for n, t in items
        )
        self.container = container
        self._freeze()

    def _key(self) -> tuple:
        return self.elements

    def __len__(self) -> int:
        return len(self.elements)

    def __iter__(self) -> Iterator[Type]:
        return (t for _, t in self.elements)

    def children(self) -> Iterator[Type]:
        return iter(self)

    @property
    def names(self) -> tuple[str | None, ...]:
        return tuple(n for n, _ in self.elements)

    @property
    def types(self) -> tuple[Type, ...]:
        return tuple(t for _, t in self.elements)

    def index_of(self, key: str | int) -> int:
        """The position of a field given by name or index; raises a helpful error."""
        if isinstance(key, int | np.integer):
            if not -len(self) <= key < len(self):
                raise IndexError(f"Index {key} is out of range for {self} ({len(self)} fields).")
            return int(key) % len(self)
        for i, (n, _) in enumerate(self.elements):
            if n == key:
                return i
        known = [n for n in self.names if n is not None]
        raise AttributeError(f"{self} has no field {key!r}; its fields are {known}.")

    def __getitem__(self, key: str | int) -> Type:
        return self.elements[self.index_of(key)][1]

    def __str__(self) -> str:
        return "<" + ",".join(str(t) if n is None else f"{n}={t}" for n, t in self.elements) + ">"

    def is_assignable_from(self, source: Type) -> bool:
        if not isinstance(source, StructType) or len(source) != len(self):
            return False
        for (tn, tt), (sn, st) in zip(self.elements, source.elements):
            if tn is not None and sn is not None and tn != sn:
                return False
            if not tt.is_assignable_from(st):
                return False
        return True


class SequenceType(Type):
    """A stream of elements (a client's dataset); never required to be materialized."""

    def __init__(self, element: Any):
        self.element = to_type(element)
        if isinstance(self.element, FederatedType | SequenceType | FunctionType):
            raise TypeError(
                f"A sequence holds tensors or structs of tensors, found {self.element}."
            )
        self._freeze()

    def _key(self) -> tuple:
        return (self.element,)

    def children(self) -> Iterator[Type]:
        yield self.element

    def __str__(self) -> str:
        return f"sequence<{self.element}>"

    def is_assignable_from(self, source: Type) -> bool:
        return isinstance(source, SequenceType) and self.element.is_assignable_from(source.element)


class FederatedType(Type):
    """A value placed at `CLIENTS` or `SERVER`.

    Args:
      member: the type of the value at each place (anything `to_type` accepts,
        such as `np.float32`).
      placement: `CLIENTS` or `SERVER`.
      all_equal: whether every place holds the same value. Defaults to True at the
        server and False at clients, as in TFF.
    """

    def __init__(self, member: Any, placement: Placement, all_equal: bool | None = None):
        if isinstance(placement, str) and placement.upper() in PLACEMENTS:
            placement = PLACEMENTS[placement.upper()]
        if not isinstance(placement, Placement):
            raise TypeError(
                f"Expected a placement (fedlang.CLIENTS or fedlang.SERVER), found {placement!r}."
            )
        self.member = to_type(member)
        if isinstance(self.member, FederatedType | FunctionType):
            raise TypeError(
                f"A federated value cannot hold a {self.member}; members are local types."
            )
        self.placement = placement
        self.all_equal = placement.default_all_equal if all_equal is None else bool(all_equal)
        self._freeze()

    def _key(self) -> tuple:
        return (self.member, self.placement.name, self.all_equal)

    def children(self) -> Iterator[Type]:
        yield self.member

    def __str__(self) -> str:
        member = str(self.member) if self.all_equal else "{" + str(self.member) + "}"
        return f"{member}@{self.placement}"

    def is_assignable_from(self, source: Type) -> bool:
        return (
            isinstance(source, FederatedType)
            and source.placement is self.placement
            and (source.all_equal or not self.all_equal)
            and self.member.is_assignable_from(source.member)
        )


class FunctionType(Type):
    """A function from `parameter` (None for no parameter) to `result`."""

    def __init__(self, parameter: Any, result: Any):
        self.parameter = None if parameter is None else to_type(parameter)
        self.result = to_type(result)
        self._freeze()

    def _key(self) -> tuple:
        return (self.parameter, self.result)

    def children(self) -> Iterator[Type]:
        if self.parameter is not None:
            yield self.parameter
        yield self.result

    def __str__(self) -> str:
        param = "" if self.parameter is None else str(self.parameter)
        return f"({param} -> {self.result})"

    def is_assignable_from(self, source: Type) -> bool:
        if not isinstance(source, FunctionType):
            return False
        if (self.parameter is None) != (source.parameter is None):
            return False
        if self.parameter is not None and not source.parameter.is_assignable_from(self.parameter):  # type: ignore[union-attr]
            return False
        return self.result.is_assignable_from(source.result)


class PlacementType(Type):
    """The type of a placement literal (`CLIENTS` or `SERVER`) passed to an intrinsic."""

    def __init__(self) -> None:
        self._freeze()

    def _key(self) -> tuple:
        return ()

    def __str__(self) -> str:
        return "placement"

    def is_assignable_from(self, source: Type) -> bool:
        return isinstance(source, PlacementType)


# ----------------------------------------------------------------------------
# Conversion from Python


def type_at_clients(member: Any, all_equal: bool = False) -> FederatedType:
    """`{member}@CLIENTS` (or `member@CLIENTS` when all_equal)."""
    return FederatedType(member, CLIENTS, all_equal=all_equal)


def type_at_server(member: Any) -> FederatedType:
    """`member@SERVER`."""
    return FederatedType(member, SERVER)


def is_namedtuple(value: Any) -> bool:
    return isinstance(value, tuple) and hasattr(type(value), "_fields")


def container_of(value: Any) -> ContainerSpec:
    if is_namedtuple(value) or (
        isinstance(value, type) and issubclass(value, tuple) and hasattr(value, "_fields")
    ):
        cls = value if isinstance(value, type) else type(value)
        return ContainerSpec("namedtuple", cls, cls.__name__)
    if dataclasses.is_dataclass(value):
        cls = value if isinstance(value, type) else type(value)
        return ContainerSpec("dataclass", cls, cls.__name__)
    if isinstance(value, Mapping):
        return ContainerSpec("dict")
    if isinstance(value, list):
        return ContainerSpec("list")
    return ContainerSpec("tuple")


def struct_items(value: Any) -> list[tuple[str | None, Any]]:
    """The (name, value) fields of a Python container, in order."""
    if is_namedtuple(value):
        return list(zip(type(value)._fields, value))
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [(f.name, getattr(value, f.name)) for f in dataclasses.fields(value)]
    if isinstance(value, Mapping):
        for k in value:
            if not isinstance(k, str):
                raise TypeError(
                    f"Struct field names must be strings, found key {k!r} in {type(value).__name__}."
                )
        return list(value.items())
    if isinstance(value, list | tuple):
        return [(None, v) for v in value]
    raise TypeError(
        f"Expected a Python container (dict, list, tuple, namedtuple, dataclass), found {type(value).__name__}."
    )


def is_container(value: Any) -> bool:
    return isinstance(value, Mapping | list | tuple) or (
        dataclasses.is_dataclass(value) and not isinstance(value, type)
    )


def _is_dtype_like(x: Any) -> bool:
    if isinstance(x, np.dtype):
        return True
    if isinstance(x, type) and (issubclass(x, np.generic) or x in (float, int, bool, str)):
        return True
    if isinstance(x, str):
        try:
            np.dtype(x)
        except TypeError:
            return False
        return True
    return hasattr(x, "dtype") and isinstance(x, type)  # jnp.float32 and friends


def _is_shape_like(x: Any) -> bool:
    return isinstance(x, list | tuple) and all(d is None or isinstance(d, int) for d in x)


def to_type(spec: Any) -> Type:
    """Converts a type spec or a Python value to a fedlang `Type`.

    Accepts: a `Type`; a dtype (`np.float32`, `'int32'`, `jnp.float32`, Python
    `float`/`int`/`bool`); a `(dtype, shape)` pair; a `jax.ShapeDtypeStruct` (use None
    for unknown dimensions); an array or scalar value (its exact type); a `SparseTensor`;
    an object with an `element_spec` (a dataset: a sequence type); and containers of
    these (dict, list, tuple, namedtuple, dataclass), which become struct types.

    Raises:
      TypeError: when the spec cannot be converted; the message says what was found.

    Example:
      >>> import numpy as np
      >>> str(to_type({'x': (np.float32, [None, 784]), 'y': np.int32}))
      '<x=float32[?,784],y=int32>'
    """
    if isinstance(spec, Type):
        return spec
    if spec is None:
        raise TypeError("Expected a type spec, found None.")
    if isinstance(spec, bool | np.bool_):
        return TensorType(np.bool_)
    if isinstance(spec, int) and not isinstance(spec, bool):
        return TensorType(np.int32)
    if isinstance(spec, float):
        return TensorType(np.float32)
    if isinstance(spec, np.generic):
        return TensorType(spec.dtype)
    if _is_dtype_like(spec):
        return TensorType(spec)
    sparse_type = getattr(spec, "fedlang_sparse_type", None)
    if sparse_type is not None:
        return sparse_type() if callable(sparse_type) else sparse_type
    if hasattr(spec, "shape") and hasattr(spec, "dtype") and not isinstance(spec, type):
        # np.ndarray, jax.Array, jax.ShapeDtypeStruct
        shape = tuple(None if not isinstance(d, int | np.integer) else int(d) for d in spec.shape)
        return TensorType(spec.dtype, shape)
    if hasattr(spec, "element_spec") and not isinstance(spec, type):
        return SequenceType(to_type(spec.element_spec))
    if (
        isinstance(spec, tuple)
        and len(spec) == 2
        and not is_namedtuple(spec)
        and _is_dtype_like(spec[0])
        and _is_shape_like(spec[1])
    ):
        return TensorType(spec[0], spec[1])
    if is_container(spec):
        return StructType(
            [(n, to_type(v)) for n, v in struct_items(spec)], container=container_of(spec)
        )
    if isinstance(spec, str):
        raise TypeError(
            f"Expected a dtype name such as 'float32', found the type string {spec!r}. fedlang "
            "builds types from Python specs, not from strings: (np.float32, [None, 784]) for "
            "float32[?,784], SequenceType(np.float32) for sequence<float32> (TFF's float32*), "
            "{'x': ..., 'y': ...} for <x=...,y=...>, type_at_clients(...) for {...}@CLIENTS."
        )
    raise TypeError(
        f"Cannot convert {type(spec).__name__} {spec!r:.80} to a fedlang type. Expected a "
        "fedlang Type, a dtype, a (dtype, shape) pair, an array, or a container of these."
    )


def infer_value_type(value: Any) -> Type:
    """The type of a concrete Python value (Python floats are float32, ints int32).

    Unlike `to_type`, a Python `str` here is a value (`'Hello'` has type `str`), never a
    dtype name, also inside containers.
    """
    if isinstance(value, str):
        return TensorType(STRING)
    if is_container(value) and not (
        hasattr(value, "shape") and hasattr(value, "dtype")
    ) and getattr(value, "fedlang_sparse_type", None) is None:
        return StructType(
            [(n, infer_value_type(v)) for n, v in struct_items(value)],
            container=container_of(value),
        )
    return to_type(value)


# ----------------------------------------------------------------------------
# Helpers over types


def contains_federated(t: Type) -> bool:
    if isinstance(t, FederatedType):
        return True
    return any(contains_federated(c) for c in t.children() if not isinstance(t, FunctionType))


def is_numeric(t: Type, kinds: str = "iufcb") -> bool:
    """True if every tensor leaf of `t` has a dtype of the given numpy kinds."""
    if isinstance(t, TensorType | SparseTensorType):
        return t.dtype.kind in kinds or (t.dtype.name in _EXTRA_DTYPES and "f" in kinds)
    if isinstance(t, StructType):
        return all(is_numeric(c, kinds) for c in t)
    return False


def tensor_leaves(t: Type) -> list[Type]:
    """The tensor (and sparse) leaves of a struct type, in order."""
    if isinstance(t, StructType):
        return [leaf for c in t for leaf in tensor_leaves(c)]
    return [t]


def check_local(t: Type, what: str) -> None:
    if contains_federated(t) or isinstance(t, FunctionType):
        raise TypeError(f"{what} must be a local (placement-free) type, found {t}.")


def describe(value: Any) -> str:
    """A short human description of a Python value for error messages."""
    if hasattr(value, "type_signature"):
        return f"a value of type {value.type_signature}"
    r = repr(value)
    return f"{type(value).__name__} {r[:60]}{'...' if len(r) > 60 else ''}"


__all__ = [
    "CLIENTS",
    "SERVER",
    "STRING",
    "ContainerSpec",
    "FederatedType",
    "FunctionType",
    "Placement",
    "PlacementType",
    "SequenceType",
    "SparseTensorType",
    "StructType",
    "TensorType",
    "Type",
    "to_type",
    "type_at_clients",
    "type_at_server",
]


# -- TFF's multi-line form (Type.formatted_representation)


def _combine(parts: list[list[str]]) -> list[str]:
    """Joins parts: each part's first line continues the previous part's last line."""
    lines = [""]
    for part in parts:
        lines[-1] += part[0]
        lines.extend(part[1:])
    return lines


def _lines(t: Type) -> list[str]:
    if isinstance(t, StructType):
        if not len(t):
            return ["<>"]
        fields: list[list[str]] = []
        for i, (name, member) in enumerate(t.elements):
            if i:
                fields.append([",", ""])
            member_lines = _lines(member)
            fields.append(member_lines if name is None else _combine([[f"{name}="], member_lines]))
        inner = ["  " + line for line in _combine(fields)]
        return _combine([["<", ""], inner, ["", ">"]])
    if isinstance(t, FederatedType):
        member_lines = _lines(t.member)
        if t.all_equal:
            return _combine([member_lines, [f"@{t.placement}"]])
        return _combine([["{"], member_lines, ["}"], [f"@{t.placement}"]])
    if isinstance(t, FunctionType):
        parameter = [""] if t.parameter is None else _lines(t.parameter)
        return _combine([["("], parameter, [" -> "], _lines(t.result), [")"]])
    if isinstance(t, SequenceType):
        return _combine([["sequence<"], _lines(t.element), [">"]])
    return [str(t)]
