"""Heavy hitters with an invertible Bloom lookup table (IBLT) sketch.

Each client encodes its strings into an IBLT (Goodrich & Mitzenmacher, "Invertible
Bloom Lookup Tables", 2011): `3` hash functions each pick a cell in their own third of
the table, and every cell holds the sum over the strings placed in it of
`[1, length, check_0, check_1, check_2, byte_0, ..., byte_{L-1}]` (`check_i` the 8-bit
slices of a 24-bit hash). The sketch is linear, so the clients' sketches are added by
`federated_sum` (as `uint32`, modulo `2^32`; `secure=True` uses
`federated_secure_modular_sum` with modulus `2^32`, secure aggregation's sum). In the
sum, a cell holding a single string `s` seen `c` times reads exactly `c * [1, len(s),
check(s), bytes(s)]` (each entry is below `2^32` when `c < 2^24`, so wrapping never
loses it). The server *peels*: a cell whose entries all divide by its count into bytes
(below 256), with zeros past the length, whose check matches and which is one of the
string's 3 cells, decodes to `(s, c)`; `s` is subtracted from its 3 cells, and so on
until no cell decodes. Decoding succeeds when the table has about 1.3 cells per
distinct string or more (`capacity`); the counts are exact. A sum that does not decode
completely (more distinct strings than `capacity`) raises rather than return the
strings it could peel, which may miss the most frequent ones.

Privacy: with `Privacy(z, clip)` a second round counts the decoded strings again with a
DP sum (each client's vector of counts over the candidates, clipped to L2 norm `clip`,
plus Gaussian noise `z * clip` through the DP factory), and only strings whose noisy
count reaches `threshold` (default `4 * z * clip`) are released, with noisy counts.
The reported `(epsilon, delta)` covers that release (the exact sketch sum stays inside
secure aggregation); thresholding the noisy counts keeps strings held by few clients
out with high probability (Gaussian partition selection).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang.analytics import data, trie
from fedlang.analytics import privacy as privacy_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.backends.jax import strings
from fedlang.core import computation, operators, tracing, types

MODULUS = 2**32
MAX_COUNT = 2**24  # c * 255 and c * max_len stay below 2^32
NUM_HASHES = 3
CELL_SEEDS = (0x1B17, 0x1B18, 0x1B19)
CHECK_SEED = 0xC4EC
LOOKUP_SEEDS = (0x100C, 0x100D)


class Decoded(NamedTuple):
    """What peeling a summed sketch recovers: strings, exact counts, leftover cells."""

    items: list[bytes]
    counts: np.ndarray
    undecoded_cells: int


@dataclasses.dataclass(frozen=True)
class IBLT:
    """The IBLT heavy-hitters method (see the module docstring).

    Attributes:
      max_len: the strings' width in bytes (`data.encode_clients(..., max_len)`).
      capacity: the most distinct strings (over all clients) the table must decode.
      threshold: the noisy count a string needs to be released with DP (default
        `4 * z * clip`); without DP every decoded string is returned.
      privacy: a `Privacy`, or None.
      secure: sum the sketches with `federated_secure_modular_sum` (modulus `2^32`).
    """

    max_len: int = 16
    capacity: int = 1000
    threshold: float | None = None
    privacy: privacy_lib.Privacy | None = None
    secure: bool = False

    def __post_init__(self) -> None:
        trie.check_positive_ints(self, "max_len", "capacity")
        privacy_lib.check_privacy(self.privacy)

    @property
    def cells_per_hash(self) -> int:
        return max(2, -(-13 * self.capacity // 30))  # 1.3 cells per string, in 3 parts

    @property
    def fields(self) -> int:
        return 5 + self.max_len  # count, length, 3 check bytes, the string's bytes

    def sketch_computation(self) -> computation.Computation:
        """The local computation of one client's sketch.

        Type signature: `(sequence<<bytes=uint8[?,L],length=int32[?]>> ->
        uint32[3*cells_per_hash,fields])`.
        """
        width, part, fields = self.max_len, self.cells_per_hash, self.fields
        cells = NUM_HASHES * part
        sketch_t = types.TensorType(np.uint32, [cells, fields])

        @jax_backend.jax_computation(data.string_type(width), result_type=sketch_t)
        def client_sketch(dataset):
            def step(state, batch, mask):
                b, n = batch["bytes"], batch["length"]
                rows = _rows(jnp, b, n) * (mask > 0).astype(jnp.uint32)[:, None]
                idx = jnp.stack([_cell(jnp, b, n, j, part) for j in range(NUM_HASHES)], 1)
                # uint32 arithmetic wraps: the sketch lives modulo 2^32.
                return state.at[idx.reshape(-1)].add(jnp.repeat(rows, NUM_HASHES, axis=0))

            return dataset.reduce(jnp.zeros((cells, fields), jnp.uint32), step, masked=True)

        return client_sketch

    def build(self) -> computation.Computation:
        """The federated computation: `({sequence<...>}@CLIENTS -> uint32[cells,fields]@SERVER)`,
        the clients' sketches summed modulo `2^32`."""
        sketch = self.sketch_computation()
        seq_t = sketch.type_signature.parameter
        secure = self.secure

        @tracing.federated_computation(types.type_at_clients(seq_t))
        def run(datasets):
            sketches = operators.federated_map(sketch, datasets)
            if secure:
                return operators.federated_secure_modular_sum(sketches, MODULUS)
            return operators.federated_sum(sketches)

        return run

    def decode(self, table: Any) -> Decoded:
        """Peels a summed sketch (see the module docstring)."""
        return peel(np.asarray(table), self.max_len, self.cells_per_hash)

    def run(self, client_datasets: Sequence[Any], top_k: int | None = None) -> trie.HeavyHitters:
        """Sketches, decodes and (with DP) counts privately, in the current runtime.

        Raises:
          ValueError: if the summed sketch does not decode completely (more distinct
            strings than `capacity`), naming the capacity to try.
        """
        datasets = list(client_datasets)
        decoded = self.decode(self.build()(datasets))
        if decoded.undecoded_cells:
            raise ValueError(
                f"Expected the summed sketch to decode completely, found "
                f"{decoded.undecoded_cells} of its {NUM_HASHES * self.cells_per_hash} cells "
                f"undecodable after peeling {len(decoded.items)} strings: the clients hold "
                f"more distinct strings than capacity={self.capacity} allows, so the result "
                f"would miss some (perhaps the most frequent). Raise capacity above the number "
                f"of distinct strings (capacity={2 * self.capacity} is a safe next try); "
                "IBLT.decode returns the strings decoded so far."
            )
        items, counts = decoded.items, decoded.counts.astype(np.float64)
        rounds = 1
        if self.privacy is not None and items:
            counts = np.asarray(
                build_candidate_counts(items, self.max_len, self.privacy)(datasets), np.float64
            )[: len(items)]
            rounds = 2
            threshold = 4 * self.privacy.stddev if self.threshold is None else self.threshold
            keep = counts >= threshold
            items = [s for s, k in zip(items, keep) if k]
            counts = counts[keep]
        order = sorted(range(len(items)), key=lambda i: (-counts[i], items[i]))[:top_k]
        spent = None if self.privacy is None else self.privacy.spent(1)
        return trie.HeavyHitters(
            [items[i].decode("utf-8", errors="replace") for i in order],
            np.asarray([counts[i] for i in order]), rounds, spent,
        )


