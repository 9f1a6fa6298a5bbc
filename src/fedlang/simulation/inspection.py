"""Open any supported client-data source by path, and summarize client data.

Used by `fedlang data inspect` and `fedlang data convert`. Formats: a store
directory (`index.json`), a TFF SQLite file (`.sqlite`/`.db`), a CSV file, LEAF JSON
(a `.json` file or a directory of them), and a directory of per-client folders.

Example:
  >>> import numpy as np
  >>> from fedlang.simulation import client_data
  >>> cd = client_data.ClientData.from_tensor_slices(
  ...     {'a': {'x': np.zeros((3, 2), np.float32)}, 'b': {'x': np.zeros((5, 2), np.float32)}})
  >>> s = summarize(cd)
  >>> s.num_clients, s.num_examples, s.element_spec
  (2, 8, '<x=float32[2]>')
"""

from __future__ import annotations

import dataclasses
import os
import pathlib
from typing import Any

import numpy as np

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation import specs, store
from fedlang.simulation.formats import directory, leaf, sqlite, tabular, tf_example

FORMATS = ("auto", "store", "sqlite", "csv", "leaf", "directory")


def detect_format(path: str | os.PathLike) -> str:
    """The format of `path` (one of `FORMATS` but 'auto').

    Raises:
      FileNotFoundError: if `path` does not exist.
      ValueError: if the format cannot be told from the path.
    """
    path = pathlib.Path(path)
    if not path.exists():
        raise FileNotFoundError(f"Expected client data at {path}, found nothing there. Check the path.")
    if path.is_dir():
        if (path / store.INDEX_FILE).exists():
            return "store"
        if any(path.glob("*.json")):
            return "leaf"
        if any(p.is_dir() for p in path.iterdir()):
            return "directory"
    else:
        suffix = path.suffix.lower()
        if suffix in (".sqlite", ".db", ".sqlite3"):
            return "sqlite"
        if suffix in (".csv", ".tsv"):
            return "csv"
        if suffix == ".json":
            return "leaf"
        with open(path, "rb") as f:
            if f.read(16) == b"SQLite format 3\x00":
                return "sqlite"
    raise ValueError(
        f"Expected a store directory, a .sqlite, .csv or LEAF .json file, or a directory of client "
        f"folders at {path}, found something else. Pass the format explicitly (--format)."
    )


def _sqlite_element(blob: bytes) -> dict[str, Any]:
    """A decoded `tf.train.Example` with numeric features as arrays (length 1 -> scalar)."""
    out = {}
    for name, value in tf_example.decode_example(blob).items():
        if isinstance(value, list):
            out[name] = value[0] if len(value) == 1 else b"".join(value)
        else:
            array = np.asarray(value)
            if array.dtype == np.int64 and (array.size == 0 or np.abs(array).max() < 2**31):
                array = array.astype(np.int32)
            out[name] = array[0] if array.size == 1 else array
    return out


def open_source(path: str | os.PathLike, fmt: str = "auto", *, split: str | None = None,
                client_column: str | None = None,
                columns: list[str] | None = None) -> client_data_lib.ClientData:
    """Opens client data from a path.

    Args:
      path: the source.
      fmt: one of `FORMATS`.
      split: the split of a TFF SQLite file (required for those).
      client_column: the client-id column of a CSV file (required for those).
      columns: for a CSV file, the columns to read (default: all but the client id);
        the others are never converted, so a blank cell there does not matter.

    Returns:
      A lazy `ClientData`. SQLite examples are decoded into dicts (numeric features
      of length 1 become scalars, int64 values that fit become int32).

    Raises:
      FileNotFoundError: if `path` does not exist.
      ValueError: for an unknown format, or a missing `split`/`client_column` (the
        message lists the choices where the file has them).
    """
    if fmt not in FORMATS:
        raise ValueError(f"Expected a format in {list(FORMATS)}, found {fmt!r}.")
    path = pathlib.Path(path)
    fmt = detect_format(path) if fmt == "auto" else fmt
    if fmt == "store":
        return store.open_store(path).client_data()
    if fmt == "sqlite":
        if split is None:
            raise ValueError(
                f"Expected a split for the SQLite file {path}, found none; its splits are "
                f"{sqlite.split_names(path)}. Pass --split NAME."
            )
        raw = sqlite.from_sqlite(path, split)
        return client_data_lib.ClientData(
            raw.client_ids, lambda cid: raw.create_dataset_for_client(cid).map(_sqlite_element),
            num_examples=raw.num_examples)
    if fmt == "csv":
        if client_column is None:
            names = tabular.column_names(path)
            raise ValueError(
                f"Expected the client-id column of {path}, found none given; its columns are "
                f"{names}. Pass --client-column NAME."
            )
        return tabular.from_csv(path, client_column, columns)
    if fmt == "leaf":
        return leaf.from_leaf(path)
    return directory.from_directory(path)


@dataclasses.dataclass(frozen=True)
class Summary:
    """Sizes and element spec of a `ClientData`.

    Attributes:
      num_clients: the number of clients.
      num_examples: examples over all clients.
      sizes: examples per client, in client order.
      element_spec: one element's structure, as text.
    """

    num_clients: int
    num_examples: int
    sizes: np.ndarray
    element_spec: str

    def histogram(self, bins: int = 10) -> list[tuple[int, int, int]]:
        """`(low, high, clients)` per bin of client sizes (equal-width, integer edges)."""
        if not len(self.sizes):
            return []
        lo, hi = int(self.sizes.min()), int(self.sizes.max())
        edges = np.unique(np.linspace(lo, hi + 1, min(bins, hi + 1 - lo) + 1).astype(np.int64))
        counts, _ = np.histogram(self.sizes, bins=edges)
        return [(int(a), int(b) - 1, int(c)) for a, b, c in zip(edges[:-1], edges[1:], counts)]


def summarize(cd: client_data_lib.ClientData) -> Summary:
    """Counts the clients' examples (from metadata when known) and describes elements."""
    sizes = np.array([cd.num_examples(c) for c in cd.client_ids], dtype=np.int64)
    return Summary(len(sizes), int(sizes.sum()), sizes, specs.structure_str(cd.structure))


def with_progress(cd: client_data_lib.ClientData, callback: Any) -> client_data_lib.ClientData:
    """`cd` whose dataset recipe calls `callback(client_id)` as each client is opened."""

    def dataset_fn(cid: str) -> dataset_lib.Dataset:
        callback(cid)
        return cd.create_dataset_for_client(cid)

    return client_data_lib.ClientData(cd.client_ids, dataset_fn, num_examples=cd.num_examples)
