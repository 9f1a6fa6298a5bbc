"""Reader for in-memory NumPy arrays split across clients by a partition."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib


def from_numpy(x: Any, y: Any = None, partition: Mapping[str, Any] | None = None
               ) -> client_data_lib.ClientData:
    """Client data from arrays and a partition (client id -> example indices).

    Args:
      x: features, one row per example (an array, or a dict of arrays).
      y: labels, one per example, or None for unlabeled data.
      partition: client id -> indices into the rows, e.g. from
        `fedlang.simulation.partitioners`.

    Returns:
      A `ClientData` whose elements are `{'x': x[i], 'y': y[i]}` (or `{'x': x[i]}`).
      Each client's rows are gathered when its dataset is iterated.

    Raises:
      ValueError: if `x` and `y` differ in length, the partition is missing, or an
        index is out of range.
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
    for cid, idx in partition.items():
        idx = np.asarray(idx, dtype=np.int64).reshape(-1)
        if idx.size and (idx.min() < -n or idx.max() >= n):
            raise ValueError(f"Expected indices in [0, {n}) for client {cid!r}, found {idx.min()}..{idx.max()}.")
        parts[str(cid)] = idx
    structure = dataset_lib.Dataset.from_tensor_slices(data).structure

    def take(v: Any, idx: np.ndarray) -> Any:
        return {k: a[idx] for k, a in v.items()} if isinstance(v, dict) else v[idx]

    def dataset_fn(cid: str) -> dataset_lib.Dataset:
        idx = parts[cid]
        return dataset_lib.Dataset.from_slices_fn(lambda: {k: take(v, idx) for k, v in data.items()},
                                                  structure, cardinality=len(idx))

    return client_data_lib.ClientData(list(parts), dataset_fn, element_spec=structure,
                                      num_examples={c: len(i) for c, i in parts.items()})
