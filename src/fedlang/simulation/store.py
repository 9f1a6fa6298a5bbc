"""The on-disk client store: one memory-mapped Arrow IPC file plus a JSON index.

Layout of a store directory::

    data.arrow   Arrow IPC file; each client's rows are contiguous. One column per
                 element field; fixed-shape tensors are FixedSizeList columns (their
                 shape is in the index), strings are large_string/large_binary.
    index.json   format/version, the element structure, record-batch offsets and
                 client_id -> [row offset, row count, crc32] for O(1) lookup.

Any source converts once with `write` (streaming: record batches are written as
rows arrive, so memory stays bounded by `max_batch_bytes`) and opens with
`open_store` or `ClientData.from_store`. Reading a client maps its rows straight from
the page cache into numpy arrays (zero copy for numeric fields), so iterating a store
much larger than memory never loads the file.

Nothing read back is trusted (see `_store_format`, and `_store_reader`, which reads):
the index is validated when the store is opened, and each record-batch slice holding
a client's rows is validated by Arrow (`validate(full=True)`: buffer sizes, string
offsets, UTF-8) and checked against the client's CRC-32 before any of it is used.
Damage raises `StoreError` naming the file and the client, never a crash or a silent
wrong value.

Writes are atomic (see `_atomic_dir`): everything is written to a hidden temporary
directory next to `path`, which is moved into place only when complete; opening or
writing a store finishes a replacement that a kill interrupted and deletes
temporaries that no live writer holds.
"""

from __future__ import annotations

import json
import os
import pathlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.simulation import _atomic_dir, _cast, _store_reader, _tree, errors, specs
from fedlang.simulation import _store_format as fmt
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

FORMAT = fmt.FORMAT
VERSION = fmt.VERSION
DATA_FILE = fmt.DATA_FILE
INDEX_FILE = fmt.INDEX_FILE
StoreError = errors.StoreError


# -- writing ----------------------------------------------------------------------


class _Writer:
    """Buffers rows per column, writes them as Arrow record batches, checksums clients."""

    def __init__(self, data_path: pathlib.Path, structure: Any, first: Any, max_batch_bytes: int):
        self.structure = structure
        self.columns = fmt.columns_of(structure)
        self.leaves = _tree.flatten(structure)
        self.strings: dict[str, str] = {}
        firsts = _tree.flatten(first) if first is not None else [None] * len(self.leaves)
        for name, leaf, value in zip(self.columns, self.leaves, firsts):
            if isinstance(leaf, specs.StringSpec):
                if leaf.shape:
                    raise TypeError(f"Expected scalar strings in field {name!r}, found {leaf}. Join them into one string first.")
                self.strings[name] = "bytes" if isinstance(value, bytes) else "str"
                continue
            if not leaf.is_fully_defined:
                raise TypeError(f"Expected a fixed shape for field {name!r}, found {leaf}. Pad or crop it with `map` first.")
            try:
                fmt.arrow_type(leaf, None)
            except (pa.ArrowNotImplementedError, NotImplementedError) as e:
                raise TypeError(f"Field {name!r} has dtype {leaf.dtype}, which the store cannot hold.") from e
        self.structure_json = fmt.structure_to_json(structure, self.strings)
        self.schema = fmt.schema(structure, self.structure_json, self.strings)
        self.sink = pa.OSFile(str(data_path), "wb")
        self.writer = pa.ipc.new_file(self.sink, self.schema)
        self.max_batch_bytes = max_batch_bytes
        self.buffer: list[list[Any]] = [[] for _ in self.columns]
        self.buffered_bytes = 0
        self.num_rows = 0
        self.batch_offsets = [0]
        self.client = ""
        # The index entries [row offset, row count (-1 while being written), crc32] of the
        # clients whose rows are buffered; checksums are chained onto them as rows are written.
        self.open_clients: list[list[int]] = []

    def begin_client(self, client_id: str, entry: list[int]) -> None:
        self.client = client_id
        self.open_clients.append(entry)

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

    def end_client(self, entry: list[int]) -> None:
        entry[1] = self.num_rows - entry[0]
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
            try:
                stacked = _cast.checked(stacked, leaf.dtype)
            except _cast.CastError as e:
                raise ValueError(f"Expected values that fit dtype {leaf.dtype} in field {name!r} (near client "
                                 f"{self.client!r}), found {e}. Declare a wider dtype in element_spec.") from e
        flat = pa.array(stacked.reshape(-1))
        if not leaf.shape:
            return flat
        return pa.FixedSizeListArray.from_arrays(flat, int(np.prod(leaf.shape)))

    def flush(self) -> None:
        if not self.buffer[0]:
            return
        arrays = [self._array(n, leaf, vals) for n, leaf, vals in zip(self.columns, self.leaves, self.buffer)]
        batch = pa.RecordBatch.from_arrays(arrays, schema=self.schema)
        start, end = self.batch_offsets[-1], self.num_rows
        for entry in self.open_clients:
            stop = end if entry[1] < 0 else entry[0] + entry[1]
            lo, hi = max(entry[0], start), min(stop, end)
            if hi > lo:
                entry[2] = fmt.checksum(batch.slice(lo - start, hi - lo), self.leaves, entry[2])
        self.writer.write_batch(batch)
        self.batch_offsets.append(end)
        # Only the client being written can have rows in the next batch.
        self.open_clients = [e for e in self.open_clients[-1:] if e[1] < 0]
        self.buffer = [[] for _ in self.columns]
        self.buffered_bytes = 0

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()


