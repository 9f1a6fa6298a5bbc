"""The task store's schema: a database made by an older fedlang opens and keeps its data,
on SQLite and on PostgreSQL (`db_url` runs each test on both)."""

import contextlib
import os

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import metrics as metrics_lib
from fedlang.deploy.store import mirrors as mirrors_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import schema, sql, values
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib

from .conftest import as_version

# The whole schema of version 1 as fedlang wrote it, before the buffered sessions'
# tables lost their `async_` names (store.py and async_store.py of that version).
V1 = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS populations (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL,"
    " clients {int} NOT NULL DEFAULT 0, finished {int} NOT NULL DEFAULT 0, created {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS clients (id TEXT PRIMARY KEY, population TEXT NOT NULL,"
    " credential_hash TEXT NOT NULL UNIQUE, created {real} NOT NULL, expires {real} NOT NULL,"
    " last_seen {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS blobs (hash TEXT PRIMARY KEY, size {int} NOT NULL,"
    " data {blob} NOT NULL, created {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rounds (id {int} PRIMARY KEY, population TEXT NOT NULL,"
    " kind TEXT NOT NULL, state TEXT NOT NULL, request_id TEXT UNIQUE, plan TEXT NOT NULL,"
    " broadcast TEXT NOT NULL, target {int} NOT NULL, capacity {int} NOT NULL,"
    " quorum {int} NOT NULL, deadline {real} NOT NULL, created {real} NOT NULL, closed {real},"
    " assigned {int} NOT NULL DEFAULT 0, reports {int} NOT NULL DEFAULT 0,"
    " late {int} NOT NULL DEFAULT 0, dropped {int} NOT NULL DEFAULT 0,"
    " refused {int} NOT NULL DEFAULT 0, failure TEXT NOT NULL DEFAULT '')",
    "CREATE INDEX IF NOT EXISTS rounds_by_state ON rounds (population, state)",
    "CREATE TABLE IF NOT EXISTS assignments (round {int} NOT NULL, client TEXT NOT NULL,"
    " state TEXT NOT NULL, assigned {real} NOT NULL, updated {real} NOT NULL,"
    " PRIMARY KEY (round, client))",
    "CREATE INDEX IF NOT EXISTS assignments_by_client ON assignments (client, state)",
    "CREATE TABLE IF NOT EXISTS reports (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL DEFAULT 0, digest TEXT NOT NULL, size {int} NOT NULL,"
    " accepted {real} NOT NULL, PRIMARY KEY (round, client, stage))",
    "CREATE TABLE IF NOT EXISTS aggregates (round {int} PRIMARY KEY, data {blob} NOT NULL,"
    " reports {int} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value {int} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS secure_rounds (round {int} PRIMARY KEY, stage {int} NOT NULL,"
    " stage_timeout {real} NOT NULL, stage_deadline {real} NOT NULL,"
    " answered {int} NOT NULL DEFAULT 0, state {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS secure_requests (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL, data {blob} NOT NULL, PRIMARY KEY (round, client, stage))",
    "CREATE TABLE IF NOT EXISTS async_sessions (id {int} PRIMARY KEY, population TEXT NOT NULL,"
    " state TEXT NOT NULL, request_id TEXT UNIQUE, plan TEXT NOT NULL, version {int} NOT NULL,"
    " weights TEXT NOT NULL, server_state TEXT NOT NULL DEFAULT '', buffer_size {int} NOT NULL,"
    " max_staleness {int} NOT NULL, applied_through {int} NOT NULL DEFAULT 0,"
    " reports {int} NOT NULL DEFAULT 0, refused_stale {int} NOT NULL DEFAULT 0,"
    " created {real} NOT NULL, updated {real} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS async_sessions_by_state ON async_sessions (population, state)",
    "CREATE TABLE IF NOT EXISTS async_versions (session {int} NOT NULL, version {int} NOT NULL,"
    " weights TEXT NOT NULL, server_state TEXT NOT NULL, through {int} NOT NULL,"
    " published {real} NOT NULL, PRIMARY KEY (session, version))",
    "CREATE TABLE IF NOT EXISTS async_tasks (session {int} NOT NULL, client TEXT NOT NULL,"
    " version {int} NOT NULL, state TEXT NOT NULL, assigned {real} NOT NULL,"
    " PRIMARY KEY (session, client, version))",
    "CREATE TABLE IF NOT EXISTS async_reports (session {int} NOT NULL, seq {int} NOT NULL,"
    " client TEXT NOT NULL, version {int} NOT NULL, staleness {int} NOT NULL,"
    " digest TEXT NOT NULL, size {int} NOT NULL, data {blob} NOT NULL, accepted {real} NOT NULL,"
    " applied {int}, PRIMARY KEY (session, seq), UNIQUE (session, client, version))",
]
PLAN, W0 = "a" * 64, "b" * 64


