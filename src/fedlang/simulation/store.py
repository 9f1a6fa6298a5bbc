"""The on-disk client store: one memory-mapped Arrow IPC file plus a JSON index.

Layout of a store directory::

    data.arrow   Arrow IPC file; each client's rows are contiguous. One column per
                 element field; fixed-shape tensors are FixedSizeList columns (their
                 shape is in the index), strings are large_string/large_binary.
    index.json   format/version, the element structure, record-batch offsets and
                 client_id -> [row offset, row count] for O(1) lookup.

Any source converts once with `write` (streaming: record batches are written as
rows arrive, so memory stays bounded by `max_batch_bytes`) and opens with
`open_store` or `ClientData.from_store`. Reading a client maps its rows straight from
the page cache into numpy arrays (zero copy for numeric fields), so iterating a store
much larger than memory never loads the file.

Writes are atomic: everything is written to a hidden temporary directory next to
`path`, which is renamed into place only when complete, so an interrupted write never
leaves something at `path` that looks like a valid store.
"""

from __future__ import annotations

import bisect
import collections
import json
import os
import pathlib
import shutil
import uuid
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.core import types
from fedlang.simulation import _tree, specs
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

FORMAT = "fedlang.client_store"
VERSION = 1
DATA_FILE = "data.arrow"
INDEX_FILE = "index.json"


class StoreError(ValueError):
    """A store directory exists but is corrupt or not a fedlang store."""


def _fix(path: pathlib.Path) -> str:
    return f"Re-create the store with `fedlang.simulation.store.write({str(path)!r}, source)`."


# -- structure <-> JSON -----------------------------------------------------------


def _columns_of(structure: Any) -> list[str]:
    return [p or "value" for p in _tree.paths(structure)]


def _structure_to_json(node: Any, strings: dict[str, str], path: str = "") -> Any:
    if isinstance(node, Mapping):
        items = [[k, _structure_to_json(v, strings, f"{path}/{k}" if path else k)] for k, v in node.items()]
        return {"dict": items}
    if isinstance(node, list | tuple):
        children = [_structure_to_json(v, strings, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node)]
        if hasattr(node, "_fields"):
            return {"namedtuple": type(node).__name__, "fields": list(node._fields), "items": children}
        return {"list" if isinstance(node, list) else "tuple": children}
    column = path or "value"
    shape = [d for d in node.shape]
    if isinstance(node, specs.StringSpec):
        return {"column": column, "string": strings.get(column, "str"), "shape": shape}
    return {"column": column, "dtype": node.dtype.name, "shape": shape}


def _structure_from_json(node: Any) -> Any:
    if "dict" in node:
        return {k: _structure_from_json(v) for k, v in node["dict"]}
    if "namedtuple" in node:
        cls = collections.namedtuple(node["namedtuple"], node["fields"])  # type: ignore[misc]
        return cls(*(_structure_from_json(v) for v in node["items"]))
    if "list" in node:
        return [_structure_from_json(v) for v in node["list"]]
    if "tuple" in node:
        return tuple(_structure_from_json(v) for v in node["tuple"])
    if "string" in node:
        return specs.StringSpec(tuple(node["shape"]))
    return types.TensorType(node["dtype"], node["shape"])


# -- writing ----------------------------------------------------------------------


