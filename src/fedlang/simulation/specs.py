"""Element specs: describing one element of a dataset.

A *structure* mirrors an element (dicts, tuples, lists, namedtuples) with a spec at
each leaf: a fedlang `types.TensorType` for numbers, or a `StringSpec` for strings,
which have no fedlang type. `element_type` turns a structure into the fedlang type
the runtimes consume (`<pixels=float32[28,28],label=int32>`); a string field becomes a
`str` tensor (`<snippets=str>`, `str[?]` after `batch`), which computations can move and
store and `fedlang.backends.jax.strings` encodes for JAX.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedlang.core import types
from fedlang.simulation import _tree


@dataclasses.dataclass(frozen=True)
class StringSpec:
    """Describes a string (str or bytes) field: a fedlang `str` tensor in `element_type`.

    Attributes:
      shape: the field's shape; `()` for a scalar string, `(None,)` after `batch`.
    """

    shape: tuple[int | None, ...] = ()

    def __str__(self) -> str:
        if not self.shape:
            return "string"
        return "string[" + ",".join("?" if d is None else str(d) for d in self.shape) + "]"


def leaf_spec(value: Any) -> types.TensorType | StringSpec:
    """The spec of one leaf value (an array, a numpy or Python scalar, a str/bytes)."""
    if isinstance(value, str | bytes):
        return StringSpec(())
    array = np.asarray(value)
    if array.dtype.kind in "OSU":
        return StringSpec(array.shape)
    return types.TensorType(array.dtype, array.shape)


def structure_of(element: Any) -> Any:
    """The structure (containers of `TensorType`/`StringSpec` leaves) of one element."""
    return _tree.map_structure(leaf_spec, element)


def to_structure(spec: Any) -> Any:
    """Converts a user element spec to a structure of `TensorType`/`StringSpec` leaves.

    Accepts a fedlang `Type` (tensor or struct), `StringSpec`, `str`/`bytes` (a scalar
    string), anything `types.to_type` accepts, and containers of these.

    Raises:
      TypeError: for specs that are neither tensors, strings nor structs.
    """
    if isinstance(spec, StringSpec):
        return spec
    if spec in (str, bytes, np.str_, np.bytes_):
        return StringSpec(())
    if isinstance(spec, types.StructType):
        values = [to_structure(t) for t in spec.types]
        kind = spec.container.kind if spec.container else ("dict" if all(spec.names) else "tuple")
        if kind in ("dict", "dataclass"):
            return dict(zip(spec.names, values))
        if kind == "namedtuple" and spec.container and spec.container.cls is not None:
            return spec.container.cls(*values)
        return list(values) if kind == "list" else tuple(values)
    if isinstance(spec, types.TensorType):
        return spec
    if isinstance(spec, types.Type):
        raise TypeError(f"Expected a tensor or struct element type, found {spec}.")
    is_pair = (isinstance(spec, tuple) and len(spec) == 2 and not _tree.is_node(spec[0])
               and isinstance(spec[1], list | tuple))
    if is_pair or not _tree.is_node(spec):
        return to_structure(types.to_type(spec))
    if isinstance(spec, dict):
        return type(spec)((k, to_structure(v)) for k, v in spec.items())
    if hasattr(spec, "_fields"):
        return type(spec)(*(to_structure(v) for v in spec))
    return type(spec)(to_structure(v) for v in spec)


def element_type(structure: Any) -> types.Type:
    """The fedlang type of a structure of `TensorType` and `StringSpec` leaves.

    A `StringSpec` becomes a `str` tensor of its shape (bytes fields are read as UTF-8).
    """
    return types.to_type(_tree.map_structure(_string_to_tensor, structure))


def _string_to_tensor(spec: Any) -> Any:
    if isinstance(spec, StringSpec):
        return types.TensorType(types.STRING, spec.shape)
    return spec


def structure_str(structure: Any) -> str:
    """A compact string for a structure, in the style of fedlang types."""
    if isinstance(structure, dict):
        return "<" + ",".join(f"{k}={structure_str(v)}" for k, v in structure.items()) + ">"
    if _tree.is_node(structure):
        fields = getattr(structure, "_fields", None)
        if fields:
            return "<" + ",".join(f"{k}={structure_str(v)}" for k, v in zip(fields, structure)) + ">"
        return "<" + ",".join(structure_str(v) for v in structure) + ">"
    return str(structure)
