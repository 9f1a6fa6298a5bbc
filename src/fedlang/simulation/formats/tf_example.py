"""A dependency-free codec for serialized `tf.train.Example` protocol buffers.

TFF's SQLite datasets store each example as a serialized `tf.train.Example`. Reading
them should not require TensorFlow or the protobuf package, and the messages are
tiny, so this module decodes the protobuf wire format directly::

    Example   { Features features = 1; }
    Features  { map<string, Feature> feature = 1; }   // entries: key = 1, value = 2
    Feature   { oneof kind { BytesList bytes_list = 1; FloatList float_list = 2;
                             Int64List int64_list = 3; } }
    BytesList { repeated bytes value = 1; }
    FloatList { repeated float value = 1 [packed = true]; }
    Int64List { repeated int64 value = 1 [packed = true]; }

Both packed and unpacked repeated fields are accepted, as any protobuf parser must.
Packed numbers are decoded with numpy (no per-value Python work). `encode_example`
writes the same format, for tests and for converting data to TFF's layout.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5
_MASK64 = (1 << 64) - 1


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        if pos >= len(buf):
            raise ValueError("Expected a complete varint, found the end of the message (truncated data).")
        b = buf[pos]
        pos += 1
        result |= (b & 0x7F) << shift
        if b < 0x80:
            return result, pos
        shift += 7
        if shift >= 70:
            raise ValueError("Expected a varint of at most 10 bytes, found a longer one (corrupt data).")


def _fields(buf: bytes) -> Iterator[tuple[int, int, Any]]:
    """Yields (field number, wire type, value): ints for varints, bytes otherwise."""
    pos, end = 0, len(buf)
    value: int | bytes
    while pos < end:
        key, pos = _read_varint(buf, pos)
        number, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, pos = _read_varint(buf, pos)
        elif wire == _BYTES:
            length, pos = _read_varint(buf, pos)
            if pos + length > end:
                raise ValueError(
                    f"Expected {length} bytes for field {number}, found {end - pos} (truncated data)."
                )
            value, pos = buf[pos : pos + length], pos + length
        elif wire in (_FIXED32, _FIXED64):
            size = 4 if wire == _FIXED32 else 8
            if pos + size > end:
                raise ValueError(f"Expected {size} bytes for field {number}, found fewer (truncated data).")
            value, pos = buf[pos : pos + size], pos + size
        else:
            raise ValueError(f"Expected a supported protobuf wire type, found {wire} for field {number}.")
        yield number, wire, value


def _packed_varints(data: bytes) -> np.ndarray:
    b = np.frombuffer(data, np.uint8)
    if b.size == 0:
        return np.empty(0, np.int64)
    if b[-1] & 0x80:
        raise ValueError("Expected complete packed varints, found a truncated one (corrupt data).")
    ends = np.flatnonzero(b < 0x80)
    starts = np.concatenate(([0], ends[:-1] + 1))
    lengths = ends - starts + 1
    if lengths.max() > 10:
        raise ValueError("Expected varints of at most 10 bytes, found a longer one (corrupt data).")
    position = np.arange(b.size) - np.repeat(starts, lengths)
    parts = (b & 0x7F).astype(np.uint64) << (7 * position).astype(np.uint64)
    return np.add.reduceat(parts, starts).view(np.int64)


def _decode_feature(buf: bytes) -> Any:
    for number, wire, value in _fields(buf):
        if wire != _BYTES:
            continue
        if number == 1:
            return [v for n, w, v in _fields(value) if n == 1 and w == _BYTES]
        if number == 2:
            parts = []
            for n, w, v in _fields(value):
                if n == 1 and w in (_BYTES, _FIXED32):
                    parts.append(np.frombuffer(v, "<f4"))
            return np.concatenate(parts).astype(np.float32) if parts else np.empty(0, np.float32)
        if number == 3:
            parts = []
            for n, w, v in _fields(value):
                if n == 1 and w == _BYTES:
                    parts.append(_packed_varints(v))
                elif n == 1 and w == _VARINT:
                    parts.append(np.array([v & _MASK64], np.uint64).view(np.int64))
            return np.concatenate(parts) if parts else np.empty(0, np.int64)
    return []  # a Feature with no kind set: an empty list


def decode_example(blob: bytes) -> dict[str, Any]:
    """Decodes a serialized `tf.train.Example`.

    Args:
      blob: the serialized message.

    Returns:
      feature name -> value: a `list[bytes]` for a BytesList, a float32 array for a
      FloatList, an int64 array for an Int64List.

    Raises:
      ValueError: if the bytes are not a well-formed Example.
    """
    out: dict[str, Any] = {}
    for number, wire, features in _fields(bytes(blob)):
        if number != 1 or wire != _BYTES:
            continue
        for n, w, entry in _fields(features):
            if n != 1 or w != _BYTES:
                continue
            key, value = "", b""
            for en, ew, ev in _fields(entry):
                if en == 1 and ew == _BYTES:
                    key = bytes(ev).decode("utf-8")
                elif en == 2 and ew == _BYTES:
                    value = ev
            out[key] = _decode_feature(value)
    return out


def _varint(value: int) -> bytes:
    value &= _MASK64
    out = bytearray()
    while True:
        bits = value & 0x7F
        value >>= 7
        if value:
            out.append(bits | 0x80)
        else:
            out.append(bits)
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | _BYTES) + _varint(len(payload)) + payload


def _encode_feature(value: Any, packed: bool) -> bytes:
    if isinstance(value, str | bytes):
        value = [value]
    if isinstance(value, list | tuple) and value and isinstance(value[0], str | bytes):
        items = b"".join(_field(1, v.encode() if isinstance(v, str) else bytes(v)) for v in value)
        return _field(1, items)
    array = np.asarray(value).reshape(-1)
    if array.dtype.kind == "f":
        floats = array.astype("<f4")
        if packed:
            return _field(2, _field(1, floats.tobytes()))
        tag = _varint(1 << 3 | _FIXED32)
        return _field(2, b"".join(tag + struct.pack("<f", f) for f in floats.tolist()))
    if array.dtype.kind in "iub":
        ints = [int(v) for v in array.tolist()]
        if packed:
            return _field(3, _field(1, b"".join(_varint(v) for v in ints)))
        tag = _varint(1 << 3 | _VARINT)
        return _field(3, b"".join(tag + _varint(v) for v in ints))
    if array.size == 0:
        return _field(2, b"")
    raise TypeError(f"Expected bytes, str, float or int feature values, found dtype {array.dtype}.")


def encode_example(features: Mapping[str, Any], packed: bool = True) -> bytes:
    """Serializes features as a `tf.train.Example`.

    Args:
      features: name -> value. `bytes`/`str` (or lists of them) become a BytesList,
        float arrays a FloatList, integer and bool arrays an Int64List.
      packed: write repeated numbers packed (what TensorFlow writes) or unpacked.

    Returns:
      The serialized message.

    Raises:
      TypeError: for values of another kind.
    """
    entries = b"".join(
        _field(1, _field(1, name.encode()) + _field(2, _encode_feature(value, packed)))
        for name, value in features.items()
    )
    return _field(1, entries)
