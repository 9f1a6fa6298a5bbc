"""Converting local values between Python containers and fedlang's internal form.

Inside runtimes a struct value is a plain Python tuple of its elements in field
order (the names live in the type), a tensor is an array, a sparse tensor is a
`SparseTensor`, and a sequence is any iterable. Values come back to users in the
container their type remembers (dict, list, tuple, namedtuple, dataclass).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, cast

import numpy as np

from fedlang.core import sparse, type_format, types


def _where(path: str) -> str:
    return f" at {path}" if path else ""


def _check_shape(arr: np.ndarray, t: types.TensorType, path: str) -> None:
    if not types._shape_assignable(t.shape, arr.shape):
        found = types.TensorType(arr.dtype, arr.shape)
        hint = ""
        if len(t.shape) == len(arr.shape) + 1 and types._shape_assignable(t.shape[1:], arr.shape):
            hint = (
                " It looks like one example where a batch of examples is expected: batch the "
                "dataset (e.g. dataset.batch(20)) so that each element is a batch."
            )
        raise TypeError(f"Expected a value of type {t}{_where(path)}, found {found}.{hint}")


def to_tensor(value: Any, t: types.TensorType, path: str = "") -> np.ndarray:
    """Converts an array-like to a NumPy array of type `t`, allowing safe casts only.

    Python numbers and lists convert to `t.dtype`; arrays may be cast within the same
    kind (float64 -> float32) but never across kinds (float -> int).
    """
    if type(value) is np.ndarray and value.dtype == t.dtype:  # the hot path: one check per batch
        _check_shape(value, t, path)
        return value
    if types.is_string_dtype(t.dtype):
        return _to_string_tensor(value, t, path)
    if isinstance(value, str | bytes) or (
        types.is_container(value) and not isinstance(value, list | tuple)
    ):
        raise _mismatch(value, t, path)
    if hasattr(value, "dtype") and hasattr(value, "shape"):
        arr = np.asarray(value)
        if arr.dtype != t.dtype:
            if not np.can_cast(arr.dtype, t.dtype, "same_kind"):
                raise TypeError(
                    f"Expected a value of type {t}{_where(path)}, found an array of dtype "
                    f"{arr.dtype}; convert it explicitly (e.g. x.astype('{t.dtype}'))."
                )
            arr = arr.astype(t.dtype)
    else:
        arr = _as_array(value, t, path)
        if arr.dtype.kind not in "biufc":
            raise _mismatch(value, t, path)
        if (arr.dtype.kind == "f" and t.dtype.kind in "iub") or (
            arr.dtype.kind in "iu" and t.dtype.kind == "b"
        ):
            raise _mismatch(value, t, path)
        arr = arr.astype(t.dtype)
    _check_shape(arr, t, path)
    return arr


def _mismatch(value: Any, t: types.TensorType, path: str) -> TypeError:
    return TypeError(
        f"Expected a value of type {type_format.for_message(t)}{_where(path)}, found "
        f"{types.describe(value)}."
    )


def _as_array(value: Any, t: types.TensorType, path: str) -> np.ndarray:
    """`np.asarray(value)`, or the type error naming what was found."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError) as e:
        raise _mismatch(value, t, path) from e


def _to_string_tensor(value: Any, t: types.TensorType, path: str) -> np.ndarray:
    """A `str` tensor from Python strings, lists of them, or unicode/string arrays.

    Numbers are never turned into text: `1` for a `str` is an error, not `'1'`."""
    arr = _as_array(value, t, path)
    if arr.dtype.kind in "OS" and all(isinstance(x, str | bytes) for x in arr.ravel()):
        # Text read as bytes (TFF's tf.string, files, Arrow binary columns) is UTF-8.
        try:
            items = [x.decode("utf-8") if isinstance(x, bytes) else x for x in arr.ravel()]
        except UnicodeDecodeError as e:
            raise TypeError(
                f"Expected UTF-8 text for a value of type {t}{_where(path)}, found bytes that are "
                f"not UTF-8 ({e.reason}); decode them with the right codec first."
            ) from e
        arr = np.asarray(items, dtype=types.STRING).reshape(arr.shape)
    if arr.dtype.kind not in "UT":
        raise _mismatch(value, t, path)
    arr = arr.astype(types.STRING)
    _check_shape(arr, t, path)
    return arr


