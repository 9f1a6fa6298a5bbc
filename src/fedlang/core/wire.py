"""The FEDL binary frame and the codecs of its parts: tensors, types, IR and local computations.

Everything fedlang sends across a process or trust boundary uses one frame::

    magic       4 bytes   b"FEDL"
    version     u16       FORMAT_VERSION (readers reject newer versions)
    kind        u8        1 = type, 2 = value, 3 = computation
    header_len  u32       then `header_len` bytes of UTF-8 JSON (the header)
    blobs       header["blobs"] times: u64 length, then that many bytes
    checksum    u32       CRC-32 of every byte before it (checked before parsing)

All integers are little-endian. The header always has a `types` table (JSON type
trees; elsewhere a type is an index into it) and `blobs` (the blob count):

* type: `{"type": i}`.
* value: `{"type": i, "value": v}` where `v` mirrors the type: a tensor is
  `{"dtype", "shape", "blob"}` (a raw little-endian buffer, C order), a sparse tensor
  `{"indices": tensor, "values": tensor, "dense_shape"}`, a struct a JSON list, a sequence
  `{"elements": [...]}`, and a per-client CLIENTS value `{"clients": [...]}`.
* computation: `{"name", "parameter_names", "locals", "ir"}`: IR nodes are JSON
  objects tagged by `"node"`; `locals` lists local computations (each encoded by the
  codec registered for its `kind`, e.g. JAX's exported StableHLO) referenced by index.

This module is the format below `Computation`: it writes and reads frames, tensors,
types, IR and local computations, and knows nothing of `Computation` (which writes
itself with `encode_computation`). The public entry points for types, values and
computations are in `fedlang.core.serialization`.

Reading never executes code from the data: no pickle, no eval, no imports. Dtypes come
from an allowlist, intrinsics must exist in `intrinsics.TABLE`, the IR is rebuilt with
its type-checking constructors and every reference must be bound. A namedtuple or
dataclass container is reused only if its class is already in `sys.modules`; otherwise
values come back as a namedtuple with the same name and fields (or a dict when the
fields are not valid namedtuple names). Any malformed input raises `SerializationError`.
"""

from __future__ import annotations

import dataclasses
import json
import keyword
import math
import struct
import sys
import zlib
from collections.abc import Callable
from typing import Any

import ml_dtypes
import numpy as np

from fedlang.core import errors, intrinsics, ir, signing, types
from fedlang.core import intrinsic_defs as _standard_intrinsics  # noqa: F401 - fills the registry

MAGIC = b"FEDL"
FORMAT_VERSION = 1
KIND_TYPE, KIND_VALUE, KIND_COMPUTATION = 1, 2, 3
_KIND_NAMES = {KIND_TYPE: "a type", KIND_VALUE: "a value", KIND_COMPUTATION: "a computation"}
PREFIX = struct.Struct("<4sHBI")

_DTYPES: dict[str, np.dtype] = {
    name: np.dtype(name)
    for name in [
        "bool",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
        "float16",
        "float32",
        "float64",
        "complex64",
        "complex128",
    ]
}
_DTYPES.update(
    {n: np.dtype(getattr(ml_dtypes, n)) for n in ("bfloat16", "float8_e4m3fn", "float8_e5m2")}
)
# Strings: a blob of the elements' UTF-8 bytes, concatenated in C order, and a blob of
# their byte lengths as little-endian uint64 (see EncodeContext.tensor).
_DTYPES["str"] = types.STRING


def malformed(expected: str, found: Any, fix: str = "") -> errors.SerializationError:
    """The error for bytes that are not what was expected: "Expected X, found Y." plus a fix."""
    found = str(found)
    end = "" if found.endswith(".") else "."
    return errors.SerializationError(f"Expected {expected}, found {found}{end}{(' ' + fix) if fix else ''}")


# Whatever a parser raises on malformed input becomes a SerializationError (with the
# original as its cause): callers handle one documented error type.
_PARSER_ERRORS = (
    TypeError,
    ValueError,
    KeyError,
    IndexError,
    AttributeError,
    RecursionError,
    OverflowError,
    AssertionError,
    StopIteration,
    struct.error,
    UnicodeError,
)


class Malformed:
    """`with Malformed(what):` turns a parser's exception into a `SerializationError`."""

    def __init__(self, what: str):
        self.what = what

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: Any, tb: Any) -> None:
        # Returns None: an exception is never swallowed, only replaced.
        if isinstance(error, _PARSER_ERRORS) and not isinstance(error, errors.SerializationError):
            raise malformed(
                self.what, f"an error reading it: {type(error).__name__}: {error}"
            ) from error


# ----------------------------------------------------------------------------
# Framing


