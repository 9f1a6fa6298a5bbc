"""Edge aggregators at the root's store, on SQLite and PostgreSQL: credentials, seats of
rounds split among edges, and partial aggregates, which stand for the reports of an
edge's clients, taken by the same shards as any report (`shards.ReportShards`)."""

import numpy as np
import pytest

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import schema
from fedlang.deploy.store import shards as shards_lib

from .conftest import as_version, enroll
from .test_rounds import accept, open_round, report


@pytest.fixture
def folder(sum_round):
    return folding.Folder(sum_round[0])


@pytest.fixture
def rounds(store, folder):
    return rounds_lib.Rounds(store, lambda plan: folder)


@pytest.fixture
def edges(rounds):
    return edges_lib.Edges(rounds)


@pytest.fixture
def shards(rounds):
    made = shards_lib.ReportShards(rounds)
    yield made
    made.close()


def partial(folder, sum_round, reports, dropped=0):
    """An edge's upload: the reports of `reports` (rows lists) folded together."""
    aggregate = folder.empty()
    for rows in reports:
        aggregate = folder.fold(aggregate, folder.check(report(sum_round, *rows)))
    return folder.encode_partial(aggregate, len(reports), dropped)


def forward(shards, folder, round_id, edge, body):
    """An edge's partial taken as the server takes it: by the shards, as any report."""
    return shards.accept(round_id, edges_lib.holder(edge), protocol.blob_hash(body), len(body),
                         folder.check_partial(body))


def test_an_edge_token_is_kept_hashed_and_can_be_revoked(edges, store, token):
    t = edges.create("east", "pop")
    assert edges.authenticate(t) == ("east", "pop")
    with store.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM edges WHERE token_hash = ?", (t,))[0] == 0
    with pytest.raises(protocol.Conflict):
        edges.create("east", "pop")
    with pytest.raises(protocol.NotFound):
        edges.create("west", "nope")
    edges.revoke("east")
    with pytest.raises(protocol.Unauthorized, match="revoked"):
        edges.authenticate(t)
    with pytest.raises(protocol.Unauthorized, match="unknown"):
        edges.authenticate("not-a-token")


def test_shares_split_the_round_and_never_exceed_its_capacity(edges, rounds, store, folder, token):
    edges.create("east", "pop")
    edges.create("west", "pop")
    r = open_round(rounds, folder, target=5, over_selection=0.2)  # capacity 6
    (client,) = enroll(store, 1, token=token)
    assert isinstance(rounds.checkin(client, "pop"), rounds_lib.Task)  # one seat taken
    _, east = edges.join("east", "pop", r.id)
    assert (east.target, east.capacity) == (3, 3)
    assert edges.join("east", "pop", r.id)[1] == east  # joining again: the same share
    _, west = edges.join("west", "pop", r.id)
    assert (west.target, west.capacity) == (2, 2)  # what was left
    assert rounds.round(r.id).assigned == 6
    edges.create("north", "pop")
    with pytest.raises(protocol.Conflict, match="all 6 taken"):
        edges.join("north", "pop", r.id)
    store.create_population("other")
    edges.create("south", "other")
    with pytest.raises(protocol.NotFound):  # another population's round does not exist
        edges.join("south", "other", r.id)


