"""Buffered (FedBuff) sessions in the task store, on SQLite and PostgreSQL: versions,
staleness refusals, the buffer bound, idempotent uploads, and what a restart reads back;
an edge's batches (`accept_many`): stored as their reports, each with its staleness now,
too stale ones counted, a batch that does not fit the buffer's room refused whole,
replays changing nothing; a session mirrored at an edge (`advance`, `release`)."""

import pytest

from fedlang.deploy import protocol
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


def _open(sessions, k=2, max_staleness=1):
    return sessions.create("pop", PLAN, W0, version=0, buffer_size=k, max_staleness=max_staleness)


def test_a_checking_in_client_gets_the_current_version_and_waits_after_reporting(sessions):
    assert sessions.checkin("c1", "pop") is None  # no session yet
    s = _open(sessions)
    task = sessions.checkin("c1", "pop")
    assert task == sessions_lib.BufferedTask(s.id, PLAN, W0, 0)
    assert sessions.checkin("c1", "pop") == task  # a restarted client gets it again
    assert sessions.accept(s.id, "c1", 0, "d1", b"r1")
    assert sessions.checkin("c1", "pop") is None  # one report per client and version
    sessions.publish(s.id, 1, W1, S1, through=1)
    assert sessions.checkin("c1", "pop") == sessions_lib.BufferedTask(s.id, PLAN, W1, 1)


def test_uploads_are_idempotent_and_one_per_client_and_version(sessions):
    s = _open(sessions)
    sessions.checkin("c1", "pop")
    assert sessions.accept(s.id, "c1", 0, "d1", b"r1") is True
    assert sessions.accept(s.id, "c1", 0, "d1", b"r1") is False  # a replay changes nothing
    assert sessions.precheck(s.id, "c1", 0, "d1") is True
    with pytest.raises(protocol.Conflict, match="already gave"):
        sessions.accept(s.id, "c1", 0, "other", b"r2")
    assert [r.data for r in sessions.reports(s.id, 0)] == [b"r1"]
    assert sessions.session(s.id).reports == 1


def test_a_report_for_a_version_the_client_was_not_given_is_refused(sessions):
    s = _open(sessions)
    with pytest.raises(protocol.Forbidden, match="check in"):
        sessions.accept(s.id, "c9", 0, "d", b"r")
    assert sessions.session(s.id).reports == 0


def test_stale_reports_are_refused_and_counted(sessions):
    s = _open(sessions, k=1, max_staleness=1)
    for c in ("a", "b", "c"):
        sessions.checkin(c, "pop")  # all three train version 0
    sessions.accept(s.id, "a", 0, "da", b"ra")
    sessions.publish(s.id, 1, W1, S1, through=1)
    sessions.accept(s.id, "b", 0, "db", b"rb")  # staleness 1: accepted
    sessions.publish(s.id, 2, W2, S2, through=2)
    with pytest.raises(protocol.Gone, match="staleness 2") as e:
        sessions.precheck(s.id, "c", 0, "dc")
    assert e.value.reason == "stale"
    sessions.count_refusal(e.value.reason, s.id)
    status = sessions.status(sessions.session(s.id))
    assert status["refused_stale"] == 1
    assert status["staleness_histogram"] == {"0": 1, "1": 1}
    assert status["version"] == 2 and status["accepted"] == 2
    assert sessions.store.counters()["refused:stale"] == 1


def test_the_buffer_takes_k_reports_until_the_driver_applies_it(sessions):
    s = _open(sessions, k=2)
    for c in ("a", "b", "c"):
        sessions.checkin(c, "pop")
    sessions.accept(s.id, "a", 0, "da", b"ra")
    sessions.accept(s.id, "b", 0, "db", b"rb")
    assert sessions.status(sessions.session(s.id))["buffer_fill"] == 2
    with pytest.raises(protocol.BufferFull, match="retry"):
        sessions.accept(s.id, "c", 0, "dc", b"rc")
    sessions.publish(s.id, 1, W1, S1, through=2)
    assert sessions.accept(s.id, "c", 0, "dc", b"rc")  # now one version stale
    assert [(r.seq, r.client, r.staleness) for r in sessions.reports(s.id, 2)] == [(3, "c", 1)]


def test_publishing_checks_the_version_and_is_idempotent(sessions):
    s = _open(sessions)
    sessions.checkin("a", "pop")
    sessions.accept(s.id, "a", 0, "da", b"ra")
    with pytest.raises(protocol.Conflict, match="Expected version 1"):
        sessions.publish(s.id, 2, W1, S1, through=1)
    with pytest.raises(protocol.Conflict, match="sequence 0 to 1"):
        sessions.publish(s.id, 1, W1, S1, through=5)
    first = sessions.publish(s.id, 1, W1, S1, through=1)
    assert sessions.publish(s.id, 1, W1, S1, through=1) == first  # a retried publish
    assert (first.version, first.weights, first.server_state, first.applied_through) == (
        1, W1, S1, 1)


def test_a_restarted_store_reads_back_the_state_and_the_pending_buffer(db_url):
    # arrange: a store with one applied buffer and two reports after it
    st = store_lib.Store(db_url)
    st.create_population("pop")
    sessions = sessions_lib.Sessions(st)
    s = _open(sessions, k=2, max_staleness=3)
    for c in ("a", "b", "c", "d"):
        sessions.checkin(c, "pop")
    sessions.accept(s.id, "a", 0, "da", b"ra")
    sessions.accept(s.id, "b", 0, "db", b"rb")
    sessions.publish(s.id, 1, W1, S1, through=2)
    sessions.accept(s.id, "c", 0, "dc", b"rc")
    st.close()  # act: a new store on the same database (a restarted server)
    again = sessions_lib.Sessions(store_lib.Store(db_url))
    s = again.session(s.id)
    assert (s.version, s.server_state, s.applied_through, s.pending) == (1, S1, 2, 1)
    pending = again.reports(s.id, s.applied_through)
    assert [(r.client, r.version, r.data) for r in pending] == [("c", 0, b"rc")]
    assert again.accept(s.id, "c", 0, "dc", b"rc") is False  # still a replay after restart
    assert again.accept(s.id, "d", 0, "dd", b"rd")
    again.store.close()