def _rows(xp: Any, b: Any, n: Any) -> Any:
    """`uint32[B, 5 + L]`: `[1, length, 3 check bytes, the bytes]` per string."""
    check = strings.hash_bytes(b, n, CHECK_SEED)
    checks = [(check >> (8 * i)) & xp.uint32(0xFF) for i in range(3)]
    head = xp.stack([xp.ones(n.shape, xp.uint32), n.astype(xp.uint32), *checks], -1)
    return xp.concatenate([head, b.astype(xp.uint32)], -1)


def _cell(xp: Any, b: Any, n: Any, j: int, part: int) -> Any:
    h = strings.hash_bytes(b, n, CELL_SEEDS[j])
    return (h % xp.uint32(part)).astype(xp.int32) + j * part


def peel(table: Any, max_len: int, part: int) -> Decoded:
    """Decodes a summed IBLT (`uint32[cells, 5 + max_len]`, modulo `2^32`) by peeling,
    many cells at a time."""
    t = np.asarray(table).astype(np.int64) % MODULUS
    found: dict[bytes, int] = {}
    while True:
        cand = np.nonzero(t[:, 0])[0]
        counts = t[cand, 0]
        keep = counts < MAX_COUNT
        cand, counts = cand[keep], counts[keep]
        if not len(cand):
            break
        vals = t[cand, 1:]
        ok = np.all(vals % counts[:, None] == 0, 1)
        vals = vals // counts[:, None]
        length, checks, raw = vals[:, 0], vals[:, 1:4], vals[:, 4:]
        ok &= (length <= max_len) & np.all(checks < 256, 1) & np.all(raw < 256, 1)
        tail = np.arange(max_len)[None, :] >= length[:, None]
        ok &= ~np.any(tail & (raw != 0), 1)
        cand, counts, length, checks, raw = (x[ok] for x in (cand, counts, length, checks, raw))
        raw = raw.astype(np.uint8)
        lengths = length.astype(np.int32)
        check = strings.hash_bytes(raw, lengths, CHECK_SEED).astype(np.int64)
        ok = np.all(np.stack([(check >> (8 * i)) & 0xFF for i in range(3)], 1) == checks, 1)
        cells = np.stack([_cell(np, raw, lengths, j, part) for j in range(NUM_HASHES)], 1)
        ok &= np.any(cells == cand[:, None], 1)
        if not ok.any():
            break
        raw, lengths, counts, cells = raw[ok], lengths[ok], counts[ok], cells[ok]
        keys = [bytes(r[:n]) for r, n in zip(raw, lengths)]
        _, first = np.unique(np.asarray(keys, dtype=object), return_index=True)
        rows = _rows(np, raw[first], lengths[first]).astype(np.int64) * counts[first, None]
        for row, item_cells, i in zip(rows, cells[first], first):
            found[keys[i]] = found.get(keys[i], 0) + int(counts[i])
            t[item_cells] = (t[item_cells] - row) % MODULUS
    items = list(found)
    return Decoded(items, np.asarray([found[k] for k in items], np.int64),
                   int(np.count_nonzero(t[:, 0])))