def test_a_partial_is_merged_once_counting_its_reports(edges, rounds, shards, store, folder,
                                                       token, sum_round):
    edges.create("east", "pop")
    edges.create("west", "pop")
    r = open_round(rounds, folder, target=4)
    edges.join("east", "pop", r.id)
    edges.join("west", "pop", r.id)
    body = partial(folder, sum_round, [[[1, 2, 3]], [[4, 5, 6]]], dropped=0)
    assert forward(shards, folder, r.id, "east", body) is True
    assert forward(shards, folder, r.id, "east", body) is False  # a replay: nothing changes
    assert rounds.round(r.id).reports == 2
    other = partial(folder, sum_round, [[[1, 1, 1]]])
    with pytest.raises(protocol.Conflict):
        forward(shards, folder, r.id, "east", other)
    assert rounds.precheck(rounds.round(r.id), edges_lib.holder("east"),
                           protocol.blob_hash(body)) is True
    with pytest.raises(protocol.Forbidden):  # an edge that did not join
        edges.create("north", "pop")
        forward(shards, folder, r.id, "north", other)
    forward(shards, folder, r.id, "west", partial(folder, sum_round, [[[7, 8, 9]], [[1, 0, 0]]]))
    done, aggregate = rounds.aggregate(r.id)
    assert (done.state, done.reports) == ("closed", 4)  # closed at its target
    # the same aggregate as the four reports folded one by one at one server
    single = open_round(rounds, folder, target=4)
    clients = enroll(store, 4, token=token)
    for c in clients:
        rounds.checkin(c, "pop")
    for c, rows in zip(clients, [[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 0, 0]]):
        accept(rounds, folder, single.id, c, report(sum_round, rows))
    np.testing.assert_array_equal(folder.results(aggregate)[0],
                                  folder.results(rounds.aggregate(single.id)[1])[0])
    assert [(s.edge, s.state, s.reports) for s in edges.shares(r.id)] == [
        ("east", "reported", 2), ("west", "reported", 2)]


def test_an_edge_gone_at_the_deadline_counts_its_seats_as_dropouts(edges, rounds, shards, store,
                                                                 folder, token, sum_round, clock):
    edges.create("east", "pop")
    edges.create("west", "pop")
    r = open_round(rounds, folder, target=4, quorum=1, deadline=60)
    edges.join("east", "pop", r.id)
    edges.join("west", "pop", r.id)
    forward(shards, folder, r.id, "east", partial(folder, sum_round, [[[1, 2, 3]]], dropped=1))
    with pytest.raises(protocol.BadRequest, match="at most 2"):  # more than its seats
        forward(shards, folder, r.id, "west", partial(folder, sum_round, [[[1, 2, 3]]], dropped=2))
    clock.now += 61
    rounds.close_due()
    done = rounds.round(r.id)
    # east's dropout, and west's two seats: it never forwarded
    assert (done.state, done.reports, done.dropped) == ("closed", 1, 3)
    assert [s.state for s in edges.shares(r.id)] == ["reported", "dropped"]
    with pytest.raises(protocol.Gone):  # too late now
        forward(shards, folder, r.id, "west", partial(folder, sum_round, [[[1, 2, 3]]]))


def test_partials_that_do_not_add_up_are_refused(folder, sum_round):
    body = partial(folder, sum_round, [[[1, 2, 3]]])
    lying = folder.encode_partial(folding.Folder(sum_round[0]).empty(), 1, 0)
    assert folder.check_partial(body).reports == 1
    with pytest.raises(folding.ReportError):
        folder.check_partial(b"junk")
    assert folder.check_partial(lying).reports == 1  # a sum has no count to check against
    with pytest.raises(folding.ReportError, match="non-negative"):
        folder.check_partial(folder.encode_partial(folder.empty(), -1, 0))


def test_a_version_5_database_gains_the_edge_tables(store, folder):
    with store.transaction(write=True) as tx:
        tx.run("DROP TABLE edges")
        as_version(tx, 5)
    store.close()
    reopened = type(store)(store.dialect.path if hasattr(store.dialect, "path") else store.dialect.url)
    try:
        assert reopened.get_meta("schema") == str(schema.VERSION).encode()
        assert edges_lib.Edges(rounds_lib.Rounds(reopened)).edges() == []
    finally:
        reopened.close()


