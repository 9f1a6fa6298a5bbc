"""Secure rounds through edge aggregators: each edge runs SecAgg+ over its own clients and
forwards its group's sum; the root merges the groups' partials. The result equals one
server's secure round and the simulation runtime's exactly (the groups' sums are exact
integer sums of the clients' wrapped inputs: see docs/deploy.md, "Secure rounds through
edges"); a share too small for a group is refused; an edge killed (-9) amid its
clients' masked inputs goes on from its store."""

import time

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.deploy import protocol
from fedlang.deploy.store import edges as edges_store

from ..conftest import bounds_of, capture, run_driver, secure_and_plain, wait_for
from .harness import RootAndEdges, local_round, status, two_edges


def _data(n, seed=0):
    """n clients' datasets of `secure_and_plain`'s points."""
    rng = np.random.default_rng(seed)
    return [[{"a": np.float32(0), "n": np.int32(v)} for v in rng.integers(-40, 90, size=4)]
            for _ in range(n)]


CLIENTS = _data(6)


def _simulated(data):
    with fl.runtime.simulation_context():
        return secure_and_plain(data)


def _assert_equal(got, want):
    for k in ("bits", "mod", "plain"):
        for name in ("q", "r"):
            np.testing.assert_array_equal(got[k][name], want[k][name])


def _run(driver_url, admin_token, client_urls, client_threads, **options):
    """One round of `secure_and_plain` over `CLIENTS` (client i at `client_urls[i]`)."""
    errors = [client_threads(deploy.Client(url, "pop", token, {"train": batches}, max_tasks=1,
                                           patience=60, backoff=(0.05, 0.5)))
              for (url, token), batches in zip(client_urls, CLIENTS)]
    with deploy.deployment_context(driver_url, admin_token, "pop", target=len(CLIENTS),
                                   deadline=60, patience=60, bounds=bounds_of(secure_and_plain),
                                   **options) as ctx:
        value = secure_and_plain(deploy.client_data("train"))
    assert not any(errors), errors
    return value, ctx.rounds


def test_a_secure_round_through_two_edges_equals_one_server_and_the_simulation(
    tmp_path, server_factory, client_threads
):
    want = _simulated(CLIENTS)
    single = server_factory(tmp_path / "single.db")
    with deploy.Admin(single.url, single.admin_token) as admin:
        token = admin.create_population("pop")
    one_server, _ = _run(single.url, single.admin_token, [(single.url, token)] * 6,
                         client_threads)
    _assert_equal(one_server, want)

    root = server_factory(tmp_path / "root.db")
    edges = two_edges(tmp_path, root)
    try:
        urls = []
        for edge in edges:
            assert edge.connect() == "pop"
            urls += [(edge.server.url, edge.create_population())] * 3
            edge.start()
        value, rounds = _run(root.url, root.admin_token, urls, client_threads)
        _assert_equal(value, want)
        r = rounds[0].details
        assert (r["kind"], r["state"], r["stage"], r["reports"]) == ("secure", "closed", 0, 6)
        with deploy.Admin(root.url, root.admin_token) as admin:
            shares = admin.edge_shares(r["id"])
        assert [(s["edge"], s["state"], s["capacity"], s["reports"]) for s in shares] == [
            ("east", "reported", 3, 3), ("west", "reported", 3, 3)]
        # The root ran no SecAgg+ and assigned no client (its seats are the edges'): what
        # it holds of the round is the two groups' partials, merged.
        with root.app_state.store.transaction() as tx:
            assert tx.all("SELECT * FROM secure_rounds") == []
            assert tx.all("SELECT client, seats FROM assignments ORDER BY client") == [
                ("edge:east", 3), ("edge:west", 3)]
        for i, edge in enumerate(edges):  # each edge's partial is its own group's sum
            (local,) = edge.state.rounds.rounds()
            assert (local.kind, local.state, local.stage, local.reports) == ("secure", "closed",
                                                                             5, 3)
            _, aggregate = edge.state.rounds.aggregate(local.id)
            group = _simulated(CLIENTS[3 * i: 3 * i + 3])
            got = edge.state.verified.folder(local.plan).results(aggregate)
            np.testing.assert_array_equal(got[0][0], group["bits"]["q"])  # bits first, q first
            assert [m.outcome for m in edge.mirrors.all()] == ["accepted"]
    finally:
        for edge in edges:
            edge.stop()