class _Writer:
    """Buffers rows per column and writes them as Arrow record batches."""

    def __init__(self, data_path: pathlib.Path, structure: Any, first: Any, max_batch_bytes: int):
        self.structure = structure
        self.columns = _columns_of(structure)
        self.leaves = _tree.flatten(structure)
        self.strings: dict[str, str] = {}
        fields = []
        for name, leaf, value in zip(self.columns, self.leaves, _tree.flatten(first) if first is not None else [None] * len(self.leaves)):
            if isinstance(leaf, specs.StringSpec):
                if leaf.shape:
                    raise TypeError(f"Expected scalar strings in field {name!r}, found {leaf}. Join them into one string first.")
                kind = "bytes" if isinstance(value, bytes) else "str"
                self.strings[name] = kind
                fields.append(pa.field(name, pa.large_binary() if kind == "bytes" else pa.large_string()))
                continue
            if not leaf.is_fully_defined:
                raise TypeError(f"Expected a fixed shape for field {name!r}, found {leaf}. Pad or crop it with `map` first.")
            try:
                arrow_type = pa.from_numpy_dtype(leaf.dtype)
            except (pa.ArrowNotImplementedError, NotImplementedError) as e:
                raise TypeError(f"Field {name!r} has dtype {leaf.dtype}, which the store cannot hold.") from e
            if leaf.shape:
                arrow_type = pa.list_(arrow_type, int(np.prod(leaf.shape)))
            fields.append(pa.field(name, arrow_type))
        self.schema = pa.schema(fields)
        self.sink = pa.OSFile(str(data_path), "wb")
        self.writer = pa.ipc.new_file(self.sink, self.schema)
        self.max_batch_bytes = max_batch_bytes
        self.buffer: list[list[Any]] = [[] for _ in self.columns]
        self.buffered_bytes = 0
        self.num_rows = 0
        self.batch_offsets = [0]
        self.client = ""

    def add(self, element: Any) -> None:
        leaves = _tree.flatten(element)
        if len(leaves) != len(self.columns):
            raise ValueError(
                f"Expected elements with structure {specs.structure_str(self.structure)}, "
                f"found {specs.structure_str(specs.structure_of(element))} in client {self.client!r}."
            )
        for column, value in zip(self.buffer, leaves):
            column.append(value)
            self.buffered_bytes += len(value) if isinstance(value, str | bytes) else np.asarray(value).nbytes
        self.num_rows += 1
        if self.buffered_bytes >= self.max_batch_bytes:
            self.flush()

    def end_client(self) -> None:
        # Prefer record batches that end at client boundaries: reads are then zero-copy.
        if self.buffered_bytes >= self.max_batch_bytes // 4:
            self.flush()

    def _array(self, name: str, leaf: Any, values: list[Any]) -> pa.Array:
        if isinstance(leaf, specs.StringSpec):
            try:
                return pa.array(values, type=self.schema.field(name).type)
            except (pa.ArrowTypeError, pa.ArrowInvalid) as e:
                raise TypeError(f"Expected {self.strings[name]} values in field {name!r} (client {self.client!r}).") from e
        try:
            stacked = np.stack([np.asarray(v) for v in values])
        except ValueError as e:
            raise ValueError(
                f"Expected every row of field {name!r} to have shape {list(leaf.shape)}, found "
                f"{sorted({np.shape(v) for v in values})} (near client {self.client!r}). Pad or crop with `map`."
            ) from e
        if stacked.shape[1:] != leaf.shape:
            raise ValueError(
                f"Expected every row of field {name!r} to have shape {list(leaf.shape)}, found "
                f"{list(stacked.shape[1:])} (near client {self.client!r}). Pad or crop with `map`."
            )
        if stacked.dtype != leaf.dtype:
            if not np.can_cast(stacked.dtype, leaf.dtype, "same_kind"):
                raise TypeError(f"Expected dtype {leaf.dtype} in field {name!r}, found {stacked.dtype} (client {self.client!r}).")
            stacked = stacked.astype(leaf.dtype)
        flat = pa.array(stacked.reshape(-1))
        if not leaf.shape:
            return flat
        return pa.FixedSizeListArray.from_arrays(flat, int(np.prod(leaf.shape)))

    def flush(self) -> None:
        if not self.buffer[0]:
            return
        arrays = [self._array(n, leaf, vals) for n, leaf, vals in zip(self.columns, self.leaves, self.buffer)]
        self.writer.write_batch(pa.RecordBatch.from_arrays(arrays, schema=self.schema))
        self.batch_offsets.append(self.num_rows)
        self.buffer = [[] for _ in self.columns]
        self.buffered_bytes = 0

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()


def _pairs(source: Any) -> Iterable[tuple[str, Iterable[Any]]]:
    if isinstance(source, client_data_lib.ClientData):
        return ((cid, source.create_dataset_for_client(cid)) for cid in source.client_ids)
    if isinstance(source, Mapping):
        return source.items()
    return source


