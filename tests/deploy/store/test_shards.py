"""Plain rounds' reports folded in memory per process and committed in groups
(`shards.ReportShards`), on SQLite and PostgreSQL: the same admission as one report per
transaction, the same aggregate, and shards of several processes (or of a process that
died) merged at the close."""

import threading

import numpy as np
import pytest

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import shards as shards_lib

from .conftest import enroll
from .test_rounds import open_round, report


@pytest.fixture
def folder(sum_round):
    return folding.Folder(sum_round[0])


@pytest.fixture
def rounds(store, folder):
    return rounds_lib.Rounds(store, lambda plan: folder)


@pytest.fixture
def shards(rounds):
    made = shards_lib.ReportShards(rounds)
    yield made
    made.close()


def take(shards, folder, round_id, client, data):
    return shards.accept(round_id, client, protocol.blob_hash(data), len(data), folder.check(data))


def assigned(rounds, store, token, n):
    clients = enroll(store, n, token=token)
    for c in clients:
        assert isinstance(rounds.checkin(c, "pop"), rounds_lib.Task)
    return clients


def test_reports_are_admitted_as_one_per_transaction_and_the_round_closes_at_its_target(
    rounds, shards, store, folder, token, sum_round
):
    r = open_round(rounds, folder, target=2, over_selection=1.0)
    a, b, c = assigned(rounds, store, token, 3)
    first = report(sum_round, [1, 2, 3])
    assert take(shards, folder, r.id, a, first) is True
    assert take(shards, folder, r.id, a, first) is False  # a replay changes nothing
    with pytest.raises(protocol.Conflict, match="different one"):
        take(shards, folder, r.id, a, report(sum_round, [9, 9, 9]))
    (stranger,) = enroll(store, 1, token=token)
    with pytest.raises(protocol.Forbidden, match="was not assigned"):
        take(shards, folder, r.id, stranger, first)
    assert rounds.round(r.id).reports == 1 and rounds.round(r.id).state == "open"
    assert take(shards, folder, r.id, b, report(sum_round, [0, 1, 0])) is True
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports, row.dropped) == ("closed", 2, 1)
    np.testing.assert_allclose(folder.results(aggregate)[0], [1, 3, 3])
    with pytest.raises(protocol.Gone, match="too late"):
        take(shards, folder, r.id, c, report(sum_round, [0, 0, 1]))
    assert take(shards, folder, r.id, a, first) is False  # its replay, after the close
    assert store.counters()["reports:accepted"] == 2
    with store.transaction() as tx:  # merged into the aggregate at the close
        assert tx.one("SELECT COUNT(*) FROM aggregate_shards")[0] == 0


def test_concurrent_reports_commit_in_groups_and_fold_exactly(
    rounds, shards, store, folder, token, sum_round
):
    n = 24
    r = open_round(rounds, folder, target=n)
    clients = assigned(rounds, store, token, n)
    bodies = [report(sum_round, [i, 1, -i]) for i in range(n)]
    results, errors = [], []

    def upload(i):
        try:
            results.append(take(shards, folder, r.id, clients[i], bodies[i]))
            results.append(take(shards, folder, r.id, clients[i], bodies[i]))  # and its replay
        except Exception as e:
            errors.append(e)

    threads = [threading.Thread(target=upload, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not errors and sorted(results) == [False] * n + [True] * n
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports) == ("closed", n)
    want = [sum(range(n)), n, -sum(range(n))]
    np.testing.assert_allclose(folder.results(aggregate)[0], want)


def test_a_report_that_would_overflow_the_shard_is_refused_and_the_others_stand(
    rounds, shards, store, folder, token, sum_round
):
    r = open_round(rounds, folder, target=3)
    a, b, c = assigned(rounds, store, token, 3)
    assert take(shards, folder, r.id, a, report(sum_round, [3e38, 0, 1]))
    with pytest.raises(folding.ReportError, match="overflow") as refused:
        take(shards, folder, r.id, b, report(sum_round, [3e38, 0, 1]))
    assert refused.value.reason == "overflow"
    assert take(shards, folder, r.id, b, report(sum_round, [-1e38, 0, 1]))  # b may still report
    assert take(shards, folder, r.id, c, report(sum_round, [0, 5, 1]))
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports) == ("closed", 3)
    np.testing.assert_allclose(folder.results(aggregate)[0], [2e38, 5, 3], rtol=1e-6)


