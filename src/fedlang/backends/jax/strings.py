"""Strings for JAX: fixed-width UTF-8 bytes, back to text, and a stable hash.

JAX arrays hold numbers, so a `str` value cannot enter a `jax_computation`. Data
pipelines encode it first (on the host, with NumPy)::

    encoded = strings.encode(["hello", "wörld"], max_len=8)
    encoded.bytes      # uint8[2, 8], zero-padded UTF-8
    encoded.lengths    # int32[2], bytes used per string
    encoded.truncated  # how many strings were longer than max_len (cut, and counted)

A string longer than `max_len` bytes is cut at the last whole UTF-8 character that
fits (so it still decodes) and counted in `truncated`: never silently. `decode` turns
bytes and lengths back into a `str` array. `hash_bytes(bytes, lengths, seed)` is a
32-bit hash of the first `length` bytes (FNV-1a, finished with MurmurHash3's `fmix32`
so every output bit depends on every input bit); it runs on NumPy arrays and inside a
`jax_computation` with identical results, so a server can hash a known string and
match what clients computed.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang.core import types

FNV_OFFSET = 0x811C9DC5
FNV_PRIME = 0x01000193


class EncodedStrings(NamedTuple):
    """Strings as fixed-width UTF-8 bytes (see the module docstring).

    Attributes:
      bytes: `uint8[..., max_len]`, zero-padded.
      lengths: `int32[...]`, the bytes used by each string (at most `max_len`).
      truncated: the number of strings longer than `max_len` bytes, which were cut.
    """

    bytes: np.ndarray
    lengths: np.ndarray
    truncated: int


def _cut(data: bytes, max_len: int) -> bytes:
    """`data[:max_len]`, backed off to a UTF-8 character boundary."""
    if len(data) <= max_len:
        return data
    end = max_len
    while end > 0 and (data[end] & 0xC0) == 0x80:  # a continuation byte starts no character
        end -= 1
    return data[:end]


def encode(values: Any, max_len: int) -> EncodedStrings:
    """Encodes strings (a str, a list or array of them, any shape) as UTF-8 bytes.

    Args:
      values: a `str`, nested lists of `str`, or a NumPy unicode/string array.
      max_len: the width in bytes; longer strings are cut and counted.

    Returns:
      `EncodedStrings(bytes uint8[*shape, max_len], lengths int32[*shape], truncated)`.

    Raises:
      TypeError: for values that are not strings (numbers are never made into text).
      ValueError: for `max_len < 1`.

    Example:
      >>> e = encode(["ab", "héllo"], max_len=4)
      >>> e.bytes.shape, e.lengths.tolist(), e.truncated
      ((2, 4), [2, 4], 1)
      >>> decode(e.bytes, e.lengths).tolist()
      ['ab', 'hél']
    """
    if isinstance(max_len, bool) or not isinstance(max_len, int | np.integer) or max_len < 1:
        raise ValueError(f"Expected max_len to be a positive integer, found {max_len!r}.")
    arr = np.asarray(values)
    if arr.dtype.kind not in "UT" and not (
        arr.dtype.kind == "O" and all(isinstance(x, str) for x in arr.ravel())
    ):
        raise TypeError(
            f"Expected strings to encode, found {types.describe(values)}; pass str values "
            "(decode bytes with .decode('utf-8') first)."
        )
    flat = [str(s).encode("utf-8") for s in arr.ravel().tolist()]
    out = np.zeros((len(flat), int(max_len)), np.uint8)
    lengths = np.zeros(len(flat), np.int32)
    truncated = 0
    for i, data in enumerate(flat):
        cut = _cut(data, int(max_len))
        truncated += len(cut) < len(data)
        out[i, : len(cut)] = np.frombuffer(cut, np.uint8)
        lengths[i] = len(cut)
    return EncodedStrings(
        out.reshape(*arr.shape, int(max_len)), lengths.reshape(arr.shape), int(truncated)
    )


def decode(data: Any, lengths: Any) -> np.ndarray:
    """The `str` array of UTF-8 `data` (`uint8[..., max_len]`) cut to `lengths`.

    Raises:
      ValueError: if shapes disagree, a length is out of range or the bytes are not UTF-8.
    """
    data = np.asarray(data, np.uint8)
    lengths = np.asarray(lengths)
    if data.ndim < 1 or data.shape[:-1] != lengths.shape:
        raise ValueError(
            f"Expected bytes of shape [*S, max_len] and lengths of shape S, found "
            f"{data.shape} and {lengths.shape}."
        )
    width = data.shape[-1]
    if lengths.size and (lengths.min() < 0 or lengths.max() > width):
        raise ValueError(f"Expected lengths in [0, {width}], found {lengths.min()}..{lengths.max()}.")
    rows = data.reshape(-1, width)
    try:
        text = [bytes(r[:n]).decode("utf-8") for r, n in zip(rows, lengths.ravel().tolist())]
    except UnicodeDecodeError as e:
        raise ValueError(f"Expected UTF-8 bytes, found invalid bytes ({e.reason}).") from e
    return np.asarray(text, dtype=types.STRING).reshape(lengths.shape)


def _fmix32(xp: Any, h: Any) -> Any:
    h = h ^ (h >> 16)
    h = h * xp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * xp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)


def hash_bytes(data: Any, lengths: Any, seed: Any = 0) -> Any:
    """A 32-bit hash (`uint32[...]`) of each string's first `length` bytes.

    Works on NumPy arrays (returns NumPy) and on JAX arrays, inside a `jax_computation`
    (returns JAX); both give the same values. Different `seed`s give independent hashes.

    Args:
      data: `uint8[..., max_len]` as made by `encode`.
      lengths: `int32[...]`.
      seed: a non-negative integer (or uint32 array broadcastable to `lengths`).
    """
    if isinstance(data, np.ndarray) and isinstance(lengths, np.ndarray):
        with np.errstate(over="ignore"):  # uint32 arithmetic wraps by design
            return _hash(np, data, lengths, seed)
    return _hash(jnp, data, lengths, seed)


def _hash(xp: Any, data: Any, lengths: Any, seed: Any) -> Any:
    data = xp.asarray(data).astype(xp.uint32)
    lengths = xp.asarray(lengths).astype(xp.int32)
    # Mixing the seed first makes seeded hashes unrelated, not just shifted.
    h = xp.zeros(lengths.shape, xp.uint32) + _fmix32(
        xp, xp.asarray(seed, dtype=xp.uint32) + xp.uint32(0x9E3779B9)
    )
    h = h ^ xp.uint32(FNV_OFFSET)
    for i in range(data.shape[-1]):  # max_len is small and static: an unrolled loop
        step = (h ^ data[..., i]) * xp.uint32(FNV_PRIME)
        h = xp.where(i < lengths, step, h)
    return _fmix32(xp, h ^ lengths.astype(xp.uint32))


def check_no_strings(t: types.Type, what: str) -> None:
    """Raises a `TypeError` saying how to encode strings if `t` has a `str` leaf."""
    leaves = types.tensor_leaves(t.element if isinstance(t, types.SequenceType) else t)
    for leaf in leaves:
        if isinstance(leaf, types.TensorType) and types.is_string_dtype(leaf.dtype):
            raise TypeError(
                f"{what} has the string type {t}, but JAX holds numbers only. Encode the strings "
                "before the computation: fedlang.backends.jax.strings.encode(values, max_len) gives "
                "uint8[..., max_len] bytes and int32 lengths (dataset.map(...) in a data "
                "pipeline), and strings.hash_bytes hashes them inside JAX."
            )