def pack(kind: int, header: dict[str, Any], blobs: list[Any]) -> bytes:
    """A frame of `kind` (`KIND_TYPE`, `KIND_VALUE`, `KIND_COMPUTATION`): the parts of
    `pack_parts`, joined once (the frame's bytes are the only copy of the blobs made)."""
    return b"".join(pack_parts(kind, header, blobs))


def pack_parts(kind: int, header: dict[str, Any], blobs: list[Any]) -> list[Any]:
    """The frame of `pack` as the buffers that make it, in order, without joining them:
    for a sender that streams them (a model's tensors are sent from their own memory).
    `blobs` are bytes-like; each stays referenced, not copied."""
    header = {**header, "blobs": len(blobs)}
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    parts: list[Any] = [PREFIX.pack(MAGIC, FORMAT_VERSION, kind, len(head)), head]
    for b in blobs:
        parts += [struct.pack("<Q", len(b) if isinstance(b, bytes) else memoryview(b).nbytes), b]
    crc = 0
    for part in parts:
        crc = zlib.crc32(part, crc)
    parts.append(struct.pack("<I", crc))
    return parts


class FrameScanner:
    """Reads a frame of `kind` as its bytes arrive (`feed`), holding none of its blobs:
    for a reader that checks a value larger than it may hold (a server taking a model's
    report). What it reads it hands to its hooks, in order: `header` (the parsed header),
    then for each blob `blob_start` (its index and length, before any of its bytes) and
    `blob_data` (its bytes, in pieces of any size: views valid during the call). `finish`
    checks that the frame ended where its checksum says. A hook refuses by raising; the
    scanner raises `SerializationError` for malformed framing.

    Attributes:
      offset: how many bytes were fed so far.
    """

    def __init__(self, kind: int, max_header: int = 1 << 20):
        self.kind = kind
        self.max_header = max_header
        self.offset = 0
        self._crc = 0
        self._pending = bytearray()  # a fixed-size field (prefix, length, header) in part
        self._need = PREFIX.size  # bytes the current field needs
        self._state = "prefix"
        self._blobs = 0
        self._blob = -1  # the blob being read
        self._left = 0  # its bytes still to come
        self._checksum = b""

    # hooks
    def header(self, header: dict[str, Any]) -> None:
        """The header, parsed (its `blobs` count checked)."""

    def blob_start(self, index: int, length: int) -> None:
        """Blob `index` of `length` bytes begins."""

    def blob_data(self, index: int, data: memoryview) -> None:
        """The next bytes of blob `index`."""

    def feed(self, data: Any) -> None:
        """Reads the next bytes of the frame."""
        view = memoryview(data).cast("B")
        while view:
            if self._state == "end":
                raise malformed("the end of the frame after its checksum", "more bytes")
            if self._state == "data":
                piece = view[: self._left]
                self._crc = zlib.crc32(piece, self._crc)
                self.offset += len(piece)
                self._left -= len(piece)
                view = view[len(piece):]
                self.blob_data(self._blob, piece)
                if not self._left:
                    self._next_blob()
                continue
            take = view[: self._need - len(self._pending)]
            self._pending += take
            self.offset += len(take)
            view = view[len(take):]
            if len(self._pending) == self._need:
                field, self._pending = bytes(self._pending), bytearray()
                self._field(field)

    def _field(self, data: bytes) -> None:
        if self._state == "checksum":
            (crc,) = struct.unpack("<I", data)
            if crc != self._crc:
                raise malformed(f"checksum {self._crc:#010x}",
                                f"{crc:#010x} (truncated or corrupted data)")
            self._state = "end"
            return
        self._crc = zlib.crc32(data, self._crc)
        if self._state == "prefix":
            magic, version, found_kind, head_len = PREFIX.unpack(data)
            if magic != MAGIC:
                raise malformed(f"fedlang data starting with {MAGIC!r}", repr(magic[:4]))
            if not 1 <= version <= FORMAT_VERSION:
                raise malformed(f"format version 1..{FORMAT_VERSION}", f"version {version}")
            if found_kind != self.kind:
                raise malformed(f"{_KIND_NAMES[self.kind]} (kind {self.kind})",
                                _KIND_NAMES.get(found_kind, f"kind {found_kind}"))
            if head_len > self.max_header:
                raise malformed(f"a header of at most {self.max_header} bytes",
                                f"{head_len} bytes")
            self._state, self._need = "header", head_len
            if head_len == 0:
                self._field(b"")
        elif self._state == "header":
            try:
                header = json.loads(data.decode())
            except (UnicodeDecodeError, ValueError, RecursionError) as e:
                raise malformed("a UTF-8 JSON header", f"invalid JSON ({e})") from None
            if not isinstance(header, dict):
                raise malformed("a JSON object as the header", type(header).__name__)
            self._blobs = check_int(header.get("blobs"), "the blob count in the header")
            self.header(header)
            self._next_blob()
        elif self._state == "length":
            (n,) = struct.unpack("<Q", data)
            self.blob_start(self._blob, n)
            self._state, self._left = "data", n
            if n == 0:
                self._next_blob()

    def _next_blob(self) -> None:
        self._blob += 1
        if self._blob < self._blobs:
            self._state, self._need = "length", 8
        else:
            self._state, self._need = "checksum", 4

    def finish(self) -> None:
        """The frame ended: its checksum was read (and held).

        Raises:
          SerializationError: the bytes stopped before it.
        """
        if self._state != "end":
            raise malformed("a whole frame", f"its end after {self.offset} bytes "
                            f"(reading {self._state})")


