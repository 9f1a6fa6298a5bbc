"""Enrolling clients in bulk: a population provisioned by its operator, not device by device.

An operator who ships credentials to devices (a fleet provisioned at the factory), or a
load test of a large population, enrolls many clients at once through the admin API
instead of one `POST /populations/{name}/enroll` each. `enroll_bulk` makes `count`
clients in one transaction (all or none), at most `MAX_BULK` a call, and hands their
credentials to the caller chunk by chunk, once: as for every secret, the store keeps only
their SHA-256 (`store.secret_hash`), so a credential that is lost is lost (revoke the
client). Rows are written `CHUNK` at a time with one `executemany`, so a call costs about
one B-tree insert per client and index, and holds at most one chunk of secrets besides
what the caller keeps.
"""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Callable, Iterator

from fedlang.deploy import protocol
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib

MAX_BULK = 100_000  # clients a call enrolls at most
CHUNK = 5_000  # rows a statement inserts
# SQLite's page cache while a call inserts, in KiB: the two indexes of `clients` (its id
# and its credential's hash) take random keys, and with SQLite's default 2 MB cache each
# insert into a table of 10^6 clients rereads index pages (measured: 59 s for 10^6
# clients, 25 s with 64 MB). Set back when the call ends.
SQLITE_CACHE_KIB = 64 << 10


def enroll_bulk(
    store: store_lib.Store,
    population: str,
    count: int,
    ttl: float,
    emit: Callable[[list[tuple[str, str]]], None],
) -> float:
    """Enrolls `count` new clients of `population` in one transaction; calls `emit` with
    each chunk's `(client id, credential)` pairs as they are made (before the commit: a
    caller shows them only once this returns); returns their credentials' expiry time.
    Clients enrolled so do not count against the population token's enrollment cap.

    Raises:
      NotFound: no such population.
      ValueError: `count` outside 1..MAX_BULK.
    """
    if not (isinstance(count, int) and 1 <= count <= MAX_BULK):
        raise ValueError(
            f"Expected 1 to {MAX_BULK} clients a call, found {count!r}; enroll more in "
            "several calls."
        )
    now = store.clock()
    expires = now + ttl
    with store.transaction(write=True) as tx:
        if tx.one(
            "SELECT 1 FROM populations WHERE name = ?" + tx.dialect.lock_row, (population,)
        ) is None:
            raise protocol.NotFound(
                f"Expected an existing population, found {population!r}; create it first."
            )
        insert = tx.dialect.sql(
            "INSERT INTO clients (id, population, credential_hash, created, expires,"
            " last_seen) VALUES (?, ?, ?, ?, ?, ?)"
        )
        cursor = tx.conn.cursor()
        with _page_cache(tx):
            for start in range(0, count, CHUNK):
                made = [
                    ("c-" + secrets.token_hex(8), secrets.token_urlsafe(32))
                    for _ in range(min(CHUNK, count - start))
                ]
                cursor.executemany(insert, [
                    (client_id, population, store_lib.secret_hash(credential), now, expires, now)
                    for client_id, credential in made
                ])
                emit(made)
        tx.run("UPDATE populations SET clients = clients + ? WHERE name = ?", (count, population))
        tx.count("enrollments", count)
        tx.count("enrollments:bulk", count)
    return expires


@contextlib.contextmanager
def _page_cache(tx: sql.Tx) -> Iterator[None]:
    """On SQLite, `SQLITE_CACHE_KIB` of page cache for the block, then the connection's
    own size again (its extra pages freed: the connection goes back to the pool)."""
    if not isinstance(tx.dialect, sql.SQLite):
        yield
        return
    before = int(tx.one("PRAGMA cache_size")[0])
    tx.run(f"PRAGMA cache_size=-{SQLITE_CACHE_KIB}")
    try:
        yield
    finally:
        tx.run(f"PRAGMA cache_size={before}")
        tx.run("PRAGMA shrink_memory")
