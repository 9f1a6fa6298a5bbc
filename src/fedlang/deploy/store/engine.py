"""The task store's transaction engine: connections to the database, transactions, and
what every table's writer shares (metadata, counters, task rows, idempotent create).

State lives in SQL: SQLite by default (one file in WAL mode, nothing to install) and
PostgreSQL by URL (`postgresql://...`, psycopg 3) for servers that outgrow one process.
Both run one schema (`schema.TABLES`, installed or migrated when the engine opens) and
one code path; `sql.Dialect` holds the few differences (parameter style, column types,
how a transaction takes its write lock).

Every change is one transaction, so a server killed at any moment has either made it or
not. SQLite runs with `synchronous=NORMAL`, which is durable across crashes of the
server process (a `kill -9`); only an operating system crash or power loss may lose the
last commits. `store.Store` adds who is who on top of it (populations, clients, tokens,
blobs, the audit log), and each mode keeps its own tables (`rounds`, `secure`,
`sessions`).
"""

from __future__ import annotations

import contextlib
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import schema, sql


class Engine:
    """Connections and transactions on a database (see the module docstring).

    Args:
      url: `sqlite:///PATH`, a file path (SQLite), or `postgresql://...`.
      clock: the time in seconds since the epoch (tests pass their own).
      max_connections: connections kept open for concurrent requests.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        max_connections: int = 16,
    ):
        self.dialect = sql.dialect(url)
        self.clock = clock
        self._idle: queue.LifoQueue[Any] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._reading = threading.local()  # this thread's shared read transaction (`reading`)
        # Called with (write, seconds) after each transaction (the server's telemetry).
        self.on_transaction: Callable[[bool, float], None] | None = None
        try:
            with self.transaction(write=True) as tx:
                schema.install(tx)
        except BaseException:
            self.close()
            raise

    # -- connections and transactions

    @contextlib.contextmanager
    def reading(self) -> Iterator[None]:
        """Makes the read transactions this thread opens in the block one transaction:
        one connection and one BEGIN/COMMIT for a request's reads (who the caller is,
        its task), which then see one snapshot. A write transaction is always its own,
        and once this thread wrote, its later reads in the block are their own too (so
        they see what it wrote)."""
        if getattr(self._reading, "tx", None) is not None:
            yield
            return
        with self.transaction() as tx:
            self._reading.tx = tx
            try:
                yield
            finally:
                self._reading.tx = None

    @contextlib.contextmanager
    def transaction(self, write: bool = False) -> Iterator[sql.Tx]:
        """A transaction: committed if the block ends normally, rolled back otherwise;
        `on_transaction` is told how long it took. A read transaction inside `reading`
        is the block's."""
        shared = getattr(self._reading, "tx", None)
        if shared is not None:
            if not write:
                yield shared
                return
            self._reading.tx = None  # this thread's later reads see its write
        self._slots.acquire()
        start = time.perf_counter()
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self.dialect.connect()
                with self._lock:
                    self._all.append(conn)
            if not (write or self.dialect.read_transactions):
                with self._statements(conn):
                    yield sql.Tx(conn, self.dialect, read_only=True)
                return
            try:
                self.dialect.begin(conn, write)
                yield sql.Tx(conn, self.dialect)
                conn.execute("COMMIT")
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except Exception:  # a broken connection is dropped, not reused
                    self._discard(conn)
                    raise
                self._idle.put(conn)
                raise
            self._idle.put(conn)
        finally:
            self._slots.release()
            if self.on_transaction is not None:
                self.on_transaction(write, time.perf_counter() - start)

    @contextlib.contextmanager
    def _statements(self, conn: Any) -> Iterator[None]:
        """Reads on `conn` as statements of their own (`Dialect.read_transactions`);
        the connection goes back to the pool unless it broke."""
        try:
            yield
        except BaseException:
            if getattr(conn, "broken", False) or getattr(conn, "closed", False):
                self._discard(conn)
                raise
            self._idle.put(conn)
            raise
        self._idle.put(conn)

    def _discard(self, conn: Any) -> None:
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        """Closes every connection."""
        with self._lock:
            for conn in self._all:
                with contextlib.suppress(Exception):
                    conn.close()
            self._all.clear()
        self._idle = queue.LifoQueue()

    # -- metadata (the server's key, its admin token)

    def get_meta(self, key: str) -> bytes | None:
        with self.transaction() as tx:
            row = tx.one("SELECT value FROM meta WHERE key = ?", (key,))
        return None if row is None else bytes(row[0])

    def delete_meta(self, key: str) -> None:
        """Deletes `key` and, on SQLite, every copy of its old value (the deleted cell is
        zeroed, `secure_delete`, and the write-ahead log truncated). PostgreSQL keeps a
        deleted row's bytes until `VACUUM` reclaims them."""
        with self.transaction(write=True) as tx:
            sql.secure_delete(tx, True)
            tx.run("DELETE FROM meta WHERE key = ?", (key,))
            sql.secure_delete(tx, False)
        if isinstance(self.dialect, sql.SQLite):  # a checkpoint runs outside a transaction
            conn = self.dialect.connect()
            try:
                conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
            finally:
                conn.close()

    # -- creating a task (a round, a session)

    def new_id(
        self, tx: sql.Tx, table: str, population: str, request_id: str | None
    ) -> tuple[int, bool]:
        """The id of a new row of `table` (`rounds`, `buffered_sessions`) for
        `population`, and True; or the id of the row made for `request_id` before, and
        False: creating a task is idempotent by request id, so a driver may retry it.
        Once it returns a new id, `table` is locked against other creators until `tx`
        ends (the caller inserts the row).

        Raises:
          NotFound: no such population.
        """
        query = f"SELECT id FROM {table} WHERE request_id = ?"
        if request_id is not None and (row := tx.one(query, (request_id,))) is not None:
            return int(row[0]), False
        if tx.one("SELECT 1 FROM populations WHERE name = ?", (population,)) is None:
            raise protocol.NotFound(
                f"Expected an existing population, found {population!r}; create it first."
            )
        self.dialect.lock_table(tx, table)
        if request_id is not None and (row := tx.one(query, (request_id,))) is not None:
            return int(row[0]), False  # made by a concurrent retry while we waited
        return int(tx.one(f"SELECT COALESCE(MAX(id), 0) + 1 FROM {table}")[0]), True

    def task_row(
        self, tx: sql.Tx, table: str, fields: str, task_id: int, what: str, lock: bool = False
    ) -> Any:
        """The row of task `task_id` in `table` (a round, a session: its `fields`), read
        in `tx`; with `lock`, locked until `tx` ends: the lock a task's writers take.

        Raises:
          NotFound: no such task (`what` names it: "round", "session").
        """
        row = tx.one(
            f"SELECT {fields} FROM {table} WHERE id = ?" + (self.dialect.lock_row if lock else ""),
            (task_id,),
        )
        if row is None:
            raise protocol.NotFound(f"Expected an existing {what} id, found {task_id}.")
        return row

    # -- counters

    def count_refusal(
        self, reason: str, update: tuple[str, tuple[Any, ...]] | None = None,
        task: str | None = None,
    ) -> None:
        """Counts a refused request (`refused:REASON`; for a `task`, `round:ID` or
        `session:ID`, also in `task_refusals`) and runs `update` (a query and its
        parameters: a mode's own counter of the task refused), in one transaction."""
        with self.transaction(write=True) as tx:
            tx.count(f"refused:{reason}")
            if task is not None:
                tx.run(
                    "INSERT INTO task_refusals (task, reason, count) VALUES (?, ?, 1)"
                    " ON CONFLICT (task, reason) DO UPDATE SET count = task_refusals.count + 1",
                    (task, reason),
                )
            if update is not None:
                tx.run(*update)

    def counters(self) -> dict[str, int]:
        with self.transaction() as tx:
            return {name: int(value) for name, value in tx.all("SELECT name, value FROM counters")}