def frame_parts(kind: int, header: dict[str, Any], blobs: list[tuple[int, Any]]) -> Any:
    """The frame of `pack_parts`, made as it is read: each blob is (its length, an
    iterable of its bytes in pieces), so a writer produces a value larger than it holds
    (a model's aggregate, summed a slice at a time). A generator of bytes-like parts;
    raises `ValueError` if a blob's pieces add up to another length than it declared."""
    header = {**header, "blobs": len(blobs)}
    head = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    crc = 0
    for part in (PREFIX.pack(MAGIC, FORMAT_VERSION, kind, len(head)), head):
        crc = zlib.crc32(part, crc)
        yield part
    for length, pieces in blobs:
        size = struct.pack("<Q", length)
        crc = zlib.crc32(size, crc)
        yield size
        written = 0
        for piece in pieces:
            crc = zlib.crc32(piece, crc)
            written += memoryview(piece).nbytes
            yield piece
        if written != length:
            raise ValueError(f"Expected a blob of {length} bytes, found {written}.")
    yield struct.pack("<I", crc)


def check_bytes(data: Any) -> None:
    """Raises `TypeError` unless `data` is bytes-like (a caller's mistake, not bad data)."""
    # A caller's mistake (not bytes at all) is a TypeError, not malformed data.
    if not isinstance(data, bytes | bytearray | memoryview):
        raise TypeError(f"Expected bytes to deserialize, found {types.describe(data)}.")


def unpack(data: Any, kind: int) -> tuple[dict[str, Any], list[memoryview]]:
    """The header and blobs of a frame of `kind` (the blobs are views of `data`, not
    copies); raises `SerializationError` if malformed."""
    check_bytes(data)
    data = memoryview(data).cast("B")
    if len(data) < PREFIX.size + 4:
        raise malformed(f"at least {PREFIX.size + 4} bytes of fedlang data", f"{len(data)} bytes")
    magic, version, found_kind, head_len = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise malformed(f"fedlang data starting with {MAGIC!r}", repr(magic[:4]))
    if version > FORMAT_VERSION or version < 1:
        raise malformed(
            f"format version 1..{FORMAT_VERSION}",
            f"version {version}",
            "It was written by a newer fedlang; upgrade fedlang to read it."
            if version > FORMAT_VERSION
            else "",
        )
    if found_kind != kind:
        what = _KIND_NAMES.get(found_kind, f"unknown kind {found_kind}")
        raise malformed(f"{_KIND_NAMES[kind]} (kind {kind})", f"{what} (kind {found_kind})")
    (crc,) = struct.unpack_from("<I", data, len(data) - 4)
    data = data[:-4]
    if crc != zlib.crc32(data):
        raise malformed(
            f"checksum {zlib.crc32(data):#010x}", f"{crc:#010x} (truncated or corrupted data)"
        )
    pos = PREFIX.size + head_len
    if pos > len(data):
        raise malformed(f"a {head_len}-byte header", f"{len(data) - PREFIX.size} bytes")
    try:
        header = json.loads(bytes(data[PREFIX.size : pos]).decode())
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise malformed("a UTF-8 JSON header", f"invalid JSON ({e})") from None
    if not isinstance(header, dict):
        raise malformed("a JSON object as the header", type(header).__name__)
    count = check_int(header.get("blobs"), "the blob count in the header")
    blobs = []
    for i in range(count):
        if pos + 8 > len(data):
            raise malformed(f"the length of blob {i} of {count}", "the end of the data")
        (n,) = struct.unpack_from("<Q", data, pos)
        pos += 8
        if pos + n > len(data):
            raise malformed(f"{n} bytes of blob {i}", f"{len(data) - pos} bytes")
        blobs.append(data[pos : pos + n])
        pos += n
    if pos != len(data):
        raise malformed("the checksum after the last blob", f"{len(data) - pos} more bytes")
    return header, blobs


def check_int(x: Any, what: str, low: int = 0, high: int | None = None) -> int:
    """`x` if it is an int in `[low, high)`, else a `SerializationError` naming `what`."""
    if not isinstance(x, int) or isinstance(x, bool) or x < low or (high is not None and x >= high):
        bound = f" in [{low}, {high})" if high is not None else f" >= {low}"
        raise malformed(f"an integer{bound} for {what}", repr(x))
    return x


