"""Reader for in-memory NumPy arrays split across clients by a partition."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib


def _clients(partition: Any) -> list[tuple[str, Any]]:
    """(client id, indices) pairs from a mapping, or from a list of index lists (ids '0', '1', ...)."""
    if isinstance(partition, Mapping):
        return [(str(cid), idx) for cid, idx in partition.items()]
    expected = ("Expected a partition: a mapping client id -> indices (e.g. from "
                "`fedlang.simulation.partitioners`), or a list of index lists (one per client)")
    if isinstance(partition, np.ndarray) and partition.ndim == 2:
        return [(str(i), idx) for i, idx in enumerate(partition)]
    if isinstance(partition, list | tuple):
        flat = [type(p).__name__ for p in partition if not isinstance(p, list | tuple | range | np.ndarray)]
        if not flat:
            return [(str(i), idx) for i, idx in enumerate(partition)]
        raise TypeError(f"{expected}, found a list of {flat[0]}. For a single client, pass "
                        f"[{str(list(partition))[:40]}].")
    raise TypeError(f"{expected}, found {type(partition).__name__}.")


def from_numpy(x: Any, y: Any = None, partition: Mapping[str, Any] | Sequence[Any] | None = None
               ) -> client_data_lib.ClientData:
    """Client data from arrays and a partition (client id -> example indices).

    Args:
      x: features, one row per example (an array, or a dict of arrays).
      y: labels, one per example, or None for unlabeled data.
      partition: client id -> indices into the rows, e.g. from
        `fedlang.simulation.partitioners`; or a list of index lists, one per client,
        whose clients are named '0', '1', ...

    Returns:
      A `ClientData` whose elements are `{'x': x[i], 'y': y[i]}` (or `{'x': x[i]}`).
      Each client's rows are gathered when its dataset is iterated.

    Raises:
      ValueError: if `x` and `y` differ in length, the partition is missing, or an
        index is out of range.
      TypeError: if the partition is of another kind, or its indices are not
        integers (a boolean mask, floats).
    """
    if partition is None:
        raise ValueError("Expected a partition (client id -> indices), found None. Make one with "
                         "`fedlang.simulation.partitioners.iid(len(x), num_clients, seed)`.")
    data: dict[str, Any] = {"x": x if isinstance(x, dict) else np.asarray(x)}
    if y is not None:
        data["y"] = np.asarray(y)
    lengths = {len(a) for v in data.values() for a in (v.values() if isinstance(v, dict) else [v])}
    if len(lengths) != 1:
        raise ValueError(f"Expected x and y with the same number of rows, found lengths {sorted(lengths)}.")
    n = lengths.pop()
    parts: dict[str, np.ndarray] = {}
    for cid, indices in _clients(partition):
        idx = np.asarray(indices).reshape(-1)
        if idx.size and idx.dtype.kind not in "iu":
            hint = " Turn a boolean mask into indices with `np.flatnonzero(mask)`." if idx.dtype.kind == "b" else ""
            raise TypeError(f"Expected integer indices for client {cid!r}, found {idx.dtype} values.{hint}")
        idx = idx.astype(np.int64)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise ValueError(f"Expected indices in [0, {n}) for client {cid!r}, found {idx.min()}..{idx.max()}.")
        parts[cid] = idx
    structure = dataset_lib.Dataset.from_tensor_slices(data).structure

    def take(v: Any, idx: np.ndarray) -> Any:
        return {k: a[idx] for k, a in v.items()} if isinstance(v, dict) else v[idx]

    def dataset_fn(cid: str) -> dataset_lib.Dataset:
        idx = parts[cid]
        return dataset_lib.Dataset.from_slices_fn(lambda: {k: take(v, idx) for k, v in data.items()},
                                                  structure, cardinality=len(idx))

    return client_data_lib.ClientData(list(parts), dataset_fn, element_spec=structure,
                                      num_examples={c: len(i) for c, i in parts.items()})
