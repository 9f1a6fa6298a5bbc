"""The task store's SQL, in the two dialects it speaks: SQLite and PostgreSQL.

One schema and one code path: queries are written with `?` parameters, and a `Dialect`
holds the few differences (parameter style, column types, how a write transaction takes
its lock, how a table is locked)."""

from __future__ import annotations

import os
import pathlib
import sqlite3
import urllib.parse
from typing import Any


class Dialect:
    name = ""
    types = {"blob": "BLOB", "int": "INTEGER", "real": "REAL"}
    lock_row = ""  # appended to a SELECT of the row a write transaction will change
    # appended to a SELECT of a row that must not change (or go) while a transaction
    # writes rows that refer to it; other such transactions go on in parallel
    share_row = ""
    # whether a read-only transaction is a BEGIN ... COMMIT; where each statement sees
    # its own snapshot anyway, a read's statements are sent alone (2 round trips fewer)
    read_transactions = True
    # what a query whose result holds large binary values passes to `execute`
    binary_results: dict[str, Any] = {}
    # a row for each table of that name (`Tx.has_table`)
    table_query = ""

    def connect(self) -> Any:
        raise NotImplementedError

    def reclaim(self) -> None:
        """Gives some of the space of deleted rows back to the file system, where the
        database does not on its own (after sweeps deleted values)."""

    def begin(self, conn: Any, write: bool) -> None:
        conn.execute("BEGIN")

    def sql(self, query: str) -> str:
        return query

    def lock_table(self, tx: Tx, table: str) -> None:
        """Serializes writers of `table` until the transaction ends."""


JOURNAL_LIMIT = 64 << 20  # bytes of write-ahead log SQLite keeps once checkpointed
RECLAIM_PAGES = 4096  # free pages SQLite gives back at a time (`reclaim`): 16 MiB


class SQLite(Dialect):
    name = "sqlite"
    table_query = "SELECT 1 FROM sqlite_master WHERE type = 'table' AND name = ?"

    def __init__(self, path: str):
        self.path = path

    def connect(self) -> Any:
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
        # A new database frees the pages of deleted rows at `reclaim` (one made by an
        # older fedlang keeps its mode: only a VACUUM changes it; its free pages are
        # reused by later writes, the file does not shrink). Before the first table only.
        conn.execute("PRAGMA auto_vacuum=INCREMENTAL")
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute("PRAGMA busy_timeout=60000")
        # the write-ahead log, grown by a large transaction, is cut back to this
        conn.execute(f"PRAGMA journal_size_limit={JOURNAL_LIMIT}")
        return conn

    def reclaim(self) -> None:
        # outside a transaction (`executescript` steps the pragma to its end: `execute`
        # frees one page); a few MiB at a time, since it moves pages and holds the write
        # lock meanwhile (the rest at the next sweep; free pages are reused by writes
        # anyway); then a checkpoint that waits for no reader, which shrinks the file
        conn = self.connect()
        try:
            conn.executescript(
                f"PRAGMA incremental_vacuum({RECLAIM_PAGES}); PRAGMA wal_checkpoint(PASSIVE);")
        finally:
            conn.close()

    def begin(self, conn: Any, write: bool) -> None:
        # A write transaction takes SQLite's write lock at once, so two writers never
        # both read a round and then both try to change it.
        conn.execute("BEGIN IMMEDIATE" if write else "BEGIN")


def secure_delete(tx: Tx, on: bool) -> None:
    """On SQLite, makes what `tx` deletes from now on be overwritten with zeros instead of
    left on a free page for a copy of the file to show (for secrets an older fedlang
    kept). Off by default: zeroing every freed page would double the writes of each
    report folded into a large aggregate."""
    if isinstance(tx.dialect, SQLite):
        tx.run(f"PRAGMA secure_delete={'ON' if on else 'OFF'}")


