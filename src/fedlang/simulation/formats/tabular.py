"""Readers for tables: CSV files and pandas DataFrames, one client per key value.

Rows are grouped by a client-id column (e.g. one client per speaker). The table is
held in Arrow memory (columnar and compact) and sorted once by client, so each
client's dataset is a zero-copy slice. For tables larger than memory, convert them
into an on-disk store (`store.write`) piece by piece.

Numeric columns become numpy arrays (float64 -> float32 and int64 -> int32 unless
`dtypes` says otherwise); text columns stay Python `str` values (see `StringSpec`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib
from fedlang.simulation import specs

_DOWNCAST = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}


def _column_to_numpy(column: pa.ChunkedArray | pa.Array, dtype: Any) -> np.ndarray:
    if pa.types.is_string(column.type) or pa.types.is_large_string(column.type) or pa.types.is_binary(
        column.type
    ) or pa.types.is_large_binary(column.type):
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
    array = np.asarray(column.to_numpy(zero_copy_only=False))
    target = np.dtype(dtype) if dtype is not None else _DOWNCAST.get(array.dtype, array.dtype)
    return array.astype(target, copy=False)


def from_arrow_table(table: pa.Table, client_id_column: str, columns: Sequence[str] | None = None,
                     dtypes: Mapping[str, Any] | None = None) -> client_data_lib.ClientData:
    """Groups the rows of an Arrow table into clients by `client_id_column`.

    Args:
      table: the table.
      client_id_column: the column whose values (converted to str) are client ids.
      columns: the columns forming each element (default: all others), in order.
      dtypes: column -> numpy dtype overrides.

    Returns:
      A `ClientData` with sorted client ids; elements are dicts column -> value.

    Raises:
      ValueError: if a named column is missing; the message lists the columns.
    """
    names = list(table.column_names)
    wanted = [c for c in names if c != client_id_column] if columns is None else list(columns)
    for c in [client_id_column, *wanted]:
        if c not in names:
            raise ValueError(f"Expected a column {c!r}, found columns {names}. Pass one of them.")
    ids = np.asarray(table.column(client_id_column).to_numpy(zero_copy_only=False)).astype(str)
    unique, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse, minlength=len(unique))
    offsets = np.concatenate(([0], np.cumsum(counts)))
    dtypes = dict(dtypes or {})
    sorted_table = table.select(wanted).take(pa.array(order))
    arrays = {c: _column_to_numpy(sorted_table.column(c), dtypes.get(c)) for c in wanted}
    client_ids = [str(u) for u in unique]
    position = {cid: i for i, cid in enumerate(client_ids)}
    structure = {c: (specs.StringSpec(()) if a.dtype == object else specs.to_structure((a.dtype, [])))
                 for c, a in arrays.items()}

    def dataset_fn(client_id: str) -> dataset_lib.Dataset:
        i = position[client_id]
        lo, hi = int(offsets[i]), int(offsets[i + 1])
        return dataset_lib.Dataset.from_slices_fn(lambda: {c: a[lo:hi] for c, a in arrays.items()},
                                                  structure, cardinality=hi - lo)

    return client_data_lib.ClientData(client_ids, dataset_fn, element_spec=structure,
                                      num_examples={c: int(counts[i]) for i, c in enumerate(client_ids)})


def from_csv(path: str | os.PathLike, client_id_column: str, columns: Sequence[str] | None = None,
             dtypes: Mapping[str, Any] | None = None, delimiter: str = ",") -> client_data_lib.ClientData:
    """Reads a CSV file (with a header row) into a `ClientData`, one client per key.

    Args:
      path: the CSV file.
      client_id_column: the column holding client ids.
      columns: the columns forming each element (default: all others).
      dtypes: column -> numpy dtype overrides.
      delimiter: the field separator.

    Returns:
      A `ClientData` (see `from_arrow_table`).

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if the file cannot be parsed or lacks a named column.
    """
    from pyarrow import csv

    if not os.path.isfile(path):
        raise FileNotFoundError(f"Expected a CSV file at {path}, found none. Check the path.")
    try:
        table = csv.read_csv(path, parse_options=csv.ParseOptions(delimiter=delimiter),
                             convert_options=csv.ConvertOptions(column_types={client_id_column: pa.string()}))
    except pa.ArrowInvalid as e:
        raise ValueError(f"Expected a CSV file with a header row at {path}, found unparsable data: {e}") from e
    return from_arrow_table(table, client_id_column, columns, dtypes)


def from_pandas(df: Any, client_id_column: str, columns: Sequence[str] | None = None,
                dtypes: Mapping[str, Any] | None = None) -> client_data_lib.ClientData:
    """Groups a pandas DataFrame into a `ClientData`, one client per key.

    pandas is imported only by the caller; fedlang does not depend on it.

    Raises:
      TypeError: if `df` is not a DataFrame.
      ValueError: if a named column is missing; the message lists the columns.
    """
    if not hasattr(df, "columns") or not hasattr(df, "iloc"):
        raise TypeError(f"Expected a pandas DataFrame, found {type(df).__name__}.")
    if client_id_column not in df.columns:
        raise ValueError(f"Expected a column {client_id_column!r}, found columns {list(df.columns)}. Pass one of them.")
    return from_arrow_table(pa.Table.from_pandas(df, preserve_index=False), client_id_column, columns, dtypes)
