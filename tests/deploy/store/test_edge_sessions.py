"""Buffered sessions through edges at the root's store, on SQLite and PostgreSQL: a batch
is stored as its reports, each with its staleness now; too stale ones are counted; a
batch that does not fit the buffer's room is refused whole; replays change nothing."""

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import edge_sessions as edge_sessions_lib
from fedlang.deploy.store import schema
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib

PLAN, W0, W1, W2, S1, S2 = (f"{i:064x}" for i in range(6))


@pytest.fixture
def sessions(db_url):
    st = store_lib.Store(db_url)
    st.create_population("pop")
    st.create_population("other")
    yield sessions_lib.Sessions(st)
    st.close()


@pytest.fixture
def edge_sessions(sessions):
    return edge_sessions_lib.EdgeSessions(sessions)


def _items(*versions):
    return [(v, f"d{i}", f"report {i}".encode()) for i, v in enumerate(versions)]


def _accept(edge_sessions, s, batch, items, digest=None):
    return edge_sessions.accept(s.id, "east", "pop", batch, digest or f"batch{batch}", 100, items)


def test_a_batch_is_stored_as_its_reports_and_a_replay_changes_nothing(sessions, edge_sessions):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=4, max_staleness=1)
    assert [x.id for x in edge_sessions.open_sessions("pop")] == [s.id]
    assert edge_sessions.open_sessions("other") == []
    with pytest.raises(protocol.NotFound):  # populations are isolated
        edge_sessions.join("west", "other", s.id)
    assert _accept(edge_sessions, s, 1, _items(0, 0)) is True
    assert _accept(edge_sessions, s, 1, _items(0, 0)) is False  # the same digest: a replay
    assert edge_sessions.precheck(s.id, "east", "pop", 1, "batch1") is True
    with pytest.raises(protocol.Conflict, match="already gave"):
        _accept(edge_sessions, s, 1, _items(0), digest="other")
    with pytest.raises(protocol.Conflict, match="batches come in order"):
        _accept(edge_sessions, s, 3, _items(0))
    stored = sessions.reports(s.id, 0)
    assert [(r.seq, r.client, r.version, r.staleness, r.data) for r in stored] == [
        (1, "edge:east/1.0", 0, 0, b"report 0"), (2, "edge:east/1.1", 0, 0, b"report 1")]
    assert sessions.session(s.id).reports == 2


def test_a_batch_takes_the_staleness_of_now_and_too_stale_reports_are_counted(
    sessions, edge_sessions
):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=2, max_staleness=1)
    sessions.publish(s.id, 1, W1, S1, through=0)
    sessions.publish(s.id, 2, W2, S2, through=0)
    with pytest.raises(protocol.BadRequest, match="versions up to 2"):
        _accept(edge_sessions, s, 1, _items(3))
    assert _accept(edge_sessions, s, 1, _items(0, 1, 2)) is True  # version 0: 2 behind
    s = sessions.session(s.id)
    assert [(r.version, r.staleness) for r in sessions.reports(s.id, 0)] == [(1, 1), (2, 0)]
    assert (s.reports, s.refused_stale) == (2, 1)
    assert [(b.batch, b.reports, b.stale) for b in edge_sessions.batches(s.id)] == [(1, 2, 1)]


def test_a_batch_that_does_not_fit_the_buffer_is_refused_whole(sessions, edge_sessions):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=3, max_staleness=1)
    _accept(edge_sessions, s, 1, _items(0, 0))
    with pytest.raises(protocol.BufferFull, match="room for 2 reports"):
        _accept(edge_sessions, s, 2, _items(0, 0))
    assert sessions.session(s.id).reports == 2  # nothing of it was kept
    sessions.publish(s.id, 1, W1, S1, through=2)  # the driver steps: room again
    assert _accept(edge_sessions, s, 2, _items(0, 0)) is True
    sessions.close(s.id)
    with pytest.raises(protocol.Gone):
        _accept(edge_sessions, s, 3, _items(1))


def test_a_version_5_database_gains_the_tables_of_sessions_through_edges(db_url):
    st = store_lib.Store(db_url)
    with st.transaction(write=True) as tx:
        for table in ("edge_batches", "upstream_sessions"):
            tx.run(f"DROP TABLE {table}")
        tx.run("UPDATE meta SET value = ? WHERE key = 'schema'", (b"5",))
    st.close()
    reopened = store_lib.Store(db_url)
    try:
        assert reopened.get_meta("schema") == str(schema.VERSION).encode()
        with reopened.transaction() as tx:
            assert tx.one("SELECT COUNT(*) FROM edge_batches")[0] == 0
            assert tx.one("SELECT COUNT(*) FROM upstream_sessions")[0] == 0
    finally:
        reopened.close()
