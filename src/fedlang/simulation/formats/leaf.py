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

from fedlang.simulation import _cast
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

_KEYS = ("users", "num_samples", "user_data")
_DOWNCAST = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}


def _load(path: pathlib.Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"Expected LEAF JSON in {path}, found invalid JSON ({e}).") from e
    except RecursionError as e:
        raise ValueError(f"Expected LEAF JSON in {path}, found arrays or objects nested too deeply to parse.") from e
    missing = [k for k in _KEYS if not isinstance(data, dict) or k not in data]
    if missing:
        found = sorted(data) if isinstance(data, dict) else type(data).__name__
        raise ValueError(f"Expected keys {list(_KEYS)} in LEAF file {path}, found {found}; missing {missing}.")
    return data


def _counts(path: pathlib.Path, data: dict[str, Any]) -> dict[str, int]:
    """user -> number of examples, after checking that the file agrees with itself."""
    users, num_samples, user_data = data["users"], data["num_samples"], data["user_data"]
    if not isinstance(users, list) or not isinstance(num_samples, list) or not isinstance(user_data, dict):
        raise ValueError(f"Expected 'users' and 'num_samples' as lists and 'user_data' as an object in LEAF file "
                         f"{path}, found {type(users).__name__}, {type(num_samples).__name__} and "
                         f"{type(user_data).__name__}.")
    if len(num_samples) != len(users):
        raise ValueError(f"Expected as many num_samples as users ({len(users)}), found {len(num_samples)} in "
                         f"LEAF file {path}.")
    counts: dict[str, int] = {}
    for user, n in zip(users, num_samples):
        user = str(user)
        if type(n) is not int or n < 0:
            raise ValueError(f"Expected a non-negative integer num_samples for user {user!r}, found {n!r} in "
                             f"LEAF file {path}.")
        record = user_data.get(user)
        if record is None:
            raise ValueError(f"Expected user_data for user {user!r} in LEAF file {path}, found none.")
        if not isinstance(record, dict) or not all(isinstance(record.get(k), list) for k in ("x", "y")):
            found = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise ValueError(f"Expected lists 'x' and 'y' for user {user!r} in LEAF file {path}, found {found}.")
        if len(record["x"]) != len(record["y"]):
            raise ValueError(f"Expected as many y as x for user {user!r}, found {len(record['x'])} x and "
                             f"{len(record['y'])} y in LEAF file {path}.")
        if len(record["x"]) != n:
            raise ValueError(f"Expected {n} examples of user {user!r} (num_samples), found {len(record['x'])} in "
                             f"LEAF file {path}.")
        counts[user] = n
    return counts


def _column(values: list[Any], where: str) -> np.ndarray:
    if values and isinstance(values[0], str):
        if not all(isinstance(v, str) for v in values):
            raise ValueError(f"Expected only strings in {where}, found other values among them.")
        out = np.empty(len(values), dtype=object)
        out[:] = values
        return out
    try:
        array = np.asarray(values)
    except ValueError as e:  # ragged
        raise ValueError(f"Expected values of one shape in {where}, found rows of different shapes ({e}).") from e
    if array.dtype.kind not in "biuf":
        raise ValueError(f"Expected numbers or strings in {where}, found {str(values)[:60]}.")
    try:
        return _cast.checked(array, _DOWNCAST.get(array.dtype, array.dtype))
    except _cast.CastError as e:
        raise ValueError(f"Expected values that fit {e.dtype} in {where}, found {e.value!r} at row {e.row}, "
                         f"which {e.reason}.") from e


def from_leaf(path: str | os.PathLike) -> client_data_lib.ClientData:
    """Opens a LEAF split (a directory of `*.json` files, or one file).

    Args:
      path: the directory (e.g. `data/femnist/data/train`) or a single JSON file.

    Returns:
      A `ClientData`, users in file order, counts from `num_samples`.

    Raises:
      FileNotFoundError: if the path does not exist or holds no `.json` file.
      ValueError: for invalid JSON, missing keys, a user in two files, or a file that
        disagrees with itself (users without counts or data, counts that differ from
        the data, x and y of different lengths); when iterating, for values that do
        not fit float32/int32 or are not numbers or strings. Each names the file.
    """
    root = pathlib.Path(path)
    files = sorted(root.glob("*.json")) if root.is_dir() else [root] if root.is_file() else []
    if not files:
        raise FileNotFoundError(f"Expected LEAF .json files at {root}, found none. Point to a split directory.")
    owner: dict[str, pathlib.Path] = {}
    counts: dict[str, int] = {}
    for f in files:
        for user, n in _counts(f, _load(f)).items():
            if user in owner:
                raise ValueError(f"Expected each LEAF user in one file, found {user!r} in {owner[user]} and {f}.")
            owner[user], counts[user] = f, n
    lock = threading.Lock()
    cached = functools.lru_cache(maxsize=1)(_load)

    def arrays(user: str) -> dict[str, np.ndarray]:
        with lock:
            data = cached(owner[user])
        record = data["user_data"][user]  # checked when the split was opened
        return {k: _column(record[k], f"{k!r} of user {user!r} in LEAF file {owner[user]}") for k in ("x", "y")}

    def dataset_fn(user: str) -> dataset_lib.Dataset:
        return dataset_lib.Dataset.from_slices_fn(lambda: arrays(user), cardinality=counts[user])

    return client_data_lib.ClientData(list(owner), dataset_fn, num_examples=counts)