def candidate_table(items: Sequence[bytes], max_len: int) -> tuple[np.ndarray, np.ndarray]:
    """Sorted 32-bit lookup hashes of `items` and their second hashes (`uint32[n]` each);
    clients find a string with `searchsorted` on the first and confirm with the second."""
    raw = np.zeros((len(items), max_len), np.uint8)
    lengths = np.zeros(len(items), np.int32)
    for i, s in enumerate(items):
        raw[i, : len(s)] = np.frombuffer(s, np.uint8)
        lengths[i] = len(s)
    first = strings.hash_bytes(raw, lengths, LOOKUP_SEEDS[0])
    second = strings.hash_bytes(raw, lengths, LOOKUP_SEEDS[1])
    return first, second


def build_candidate_counts(
    items: Sequence[bytes], max_len: int, privacy: privacy_lib.Privacy | None
) -> computation.Computation:
    """Counts of the given strings over the clients (a DP sum with `privacy`).

    Type signature: `({sequence<...>}@CLIENTS -> float32[n+1]@SERVER)` in the order of
    `items`; the last entry counts strings that are no candidate.
    """
    first, second = candidate_table(items, max_len)
    order = np.argsort(first, kind="stable")
    sorted_first, sorted_second = first[order], second[order]
    n = len(items)
    count_t = types.TensorType(np.int32, [n + 1])

    @jax_backend.jax_computation(data.string_type(max_len), result_type=count_t)
    def client_counts(dataset):
        def step(state, batch, mask):
            b, ln = batch["bytes"], batch["length"]
            h1 = strings.hash_bytes(b, ln, LOOKUP_SEEDS[0])
            h2 = strings.hash_bytes(b, ln, LOOKUP_SEEDS[1])
            i = jnp.clip(jnp.searchsorted(jnp.asarray(sorted_first), h1), 0, n - 1)
            hit = (jnp.asarray(sorted_first)[i] == h1) & (jnp.asarray(sorted_second)[i] == h2)
            where = jnp.where(hit, jnp.asarray(order)[i], n)
            return state.at[where].add(mask.astype(jnp.int32))

        return dataset.reduce(jnp.zeros(n + 1, jnp.int32), step, masked=True)

    @tracing.federated_computation(types.type_at_clients(data.string_type(max_len)))
    def run(datasets):
        return privacy_lib.aggregate(operators.federated_map(client_counts, datasets), privacy)

    return run


def iblt_heavy_hitters(
    client_strings: Sequence[Sequence[str]],
    top_k: int | None = None,
    *,
    max_len: int = 16,
    capacity: int = 1000,
    threshold: float | None = None,
    privacy: privacy_lib.Privacy | None = None,
    secure: bool = False,
) -> trie.HeavyHitters:
    """Heavy hitters of the clients' strings (one list per client) with an IBLT sketch.

    Raises:
      ValueError: if the summed sketch does not decode completely (more distinct
        strings than `capacity`): raise `capacity`.
      TypeError: if `client_strings` is a flat list of strings, not one list per client.

    Example:
      >>> hh = iblt_heavy_hitters([["a", "bb", "a"], ["a", "c"], []], max_len=4, capacity=10)
      >>> hh.items, hh.counts.tolist()
      (['a', 'bb', 'c'], [3.0, 1.0, 1.0])
    """
    enc = data.encode_clients(client_strings, max_len)
    algo = IBLT(max_len, capacity, threshold, privacy, secure)
    return algo.run(enc.datasets, top_k)._replace(truncated=enc.truncated)