def to_internal(value: Any, t: types.Type, path: str = "") -> Any:
    """Validates a Python value against a local type and converts it to internal form.

    Raises:
      TypeError: naming the expected type, what was found and where (`path`).
    """
    if isinstance(t, types.TensorType):
        return to_tensor(value, t, path)
    if isinstance(t, types.SparseTensorType):
        if not isinstance(value, sparse.SparseTensor):
            raise TypeError(
                f"Expected a fedlang.SparseTensor of type {t}{_where(path)}, found {types.describe(value)}."
            )
        if not t.is_assignable_from(value.fedlang_sparse_type):
            raise TypeError(
                f"Expected a value of type {t}{_where(path)}, found {value.fedlang_sparse_type}."
            )
        return value
    if isinstance(t, types.StructType):
        return tuple(
            to_internal(v, et, f"{path}{field_path(n, i)}")
            for i, (n, et, v) in enumerate(match_fields(value, t, path))
        )
    if isinstance(t, types.SequenceType):
        if isinstance(value, str | bytes | Mapping) or not isinstance(value, Iterable):
            raise TypeError(
                f"Expected a dataset (any iterable of elements of type {t.element}){_where(path)}, "
                f"found {types.describe(value)}."
            )
        return Stream(value, t.element, path)
    raise TypeError(f"Cannot pass a Python value for type {t}{_where(path)}.")


def field_path(name: str | None, i: int) -> str:
    """How field `i` (named `name`, or not) is written in a path: `.name` or `[i]`."""
    return f".{name}" if name is not None else f"[{i}]"


def match_fields(
    value: Any, t: types.StructType, path: str
) -> list[tuple[str | None, types.Type, Any]]:
    """`(name, type, value)` per field of `t`, taking the fields of a Python container by
    name (dicts, namedtuples, dataclasses) or position; raises `TypeError` at `path`."""
    if (
        isinstance(value, tuple)
        and not types.is_namedtuple(value)
        and len(value) == len(t)
        and all(n is None for n in t.names)
    ):
        return [(None, et, v) for (_, et), v in zip(t.elements, value)]
    if not types.is_container(value):
        raise TypeError(
            f"Expected a struct of type {type_format.for_message(t)}{_where(path)}, found "
            f"{types.describe(value)}."
        )
    items = types.struct_items(value)
    if len(items) != len(t):
        raise TypeError(
            f"Expected a struct of {len(t)} fields {list(t.names)}{_where(path)}, found "
            f"{len(items)} fields {[n for n, _ in items]}; the whole type is {type_format.for_message(t)}."
        )
    named = {n: v for n, v in items if n is not None}
    out: list[tuple[str | None, types.Type, Any]] = []
    for i, (n, et) in enumerate(t.elements):
        if n is not None and named:
            if n not in named:
                raise TypeError(
                    f"Expected a field {n!r}{_where(path)}, found fields {list(named)}; the "
                    f"struct's type is {type_format.for_message(t)}."
                )
            out.append((n, et, named[n]))
        else:
            out.append((n, et, items[i][1]))
    return out


class Stream:
    """A lazily converted sequence: iterating converts and checks each element.

    Each iteration starts a fresh pass over the underlying iterable (a one-shot
    generator can therefore be iterated once).
    """

    def __init__(self, source: Iterable, element_type: types.Type, path: str = ""):
        self.source = source
        self.element_type = element_type
        self.path = path

    @property
    def replayable(self) -> bool:
        """Whether iterating again gives the same elements (a list, or a dataset recipe),
        unlike a one-shot generator or iterator."""
        return isinstance(self.source, list | tuple) or hasattr(self.source, "element_spec")

    def __iter__(self) -> Iterator[Any]:
        fast = _fast_converter(self.element_type)
        for i, element in enumerate(self.source):
            out = fast(element) if fast is not None else _MISS
            if out is _MISS:  # not the common case: the full check, with a precise error
                out = to_internal(element, self.element_type, f"{self.path}<element {i}>")
            yield out


