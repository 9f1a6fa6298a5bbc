"""Readers for tables: CSV files and pandas DataFrames, one client per key value.

Rows are grouped by a client-id column (e.g. one client per speaker). The table is
held in Arrow memory (columnar and compact) and sorted once by client, so each
client's dataset is a zero-copy slice. For tables larger than memory, convert them
into an on-disk store (`store.write`) piece by piece.

Numeric columns become numpy arrays (float64 -> float32 and int64 -> int32 unless
`dtypes` says otherwise); text columns stay Python `str` values (see `StringSpec`).
"""

from __future__ import annotations

import codecs
import os
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pyarrow as pa

from fedlang.simulation import _cast, specs
from fedlang.simulation import client_data as client_data_lib
from fedlang.simulation import dataset as dataset_lib

_DOWNCAST = {np.dtype(np.float64): np.dtype(np.float32), np.dtype(np.int64): np.dtype(np.int32)}
_MISSING = ("error", "nan")
_TEXT = (str, bytes, object)


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_binary(t) or pa.types.is_large_binary(t)


def _first(mask: pa.ChunkedArray | pa.Array) -> int:
    return int(np.flatnonzero(np.asarray(mask.to_numpy(zero_copy_only=False)))[0])


def _column_to_numpy(column: pa.ChunkedArray | pa.Array, name: str, dtype: Any, missing: str,
                     where: Callable[[int], str]) -> np.ndarray:
    """One column as numpy, refusing blanks and values that the cast would change."""
    wanted = None if dtype is None or dtype in _TEXT else np.dtype(dtype)
    text = _is_text(column.type)
    if column.null_count:
        if missing == "nan" and not text and (wanted is None or wanted.kind == "f"):
            pass  # read as NaN, as asked
        else:
            if missing == "error":
                fix = "Fill it in or drop the row, or pass missing='nan' to read blanks of number columns as NaN."
            else:
                fix = ("Text has no NaN: fill it in or drop the row." if text else
                       f"{wanted} has no NaN: request a float dtype for {name!r}, or fill in the blanks.")
            raise ValueError(f"Expected a value in every row of column {name!r}, found a blank at "
                             f"{where(_first(column.is_null()))}. {fix}")
    if text:
        if wanted is not None:
            raise ValueError(f"Expected numbers in column {name!r} for dtype {wanted}, found text. Drop the "
                             f"dtype for {name!r} or convert the text first.")
        if dtype is bytes and not pa.types.is_binary(column.type) and not pa.types.is_large_binary(column.type):
            column = column.cast(pa.large_binary())
        return np.asarray(column.to_numpy(zero_copy_only=False), dtype=object)
    if pa.types.is_null(column.type):  # every cell blank (allowed by missing='nan')
        return np.full(len(column), np.nan, wanted or np.float32)
    array = np.asarray(column.to_numpy(zero_copy_only=False))
    target = wanted if wanted is not None else _DOWNCAST.get(array.dtype, array.dtype)
    try:
        return _cast.checked(array, target)
    except _cast.CastError as e:
        wider = "np.int64" if target.kind in "iu" else "np.float64"
        raise ValueError(f"Expected values of column {name!r} that fit {target}, found {e.value!r} at "
                         f"{where(e.row)}, which {e.reason}. Pass dtypes={{{name!r}: {wider}}} (or the dtype "
                         "it needs) to keep it.") from e


def _client_ids(column: pa.ChunkedArray | pa.Array, name: str, where: Callable[[int], str]) -> np.ndarray:
    ids = np.asarray(column.to_numpy(zero_copy_only=False)).astype(str)
    blank = np.asarray(column.is_null().to_numpy(zero_copy_only=False)) | (ids == "")
    if blank.any():
        raise ValueError(f"Expected a client id in every row of column {name!r}, found a blank at "
                         f"{where(int(np.flatnonzero(blank)[0]))}. Fill it in or drop the row.")
    return ids


def _check_missing(missing: str) -> None:
    if missing not in _MISSING:
        raise ValueError(f"Expected missing='error' or missing='nan', found missing={missing!r}.")


def from_arrow_table(table: pa.Table, client_id_column: str, columns: Sequence[str] | None = None,
                     dtypes: Mapping[str, Any] | None = None, missing: str = "error") -> client_data_lib.ClientData:
    """Groups the rows of an Arrow table into clients by `client_id_column`.

    Args:
      table: the table.
      client_id_column: the column whose values (converted to str) are client ids.
      columns: the columns forming each element (default: all others), in order.
      dtypes: column -> numpy dtype overrides (`bytes` keeps a text column as raw bytes).
      missing: 'error' (default) refuses blank (null) cells, naming the row; 'nan'
        reads blanks of number columns as NaN, which makes an integer column float32.

    Returns:
      A `ClientData` with sorted client ids; elements are dicts column -> value.

    Raises:
      ValueError: if a named column is missing (the message lists the columns), names
        repeat, a cell is blank, or a value does not fit its dtype (numbers are never
        wrapped, truncated or overflowed to inf); the message names the row.
    """
    return _from_table(table, client_id_column, columns, dtypes, missing, "the table", lambda i: f"row {i} of the table")


