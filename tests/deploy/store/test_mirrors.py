"""At an edge's store, on SQLite and PostgreSQL: what it mirrors of the root. A mirror is
recorded with the local task that opens it (once, across restarts); an upload is recorded
before it is sent and stays the same until the root answers; the root's key is pinned."""

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import mirrors as mirrors_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sessions as sessions_lib

PLAN, W0 = (f"{i:064x}" for i in range(2))
ROUND, SESSION = protocol.TaskKind.AGGREGATE, protocol.TaskKind.BUFFERED


def test_a_mirrored_round_is_opened_once_and_ends_with_the_root_s_answer(store, token, sum_round):
    mirrors, rounds = mirrors_lib.Mirrors(store), rounds_lib.Rounds(store)
    empty = folding.Folder(sum_round[0]).empty()
    plan, broadcast = store.put_blob(b"edge-signed plan"), store.put_blob(b"broadcast")
    options = rounds_lib.CohortOptions(3, over_selection=1 / 3, quorum=1, deadline=60)

    def open_mirror():  # as a restarted edge does: the same request id
        return rounds.create("pop", plan, broadcast, options, empty, request_id="upstream-round-7",
                             on_create=lambda tx, r: mirrors.record(tx, ROUND, 7, r.id))

    first, again = open_mirror(), open_mirror()
    assert first == again and (first.target, first.capacity) == (3, 4)
    (m,) = mirrors.all(pending=True)
    assert (m.kind, m.upstream, m.local, m.uploads, m.outcome) == (ROUND, 7, first.id, 0, "")
    mirrors.finish(m, "accepted", uploads=1)
    assert mirrors.all(pending=True) == []
    assert (mirrors.get(ROUND, 7).outcome, mirrors.get(ROUND, 7).uploads) == ("accepted", 1)
    assert store.counters()["mirrors:accepted"] == 1


def test_a_mirrored_session_sends_each_report_in_one_batch(store):
    mirrors, sessions = mirrors_lib.Mirrors(store), sessions_lib.Sessions(store)
    store.create_population("pop")
    s = sessions.create("pop", PLAN, W0, version=2, buffer_size=2, max_staleness=1,
                        request_id="upstream-session-7",
                        on_create=lambda tx, s: mirrors.record(tx, SESSION, 7, s.id))
    (m,) = mirrors.all()
    assert mirrors.sending(m, available=0, most=2).sending_through is None  # nothing to send
    assert mirrors.sending(m, available=2, most=1).sending_through == 1  # the root's room
    assert mirrors.sending(m, available=2, most=2).sending_through == 1  # the same, until answered
    released = []
    mirrors.sent(m, lambda tx, through: released.append(through))
    m = mirrors.sending(m, available=2, most=2)
    assert (m.uploads, m.forwarded_through, m.sending_through) == (1, 1, 2)
    mirrors.sent(m, lambda tx, through: sessions.release(tx, s.id, through))
    assert released == [1] and sessions.session(s.id).applied_through == 2
    mirrors.finish(m, "closed")
    assert mirrors.all(pending=True) == []


def test_the_root_s_key_is_pinned_on_first_contact(store):
    mirrors = mirrors_lib.Mirrors(store)
    assert mirrors.pinned_key(b"k" * 32) == b"k" * 32
    assert mirrors.pinned_key(b"x" * 32) == b"k" * 32  # the first one stays