_MISS = object()
_CONVERTERS: dict[types.Type, Any] = {}


def _fast_converter(t: types.Type) -> Any:
    """A converter for elements that already have exactly the right form (NumPy arrays
    of the right dtype in dicts with the right keys), returning `_MISS` otherwise; None
    when `t` has no such fast form. Built once per type: it runs for every batch."""
    if t not in _CONVERTERS:
        _CONVERTERS[t] = _build_fast(t)
    return _CONVERTERS[t]


def _build_fast(t: types.Type) -> Any:
    if isinstance(t, types.TensorType):
        dtype, shape = t.dtype, t.shape
        rank = len(shape)

        def tensor(v: Any) -> Any:
            ok = type(v) is np.ndarray and v.dtype == dtype and v.ndim == rank
            if ok and all(d is None or d == s for d, s in zip(shape, v.shape)):
                return v
            return _MISS

        return tensor
    if isinstance(t, types.StructType) and len(t) and all(n is not None for n in t.names):
        fields = [(n, _build_fast(et)) for n, et in t.elements]
        if any(f is None for _, f in fields):
            return None
        n_fields = len(fields)

        def struct(v: Any) -> Any:
            if type(v) is not dict or len(v) != n_fields:
                return _MISS
            out = []
            for name, convert in fields:
                x = v.get(name, _MISS)
                if x is _MISS or (x := convert(x)) is _MISS:
                    return _MISS
                out.append(x)
            return tuple(out)

        return struct
    return None


def to_python(value: Any, t: types.Type) -> Any:
    """Converts an internal value to what users see: numpy values in their containers."""
    if isinstance(t, types.TensorType):
        arr = np.asarray(value)
        if arr.dtype.kind == "U":  # a runtime stacked strings into NumPy's fixed width
            arr = arr.astype(types.STRING)
        return arr[()] if arr.ndim == 0 else arr
    if isinstance(t, types.StructType):
        return build_container([to_python(v, et) for v, et in zip(value, t.types)], t)
    if isinstance(t, types.SequenceType):
        return (
            [to_python(e, t.element) for e in value]
            if not isinstance(value, Stream)
            else value.source
        )
    return value


def build_container(values: list[Any], t: types.StructType) -> Any:
    """Builds the Python container of struct type `t` from its element values."""
    spec = t.container
    names = t.names
    if spec is None:
        if all(n is not None for n in names) and names:
            spec = types.ContainerSpec("dict")
        else:
            spec = types.ContainerSpec("tuple")
    if spec.kind == "dict":
        if any(n is None for n in names):
            raise TypeError(f"Cannot build a dict from struct type {t} with unnamed fields.")
        return dict(zip(names, values))
    if spec.kind == "list":
        return list(values)
    if spec.kind == "tuple":
        return tuple(values)
    if spec.kind == "namedtuple":
        cls = spec.cls or _surrogate_namedtuple(
            spec.name, tuple(n or f"_{i}" for i, n in enumerate(names))
        )
        return cls(*values)
    if spec.kind == "dataclass":
        if spec.cls is not None:
            return spec.cls(**dict(zip(cast("tuple[str, ...]", names), values)))
        return _surrogate_namedtuple(spec.name, tuple(n or f"_{i}" for i, n in enumerate(names)))(
            *values
        )
    raise TypeError(f"Unknown container kind {spec.kind!r}.")


_SURROGATES: dict[tuple[str, tuple[str, ...]], type] = {}