@contextlib.contextmanager
def raw(db_url):
    """A transaction on the database itself, below the store."""
    dialect = sql.dialect(db_url)
    conn = dialect.connect()
    try:
        dialect.begin(conn, True)
        yield sql.Tx(conn, dialect)
        conn.execute("COMMIT")
    finally:
        conn.close()


def make_version_1(db_url, version=b"1"):
    """A database as fedlang's schema version 1 left it: a population with one enrolled
    client, an open round it was assigned, and an open buffered session at version 0
    with one accepted report of that client."""
    with raw(db_url) as tx:
        for statement in V1:
            tx.run(statement.format(**tx.dialect.types))
        tx.run("INSERT INTO meta (key, value) VALUES ('schema', ?)", (version,))
        tx.run("INSERT INTO populations (name, token_hash, clients, created)"
               " VALUES ('pop', ?, 1, 1.0)", (store_lib.secret_hash("token"),))
        tx.run("INSERT INTO clients (id, population, credential_hash, created, expires,"
               " last_seen) VALUES ('c-1', 'pop', ?, 1.0, 9e9, 1.0)",
               (store_lib.secret_hash("credential"),))
        tx.run("INSERT INTO rounds (id, population, kind, state, plan, broadcast, target,"
               " capacity, quorum, deadline, created, assigned) VALUES (1, 'pop', 'aggregate',"
               " 'open', ?, ?, 2, 2, 2, 9e9, 1.0, 1)", (PLAN, W0))
        tx.run("INSERT INTO assignments (round, client, state, assigned, updated)"
               " VALUES (1, 'c-1', 'assigned', 1.0, 1.0)")
        tx.run("INSERT INTO aggregates (round, data, reports) VALUES (1, ?, 0)", (b"agg",))
        tx.run("INSERT INTO async_sessions (id, population, state, plan, version, weights,"
               " buffer_size, max_staleness, reports, created, updated) VALUES (1, 'pop',"
               " 'open', ?, 0, ?, 2, 1, 1, 1.0, 1.0)", (PLAN, W0))
        tx.run("INSERT INTO async_versions (session, version, weights, server_state, through,"
               " published) VALUES (1, 0, ?, '', 0, 1.0)", (W0,))
        tx.run("INSERT INTO async_tasks (session, client, version, state, assigned)"
               " VALUES (1, 'c-1', 0, 'reported', 1.0)")
        tx.run("INSERT INTO async_reports (session, seq, client, version, staleness, digest,"
               " size, data, accepted) VALUES (1, 1, 'c-1', 0, 0, 'd1', 2, ?, 1.0)", (b"r1",))


def stored_version(db_url):
    with raw(db_url) as tx:
        return bytes(tx.one("SELECT value FROM meta WHERE key = 'schema'")[0])


