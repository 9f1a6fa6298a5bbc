"""The task store, one suite on SQLite and on PostgreSQL (`db_url` runs each test on both)."""

import threading

import numpy as np
import pytest

from fedlang.deploy import aggregation, execution, protocol
from fedlang.deploy import store as store_lib


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
def folder(sum_round):
    return aggregation.Folder(sum_round[0])


def report(sum_round, *rows):
    plan, broadcast = sum_round
    return execution.run_plan(plan, broadcast, {"train": [np.array(r, np.float32) for r in rows]})


def open_round(store, folder, target=3, population="pop", **options):
    plan = store.put_blob(b"signed plan")
    broadcast = store.put_blob(b"broadcast")
    options = store_lib.CohortOptions(target, **options)
    return store.create_round(population, plan, broadcast, options, folder.empty())


def enroll(store, n, population="pop", token=None, ttl=3600.0):
    return [store.enroll(population, token, ttl)[0] for _ in range(n)]


@pytest.fixture
def token(store):
    return store.create_population("pop")


def accept(store, folder, round_id, client, data):
    checked = folder.check(data)
    return store.accept_report(round_id, client, protocol.blob_hash(data), len(data),
                               lambda agg: folder.fold(agg, checked))


def test_enrollment_needs_the_population_token_and_credentials_expire(store, token, clock):
    with pytest.raises(protocol.Unauthorized, match="enrollment token of population 'pop'"):
        store.enroll("pop", "wrong", 60.0)
    with pytest.raises(protocol.Unauthorized, match="unknown population"):
        store.enroll("nope", token, 60.0)
    client_id, credential, _ = store.enroll("pop", token, 60.0)
    assert store.authenticate(credential) == (client_id, "pop")
    with pytest.raises(protocol.Unauthorized, match="unknown one"):
        store.authenticate("not-a-credential")
    clock.now += 61
    with pytest.raises(protocol.Unauthorized, match="expired") as e:
        store.authenticate(credential)
    assert e.value.reason == "expired"
    assert store.populations()[0]["clients"] == 1
    with pytest.raises(protocol.Conflict, match="exists"):
        store.create_population("pop")


def test_blobs_are_content_addressed(store):
    h = store.put_blob(b"abc")
    assert h == protocol.blob_hash(b"abc") and store.put_blob(b"abc") == h
    assert store.get_blob(h) == b"abc" and store.has_blob(h)
    with pytest.raises(protocol.NotFound):
        store.get_blob("0" * 64)


def test_checkin_assigns_up_to_the_over_selected_cohort(store, folder, token):
    r = open_round(store, folder, target=2, over_selection=0.5)  # capacity 3
    clients = enroll(store, 5, token=token)
    answers = [store.checkin(c, "pop") for c in clients]
    tasks = [a for a in answers if isinstance(a, store_lib.Task)]
    assert len(tasks) == 3 and all(t.round == r.id for t in tasks)
    waits = [a for a in answers if not isinstance(a, store_lib.Task)]
    assert len(waits) == 2 and all(0.25 <= w <= 7.5 for w in waits)
    # a client that checks in again (e.g. restarted) gets its task again, not a second one
    assert store.checkin(clients[0], "pop") == tasks[0]
    assert store.round(r.id).assigned == 3


def test_a_report_is_folded_once_and_replays_change_nothing(store, folder, token, sum_round):
    r = open_round(store, folder, target=3)
    a, b, c = enroll(store, 3, token=token)
    for x in (a, b, c):
        store.checkin(x, "pop")
    first = report(sum_round, [1, 2, 3])
    assert accept(store, folder, r.id, a, first) is True
    assert accept(store, folder, r.id, a, first) is False  # replay: no change
    with pytest.raises(protocol.Conflict, match="different one"):
        accept(store, folder, r.id, a, report(sum_round, [9, 9, 9]))
    row, aggregate = store.aggregate(r.id)
    assert row.reports == 1
    np.testing.assert_allclose(folder.results(aggregate)[0], [1, 2, 3])
    # the client is not given the round it reported for again
    assert not isinstance(store.checkin(a, "pop"), store_lib.Task)


def test_reports_for_tasks_not_given_are_forbidden(store, folder, token, sum_round):
    r = open_round(store, folder)
    (a,) = enroll(store, 1, token=token)
    with pytest.raises(protocol.Forbidden, match="was not assigned"):
        accept(store, folder, r.id, a, report(sum_round, [1, 1, 1]))
    assert store.round(r.id).reports == 0