def test_bad_session_options_and_a_second_open_session_are_refused(sessions):
    with pytest.raises(protocol.BadRequest, match="buffer size"):
        sessions.create("pop", PLAN, W0, version=0, buffer_size=0, max_staleness=1)
    with pytest.raises(protocol.BadRequest, match="staleness"):
        sessions.create("pop", PLAN, W0, version=0, buffer_size=1, max_staleness=-1)
    with pytest.raises(protocol.NotFound, match="population"):
        sessions.create("nope", PLAN, W0, version=0, buffer_size=1, max_staleness=1)
    s = _open(sessions)
    with pytest.raises(protocol.Conflict, match="close it"):
        _open(sessions)
    sessions.close(s.id)
    sessions.checkin("a", "pop")
    assert sessions.checkin("a", "pop") is None
    assert _open(sessions).id == s.id + 1


# -- an edge's batches


def _items(*versions):
    return [(v, f"d{i}", f"report {i}".encode()) for i, v in enumerate(versions)]


def _batch(sessions, s, batch, items, digest=None):
    return sessions.accept_many(s.id, "edge:east", batch, digest or f"batch{batch}", 100, items)


def test_a_batch_is_stored_as_its_reports_and_a_replay_changes_nothing(sessions):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=4, max_staleness=1)
    assert [x.id for x in sessions.open_sessions("pop")] == [s.id]
    assert sessions.open_sessions("other") == []
    assert _batch(sessions, s, 1, _items(0, 0)) is True
    assert _batch(sessions, s, 1, _items(0, 0)) is False  # the same digest: a replay
    assert sessions.precheck_many(s.id, "edge:east", 1, "batch1") is True
    with pytest.raises(protocol.Conflict, match="already gave"):
        _batch(sessions, s, 1, _items(0), digest="other")
    with pytest.raises(protocol.Conflict, match="batches come in order"):
        _batch(sessions, s, 3, _items(0))
    stored = sessions.reports(s.id, 0)
    assert [(r.seq, r.client, r.version, r.staleness, r.data) for r in stored] == [
        (1, "edge:east/1.0", 0, 0, b"report 0"), (2, "edge:east/1.1", 0, 0, b"report 1")]
    assert sessions.session(s.id).reports == 2


def test_a_batch_takes_the_staleness_of_now_and_too_stale_reports_are_counted(sessions):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=2, max_staleness=1)
    sessions.publish(s.id, 1, W1, S1, through=0)
    sessions.publish(s.id, 2, W2, S2, through=0)
    with pytest.raises(protocol.BadRequest, match="versions up to 2"):
        _batch(sessions, s, 1, _items(3))
    assert _batch(sessions, s, 1, _items(0, 1, 2)) is True  # version 0: 2 behind
    s = sessions.session(s.id)
    assert [(r.version, r.staleness) for r in sessions.reports(s.id, 0)] == [(1, 1), (2, 0)]
    assert (s.reports, s.refused_stale) == (2, 1)
    assert [(b.client, b.batch, b.reports, b.stale) for b in sessions.batches(s.id)] == [
        ("edge:east", 1, 2, 1)]


def test_a_batch_that_does_not_fit_the_buffer_is_refused_whole(sessions):
    s = sessions.create("pop", PLAN, W0, version=0, buffer_size=3, max_staleness=1)
    _batch(sessions, s, 1, _items(0, 0))
    with pytest.raises(protocol.BufferFull, match="room for 2 reports"):
        _batch(sessions, s, 2, _items(0, 0))
    assert sessions.session(s.id).reports == 2  # nothing of it was kept
    sessions.publish(s.id, 1, W1, S1, through=2)  # the driver steps: room again
    assert _batch(sessions, s, 2, _items(0, 0)) is True
    sessions.close(s.id)
    with pytest.raises(protocol.Gone):
        _batch(sessions, s, 3, _items(1))


# -- a session mirrored at an edge


def test_a_mirrored_session_follows_the_root_s_versions_and_releases_forwarded_reports(sessions):
    s = sessions.create("pop", PLAN, W0, version=2, buffer_size=2, max_staleness=1)
    for client in ("a", "b"):
        sessions.checkin(client, "pop")
        assert sessions.accept(s.id, client, 2, f"d-{client}", client.encode())
    sessions.checkin("c", "pop")
    with pytest.raises(protocol.BufferFull):  # the edge holds at most K not forwarded
        sessions.accept(s.id, "c", 2, "d-c", b"c")
    with sessions.store.transaction(write=True) as tx:
        sessions.release(tx, s.id, 2)
    assert sessions.session(s.id).pending == 0  # forwarded reports left the buffer
    sessions.advance(s.id, 5, W2)  # the root stepped three times
    sessions.advance(s.id, 4, W0)  # an older version changes nothing
    s = sessions.session(s.id)
    assert (s.version, s.weights) == (5, W2)
    assert sessions.checkin("a", "pop") == sessions_lib.BufferedTask(s.id, s.plan, W2, 5)