def test_a_version_1_database_opens_with_its_rounds_and_buffered_sessions(db_url):
    make_version_1(db_url)
    store = store_lib.Store(db_url)
    try:
        assert stored_version(db_url) == str(schema.VERSION).encode()
        assert store.authenticate("credential") == ("c-1", "pop")
        (pop,) = store.populations()  # version 3's enrollment counts
        assert (pop["token_enrollments"], pop["max_enrollments"]) == (0, None)
        assert store.enroll("pop", "token", 60.0)[0].startswith("c-")
        rounds = rounds_lib.Rounds(store)
        assert rounds.checkin("c-1", "pop").round == 1  # its assignment held
        sessions = sessions_lib.Sessions(store)
        s = sessions.session(1)
        assert (s.state, s.version, s.reports, s.pending) == ("open", 0, 1, 1)
        assert [(r.seq, r.client, r.data) for r in sessions.reports(1, after=0)] == [
            (1, "c-1", b"r1")]
        assert sessions.precheck(1, "c-1", 0, "d1") is True  # the replay of its report
        sessions.publish(1, 1, W0, PLAN, through=1)
        assert sessions.checkin("c-1", "pop").version == 1
        assert sessions.accept(1, "c-1", 1, "d2", b"r2") is True
        assert sessions.status(sessions.session(1))["staleness_histogram"] == {"0": 2}
    finally:
        store.close()
    # the old names are gone (each dialect raises its own error)
    with raw(db_url) as tx, pytest.raises(Exception):  # noqa: B017
        tx.one("SELECT COUNT(*) FROM async_sessions")
    reopened = store_lib.Store(db_url)  # a migrated database opens as any other
    try:
        assert sessions_lib.Sessions(reopened).session(1).version == 1
    finally:
        reopened.close()


def test_a_version_5_database_gains_released_metrics_and_refusals_by_task(db_url):
    store = store_lib.Store(db_url)
    store.create_population("pop")
    store.close()
    with raw(db_url) as tx:  # as version 5 left it: without the tables of version 6
        tx.run("DROP TABLE released_metrics")
        tx.run("DROP TABLE task_refusals")
        as_version(tx, 5)
    store = store_lib.Store(db_url)
    try:
        assert stored_version(db_url) == str(schema.VERSION).encode()
        assert [p["name"] for p in store.populations()] == ["pop"]
        assert metrics_lib.release(store, "pop", 1, {"train": {"loss": 0.5}}) == 1
        assert [m["value"] for m in metrics_lib.released(store, "pop")] == [0.5]
        store.count_refusal("late", task="round:1")
        assert metrics_lib.refusals(store, ["round:1"]) == {"round:1": {"late": 1}}
    finally:
        store.close()


def test_a_new_database_is_at_the_current_version(db_url):
    store_lib.Store(db_url).close()
    assert stored_version(db_url) == str(schema.VERSION).encode()


@pytest.mark.parametrize("version", [str(schema.VERSION + 1).encode(), b"x"])
def test_a_database_of_a_newer_or_unknown_version_is_refused_unchanged(db_url, version):
    make_version_1(db_url, version=version)
    with pytest.raises(ValueError, match=f"schema version {schema.VERSION}.*found version"):
        store_lib.Store(db_url)
    assert stored_version(db_url) == version
    with raw(db_url) as tx:
        assert tx.one("SELECT COUNT(*) FROM async_sessions")[0] == 1


def test_every_version_before_the_current_one_has_a_migration():
    assert sorted(schema.MIGRATIONS) == list(range(1, schema.VERSION))


def test_a_version_5_database_opens_and_its_open_round_takes_sharded_reports(db_url):
    # a version 5 database: today's tables but `aggregate_shards` (version 7's), one
    # round open with a report folded the old way
    store_lib.Store(db_url).close()
    with raw(db_url) as tx:
        tx.run("DROP TABLE aggregate_shards")
        as_version(tx, 5)
        tx.run("INSERT INTO rounds (id, population, kind, state, plan, broadcast, target,"
               " capacity, quorum, deadline, created, assigned, reports) VALUES (1, 'pop',"
               " 'aggregate', 'open', 'p', 'b', 2, 2, 2, 9e9, 1.0, 2, 1)")
    store = store_lib.Store(db_url)
    try:
        assert stored_version(db_url) == str(schema.VERSION).encode()
        rounds = rounds_lib.Rounds(store)
        assert rounds.round(1).reports == 1  # its row's count, and no shards yet
        with store.transaction(write=True) as tx:
            tx.run("INSERT INTO aggregate_shards (round, shard, value, reports)"
                   " VALUES (1, 'a', ?, 1)", (values.write(tx, [b"x"]).id,))
        assert rounds.round(1).reports == 2
    finally:
        store.close()