def test_concurrent_joins_and_checkins_never_exceed_the_round_s_capacity(edges, rounds, store,
                                                                         folder, token):
    import threading

    for name in ("east", "west"):
        edges.create(name, "pop")
    r = open_round(rounds, folder, target=8)  # capacity 8: 4 seats per edge, or clients
    clients = enroll(store, 8, token=token)
    results, start = [], threading.Barrier(10)

    def act(fn, *args):
        start.wait()
        try:
            results.append(fn(*args))
        except protocol.Conflict as e:
            results.append(e)

    threads = [threading.Thread(target=act, args=(edges.join, name, "pop", r.id))
               for name in ("east", "west")]
    threads += [threading.Thread(target=act, args=(rounds.checkin, c, "pop")) for c in clients]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    seats = sum(s.capacity for s in edges.shares(r.id))
    tasks = sum(isinstance(x, rounds_lib.Task) for x in results)
    assert seats + tasks == rounds.round(r.id).assigned == 8


def open_secure(rounds, folder, target, **options):
    """A secure round run by edges: kind `secure`, no SecAgg+ state at the root."""
    plan = rounds.store.put_blob(b"signed plan")
    broadcast = rounds.store.put_blob(b"broadcast")
    cohort = rounds_lib.CohortOptions(target, **options)
    return rounds.create("pop", plan, broadcast, cohort, folder.empty(), kind=rounds_lib.SECURE)


def test_a_secure_round_run_by_edges_splits_its_seats_evenly_and_assigns_none_at_the_root(
    edges, rounds, shards, store, folder, sum_round, token, clock
):
    six = rounds_lib.CohortOptions(6, over_selection=1 / 6)  # 7 seats
    assert not edges.check_secure("pop", six)  # no edges: the root runs it
    for name in ("east", "west", "north"):
        edges.create(name, "pop")
    assert edges.check_secure("pop", six)
    with pytest.raises(protocol.BadRequest, match=r"found 5 seats in all; .* at least 6 seats"):
        edges.check_secure("pop", rounds_lib.CohortOptions(5))
    r = open_secure(rounds, folder, 6, over_selection=1 / 6, quorum=2, deadline=60)
    (client,) = enroll(store, 1, token=token)
    assert not isinstance(rounds.checkin(client, "pop"), rounds_lib.Task)  # the edges' seats
    assert [(x.id, s) for x, s in edges.open_rounds("east", "pop")] == [(r.id, None)]
    shares = [edges.join(name, "pop", r.id)[1] for name in ("east", "west", "north")]
    assert [(s.capacity, s.target) for s in shares] == [(3, 2), (2, 2), (2, 2)]
    assert rounds.round(r.id).assigned == 7
    assert forward(shards, folder, r.id, "east", partial(folder, sum_round, [[[1, 2, 3]]] * 2, 1))
    clock.now += 61  # the others never forward: their seats are dropouts
    assert rounds.close_due() == 1
    closed = rounds.round(r.id)
    assert (closed.state, closed.reports, closed.dropped) == ("closed", 2, 5)
    np.testing.assert_allclose(folder.results(rounds.aggregate(r.id)[1])[0], [2, 4, 6])


def test_an_edge_whose_share_of_a_secure_round_is_too_small_for_a_group_is_refused(
    edges, rounds, store, folder, token
):
    edges.create("east", "pop")
    edges.create("west", "pop")
    r = open_secure(rounds, folder, 5)  # 2 and 3 seats for two edges
    edges.create("north", "pop")  # made after: three shares of 2, 2 and 1
    assert [edges.join(n, "pop", r.id)[1].capacity for n in ("east", "west")] == [2, 2]
    with pytest.raises(protocol.Conflict, match="at least 2 seats for an edge's group"):
        edges.join("north", "pop", r.id)
    # A secure round the root runs itself (opened before its population had edges) is
    # not an edge's to join.
    own = open_secure(rounds, folder, 4)
    with store.transaction(write=True) as tx:
        tx.run("INSERT INTO secure_rounds (round, stage, stage_timeout, stage_deadline, state)"
               " VALUES (?, 1, 10, 0, ?)", (own.id, b""))
    assert own.id not in [x.id for x, _ in edges.open_rounds("east", "pop")]
    with pytest.raises(protocol.Conflict, match="run by the root"):
        edges.join("east", "pop", own.id)
