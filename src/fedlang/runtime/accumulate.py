"""Chunk-by-chunk accumulators for the aggregation intrinsics.

Each accumulator folds chunk values (see `chunks.py`) into a running partial result,
so aggregating a cohort needs memory for one chunk, not the cohort. The running result
is also a value of its own (`partial()`, of type `partial_type`) that merges with
another accumulator's (`merge`): runtimes that aggregate in several places (deployment
clients and their server, Ray workers) fold clients where they are and merge partials.
One contribution's partial also has a narrow form (`report()`, of type `report_type`):
a sum's totals in the values' own dtype, which a deployment client reports (a float32
model's update travels as float32); `merge` takes it and widens it. Results match the
reference semantics in `fedlang.core.intrinsic_defs` (sums of floats are reduced in
float32 within a chunk and accumulated across chunks in float64); with no clients
each returns its intrinsic's `empty` value, given by the definition.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import Any, cast

import jax
import jax.numpy as jnp
import numpy as np
import numpy.typing as npt

from fedlang.core import intrinsic_defs, intrinsics, sparse, sparse_intrinsics, structure, types
from fedlang.runtime import chunks, reference

#: An accumulator's running result as a value of its `partial_type` (internal form),
#: which another accumulator of the same aggregation merges.
Partial = Any
#: The result of an aggregation over no clients, from the member type.
Empty = Callable[[types.Type], chunks.Internal]


def _leaf_chunks(cv: chunks.ChunkValue, t: types.Type) -> list[tuple[chunks.Leaf, bool]]:
    """(leaf, is_replicated) pairs of a tensor-struct chunk value, in flatten order."""
    if isinstance(cv, chunks.Rep):
        return [(x, True) for x in structure.flatten(cv.value, t)]
    if isinstance(t, types.StructType):
        return [p for x, et in zip(cv, t.types) for p in _leaf_chunks(x, et)]
    return [(cv, False)]


# Dtypes whose chunk reductions NumPy does in place on the host (BLAS for weighted
# sums). A chunk's values are host arrays already; handing them to JAX first copies
# them into device buffers: for a 13 MB update x 8 clients, 109 ms against 4 ms.
_HOST_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


def _host_float(x: chunks.Leaf) -> bool:
    """A float32/64 chunk in host memory: a NumPy array, or a JAX array on the CPU
    (NumPy reads it in place; XLA:CPU's reduction over the clients' axis is also
    several times slower than NumPy's)."""
    if isinstance(x, np.ndarray):
        return x.dtype in _HOST_FLOATS
    if isinstance(x, jax.Array):
        return x.dtype in _HOST_FLOATS and all(d.platform == "cpu" for d in x.devices())
    return False


def _acc_dtype(dt: np.dtype) -> npt.DTypeLike:
    return np.float64 if dt.kind in "fc" else np.int64 if dt.kind in "iub" else dt


def _widened(t: types.Type) -> types.Type:
    """`t` with every tensor in its accumulation dtype (float64, complex128 or int64)."""
    if isinstance(t, types.StructType):
        return types.StructType([(n, _widened(x)) for n, x in t.elements], container=t.container)
    assert isinstance(t, types.TensorType)  # the aggregation rules allow dense tensors only
    wide = np.complex128 if t.dtype.kind == "c" else _acc_dtype(t.dtype)
    return types.TensorType(wide, t.shape)


def _struct(**fields: types.Type) -> types.StructType:
    return types.StructType(list(fields.items()))


_INT64 = types.TensorType(np.int64)
_FLOAT64 = types.TensorType(np.float64)


class Accumulator:
    """Folds chunks with `add(cv, c)` and finishes with `result()` (internal value).

    `partial()` is the running result as a value of `partial_type`, and `merge(p)` folds
    in another accumulator's partial: `a.merge(b.partial())` then `a.result()` equals
    one accumulator fed the chunks of both. For `b` fed one contribution, `b.report()`
    (of `report_type`, no wider than its values) merges to the same bits.
    """

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        raise NotImplementedError

    def result(self) -> chunks.Internal:
        raise NotImplementedError

    @property
    def partial_type(self) -> types.Type:
        raise TypeError(f"{type(self).__name__} cannot be aggregated in parts.")

    def partial(self) -> Partial:
        raise TypeError(f"{type(self).__name__} cannot be aggregated in parts.")

    def merge(self, partial: Partial) -> None:
        raise TypeError(f"{type(self).__name__} cannot be aggregated in parts.")

    @property
    def report_type(self) -> types.Type:
        """The type of one contribution's partial (`report()`): `partial_type`, with a
        sum's totals in the values' own dtype instead of the wide one they accumulate in."""
        return self.partial_type

    def report(self) -> Partial:
        """The partial of an accumulator fed one contribution, as a value of
        `report_type` (what a deployment client reports); `merge` takes it as it takes
        a `partial()`.

        Raises:
          ValueError: if the accumulator holds more than one contribution's worth: a
            total that its values' dtype cannot hold exactly.
        """
        return self.partial()


class Sum(Accumulator):
    def __init__(self, member: types.Type, empty: Empty):
        self.member, self.empty = member, empty
        self.leaf_types = structure.leaf_types(member)
        self.total: chunks.Leaves | None = None

    def _chunk_sums(self, cv: chunks.ChunkValue, c: int) -> list[np.ndarray]:
        out = []
        for (x, rep), lt in zip(_leaf_chunks(cv, self.member), self.leaf_types):
            if rep:
                out.append(np.asarray(x, _acc_dtype(lt.dtype)) * c)
            elif _host_float(x):  # reduced in its own dtype, as below; widened when added
                x = np.asarray(x)
                # one client's row is its chunk's sum (np.add.reduce would copy it)
                out.append(x[0] if len(x) == 1 else np.add.reduce(x, axis=0))
            else:
                out.append(np.asarray(jnp.sum(jnp.asarray(x), axis=0), _acc_dtype(lt.dtype)))
        return out

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        self._add_total(self._chunk_sums(cv, c))

    def _add_total(self, sums: chunks.Leaves) -> None:
        # Into the wide total in place: adding a model-sized chunk allocates no new total
        # (and a sum in the values' dtype is widened element by element as it is added).
        if self.total is None:  # a copy: the total is written to, never its inputs
            wide = structure.leaf_types(_widened(self.member))
            self.total = [np.array(x, lt.dtype) for x, lt in zip(sums, wide)]
        else:
            for t, x in zip(self.total, sums):
                np.add(t, x, out=t)

    def result(self) -> chunks.Internal:
        if self.total is None:
            return self.empty(self.member)
        return structure.unflatten(
            [t.astype(lt.dtype) for t, lt in zip(self.total, self.leaf_types)], self.member
        )

    def _total_value(self) -> chunks.Internal:
        # The running total's own arrays, not copies (a model-sized partial is read at
        # once: serialized, checked, sent): later adds change them in place.
        wide = _widened(self.member)
        if self.total is None:
            return structure.unflatten(
                [
                    np.zeros([d or 0 for d in lt.shape], lt.dtype)
                    for lt in structure.leaf_types(wide)
                ],
                wide,
            )
        return structure.unflatten(list(self.total), wide)

    def _report_total(self) -> chunks.Internal:
        """The total in the values' own dtypes. One contribution's total is exact in
        them (it was summed in them, then widened: `_chunk_sums`, `WeightedMean.add`);
        this checks it rather than trusting it, so a report never rounds."""
        wide = _widened(self.member)
        leaves = []
        for i, (x, lt) in enumerate(zip(structure.flatten(self._total_value(), wide),
                                        self.leaf_types)):
            x = np.asarray(x)
            with np.errstate(over="ignore", invalid="ignore"):  # inexact: refused below
                narrow = np.asarray(x.astype(lt.dtype))
            if not np.array_equal(narrow.astype(x.dtype), x, equal_nan=x.dtype.kind in "fc"):
                raise ValueError(
                    f"Expected one contribution's total, exact in its values' dtype, found "
                    f"tensor {i} of the total ({lt}) not exact in {np.dtype(lt.dtype).name}; "
                    "report() is the partial of one contribution: give several as partial()."
                )
            leaves.append(narrow)
        return structure.unflatten(leaves, self.member)

    @property
    def partial_type(self) -> types.Type:
        return _widened(self.member)

    def partial(self) -> Partial:
        return self._total_value()

    @property
    def report_type(self) -> types.Type:
        return self.member

    def report(self) -> Partial:
        return self._report_total()

    def merge(self, partial: Partial) -> None:
        self._merge_total(partial)

    def _merge_total(self, total: chunks.Internal) -> None:
        # A report's totals are in the values' dtypes: widened as they are added.
        self._add_total([np.asarray(x) for x in structure.flatten(total, _widened(self.member))])


class Mean(Sum):
    def __init__(self, member: types.Type, empty: Empty):
        super().__init__(member, empty)
        self.count = 0

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        super().add(cv, c)
        self.count += c

    def result(self) -> chunks.Internal:
        if self.total is None or self.count == 0:
            return self.empty(self.member)
        return structure.unflatten(
            [(t / self.count).astype(lt.dtype) for t, lt in zip(self.total, self.leaf_types)],
            self.member,
        )

    @property
    def partial_type(self) -> types.Type:
        return _struct(total=_widened(self.member), count=_INT64)

    def partial(self) -> Partial:
        return (self._total_value(), np.int64(self.count))

    @property
    def report_type(self) -> types.Type:
        return _struct(total=self.member, count=_INT64)

    def report(self) -> Partial:
        return (self._report_total(), np.int64(self.count))

    def merge(self, partial: Partial) -> None:
        total, count = partial
        self._merge_total(total)
        self.count += int(count)


class WeightedMean(Sum):
    """sum(w * x) / sum(w); NaN when the weights sum to zero (as the reference)."""

    def __init__(self, member: types.Type, weight_type: types.Type, empty: Empty):
        super().__init__(member, empty)
        self.weight_type = weight_type
        self.weight_total = 0.0

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        values, weights = cv
        w = (
            np.full(c, float(weights.value))
            if isinstance(weights, chunks.Rep)
            else np.asarray(weights, np.float64)
        )
        wj = jnp.asarray(w, jnp.float32)
        sums = []
        for x, rep in _leaf_chunks(values, self.member):
            if rep:
                sums.append(np.asarray(x, np.float64) * w.sum())
            elif _host_float(x):
                x = np.asarray(x)
                sums.append(np.asarray(np.tensordot(w.astype(x.dtype), x, axes=1), np.float64))
            else:
                xj = jnp.asarray(x)
                sums.append(np.asarray(jnp.tensordot(wj.astype(xj.dtype), xj, axes=1), np.float64))
        self._add_total(sums)
        self.weight_total += float(w.sum())

    def result(self) -> chunks.Internal:
        if self.total is None:
            return self.empty(self.member)
        with np.errstate(invalid="ignore", divide="ignore"):
            leaves = [
                (t / self.weight_total).astype(lt.dtype)
                for t, lt in zip(self.total, self.leaf_types)
            ]
        return structure.unflatten(leaves, self.member)

    @property
    def partial_type(self) -> types.Type:
        return _struct(total=_widened(self.member), weight=_FLOAT64)

    def partial(self) -> Partial:
        return (self._total_value(), np.float64(self.weight_total))

    @property
    def report_type(self) -> types.Type:
        return _struct(total=self.member, weight=_FLOAT64)

    def report(self) -> Partial:
        return (self._report_total(), np.float64(self.weight_total))

    def merge(self, partial: Partial) -> None:
        total, weight = partial
        self._merge_total(total)
        self.weight_total += float(weight)


class Extremum(Accumulator):
    def __init__(self, member: types.Type, is_min: bool, empty: Empty):
        self.member, self.empty = member, empty
        self.leaf_types = structure.leaf_types(member)
        self.reduce = np.minimum if is_min else np.maximum
        self.jreduce = jnp.min if is_min else jnp.max
        self.best: chunks.Leaves | None = None

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        if c == 0:
            return
        vals = [
            np.asarray(x) if rep else np.asarray(self.jreduce(jnp.asarray(x), axis=0))
            for x, rep in _leaf_chunks(cv, self.member)
        ]
        self._fold(vals)

    def _fold(self, vals: chunks.Leaves) -> None:
        self.best = (
            vals if self.best is None else [self.reduce(a, b) for a, b in zip(self.best, vals)]
        )

    def result(self) -> chunks.Internal:
        if self.best is None:
            return self.empty(self.member)
        leaves = [b.astype(lt.dtype) for b, lt in zip(self.best, self.leaf_types)]
        return structure.unflatten(leaves, self.member)

    @property
    def partial_type(self) -> types.Type:
        return _struct(best=self.member, seen=types.TensorType(np.bool_))

    def partial(self) -> Partial:
        return (self.result(), np.bool_(self.best is not None))

    def merge(self, partial: Partial) -> None:
        best, seen = partial
        if bool(seen):
            self._fold([np.asarray(x) for x in structure.flatten(best, self.member)])


class Aggregate(Accumulator):
    """federated_aggregate: clients folded per chunk with `accumulate`, chunks merged."""

    def __init__(
        self,
        member: types.Type,
        zero: chunks.Internal,
        accumulate: reference.Function,
        merge: reference.Function,
        report: reference.Function,
        call: reference.Call,
        zero_type: types.Type | None = None,
    ):
        self.member, self.zero, self.zero_type = member, zero, zero_type
        self.accumulate_fn, self.merge_fn, self.report_fn = accumulate, merge, report
        self.call = call
        self.total: chunks.Internal | None = None
        self.count = 0

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        partial = self.zero
        for v in chunks.unstack(cv, self.member, c):
            partial = self.call(self.accumulate_fn, (partial, v))
        self._fold(partial)
        self.count += c

    def _fold(self, partial: chunks.Internal) -> None:
        self.total = (
            partial if self.total is None else self.call(self.merge_fn, (self.total, partial))
        )

    def result(self) -> chunks.Internal:
        total = self.zero if self.total is None else self.total
        return self.call(self.report_fn, total)

    @property
    def partial_type(self) -> types.Type:
        if self.zero_type is None:
            raise TypeError("This federated_aggregate was set up without its zero's type.")
        return _struct(value=self.zero_type, count=_INT64)

    def partial(self) -> Partial:
        return (self.zero if self.total is None else self.total, np.int64(self.count))

    def merge(self, partial: Partial) -> None:
        value, count = partial
        if int(count):
            self._fold(value)
            self.count += int(count)


class ModularSum(Accumulator):
    """Exact integer sums of inputs wrapped modulo `wrap`, reduced modulo `modulus(n)` at the end.

    A leaf whose input wrap and partial modulus are both powers of two up to 2^64 is
    summed in uint64 arithmetic (its natural wrap-around is exact modulo 2^64, hence
    modulo every smaller power of two), as is a leaf wrapped modulo some m <= 2^32 and
    reduced modulo m after every chunk; other leaves use exact Python integers. The
    result is the same either way (`tests/runtime/test_accumulate.py` checks it), the
    fast leaves without an object array per chunk.
    """

    def __init__(
        self,
        member: types.Type,
        wrap: list[int],
        modulus: Callable[[int], list[int]],
        partial_moduli: list[int] | None = None,
    ):
        self.member, self.wrap, self.modulus = member, wrap, modulus
        self.leaf_types = structure.leaf_types(member)
        self.total: chunks.Leaves | None = None
        self.count = 0
        # Partials are kept modulo a multiple of every final modulus (2^64 for bit
        # widths, whose group is 2^(b + ceil(log2 n)); the modulus itself otherwise).
        self.partial_moduli = partial_moduli or [1 << 64] * len(self.leaf_types)
        self.fast = [
            _fast_modulus(w, m) for w, m in zip(self.wrap, self.partial_moduli, strict=True)
        ]

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        sums: chunks.Leaves = []
        for i, (x, rep) in enumerate(_leaf_chunks(cv, self.member)):
            if self.fast[i]:
                wrapped = _wrap_u64(np.asarray(x), self.wrap[i])
                if rep:
                    sums.append(wrapped * np.uint64(c))
                else:
                    sums.append(wrapped.sum(axis=0, dtype=np.uint64) if c else np.uint64(0))
                continue
            wrapped = _mod(np.asarray(x).astype(object), self.wrap[i])
            sums.append(wrapped * c if rep else (wrapped.sum(axis=0) if c else 0))
        self._add_total(sums)
        self.count += c

    def _add_total(self, sums: chunks.Leaves) -> None:
        if self.total is not None:
            sums = [a + b for a, b in zip(self.total, sums)]
        self.total = [
            _reduce_u64(x, self.partial_moduli[i]) if self.fast[i] else x
            for i, x in enumerate(sums)
        ]

    @property
    def partial_type(self) -> types.Type:
        totals = [types.TensorType(np.uint64, lt.shape) for lt in self.leaf_types]
        return _struct(totals=types.StructType(totals), count=_INT64)

    def partial(self) -> Partial:
        totals = []
        for i, lt in enumerate(self.leaf_types):
            total = 0 if self.total is None else self.total[i]
            shape = [d or 0 for d in lt.shape]
            if self.fast[i]:
                reduced = np.zeros(shape, np.uint64) + _reduce_u64(
                    np.asarray(total, np.uint64), self.partial_moduli[i]
                )
                totals.append(reduced)
                continue
            reduced = _mod(
                np.asarray(total, dtype=object) + np.zeros(shape, object),
                self.partial_moduli[i],
            )
            totals.append(np.asarray(reduced.astype(np.uint64)))
        return (tuple(totals), np.int64(self.count))

    def merge(self, partial: Partial) -> None:
        totals, count = partial
        self._add_total(
            [
                np.asarray(x, np.uint64) if self.fast[i] else np.asarray(x).astype(object)
                for i, x in enumerate(totals)
            ]
        )
        self.count += int(count)

    def result(self) -> chunks.Internal:
        moduli = self.modulus(self.count)
        leaves = []
        for i, lt in enumerate(self.leaf_types):
            total = 0 if self.total is None else self.total[i]
            acc = _mod(
                np.asarray(total).astype(object)
                + np.zeros([d or 0 for d in lt.shape], dtype=object),
                moduli[i],
            )
            leaves.append(np.asarray(acc.astype(np.int64)).astype(lt.dtype))
        return structure.unflatten(leaves, self.member)


def _is_pow2(m: int) -> bool:
    return m > 0 and m & (m - 1) == 0


def _fast_modulus(wrap: int, partial_modulus: int) -> bool:
    """Whether a leaf can be summed exactly in uint64 (see `ModularSum`)."""
    if _is_pow2(wrap) and _is_pow2(partial_modulus):
        return wrap <= 1 << 64 and partial_modulus <= 1 << 64
    return wrap == partial_modulus and wrap <= 1 << 32


def _wrap_u64(x: np.ndarray, wrap: int) -> np.ndarray:
    """Integer inputs modulo `wrap` as uint64 (`wrap` a power of two <= 2^64, or <= 2^32)."""
    if _is_pow2(wrap):
        # Two's complement: the cast is exact modulo 2^64, so masking is exact modulo wrap.
        u = x.astype(np.int64).astype(np.uint64) if x.dtype.kind == "i" else x.astype(np.uint64)
        return u if wrap == 1 << 64 else u & np.uint64(wrap - 1)
    if x.dtype.kind == "u":
        return np.mod(x.astype(np.uint64), np.uint64(wrap))
    return np.mod(x.astype(np.int64), np.int64(wrap)).astype(np.uint64)


def _reduce_u64(x: chunks.Leaf, modulus: int) -> chunks.Leaf:
    """A uint64 total modulo `modulus` (a power of two <= 2^64, or at most 2^32)."""
    if modulus == 1 << 64:
        return x
    if _is_pow2(modulus):
        return x & np.uint64(modulus - 1)
    return x % np.uint64(modulus)


def _mod(values: Any, modulus: int) -> Any:
    """`values mod modulus` exactly, for Python integers of any size (object arrays)."""
    return np.asarray(np.mod(values, np.asarray(modulus, dtype=object)), dtype=object)


def bitwidth_moduli(widths: list[int]) -> Callable[[int], list[int]]:
    def moduli(n: int) -> list[int]:
        extra = math.ceil(math.log2(n)) if n > 1 else 0
        return [2 ** (b + extra) for b in widths]

    return moduli


class Collect(Accumulator):
    """Materializes CLIENTS values as a list (for results returned to Python)."""

    def __init__(self, member: types.Type):
        self.member = member
        self.values: list[chunks.Internal] = []

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        self.values.extend(chunks.unstack(cv, self.member, c))

    def result(self) -> chunks.Internal:
        return self.values


class SparseSum(Accumulator):
    """The sparse family: a dense scatter-add, or a running coalesced union of indices.

    Client entries are merged chunk by chunk; the union's per-index client counts give
    `federated_sparse_mean`. Memory is the result's size, never the cohort's.
    """

    def __init__(self, member: types.Type, mode: str, empty: Empty):
        self.member, self.mode, self.empty = member, mode, empty
        # the sparse intrinsics' type rules checked that every leaf is sparse
        self.leaves = cast("list[types.SparseTensorType]", types.tensor_leaves(member))
        self.running: list[Any] | None = None

    def _client_leaves(self, value: chunks.Internal) -> list[sparse.SparseTensor]:
        flat = structure.flatten(value, self.member)  # (indices, values) per sparse leaf
        return [
            sparse.SparseTensor.from_parts(flat[2 * i], flat[2 * i + 1], lt.dense_shape)
            for i, lt in enumerate(self.leaves)
        ]

    def add(self, cv: chunks.ChunkValue, c: int) -> None:
        flat_clients = [self._client_leaves(v) for v in chunks.unstack(cv, self.member, c)]
        parts: list[Any] = []
        for i, lt in enumerate(self.leaves):
            sts = [fc[i] for fc in flat_clients]
            if self.mode == "dense":
                parts.append(sparse_intrinsics.dense_sum(lt, sts))
            else:
                parts.append(_union(lt, sts))
        self._merge_parts(parts)

    def _merge_parts(self, parts: list[Any]) -> None:
        if self.running is None:
            self.running = parts
        elif self.mode == "dense":
            self.running = [a + b for a, b in zip(self.running, parts)]
        else:
            self.running = [_merge(a, b) for a, b in zip(self.running, parts)]

    def result(self) -> chunks.Internal:
        if self.running is None:
            return self.empty(self.member)
        if self.mode == "dense":
            return structure.unflatten(self.running, sparse_intrinsics.densify(self.member))
        flat = []
        for idx, val, cnt in self.running:
            if self.mode == "mean":
                val = (val / np.maximum(cnt, 1)).astype(val.dtype)
            flat += [idx, val]
        return structure.unflatten(flat, self.member)

    @property
    def partial_type(self) -> types.Type:
        if self.mode == "dense":
            return sparse_intrinsics.densify(self.member)
        return types.StructType(
            [
                types.StructType(
                    [
                        ("indices", types.TensorType(np.int64, [None, len(lt.dense_shape)])),
                        ("values", types.TensorType(lt.dtype, [None])),
                        ("counts", types.TensorType(np.int64, [None])),
                    ]
                )
                for lt in self.leaves
            ]
        )

    def partial(self) -> Partial:
        if self.mode == "dense":
            if self.running is None:
                return intrinsics.zeros(self.partial_type)
            return structure.unflatten(self.running, self.partial_type)
        parts = self.running or [_union(lt, []) for lt in self.leaves]
        return tuple(tuple(p) for p in parts)

    def merge(self, partial: Partial) -> None:
        if self.mode == "dense":
            self._merge_parts(
                [np.asarray(x) for x in structure.flatten(partial, self.partial_type)]
            )
        else:
            self._merge_parts([tuple(np.asarray(x) for x in p) for p in partial])


def _union(
    lt: types.SparseTensorType, sts: list[sparse.SparseTensor]
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rank = len(lt.dense_shape)
    parts = [sparse.coalesce(st.indices, np.asarray(st.values, lt.dtype)) for st in sts]
    if not parts:
        return np.zeros((0, rank), np.int64), np.zeros(0, lt.dtype), np.zeros(0, np.int64)
    merged = sparse.coalesce(
        np.concatenate([p[0] for p in parts]).reshape(-1, rank),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([np.ones(len(p[1]), np.int64) for p in parts]),
    )
    return cast("tuple[np.ndarray, np.ndarray, np.ndarray]", merged)  # counts given: 3 parts


def _merge(a: tuple, b: tuple) -> tuple:
    rank = a[0].shape[1] if a[0].ndim == 2 else b[0].shape[1]
    return sparse.coalesce(
        np.concatenate([a[0], b[0]]).reshape(-1, rank),
        np.concatenate([a[1], b[1]]),
        np.concatenate([a[2], b[2]]),
    )


# ----------------------------------------------------------------------------
# The registry: how each aggregation intrinsic is accumulated, for every runtime
#
# An aggregation's argument splits into the clients' part (what each client feeds the
# accumulator: the value, or for a weighted mean the pair <value, weight>) and server
# arguments (federated_aggregate's zero and functions, a secure sum's bounds), which
# are concrete when the accumulator is made.

# Which part of the argument each client feeds the accumulator: the whole argument,
# its first element, or the zip of its two CLIENTS elements.
WHOLE, FIRST, ZIPPED = "whole", "first", "zipped"

#: The concrete non-client elements of an aggregation's argument (see above).
ServerArgs = tuple
Factory = Callable[[intrinsics.IntrinsicDef, types.Type, ServerArgs, reference.Call], Accumulator]


@dataclasses.dataclass(frozen=True)
class Aggregation:
    """How an aggregation intrinsic is accumulated.

    Attributes:
      clients: WHOLE, FIRST or ZIPPED (see above).
      make: `make(definition, parameter_type, server_args, call) -> Accumulator`, where
        `server_args` are the concrete non-client elements of the argument and `call`
        applies a function value to an internal argument.
    """

    clients: str
    make: Factory

    def client_type(self, parameter_type: types.Type) -> types.Type:
        """The type of what one client feeds the accumulator."""
        if self.clients == WHOLE:
            return cast(types.FederatedType, parameter_type).member
        elements = cast(types.StructType, parameter_type).types
        if self.clients == FIRST:
            return cast(types.FederatedType, elements[0]).member
        return types.StructType([cast(types.FederatedType, e).member for e in elements])

    def server_args(self, arg: reference.Value) -> ServerArgs:
        """The non-client elements of an argument (empty unless FIRST)."""
        return tuple(arg[1:]) if self.clients == FIRST else ()


def _member(t: types.Type) -> types.Type:
    return cast(types.FederatedType, t).member


def _empty(d: intrinsics.IntrinsicDef) -> Empty:
    return cast(Empty, d.empty)  # every aggregation in the table below defines one


def _secure(
    d: intrinsics.IntrinsicDef, t: types.Type, server_args: ServerArgs, call: reference.Call
) -> Accumulator:
    arg_t = cast(types.StructType, t)
    member = _member(arg_t.types[0])
    bounds = intrinsic_defs.secure_bounds(server_args[0], arg_t.types[1], member)
    if d is intrinsic_defs.FEDERATED_SECURE_MODULAR_SUM:
        return ModularSum(member, bounds, lambda n: bounds, bounds)
    return ModularSum(member, [2**b for b in bounds], bitwidth_moduli(bounds))


def _aggregate(
    d: intrinsics.IntrinsicDef, t: types.Type, server_args: ServerArgs, call: reference.Call
) -> Accumulator:
    arg_t = cast(types.StructType, t)
    zero, acc, merge, report = server_args
    return Aggregate(_member(arg_t.types[0]), zero, acc, merge, report, call, arg_t.types[1])


def _weighted(
    d: intrinsics.IntrinsicDef, t: types.Type, server_args: ServerArgs, call: reference.Call
) -> Accumulator:
    values_t, weights_t = cast(types.StructType, t).types
    return WeightedMean(_member(values_t), _member(weights_t), _empty(d))


def _sparse(mode: str) -> Factory:
    return lambda d, t, server_args, call: SparseSum(_member(t), mode, _empty(d))


_defs = intrinsic_defs
AGGREGATIONS: dict[str, Aggregation] = {
    _defs.FEDERATED_SUM.uri: Aggregation(WHOLE, lambda d, t, a, c: Sum(_member(t), _empty(d))),
    _defs.FEDERATED_MEAN.uri: Aggregation(WHOLE, lambda d, t, a, c: Mean(_member(t), _empty(d))),
    _defs.FEDERATED_WEIGHTED_MEAN.uri: Aggregation(ZIPPED, _weighted),
    _defs.FEDERATED_MIN.uri: Aggregation(
        WHOLE, lambda d, t, a, c: Extremum(_member(t), True, _empty(d))
    ),
    _defs.FEDERATED_MAX.uri: Aggregation(
        WHOLE, lambda d, t, a, c: Extremum(_member(t), False, _empty(d))
    ),
    _defs.FEDERATED_AGGREGATE.uri: Aggregation(FIRST, _aggregate),
    _defs.FEDERATED_SECURE_SUM_BITWIDTH.uri: Aggregation(FIRST, _secure),
    _defs.FEDERATED_SECURE_MODULAR_SUM.uri: Aggregation(FIRST, _secure),
    _defs.SPARSE_SUM.uri: Aggregation(WHOLE, _sparse("dense")),
    _defs.SPARSE_SUM_KEEP_SPARSE.uri: Aggregation(WHOLE, _sparse("sum")),
    _defs.SPARSE_MEAN.uri: Aggregation(WHOLE, _sparse("mean")),
}
