"""Reading an on-disk client store (see `store` for its layout): `Reader` maps the data
file and checks every row it hands out.

The store's index is validated when it is opened; each record-batch slice holding a
client's rows is validated by Arrow (`validate(full=True)`: buffer sizes, string
offsets, UTF-8) and checked against the client's CRC-32 before any of it is used.
Damage raises `StoreError` naming the file and the client, never a crash or a silent
wrong value.

This module lies below `client_data`, so that `ClientData.from_store` can open a
store; `store.Store` (what `store.open_store` returns) adds `client_data()`.
"""

from __future__ import annotations

import bisect
import os
import pathlib
import warnings
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.simulation import _atomic_dir, _tree, errors, specs
from fedlang.simulation import _store_format as fmt
from fedlang.simulation import dataset as dataset_lib


def _fix(path: pathlib.Path) -> str:
    return f"Re-create the store with `fedlang.simulation.store.write({str(path)!r}, source)`."


# Errors Arrow and the OS raise on a damaged file; each becomes a `StoreError`.
_DAMAGE = (pa.ArrowException, OSError, UnicodeDecodeError)


class Reader:
    """An open, memory-mapped store: its client ids, element structure and rows (checked
    as they are read). `store.Store` is this with `client_data()`."""

    def __init__(self, path: str | os.PathLike):
        self.path = path = pathlib.Path(path)
        _atomic_dir.recover(path)
        index_path, data_path = path / fmt.INDEX_FILE, path / fmt.DATA_FILE
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
            raise errors.StoreError(f"Expected a valid index in {index_path}: {e}. {_fix(path)}") from e
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
            raise errors.StoreError(f"Expected {data_path} to match {index_path}: {e}. {_fix(path)}") from e
        except _DAMAGE as e:
            raise errors.StoreError(f"Expected an Arrow IPC file at {data_path}, found a corrupt one ({e}). {_fix(path)}") from e
        if num_batches != len(self._offsets) - 1:
            raise errors.StoreError(f"Expected {len(self._offsets) - 1} record batches in {data_path} as {index_path} "
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
            raise errors.UnknownClientError(
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
        except errors.StoreError:
            raise
        except _DAMAGE as e:
            raise errors.StoreError(f"Expected readable rows of client {client_id!r} in {self._data_path}, found "
                             f"damage ({type(e).__name__}: {e}). {_fix(self.path)}") from e
        return _tree.unflatten(self.structure, arrays)

    def _pieces(self, client_id: str, offset: int, count: int, expected: int | None) -> list[pa.RecordBatch]:
        """The validated record-batch slices holding a client's rows."""
        if not count:
            if expected is not None and expected != fmt.client_seed(client_id):
                raise errors.StoreError(f"Expected the checksum of client {client_id!r} (no rows) in {self.path / fmt.INDEX_FILE} "
                                 f"to match its id, found a different one: the index is damaged. {_fix(self.path)}")
            return []
        if self._stat() != self._file_id:
            raise errors.StoreError(f"Expected the store at {self.path} to be unchanged since it was opened, found "
                             f"{fmt.DATA_FILE} replaced (the store was rewritten). Open it again.")
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
                raise errors.StoreError(f"Expected {self._offsets[b + 1] - self._offsets[b]} rows in record batch {b} "
                                 f"of {self._data_path}, found {batch.num_rows} (reading client {client_id!r}). "
                                 f"{_fix(self.path)}")
            lo = max(offset, self._offsets[b]) - self._offsets[b]
            hi = min(offset + count, self._offsets[b + 1]) - self._offsets[b]
            piece = batch.slice(lo, hi - lo)
            piece.validate(full=True)  # before any value is touched: sizes, offsets, UTF-8
            nulls = [c for c, col in zip(self.columns, piece.columns) if _null_count(col)]
            if nulls:
                raise errors.StoreError(f"Expected no missing values in {self._data_path}, found some in columns {nulls} "
                                 f"of client {client_id!r}. {_fix(self.path)}")
            if expected is not None:
                crc = fmt.checksum(piece, self._leaves, crc)
            pieces.append(piece)
            b += 1
        if expected is not None and crc != expected:
            raise errors.StoreError(f"Expected the rows of client {client_id!r} in {self._data_path} to match their "
                             f"checksum, found them changed (crc32 {crc:08x}, expected {expected:08x}): the file "
                             f"is damaged. {_fix(self.path)}")
        return pieces

    def read_client(self, client_id: str) -> dataset_lib.Dataset:
        """A client's lazy `Dataset`; its rows are mapped in when iteration starts."""
        count = self.num_examples(client_id)
        return dataset_lib.Dataset.from_slices_fn(lambda: self.read_arrays(client_id), self.structure, cardinality=count)


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
