"""Types, values and computations to bytes and back: the public entry points.

`serialize_type`, `serialize_value` and `serialize_computation` (also
`Computation.to_bytes`) write one frame of the versioned binary format that
`fedlang.core.wire` defines (magic, version, kind, a JSON header, raw blobs, a CRC-32);
`deserialize_type`, `deserialize_value` and `deserialize_computation` (also
`Computation.from_bytes`) read it back.

Reading never executes code from the data: no pickle, no eval, no imports. Dtypes come
from an allowlist, intrinsics must exist in `intrinsics.TABLE`, the IR is rebuilt with
its type-checking constructors and every reference must be bound. A namedtuple or
dataclass container is reused only if its class is already in `sys.modules`; otherwise
values come back as a namedtuple with the same name and fields (or a dict when the
fields are not valid namedtuple names). Any malformed input raises `SerializationError`.

Example:
  >>> import numpy as np
  >>> deserialize_value(serialize_value({"w": np.float32(1.5)}))
  {'w': np.float32(1.5)}
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Iterable, Iterator
from typing import Any

import numpy as np

from fedlang.core import computation, errors, sparse, structure, types, wire

SerializationError = errors.SerializationError
# The error for bytes that are not what was expected, for readers of formats built on
# this one (deployment plans): "Expected X, found Y." plus a fix.
malformed = wire.malformed


# ----------------------------------------------------------------------------
# Types


def serialize_type(type_spec: Any) -> bytes:
    """Serializes a type (anything `fedlang.to_type` accepts)."""
    ctx = wire.EncodeContext()
    root = ctx.type_ref(types.to_type(type_spec))
    return wire.pack(wire.KIND_TYPE, {"types": ctx.types, "type": root}, ctx.blobs)


def deserialize_type(data: bytes) -> types.Type:
    """Reads a type written by `serialize_type`; raises `SerializationError` if malformed."""
    wire.check_bytes(data)
    with wire.Malformed("a serialized type"):
        header, blobs = wire.unpack(data, wire.KIND_TYPE)
        return wire.DecodeContext(header, blobs).type(header.get("type"))


# ----------------------------------------------------------------------------
# Values


def _to_internal(value: Any, t: types.Type, path: str) -> Any:
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            if not isinstance(value, list | tuple):
                raise TypeError(
                    f"Expected a list with one entry per client for {t}{' at ' + path if path else ''}, "
                    f"found {types.describe(value)}."
                )
            return [
                structure.to_internal(v, t.member, f"{path}[client {i}]")
                for i, v in enumerate(value)
            ]
        return structure.to_internal(value, t.member, path)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(
            _to_internal(v, et, f"{path}{structure.field_path(n, i)}")
            for i, (n, et, v) in enumerate(structure.match_fields(value, t, path))
        )
    if isinstance(t, types.FunctionType | types.PlacementType):
        raise TypeError(f"Cannot serialize a value of type {t}; serialize the computation instead.")
    return structure.to_internal(value, t, path)


def _encode_value(v: Any, t: types.Type, ctx: wire.EncodeContext) -> Any:
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            return {"clients": [_encode_value(x, t.member, ctx) for x in v]}
        return _encode_value(v, t.member, ctx)
    if isinstance(t, types.StructType):
        return [_encode_value(x, et, ctx) for x, et in zip(v, t.types)]
    if isinstance(t, types.SequenceType):
        return {"elements": [_encode_value(x, t.element, ctx) for x in v]}
    if isinstance(t, types.SparseTensorType):
        return {
            "indices": ctx.tensor(v.indices),
            "values": ctx.tensor(v.values),
            "dense_shape": list(v.dense_shape),
        }
    return ctx.tensor(v)


def _decode_value(obj: Any, t: types.Type, ctx: wire.DecodeContext) -> Any:
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            return [
                _decode_value(x, t.member, ctx) for x in wire.field(obj, "clients", list, f"a {t} value")
            ]
        return _decode_value(obj, t.member, ctx)
    if isinstance(t, types.StructType):
        if not isinstance(obj, list) or len(obj) != len(t):
            raise wire.malformed(f"a list of {len(t)} fields for a {t} value", repr(obj)[:80])
        return tuple(_decode_value(x, et, ctx) for x, et in zip(obj, t.types))
    if isinstance(t, types.SequenceType):
        return [
            _decode_value(x, t.element, ctx) for x in wire.field(obj, "elements", list, f"a {t} value")
        ]
    if isinstance(t, types.SparseTensorType):
        rank = len(t.dense_shape)
        indices = ctx.tensor(obj.get("indices"), types.TensorType(np.int64, [None, rank]))
        values = ctx.tensor(obj.get("values"), types.TensorType(t.dtype, [None]))
        shape = [
            wire.check_int(d, "a dense dimension")
            for d in wire.field(obj, "dense_shape", list, "a sparse value")
        ]
        if not types._shape_assignable(t.dense_shape, tuple(shape)):
            raise wire.malformed(f"a dense shape for {t}", shape)
        return sparse.SparseTensor(indices, values, shape)
    if isinstance(t, types.TensorType):
        return ctx.tensor(obj, t)
    raise wire.malformed("a value type (tensors, structs, sequences, federated values)", str(t))


def _to_python(v: Any, t: types.Type) -> Any:
    if isinstance(t, types.FederatedType):
        if t.placement is types.CLIENTS and not t.all_equal:
            return [structure.to_python(x, t.member) for x in v]
        return structure.to_python(v, t.member)
    if isinstance(t, types.StructType):
        return structure.build_container([_to_python(x, et) for x, et in zip(v, t.types)], t)
    return structure.to_python(v, t)


def serialize_value(value: Any, type_spec: Any = None) -> bytes:
    """Serializes a value: tensors, sparse tensors, structs, sequences or federated values.

    Args:
      value: the value. A per-client CLIENTS value is a list with one entry per client.
      type_spec: its type (anything `fedlang.to_type` accepts). Needed for federated
        values; by default the type is inferred from the value (a Python list is a struct).

    Returns:
      The bytes, which `deserialize_value` turns back into the value.

    Raises:
      TypeError: if the value does not match `type_spec` (or has no fedlang type).
    """
    t = types.infer_value_type(value) if type_spec is None else types.to_type(type_spec)
    ctx = wire.EncodeContext()
    encoded = _encode_value(_to_internal(value, t, ""), t, ctx)
    return wire.pack(
        wire.KIND_VALUE, {"types": ctx.types, "type": ctx.type_ref(t), "value": encoded}, ctx.blobs
    )


@dataclasses.dataclass(frozen=True)
class DenseLayout:
    """Where the tensors of a value lie in its frame, for a type whose leaves are all
    dense tensors of known shape (a model, its update, a sum's totals): the frame
    `serialize_value` writes for any value of the type has the same header, so the
    tensors' places depend on the type only. Lets a reader take a slice of one tensor
    out of a stored frame, and a writer make a frame a slice at a time (`parts`).

    Attributes:
      type: the type.
      header: the frame's header (without its blob count).
      leaves: the tensors' types, in the order of their blobs.
      shapes: their shapes.
      lengths: each tensor's bytes.
      offsets: where each tensor's bytes begin in the frame.
      size: the frame's bytes.
    """

    type: types.Type
    header: dict[str, Any]
    leaves: list[types.TensorType]
    shapes: list[tuple[int, ...]]
    lengths: list[int]
    offsets: list[int]
    size: int

    def parts(self, pieces: Iterable[Iterable[Any]]) -> Iterator[Any]:
        """The frame of the value whose tensors' bytes are `pieces` (per tensor, its
        little-endian C-order bytes in pieces of any size), made as it is read: the
        bytes `serialize_value` writes for that value."""
        return wire.frame_parts(wire.KIND_VALUE, self.header, list(zip(self.lengths, pieces)))


class LayoutScan(wire.FrameScanner):
    """Checks, as its bytes arrive (`feed`, then `finish`), that a frame holds a value of
    a `DenseLayout`'s type: its header exactly the layout's (each tensor's dtype and
    shape, read before any tensor), each tensor of its length, the frame whole with its
    checksum; holding no tensor (`blob_data` sees each piece, for a subclass).

    Raises (`feed`, `finish`):
      SerializationError: the bytes are not such a frame.
    """

    def __init__(self, layout: DenseLayout):
        super().__init__(wire.KIND_VALUE)
        self.layout = layout

    def header(self, header: dict[str, Any]) -> None:
        found = wire.DecodeContext(header, []).type(header.get("type"))
        if found != self.layout.type:
            raise wire.malformed(f"a value of type {self.layout.type}", f"one of {found}")
        if header.get("value") != self.layout.header["value"]:
            raise wire.malformed(f"a value of type {self.layout.type} written as fedlang "
                                 "writes it", "tensors of other dtypes, shapes or order")

    def blob_start(self, index: int, length: int) -> None:
        lengths = self.layout.lengths
        if index >= len(lengths) or length != lengths[index]:
            want = lengths[index] if index < len(lengths) else 0
            raise wire.malformed(f"tensor {index} of {self.layout.type} in {want} bytes",
                                 f"{length} bytes")


def tensor_bytes(x: Any, dtype: Any = None) -> memoryview:
    """A tensor's bytes as `serialize_value` writes them (little-endian, C order), as
    `DenseLayout.parts` takes them: a view of its own memory where it has those already
    (a NumPy array, a JAX array on the CPU), else a copy; cast to `dtype` first if given."""
    a = np.asarray(x) if dtype is None else np.asarray(x, dtype)
    a = np.ascontiguousarray(a, a.dtype if a.dtype.kind == "b" else a.dtype.newbyteorder("<"))
    return a.reshape(-1).view(np.uint8).data


def dense_layout(type_spec: Any) -> DenseLayout:
    """The `DenseLayout` of a type.

    Raises:
      TypeError: a leaf is not a dense tensor of known shape and fixed-size dtype.
    """
    t = types.to_type(type_spec)
    leaves: list[types.TensorType] = []

    def encode(x: types.Type) -> Any:
        if isinstance(x, types.StructType):
            return [encode(e) for e in x.types]
        if (not isinstance(x, types.TensorType) or any(d is None for d in x.shape)
                or types._dtype_name(np.dtype(x.dtype)) not in wire._DTYPES
                or np.dtype(x.dtype).kind not in "biufc"):
            raise TypeError(f"Expected dense tensors of known shape in {t}, found {x}.")
        leaves.append(x)
        return {"dtype": types._dtype_name(np.dtype(x.dtype)), "shape": list(x.shape),
                "blob": len(leaves) - 1}

    ctx = wire.EncodeContext()
    value = encode(t)
    header = {"types": ctx.types, "type": ctx.type_ref(t), "value": value}
    head = json.dumps({**header, "blobs": len(leaves)}, separators=(",", ":"),
                      ensure_ascii=False).encode()
    shapes = [tuple(int(d or 0) for d in lt.shape) for lt in leaves]
    lengths = [math.prod(shape) * np.dtype(lt.dtype).itemsize for shape, lt in zip(shapes, leaves)]
    offsets, at = [], wire.PREFIX.size + len(head)
    for n in lengths:
        offsets.append(at + 8)
        at += 8 + n
    return DenseLayout(t, header, leaves, shapes, lengths, offsets, at + 4)


def deserialize_value(
    data: bytes, *, expected_type: Any = None, max_bytes: int | None = None,
    copy: bool = True,
) -> Any:
    """Reads a value written by `serialize_value`, in the containers its type remembers.

    Safe on untrusted bytes: nothing is executed or imported, each buffer is read once
    (so the decoded tensors never exceed the input's size), and every malformed input
    raises `SerializationError`.

    Args:
      data: the bytes.
      expected_type: if given, the value's type must be exactly this (anything
        `fedlang.to_type` accepts); checked before any tensor is decoded.
      max_bytes: if given, refuse values whose tensors exceed this many bytes.
      copy: tensors are arrays of their own (True), or views of `data` (False: a large
        value is not held twice while it is read; read-only when `data` is bytes).

    CLIENTS values come back as lists, tensors as NumPy arrays (scalars as NumPy scalars).

    Raises:
      SerializationError: if the bytes are malformed, truncated, from a newer version,
        of another type than `expected_type`, or larger than `max_bytes`.
    """
    wire.check_bytes(data)
    with wire.Malformed("a serialized value"):
        header, blobs = wire.unpack(data, wire.KIND_VALUE)
        ctx = wire.DecodeContext(header, blobs, max_bytes=max_bytes, copy=copy)
        t = ctx.type(header.get("type"))
        if expected_type is not None:
            want = types.to_type(expected_type)
            if t != want:
                raise wire.malformed(f"a value of type {want}", f"a value of type {t}")
        return _to_python(_decode_value(header.get("value"), t, ctx), t)


# ----------------------------------------------------------------------------
# Computations


def serialize_computation(comp: computation.Computation) -> bytes:
    """Serializes a computation: `comp.to_bytes()`.

    Raises:
      SerializationError: if a local computation's backend has no registered codec.
    """
    return comp.to_bytes()


def deserialize_computation(
    data: bytes,
    *,
    public_key: Any = None,
    trusted: bool = False,
    max_bytes: int | None = None,
) -> computation.Computation:
    """Rebuilds a computation written by `serialize_computation`, in any process:
    `Computation.from_bytes`, which says how untrusted bytes are checked.

    Raises:
      SerializationError: if the bytes are malformed or fail their checks.
    """
    return computation.Computation.from_bytes(
        data, public_key=public_key, trusted=trusted, max_bytes=max_bytes
    )