def _fsync(path: pathlib.Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(path: str | os.PathLike, source: Any, *, element_spec: Any = None,
          overwrite: bool = False, max_batch_bytes: int = 32 << 20) -> pathlib.Path:
    """Converts client data into a store at `path`, streaming and atomically.

    Args:
      path: the store directory to create.
      source: a `ClientData`, a mapping client_id -> iterable of elements, or an
        iterable of `(client_id, iterable_of_elements)` pairs. Each client appears once.
      element_spec: the spec of one element; inferred from the first element if
        omitted. Numeric fields need a fixed shape; string fields must be scalars.
      overwrite: replace an existing store at `path`.
      max_batch_bytes: rows are buffered up to about this many bytes before being
        written, which bounds the memory used.

    Returns:
      `path`, as a `pathlib.Path`.

    Raises:
      FileExistsError: if `path` exists and `overwrite` is False, or if it is not a
        store (overwrite never deletes a directory that is not a store).
      ValueError: for repeated client ids, rows of varying shape, or a source with no
        elements and no `element_spec`.
      TypeError: for non-string client ids or fields the store cannot hold.
    """
    path = pathlib.Path(path)
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"Expected no file at {path}, found one. Pass overwrite=True to replace it.")
        if not (path / INDEX_FILE).exists() and any(path.iterdir()):
            raise FileExistsError(f"Expected a fedlang store at {path} to overwrite, found another non-empty path.")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex}"
    tmp.mkdir()
    try:
        structure = None if element_spec is None else specs.to_structure(element_spec)
        writer: _Writer | None = None
        clients: dict[str, list[int]] = {}
        for cid, elements in _pairs(source):
            if not isinstance(cid, str):
                raise TypeError(f"Expected string client ids, found {type(cid).__name__} {cid!r}.")
            if cid in clients:
                raise ValueError(f"Expected each client once (rows are contiguous), found {cid!r} twice.")
            start = writer.num_rows if writer else 0
            for element in elements:
                if writer is None:
                    writer = _Writer(tmp / DATA_FILE, structure or specs.structure_of(element), element, max_batch_bytes)
                writer.client = cid
                writer.add(element)
            if writer is not None:
                writer.end_client()
            clients[cid] = [start, (writer.num_rows if writer else 0) - start]
        if writer is None:
            if structure is None:
                raise ValueError("Expected at least one element to infer the schema, found none. Pass element_spec=.")
            writer = _Writer(tmp / DATA_FILE, structure, None, max_batch_bytes)
        writer.close()
        strings = writer.strings
        index = {
            "format": FORMAT,
            "version": VERSION,
            "num_rows": writer.num_rows,
            "structure": _structure_to_json(writer.structure, strings),
            "batch_offsets": writer.batch_offsets,
            "clients": clients,
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index))
        _fsync(tmp / DATA_FILE)
        _fsync(tmp / INDEX_FILE)
        if path.exists():
            old = path.parent / f".{path.name}.old-{uuid.uuid4().hex}"
            path.rename(old)
            tmp.rename(path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return path


# -- reading ----------------------------------------------------------------------


class Store:
    """An open, memory-mapped store (see `open_store`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = path = pathlib.Path(path)
        index_path, data_path = path / INDEX_FILE, path / DATA_FILE
        if not path.is_dir():
            raise FileNotFoundError(
                f"Expected a client store directory at {path}, found none. Create one with "
                "`fedlang.simulation.store.write(path, client_data)`."
            )
        for required in (index_path, data_path):
            if not required.is_file():
                raise FileNotFoundError(f"Expected {required} in the store, found it missing. {_fix(path)}")
        try:
            index = json.loads(index_path.read_text())
            if index.get("format") != FORMAT:
                raise StoreError(f"Expected format {FORMAT!r} in {index_path}, found {index.get('format')!r}. {_fix(path)}")
            if index.get("version") != VERSION:
                raise StoreError(f"Expected store version {VERSION} in {index_path}, found {index.get('version')!r}. {_fix(path)}")
            self.structure = _structure_from_json(index["structure"])
            self._offsets: list[int] = index["batch_offsets"]
            self._clients: dict[str, list[int]] = index["clients"]
            num_rows = int(index["num_rows"])
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise StoreError(f"Expected a valid index in {index_path}, found a corrupt one ({e!r}). {_fix(path)}") from e
        self._data_path = str(data_path)
        try:
            reader = self._open()
        except (pa.ArrowInvalid, OSError) as e:
            raise StoreError(f"Expected an Arrow IPC file at {data_path}, found a corrupt one ({e}). {_fix(path)}") from e
        self.columns = _columns_of(self.structure)
        if (
            reader.num_record_batches != len(self._offsets) - 1
            or self._offsets[-1] != num_rows
            or reader.schema.names != self.columns
        ):
            raise StoreError(f"Expected {data_path} to match {index_path}, found a mismatch. {_fix(path)}")
        self._leaves = _tree.flatten(self.structure)

    def _open(self) -> pa.ipc.RecordBatchFileReader:
        return pa.ipc.open_file(pa.memory_map(self._data_path, "r"))

    @property
    def client_ids(self) -> list[str]:
        return list(self._clients)

    def num_examples(self, client_id: str) -> int:
        return self._range(client_id)[1]

    def _range(self, client_id: str) -> list[int]:
        try:
            return self._clients[client_id]
        except KeyError:
            raise client_data_lib.UnknownClientError(
                f"Expected a client id of the store at {self.path}, found {client_id!r}; list "
                "them with `ClientData.from_store(path).client_ids`."
            ) from None

    def read_arrays(self, client_id: str) -> Any:
        """A client's rows as a structure of numpy arrays (zero copy where possible)."""
        offset, count = self._range(client_id)
        # Each read maps the file afresh (about 0.2 ms: the footer is parsed again) and
        # the returned arrays are the only references to that mapping: when they are
        # dropped, the file is unmapped and the pages they touched leave this process's
        # RSS (they stay in the page cache). One mapping shared by all reads would keep
        # every page ever touched resident, growing RSS with each round's new clients.
        reader = self._open() if count else None
        pieces: list[pa.RecordBatch] = []
        b = bisect.bisect_right(self._offsets, offset) - 1
        while reader is not None and b < len(self._offsets) - 1 and self._offsets[b] < offset + count:
            lo = max(offset, self._offsets[b]) - self._offsets[b]
            hi = min(offset + count, self._offsets[b + 1]) - self._offsets[b]
            pieces.append(reader.get_batch(b).slice(lo, hi - lo))
            b += 1
        arrays = []
        for i, leaf in enumerate(self._leaves):
            parts = [_to_numpy(p.column(i), leaf) for p in pieces]
            arrays.append(parts[0] if len(parts) == 1 else _empty(leaf) if not parts else np.concatenate(parts))
        return _tree.unflatten(self.structure, arrays)

    def read_client(self, client_id: str) -> dataset_lib.Dataset:
        """A client's lazy `Dataset`; its rows are mapped in when iteration starts."""
        count = self.num_examples(client_id)
        return dataset_lib.Dataset.from_slices_fn(lambda: self.read_arrays(client_id), self.structure, cardinality=count)

    def client_data(self) -> client_data_lib.ClientData:
        """The store as a `ClientData`."""
        return client_data_lib.ClientData(self.client_ids, self.read_client, element_spec=self.structure,
                                          num_examples=self.num_examples)


def _empty(leaf: Any) -> np.ndarray:
    if isinstance(leaf, specs.StringSpec):
        return np.empty((0,), dtype=object)
    return np.empty((0, *leaf.shape), dtype=leaf.dtype)


def _to_numpy(column: pa.Array, leaf: Any) -> np.ndarray:
    if isinstance(leaf, specs.StringSpec):
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
    zero_copy = leaf.dtype != np.bool_
    if leaf.shape:
        flat = column.flatten().to_numpy(zero_copy_only=zero_copy)
        return flat.reshape(len(column), *leaf.shape)
    return column.to_numpy(zero_copy_only=zero_copy)


def open_store(path: str | os.PathLike) -> Store:
    """Opens a store memory-mapped; reads only the index and the file footer.

    Raises:
      FileNotFoundError: if the directory or one of its files is missing.
      StoreError: (a `ValueError`) if a file is corrupt.
    """
    return Store(path)


def read_client(path_or_store: str | os.PathLike | Store, client_id: str) -> dataset_lib.Dataset:
    """The lazy `Dataset` of one client of a store (a path or an open `Store`)."""
    store = path_or_store if isinstance(path_or_store, Store) else Store(path_or_store)
    return store.read_client(client_id)
