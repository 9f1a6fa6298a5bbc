"""Rounds in the task store: assignment, reports, closing, on SQLite and on PostgreSQL
(`db_url` runs each test on both). Reports are taken as the server takes them, by the
shards (`accept`)."""

import os
import sqlite3
import threading

import numpy as np
import pytest

from fedlang.deploy import protocol
from fedlang.deploy.plans import execution, folding
from fedlang.deploy.store import mirrors as mirrors_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import shards as shards_lib
from fedlang.deploy.store import store as store_lib

from .conftest import enroll


@pytest.fixture
def folder(sum_round):
    return folding.Folder(sum_round[0])


@pytest.fixture
def rounds(store, folder):
    return rounds_lib.Rounds(store, lambda plan: folder)


def report(sum_round, *rows):
    plan, broadcast = sum_round
    return execution.run_plan(plan, broadcast, {"train": [np.array(r, np.float32) for r in rows]})


def open_round(rounds, folder, target=3, population="pop", **options):
    plan = rounds.store.put_blob(b"signed plan")
    broadcast = rounds.store.put_blob(b"broadcast")
    options = rounds_lib.CohortOptions(target, **options)
    return rounds.create(population, plan, broadcast, options, folder.empty())


def accept(rounds, folder, round_id, client, data):
    """Takes a client's report as the server does (`shards.ReportShards`: its writer
    commits it, or raises the refusal). Each call is a process of its own (its own
    shard), as the server's several processes are."""
    shards = shards_lib.ReportShards(rounds)
    try:
        return shards.accept(round_id, client, protocol.blob_hash(data), len(data),
                             folder.check(data))
    finally:
        shards.close()


def test_checkin_assigns_up_to_the_over_selected_cohort(rounds, store, folder, token):
    r = open_round(rounds, folder, target=2, over_selection=0.5)  # capacity 3
    clients = enroll(store, 5, token=token)
    answers = [rounds.checkin(c, "pop") for c in clients]
    tasks = [a for a in answers if isinstance(a, rounds_lib.Task)]
    assert len(tasks) == 3 and all(t.round == r.id for t in tasks)
    waits = [a for a in answers if not isinstance(a, rounds_lib.Task)]
    assert len(waits) == 2 and all(0.25 <= w <= 7.5 for w in waits)
    # a client that checks in again (e.g. restarted) gets its task again, not a second one
    assert rounds.checkin(clients[0], "pop") == tasks[0]
    assert rounds.round(r.id).assigned == 3


def test_a_report_is_folded_once_and_replays_change_nothing(rounds, store, folder, token,
                                                            sum_round, clock):
    r = open_round(rounds, folder, target=3, quorum=1, deadline=60)
    a, b, c = enroll(store, 3, token=token)
    for x in (a, b, c):
        rounds.checkin(x, "pop")
    first = report(sum_round, [1, 2, 3])
    assert accept(rounds, folder, r.id, a, first) is True
    assert accept(rounds, folder, r.id, a, first) is False  # replay: no change
    with pytest.raises(protocol.Conflict, match="different one"):
        accept(rounds, folder, r.id, a, report(sum_round, [9, 9, 9]))
    assert rounds.round(r.id).reports == 1
    # the client is not given the round it reported for again
    assert not isinstance(rounds.checkin(a, "pop"), rounds_lib.Task)
    clock.now += 61
    assert rounds.close_due() == 1  # closed with its quorum: its shards merged
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports, row.dropped) == ("closed", 1, 2)
    np.testing.assert_allclose(folder.results(aggregate)[0], [1, 2, 3])


def test_reports_for_tasks_not_given_are_forbidden(rounds, store, folder, token, sum_round):
    r = open_round(rounds, folder)
    (a,) = enroll(store, 1, token=token)
    with pytest.raises(protocol.Forbidden, match="was not assigned"):
        accept(rounds, folder, r.id, a, report(sum_round, [1, 1, 1]))
    assert rounds.round(r.id).reports == 0