def _from_table(table: pa.Table, client_id_column: str, columns: Sequence[str] | None,
                dtypes: Mapping[str, Any] | None, missing: str, source: str,
                where: Callable[[int], str]) -> client_data_lib.ClientData:
    _check_missing(missing)
    names = list(table.column_names)
    repeated = sorted({c for c in names if names.count(c) > 1})
    if repeated:
        raise ValueError(f"Expected distinct column names in {source}, found {repeated} more than once. "
                         "Rename the repeated columns.")
    wanted = [c for c in names if c != client_id_column] if columns is None else list(columns)
    for c in [client_id_column, *wanted]:
        if c not in names:
            raise ValueError(f"Expected a column {c!r}, found columns {names}. Pass one of them.")
    dtypes = dict(dtypes or {})
    ids = _client_ids(table.column(client_id_column), client_id_column, where)
    converted = {c: _column_to_numpy(table.column(c), c, dtypes.get(c), missing, where) for c in wanted}
    unique, inverse = np.unique(ids, return_inverse=True)
    order = np.argsort(inverse, kind="stable")
    counts = np.bincount(inverse, minlength=len(unique))
    offsets = np.concatenate(([0], np.cumsum(counts)))
    arrays = {c: a[order] for c, a in converted.items()}
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


# The first bytes of files that are sometimes given where a CSV file belongs: what
# the file is, and the fix where it is not "pass a CSV file".
_CSV_FIX = "Pass a CSV file: text with a header row."
_SIGNATURES = (
    (b"PK\x03\x04", "a zip archive (an .npz?)", _CSV_FIX),
    (b"\x93NUMPY", "a NumPy .npy array", _CSV_FIX),
    (b"SQLite format 3\x00", "an SQLite database", _CSV_FIX),
    (b"PAR1", "a Parquet file", _CSV_FIX),
    (b"\x89HDF", "an HDF5 file", _CSV_FIX),
    (b"\x1f\x8b", "gzip-compressed data", "Decompress it first."),
    (b"\xff\xfe", "UTF-16 text", "Pass encoding='utf-16'."),
    (b"\xfe\xff", "UTF-16 text", "Pass encoding='utf-16'."),
)
_SNIFF_BYTES = 8192
# Control bytes that text has (tab, line feed, form feed, carriage return, ...).
_TEXT_CONTROLS = frozenset(b"\t\n\x0b\x0c\r\x1b")


def check_csv_file(path: str | os.PathLike, encoding: str = "utf-8", delimiter: str = ",") -> None:
    """Checks that `path` is a file that looks like text, from its first 8 KiB.

    A CSV parser reads any bytes as rows: given an `.npz` or an image, it reports a
    column count with the file's bytes in its message. This says what the file is
    instead.

    Raises:
      FileNotFoundError: if there is no file at `path`.
      ValueError: if the file starts like another format (a zip archive, a NumPy
        array, an SQLite database, ...) or holds binary data (a NUL byte, or more than
        one control byte in 10 other than tab, line ends and `delimiter`), or
        `encoding` is unknown; the message names the path.
    """
    if not os.path.isfile(path):
        raise FileNotFoundError(f"Expected a CSV file at {path}, found none. Check the path.")
    try:
        codec = codecs.lookup(encoding).name
    except LookupError as e:
        raise ValueError(f"Expected an encoding Python knows, found encoding={encoding!r}.") from e
    with open(path, "rb") as f:
        head = f.read(_SNIFF_BYTES)
    wide = codec.startswith(("utf-16", "utf-32"))  # their text has NUL bytes
    for magic, what, fix in _SIGNATURES:
        if head.startswith(magic) and not (wide and what == "UTF-16 text"):
            raise ValueError(f"Expected a CSV file at {path}, found {what}. {fix}")
    # A stray control character in a cell is a parse matter (its error escapes it);
    # NUL bytes, or many control bytes, mean the file is not text.
    allowed = _TEXT_CONTROLS | set(delimiter.encode(codec, "replace"))
    controls = sum(1 for b in head if b < 0x20 and b not in allowed)
    if not wide and (b"\x00" in head or controls * 10 > len(head)):
        raise ValueError(f"Expected a CSV file at {path}, found binary data. {_CSV_FIX}")