def field(obj: Any, key: str, kind: type | tuple[type, ...], what: str) -> Any:
    """`obj[key]`, checked to be a dict entry of type `kind` (`what` names `obj` in errors)."""
    if not isinstance(obj, dict) or key not in obj:
        raise malformed(f"{what} with a {key!r} entry", repr(obj)[:80])
    value = obj[key]
    if not isinstance(value, kind) or (isinstance(value, bool) and kind is int):
        raise malformed(
            f"{key!r} of {what} to be {getattr(kind, '__name__', kind)}", repr(value)[:80]
        )
    return value


# ----------------------------------------------------------------------------
# Encoding and decoding state shared by types, values and IR


class EncodeContext:
    """Collects the type table and blobs while encoding; local codecs write through it."""

    def __init__(self) -> None:
        self.types: list[Any] = []
        self._type_index: dict[types.Type, int] = {}
        self.blobs: list[Any] = []

    def add_blob(self, data: Any) -> int:
        """Stores `data` (bytes-like: kept by reference, not copied) as a blob; returns
        its index."""
        self.blobs.append(data if isinstance(data, bytes) else memoryview(data).cast("B"))
        return len(self.blobs) - 1

    def type_ref(self, t: types.Type) -> int:
        """Stores `t` in the type table (once; containers must agree); returns its index."""
        key = (t, _container_key(t))
        if key not in self._type_index:
            self._type_index[key] = len(self.types)  # type: ignore[index]
            self.types.append(_type_json(t))
        return self._type_index[key]  # type: ignore[index]

    def tensor(self, value: Any) -> dict[str, Any]:
        arr = np.asarray(value)  # (tobytes writes C order; ascontiguousarray would make 0-d 1-d)
        name = types._dtype_name(arr.dtype)
        if name == "str":
            encoded = [s.encode("utf-8") for s in arr.ravel().tolist()]
            lengths = np.asarray([len(b) for b in encoded], dtype="<u8")
            return {
                "dtype": name,
                "shape": list(arr.shape),
                "blob": self.add_blob(b"".join(encoded)),
                "lengths": self.add_blob(lengths.tobytes()),
            }
        if name not in _DTYPES:
            raise TypeError(
                f"Expected a tensor of one of the dtypes {sorted(_DTYPES)}, found {arr.dtype}."
            )
        arr = arr.astype(arr.dtype.newbyteorder("=")) if not arr.dtype.isnative else arr
        if sys.byteorder == "big":
            arr = arr.byteswap()
        if not arr.flags.c_contiguous:
            arr = arr.copy(order="C")
        # a view of the tensor's own memory (as raw bytes: any dtype, 0-d too), not a copy
        raw = arr.reshape(-1).view(np.uint8)
        return {"dtype": name, "shape": list(arr.shape), "blob": self.add_blob(raw)}