def test_shards_of_several_processes_and_of_one_that_died_merge_at_the_close(
    rounds, store, folder, token, sum_round
):
    r = open_round(rounds, folder, target=5)
    clients = assigned(rounds, store, token, 5)
    first, second = shards_lib.ReportShards(rounds), shards_lib.ReportShards(rounds)
    try:
        for i in range(2):
            assert take(first, folder, r.id, clients[i], report(sum_round, [i + 1, 0, 0]))
        for i in range(2, 4):
            assert take(second, folder, r.id, clients[i], report(sum_round, [0, i + 1, 0]))
        # the first process dies: what it acknowledged is in its shard's row
        first = shards_lib.ReportShards(rounds)
        assert rounds.round(r.id).reports == 4
        assert take(first, folder, r.id, clients[0], report(sum_round, [1, 0, 0])) is False
        assert take(first, folder, r.id, clients[4], report(sum_round, [0, 0, 7]))
    finally:
        first.close()
        second.close()
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports) == ("closed", 5)
    np.testing.assert_allclose(folder.results(aggregate)[0], [3, 7, 7])
    with store.transaction() as tx:
        assert tx.one("SELECT reports FROM aggregates WHERE round = ?", (r.id,))[0] == 5


def test_at_the_deadline_a_round_with_shards_closes_with_them(
    rounds, shards, store, folder, token, sum_round, clock
):
    r = open_round(rounds, folder, target=3, quorum=2, deadline=10.0)
    a, b, c = assigned(rounds, store, token, 3)
    take(shards, folder, r.id, a, report(sum_round, [1, 0, 0]))
    take(shards, folder, r.id, b, report(sum_round, [0, 1, 0]))
    clock.now += 11
    with pytest.raises(protocol.Gone):  # refused as late; the round closes
        take(shards, folder, r.id, c, report(sum_round, [0, 0, 1]))
    row, aggregate = rounds.aggregate(r.id)
    assert (row.state, row.reports, row.dropped) == ("closed", 2, 1)
    np.testing.assert_allclose(folder.results(aggregate)[0], [1, 1, 0])


def test_shards_whose_sum_overflows_fail_the_round_with_the_reason(
    rounds, store, folder, token, sum_round
):
    r = open_round(rounds, folder, target=2)
    a, b = assigned(rounds, store, token, 2)
    first, second = shards_lib.ReportShards(rounds), shards_lib.ReportShards(rounds)
    try:  # each process's shard is finite; their sum is not
        assert take(first, folder, r.id, a, report(sum_round, [3e38, 0, 0]))
        assert take(second, folder, r.id, b, report(sum_round, [3e38, 0, 0]))
    finally:
        first.close()
        second.close()
    row = rounds.round(r.id)
    assert row.state == "failed" and "overflow when merged" in row.failure


@pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)  # SQLite: one writer at a time
def test_a_round_closes_when_two_processes_commit_its_last_reports_at_once(
    rounds, store, folder, token, sum_round, monkeypatch
):
    r = open_round(rounds, folder, target=2)
    a, b = assigned(rounds, store, token, 2)
    barrier, read = threading.Barrier(2), rounds.round_for_reports

    def read_together(tx, round_id):  # both groups count before either commits
        row = read(tx, round_id)
        barrier.wait(30)
        return row

    monkeypatch.setattr(rounds, "round_for_reports", read_together)
    first, second = shards_lib.ReportShards(rounds), shards_lib.ReportShards(rounds)
    results = []
    threads = [threading.Thread(target=lambda s, c, v: results.append(
        take(s, folder, r.id, c, report(sum_round, v))), args=args)
        for args in ((first, a, [1, 0, 0]), (second, b, [0, 1, 0]))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=60)
    finally:
        first.close()
        second.close()
    assert results == [True, True]
    row, aggregate = rounds.aggregate(r.id)  # neither group saw the other's report
    assert (row.state, row.reports) == ("closed", 2)
    np.testing.assert_allclose(folder.results(aggregate)[0], [1, 1, 0])


def test_a_rounds_count_reads_its_shards_counts_from_an_index_not_their_data(
    rounds, shards, store, folder, token, sum_round
):
    # SQLite stores a shard's `data` before its `reports`: reading the count from the row
    # would walk the whole aggregate (1.4 ms for an 8 MB one) on every round lookup.
    if store.dialect.name == "postgresql":
        pytest.skip("PostgreSQL keeps large values out of the row (TOAST)")
    r = open_round(rounds, folder, target=2)
    (a, _) = assigned(rounds, store, token, 2)
    assert take(shards, folder, r.id, a, report(sum_round, [1, 2, 3])) is True
    assert rounds.round(r.id).reports == 1
    with store.transaction() as tx:
        plan = [row[3] for row in tx.all(
            f"EXPLAIN QUERY PLAN SELECT {rounds_lib._ROUND_FIELDS} FROM rounds WHERE id = ?",
            (r.id,))]
    assert any("COVERING INDEX aggregate_shards_reports" in step for step in plan), plan
