"""Heavy hitters with an invertible Bloom lookup table (IBLT) sketch.

Each client encodes its strings into an IBLT (Goodrich & Mitzenmacher, "Invertible
Bloom Lookup Tables", 2011): `3` hash functions each pick a cell in their own third of
the table, and every cell holds, modulo the prime `P = 2^31 - 1`, the sum over the
strings placed in it of `[1, check(s), len(s), chunk_1(s), ...]` (the string's UTF-8
bytes in 16-bit chunks; `check` is a 16-bit hash). The sketch is linear, so the clients'
sketches are added with `federated_secure_modular_sum` (secure aggregation's modular
sum): the server only sees the sum, in which a cell holding a single string `s` (seen
`c` times) reads `c * [1, check(s), len(s), chunks(s)]`. The server *peels*: it divides a
cell by its count, checks the result is a well-formed string whose hash matches and
that hashes to that cell, records `(s, c)` and subtracts it from its 3 cells, until no
cell decodes. Decoding succeeds when the table has about 1.3 cells per distinct string
or more (`capacity`); the counts are exact.

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

PRIME = 2**31 - 1
NUM_HASHES = 3
CELL_SEEDS = (0x1B17, 0x1B18, 0x1B19)
CHECK_SEED = 0xC4EC
LOOKUP_SEEDS = (0x100C, 0x100D)


class Decoded(NamedTuple):
    """What peeling a summed sketch recovers: strings, exact counts, leftover cells."""

    items: list[bytes]
    counts: np.ndarray
    undecoded_cells: int


def _chunks(width: int) -> int:
    return (width + 1) // 2


@dataclasses.dataclass(frozen=True)
class IBLT:
    """The IBLT heavy-hitters method (see the module docstring).

    Attributes:
      max_len: the strings' width in bytes (`data.encode_clients(..., max_len)`).
      capacity: the most distinct strings (over all clients) the table must decode.
      threshold: the noisy count a string needs to be released with DP (default
        `4 * z * clip`); without DP every decoded string is returned.
      privacy: a `Privacy`, or None.
    """

    max_len: int = 16
    capacity: int = 1000
    threshold: float | None = None
    privacy: privacy_lib.Privacy | None = None

    def __post_init__(self) -> None:
        for name in ("max_len", "capacity"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"Expected {name} to be a positive integer, found {v!r}.")
        privacy_lib.check_privacy(self.privacy)

    @property
    def cells_per_hash(self) -> int:
        return max(2, -(-13 * self.capacity // 30))  # 1.3 cells per string, in 3 parts

    @property
    def fields(self) -> int:
        return 3 + _chunks(self.max_len)  # count, check, length, chunks

    def sketch_computation(self) -> computation.Computation:
        """The local computation of one client's sketch.

        Type signature: `(sequence<<bytes=uint8[?,L],length=int32[?]>> ->
        int32[3*cells_per_hash,fields])`.
        """
        width, part, fields = self.max_len, self.cells_per_hash, self.fields
        cells = NUM_HASHES * part
        sketch_t = types.TensorType(np.int32, [cells, fields])

        @jax_backend.jax_computation(data.string_type(width), result_type=sketch_t)
        def client_sketch(dataset):
            def step(state, batch, mask):
                b, n = batch["bytes"], batch["length"]
                m = (mask > 0).astype(jnp.uint32)
                rows = _rows(jnp, b, n) * m[:, None]  # [B, fields], each entry < 2^16
                idx = jnp.stack([_cell(jnp, b, n, j, part) for j in range(NUM_HASHES)], 1)
                # Entries < 2^16, batches < 2^15 rows: a cell gains < 2^32 - P, no wrap.
                state = state.at[idx.reshape(-1)].add(jnp.repeat(rows, NUM_HASHES, axis=0))
                return state % jnp.uint32(PRIME)

            out = dataset.reduce(jnp.zeros((cells, fields), jnp.uint32), step, masked=True)
            return out.astype(jnp.int32)

        return client_sketch

    def build(self) -> computation.Computation:
        """The federated computation: `({sequence<...>}@CLIENTS -> int32[cells,fields]@SERVER)`,
        the clients' sketches summed modulo `P` by secure aggregation."""
        sketch = self.sketch_computation()
        seq_t = sketch.type_signature.parameter

        @tracing.federated_computation(types.type_at_clients(seq_t))
        def run(datasets):
            return operators.federated_secure_modular_sum(
                operators.federated_map(sketch, datasets), PRIME
            )

        return run

    def decode(self, table: Any) -> Decoded:
        """Peels a summed sketch (see the module docstring)."""
        return peel(np.asarray(table, np.int64), self.max_len, self.cells_per_hash)

    def run(self, client_datasets: Sequence[Any], top_k: int | None = None) -> trie.HeavyHitters:
        """Sketches, decodes and (with DP) counts privately, in the current runtime."""
        datasets = list(client_datasets)
        decoded = self.decode(self.build()(datasets))
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
    """`[B, fields]` uint32: `[1, check, length, 16-bit chunks...]` per string."""
    b = b.astype(xp.uint32)
    if b.shape[-1] % 2:
        b = xp.concatenate([b, xp.zeros((*b.shape[:-1], 1), xp.uint32)], -1)
    chunks = b[..., 0::2] | (b[..., 1::2] << 8)
    check = strings.hash_bytes(b.astype(xp.uint8), n, CHECK_SEED) & xp.uint32(0xFFFF)
    ones = xp.ones(n.shape, xp.uint32)
    return xp.concatenate([xp.stack([ones, check, n.astype(xp.uint32)], -1), chunks], -1)