def column_names(path: str | os.PathLike, delimiter: str = ",", encoding: str = "utf-8") -> list[str]:
    """The header of the CSV file at `path` (read as a stream: no column is converted).

    Raises:
      FileNotFoundError: if there is no file at `path`.
      ValueError: if it is not a CSV file (see `check_csv_file`) or its header cannot
        be parsed; the message names the path.
    """
    from pyarrow import csv

    check_csv_file(path, encoding, delimiter)
    try:
        reader = csv.open_csv(path, read_options=csv.ReadOptions(encoding=encoding),
                              parse_options=csv.ParseOptions(delimiter=delimiter))
    except pa.ArrowInvalid as e:
        raise _unparsable(path, e) from e
    return list(reader.schema.names)


def _unparsable(path: str | os.PathLike, e: Exception) -> ValueError:
    # pyarrow quotes the offending row: escape its control characters for a terminal.
    text = "".join(c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in str(e))
    return ValueError(f"Expected a CSV file with a header row at {path}, found unparsable data: {text}")


def from_csv(path: str | os.PathLike, client_id_column: str, columns: Sequence[str] | None = None,
             dtypes: Mapping[str, Any] | None = None, delimiter: str = ",", missing: str = "error",
             encoding: str = "utf-8") -> client_data_lib.ClientData:
    """Reads a CSV file (with a header row) into a `ClientData`, one client per key.

    Args:
      path: the CSV file.
      client_id_column: the column holding client ids.
      columns: the columns forming each element (default: all others).
      dtypes: column -> numpy dtype overrides (`bytes` keeps a text column as raw bytes).
      delimiter: the field separator.
      missing: 'error' (default) refuses blank cells, naming the line; 'nan' reads
        blanks of number columns as NaN (an integer column then becomes float32).
      encoding: the file's text encoding, e.g. 'latin-1'.

    Returns:
      A `ClientData` (see `from_arrow_table`).

    Raises:
      FileNotFoundError: if the file does not exist.
      ValueError: if the file is not text (another format or binary data, told from
        its first bytes by `check_csv_file`; the bytes are never quoted), cannot be
        parsed (pyarrow's reason, control characters escaped), lacks a named column,
        repeats a column name, has a blank cell, text that is not in `encoding`, or a
        value that does not fit its dtype; the message names the line.
    """
    from pyarrow import csv

    _check_missing(missing)
    check_csv_file(path, encoding, delimiter)
    try:
        table = csv.read_csv(path, read_options=csv.ReadOptions(encoding=encoding),
                             parse_options=csv.ParseOptions(delimiter=delimiter),
                             convert_options=csv.ConvertOptions(column_types={client_id_column: pa.string()}))
    except pa.ArrowInvalid as e:
        raise _unparsable(path, e) from e

    def where(i: int) -> str:
        return f"line {i + 2} of {path}"

    for name, column in zip(table.column_names, table.columns):
        if pa.types.is_binary(column.type) and (dtypes or {}).get(name) is not bytes:
            # pyarrow reads a column with any cell that is not UTF-8 as bytes.
            row = next(i for i, v in enumerate(column.to_pylist()) if v is not None and not _utf8(v))
            raise ValueError(f"Expected UTF-8 text in column {name!r}, found bytes that are not at {where(row)}. "
                             f"Pass encoding='latin-1' (or the file's encoding) to from_csv, or dtypes={{{name!r}: "
                             "bytes}} to keep raw bytes.")
    return _from_table(table, client_id_column, columns, dtypes, missing, str(path), where)


def _utf8(value: bytes) -> bool:
    try:
        value.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def from_pandas(df: Any, client_id_column: str, columns: Sequence[str] | None = None,
                dtypes: Mapping[str, Any] | None = None, missing: str = "error") -> client_data_lib.ClientData:
    """Groups a pandas DataFrame into a `ClientData`, one client per key.

    pandas is imported only by the caller; fedlang does not depend on it. Missing
    values (None, NaN) are blanks: see `missing` in `from_arrow_table`.

    Raises:
      TypeError: if `df` is not a DataFrame.
      ValueError: if a named column is missing (the message lists the columns), a
        cell is blank, or a value does not fit its dtype; the message names the row.
    """
    if not hasattr(df, "columns") or not hasattr(df, "iloc"):
        raise TypeError(f"Expected a pandas DataFrame, found {type(df).__name__}.")
    if client_id_column not in df.columns:
        raise ValueError(f"Expected a column {client_id_column!r}, found columns {list(df.columns)}. Pass one of them.")
    return _from_table(pa.Table.from_pandas(df, preserve_index=False), client_id_column, columns, dtypes, missing,
                       "the DataFrame", lambda i: f"row {i} of the DataFrame")