def test_a_secure_round_with_too_few_seats_for_each_edge_is_refused_and_never_assigned_at_the_root(
    tmp_path, server_factory
):
    root = server_factory(tmp_path / "root.db")
    plan, broadcast = capture(secure_and_plain, deploy.client_data("train"))
    with deploy.Admin(root.url, root.admin_token) as admin:
        token = admin.create_population("pop")
        for name in ("east", "west"):
            admin.create_edge(name, "pop")
        plan_hash, broadcast_hash = admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast)
        least = 2 * edges_store.MIN_SECURE_GROUP
        with pytest.raises(protocol.BadRequest,
                           match=rf"at least {edges_store.MIN_SECURE_GROUP} seats for each edge "
                                 rf"of population 'pop' \(2 edges\).*at least {least} seats"):
            admin.create_round("pop", plan_hash, broadcast_hash, target=3)
        r = admin.create_round("pop", plan_hash, broadcast_hash, target=4, deadline=30)
        assert (r["kind"], r["stage"]) == ("secure", 0)
    # A client of the population at the root is never given a seat of it: they are the edges'.
    with httpx.Client(base_url=root.url, timeout=10) as h:
        auth = {"Authorization": f"Bearer {token}"}
        enrolled = h.post("/v1/populations/pop/enroll", headers=auth).json()
        checkin = h.post("/v1/checkin",
                         headers={"Authorization": f"Bearer {enrolled['credential']}"}).json()
        assert checkin.get("task") is None, checkin


@pytest.mark.slow
def test_an_edge_whose_group_fails_forwards_no_report_and_the_root_closes_with_the_other_group(
    tmp_path, server_factory, client_threads
):
    # About 20 s: east's one client is too few for a group (its quorum, 2), so east's
    # SecAgg+ fails when stage 1 times out; the root closes at its deadline, at its quorum.
    root = server_factory(tmp_path / "root.db")
    edges = two_edges(tmp_path, root)
    clients = []
    try:
        urls = []
        for edge in edges:
            edge.connect()
            urls += [(edge.server.url, edge.create_population())] * 3
            edge.start()
        clients = [deploy.Client(url, "pop", token, {"train": batches}, max_tasks=1, patience=5,
                                 backoff=(0.05, 0.5))
                   for (url, token), batches in list(zip(urls, CLIENTS))[2:]]
        errors = [client_threads(c) for c in clients]
        result = {}
        run_driver(root.url, root.admin_token, result, secure_and_plain, target=6, quorum=3, deadline=20)
        assert "error" not in result, result
        _assert_equal(result["value"], _simulated(CLIENTS[3:]))
        r = result["rounds"][0].details
        assert (r["state"], r["reports"], r["dropped"]) == ("closed", 3, 1)
        with deploy.Admin(root.url, root.admin_token) as admin:
            shares = admin.edge_shares(r["id"])
        assert [(s["edge"], s["state"], s["reports"], s["dropped"]) for s in shares] == [
            ("east", "reported", 0, 1), ("west", "reported", 3, 0)]
        (local,) = edges[0].state.rounds.rounds()
        assert (local.state, local.assigned) == ("failed", 1)
        assert "Expected at least 2 clients (the round's quorum)" in local.failure
        assert not any(errors[1:])
    finally:
        for c in clients:  # east's client would check in again: stopped before its edge
            c.stop()
        for edge in edges:
            edge.stop()


@pytest.mark.slow
def test_an_edge_killed_amid_its_clients_masked_inputs_goes_on_and_loses_none_it_acknowledged(
    db_url, tmp_path, client_threads, gates
):
    with RootAndEdges(db_url, tmp_path) as d:  # the root on SQLite, then PostgreSQL
        east = d.east
        gate = gates(east.url)  # east's clients' stage messages pass through it
        gate.hold(3)
        errors = d.clients(client_threads, CLIENTS,
                           urls=[gate.url] * 3 + [d.west.url] * 3)
        d.drive(secure_and_plain, target=6, deadline=120)
        wait_for(lambda: gate.waiting[3] == 3, "east's three masked inputs")
        gate.release(3, 2)  # two are acknowledged by east, in its store
        wait_for(lambda: local_round(east.url)["reports"] == 2, "two masked inputs at east")
        east.kill()
        gate.release(3)  # the third meets a dead edge (502) and is retried
        time.sleep(0.5)
        east.start()
        result = d.join()
        _assert_equal(result["value"], _simulated(CLIENTS))
        assert result["rounds"][0].reports == 6
        local = local_round(east.url)  # each masked input once, the protocol finished
        assert (local["kind"], local["state"], local["stage"], local["reports"]) == (
            "secure", "closed", 5, 3)
        answer = status(d.root.url)
        assert (answer["rounds"][0]["state"], answer["reports"]["accepted"]) == ("closed", 6)
        assert not any(errors)