_SOURCE_KINDS = ("a ClientData, a mapping client_id -> iterable of elements, or an iterable of "
                 "(client_id, elements) pairs")


def _pairs(source: Any) -> Iterable[tuple[str, Iterable[Any]]]:
    if isinstance(source, client_data_lib.ClientData):
        return ((cid, source.create_dataset_for_client(cid)) for cid in source.client_ids)
    if isinstance(source, Mapping):
        return source.items()
    if isinstance(source, np.ndarray | str | bytes) or not isinstance(source, Iterable):
        found = f"an array of shape {source.shape}" if isinstance(source, np.ndarray) else type(source).__name__
        raise TypeError(
            f"Expected {_SOURCE_KINDS}, found {found}. To store arrays, split them into clients "
            "first: `store.write(path, fedlang.simulation.from_numpy(x, y, partition))`."
        )
    return _checked_pairs(source)


def _checked_pairs(source: Iterable[Any]) -> Iterator[tuple[str, Iterable[Any]]]:
    for item in source:
        if not isinstance(item, tuple | list) or len(item) != 2:
            raise TypeError(f"Expected {_SOURCE_KINDS}, found an item {type(item).__name__} {item!r:.60} that is "
                            "not a (client_id, elements) pair.")
        yield item[0], item[1]


def _elements(client_id: str, elements: Any) -> Iterable[Any]:
    if isinstance(elements, Mapping | str | bytes) or not isinstance(elements, Iterable):
        raise TypeError(
            f"Expected an iterable of elements for client {client_id!r}, found {type(elements).__name__}. "
            "For columns of arrays, use `ClientData.from_tensor_slices({client_id: columns})` as the source."
        )
    return elements


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
      ValueError: for repeated client ids, rows of varying shape, values that do not
        fit the declared dtype, or a source with no elements and no `element_spec`.
      TypeError: for a source of another kind, non-string client ids or fields the
        store cannot hold.
    """
    path = pathlib.Path(path)
    _atomic_dir.recover(path)
    if path.exists():
        if not overwrite:
            raise FileExistsError(f"Expected no file at {path}, found one. Pass overwrite=True to replace it.")
        if not (path / INDEX_FILE).exists() and any(path.iterdir()):
            raise FileExistsError(f"Expected a fedlang store at {path} to overwrite, found another non-empty path.")
    pairs = _pairs(source)
    path.parent.mkdir(parents=True, exist_ok=True)
    with _atomic_dir.staging(path) as tmp:
        structure = None if element_spec is None else specs.to_structure(element_spec)
        writer: _Writer | None = None
        clients: dict[str, list[int]] = {}
        for cid, elements in pairs:
            if not isinstance(cid, str):
                raise TypeError(f"Expected string client ids, found {type(cid).__name__} {cid!r}.")
            if cid in clients:
                raise ValueError(f"Expected each client once (rows are contiguous), found {cid!r} twice.")
            entry = clients[cid] = [writer.num_rows if writer else 0, -1, fmt.client_seed(cid)]
            if writer is not None:
                writer.begin_client(cid, entry)
            for element in _elements(cid, elements):
                if writer is None:
                    writer = _Writer(tmp / DATA_FILE, structure or specs.structure_of(element), element, max_batch_bytes)
                    writer.begin_client(cid, entry)
                writer.add(element)
            if writer is not None:
                writer.end_client(entry)
            else:
                entry[1] = 0
        if writer is None:
            if structure is None:
                raise ValueError("Expected at least one element to infer the schema, found none. Pass element_spec=.")
            writer = _Writer(tmp / DATA_FILE, structure, None, max_batch_bytes)
        writer.close()
        index = {
            "format": FORMAT,
            "version": VERSION,
            "checksum": fmt.CHECKSUM,
            "num_rows": writer.num_rows,
            "structure": writer.structure_json,
            "batch_offsets": writer.batch_offsets,
            "clients": clients,
        }
        (tmp / INDEX_FILE).write_text(json.dumps(index))
        _fsync(tmp / DATA_FILE)
        _fsync(tmp / INDEX_FILE)
        _atomic_dir.commit(tmp, path)
    return path


# -- reading ----------------------------------------------------------------------


class Store(_store_reader.Reader):
    """An open, memory-mapped store (see `open_store`): its client ids, structure and
    rows (`_store_reader.Reader`), and `client_data()`."""

    def client_data(self) -> client_data_lib.ClientData:
        """The store as a `ClientData`."""
        return client_data_lib.ClientData.from_store(self)


def open_store(path: str | os.PathLike) -> Store:
    """Opens a store memory-mapped; reads only the index and the file footer.

    A replacement of the store that a kill interrupted is finished first, and
    temporaries left by killed writers are deleted (see `_atomic_dir`).

    Raises:
      FileNotFoundError: if the directory or one of its files is missing.
      StoreError: (a `ValueError`) if a file is corrupt; reading a damaged client
        raises it later, naming the client.
    """
    return Store(path)


def read_client(path_or_store: str | os.PathLike | Store, client_id: str) -> dataset_lib.Dataset:
    """The lazy `Dataset` of one client of a store (a path or an open `Store`)."""
    store = path_or_store if isinstance(path_or_store, Store) else Store(path_or_store)
    return store.read_client(client_id)