class Postgres(Dialect):
    name = "postgresql"
    types = {"blob": "BYTEA", "int": "BIGINT", "real": "DOUBLE PRECISION"}
    lock_row = " FOR UPDATE"
    share_row = " FOR KEY SHARE"
    # READ COMMITTED (PostgreSQL's default, and the store's): every statement of a
    # transaction sees what was committed when it started, so a read transaction's
    # statements read the same outside one
    read_transactions = False
    # bytea as bytes, not as hex text to decode (a large value reads 3x as fast)
    binary_results = {"binary": True}
    table_query = ("SELECT 1 FROM information_schema.tables WHERE table_schema ="
                   " current_schema() AND table_name = ?")

    def __init__(self, url: str):
        self.url = url

    def connect(self) -> Any:
        try:
            import psycopg
        except ImportError as e:
            raise ImportError(
                "A PostgreSQL task store needs psycopg 3: pip install 'fedlang[deploy]'."
            ) from e
        try:
            return psycopg.connect(self.url, autocommit=True)
        except psycopg.OperationalError as e:  # an OSError: a server says it in one line
            raise ConnectionError(
                f"Expected the PostgreSQL server of {_without_password(self.url)} to accept a "
                f"connection, found: {' '.join(str(e).split())}. Check that it runs and that "
                "the URL (host, port, user, database) is right.") from e

    def sql(self, query: str) -> str:
        return query.replace("?", "%s")

    def lock_table(self, tx: Tx, table: str) -> None:
        tx.run(f"LOCK TABLE {table} IN SHARE ROW EXCLUSIVE MODE")


def _without_password(url: str) -> str:
    """`url` with its password, if any, replaced by `***` (for messages and logs).

    Example:
      >>> _without_password("postgresql://fl:secret@db:5432/store")
      'postgresql://fl:***@db:5432/store'
    """
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc))


def dialect(url: str | os.PathLike[str]) -> Dialect:
    text = str(url)
    if text.startswith(("postgresql://", "postgres://")):
        return Postgres(text)
    if text.startswith("sqlite:///"):
        text = text[len("sqlite:///") :]
    elif "://" in text:
        raise ValueError(
            f"Expected a database URL (sqlite:///PATH, a file path, or postgresql://...), "
            f"found {text!r}."
        )
    if text != ":memory:":
        pathlib.Path(text).parent.mkdir(parents=True, exist_ok=True)
    return SQLite(text)


class Tx:
    """One transaction's connection, with `?` parameters in every dialect."""

    def __init__(self, conn: Any, dialect: Dialect, read_only: bool = False):
        self.conn = conn
        self.dialect = dialect
        self.read_only = read_only  # statements outside a transaction: no writes

    def _writes(self) -> None:
        if self.read_only:
            raise RuntimeError(
                "Expected only reads in a read transaction, found a write; open it with "
                "Store.transaction(write=True)."
            )

    def run(self, query: str, params: tuple[Any, ...] = ()) -> int:
        self._writes()
        return self.conn.execute(self.dialect.sql(query), params).rowcount

    def one(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        return self.conn.execute(self.dialect.sql(query), params).fetchone()

    def one_binary(self, query: str, params: tuple[Any, ...] = ()) -> Any:
        """`one`, for a row holding a large binary value (`Dialect.binary_results`)."""
        return self.conn.execute(
            self.dialect.sql(query), params, **self.dialect.binary_results).fetchone()

    def has_table(self, name: str) -> bool:
        """Whether the database has table `name` (a migration from a version before it)."""
        return self.one(self.dialect.table_query, (name,)) is not None

    def all(self, query: str, params: tuple[Any, ...] = ()) -> list[Any]:
        return list(self.conn.execute(self.dialect.sql(query), params).fetchall())

    def many(self, query: str, rows: list[tuple[Any, ...]]) -> None:
        """`run` once per row of parameters, in one call (one round trip on PostgreSQL)."""
        self._writes()
        if rows:
            self.conn.cursor().executemany(self.dialect.sql(query), rows)

    def count(self, name: str, n: int = 1) -> None:
        self.run(
            "INSERT INTO counters (name, value) VALUES (?, ?) ON CONFLICT (name) DO UPDATE"
            " SET value = counters.value + excluded.value",
            (name, n),
        )