# The edge tables of version 11, as fedlang wrote them (store/edges.py, edge_sessions.py,
# upstream.py, upstream_sessions.py of that version).
V11_EDGES = [
    "CREATE TABLE edge_shares (round {int} NOT NULL, edge TEXT NOT NULL,"
    " state TEXT NOT NULL, target {int} NOT NULL, capacity {int} NOT NULL,"
    " joined {real} NOT NULL, digest TEXT, size {int}, reports {int} NOT NULL DEFAULT 0,"
    " dropped {int} NOT NULL DEFAULT 0, accepted {real}, PRIMARY KEY (round, edge))",
    "CREATE TABLE upstream_rounds (upstream {int} PRIMARY KEY,"
    " round {int} NOT NULL UNIQUE, forwarded {real}, outcome TEXT NOT NULL DEFAULT '')",
    "CREATE TABLE edge_batches (session {int} NOT NULL, edge TEXT NOT NULL,"
    " batch {int} NOT NULL, digest TEXT NOT NULL, size {int} NOT NULL,"
    " reports {int} NOT NULL, stale {int} NOT NULL, accepted {real} NOT NULL,"
    " PRIMARY KEY (session, edge, batch))",
    "CREATE TABLE upstream_sessions (upstream {int} PRIMARY KEY,"
    " session {int} NOT NULL UNIQUE, batches {int} NOT NULL DEFAULT 0,"
    " forwarded_through {int} NOT NULL DEFAULT 0, sending_through {int},"
    " outcome TEXT NOT NULL DEFAULT '')",
]


