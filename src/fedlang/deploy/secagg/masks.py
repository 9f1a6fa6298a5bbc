"""Masks: a PRG from AES-256-CTR, uniform modulo each segment's modulus, and modular sums.

`expand(seed, i, segment)` is the mask of segment `i` under a 32-byte seed: the AES-256-CTR
keystream of key `seed`, with the initial counter block `i` (8 bytes, big-endian) followed
by 8 zero bytes, read as little-endian words: uint32 words when R is a power of two up
to 2**32, uint64 words otherwise. Segments thus draw from disjoint counter ranges of one
key. The words become values modulo R exactly uniformly:

- R a power of two: the low bits of each word (R = 2**32 or 2**64 takes the whole word).
- any other R (up to 2**63): rejection sampling; words at or above the largest multiple
  of R below 2**64 are skipped, the rest are reduced modulo R. The result is exactly
  uniform (no bias at all); fewer than 1 in 2 words is skipped, and the same seed always
  yields the same values, however they are drawn.

All vectors are uint64 arrays of residues in [0, R); the sums below keep them there.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import numpy as np
from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

from fedlang.deploy.secagg import config

_AES_BLOCK = 16


def expand(seed: bytes, index: int, segment: config.Segment) -> np.ndarray:
    """The mask of segment `index` under `seed`: `segment.length` uniform residues (uint64)."""
    stream = Keystream(seed, index)
    n, m = segment.length, segment.modulus
    if segment.is_power_of_two:
        words = stream.words(n, _word(segment))
        _low_bits(words, m)
        return words.astype(np.uint64, copy=False)
    limit = np.uint64(((1 << 64) // m) * m - 1)  # the largest word kept
    out = np.empty(n, np.uint64)
    have = 0
    while have < n:
        need = n - have
        # Draw a little more than the expected need, so one draw almost always suffices.
        keep = float(limit) / 2.0**64
        words = stream.words(int(need / keep * 1.01) + 64)
        kept = words[words <= limit][:need]
        out[have : have + kept.size] = kept
        have += kept.size
    np.remainder(out, np.uint64(m), out=out)
    return out


class Accumulator:
    """Adds and subtracts many masks to one vector, modulo the segment's modulus.

    For a power-of-two modulus the keystream words are added as they are (unsigned
    arithmetic wraps modulo 2**32 or 2**64, a multiple of the modulus) into a reused
    buffer, and the sum is reduced once at the end: the same result as `expand` and
    `add_into`, faster.
    """

    def __init__(self, start: np.ndarray, segment: config.Segment):
        self.segment = segment
        self._scratch: np.ndarray | None = None
        if segment.is_power_of_two:
            word = _word(segment)
            self._value = start.astype(word)  # residues below the modulus fit in a word
            self._scratch = np.empty(segment.length, word)
        else:
            self._value = start

    def add(self, seed: bytes, index: int, sign: int = 1) -> None:
        """value += sign * mask(seed, index); sign is +1 or -1."""
        if self._scratch is None:
            mask = expand(seed, index, self.segment)
            (add_into if sign > 0 else subtract_into)(self._value, mask, self.segment)
            return
        Keystream(seed, index).words_into(self._scratch)
        (np.add if sign > 0 else np.subtract)(self._value, self._scratch, out=self._value)

    def result(self) -> np.ndarray:
        """The vector, reduced modulo the segment's modulus (uint64)."""
        if self._scratch is not None:
            _low_bits(self._value, self.segment.modulus)
        return self._value.astype(np.uint64, copy=False)


def reduce(values: object, segment: config.Segment, what: str) -> np.ndarray:
    """An integer array as residues modulo the segment's modulus (uint64, flattened).

    Raises:
      TypeError: not integers.
      ValueError: not `segment.length` elements.
    """
    x = np.asarray(values)
    if x.dtype.kind not in "iu":
        raise TypeError(f"Expected integers for {what}, found an array of {x.dtype}.")
    if x.size != segment.length:
        raise ValueError(
            f"Expected {segment.length} elements for {what}, found {x.size} (shape {x.shape})."
        )
    flat = x.reshape(-1)
    m = segment.modulus
    if segment.is_power_of_two:
        # Two's complement: casting to uint64 is reduction modulo 2**64, so modulo any 2**r.
        out = flat.astype(np.uint64)
        if m < config.MAX_POWER_OF_TWO_MODULUS:
            np.bitwise_and(out, np.uint64(m - 1), out=out)
        return out
    if x.dtype.kind == "u":
        return np.remainder(flat.astype(np.uint64), np.uint64(m))
    return np.remainder(flat.astype(np.int64), np.int64(m)).astype(np.uint64)