def test_the_round_closes_at_its_target_and_late_reports_are_refused(rounds, store, folder, token, sum_round):
    r = open_round(rounds, folder, target=2, over_selection=0.5)
    a, b, c = enroll(store, 3, token=token)
    for x in (a, b, c):
        rounds.checkin(x, "pop")
    accept(rounds, folder, r.id, a, report(sum_round, [1, 0, 0]))
    accept(rounds, folder, r.id, b, report(sum_round, [0, 1, 0]))
    row = rounds.round(r.id)
    assert (row.state, row.reports, row.dropped) == ("closed", 2, 1)
    with pytest.raises(protocol.Gone, match="too late"):
        accept(rounds, folder, r.id, c, report(sum_round, [0, 0, 1]))
    rounds.count_refusal("late", r.id)
    assert rounds.round(r.id).late == 1
    np.testing.assert_allclose(folder.results(rounds.aggregate(r.id)[1])[0], [1, 1, 0])
    assert store.counters()["dropouts"] == 1


def test_at_the_deadline_a_round_closes_with_its_quorum_or_fails(rounds, store, folder, token, sum_round, clock):
    ok = open_round(rounds, folder, target=3, quorum=1, deadline=10.0)
    a, b = enroll(store, 2, token=token)
    rounds.checkin(a, "pop")
    rounds.checkin(b, "pop")
    accept(rounds, folder, ok.id, a, report(sum_round, [1, 0, 0]))
    short = open_round(rounds, folder, target=3, quorum=2, deadline=10.0)
    rounds.checkin(a, "pop")
    clock.now += 11
    assert rounds.close_due() == 2
    assert rounds.round(ok.id).state == "closed" and rounds.round(ok.id).dropped == 1
    failed = rounds.round(short.id)
    assert failed.state == "failed"
    assert "0 of the 2 reports its quorum needs" in failed.failure


def test_round_creation_is_idempotent_by_request_id(rounds, store, folder, token):
    options = rounds_lib.CohortOptions(2)
    first = rounds.create("pop", "p", "b", options, folder.empty(), request_id="req-1")
    again = rounds.create("pop", "p", "b", options, folder.empty(), request_id="req-1")
    assert first.id == again.id and len(rounds.rounds()) == 1
    with pytest.raises(protocol.NotFound, match="create it first"):
        rounds.create("other", "p", "b", options, folder.empty())


@pytest.mark.parametrize("bad", [
    dict(target=0), dict(target=2, quorum=3), dict(target=2, over_selection=-1),
    dict(target=2, deadline=0.0), dict(target=2, deadline=float("nan")),
    dict(target=2, deadline=10.0, stage_timeout=11.0), dict(target=2, stage_timeout=0.0),
])
def test_cohort_options_are_checked(bad):
    with pytest.raises(ValueError, match="Expected"):
        rounds_lib.CohortOptions(**bad)


def test_a_secure_rounds_stage_timeout_defaults_to_a_quarter_of_the_deadline():
    assert rounds_lib.CohortOptions(2, deadline=100.0).stage_seconds == 25.0
    assert rounds_lib.CohortOptions(2, deadline=100.0, stage_timeout=5.0).stage_seconds == 5.0


def test_concurrent_reports_are_each_folded_exactly_once(rounds, store, folder, token, sum_round):
    n = 8
    r = open_round(rounds, folder, target=n)
    clients = enroll(store, n, token=token)
    for c in clients:
        rounds.checkin(c, "pop")
    reports = [report(sum_round, [i, 1, 0]) for i in range(n)]
    errors = []

    def upload(i):
        try:
            for _ in range(2):  # every client also replays its report
                accept(rounds, folder, r.id, clients[i], reports[i])
        except Exception as e:  # pragma: no cover - shown by the assertion
            errors.append(e)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports) == ("closed", n)
    np.testing.assert_allclose(folder.results(aggregate)[0], [sum(range(n)), n, 0])


def test_the_state_survives_reopening_the_database(db_url, clock, folder, sum_round):
    s = store_lib.Store(db_url, clock=clock)
    rounds = rounds_lib.Rounds(s, lambda plan: folder)
    token = s.create_population("pop")
    r = open_round(rounds, folder, target=2)
    (a,) = enroll(s, 1, token=token)
    rounds.checkin(a, "pop")
    accept(rounds, folder, r.id, a, report(sum_round, [1, 2, 3]))
    s.close()
    again = store_lib.Store(db_url, clock=clock)
    try:
        rounds = rounds_lib.Rounds(again, lambda plan: folder)
        assert rounds.round(r.id).reports == 1
        assert accept(rounds, folder, r.id, a, report(sum_round, [1, 2, 3])) is False
        h, made = again.admin_token()  # made on first use, then kept (as a hash)
        assert made is not None and again.admin_token() == (h, None)
        assert again.get_meta("admin_token_sha256") == h.encode() == store_lib.secret_hash(made).encode()
    finally:
        again.close()


