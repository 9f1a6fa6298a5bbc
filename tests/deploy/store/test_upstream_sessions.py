"""At an edge's store, on SQLite and PostgreSQL: a mirrored session follows the root's
versions; a batch is recorded before it is sent and stays the same until the root
answers; forwarded reports leave the edge's buffer."""

import pytest

from fedlang.deploy import protocol
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib
from fedlang.deploy.store import upstream_sessions as upstream_lib

PLAN, W0, W3 = (f"{i:064x}" for i in range(3))


@pytest.fixture
def sessions(db_url):
    st = store_lib.Store(db_url)
    st.create_population("pop")
    yield sessions_lib.Sessions(st)
    st.close()


def _report(sessions, s, client, version):
    sessions.checkin(client, "pop")
    assert sessions.accept(s.id, client, version, f"d-{client}", client.encode())


def test_a_mirror_follows_versions_and_sends_each_report_in_one_batch(sessions):
    upstream = upstream_lib.UpstreamSessions(sessions)
    s = upstream.open(7, "pop", PLAN, W0, version=2, buffer_size=2, max_staleness=1)
    again = upstream.open(7, "pop", PLAN, W0, version=2, buffer_size=2, max_staleness=1)
    assert again.id == s.id and [m.upstream for m in upstream.mirrors()] == [7]
    assert upstream.next_batch(7, 2).sending_through is None  # nothing to send
    _report(sessions, s, "a", 2)
    _report(sessions, s, "b", 2)
    sessions.checkin("c", "pop")
    with pytest.raises(protocol.BufferFull):  # the edge holds at most K not forwarded
        sessions.accept(s.id, "c", 2, "d-c", b"c")
    assert upstream.next_batch(7, 1).sending_through == 1  # at most the root's room
    assert upstream.next_batch(7, 2).sending_through == 1  # the same batch until answered
    upstream.forwarded(7)
    m = upstream.next_batch(7, 2)
    assert (m.batches, m.forwarded_through, m.sending_through) == (1, 1, 2)
    upstream.forwarded(7)
    assert sessions.session(s.id).pending == 0  # forwarded reports left the buffer
    upstream.advance(s.id, 5, W3)  # the root stepped three times
    upstream.advance(s.id, 4, W0)  # an older version changes nothing
    s = sessions.session(s.id)
    assert (s.version, s.weights) == (5, W3)
    assert sessions.checkin("a", "pop") == sessions_lib.BufferedTask(s.id, s.plan, W3, 5)
    upstream.end(7, "closed")
    assert upstream.mirrors(pending=True) == []
    assert sessions.session(s.id).state == "closed"