def _surrogate_namedtuple(name: str, fields: tuple[str, ...]) -> type:
    """A namedtuple standing in for a class this process cannot import."""
    key = (name, fields)
    if key not in _SURROGATES:
        _SURROGATES[key] = collections.namedtuple(name or "Struct", fields, rename=True)  # type: ignore[misc]
    return _SURROGATES[key]


def to_container(value: Any, t: types.Type) -> Any:
    """Internal value -> the container form passed to user JAX code (arrays left as they are)."""
    if isinstance(t, types.StructType):
        return build_container([to_container(v, et) for v, et in zip(value, t.types)], t)
    return value


def from_container(value: Any, t: types.Type, path: str = "") -> Any:
    """Output of user JAX code -> internal form, checking its structure against `t`."""
    if isinstance(t, types.StructType):
        return tuple(
            from_container(v, et, f"{path}{field_path(n, i)}")
            for i, (n, et, v) in enumerate(match_fields(value, t, path))
        )
    return value


def flatten(value: Any, t: types.Type) -> list[Any]:
    """The tensor leaves of an internal value, in type order (sparse: indices, values)."""
    if isinstance(t, types.StructType):
        return [leaf for v, et in zip(value, t.types) for leaf in flatten(v, et)]
    if isinstance(t, types.SparseTensorType):
        return [value.indices, value.values]
    return [value]


_FLATTENERS: dict[types.Type, Callable[[Any], list[Any]]] = {}


def flattener(t: types.Type) -> Callable[[Any], list[Any]]:
    """`flatten(value, t)` as a function of `value` alone, made once per type (runtimes
    flatten every batch: the generic walk costs more than a small model's step)."""
    fn = _FLATTENERS.get(t)
    if fn is None:
        if isinstance(t, types.TensorType):
            fn = _one
        elif isinstance(t, types.StructType) and all(
            isinstance(x, types.TensorType) for x in t.types
        ):
            fn = list
        else:
            fn = functools.partial(flatten, t=t)
        _FLATTENERS[t] = fn
    return fn


def _one(value: Any) -> list[Any]:
    return [value]


def unflatten(leaves: Iterable[Any], t: types.Type) -> Any:
    """Inverse of `flatten`."""
    it = iter(leaves)
    out = _unflatten(it, t)
    if next(it, _END) is not _END:
        raise ValueError(f"Too many leaves for type {t}.")
    return out


_END = object()


def _unflatten(it: Iterator[Any], t: types.Type) -> Any:
    if isinstance(t, types.StructType):
        return tuple(_unflatten(it, et) for et in t.types)
    if isinstance(t, types.SparseTensorType):
        indices = next(it)
        return sparse.SparseTensor.from_parts(indices, next(it), t.dense_shape)
    return next(it)


def leaf_types(t: types.Type) -> list[types.TensorType]:
    """The dense tensor types of `flatten(value, t)`, in order."""
    out: list[types.TensorType] = []
    for leaf in types.tensor_leaves(t):
        if isinstance(leaf, types.SparseTensorType):
            out.append(types.TensorType(np.int64, [None, len(leaf.dense_shape)]))
            out.append(types.TensorType(leaf.dtype, [None]))
        elif isinstance(leaf, types.TensorType):
            out.append(leaf)
        else:
            raise TypeError(f"Expected tensors, found {leaf}.")
    return out


def type_of_leaves(leaves: list[Any], template: types.Type) -> types.Type:
    """Rebuilds `template` with the shapes and dtypes of concrete or abstract leaves."""
    it = iter(leaves)

    def build(t: types.Type) -> types.Type:
        if isinstance(t, types.StructType):
            return types.StructType([(n, build(et)) for n, et in t.elements], container=t.container)
        if isinstance(t, types.SparseTensorType):
            next(it)
            values = next(it)
            return types.SparseTensorType(values.dtype, t.dense_shape)
        return types.to_type(next(it))

    return build(template)


def is_dataclass_instance(value: Any) -> bool:
    return dataclasses.is_dataclass(value) and not isinstance(value, type)