class DecodeContext:
    """Reads the type table and blobs while decoding; local codecs read through it.

    Every blob may be read once: the format never shares a buffer between two values,
    so a value cannot decode to more tensor bytes than it holds (a "decompression bomb"
    of many references to one large blob is refused). `max_bytes` bounds the decoded
    tensor bytes further, for callers such as a server with a memory budget.

    Attributes:
      trusted: whether the bytes come from a source the caller trusts (its own, or
        verified against a pinned key). Local codecs must not hand untrusted embedded
        programs to a native parser in this process before checking them elsewhere.
      copy: tensors are copies of the frame's bytes (True), or views of them (False:
        no second copy of a large value, for a reader that only reads it while it
        holds the frame).
    """

    def __init__(
        self,
        header: dict[str, Any],
        blobs: list[Any],
        trusted: bool = False,
        max_bytes: int | None = None,
        copy: bool = True,
    ):
        self._types_json = field(header, "types", list, "the header")
        self.copy = copy
        self._types: dict[int, types.Type] = {}
        self._blobs = blobs
        self._used: set[int] = set()
        self.trusted = trusted
        self.max_bytes = max_bytes
        self.decoded_bytes = 0

    def blob(self, index: Any) -> bytes:
        """The blob at `index` (validated; each blob may be read once)."""
        return bytes(self._buffer(index))

    def _buffer(self, index: Any) -> Any:
        """The blob at `index` as a view of the frame (validated; read once)."""
        i = check_int(index, "a blob index", 0, len(self._blobs))
        if i in self._used:
            raise malformed(
                f"each blob to be used once (blob {i} is referenced twice)",
                "a shared reference",
                "The format never shares buffers; these bytes were crafted or damaged.",
            )
        self._used.add(i)
        return self._blobs[i]

    def account(self, nbytes: int) -> None:
        """Counts `nbytes` of decoded data against `max_bytes`."""
        self.decoded_bytes += nbytes
        if self.max_bytes is not None and self.decoded_bytes > self.max_bytes:
            raise malformed(
                f"at most {self.max_bytes} decoded bytes (the caller's limit)",
                f"more than {self.decoded_bytes} bytes",
            )

    def type(self, index: Any) -> types.Type:
        """The type at `index` of the type table (validated)."""
        i = check_int(index, "a type index", 0, len(self._types_json))
        if i not in self._types:
            try:
                self._types[i] = _type_from_json(self._types_json[i])
            except (TypeError, ValueError, KeyError, AttributeError, RecursionError) as e:
                if isinstance(e, errors.SerializationError):
                    raise
                raise malformed("a valid type", f"an invalid type ({e})") from None
        return self._types[i]

    def tensor(self, obj: Any, expected: types.TensorType | None = None) -> np.ndarray:
        name = field(obj, "dtype", str, "a tensor")
        if name not in _DTYPES:
            raise malformed(f"a tensor dtype in {sorted(_DTYPES)}", repr(name))
        dtype = _DTYPES[name]
        shape = tuple(
            check_int(d, "a tensor dimension") for d in field(obj, "shape", list, "a tensor")
        )
        if expected is not None and (
            expected.dtype != dtype or not types._shape_assignable(expected.shape, shape)
        ):
            raise malformed(f"a tensor of type {expected}", f"{name}{list(shape)}")
        if name == "str":
            return self._strings(obj, shape)
        buf = self._buffer(obj.get("blob"))
        size = math.prod(shape) * dtype.itemsize
        if len(buf) != size:
            raise malformed(f"{size} bytes for a {name}{list(shape)} tensor", f"{len(buf)} bytes")
        self.account(size)
        if dtype == np.bool_:
            return (np.frombuffer(buf, np.uint8) != 0).reshape(shape)
        arr = np.frombuffer(buf, dtype).reshape(shape)
        if sys.byteorder == "big":
            return arr.byteswap()
        return arr.copy() if self.copy else arr

    def _strings(self, obj: dict[str, Any], shape: tuple[int, ...]) -> np.ndarray:
        count = math.prod(shape)
        length_buf = self.blob(obj.get("lengths"))
        if len(length_buf) != 8 * count:
            raise malformed(
                f"{8 * count} bytes of lengths for a str{list(shape)} tensor",
                f"{len(length_buf)} bytes",
            )
        data = self.blob(obj.get("blob"))
        # Counted before decoding: the limit holds for the text as for any tensor.
        self.account(len(data) + len(length_buf))
        lengths = np.frombuffer(length_buf, "<u8")
        if int(lengths.sum(dtype=np.uint64)) != len(data) or (lengths > len(data)).any():
            raise malformed(
                f"string lengths adding up to the {len(data)} bytes of text",
                f"lengths summing to {int(lengths.sum(dtype=np.uint64))}",
            )
        ends = np.cumsum(lengths, dtype=np.int64)
        starts = ends - lengths.astype(np.int64)
        try:
            items = [data[a:b].decode("utf-8") for a, b in zip(starts.tolist(), ends.tolist())]
        except UnicodeDecodeError as e:
            raise malformed("UTF-8 text in a str tensor", f"invalid bytes ({e.reason})") from None
        return np.asarray(items, dtype=types.STRING).reshape(shape)


# ----------------------------------------------------------------------------
# Types


def _container_key(t: types.Type) -> Any:
    if isinstance(t, types.StructType):
        c = t.container
        return (None if c is None else (c.kind, c.cls, c.name), *map(_container_key, t.types))
    return tuple(_container_key(c) for c in t.children())


def _container_json(c: types.ContainerSpec | None) -> Any:
    if c is None:
        return None
    out: dict[str, Any] = {"kind": c.kind, "name": c.name}
    if c.cls is not None:
        out.update(module=getattr(c.cls, "__module__", ""), qualname=c.cls.__qualname__)
    return out


def _type_json(t: types.Type) -> Any:
    if isinstance(t, types.TensorType | types.SparseTensorType):
        shape = t.shape if isinstance(t, types.TensorType) else t.dense_shape
        kind = "tensor" if isinstance(t, types.TensorType) else "sparse"
        return {"t": kind, "dtype": types._dtype_name(t.dtype), "shape": list(shape)}
    if isinstance(t, types.StructType):
        fields = [[n, _type_json(et)] for n, et in t.elements]
        return {"t": "struct", "fields": fields, "container": _container_json(t.container)}
    if isinstance(t, types.SequenceType):
        return {"t": "sequence", "element": _type_json(t.element)}
    if isinstance(t, types.FederatedType):
        return {
            "t": "federated",
            "member": _type_json(t.member),
            "placement": t.placement.name,
            "all_equal": t.all_equal,
        }
    if isinstance(t, types.FunctionType):
        param = None if t.parameter is None else _type_json(t.parameter)
        return {"t": "function", "parameter": param, "result": _type_json(t.result)}
    if isinstance(t, types.PlacementType):
        return {"t": "placement"}
    raise TypeError(f"Expected a fedlang type, found {t!r}.")


