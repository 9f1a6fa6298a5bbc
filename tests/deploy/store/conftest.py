"""Fixtures of the task store's tests: a store on each database, a clock tests move."""

import pytest

from fedlang.deploy.store import store as store_lib
from fedlang.deploy.store import values


class Clock:
    def __init__(self, now=1_000_000.0):
        self.now = now

    def __call__(self):
        return self.now


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def store(db_url, clock):
    s = store_lib.Store(db_url, clock=clock, pace=store_lib.Pace(min_retry=0.5, max_retry=5.0))
    yield s
    s.close()


@pytest.fixture
def token(store):
    return store.create_population("pop")


def enroll(store, n, population="pop", token=None, ttl=3600.0):
    return [store.enroll(population, token, ttl)[0] for _ in range(n)]


# What a migration adds to tables that exist already, by the version that added it: a
# database made with today's schema and marked older (`as_version`) must not have it.
_ADDED_COLUMNS = {12: [("assignments", "seats"), ("assignments", "target"),
                       ("reports", "count"), ("reports", "dropped")]}


# The tables whose bytes version 13 moved into values in chunks, as version 12 had them.
V12_TABLES = {
    "blobs": ("hash", "size, created", "CREATE TABLE blobs (hash TEXT PRIMARY KEY,"
              " size {int} NOT NULL, data {blob} NOT NULL, created {real} NOT NULL)"),
    "aggregates": ("round", "reports", "CREATE TABLE aggregates (round {int} PRIMARY KEY,"
                   " data {blob} NOT NULL, reports {int} NOT NULL)"),
    "aggregate_shards": ("round", "shard, reports", "CREATE TABLE aggregate_shards (round"
                         " {int} NOT NULL, shard TEXT NOT NULL, data {blob} NOT NULL,"
                         " reports {int} NOT NULL, PRIMARY KEY (round, shard))"),
}


def _as_version_12(tx):
    """Blobs, aggregates and their shards with their bytes in their rows (`data`), as
    before version 13."""
    for table, (key, columns, made) in V12_TABLES.items():
        if not tx.has_table(table):  # (a test made the database older still)
            continue
        rows = tx.all(f"SELECT {key}, value, {columns} FROM {table}")
        tx.run(f"DROP TABLE {table}")
        tx.run(made.format(**tx.dialect.types))
        for k, value, *rest in rows:
            data = values.read(tx, values.head(tx, value))
            tx.run(f"INSERT INTO {table} ({key}, data, {columns}) VALUES (?, ?{', ?' * len(rest)})",
                   (k, data, *rest))
    tx.run("DROP TABLE value_chunks")
    tx.run("DROP TABLE value_heads")


def as_version(tx, version):
    """Marks a database made with today's schema as of schema `version`, without the
    columns later versions added (their migration adds them again) and with the tables
    they changed as they were."""
    if version < 13:
        _as_version_12(tx)
    for added, columns in _ADDED_COLUMNS.items():
        if version < added:
            for table, column in columns:
                tx.run(f"ALTER TABLE {table} DROP COLUMN {column}")
    tx.run("UPDATE meta SET value = ? WHERE key = 'schema'", (str(version).encode(),))