def test_a_finished_population_tells_clients_to_stop(rounds, store, token):
    (a,) = enroll(store, 1, token=token)
    store.finish_population("pop")
    assert rounds.checkin(a, "pop") is None
    with pytest.raises(protocol.NotFound):
        store.finish_population("nope")



# -- space: aggregates and blobs no task needs are deleted


def closed_round(rounds, aggregate, population="pop", broadcast=b"broadcast", on_create=None):
    """A round of `population` closed with one report, folded into its aggregate
    (`aggregate`, the bytes it starts with, reversed: the aggregate is written again)."""
    store = rounds.store
    plan, model = store.put_blob(b"signed plan"), store.put_blob(broadcast)
    r = rounds.create(population, plan, model, rounds_lib.CohortOptions(1), aggregate,
                      on_create=on_create)
    with store.transaction(write=True) as tx:
        rounds_lib.fold_report(tx, r.id, "c-1", lambda a: a[::-1], store.clock())
    rounds.close_if_done(r.id)
    return rounds.round(r.id)


def test_the_latest_closed_rounds_of_a_population_keep_their_aggregates(rounds, store, folder,
                                                                         token):
    # arrange: in "pop", r1 (mirrored by an edge that has not forwarded it yet), r2 failed,
    # r3 and r4 closed, r5 open; in "other", r6 closed
    store.create_population("other")
    mirrors = mirrors_lib.Mirrors(store)
    r1 = closed_round(rounds, b"one", on_create=lambda tx, r: mirrors.record(
        tx, protocol.TaskKind.AGGREGATE, 7, r.id))
    r2 = rounds.stop(open_round(rounds, folder).id, "stopped by the test")
    r3, r4 = closed_round(rounds, b"three"), closed_round(rounds, b"four")
    r5 = open_round(rounds, folder)
    r6 = closed_round(rounds, b"six", population="other")
    assert [r.state for r in (r1, r2, r3, r4, r5, r6)] == [
        "closed", "failed", "closed", "closed", "open", "closed"]
    # act
    assert rounds.sweep_aggregates() == 1
    # assert: r2's is deleted (two later rounds ended), r1's kept until it is forwarded
    with pytest.raises(protocol.Gone, match=f"round {r2.id}'s deleted") as e:
        rounds.aggregate(r2.id)
    assert e.value.reason == "deleted" and rounds.aggregate_value(r2.id)[1] is None
    assert [rounds.aggregate(r.id)[1] for r in (r1, r3, r4, r6)] == [
        b"eno", b"eerht", b"ruof", b"xis"]
    assert rounds.aggregate(r5.id)[1] == folder.empty()
    (m,) = mirrors.all()
    mirrors.finish(m, "accepted")
    assert rounds.sweep_aggregates() == 1
    with pytest.raises(protocol.Gone):
        rounds.aggregate(r1.id)
    r7 = closed_round(rounds, b"seven")  # r3's turn: two later rounds closed
    assert rounds.sweep_aggregates() == 1
    assert rounds.aggregate_value(r3.id)[1] is None
    assert [rounds.aggregate(r.id)[1] for r in (r4, r7, r6)] == [b"ruof", b"neves", b"xis"]


def stored_bytes(store):
    with store.transaction() as tx:
        return int(tx.one("SELECT COALESCE(SUM(size), 0) FROM value_heads")[0])


def test_ten_rounds_of_a_model_take_a_few_times_its_size_not_ten(rounds, store, token, clock):
    # A model of S bytes: each round uploads it (its broadcast) and writes an aggregate of
    # 2 S (float64); the driver opens a round a minute, and blobs are kept a minute.
    size = 4 << 20
    store.blob_grace = 60.0
    for _ in range(10):
        closed_round(rounds, os.urandom(2 * size), broadcast=os.urandom(size))
        clock.now += 61
        rounds.sweep()
    # the aggregates of the 2 latest rounds, and the latest model (30 S kept otherwise)
    assert stored_bytes(store) <= 5 * size + 100
    if store.dialect.name == "sqlite":  # and the file shrank as they went
        path = store.dialect.path
        with sqlite3.connect(path) as conn:
            conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        on_disk = os.path.getsize(path) + os.path.getsize(path + "-wal")
        assert on_disk <= 8 * size, f"{on_disk / size:.1f} times the model's size"