def test_the_round_closes_at_its_target_and_late_reports_are_refused(store, folder, token, sum_round):
    r = open_round(store, folder, target=2, over_selection=0.5)
    a, b, c = enroll(store, 3, token=token)
    for x in (a, b, c):
        store.checkin(x, "pop")
    accept(store, folder, r.id, a, report(sum_round, [1, 0, 0]))
    accept(store, folder, r.id, b, report(sum_round, [0, 1, 0]))
    row = store.round(r.id)
    assert (row.state, row.reports, row.dropped) == ("closed", 2, 1)
    with pytest.raises(protocol.Gone, match="too late"):
        accept(store, folder, r.id, c, report(sum_round, [0, 0, 1]))
    store.count_refusal("late", r.id)
    assert store.round(r.id).late == 1
    np.testing.assert_allclose(folder.results(store.aggregate(r.id)[1])[0], [1, 1, 0])
    assert store.counters()["dropouts"] == 1


def test_at_the_deadline_a_round_closes_with_its_quorum_or_fails(store, folder, token, sum_round, clock):
    ok = open_round(store, folder, target=3, quorum=1, deadline=10.0)
    a, b = enroll(store, 2, token=token)
    store.checkin(a, "pop")
    store.checkin(b, "pop")
    accept(store, folder, ok.id, a, report(sum_round, [1, 0, 0]))
    short = open_round(store, folder, target=3, quorum=2, deadline=10.0)
    store.checkin(a, "pop")
    clock.now += 11
    assert store.close_due_rounds() == 2
    assert store.round(ok.id).state == "closed" and store.round(ok.id).dropped == 1
    failed = store.round(short.id)
    assert failed.state == "failed"
    assert "0 of the 2 reports its quorum needs" in failed.failure


def test_round_creation_is_idempotent_by_request_id(store, folder, token):
    options = store_lib.CohortOptions(2)
    first = store.create_round("pop", "p", "b", options, folder.empty(), request_id="req-1")
    again = store.create_round("pop", "p", "b", options, folder.empty(), request_id="req-1")
    assert first.id == again.id and len(store.rounds()) == 1
    with pytest.raises(protocol.NotFound, match="create it first"):
        store.create_round("other", "p", "b", options, folder.empty())


@pytest.mark.parametrize("bad", [
    dict(target=0), dict(target=2, quorum=3), dict(target=2, over_selection=-1),
    dict(target=2, deadline=0.0), dict(target=2, deadline=float("nan")),
    dict(target=2, deadline=10.0, stage_timeout=11.0), dict(target=2, stage_timeout=0.0),
])
def test_cohort_options_are_checked(bad):
    with pytest.raises(ValueError, match="Expected"):
        store_lib.CohortOptions(**bad)


def test_a_secure_rounds_stage_timeout_defaults_to_a_quarter_of_the_deadline():
    assert store_lib.CohortOptions(2, deadline=100.0).stage_seconds == 25.0
    assert store_lib.CohortOptions(2, deadline=100.0, stage_timeout=5.0).stage_seconds == 5.0


def test_concurrent_reports_are_each_folded_exactly_once(store, folder, token, sum_round):
    n = 8
    r = open_round(store, folder, target=n)
    clients = enroll(store, n, token=token)
    for c in clients:
        store.checkin(c, "pop")
    reports = [report(sum_round, [i, 1, 0]) for i in range(n)]
    errors = []

    def upload(i):
        try:
            for _ in range(2):  # every client also replays its report
                accept(store, folder, r.id, clients[i], reports[i])
        except Exception as e:  # pragma: no cover - shown by the assertion
            errors.append(e)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    row, aggregate = store.aggregate(r.id)
    assert (row.state, row.reports) == ("closed", n)
    np.testing.assert_allclose(folder.results(aggregate)[0], [sum(range(n)), n, 0])


def test_the_state_survives_reopening_the_database(db_url, clock, folder, sum_round):
    s = store_lib.Store(db_url, clock=clock)
    token = s.create_population("pop")
    r = open_round(s, folder, target=2)
    (a,) = enroll(s, 1, token=token)
    s.checkin(a, "pop")
    accept(s, folder, r.id, a, report(sum_round, [1, 2, 3]))
    s.close()
    again = store_lib.Store(db_url, clock=clock)
    try:
        assert again.round(r.id).reports == 1
        assert accept(again, folder, r.id, a, report(sum_round, [1, 2, 3])) is False
        assert again.setdefault_meta("k", b"1") == b"1" and again.setdefault_meta("k", b"2") == b"1"
    finally:
        again.close()


def test_a_finished_population_tells_clients_to_stop(store, token):
    (a,) = enroll(store, 1, token=token)
    store.finish_population("pop")
    assert store.checkin(a, "pop") is None
    with pytest.raises(protocol.NotFound):
        store.finish_population("nope")


def test_database_urls_are_checked(tmp_path):
    with pytest.raises(ValueError, match="Expected a database URL"):
        store_lib.Store("mysql://x/y")
