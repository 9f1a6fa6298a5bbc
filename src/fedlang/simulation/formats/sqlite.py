"""Reader for TensorFlow Federated's SQLite dataset files, without TensorFlow.

TFF's files (EMNIST, Shakespeare, Stack Overflow, CIFAR-100, ...) hold two tables::

    examples(split_name TEXT, client_id TEXT, serialized_example_proto BLOB)
    client_metadata(client_id TEXT, split_name TEXT, num_examples INTEGER)

Opening a split reads only `client_metadata`; a client's rows are queried (in insertion
order) when its dataset is iterated, and each blob is decoded with the pure-Python
`tf.train.Example` codec in `tf_example`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import pathlib
import sqlite3
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fedlang.core import types
from fedlang.simulation import _cast, specs
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation.formats import tf_example

_COLUMNS = {"examples": ("split_name", "client_id", "serialized_example_proto"),
            "client_metadata": ("client_id", "split_name", "num_examples")}
_TABLES = tuple(_COLUMNS)


@dataclasses.dataclass(frozen=True)
class Feature:
    """How to decode one `tf.train.Example` feature into an element field.

    Attributes:
      dtype: the numpy dtype of the field, or `bytes`/`str` for a scalar string.
      shape: the field's shape (the feature must hold exactly that many values).
      default: the value used when an example lacks the feature; None makes a
        missing feature an error.
    """

    dtype: Any
    shape: tuple[int, ...] = ()
    default: Any = None

    @property
    def spec(self) -> types.TensorType | specs.StringSpec:
        if self.dtype in (bytes, str):
            return specs.StringSpec(())
        return types.TensorType(self.dtype, self.shape)

    def decode(self, name: str, value: Any, where: str = "") -> Any:
        """The field value of feature `name` decoded from `value` (from `tf_example`).

        Args:
          name: the feature's name.
          value: what `tf_example.decode_example` gave for it, or None if absent.
          where: appended to error messages, e.g. " (client 'a' in data.sqlite)".

        Raises:
          ValueError: if the feature is absent without a default, has another number
            of values, or values that do not fit `dtype` (never wrapped or truncated).
        """
        if value is None:
            if self.default is None:
                raise ValueError(f"Expected feature {name!r} in every example, found an example without it{where}.")
            return self.default
        if self.dtype in (bytes, str):
            if len(value) != 1 or not isinstance(value, list):
                raise ValueError(f"Expected one bytes value for feature {name!r}, found {value!r:.60}{where}.")
            if self.dtype is bytes:
                return value[0]
            try:
                return value[0].decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"Expected UTF-8 text in feature {name!r}, found {value[0]!r:.60}{where}. Use "
                                 "Feature(bytes) to read raw bytes.") from e
        array = np.asarray(value)
        size = int(np.prod(self.shape))
        if array.size != size:
            raise ValueError(f"Expected {size} values for feature {name!r} (shape {list(self.shape)}), found "
                             f"{array.size}{where}.")
        try:
            return _cast.checked(array, self.dtype).reshape(self.shape)
        except _cast.CastError as e:
            wider = "np.float64" if e.dtype.kind == "f" else "np.int64"
            raise ValueError(f"Expected values of feature {name!r} that fit {e.dtype}, found {e.value!r}, which "
                             f"{e.reason}{where}. Declare Feature({wider}) (or the dtype it needs).") from e


def _connect(path: pathlib.Path) -> sqlite3.Connection:
    if not path.is_file():
        raise FileNotFoundError(f"Expected a TFF SQLite file at {path}, found none. Check the path.")
    return sqlite3.connect(f"{path.resolve().as_uri()}?mode=ro", uri=True)


def split_names(path: str | os.PathLike) -> list[str]:
    """The split names present in a TFF SQLite file (reads `client_metadata` only)."""
    path = _check_file(pathlib.Path(path))
    with contextlib.closing(_connect(path)) as conn:
        return [r[0] for r in conn.execute("SELECT DISTINCT split_name FROM client_metadata ORDER BY split_name")]


def _check_file(path: pathlib.Path) -> pathlib.Path:
    if not path.is_file():
        raise FileNotFoundError(f"Expected a TFF SQLite file at {path}, found none. Check the path.")
    try:
        with contextlib.closing(_connect(path)) as conn:
            tables = {r[0] for r in conn.execute("SELECT name FROM sqlite_master WHERE type='table'")}
            missing = [t for t in _TABLES if t not in tables]
            if missing:
                raise ValueError(
                    f"Expected tables {list(_TABLES)} in {path} (TFF's SQLite layout), found "
                    f"{sorted(tables)}; missing {missing}. Is this a TFF dataset file?"
                )
            for table, expected in _COLUMNS.items():
                found = [r[1] for r in conn.execute(f"PRAGMA table_info({table})")]
                absent = [c for c in expected if c not in found]
                if absent:
                    raise ValueError(f"Expected columns {list(expected)} in table {table} of {path} (TFF's SQLite "
                                     f"layout), found {found}; missing {absent}.")
    except sqlite3.DatabaseError as e:
        raise ValueError(f"Expected a SQLite database at {path}, found an unreadable file ({e}).") from e
    return path


def from_sqlite(path: str | os.PathLike, split_name: str,
                features: Mapping[str, Feature] | None = None) -> client_data_lib.ClientData:
    """Opens one split of a TFF SQLite file as a lazy `ClientData`.

    Args:
      path: the `.sqlite` file (decompressed).
      split_name: e.g. 'train', 'test', 'digits_only_train'.
      features: name -> `Feature` to decode each example into a dict. When None,
        each element is the raw serialized `tf.train.Example` (`bytes`); decode it
        with `tf_example.decode_example`.

    Returns:
      A `ClientData` with client ids sorted, counts from `client_metadata`.

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if it is not a SQLite file, lacks the TFF tables or their columns,
        has a count that is not a non-negative integer, or has no client of
        `split_name` (the message lists the splits it has). When a client's dataset
        is iterated: if its rows differ in number from `client_metadata`, or a value
        does not fit its `Feature` (each message names the client and the file).
    """
    path = _check_file(pathlib.Path(path))
    with contextlib.closing(_connect(path)) as conn:
        rows = conn.execute(
            "SELECT client_id, num_examples FROM client_metadata WHERE split_name = ?", (split_name,)
        ).fetchall()
    if not rows:
        raise ValueError(
            f"Expected clients of split {split_name!r} in {path}, found none; its splits are {split_names(path)}."
        )
    for cid, n in rows:
        if type(n) is not int or n < 0:
            raise ValueError(f"Expected a non-negative integer num_examples for client {cid!r} of split "
                             f"{split_name!r} in table client_metadata of {path}, found {n!r}.")
    counts = {str(cid): n for cid, n in sorted(rows, key=lambda r: str(r[0]))}
    if features is None:
        structure: Any = specs.StringSpec(())
    else:
        structure = {name: f.spec for name, f in features.items()}

    def decode(blob: Any, client_id: str) -> Any:
        where = f" (client {client_id!r} in {path})"
        if not isinstance(blob, bytes):
            raise ValueError(f"Expected a serialized tf.train.Example (a BLOB), found "
                             f"{'NULL' if blob is None else type(blob).__name__}{where}.")
        if features is None:
            return blob
        try:
            parsed = tf_example.decode_example(blob)
        except ValueError as e:
            raise ValueError(f"Expected a serialized tf.train.Example{where}, found a corrupt blob: {e}") from e
        return {name: f.decode(name, parsed.get(name), where) for name, f in features.items()}

    def examples_of(client_id: str) -> Iterator[Any]:
        expected = counts[client_id]
        found = 0
        with contextlib.closing(_connect(path)) as conn:
            cursor = conn.execute(
                "SELECT serialized_example_proto FROM examples WHERE split_name = ? AND client_id = ? "
                "ORDER BY rowid", (split_name, client_id))
            for (blob,) in cursor:
                found += 1
                if found > expected:
                    break
                yield decode(blob, client_id)
        if found != expected:
            raise ValueError(f"Expected {expected} examples of client {client_id!r} (its num_examples in "
                             f"client_metadata), found {found if found < expected else 'more'} in {path}. "
                             "Fix the file's client_metadata table.")

    def dataset_fn(client_id: str) -> dataset_lib.Dataset:
        def iter_fn(_: tuple[int, ...]) -> Iterator[Any]:
            try:
                yield from examples_of(client_id)
            except sqlite3.DatabaseError as e:
                raise ValueError(f"Expected a readable SQLite database at {path}, found an error reading client "
                                 f"{client_id!r} ({e}).") from e

        return dataset_lib.Dataset(iter_fn, structure, cardinality=counts[client_id])

    return client_data_lib.ClientData(list(counts), dataset_fn, element_spec=structure, num_examples=counts)


def write_sqlite(path: str | os.PathLike, split_name: str,
                 clients: Mapping[str, list[Mapping[str, Any]]], packed: bool = True) -> None:
    """Writes (or appends) one split in TFF's SQLite layout; used to make test files.

    Args:
      path: the file to create or extend.
      split_name: the split the rows belong to.
      clients: client id -> list of feature dicts (see `tf_example.encode_example`).
      packed: write packed repeated numbers (as TensorFlow does) or unpacked ones.
    """
    with contextlib.closing(sqlite3.connect(os.fspath(path))) as conn:
        conn.execute("CREATE TABLE IF NOT EXISTS examples (split_name TEXT NOT NULL, client_id TEXT NOT NULL, "
                     "serialized_example_proto BLOB NOT NULL)")
        conn.execute("CREATE TABLE IF NOT EXISTS client_metadata (client_id TEXT NOT NULL, split_name TEXT NOT NULL, "
                     "num_examples INTEGER NOT NULL)")
        for cid, examples in clients.items():
            conn.executemany("INSERT INTO examples VALUES (?, ?, ?)",
                             [(split_name, cid, tf_example.encode_example(e, packed)) for e in examples])
            conn.execute("INSERT INTO client_metadata VALUES (?, ?, ?)", (cid, split_name, len(examples)))
        conn.commit()
