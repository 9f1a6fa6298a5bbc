"""Signed envelopes: Ed25519 signatures over serialized computations (and any bytes).

A CRC detects accidents, not attacks. Bytes that cross a trust boundary and will be
handed to a native parser (the StableHLO programs inside a computation) are signed by
the sender and verified against a key the receiver pinned beforehand — the deployment
server signs the computations it hands out; clients pin its public key when they enroll.

Envelope::

    magic        4 bytes   b"FEDS"
    version      u16       1
    key id       8 bytes   the first 8 bytes of SHA-256(public key), to name a wrong key
    signature    64 bytes  Ed25519 over everything before it and the payload
    payload      the signed bytes

Example:
  >>> key = generate_key()
  >>> signed = sign(b"payload", key)
  >>> verify(signed, public_key_bytes(key))
  b'payload'
"""

from __future__ import annotations

import hashlib
import struct
from typing import Any

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization as crypto_serialization
from cryptography.hazmat.primitives.asymmetric import ed25519

from fedlang.core import errors

SignatureError = errors.SignatureError

MAGIC = b"FEDS"
VERSION = 1
_HEAD = struct.Struct("<4sH8s64s")
ENVELOPE_SIZE = _HEAD.size  # the bytes before the payload


def generate_key() -> ed25519.Ed25519PrivateKey:
    """A new Ed25519 signing key."""
    return ed25519.Ed25519PrivateKey.generate()


def private_key_bytes(key: ed25519.Ed25519PrivateKey) -> bytes:
    """The 32 raw bytes of a private key (store them like a password)."""
    return key.private_bytes(
        crypto_serialization.Encoding.Raw,
        crypto_serialization.PrivateFormat.Raw,
        crypto_serialization.NoEncryption(),
    )


def public_key_bytes(key: Any) -> bytes:
    """The 32 raw bytes of the public key of a private key, or of a public key."""
    if isinstance(key, ed25519.Ed25519PrivateKey):
        key = key.public_key()
    return _public_key(key).public_bytes(
        crypto_serialization.Encoding.Raw, crypto_serialization.PublicFormat.Raw
    )


def load_private_key(raw: bytes) -> ed25519.Ed25519PrivateKey:
    """A private key from its 32 raw bytes."""
    if not isinstance(raw, bytes | bytearray) or len(raw) != 32:
        raise ValueError("Expected the 32 raw bytes of an Ed25519 private key.")
    return ed25519.Ed25519PrivateKey.from_private_bytes(bytes(raw))


def _public_key(key: Any) -> ed25519.Ed25519PublicKey:
    if isinstance(key, ed25519.Ed25519PublicKey):
        return key
    if isinstance(key, bytes | bytearray) and len(key) == 32:
        return ed25519.Ed25519PublicKey.from_public_bytes(bytes(key))
    raise TypeError(
        "Expected an Ed25519 public key (a cryptography Ed25519PublicKey or its 32 raw "
        f"bytes), found {type(key).__name__}."
    )


def key_id(key: Any) -> bytes:
    """The 8-byte id of a public (or private) key, as written in envelopes."""
    return hashlib.sha256(public_key_bytes(key)).digest()[:8]


def is_signed(data: bytes) -> bool:
    """Whether `data` starts like a signed envelope."""
    return bytes(data[:4]) == MAGIC


def sign(payload: bytes, key: ed25519.Ed25519PrivateKey) -> bytes:
    """Wraps `payload` in an envelope signed with `key`."""
    prefix = struct.pack("<4sH8s", MAGIC, VERSION, key_id(key))
    signature = key.sign(prefix + bytes(payload))
    return prefix + signature + bytes(payload)


def verify(data: bytes, public_key: Any) -> bytes:
    """The payload of an envelope, once its signature verifies against `public_key`.

    Raises:
      SignatureError: if `data` is not an envelope, was signed by another key, or the
        signature does not match (the payload or envelope was changed).
    """
    data = bytes(data)
    if len(data) < _HEAD.size or not is_signed(data):
        raise SignatureError(
            "Expected bytes signed by the pinned key (a signed envelope starting with "
            f"{MAGIC!r}), found unsigned or truncated data."
        )
    _, version, kid, signature = _HEAD.unpack_from(data)
    if version != VERSION:
        raise SignatureError(f"Expected signed envelope version {VERSION}, found {version}.")
    pinned = _public_key(public_key)
    if kid != key_id(pinned):
        raise SignatureError(
            f"The bytes were signed by key {kid.hex()}, not by the pinned key "
            f"{key_id(pinned).hex()}; refusing them."
        )
    payload = data[_HEAD.size :]
    try:
        pinned.verify(signature, data[: _HEAD.size - 64] + payload)
    except InvalidSignature as e:
        raise SignatureError(
            "The signature does not verify against the pinned key: the bytes were changed "
            "after signing."
        ) from e
    return payload