def _type_from_json(obj: Any) -> types.Type:
    tag = field(obj, "t", str, "a type")
    if tag in ("tensor", "sparse"):
        name = field(obj, "dtype", str, "a type")
        if name not in _DTYPES:
            raise malformed(f"a dtype in {sorted(_DTYPES)}", repr(name))
        shape = [
            None if d is None else check_int(d, "a dimension")
            for d in field(obj, "shape", list, "a type")
        ]
        cls = types.TensorType if tag == "tensor" else types.SparseTensorType
        return cls(_DTYPES[name], shape)
    if tag == "struct":
        fields = []
        for f in field(obj, "fields", list, "a struct type"):
            if not (
                isinstance(f, list) and len(f) == 2 and (f[0] is None or isinstance(f[0], str))
            ):
                raise malformed("a [name or null, type] struct field", repr(f)[:80])
            fields.append((f[0], _type_from_json(f[1])))
        return types.StructType(
            fields, container=_container_from_json(obj.get("container"), fields)
        )
    if tag == "sequence":
        return types.SequenceType(_type_from_json(obj.get("element")))
    if tag == "federated":
        placement = field(obj, "placement", str, "a federated type")
        if placement not in types.PLACEMENTS:
            raise malformed(f"a placement in {sorted(types.PLACEMENTS)}", repr(placement))
        all_equal = field(obj, "all_equal", bool, "a federated type")
        return types.FederatedType(
            _type_from_json(obj.get("member")), types.PLACEMENTS[placement], all_equal
        )
    if tag == "function":
        param = obj.get("parameter")
        return types.FunctionType(
            None if param is None else _type_from_json(param), _type_from_json(obj.get("result"))
        )
    if tag == "placement":
        return types.PlacementType()
    raise malformed(
        "a type tag (tensor, sparse, struct, sequence, federated, function, placement)", repr(tag)
    )


def _container_from_json(obj: Any, fields: list[tuple[Any, Any]]) -> types.ContainerSpec | None:
    if obj is None:
        return None
    kind = field(obj, "kind", str, "a container")
    name = obj.get("name", "")
    names = [n for n, _ in fields]
    if kind in ("dict", "list", "tuple"):
        return types.ContainerSpec(kind)
    if kind not in ("namedtuple", "dataclass"):
        raise malformed("a container kind (dict, list, tuple, namedtuple, dataclass)", repr(kind))
    cls = _existing_class(obj.get("module"), obj.get("qualname"))
    if cls is not None and (
        (
            kind == "namedtuple"
            and issubclass(cls, tuple)
            and getattr(cls, "_fields", None) == tuple(names)
        )
        or (
            kind == "dataclass"
            and dataclasses.is_dataclass(cls)
            and [f.name for f in dataclasses.fields(cls)] == names
        )
    ):
        return types.ContainerSpec(kind, cls, cls.__name__)
    if _valid_namedtuple(name, names):
        return types.ContainerSpec(kind, None, name)
    return types.ContainerSpec("dict") if names and None not in names else None


def _existing_class(module: Any, qualname: Any) -> type | None:
    """The class `module.qualname` if that module is already imported (never imports)."""
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    scope: Any = sys.modules.get(module)
    for part in qualname.split("."):
        # vars() rather than getattr: no module __getattr__ or descriptor code runs.
        scope = vars(scope).get(part) if hasattr(scope, "__dict__") else None
    return scope if isinstance(scope, type) else None


def _valid_namedtuple(name: Any, names: list[Any]) -> bool:
    return all(
        isinstance(n, str)
        and n.isidentifier()
        and not keyword.iskeyword(n)
        and not n.startswith("_")
        for n in [name, *names]
    ) and len(set(names)) == len(names)


# ----------------------------------------------------------------------------
# Local computation codecs


@dataclasses.dataclass(frozen=True)
class _Codec:
    encode: Callable[[Any, EncodeContext], dict[str, Any]]
    decode: Callable[[dict[str, Any], DecodeContext], Any]


_CODECS: dict[str, _Codec] = {}