def _cell(xp: Any, b: Any, n: Any, j: int, part: int) -> Any:
    h = strings.hash_bytes(b, n, CELL_SEEDS[j])
    return (h % xp.uint32(part)).astype(xp.int32) + j * part


def peel(table: np.ndarray, max_len: int, part: int) -> Decoded:
    """Decodes a summed IBLT `int64[cells, fields]` (values mod `P`), vectorized peeling."""
    t = np.mod(table.astype(np.int64), PRIME)
    found: dict[bytes, int] = {}
    chunk_count = _chunks(max_len)
    while True:
        cand = np.nonzero(t[:, 0])[0]
        if not len(cand):
            break
        counts = t[cand, 0]
        inv = np.asarray([pow(int(c), PRIME - 2, PRIME) for c in counts], np.int64)
        vals = (t[cand, 1:] * inv[:, None]) % PRIME
        check, length, chunks = vals[:, 0], vals[:, 1], vals[:, 2:]
        ok = (counts < PRIME // 2) & (length <= max_len) & np.all(chunks < 65536, 1)
        cand, counts, check, length, chunks = (x[ok] for x in (cand, counts, check, length, chunks))
        raw = np.zeros((len(cand), 2 * chunk_count), np.uint8)
        raw[:, 0::2] = chunks & 0xFF
        raw[:, 1::2] = chunks >> 8
        raw = raw[:, :max_len]
        lengths = length.astype(np.int32)
        # Bytes past the length must be zero, and the hashes must agree with the cell.
        tail = np.arange(max_len)[None, :] >= lengths[:, None]
        ok = ~np.any(tail & (raw != 0), 1)
        with np.errstate(over="ignore"):
            ok &= (strings.hash_bytes(raw, lengths, CHECK_SEED) & 0xFFFF) == check
            cells = np.stack([_cell(np, raw, lengths, j, part) for j in range(NUM_HASHES)], 1)
        ok &= np.any(cells == cand[:, None], 1)
        if not ok.any():
            break
        raw, lengths, counts, cells, check = raw[ok], lengths[ok], counts[ok], cells[ok], check[ok]
        keys = [bytes(r[:n]) for r, n in zip(raw, lengths)]
        _, first = np.unique(np.asarray(keys, dtype=object), return_index=True)
        for i in first:
            found[keys[i]] = found.get(keys[i], 0) + int(counts[i])
            with np.errstate(over="ignore"):
                row = _rows(np, raw[i : i + 1], lengths[i : i + 1])[0].astype(np.int64)
            for c in cells[i]:
                t[c] = np.mod(t[c] - counts[i] * row, PRIME)
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
) -> trie.HeavyHitters:
    """Heavy hitters of the clients' strings (one list per client) with an IBLT sketch.

    Example:
      >>> hh = iblt_heavy_hitters([["a", "bb", "a"], ["a", "c"], []], max_len=4, capacity=10)
      >>> hh.items, hh.counts.tolist()
      (['a', 'bb', 'c'], [3.0, 1.0, 1.0])
    """
    enc = data.encode_clients(client_strings, max_len)
    algo = IBLT(max_len, capacity, threshold, privacy)
    return algo.run(enc.datasets, top_k)._replace(truncated=enc.truncated)
