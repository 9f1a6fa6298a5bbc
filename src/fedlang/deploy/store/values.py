"""Values of any size in the task store, kept in chunks (issue 40).

SQLite keeps at most 10^9 bytes in one cell and PostgreSQL's bytea 1 GB, and reading a
cell means holding it whole: a model of a few hundred MB (its float64 aggregate twice
that) fits neither. A value here is one row of `value_heads` (its id, size, chunk size,
SHA-256, and `staged` while it is being written) and its bytes cut into rows of
`value_chunks (value, idx, data)`: `chunk` bytes each (`CHUNK`), the last one shorter; an
empty value has none, and a small one is one row, so a small model costs what it did.
A row that owns a value (a blob, a round's aggregate) names it by id; every write makes
a new id, so a reader never mixes the chunks of two values.

Writing: `write(tx, parts)` writes a value in the caller's transaction, which commits
it with the row that names it: a server killed at any moment has written both or
neither. A value that arrives over time (an upload) is `Staging`: each full chunk is
written in its own short transaction (a long one would hold SQLite's write lock for
the whole upload), under a head marked staged that no row names, then `Staging.finish`
writes the last chunk and the head in the caller's transaction, with the row that names
it. Until then nothing of it is visible; `Staging.discard` deletes it, and
`sweep_staged` what a killed process left.

Reading: `read(tx, value)` reads a value whole (small callers: a plan, a test);
`chunks(store, value, start, stop)` yields a byte range a chunk at a time, each read by a
transaction of its own: a reader holds one chunk, never the value, and holds no
transaction between chunks.

What a read checks: each chunk's length, against the head (`chunk` bytes, the last one
what is left of `size`): a chunk missing, cut or out of place is an error, never bytes
passed on. A read of the whole value also checks the SHA-256 its head recorded when it was
written, before it gives out the last chunk, so a damaged value is never handed out
whole (a blob's recorded SHA-256 is its name). A read of a part (a download resumed with
`Range`) checks lengths only: its reader checks the whole once it has it.

Chunk size: 1 MiB, the least memory per transfer at no cost in speed. Measured writing
(a chunk per transaction, as an upload) and reading (a chunk per query, as a download) a
1 GiB value, best of 3 runs on a 2-core machine: SQLite wrote 292, 284 and 266 MiB/s
and read 1953, 2180 and 1839 MiB/s with 1, 4 and 16 MiB chunks; PostgreSQL wrote 176,
162 and 151 MiB/s and read 642, 540 and 387 MiB/s (its reads in binary form: as hex
text, 100 to 170 MiB/s whatever the size). The disk bounds writes and a query costs
little next to its bytes, so 1 and 4 MiB are equal within the noise (16 MiB reads
slower on PostgreSQL); what differs is what each download and upload under way holds,
about one chunk: 1 MiB, for 1,024 rows a GiB.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import secrets
import typing
from collections.abc import Iterable, Iterator
from typing import Any, Protocol

from fedlang.deploy.store import sql

CHUNK = 1 << 20

HEADS = (
    "CREATE TABLE IF NOT EXISTS value_heads (id TEXT PRIMARY KEY, size {int} NOT NULL,"
    " chunk {int} NOT NULL, sha256 TEXT NOT NULL, staged {real})"
)
CHUNKS = (
    "CREATE TABLE IF NOT EXISTS value_chunks (value TEXT NOT NULL, idx {int} NOT NULL,"
    " data {blob} NOT NULL, PRIMARY KEY (value, idx))"
)


class Transactions(Protocol):
    """Where values are read and written from outside a caller's transaction: the
    store (`engine.Engine.transaction`) and its clock."""

    def transaction(self, write: bool = False) -> contextlib.AbstractContextManager[sql.Tx]: ...

    def clock(self) -> float: ...


class DamagedValue(ValueError):
    """A stored value whose chunks disagree with its head (a length, or the SHA-256 of
    the whole): the database was changed outside fedlang, or damaged."""


class Swept(LookupError):
    """A staged value whose chunks were swept (`sweep_staged`): nothing was written to
    it for longer than the sweep allows."""


@dataclasses.dataclass(frozen=True)
class Value:
    """A stored value's head: its id, size in bytes, chunk size and SHA-256 (hex)."""

    id: str
    size: int
    chunk: int
    sha256: str

    @property
    def chunks(self) -> int:
        return -(-self.size // self.chunk)

    def length(self, idx: int) -> int:
        """How many bytes chunk `idx` holds."""
        return min(self.chunk, self.size - idx * self.chunk)


def _new_id() -> str:
    return secrets.token_hex(16)


def _cut(parts: Iterable[bytes], chunk: int) -> Iterator[bytes | memoryview]:
    """`parts` (of any sizes) as pieces of `chunk` bytes, the last one shorter; a part
    of several chunks is cut without copying it."""
    buffer = bytearray()
    for part in parts:
        view = memoryview(part)
        if buffer:
            take = min(len(view), chunk - len(buffer))
            buffer += view[:take]
            view = view[take:]
            if len(buffer) < chunk:
                continue
            yield bytes(buffer)
            buffer.clear()
        while len(view) >= chunk:
            yield view[:chunk]
            view = view[chunk:]
        buffer += view
    if buffer:
        yield bytes(buffer)


def _put_chunk(tx: sql.Tx, value_id: str, idx: int, data: bytes | memoryview) -> None:
    tx.run("INSERT INTO value_chunks (value, idx, data) VALUES (?, ?, ?)", (value_id, idx, data))


def write(tx: sql.Tx, parts: Iterable[bytes], chunk: int = CHUNK) -> Value:
    """Writes a new value of the bytes of `parts` (of any sizes) in `tx`; its head. If
    `parts` raises (it may be a generator making the value), nothing of it is left."""
    value_id, digest, size = _new_id(), hashlib.sha256(), 0
    try:
        for idx, piece in enumerate(_cut(parts, chunk)):
            digest.update(piece)
            size += len(piece)
            _put_chunk(tx, value_id, idx, piece)
    except BaseException:  # `parts` failed (e.g. a sum made as it is written overflowed)
        tx.run("DELETE FROM value_chunks WHERE value = ?", (value_id,))
        raise
    value = Value(value_id, size, chunk, digest.hexdigest())
    tx.run(
        "INSERT INTO value_heads (id, size, chunk, sha256, staged) VALUES (?, ?, ?, ?, NULL)",
        (value.id, value.size, value.chunk, value.sha256),
    )
    return value


def head(tx: sql.Tx, value_id: str) -> Value | None:
    """The head of written value `value_id` (None: none, or one still staged)."""
    row = tx.one(
        "SELECT id, size, chunk, sha256 FROM value_heads WHERE id = ? AND staged IS NULL",
        (value_id,),
    )
    return None if row is None else Value(str(row[0]), int(row[1]), int(row[2]), str(row[3]))


def delete(tx: sql.Tx, value_id: str) -> None:
    """Deletes a value (written or staged): its chunks and its head."""
    tx.run("DELETE FROM value_chunks WHERE value = ?", (value_id,))
    tx.run("DELETE FROM value_heads WHERE id = ?", (value_id,))


def read_chunk(tx: sql.Tx, value: Value, idx: int) -> bytes:
    """Chunk `idx` of `value`, its length checked.

    Raises:
      DamagedValue: the chunk is missing or of another length than the head says.
    """
    row = tx.one_binary("SELECT data FROM value_chunks WHERE value = ? AND idx = ?",
                        (value.id, idx))
    found = None if row is None else len(row[0])
    if found != value.length(idx):
        raise DamagedValue(
            f"Expected chunk {idx} of stored value {value.id} to hold {value.length(idx)} "
            f"bytes, found {'none' if found is None else found}; the database was changed "
            "outside fedlang or damaged (or the value was deleted while it was read)."
        )
    return bytes(row[0])


def _check_whole(value: Value, digest: Any) -> None:
    if digest.hexdigest() != value.sha256:
        raise DamagedValue(
            f"Expected stored value {value.id} to have the SHA-256 {value.sha256}, found "
            f"{digest.hexdigest()}; the database was changed outside fedlang or damaged."
        )


def read(tx: sql.Tx, value: Value) -> bytes:
    """`value` whole, read in `tx`, its chunks' lengths and its SHA-256 checked.

    Raises:
      DamagedValue: see `read_chunk` and the module docstring.
    """
    data, digest = bytearray(value.size), hashlib.sha256()  # one buffer: no join of chunks
    for idx in range(value.chunks):
        chunk = read_chunk(tx, value, idx)
        digest.update(chunk)
        data[idx * value.chunk:idx * value.chunk + len(chunk)] = chunk
    _check_whole(value, digest)
    return typing.cast(bytes, data)  # a bytearray: every reader of bytes here takes it


def read_id(tx: sql.Tx, value_id: str) -> bytes:
    """Written value `value_id` whole (`read`), for a row that names it.

    Raises:
      DamagedValue: no such value (the row names one that was deleted), or see `read`.
    """
    value = head(tx, value_id)
    if value is None:
        raise DamagedValue(f"Expected stored value {value_id}, found none; the database was "
                           "changed outside fedlang or damaged.")
    return read(tx, value)


def read_range(tx: sql.Tx, value: Value, start: int, stop: int) -> bytes:
    """Bytes `start:stop` of `value`, read in `tx` (each chunk's length checked, not the
    whole's SHA-256: for a reader of slices, such as a fold a slice at a time).

    Raises:
      DamagedValue: see `read_chunk`.
    """
    if not 0 <= start <= stop <= value.size:
        raise ValueError(f"Expected a range within 0:{value.size}, found {start}:{stop}.")
    out = bytearray()
    for idx in range(start // value.chunk, -(-stop // value.chunk)):
        data = read_chunk(tx, value, idx)
        base = idx * value.chunk
        out += memoryview(data)[max(start - base, 0):min(stop - base, len(data))]
    return typing.cast(bytes, out)


def chunks(store: Transactions, value: Value, start: int = 0,
           stop: int | None = None) -> Iterator[bytes]:
    """The bytes `start:stop` of `value` (`stop`: its end by default), a chunk at a
    time, each read in a transaction of its own. Read whole, the value's SHA-256 is
    checked before its last chunk is given.

    Raises:
      DamagedValue: a chunk's length, or the whole's SHA-256, differs from the head's
        (or the value was deleted while it was read).
    """
    stop = value.size if stop is None else stop
    if not 0 <= start <= stop <= value.size:
        raise ValueError(f"Expected a range within 0:{value.size}, found {start}:{stop}.")
    if start == stop:
        return
    digest = hashlib.sha256() if (start, stop) == (0, value.size) else None
    first, last = start // value.chunk, (stop - 1) // value.chunk
    for idx in range(first, last + 1):
        with store.transaction() as tx:
            data = read_chunk(tx, value, idx)
        if digest is not None:
            digest.update(data)
            if idx == last:
                _check_whole(value, digest)
        begin = start - idx * value.chunk if idx == first else 0
        end = stop - idx * value.chunk if idx == last else len(data)
        yield data if (begin, end) == (0, len(data)) else data[begin:end]


class Staging:
    """A value written as it arrives (see the module docstring): `write` its bytes in
    parts of any size, then `finish` it in the transaction that writes the row naming
    it, or `discard` it.

    Args:
      store: where each full chunk is written, in a transaction of its own.
      chunk: the value's chunk size.
    """

    def __init__(self, store: Transactions, chunk: int = CHUNK):
        self.store = store
        self.chunk = chunk
        self.id = _new_id()
        self.size = 0
        self._digest = hashlib.sha256()
        self._buffer = bytearray()
        self._written = 0  # chunks written

    @property
    def sha256(self) -> str:
        """The SHA-256 (hex) of the bytes written so far."""
        return self._digest.hexdigest()

    def write(self, data: bytes | bytearray) -> None:
        """Adds `data`; each chunk it completes is written in a transaction of its own."""
        self._digest.update(data)
        self.size += len(data)
        self._buffer += data
        while len(self._buffer) >= self.chunk:
            piece = bytes(memoryview(self._buffer)[: self.chunk])
            del self._buffer[: self.chunk]
            with self.store.transaction(write=True) as tx:
                if self._written == 0:  # the head, staged: the sweep finds it if we die
                    tx.run(
                        "INSERT INTO value_heads (id, size, chunk, sha256, staged)"
                        " VALUES (?, 0, ?, '', ?)",
                        (self.id, self.chunk, self.store.clock()),
                    )
                elif not tx.run("UPDATE value_heads SET staged = ? WHERE id = ?"
                                " AND staged IS NOT NULL", (self.store.clock(), self.id)):
                    raise self._swept()
                _put_chunk(tx, self.id, self._written, piece)
            self._written += 1

    def finish(self, tx: sql.Tx) -> Value:
        """The whole value, its last chunk and its head written in `tx`: it exists once
        `tx` commits (with the row that names it).

        Raises:
          Swept: its chunks were swept meanwhile (`sweep_staged`).
        """
        value = Value(self.id, self.size, self.chunk, self.sha256)
        if not self._written:
            tx.run("INSERT INTO value_heads (id, size, chunk, sha256, staged)"
                   " VALUES (?, ?, ?, ?, NULL)", (value.id, value.size, value.chunk, value.sha256))
        elif not tx.run("UPDATE value_heads SET size = ?, sha256 = ?, staged = NULL"
                        " WHERE id = ? AND staged IS NOT NULL",
                        (value.size, value.sha256, value.id)):
            raise self._swept()
        if self._buffer:
            _put_chunk(tx, self.id, self._written, bytes(self._buffer))
        return value

    def _swept(self) -> Swept:
        return Swept(f"Expected the staged chunks of value {self.id}, found them swept: "
                     "nothing was written to it for too long; write it again.")

    def discard(self) -> None:
        """Deletes the chunks written so far (a value never finished)."""
        self._buffer.clear()
        if self._written:
            with self.store.transaction(write=True) as tx:
                tx.run("DELETE FROM value_chunks WHERE value = ?"
                       " AND EXISTS (SELECT 1 FROM value_heads WHERE id = ? AND staged IS NOT NULL)",
                       (self.id, self.id))
                tx.run("DELETE FROM value_heads WHERE id = ? AND staged IS NOT NULL", (self.id,))


def sweep_staged(store: Transactions, before: float) -> int:
    """Deletes the staged values nothing was written to since `before` (uploads cut off
    by a killed process), each in a transaction of its own; returns how many."""
    with store.transaction() as tx:
        due = [str(row[0]) for row in tx.all(
            "SELECT id FROM value_heads WHERE staged IS NOT NULL AND staged < ?", (before,))]
    for value_id in due:
        with store.transaction(write=True) as tx:
            row = tx.one("SELECT 1 FROM value_heads WHERE id = ? AND staged IS NOT NULL"
                         " AND staged < ?" + tx.dialect.lock_row, (value_id, before))
            if row is not None:
                delete(tx, value_id)
    return len(due)