def register_local_codec(
    kind: str,
    encode: Callable[[Any, EncodeContext], dict[str, Any]],
    decode: Callable[[dict[str, Any], DecodeContext], Any],
) -> None:
    """Registers how local computations of a backend `kind` (e.g. 'jax') are serialized.

    Args:
      kind: the `kind` attribute of the backend's local computations.
      encode: `encode(computation, ctx) -> dict` returns JSON-able metadata, storing
        binary parts with `ctx.add_blob(bytes)` and types with `ctx.type_ref(t)`.
      decode: `decode(metadata, ctx) -> LocalComputation` rebuilds it, reading with
        `ctx.blob(i)` and `ctx.type(i)`. It must not execute code from the data.
    """
    _CODECS[kind] = _Codec(encode, decode)


def _codec(kind: Any) -> _Codec:
    if kind not in _CODECS:
        raise malformed(
            f"a local computation kind registered with register_local_codec ({sorted(_CODECS)})",
            repr(kind),
            "Import the backend that defines it (importing fedlang registers 'jax').",
        )
    return _CODECS[kind]


# ----------------------------------------------------------------------------
# IR and computations


class _IREncoder:
    def __init__(self) -> None:
        self.ctx = EncodeContext()
        self.locals: list[dict[str, Any]] = []
        self._local_index: dict[int, int] = {}
        self._keep: list[Any] = []  # keeps ids in _local_index unique

    def node(self, n: ir.Node) -> dict[str, Any]:
        ty = self.ctx.type_ref
        if isinstance(n, ir.Reference):
            return {"node": "reference", "name": n.name, "type": ty(n.type_signature)}
        if isinstance(n, ir.Lambda):
            param = None if n.parameter_type is None else ty(n.parameter_type)
            return {
                "node": "lambda",
                "parameter": n.parameter_name,
                "parameter_type": param,
                "result": self.node(n.result),
            }
        if isinstance(n, ir.Block):
            return {
                "node": "block",
                "locals": [[k, self.node(v)] for k, v in n.locals],
                "result": self.node(n.result),
            }
        if isinstance(n, ir.Call):
            arg = None if n.argument is None else self.node(n.argument)
            return {"node": "call", "function": self.node(n.function), "argument": arg}
        if isinstance(n, ir.Selection):
            return {"node": "selection", "source": self.node(n.source), "index": n.index}
        if isinstance(n, ir.Struct):
            return {
                "node": "struct",
                "elements": [[k, self.node(v)] for k, v in n.elements],
                "type": ty(n.type_signature),
            }
        if isinstance(n, ir.Intrinsic | ir.Data):
            return {"node": type(n).__name__.lower(), "uri": n.uri, "type": ty(n.type_signature)}
        if isinstance(n, ir.Literal):
            return {
                "node": "literal",
                "value": self.ctx.tensor(n.value),
                "type": ty(n.type_signature),
            }
        if isinstance(n, ir.PlacementLiteral):
            return {"node": "placement", "placement": n.placement.name}
        if isinstance(n, ir.Local):
            c = n.computation
            if id(c) not in self._local_index:
                meta = _codec(c.kind).encode(c, self.ctx)
                self._local_index[id(c)] = len(self.locals)
                self._keep.append(c)
                self.locals.append({"kind": c.kind, "meta": meta})
            return {"node": "local", "index": self._local_index[id(c)]}
        raise TypeError(f"Expected an IR node, found {n!r}.")


