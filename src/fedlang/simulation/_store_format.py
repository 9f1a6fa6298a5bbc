"""The on-disk store's format: its index, its Arrow schema and its checksums.

Everything here is about trusting nothing that is read back. `parse_index` turns the
bytes of `index.json` into an `Index` only if they describe a store the reader can
use safely: known version, a structure of supported leaves whose column names match,
record-batch offsets that increase from 0 to `num_rows`, and client row ranges that
tile `[0, num_rows)` exactly (no overlap, no gap, nothing out of range).

Version 2 stores carry, for each client, a CRC-32 (`zlib.crc32`, chained) of the
client id and of the bytes of its rows: for numeric fields the values, for string
fields the value lengths and the UTF-8 or binary bytes. The checksum is computed
over the Arrow record-batch slices that hold the client's rows, in order, by the
same `checksum` function at write and at read, so it depends only on the rows and
on where record batches end (which the index records). The element structure is
also written into the Arrow schema's metadata, so a changed dtype or shape in the
index is caught against the data file. Version 1 stores (written before checksums)
have neither; they are read with Arrow validation but without checksums.

CRC-32 detects damage (flipped bits, overwritten or shifted bytes); it is not a
signature: whoever can write the files can write matching checksums.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import keyword
import math
import zlib
from collections.abc import Mapping
from typing import Any, NoReturn

import numpy as np
import pyarrow as pa

from fedlang.core import types
from fedlang.simulation import _tree, specs

FORMAT = "fedlang.client_store"
VERSION = 2
VERSIONS = (1, 2)
CHECKSUM = "crc32"
STRUCTURE_KEY = b"fedlang.structure"
DATA_FILE = "data.arrow"  # the rows (Arrow IPC)
INDEX_FILE = "index.json"  # the index
# What a leaf of the index may say (and what the writer can store).
_DTYPES = frozenset(["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64",
                     "float16", "float32", "float64"])
_MAX_ROW_VALUES = 1 << 31  # Arrow's FixedSizeList size is an int32


class InvalidIndexError(ValueError):
    """What is wrong with an index; `store` turns it into a `StoreError` naming the file."""


@dataclasses.dataclass(frozen=True)
class Index:
    """A validated `index.json`.

    Attributes:
      version: 1 (no checksums) or 2.
      structure: the element structure (containers of `TensorType`/`StringSpec`).
      structure_json: the structure as stored (compared with the Arrow schema's copy).
      string_kinds: column -> 'str' or 'bytes' for string fields.
      num_rows: the number of rows of the data file.
      batch_offsets: the first row of each record batch, then `num_rows`.
      clients: client id -> [row offset, row count] and, from version 2, the crc32.
    """

    version: int
    structure: Any
    structure_json: Any
    string_kinds: dict[str, str]
    num_rows: int
    batch_offsets: list[int]
    clients: dict[str, list[int]]


# -- structure <-> JSON -----------------------------------------------------------


def columns_of(structure: Any) -> list[str]:
    """The Arrow column name of each leaf, in `_tree.flatten` order."""
    return [p or "value" for p in _tree.paths(structure)]


def structure_to_json(node: Any, strings: Mapping[str, str], path: str = "") -> Any:
    """The JSON form of a structure; `strings` gives each string column's kind."""
    if isinstance(node, Mapping):
        return {"dict": [[k, structure_to_json(v, strings, f"{path}/{k}" if path else k)] for k, v in node.items()]}
    if isinstance(node, list | tuple):
        children = [structure_to_json(v, strings, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node)]
        if hasattr(node, "_fields"):
            return {"namedtuple": type(node).__name__, "fields": list(node._fields), "items": children}
        return {"list" if isinstance(node, list) else "tuple": children}
    column = path or "value"
    shape = list(node.shape)
    if isinstance(node, specs.StringSpec):
        return {"column": column, "string": strings.get(column, "str"), "shape": shape}
    return {"column": column, "dtype": node.dtype.name, "shape": shape}


def _is_int(x: Any) -> bool:
    return type(x) is int  # not bool, not float


def _name(x: Any, what: str) -> str:
    if not isinstance(x, str) or not x.isidentifier() or keyword.iskeyword(x):
        raise InvalidIndexError(f"Expected a Python identifier as {what}, found {x!r}.")
    return x


def _structure_from_json(node: Any, strings: dict[str, str], path: str = "") -> Any:
    """The structure a JSON node describes; raises `InvalidIndexError` for any malformed node."""

    def child(key: str, value: Any) -> Any:
        return _structure_from_json(value, strings, f"{path}/{key}" if path else key)

    if not isinstance(node, dict):
        raise InvalidIndexError(f"Expected a structure node (a JSON object), found {type(node).__name__}.")
    if "dict" in node:
        items = node["dict"]
        if not isinstance(items, list) or not all(isinstance(i, list) and len(i) == 2 and isinstance(i[0], str)
                                                  for i in items):
            raise InvalidIndexError("Expected [key, node] pairs in a 'dict' structure node.")
        if len({k for k, _ in items}) != len(items):
            raise InvalidIndexError("Expected distinct keys in a 'dict' structure node, found a repeated one.")
        return {k: child(k, v) for k, v in items}
    if "namedtuple" in node:
        name, fields, items = node.get("namedtuple"), node.get("fields"), node.get("items")
        if not isinstance(fields, list) or not isinstance(items, list) or len(fields) != len(items):
            raise InvalidIndexError("Expected as many 'fields' as 'items' in a 'namedtuple' structure node.")
        fields = [_name(f, "a namedtuple field") for f in fields]
        if len(set(fields)) != len(fields) or any(f.startswith("_") for f in fields):
            raise InvalidIndexError(f"Expected distinct namedtuple fields not starting with '_', found {fields}.")
        cls = collections.namedtuple(_name(name, "a namedtuple name"), fields)  # type: ignore[misc]
        return cls(*(child(str(i), v) for i, v in enumerate(items)))
    for kind, container in (("list", list), ("tuple", tuple)):
        if kind in node:
            if not isinstance(node[kind], list):
                raise InvalidIndexError(f"Expected a list in a {kind!r} structure node.")
            return container(child(str(i), v) for i, v in enumerate(node[kind]))
    shape = node.get("shape")
    if (not isinstance(shape, list) or not all(_is_int(d) and d >= 0 for d in shape)
            or math.prod(shape) >= _MAX_ROW_VALUES):
        raise InvalidIndexError(f"Expected a shape of non-negative integers with fewer than 2**31 values, found "
                                f"{str(shape)[:60]}.")
    if node.get("column") != (path or "value"):
        raise InvalidIndexError(f"Expected column {path or 'value'!r} for the leaf at that path, found "
                                f"{node.get('column')!r}.")
    if "string" in node:
        if node["string"] not in ("str", "bytes") or shape:
            raise InvalidIndexError(f"Expected a scalar 'str' or 'bytes' string leaf, found {node!r:.80}.")
        strings[node["column"]] = node["string"]
        return specs.StringSpec(())
    if node.get("dtype") not in _DTYPES:
        raise InvalidIndexError(f"Expected a boolean, integer or float dtype, found {str(node.get('dtype'))[:40]!r}.")
    return types.TensorType(np.dtype(node["dtype"]), shape)


# -- the index ----------------------------------------------------------------------


def parse_index(raw: bytes) -> Index:
    """Validates the bytes of `index.json`.

    Raises:
      InvalidIndexError: naming what is wrong; the caller adds the file name.
    """
    try:
        index = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as e:
        raise InvalidIndexError(f"Expected UTF-8 text, found invalid bytes at offset {e.start}") from e
    except json.JSONDecodeError as e:
        raise InvalidIndexError(f"Expected JSON, found invalid JSON ({e})") from e
    except RecursionError as e:
        raise InvalidIndexError("Expected JSON of reasonable depth, found deeper nesting than Python can parse") from e
    if not isinstance(index, dict):
        raise InvalidIndexError(f"Expected a JSON object, found {type(index).__name__}")
    missing = [k for k in ("format", "version", "num_rows", "structure", "batch_offsets", "clients")
               if k not in index]
    if missing:
        raise InvalidIndexError(f"Expected the keys format, version, num_rows, structure, batch_offsets and "
                          f"clients, found {missing} missing")
    if index["format"] != FORMAT:
        raise InvalidIndexError(f"Expected format {FORMAT!r}, found {index['format']!r}")
    version = index["version"]
    if not _is_int(version) or version not in VERSIONS:
        raise InvalidIndexError(f"Expected store version {' or '.join(map(str, VERSIONS))}, found {version!r}")
    if version >= 2 and index.get("checksum") != CHECKSUM:
        raise InvalidIndexError(f"Expected checksum {CHECKSUM!r}, found {index.get('checksum')!r}")
    strings: dict[str, str] = {}
    try:
        structure = _structure_from_json(index["structure"], strings)
    except RecursionError as e:
        raise InvalidIndexError("Expected a structure of reasonable depth, found deeper nesting") from e
    except (KeyError, TypeError, AttributeError) as e:
        raise InvalidIndexError(f"Expected a valid element structure, found a malformed one ({e!r})") from e
    columns = columns_of(structure)
    if len(set(columns)) != len(columns):
        raise InvalidIndexError(f"Expected distinct column names, found {columns}")
    num_rows = index["num_rows"]
    if not _is_int(num_rows) or num_rows < 0:
        raise InvalidIndexError(f"Expected a non-negative integer num_rows, found {num_rows!r}")
    offsets = index["batch_offsets"]
    if (not isinstance(offsets, list) or not offsets or not all(_is_int(o) for o in offsets)
            or offsets[0] != 0 or offsets[-1] != num_rows
            or any(a >= b for a, b in itertools.pairwise(offsets))):
        raise InvalidIndexError(f"Expected batch_offsets increasing from 0 to num_rows ({num_rows}), "
                          f"found {str(offsets)[:80]}")
    clients = _parse_clients(index["clients"], version, num_rows)
    return Index(version, structure, index["structure"], strings, num_rows, offsets, clients)


def _bad_entry(clients: dict[str, Any], width: int) -> NoReturn:
    """Raises for the first client entry that is not `width` non-negative int64s (the crc < 2**32)."""
    what = "[row offset, row count, crc32]" if width == 3 else "[row offset, row count]"
    for cid, entry in clients.items():
        if (not isinstance(entry, list) or len(entry) != width or not all(_is_int(v) and 0 <= v < 1 << 63 for v in entry)
                or (width == 3 and entry[2] >= 1 << 32)):
            raise InvalidIndexError(f"Expected {what} of non-negative integers for client {cid!r}, "
                                    f"found {str(entry)[:60]}")
    raise InvalidIndexError(f"Expected {what} of non-negative integers for each client, found others")


def _parse_clients(clients: Any, version: int, num_rows: int) -> dict[str, list[int]]:
    if not isinstance(clients, dict):
        raise InvalidIndexError(f"Expected clients as an object id -> range, found {type(clients).__name__}")
    width = 3 if version >= 2 else 2
    # Vectorized where it can be: an index of a million clients validates in about 0.3 s.
    entries = list(clients.values())
    if not all(type(e) is list and len(e) == width and all(type(v) is int for v in e) for e in entries):
        _bad_entry(clients, width)
    try:
        table = np.fromiter(itertools.chain.from_iterable(entries), np.int64, width * len(entries))
    except OverflowError:
        _bad_entry(clients, width)
    table = table.reshape(len(entries), width)
    if (table < 0).any() or (width == 3 and (table[:, 2] >= 1 << 32).any()):
        _bad_entry(clients, width)
    offsets, counts = table[:, 0], table[:, 1]
    # The rows of the clients with rows tile [0, num_rows) exactly, in some order.
    rows = counts > 0
    starts, sizes = offsets[rows], counts[rows]
    order = np.lexsort((sizes, starts))
    starts, sizes = starts[order], sizes[order]
    ends = np.concatenate(([0], np.cumsum(sizes)))
    wrong = np.flatnonzero(starts != ends[:-1])
    if wrong.size:
        at, expected = int(starts[wrong[0]]), int(ends[wrong[0]])
        kind = "overlap" if at < expected else "a gap"
        raise InvalidIndexError(f"Expected client row ranges that tile [0, {num_rows}), found {kind} at row "
                                f"{min(at, expected)}")
    if int(ends[-1]) != num_rows:
        raise InvalidIndexError(f"Expected client row ranges that cover {num_rows} rows, found {int(ends[-1])}")
    beyond = np.flatnonzero(offsets > num_rows)
    if beyond.size:
        raise InvalidIndexError(f"Expected row offsets within [0, {num_rows}], found client "
                                f"{list(clients)[int(beyond[0])]!r} beyond")
    return clients


# -- the Arrow schema ---------------------------------------------------------------


def arrow_type(leaf: Any, string_kind: str | None) -> pa.DataType:
    """The Arrow type of a column holding `leaf` (a `TensorType` or scalar `StringSpec`)."""
    if isinstance(leaf, specs.StringSpec):
        return pa.large_binary() if string_kind == "bytes" else pa.large_string()
    value = pa.from_numpy_dtype(leaf.dtype)
    return pa.list_(value, math.prod(leaf.shape)) if leaf.shape else value


def schema(structure: Any, structure_json: Any, strings: Mapping[str, str]) -> pa.Schema:
    """The schema of a store's data file, with the structure in its metadata."""
    fields = [pa.field(c, arrow_type(leaf, strings.get(c)))
              for c, leaf in zip(columns_of(structure), _tree.flatten(structure))]
    return pa.schema(fields, metadata={STRUCTURE_KEY: json.dumps(structure_json).encode()})


def check_schema(found: pa.Schema, index: Index) -> None:
    """Raises `InvalidIndexError` if the data file's schema does not match the index."""
    expected = schema(index.structure, index.structure_json, index.string_kinds)
    pairs = list(zip(expected, found))
    if len(expected) != len(found) or any(e.name != f.name or not e.type.equals(f.type) for e, f in pairs):
        shown = [f"{f.name}: {f.type}" for f in found][:6]
        raise InvalidIndexError(f"Expected columns {[f'{e.name}: {e.type}' for e in expected][:6]} as the index "
                          f"describes, found {shown}")
    if index.version >= 2:
        stored = (found.metadata or {}).get(STRUCTURE_KEY)
        try:
            same = stored is not None and json.loads(stored) == index.structure_json
        except (ValueError, RecursionError):
            same = False
        if not same:
            raise InvalidIndexError("Expected the element structure of the index (dtypes, shapes, containers) in "
                              "the data file's schema, found a different one")


# -- checksums ----------------------------------------------------------------------


def client_seed(client_id: str) -> int:
    """The checksum of a client with no rows; rows are chained onto it."""
    return zlib.crc32(client_id.encode("utf-8", "surrogatepass"))


def checksum(piece: pa.RecordBatch, leaves: list[Any], crc: int) -> int:
    """Chains the bytes of the rows of `piece` (a record-batch slice) onto `crc`.

    `piece` must have been validated (`validate(full=True)`) when it was read back.
    """
    for column, leaf in zip(piece.columns, leaves):
        if not len(column):
            continue
        if isinstance(leaf, specs.StringSpec):
            _, offsets_buffer, data = column.buffers()
            offsets = np.frombuffer(offsets_buffer, "<i8")[column.offset : column.offset + len(column) + 1]
            crc = zlib.crc32(np.diff(offsets).data, crc)
            crc = zlib.crc32(memoryview(data)[int(offsets[0]) : int(offsets[-1])], crc)
            continue
        values = column.flatten() if leaf.shape else column
        crc = zlib.crc32(np.ascontiguousarray(values.to_numpy(zero_copy_only=False)).data, crc)
    return crc