def add_into(acc: np.ndarray, y: np.ndarray, segment: config.Segment) -> None:
    """acc = (acc + y) mod R, in place; both hold residues."""
    np.add(acc, y, out=acc)  # wraps modulo 2**64, which R divides or exceeds twice
    _normalize(acc, segment)


def subtract_into(acc: np.ndarray, y: np.ndarray, segment: config.Segment) -> None:
    """acc = (acc - y) mod R, in place; both hold residues."""
    if segment.is_power_of_two:
        np.subtract(acc, y, out=acc)
        _normalize(acc, segment)
        return
    borrow = acc < y
    np.subtract(acc, y, out=acc)
    np.add(acc, np.uint64(segment.modulus), out=acc, where=borrow)


def check_residues(y: np.ndarray, segment: config.Segment, what: str) -> None:
    """Raises SecAggError unless every element of `y` is below the segment's modulus."""
    if segment.modulus < config.MAX_POWER_OF_TWO_MODULUS and y.size and y.max() >= segment.modulus:
        raise config.SecAggError(
            f"Expected {what} with values below the modulus {segment.modulus}, found "
            f"{int(y.max())}."
        )


def zeros(segments: Sequence[config.Segment]) -> list[np.ndarray]:
    return [np.zeros(s.length, np.uint64) for s in segments]


def _word(segment: config.Segment) -> np.dtype:
    # Power-of-two moduli up to 2**32 draw 4-byte words: half the keystream, same uniformity.
    small = segment.is_power_of_two and segment.modulus <= 1 << 32
    return np.dtype(np.uint32 if small else np.uint64)


def _low_bits(words: np.ndarray, modulus: int) -> None:
    if modulus < 1 << (8 * words.itemsize):
        np.bitwise_and(words, words.dtype.type(modulus - 1), out=words)


def _normalize(acc: np.ndarray, segment: config.Segment) -> None:
    m = segment.modulus
    if segment.is_power_of_two:
        if m < config.MAX_POWER_OF_TWO_MODULUS:
            np.bitwise_and(acc, np.uint64(m - 1), out=acc)
    else:
        np.subtract(acc, np.uint64(m), out=acc, where=acc >= np.uint64(m))


class Keystream:
    """Consecutive AES-256-CTR keystream words of one (seed, index) pair."""

    def __init__(self, seed: bytes, index: int):
        if len(seed) != 32:
            raise ValueError(f"Expected a 32-byte seed, found {len(seed)} bytes.")
        nonce = index.to_bytes(8, "big") + bytes(8)
        self._encryptor = Cipher(algorithms.AES(seed), modes.CTR(nonce)).encryptor()

    def words(self, count: int, dtype: type | np.dtype = np.uint64) -> np.ndarray:
        """The next `count` words of `dtype` (uint32 or uint64), in a new array."""
        out = np.empty(count, dtype)
        self.words_into(out)
        return out

    def words_into(self, out: np.ndarray) -> None:
        """Fills `out` (a contiguous unsigned array) with the next keystream bytes."""
        n = out.nbytes
        view = out.data.cast("B")
        # Some versions of update_into want block_size - 1 spare bytes of output: the last
        # block and the tail (< 32 bytes) come from update() instead.
        body = max(n - n % _AES_BLOCK - _AES_BLOCK, 0)
        if body:
            self._encryptor.update_into(_zeros(body), view)
        if n - body:
            view[body:] = self._encryptor.update(_zeros(n - body))


@functools.cache
def _zero_block(size: int) -> bytes:
    return bytes(size)


def _zeros(n: int) -> memoryview:
    # Zero input for the keystream (AES-CTR of zeros is the keystream); read-only, shared.
    size = 1 << max(n - 1, 0).bit_length()
    return memoryview(_zero_block(size))[:n]