class _IRDecoder:
    def __init__(
        self, header: dict[str, Any], blobs: list[Any], trusted: bool, max_bytes: int | None
    ):
        self.ctx = DecodeContext(header, blobs, trusted, max_bytes)
        self.locals = []
        for entry in field(header, "locals", list, "the header"):
            kind = field(entry, "kind", str, "a local computation")
            local = _codec(kind).decode(field(entry, "meta", dict, "a local computation"), self.ctx)
            if not isinstance(local, ir.LocalComputation):
                raise malformed("a local computation from the codec", repr(local)[:80])
            self.locals.append(local)

    def node(self, obj: Any, env: dict[str, types.Type]) -> ir.Node:
        tag = field(obj, "node", str, "an IR node")
        if tag == "reference":
            name, t = field(obj, "name", str, "a reference"), self.ctx.type(obj.get("type"))
            if name not in env or not t.is_assignable_from(env[name]):
                found = f"bound to {env[name]}" if name in env else "unbound"
                raise malformed(f"reference {name!r} of type {t} to be bound", found)
            return ir.Reference(name, t)
        if tag == "lambda":
            name, pt = obj.get("parameter"), obj.get("parameter_type")
            if name is not None and not isinstance(name, str):
                raise malformed("a string or null lambda parameter name", repr(name))
            param_t = None if pt is None else self.ctx.type(pt)
            inner = env if name is None else {**env, name: param_t}
            return ir.Lambda(name, param_t, self.node(obj.get("result"), inner))  # type: ignore[arg-type]
        if tag == "block":
            env, bound = dict(env), []
            for entry in field(obj, "locals", list, "a block"):
                if not (isinstance(entry, list) and len(entry) == 2 and isinstance(entry[0], str)):
                    raise malformed("a [name, node] block local", repr(entry)[:80])
                value = self.node(entry[1], env)
                env[entry[0]] = value.type_signature
                bound.append((entry[0], value))
            return ir.Block(bound, self.node(obj.get("result"), env))
        if tag == "call":
            arg = obj.get("argument")
            fn = self.node(obj.get("function"), env)
            return ir.Call(fn, None if arg is None else self.node(arg, env))
        if tag == "selection":
            return ir.Selection(
                self.node(obj.get("source"), env), check_int(obj.get("index"), "a selection index")
            )
        if tag == "struct":
            t = self.ctx.type(obj.get("type"))
            elements = field(obj, "elements", list, "a struct node")
            if not all(isinstance(e, list) and len(e) == 2 for e in elements):
                raise malformed("[name or null, node] struct elements", repr(elements)[:80])
            if not isinstance(t, types.StructType) or [e[0] for e in elements] != list(t.names):
                raise malformed(
                    f"struct elements named like its type {t}", [e[0] for e in elements]
                )
            return ir.Struct([(e[0], self.node(e[1], env)) for e in elements], t.container)
        if tag == "intrinsic":
            return _intrinsic(field(obj, "uri", str, "an intrinsic"), self.ctx.type(obj.get("type")))
        if tag == "data":
            return ir.Data(field(obj, "uri", str, "a data node"), self.ctx.type(obj.get("type")))
        if tag == "literal":
            t = self.ctx.type(obj.get("type"))
            if not isinstance(t, types.TensorType):
                raise malformed("a tensor type for a literal", str(t))
            return ir.Literal(self.ctx.tensor(obj.get("value"), t), t)
        if tag == "placement":
            name = obj.get("placement")
            if name not in types.PLACEMENTS:
                raise malformed(f"a placement in {sorted(types.PLACEMENTS)}", repr(name))
            return ir.PlacementLiteral(types.PLACEMENTS[name])
        if tag == "local":
            return ir.Local(
                self.locals[check_int(obj.get("index"), "a local index", 0, len(self.locals))]
            )
        raise malformed("an IR node tag", repr(tag))


def _intrinsic(uri: str, t: types.Type) -> ir.Intrinsic:
    if uri not in intrinsics.TABLE:
        raise malformed(
            "an intrinsic in fedlang.core.intrinsics.TABLE", repr(uri), "Upgrade fedlang?"
        )
    if not isinstance(t, types.FunctionType) or t.parameter is None:
        raise malformed(f"a function type with a parameter for intrinsic {uri}", str(t))
    result = intrinsics.TABLE[uri].type_rule(t.parameter)
    if not t.result.is_assignable_from(result):
        raise malformed(f"{uri} to have a result of type {result} for {t.parameter}", str(t.result))
    return ir.Intrinsic(uri, t)


def encode_computation(root: ir.Node, name: str, parameter_names: tuple[str, ...]) -> bytes:
    """A computation's frame: its IR `root` and the local computations it calls.

    Raises:
      SerializationError: if a local computation's backend has no registered codec.
    """
    enc = _IREncoder()
    encoded = enc.node(root)
    header = {
        "types": enc.ctx.types,
        "name": name,
        "parameter_names": list(parameter_names),
        "locals": enc.locals,
        "ir": encoded,
    }
    return pack(KIND_COMPUTATION, header, enc.ctx.blobs)


def decode_computation(
    data: bytes,
    *,
    public_key: Any = None,
    trusted: bool = False,
    max_bytes: int | None = None,
) -> tuple[ir.Node, str, tuple[str, ...]]:
    """The IR root, name and parameter names of a frame written by `encode_computation`.

    The embedded programs are checked as `Computation.from_bytes` describes (by the
    signature with `public_key`, not at all with `trusted`, else in a separate process).

    Raises:
      SerializationError: if the bytes are malformed, truncated, from a newer version,
        unsigned or signed by another key (with `public_key`), name an unknown
        intrinsic or backend, do not type-check, or embed a program that fails its check.
    """
    check_bytes(data)
    if public_key is not None:
        data = signing.verify(data, public_key)
        trusted = True
    elif signing.is_signed(data):
        with Malformed("a signed computation"):
            data = bytes(data)[signing.ENVELOPE_SIZE :]
    with Malformed("a serialized computation"):
        header, blobs = unpack(data, KIND_COMPUTATION)
        name = field(header, "name", str, "the header")
        names = field(header, "parameter_names", list, "the header")
        if not all(isinstance(n, str) for n in names):
            raise malformed("parameter names to be strings", repr(names)[:80])
        with Malformed("IR that type-checks"):
            root = _IRDecoder(header, blobs, trusted, max_bytes).node(header.get("ir"), {})
    return root, name, tuple(names)
