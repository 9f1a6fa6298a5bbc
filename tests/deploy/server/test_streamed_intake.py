"""A large model's reports through a real server (issue 40): with `--stream-report-bytes`
below a round's report size, each report is checked as it arrives and written to storage
in chunks, never held; the round's close folds them a slice at a time. The answers, the
refusals and the aggregate are those of reports held whole; nothing of a refused or cut
report is left in the store."""

import dataclasses

import numpy as np
import pytest

from fedlang import deploy
from fedlang.deploy.plans import folding

from .conftest import Clock
from .test_rounds import Setup


def _servers(server_factory, db_url, sum_round, streamed, target=3):
    limits = deploy.Limits(stream_report_bytes=0 if streamed else 64 << 20)
    server = server_factory(db=db_url, clock=Clock(), credential_ttl=3600.0, limits=limits)
    return Setup(server, sum_round, target=target, clients=4)


def _leftovers(server):
    """Stored values no row names, and values still staged (none may be left)."""
    with server.store.transaction() as tx:
        named = {str(v) for (v,) in tx.all(
            "SELECT value FROM blobs UNION SELECT value FROM aggregates"
            " UNION SELECT value FROM aggregate_shards UNION SELECT value FROM stored_reports")}
        heads = {str(v) for (v,) in tx.all("SELECT id FROM value_heads")}
        staged = tx.all("SELECT id FROM value_heads WHERE staged IS NOT NULL")
        orphans = tx.all("SELECT DISTINCT value FROM value_chunks WHERE value NOT IN"
                         " (SELECT id FROM value_heads)")
    return heads - named, staged, orphans


def test_streamed_reports_fold_to_the_aggregate_of_reports_held_whole(server_factory, db_url,
                                                                      sum_round):
    rows = [[1.5, -2, 3], [4, 5.25, -6], [0.125, 8, 9]]
    folder = folding.Folder(sum_round[0])
    s = _servers(server_factory, db_url, sum_round, streamed=True)
    try:
        held = folder.empty()  # the aggregate of the reports held whole, as before
        for client, row in zip(s.clients, rows):
            s.checkin(client)
            report = s.report(row, [1, 1, 1])
            held = folder.fold(held, folder.check(report))
            first = s.put(client, report)
            assert first.status_code == 200, first.text
            again = s.put(client, report)  # a replay: accepted again, nothing changed
            assert again.status_code == 200, again.text
        # the round closes right after the last answer (its close folds the reports)
        r = s.http.get(f"/v1/admin/rounds/{s.round['id']}", headers=s.admin,
                       params={"wait": 30, "seen": 3}).json()
        assert (r["state"], r["reports"]) == ("closed", 3)
        aggregate = s.server.app_state.rounds.aggregate(s.round["id"])[1]
        with s.server.store.transaction() as tx:  # folded, then deleted
            assert tx.all("SELECT * FROM stored_reports") == []
        assert _leftovers(s.server) == (set(), [], [])
    finally:
        s.http.close()
    assert bytes(aggregate) == bytes(held)
    (total,) = folder.results(aggregate)
    np.testing.assert_array_equal(total, np.sum(rows, axis=0) + 3)


def test_a_streamed_report_is_refused_as_one_held_whole_and_nothing_is_kept(
        server_factory, db_url, sum_round):
    s = _servers(server_factory, db_url, sum_round, streamed=True)
    try:
        a, b, c, _ = s.clients
        for client in (a, b, c):
            s.checkin(client)
        honest = s.report([1, 2, 3])
        cut = s.put(a, honest[: len(honest) - 7])
        nan = s.put(a, s.report([np.nan, 2, 3]))
        other = s.put(a, b"FEDL" + bytes(100))
        assert [(x.status_code, x.json()["reason"]) for x in (cut, nan, other)] == [
            (400, "malformed"), (400, "non_finite"), (400, "malformed")]
        assert s.put(a, honest).status_code == 200
        conflict = s.put(a, s.report([3, 2, 1]))  # another report for the same seat
        assert conflict.status_code == 409, conflict.text
        # a report that could make the float32 sum overflow: refused, the round goes on
        big = s.put(b, s.report([3e38, 0, 0]))
        assert big.status_code == 200, big.text
        over = s.put(c, s.report([3e38, 0, 0]))
        assert (over.status_code, over.json()["reason"]) == (400, "overflow"), over.text
        r = s.http.get(f"/v1/admin/rounds/{s.round['id']}", headers=s.admin).json()
        assert (r["state"], r["reports"]) == ("open", 2)
        assert r["refused"] >= 4
        assert _leftovers(s.server)[1:] == ([], [])
        with s.server.store.transaction() as tx:
            assert len(tx.all("SELECT * FROM stored_reports")) == 2
    finally:
        s.http.close()


@pytest.mark.parametrize("changed", [False, True])
def test_the_close_folds_ahead_of_its_transaction_unless_its_inputs_changed(
        server_factory, db_url, sum_round, changed):
    # The new aggregate is written before the close's write transaction, which only
    # swaps it in; when the fold's inputs changed meanwhile (here: made to look so), the
    # close folds in its transaction and what was written ahead is deleted.
    s = _servers(server_factory, db_url, sum_round, streamed=True, target=2)
    rounds = s.server.app_state.rounds
    made = []
    fold_ahead = rounds._fold_ahead

    def recording(round_id):
        ahead = fold_ahead(round_id)
        if ahead is not None and changed:
            ahead = dataclasses.replace(ahead, inputs=("another", [], []))
        made.append(ahead)
        return ahead

    rounds._fold_ahead = recording
    rows = [[1, 2, 3], [0.5, -4, 8]]
    folder = folding.Folder(sum_round[0])
    try:
        held = folder.empty()
        for client, row in zip(s.clients, rows):
            s.checkin(client)
            report = s.report(row)
            held = folder.fold(held, folder.check(report))
            assert s.put(client, report).status_code == 200
        r = s.http.get(f"/v1/admin/rounds/{s.round['id']}", headers=s.admin,
                       params={"wait": 30, "seen": 2}).json()
        assert (r["state"], r["reports"]) == ("closed", 2)
        assert [a is not None for a in made] == [True]
        aggregate = rounds.aggregate(s.round["id"])[1]
        with s.server.store.transaction() as tx:  # the value written ahead, or a new one
            (value,) = tx.one("SELECT value FROM aggregates WHERE round = ?", (s.round["id"],))
        assert (str(value) == made[0].staging.id) is not changed
        assert _leftovers(s.server) == (set(), [], [])
    finally:
        s.http.close()
    assert bytes(aggregate) == bytes(held)
