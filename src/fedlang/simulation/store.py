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

Nothing read back is trusted (see `_store_format`): the index is validated when the
store is opened, and each record-batch slice holding a client's rows is validated by
Arrow (`validate(full=True)`: buffer sizes, string offsets, UTF-8) and checked
against the client's CRC-32 before any of it is used. Damage raises `StoreError`
naming the file and the client, never a crash or a silent wrong value.

Writes are atomic (see `_atomic_dir`): everything is written to a hidden temporary
directory next to `path`, which is moved into place only when complete; opening or
writing a store finishes a replacement that a kill interrupted and deletes
temporaries that no live writer holds.
"""

from __future__ import annotations

import bisect
import json
import os
import pathlib
import warnings
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.simulation import _atomic_dir, _cast, _tree, specs
from fedlang.simulation import _store_format as fmt
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

FORMAT = fmt.FORMAT
VERSION = fmt.VERSION
DATA_FILE = "data.arrow"
INDEX_FILE = "index.json"


class StoreError(ValueError):
    """A store directory exists but is corrupt or not a fedlang store."""


def _fix(path: pathlib.Path) -> str:
    return f"Re-create the store with `fedlang.simulation.store.write({str(path)!r}, source)`."


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

# Errors Arrow and the OS raise on a damaged file; each becomes a `StoreError`.
_DAMAGE = (pa.ArrowException, OSError, UnicodeDecodeError)


class Store:
    """An open, memory-mapped store (see `open_store`)."""

    def __init__(self, path: str | os.PathLike):
        self.path = path = pathlib.Path(path)
        _atomic_dir.recover(path)
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
            index = fmt.parse_index(index_path.read_bytes())
        except fmt.InvalidIndexError as e:
            raise StoreError(f"Expected a valid index in {index_path}: {e}. {_fix(path)}") from e
        self._index = index
        self.structure = index.structure
        self._offsets = index.batch_offsets
        self._clients = index.clients
        self._leaves = _tree.flatten(self.structure)
        self.columns = fmt.columns_of(self.structure)
        self._data_path = str(data_path)
        try:
            self._file_id = self._stat()
            reader = self._open()
            fmt.check_schema(reader.schema, index)
            num_batches = reader.num_record_batches
        except fmt.InvalidIndexError as e:
            raise StoreError(f"Expected {data_path} to match {index_path}: {e}. {_fix(path)}") from e
        except _DAMAGE as e:
            raise StoreError(f"Expected an Arrow IPC file at {data_path}, found a corrupt one ({e}). {_fix(path)}") from e
        if num_batches != len(self._offsets) - 1:
            raise StoreError(f"Expected {len(self._offsets) - 1} record batches in {data_path} as {index_path} "
                             f"says, found {num_batches}. {_fix(path)}")
        if index.version < fmt.VERSION:
            warnings.warn(
                f"The store at {path} was written by an older fedlang (store version {index.version}) without "
                "checksums: its files are validated when read, but damaged values cannot be detected. "
                f"{_fix(path)}", UserWarning, stacklevel=3)

    def _stat(self) -> tuple[int, int, int]:
        st = os.stat(self._data_path)
        return st.st_dev, st.st_ino, st.st_size

    def _open(self) -> pa.ipc.RecordBatchFileReader:
        return pa.ipc.open_file(pa.memory_map(self._data_path, "r"))

    @property
    def client_ids(self) -> list[str]:
        return list(self._clients)

    @property
    def verified(self) -> bool:
        """Whether reads are checked against checksums (stores of version 2 and later)."""
        return self._index.version >= 2

    def num_examples(self, client_id: str) -> int:
        return self._range(client_id)[1]

    def _range(self, client_id: str) -> tuple[int, int, int | None]:
        """(row offset, row count, crc32 or None for a version 1 store)."""
        try:
            entry = self._clients[client_id]
            return entry[0], entry[1], entry[2] if len(entry) > 2 else None
        except KeyError:
            raise client_data_lib.UnknownClientError(
                f"Expected a client id of the store at {self.path}, found {client_id!r}; list "
                "them with `ClientData.from_store(path).client_ids`."
            ) from None

    def read_arrays(self, client_id: str) -> Any:
        """A client's rows as a structure of numpy arrays (zero copy where possible).

        Raises:
          StoreError: if the client's rows are damaged, or the store was replaced
            since it was opened.
        """
        offset, count, expected = self._range(client_id)
        try:
            pieces = self._pieces(client_id, offset, count, expected)
            arrays = []
            for i, leaf in enumerate(self._leaves):
                parts = [_to_numpy(p.column(i), leaf) for p in pieces]
                arrays.append(parts[0] if len(parts) == 1 else _empty(leaf) if not parts else np.concatenate(parts))
        except StoreError:
            raise
        except _DAMAGE as e:
            raise StoreError(f"Expected readable rows of client {client_id!r} in {self._data_path}, found "
                             f"damage ({type(e).__name__}: {e}). {_fix(self.path)}") from e
        return _tree.unflatten(self.structure, arrays)

    def _pieces(self, client_id: str, offset: int, count: int, expected: int | None) -> list[pa.RecordBatch]:
        """The validated record-batch slices holding a client's rows."""
        if not count:
            if expected is not None and expected != fmt.client_seed(client_id):
                raise StoreError(f"Expected the checksum of client {client_id!r} (no rows) in {self.path / INDEX_FILE} "
                                 f"to match its id, found a different one: the index is damaged. {_fix(self.path)}")
            return []
        if self._stat() != self._file_id:
            raise StoreError(f"Expected the store at {self.path} to be unchanged since it was opened, found "
                             f"{DATA_FILE} replaced (the store was rewritten). Open it again.")
        # Each read maps the file afresh (about 0.2 ms: the footer is parsed again) and
        # the returned arrays are the only references to that mapping: when they are
        # dropped, the file is unmapped and the pages they touched leave this process's
        # RSS (they stay in the page cache). One mapping shared by all reads would keep
        # every page ever touched resident, growing RSS with each round's new clients.
        reader = self._open()
        crc = fmt.client_seed(client_id)
        pieces: list[pa.RecordBatch] = []
        b = bisect.bisect_right(self._offsets, offset) - 1
        while b < len(self._offsets) - 1 and self._offsets[b] < offset + count:
            batch = reader.get_batch(b)
            if batch.num_rows != self._offsets[b + 1] - self._offsets[b]:
                raise StoreError(f"Expected {self._offsets[b + 1] - self._offsets[b]} rows in record batch {b} "
                                 f"of {self._data_path}, found {batch.num_rows} (reading client {client_id!r}). "
                                 f"{_fix(self.path)}")
            lo = max(offset, self._offsets[b]) - self._offsets[b]
            hi = min(offset + count, self._offsets[b + 1]) - self._offsets[b]
            piece = batch.slice(lo, hi - lo)
            piece.validate(full=True)  # before any value is touched: sizes, offsets, UTF-8
            nulls = [c for c, col in zip(self.columns, piece.columns) if _null_count(col)]
            if nulls:
                raise StoreError(f"Expected no missing values in {self._data_path}, found some in columns {nulls} "
                                 f"of client {client_id!r}. {_fix(self.path)}")
            if expected is not None:
                crc = fmt.checksum(piece, self._leaves, crc)
            pieces.append(piece)
            b += 1
        if expected is not None and crc != expected:
            raise StoreError(f"Expected the rows of client {client_id!r} in {self._data_path} to match their "
                             f"checksum, found them changed (crc32 {crc:08x}, expected {expected:08x}): the file "
                             f"is damaged. {_fix(self.path)}")
        return pieces

    def read_client(self, client_id: str) -> dataset_lib.Dataset:
        """A client's lazy `Dataset`; its rows are mapped in when iteration starts."""
        count = self.num_examples(client_id)
        return dataset_lib.Dataset.from_slices_fn(lambda: self.read_arrays(client_id), self.structure, cardinality=count)

    def client_data(self) -> client_data_lib.ClientData:
        """The store as a `ClientData`."""
        return client_data_lib.ClientData(self.client_ids, self.read_client, element_spec=self.structure,
                                          num_examples=self.num_examples)


def _null_count(column: pa.Array) -> int:
    nulls = column.null_count
    if pa.types.is_fixed_size_list(column.type):
        nulls += column.flatten().null_count
    return nulls


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
