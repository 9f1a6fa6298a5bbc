"""Reader for LEAF benchmark JSON files (FEMNIST, Shakespeare, Sent140, ...).

A LEAF split is a directory of JSON files, each holding some of the users::

    {"users": ["f0001", ...], "num_samples": [12, ...],
     "user_data": {"f0001": {"x": [...], "y": [...]}, ...}}

Opening a split parses each file once to learn its users and counts, keeping none
of the data. Iterating a client parses its file again (the most recently used file
is cached), so converting to a store (`store.write`) is the fast path for repeated use.
Elements are `{'x': x_i, 'y': y_i}`; numbers become float32/int32 arrays, text stays
`str`.
"""

from __future__ import annotations

import functools
import json
import os
import pathlib
import threading
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

_KEYS = ("users", "num_samples", "user_data")
_DOWNCAST = {np.dtype(np.float64): np.float32, np.dtype(np.int64): np.int32}


def _load(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Expected LEAF JSON in {path}, found invalid JSON ({e}).") from e
    missing = [k for k in _KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"Expected keys {list(_KEYS)} in LEAF file {path}, found {found}; missing {missing}.")
    return data


def _column(values: list[Any]) -> np.ndarray:
    if values and isinstance(values[0], str):
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    array = np.asarray(values)
    return array.astype(_DOWNCAST.get(array.dtype, array.dtype))


def from_leaf(path: str | os.PathLike) -> client_data_lib.ClientData:
    """Opens a LEAF split (a directory of `*.json` files, or one file).

    Args:
      path: the directory (e.g. `data/femnist/data/train`) or a single JSON file.

    Returns:
      A `ClientData`, users in file order, counts from `num_samples`.

    Raises:
      FileNotFoundError: if the path does not exist or holds no `.json` file.
      ValueError: for invalid JSON, missing keys or a user in two files.
    """
    root = pathlib.Path(path)
    files = sorted(root.glob("*.json")) if root.is_dir() else [root] if root.is_file() else []
    if not files:
        raise FileNotFoundError(f"Expected LEAF .json files at {root}, found none. Point to a split directory.")
    owner: dict[str, pathlib.Path] = {}
    counts: dict[str, int] = {}
    for f in files:
        data = _load(f)
        for user, n in zip(data["users"], data["num_samples"]):
            if user in owner:
                raise ValueError(f"Expected each LEAF user in one file, found {user!r} in {owner[user]} and {f}.")
            owner[str(user)], counts[str(user)] = f, int(n)
    lock = threading.Lock()
    cached = functools.lru_cache(maxsize=1)(_load)

    def arrays(user: str) -> dict[str, np.ndarray]:
        with lock:
            data = cached(owner[user])
        record = data["user_data"].get(user)
        if record is None:
            raise ValueError(f"Expected user_data for {user!r} in {owner[user]}, found none.")
        return {"x": _column(record["x"]), "y": _column(record["y"])}

    def dataset_fn(user: str) -> dataset_lib.Dataset:
        return dataset_lib.Dataset.from_slices_fn(lambda: arrays(user), cardinality=counts[user])

    return client_data_lib.ClientData(list(owner), dataset_fn, num_examples=counts)