def test_a_version_11_database_keeps_its_edges_shares_batches_and_mirrors(db_url):
    # arrange: a root's open round 1 where edge east forwarded 2 reports (1 dropout,
    # already in the round's row as version 11 counted it) and west holds 2 seats; a
    # session with east's batch 1; and, as an edge's store would hold them, a mirrored
    # round forwarded and a mirrored session sending its second batch
    store = store_lib.Store(db_url)
    store.create_population("pop")
    store.close()
    with raw(db_url) as tx:
        tx.run("DROP TABLE buffered_batches")
        tx.run("DROP TABLE mirrors")
        as_version(tx, 11)
        for statement in V11_EDGES:
            tx.run(statement.format(**tx.dialect.types))
        tx.run("INSERT INTO edges (name, population, token_hash, created)"
               " VALUES ('east', 'pop', 'h1', 1.0), ('west', 'pop', 'h2', 1.0)")
        tx.run("INSERT INTO rounds (id, population, kind, state, plan, broadcast, target,"
               " capacity, quorum, deadline, created, assigned, reports, dropped) VALUES"
               " (1, 'pop', 'aggregate', 'open', 'p', 'b', 4, 4, 1, 9e9, 1.0, 4, 2, 1),"
               " (2, 'pop', 'aggregate', 'closed', 'p', 'b', 1, 1, 1, 9e9, 1.0, 1, 1, 0)")
        tx.run("INSERT INTO edge_shares (round, edge, state, target, capacity, joined, digest,"
               " size, reports, dropped, accepted) VALUES"
               " (1, 'east', 'reported', 2, 2, 1.0, 'd-east', 10, 2, 1, 2.0),"
               " (1, 'west', 'assigned', 2, 2, 1.0, NULL, NULL, 0, 0, NULL)")
        tx.run("INSERT INTO upstream_rounds (upstream, round, forwarded, outcome)"
               " VALUES (7, 2, 3.0, 'accepted')")
        tx.run("INSERT INTO buffered_sessions (id, population, state, plan, version, weights,"
               " buffer_size, max_staleness, reports, created, updated) VALUES (1, 'pop',"
               " 'open', ?, 0, ?, 4, 1, 2, 1.0, 1.0)", (PLAN, W0))
        tx.run("INSERT INTO edge_batches (session, edge, batch, digest, size, reports, stale,"
               " accepted) VALUES (1, 'east', 1, 'b1', 20, 2, 0, 2.0)")
        tx.run("INSERT INTO upstream_sessions (upstream, session, batches, forwarded_through,"
               " sending_through) VALUES (9, 1, 1, 2, 2)")
    # act
    store = store_lib.Store(db_url)
    try:
        # assert: the shares are assignments of seats, east's partial an upload of 2
        assert stored_version(db_url) == str(schema.VERSION).encode()
        edges = edges_lib.Edges(rounds_lib.Rounds(store))
        assert [s.to_json() for s in edges.shares(1)] == [
            {"round": 1, "edge": "east", "state": "reported", "target": 2, "capacity": 2,
             "digest": "d-east", "reports": 2, "dropped": 1},
            {"round": 1, "edge": "west", "state": "assigned", "target": 2, "capacity": 2,
             "digest": None, "reports": 0, "dropped": 0}]
        rounds = rounds_lib.Rounds(store)
        assert rounds.precheck(rounds.round(1), "edge:east", "d-east") is True  # its replay
        assert rounds.round(1).dropped == 0  # east's dropout is counted at the close now
        rounds.stop(1, "stopped by the test")
        assert rounds.round(1).dropped == 3  # east's dropout once, and west's two seats
        sessions = sessions_lib.Sessions(store)
        assert sessions.precheck_many(1, "edge:east", 1, "b1") is True
        assert [(b.client, b.batch, b.reports) for b in sessions.batches(1)] == [
            ("edge:east", 1, 2)]
        mirrors = mirrors_lib.Mirrors(store).all()
        assert [(m.kind, m.upstream, m.local, m.uploads, m.forwarded_through,
                 m.sending_through, m.outcome) for m in mirrors] == [
            ("aggregate", 7, 2, 1, 0, None, "accepted"), ("buffered", 9, 1, 1, 2, 2, "")]
    finally:
        store.close()
    with raw(db_url) as tx, pytest.raises(Exception):  # noqa: B017 (the old tables are gone)
        tx.one("SELECT COUNT(*) FROM edge_shares")


def test_a_version_12_database_keeps_its_blobs_and_aggregates_in_chunks(db_url):
    # arrange: as version 12 left it, a blob of several chunks, a small one, and a
    # round's aggregate, each whole in its row
    big, small = os.urandom(2 * values.CHUNK + 5), b"signed plan"
    store = store_lib.Store(db_url)
    store.create_population("pop")
    h_big, h_small = store.put_blob(big), store.put_blob(small)
    rounds = rounds_lib.Rounds(store)
    r = rounds.create("pop", h_small, h_big, rounds_lib.CohortOptions(1), b"aggregate bytes")
    store.close()
    with raw(db_url) as tx:
        as_version(tx, 12)
        assert bytes(tx.one_binary("SELECT data FROM blobs WHERE hash = ?", (h_big,))[0]) == big
    # act
    store = store_lib.Store(db_url)
    try:
        # assert: the same bytes, now in chunks, and the old columns gone
        assert stored_version(db_url) == str(schema.VERSION).encode()
        assert store.get_blob(h_big) == big and store.get_blob(h_small) == small
        assert store.open_blob(h_big).chunks == 3
        assert rounds_lib.Rounds(store).aggregate(r.id)[1] == b"aggregate bytes"
        with store.transaction() as tx:
            assert tx.one("SELECT COUNT(*) FROM value_chunks")[0] == 5
            for table in ("blobs", "aggregates"):
                with pytest.raises(Exception):  # noqa: B017 (each dialect raises its own)
                    tx.one(f"SELECT data FROM {table}")
        assert store.put_blob(b"new") and store.has_blob(protocol.blob_hash(b"new"))
    finally:
        store.close()
    store_lib.Store(db_url).close()  # a migrated database opens as any other
