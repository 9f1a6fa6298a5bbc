"""Histograms over fixed numeric bins and over categories (integer ids or strings).

A client counts its records per bin in a `dataset.reduce`; the counts are summed
across clients (exactly, securely or with DP: `analytics.privacy`). Bins follow
`numpy.histogram`: bin `i` is `[edges[i], edges[i+1])`, the last bin also holds
`edges[-1]`; records outside `[edges[0], edges[-1]]` (and NaN) are counted in
`out_of_range`, never dropped silently. With DP one client adds its whole count
vector (`[bins + 1]`, the last entry being its out-of-range count): `Privacy.clip`
bounds its L2 norm.

String categories are matched by a 64-bit hash (two `strings.hash_bytes` seeds) of the
encoded strings, computed by the clients inside JAX and by the server for the known
categories; a string that is no category counts as out of range.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang.analytics import data
from fedlang.analytics import privacy as privacy_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.backends.jax import strings
from fedlang.core import computation, operators, tracing, types

CATEGORY_SEEDS = (0x5EED1, 0x5EED2)


class Histogram(NamedTuple):
    """Counts per bin (float32 with DP or secure aggregation, else int32).

    Attributes:
      counts: `[bins]`.
      out_of_range: records outside the bins (or unknown categories).
      privacy: the spent `(epsilon, delta)` with DP, else None.
      truncated: strings cut to `max_len` when encoding (string histograms), else 0.
    """

    counts: np.ndarray
    out_of_range: Any
    privacy: privacy_lib.Spent | None
    truncated: int = 0


def _edges(edges: Any) -> np.ndarray:
    e = np.asarray(edges, dtype=np.float32)
    if e.ndim != 1 or len(e) < 2 or not np.all(np.diff(e) > 0) or not np.all(np.isfinite(e)):
        raise ValueError(
            f"Expected at least two finite, strictly increasing bin edges, found {edges!r}."
        )
    return e


def _counts_computation(
    seq_t: types.SequenceType,
    bins: int,
    bin_of: Any,
    privacy: privacy_lib.Privacy | None,
    secure_bound: float | None,
) -> computation.Computation:
    """The shared skeleton: `bin_of(batch) -> int32[B]` in `[0, bins]` (`bins`: out of
    range); counts per client, summed across clients."""
    count_t = types.TensorType(np.int32, [bins + 1])

    @jax_backend.jax_computation(seq_t, result_type=count_t)
    def client_counts(dataset):
        def step(state, batch, mask):
            which = bin_of(batch)
            return state.at[which].add(mask.astype(jnp.int32))

        return dataset.reduce(jnp.zeros(bins + 1, jnp.int32), step, masked=True)

    @tracing.federated_computation(types.type_at_clients(seq_t))
    def run(datasets):
        return privacy_lib.aggregate(
            operators.federated_map(client_counts, datasets), privacy, secure_bound
        )

    return run


def build_histogram(
    edges: Sequence[float],
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> computation.Computation:
    """The federated histogram over fixed bins.

    Type signature: `({sequence<float32[?]>}@CLIENTS -> int32[bins+1]@SERVER)` (float32
    with DP or secure aggregation); the last entry counts out-of-range records.
    """
    e = _edges(edges)
    bins = len(e) - 1

    def bin_of(batch: Any) -> Any:
        i = jnp.searchsorted(jnp.asarray(e), batch, side="right") - 1
        i = jnp.where(batch == e[-1], bins - 1, i)  # numpy: the last bin is closed
        inside = (batch >= e[0]) & (batch <= e[-1])
        return jnp.where(inside, i, bins).astype(jnp.int32)

    return _counts_computation(
        data.number_type(np.float32), bins, bin_of, privacy_lib.check_privacy(privacy), secure_bound
    )


def _result(out: Any, privacy: privacy_lib.Privacy | None, truncated: int = 0) -> Histogram:
    out = np.asarray(out)
    return Histogram(out[:-1], out[-1], None if privacy is None else privacy.spent(1), truncated)


def histogram(
    client_values: Sequence[Any],
    edges: Sequence[float],
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> Histogram:
    """The histogram of all clients' records (one array-like per client) over `edges`.

    Example:
      >>> h = histogram([[0.5, 1.5, 9.0], [1.0, 2.0]], edges=[0, 1, 2])
      >>> h.counts.tolist(), int(h.out_of_range)
      ([1, 3], 1)
    """
    comp = build_histogram(edges, privacy=privacy, secure_bound=secure_bound)
    return _result(comp([data.number_batches(v) for v in client_values]), privacy)


def build_category_histogram(
    num_categories: int,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> computation.Computation:
    """The federated histogram of integer categories `0..num_categories-1`.

    Type signature: `({sequence<int32[?]>}@CLIENTS -> int32[num_categories+1]@SERVER)`.
    """
    if isinstance(num_categories, bool) or not isinstance(num_categories, int) or num_categories < 1:
        raise ValueError(f"Expected a positive number of categories, found {num_categories!r}.")

    def bin_of(batch: Any) -> Any:
        inside = (batch >= 0) & (batch < num_categories)
        return jnp.where(inside, batch, num_categories).astype(jnp.int32)

    return _counts_computation(
        data.number_type(np.int32), num_categories, bin_of, privacy_lib.check_privacy(privacy),
        secure_bound,
    )


def category_histogram(
    client_values: Sequence[Any],
    num_categories: int,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> Histogram:
    """Counts of integer categories over all clients (one array-like of ids per client)."""
    comp = build_category_histogram(num_categories, privacy=privacy, secure_bound=secure_bound)
    return _result(comp([data.number_batches(v, np.int32) for v in client_values]), privacy)


def category_hashes(categories: Sequence[str], max_len: int) -> np.ndarray:
    """`uint32[n, 2]`: the two hashes clients compare with, one row per category."""
    enc = strings.encode(np.asarray(list(categories), dtype=types.STRING), max_len)
    return np.stack([strings.hash_bytes(enc.bytes, enc.lengths, s) for s in CATEGORY_SEEDS], -1)


def build_string_histogram(
    categories: Sequence[str],
    max_len: int,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> computation.Computation:
    """The federated histogram of string categories (clients' strings encoded by
    `data.encode_clients(..., max_len)`).

    Type signature: `({sequence<<bytes=uint8[?,L],length=int32[?]>>}@CLIENTS ->
    int32[len(categories)+1]@SERVER)`.

    Raises:
      ValueError: for duplicate categories (or two that collide after encoding).
    """
    cats = list(categories)
    table = category_hashes(cats, max_len)
    if len({tuple(r) for r in table.tolist()}) != len(cats):
        raise ValueError(
            f"Expected distinct categories (after cutting to {max_len} bytes), found duplicates "
            f"in {cats[:10]}{'...' if len(cats) > 10 else ''}."
        )
    n = len(cats)

    def bin_of(batch: Any) -> Any:
        h = jnp.stack(
            [strings.hash_bytes(batch["bytes"], batch["length"], s) for s in CATEGORY_SEEDS], -1
        )
        match = jnp.all(h[:, None, :] == jnp.asarray(table)[None, :, :], -1)  # [B, n]
        return jnp.where(match.any(1), jnp.argmax(match, 1), n).astype(jnp.int32)

    return _counts_computation(
        data.string_type(max_len), n, bin_of, privacy_lib.check_privacy(privacy), secure_bound
    )


def string_histogram(
    client_strings: Sequence[Sequence[str]],
    categories: Sequence[str],
    max_len: int = 32,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> Histogram:
    """Counts of string categories over all clients' strings (one list per client).

    Strings longer than `max_len` bytes are cut (and counted in `truncated`).

    Example:
      >>> h = string_histogram([["cat", "dog", "cat"], ["emu"]], ["cat", "dog"])
      >>> h.counts.tolist(), int(h.out_of_range)
      ([2, 1], 1)
    """
    enc = data.encode_clients(client_strings, max_len)
    comp = build_string_histogram(categories, max_len, privacy=privacy, secure_bound=secure_bound)
    return _result(comp(enc.datasets), privacy, enc.truncated)


# ----------------------------------------------------------------------------
# Quantiles from a hierarchical (tree) histogram


class Quantiles(NamedTuple):
    """Estimated quantiles, the tree they came from, and the privacy spent."""

    values: np.ndarray
    tree: np.ndarray
    privacy: privacy_lib.Spent | None


def tree_size(depth: int) -> int:
    """Nodes of a complete binary tree with `2**depth` leaves (levels 0..depth)."""
    return 2 ** (depth + 1) - 1


def build_tree_histogram(
    lower: float,
    upper: float,
    depth: int = 10,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> computation.Computation:
    """The hierarchical histogram: counts of every node of a binary tree over
    `[lower, upper]` with `2**depth` equal leaves, stored level by level (root first).

    Records are clamped to `[lower, upper]` (NaN records are skipped). One record adds 1 to one node per level,
    so with DP a client of `n` records adds a vector of L2 norm at most
    `n * sqrt(depth + 1)`.

    Type signature: `({sequence<float32[?]>}@CLIENTS -> int32[2**(depth+1)-1]@SERVER)`.
    """
    lo, hi = float(lower), float(upper)
    if not lo < hi or not (isinstance(depth, int) and 1 <= depth <= 20):
        raise ValueError(
            f"Expected lower < upper and an integer depth in [1, 20], found {lower}, {upper}, {depth!r}."
        )
    leaves = 2**depth
    seq_t = data.number_type(np.float32)
    tree_t = types.TensorType(np.int32, [tree_size(depth)])

    @jax_backend.jax_computation(seq_t, result_type=tree_t)
    def client_tree(dataset):
        def step(state, batch, mask):
            x = jnp.clip(batch, lo, hi)
            leaf = jnp.clip(jnp.floor((x - lo) / (hi - lo) * leaves), 0, leaves - 1).astype(jnp.int32)
            keep = (mask > 0) & ~jnp.isnan(batch)
            return state.at[leaf].add(keep.astype(jnp.int32))

        counts = dataset.reduce(jnp.zeros(leaves, jnp.int32), step, masked=True)
        levels = [counts]
        for _ in range(depth):
            levels.append(levels[-1].reshape(-1, 2).sum(1))
        return jnp.concatenate(levels[::-1])

    privacy = privacy_lib.check_privacy(privacy)

    @tracing.federated_computation(types.type_at_clients(seq_t))
    def run(datasets):
        return privacy_lib.aggregate(
            operators.federated_map(client_tree, datasets), privacy, secure_bound
        )

    return run


def tree_quantiles(tree: Any, qs: Sequence[float], lower: float, upper: float) -> np.ndarray:
    """Quantiles from a (possibly noisy) tree histogram, walking down from the root.

    At each node the rank still to find is compared with the left child's count
    (negative noisy counts count as 0); inside the final leaf the value is interpolated.
    """
    tree = np.maximum(np.asarray(tree, np.float64), 0.0)
    depth = int(np.log2(len(tree) + 1)) - 1
    if tree_size(depth) != len(tree):
        raise ValueError(f"Expected a tree of 2**(depth+1)-1 nodes, found {len(tree)}.")
    width = (upper - lower) / 2**depth
    out = []
    for q in qs:
        if not 0 <= q <= 1:
            raise ValueError(f"Expected quantiles in [0, 1], found {q}.")
        rank, node = q * tree[0], 0
        for level in range(depth):
            start = 2 ** (level + 1) - 1
            left = start + 2 * (node - (2**level - 1))
            if rank <= tree[left] or tree[left + 1] <= 0:
                node = left
            else:
                rank -= tree[left]
                node = left + 1
        leaf = node - (2**depth - 1)
        # The records of a leaf are taken as spread evenly over it (rank r of n at (r-1/2)/n).
        frac = 0.5 if tree[node] <= 0 else min(max((rank - 0.5) / tree[node], 0.0), 1.0)
        out.append(lower + (leaf + frac) * width)
    return np.asarray(out)


def quantiles(
    client_values: Sequence[Any],
    qs: Sequence[float],
    lower: float,
    upper: float,
    depth: int = 10,
    *,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> Quantiles:
    """Quantiles `qs` of all clients' records within `[lower, upper]` from a tree
    histogram (`build_tree_histogram`); exact to a leaf's width without DP.

    Example:
      >>> q = quantiles([[1.0, 2.0], [3.0, 4.0]], [0.5], lower=0, upper=8, depth=3)
      >>> q.values.tolist()
      [2.5]
    """
    comp = build_tree_histogram(lower, upper, depth, privacy=privacy, secure_bound=secure_bound)
    tree = np.asarray(comp([data.number_batches(v) for v in client_values]))
    spent = None if privacy is None else privacy.spent(1)
    return Quantiles(tree_quantiles(tree, qs, lower, upper), tree, spent)

