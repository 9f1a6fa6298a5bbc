"""`SparseTensor`: a first-class sparse value in COO form."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedlang.core import types


@dataclasses.dataclass(frozen=True, init=False)
class SparseTensor:
    """A sparse tensor: `indices[nnz, rank]` (int64), `values[nnz]`, and a static `dense_shape`.

    The JAX backend registers it as a pytree (indices and values are leaves, the dense
    shape is static), so it flows through `jax.jit` and `jax.vmap` without being densified.

    Example:
      >>> st = SparseTensor([[0, 1], [2, 0]], [1.0, 2.0], (3, 2))
      >>> st.to_dense().tolist()
      [[0.0, 1.0], [0.0, 0.0], [2.0, 0.0]]
    """

    indices: Any
    values: Any
    dense_shape: tuple[int, ...]

    def __init__(self, indices: Any, values: Any, dense_shape: Any):
        if not _is_backend_array(indices):
            indices = np.asarray(indices, dtype=np.int64).reshape(-1, len(tuple(dense_shape)))
        if not _is_backend_array(values):
            values = np.asarray(values)
            if values.dtype == np.float64:
                values = values.astype(np.float32)
        object.__setattr__(self, "indices", indices)
        object.__setattr__(self, "values", values)
        object.__setattr__(self, "dense_shape", tuple(int(d) for d in dense_shape))
        if indices.shape[0] != values.shape[0]:
            raise ValueError(
                f"Expected one value per index row, found {indices.shape[0]} index rows and "
                f"{values.shape[0]} values."
            )

    @property
    def fedlang_sparse_type(self) -> types.SparseTensorType:
        return types.SparseTensorType(self.values.dtype, self.dense_shape)

    @property
    def nnz(self) -> int:
        return int(self.values.shape[0])

    def to_dense(self) -> Any:
        """The dense array (NumPy for NumPy inputs, JAX inside traced code)."""
        if isinstance(self.values, np.ndarray) and isinstance(self.indices, np.ndarray):
            out: Any = np.zeros(self.dense_shape, self.values.dtype)
            np.add.at(out, tuple(self.indices.T), self.values)
            return out
        xp = self.values.__array_namespace__()  # jax.numpy, also for traced values
        out = xp.zeros(self.dense_shape, self.values.dtype)
        return out.at[tuple(self.indices.T)].add(self.values)

    @classmethod
    def from_parts(cls, indices: Any, values: Any, dense_shape: Any) -> SparseTensor:
        """A sparse tensor from its parts as they are (no validation or conversion).

        Backends use it to rebuild sparse values whose parts are traced placeholders.
        """
        st = object.__new__(cls)
        object.__setattr__(st, "indices", indices)
        object.__setattr__(st, "values", values)
        object.__setattr__(st, "dense_shape", dense_shape)
        return st


def _is_backend_array(x: Any) -> bool:
    """An array of a backend (e.g. a JAX array or tracer): kept as it is, never converted."""
    return not isinstance(x, np.ndarray) and hasattr(x, "__array_namespace__")


def coalesce(
    indices: np.ndarray, values: np.ndarray, counts: np.ndarray | None = None
) -> tuple[np.ndarray, ...]:
    """Sorts COO entries by index and sums duplicates (and their `counts`, if given).

    Returns `(indices, values)` or `(indices, values, counts)`; indices are unique and in
    lexicographic order, so the result does not depend on the order of the entries.
    """
    values = np.asarray(values)
    indices = np.asarray(indices, np.int64)
    if len(values):
        indices = indices.reshape(len(values), -1)
    if len(values) == 0:
        out = (indices, values)
        return (*out, np.zeros(0, np.int64)) if counts is not None else out
    unique, inverse = np.unique(indices, axis=0, return_inverse=True)
    inverse = inverse.reshape(-1)
    summed = np.zeros(len(unique), values.dtype)
    np.add.at(summed, inverse, values)
    if counts is None:
        return unique, summed
    total = np.zeros(len(unique), np.int64)
    np.add.at(total, inverse, counts)
    return unique, summed, total
