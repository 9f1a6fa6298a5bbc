"""Registers fedlang's values with JAX: `SparseTensor` is a pytree.

Indices and values are its leaves and the dense shape is static, so a sparse value
flows through `jax.jit` and `jax.vmap` without being densified.
"""

from __future__ import annotations

from typing import Any

import jax

from fedlang.core import sparse, types


def _flatten(st: sparse.SparseTensor) -> tuple[tuple[Any, Any], tuple[int, ...]]:
    return (st.indices, st.values), st.dense_shape


def _unflatten(dense_shape: types.Shape, children: Any) -> sparse.SparseTensor:
    # Inside JAX transformations the leaves may be tracers or placeholder objects that
    # must not be validated or converted.
    return sparse.SparseTensor.from_parts(children[0], children[1], dense_shape)


jax.tree_util.register_pytree_node(sparse.SparseTensor, _flatten, _unflatten)
