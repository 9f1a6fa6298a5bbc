"""Chunk-by-chunk accumulators for the aggregation intrinsics.

Each accumulator folds chunk values (see `chunks.py`) into a running partial result,
so aggregating a cohort needs memory for one chunk, not the cohort. Results match the
reference semantics in `fedlang.core.intrinsics` (sums of floats are reduced in
float32 within a chunk and accumulated across chunks in float64).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import jax.numpy as jnp
import numpy as np

from fedlang.core import intrinsics, sparse, sparse_intrinsics, structure, types
from fedlang.runtime import chunks


def _leaf_chunks(cv: Any, t: types.Type) -> list[tuple[Any, bool]]:
    """(leaf, is_replicated) pairs of a tensor-struct chunk value, in flatten order."""
    if isinstance(cv, chunks.Rep):
        return [(x, True) for x in structure.flatten(cv.value, t)]
    if isinstance(t, types.StructType):
        return [p for x, et in zip(cv, t.types) for p in _leaf_chunks(x, et)]
    return [(cv, False)]


def _acc_dtype(dt: np.dtype) -> Any:
    return np.float64 if dt.kind in "fc" else np.int64 if dt.kind in "iub" else dt


class Accumulator:
    """Folds chunks with `add(cv, c)` and finishes with `result()` (internal value)."""

    def add(self, cv: Any, c: int) -> None:
        raise NotImplementedError

    def result(self) -> Any:
        raise NotImplementedError


class Sum(Accumulator):
    def __init__(self, member: types.Type):
        self.member = member
        self.leaf_types = structure.leaf_types(member)
        self.total: list[Any] | None = None

    def _chunk_sums(self, cv: Any, c: int) -> list[np.ndarray]:
        out = []
        for (x, rep), lt in zip(_leaf_chunks(cv, self.member), self.leaf_types):
            if rep:
                out.append(np.asarray(x, _acc_dtype(lt.dtype)) * c)
            else:
                out.append(np.asarray(jnp.sum(jnp.asarray(x), axis=0), _acc_dtype(lt.dtype)))
        return out

    def add(self, cv: Any, c: int) -> None:
        sums = self._chunk_sums(cv, c)
        self.total = sums if self.total is None else [a + b for a, b in zip(self.total, sums)]

    def result(self) -> Any:
        if self.total is None:
            return intrinsics._zeros(self.member)
        return structure.unflatten(
            [t.astype(lt.dtype) for t, lt in zip(self.total, self.leaf_types)], self.member
        )


class Mean(Sum):
    def __init__(self, member: types.Type):
        super().__init__(member)
        self.count = 0

    def add(self, cv: Any, c: int) -> None:
        super().add(cv, c)
        self.count += c

    def result(self) -> Any:
        if self.total is None:
            return intrinsics._nan(self.member)
        return structure.unflatten(
            [(t / self.count).astype(lt.dtype) for t, lt in zip(self.total, self.leaf_types)],
            self.member,
        )


class WeightedMean(Sum):
    """sum(w * x) / sum(w); NaN when the weights sum to zero (as the reference)."""

    def __init__(self, member: types.Type, weight_type: types.Type):
        super().__init__(member)
        self.weight_type = weight_type
        self.weight_total = 0.0

    def add(self, cv: Any, c: int) -> None:
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
            else:
                xj = jnp.asarray(x)
                sums.append(np.asarray(jnp.tensordot(wj.astype(xj.dtype), xj, axes=1), np.float64))
        self.total = sums if self.total is None else [a + b for a, b in zip(self.total, sums)]
        self.weight_total += float(w.sum())

    def result(self) -> Any:
        if self.total is None:
            return intrinsics._nan(self.member)
        with np.errstate(invalid="ignore", divide="ignore"):
            leaves = [
                (t / self.weight_total).astype(lt.dtype)
                for t, lt in zip(self.total, self.leaf_types)
            ]
        return structure.unflatten(leaves, self.member)


class Extremum(Accumulator):
    def __init__(self, member: types.Type, is_min: bool):
        self.member = member
        self.leaf_types = structure.leaf_types(member)
        self.reduce = np.minimum if is_min else np.maximum
        self.jreduce = jnp.min if is_min else jnp.max
        self.identity = intrinsics._dtype_max if is_min else intrinsics._dtype_min
        self.best: list[Any] | None = None

    def add(self, cv: Any, c: int) -> None:
        if c == 0:
            return
        vals = [
            np.asarray(x) if rep else np.asarray(self.jreduce(jnp.asarray(x), axis=0))
            for x, rep in _leaf_chunks(cv, self.member)
        ]
        self.best = (
            vals if self.best is None else [self.reduce(a, b) for a, b in zip(self.best, vals)]
        )

    def result(self) -> Any:
        if self.best is None:
            leaves = [
                np.full([d or 0 for d in lt.shape], self.identity(lt.dtype), lt.dtype)
                for lt in self.leaf_types
            ]
        else:
            leaves = [b.astype(lt.dtype) for b, lt in zip(self.best, self.leaf_types)]
        return structure.unflatten(leaves, self.member)


class Aggregate(Accumulator):
    """federated_aggregate: clients folded per chunk with `accumulate`, chunks merged."""

    def __init__(
        self,
        member: types.Type,
        zero: Any,
        accumulate: Any,
        merge: Any,
        report: Any,
        call: Callable,
    ):
        self.member, self.zero = member, zero
        self.accumulate, self.merge, self.report, self.call = accumulate, merge, report, call
        self.total: Any = None

    def add(self, cv: Any, c: int) -> None:
        partial = self.zero
        for v in chunks.unstack(cv, self.member, c):
            partial = self.call(self.accumulate, (partial, v))
        self.total = partial if self.total is None else self.call(self.merge, (self.total, partial))

    def result(self) -> Any:
        total = self.zero if self.total is None else self.total
        return self.call(self.report, total)


class ModularSum(Accumulator):
    """Exact integer sums of inputs wrapped modulo `wrap`, reduced modulo `modulus(n)` at the end."""

    def __init__(self, member: types.Type, wrap: list[int], modulus: Callable[[int], list[int]]):
        self.member, self.wrap, self.modulus = member, wrap, modulus
        self.leaf_types = structure.leaf_types(member)
        self.total: list[Any] | None = None
        self.count = 0

    def add(self, cv: Any, c: int) -> None:
        sums = []
        for i, (x, rep) in enumerate(_leaf_chunks(cv, self.member)):
            wrapped = np.mod(np.asarray(x).astype(object), self.wrap[i])
            sums.append(wrapped * c if rep else (wrapped.sum(axis=0) if c else 0))
        self.total = sums if self.total is None else [a + b for a, b in zip(self.total, sums)]
        self.count += c

    def result(self) -> Any:
        moduli = self.modulus(self.count)
        leaves = []
        for i, lt in enumerate(self.leaf_types):
            total = 0 if self.total is None else self.total[i]
            acc = np.mod(
                np.asarray(total, dtype=object)
                + np.zeros([d or 0 for d in lt.shape], dtype=object),
                moduli[i],
            )
            leaves.append(np.asarray(acc.astype(np.int64)).astype(lt.dtype))
        return structure.unflatten(leaves, self.member)


def bitwidth_moduli(widths: list[int]) -> Callable[[int], list[int]]:
    def moduli(n: int) -> list[int]:
        extra = math.ceil(math.log2(n)) if n > 1 else 0
        return [2 ** (b + extra) for b in widths]

    return moduli


class Collect(Accumulator):
    """Materializes CLIENTS values as a list (for results returned to Python)."""

    def __init__(self, member: types.Type):
        self.member = member
        self.values: list[Any] = []

    def add(self, cv: Any, c: int) -> None:
        self.values.extend(chunks.unstack(cv, self.member, c))

    def result(self) -> Any:
        return self.values


class SparseSum(Accumulator):
    """The sparse family: a dense scatter-add, or a running coalesced union of indices.

    Client entries are merged chunk by chunk; the union's per-index client counts give
    `federated_sparse_mean`. Memory is the result's size, never the cohort's.
    """

    def __init__(self, member: types.Type, mode: str):
        self.member, self.mode, self.lib = member, mode, sparse_intrinsics
        # the sparse intrinsics' type rules checked that every leaf is sparse
        self.leaves = cast("list[types.SparseTensorType]", types.tensor_leaves(member))
        self.partial: list[Any] | None = None

    def add(self, cv: Any, c: int) -> None:
        clients = chunks.unstack(cv, self.member, c)
        flat_clients = [_sparse_leaves(v, self.member) for v in clients]
        parts: list[Any] = []
        for i, lt in enumerate(self.leaves):
            sts = [fc[i] for fc in flat_clients]
            if self.mode == "dense":
                parts.append(self.lib.dense_sum(lt, sts))
            else:
                parts.append(_union(lt, sts))
        if self.partial is None:
            self.partial = parts
        elif self.mode == "dense":
            self.partial = [a + b for a, b in zip(self.partial, parts)]
        else:
            self.partial = [_merge(a, b) for a, b in zip(self.partial, parts)]

    def result(self) -> Any:
        out = []
        for i, lt in enumerate(self.leaves):
            if self.mode == "dense":
                out.append(
                    np.zeros(cast("tuple[int, ...]", lt.dense_shape), lt.dtype)
                    if self.partial is None
                    else self.partial[i]
                )
                continue
            idx, val, cnt = self.partial[i] if self.partial is not None else _union(lt, [])
            if self.mode == "mean":
                val = (val / np.maximum(cnt, 1)).astype(lt.dtype)
            out.append(sparse_tensor(idx, val, lt.dense_shape))
        return _rebuild(out, self.member)


def _sparse_leaves(value: Any, t: types.Type) -> list[Any]:
    if isinstance(t, types.StructType):
        return [x for v, et in zip(value, t.types) for x in _sparse_leaves(v, et)]
    return [value]


def _rebuild(leaves: list[Any], t: types.Type) -> Any:
    it = iter(leaves)

    def build(tt: types.Type) -> Any:
        if isinstance(tt, types.StructType):
            return tuple(build(x) for x in tt.types)
        return next(it)

    return build(t)


def _union(lt: Any, sts: list[Any]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
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


def sparse_tensor(indices: Any, values: Any, dense_shape: Any) -> Any:
    return sparse.SparseTensor(indices, values, dense_shape)
