"""The sparse aggregation family, with explicit semantics (registered with `intrinsics.define`).

Summing the three component tensors of COO values is never right (indices would be
added). Instead:

* `federated_sparse_sum`: `({sparse<T[s]>}@CLIENTS -> T[s]@SERVER)` scatters every
  client's entries into a dense result (duplicates add up);
* `federated_sparse_sum_keep_sparse`: `({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)`
  keeps the result sparse: the union of the clients' indices, values summed;
* `federated_sparse_mean`: `({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)`: at each
  index of the union, the sum divided by the number of clients that sent that index
  (a client sending an index twice counts once), so rows touched by few clients are not
  diluted by the many that never saw them.

Results are coalesced (unique indices in lexicographic order), so they do not depend on
client order or chunking.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, cast

import numpy as np

from fedlang.core import intrinsics, sparse, types


def _rule(uri: str, dense: bool, floating: bool) -> Callable[[types.Type], types.Type]:
    def rule(t: types.Type) -> types.Type:
        v = intrinsics.expect_federated(t, uri, types.CLIENTS)
        leaves = types.tensor_leaves(v.member)
        if not leaves or not all(isinstance(x, types.SparseTensorType) for x in leaves):
            raise TypeError(
                f"{uri} expects sparse tensors (a fedlang.SparseTensor per client), found {v.member}. "
                "For dense values use federated_sum or federated_mean."
            )
        for x in leaves:
            if any(d is None for d in x.dense_shape):  # type: ignore[attr-defined]
                raise TypeError(f"{uri} needs a fully known dense shape, found {x}.")
            if floating and x.dtype.kind not in "fc":  # type: ignore[attr-defined]
                raise TypeError(f"{uri} expects floating-point values, found {x}.")
        if dense:
            return types.FederatedType(densify(v.member), types.SERVER)
        return types.FederatedType(v.member, types.SERVER)

    return rule


def densify(t: types.Type) -> types.Type:
    """The dense type of the result of summing sparse values of type `t`."""
    if isinstance(t, types.StructType):
        return types.StructType([(n, densify(x)) for n, x in t.elements], container=t.container)
    return types.TensorType(t.dtype, t.dense_shape)  # type: ignore[attr-defined]


def _per_leaf(
    t: types.Type, clients: list[Any], fn: Callable[[types.SparseTensorType, list[Any]], Any]
) -> Any:
    if isinstance(t, types.StructType):
        return tuple(_per_leaf(x, [c[i] for c in clients], fn) for i, x in enumerate(t.types))
    return fn(t, clients)  # type: ignore[arg-type]


def dense_sum(t: types.SparseTensorType, clients: list[Any]) -> np.ndarray:
    out = np.zeros(cast("tuple[int, ...]", t.dense_shape), t.dtype)  # the rule checked it is known
    for st in clients:
        np.add.at(out, tuple(np.asarray(st.indices, np.int64).T), np.asarray(st.values, t.dtype))
    return out


def union_sum(
    t: types.SparseTensorType, clients: list[Any], mean: bool = False
) -> sparse.SparseTensor:
    rank = len(t.dense_shape)
    if not clients:
        return sparse.SparseTensor(
            np.zeros((0, rank), np.int64), np.zeros(0, t.dtype), t.dense_shape
        )
    parts = []
    for st in clients:
        idx, val = sparse.coalesce(st.indices, np.asarray(st.values, t.dtype))
        parts.append(
            (idx, val, np.ones(len(val), np.int64))
        )  # within a client, an index counts once
    idx, val, cnt = sparse.coalesce(
        np.concatenate([p[0] for p in parts]).reshape(-1, rank),
        np.concatenate([p[1] for p in parts]),
        np.concatenate([p[2] for p in parts]),
    )
    if mean:
        val = (val / cnt).astype(t.dtype)
    return sparse.SparseTensor(idx, val, t.dense_shape)


def _empty(dense: bool) -> Any:
    def empty(member: types.Type) -> Any:
        return _per_leaf(member, [], dense_sum if dense else union_sum)

    return empty


# Type signature: {sparse<T[s]>}@CLIENTS -> T[s]@SERVER  (scatter-add into a dense result)
FEDERATED_SPARSE_SUM = intrinsics.define(
    "federated_sparse_sum",
    intrinsics.Kind.AGGREGATE,
    "({sparse<T[s]>}@CLIENTS -> T[s]@SERVER)",
    _rule("federated_sparse_sum", dense=True, floating=False),
    lambda arg, t, rt: _per_leaf(cast(types.FederatedType, t).member, arg, dense_sum),
    empty=_empty(dense=True),
)
# Type signature: {sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER  (union of indices, values summed)
FEDERATED_SPARSE_SUM_KEEP_SPARSE = intrinsics.define(
    "federated_sparse_sum_keep_sparse",
    intrinsics.Kind.AGGREGATE,
    "({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)",
    _rule("federated_sparse_sum", dense=False, floating=False),
    lambda arg, t, rt: _per_leaf(cast(types.FederatedType, t).member, arg, union_sum),
    empty=_empty(dense=False),
)
# Type signature: {sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER  (per index: sum / number of clients sending it)
FEDERATED_SPARSE_MEAN = intrinsics.define(
    "federated_sparse_mean",
    intrinsics.Kind.AGGREGATE,
    "({sparse<T[s]>}@CLIENTS -> sparse<T[s]>@SERVER)",
    _rule("federated_sparse_mean", dense=False, floating=True),
    lambda arg, t, rt: _per_leaf(
        cast(types.FederatedType, t).member, arg, lambda lt, cs: union_sum(lt, cs, mean=True)
    ),
    empty=_empty(dense=False),
)
