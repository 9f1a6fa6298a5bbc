"""The byte format of secure aggregation messages (and of the server's saved state).

Every message is one frame; all integers are little-endian::

    magic       4 bytes   b"FLSA"
    version     u8        WIRE_VERSION (readers reject other versions)
    kind        u8        one of KINDS (which message this is)
    header_len  u32       then `header_len` bytes of UTF-8 JSON: an object
    blobs       header["blobs"] times: u64 length, then that many bytes

Nothing may follow the last blob. The header holds ids and small numbers (moduli as
decimal strings, so readers without big integers keep them exact; the round id as hex);
keys, ciphertexts, shares and vectors are blobs. The fields of each kind are listed in
docs/deploy.md ("Secure aggregation", "Message format").
"""

from __future__ import annotations

import dataclasses
import json
import struct
from typing import Any

from fedlang.deploy.secagg import config

MAGIC = b"FLSA"
WIRE_VERSION = 1
_PREFIX = struct.Struct("<4sBBI")
_BLOB_LEN = struct.Struct("<Q")

CONFIG, ADVERTISE, SHARE_REQUEST, SHARES, MASK_REQUEST, MASKED_INPUT = 1, 2, 3, 4, 5, 6
UNMASK_REQUEST, UNMASK, SERVER_STATE = 7, 8, 9
KINDS = {
    CONFIG: "round configuration",
    ADVERTISE: "advertise-keys",
    SHARE_REQUEST: "share-keys request",
    SHARES: "shares",
    MASK_REQUEST: "masked-input request",
    MASKED_INPUT: "masked-input",
    UNMASK_REQUEST: "unmasking request",
    UNMASK: "unmasking",
    SERVER_STATE: "server state",
}


@dataclasses.dataclass(frozen=True)
class Message:
    """A decoded frame: its kind, JSON header and binary blobs."""

    kind: int
    header: dict[str, Any]
    blobs: tuple[bytes, ...]

    def field(self, key: str, kind: type | tuple[type, ...], what: str) -> Any:
        """`header[key]`, checked to be of `kind` (bool is never an int here)."""
        value = self.header.get(key)
        if not isinstance(value, kind) or (isinstance(value, bool) and bool not in _tuple(kind)):
            raise config.SecAggError(
                f"Expected {what} in field {key!r} of a {KINDS[self.kind]} message, "
                f"found {_show(value)}."
            )
        return value

    def ids(self, key: str) -> list[str]:
        """`header[key]` as a list of distinct client ids."""
        return check_ids(self.header.get(key), f"field {key!r} of a {KINDS[self.kind]} message")

    def blob(self, i: int, size: int | None, what: str) -> bytes:
        """Blob `i`, checked to be `size` bytes long when `size` is given."""
        if i >= len(self.blobs):
            raise config.SecAggError(
                f"Expected {what} as blob {i} of a {KINDS[self.kind]} message, found "
                f"{len(self.blobs)} blobs."
            )
        b = self.blobs[i]
        if size is not None and len(b) != size:
            raise config.SecAggError(
                f"Expected {what} of {size} bytes in a {KINDS[self.kind]} message, found "
                f"{len(b)} bytes."
            )
        return b


def encode(kind: int, header: dict[str, Any], blobs: list[bytes] | tuple[bytes, ...] = ()) -> bytes:
    """Writes one frame."""
    head = json.dumps({**header, "blobs": len(blobs)}, separators=(",", ":")).encode()
    parts = [_PREFIX.pack(MAGIC, WIRE_VERSION, kind, len(head)), head]
    for b in blobs:
        parts += [_BLOB_LEN.pack(len(b)), b]
    return b"".join(parts)


def decode(data: Any, kind: int) -> Message:
    """Reads one frame of the expected `kind`.

    Raises:
      SecAggError: not bytes, truncated, trailing bytes, another kind or version, or a
        header that is not a JSON object.
    """
    if not isinstance(data, bytes | bytearray | memoryview):
        raise config.SecAggError(
            f"Expected a {KINDS[kind]} message as bytes, found {type(data).__name__}."
        )
    view = memoryview(data).cast("B")
    if len(view) < _PREFIX.size:
        raise config.SecAggError(
            f"Expected a {KINDS[kind]} message of at least {_PREFIX.size} bytes, found "
            f"{len(view)} bytes (truncated)."
        )
    magic, version, found, head_len = _PREFIX.unpack_from(view)
    if magic != MAGIC:
        raise config.SecAggError(
            f"Expected a secure aggregation message starting with {MAGIC!r}, found {bytes(magic)!r}."
        )
    if version != WIRE_VERSION:
        raise config.SecAggError(
            f"Expected secure aggregation wire version {WIRE_VERSION}, found {version}. "
            "Client and server must run the same protocol version."
        )
    if found != kind:
        raise config.SecAggError(
            f"Expected a {KINDS[kind]} message, found {KINDS.get(found, f'unknown kind {found}')}."
        )
    pos = _PREFIX.size + head_len
    if pos > len(view):
        raise config.SecAggError(f"Expected a {head_len}-byte header, found a truncated message.")
    try:
        header = json.loads(bytes(view[_PREFIX.size : pos]).decode())
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise config.SecAggError(f"Expected a JSON header, found invalid JSON ({e}).") from None
    if not isinstance(header, dict):
        raise config.SecAggError(f"Expected a JSON object as header, found {_show(header)}.")
    count = header.get("blobs")
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise config.SecAggError(f"Expected a blob count in the header, found {_show(count)}.")
    blobs = []
    for i in range(count):
        if pos + _BLOB_LEN.size > len(view):
            raise config.SecAggError(f"Expected {count} blobs, found a message truncated at {i}.")
        (n,) = _BLOB_LEN.unpack_from(view, pos)
        pos += _BLOB_LEN.size
        if pos + n > len(view):
            raise config.SecAggError(
                f"Expected blob {i} of {n} bytes, found {len(view) - pos} bytes (truncated)."
            )
        blobs.append(bytes(view[pos : pos + n]))
        pos += n
    if pos != len(view):
        raise config.SecAggError(
            f"Expected the message to end after its {count} blobs, found {len(view) - pos} "
            "more bytes."
        )
    return Message(kind, header, tuple(blobs))


def check_client_id(value: Any, where: str) -> str:
    """A client id: a non-empty string of at most MAX_CLIENT_ID_LENGTH characters."""
    if not isinstance(value, str) or not 0 < len(value) <= config.MAX_CLIENT_ID_LENGTH:
        raise config.SecAggError(
            f"Expected a client id (a string of 1 to {config.MAX_CLIENT_ID_LENGTH} characters) "
            f"in {where}, found {_show(value)}."
        )
    return value


def check_ids(value: Any, where: str) -> list[str]:
    """A list of distinct client ids."""
    if not isinstance(value, list):
        raise config.SecAggError(f"Expected a list of client ids in {where}, found {_show(value)}.")
    for i in value:
        check_client_id(i, where)
    if len(set(value)) != len(value):
        raise config.SecAggError(f"Expected distinct client ids in {where}, found repeated ones.")
    return value


def split(blob: bytes, size: int, count: int, what: str) -> list[bytes]:
    """Cuts a blob of `count` fixed-size records."""
    if len(blob) != size * count:
        raise config.SecAggError(
            f"Expected {count} {what} of {size} bytes ({size * count} bytes), found {len(blob)} bytes."
        )
    return [blob[i * size : (i + 1) * size] for i in range(count)]


def _tuple(kind: type | tuple[type, ...]) -> tuple[type, ...]:
    return kind if isinstance(kind, tuple) else (kind,)


def _show(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
