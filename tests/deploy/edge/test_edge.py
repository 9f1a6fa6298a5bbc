"""Edge aggregators end to end: a root, two edges and their clients; the round's result
equals one server's and the simulation runtime's."""

import time

import jax
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.deploy.edge import sync as edge_lib
from fedlang.learning import algorithms

from ..conftest import Gated, batch_sum, wait_for
from ..driver.test_context import _client_batches, _model_fn
from .harness import RootAndEdges, local_round, make_edge, status, two_edges

CLIENTS = [_client_batches(i) for i in range(6)]


def run_round(driver_url, admin_token, client_urls, client_threads, **options):
    """One FedAvg round of `CLIENTS` (client i at `client_urls[i]`: (url, token))."""
    process = algorithms.build_weighted_fed_avg(_model_fn, optax.sgd(0.5))
    errors = [client_threads(deploy.Client(url, "pop", token, {"train": batches}, max_tasks=1,
                                           patience=60, backoff=(0.05, 0.5)))
              for (url, token), batches in zip(client_urls, CLIENTS)]
    with deploy.deployment_context(driver_url, admin_token, "pop", target=len(CLIENTS),
                                   deadline=60, patience=60, **options) as ctx:
        state, _ = process.next(process.initialize(), deploy.client_data("train"))
    assert not any(errors), errors
    return process.get_model_weights(state), ctx.rounds


def assert_same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)


def test_a_round_through_two_edges_equals_one_server_and_the_simulation(
    tmp_path, server_factory, client_threads
):
    process = algorithms.build_weighted_fed_avg(_model_fn, optax.sgd(0.5))
    with fl.runtime.simulation_context():
        simulated, _ = process.next(process.initialize(), CLIENTS)
    single = server_factory(tmp_path / "single.db")
    with deploy.Admin(single.url, single.admin_token) as admin:
        token = admin.create_population("pop")
    one_server, _ = run_round(single.url, single.admin_token, [(single.url, token)] * 6,
                              client_threads)

    root = server_factory(tmp_path / "root.db")
    edges = two_edges(tmp_path, root)
    try:
        urls = []
        for edge in edges:
            assert edge.connect() == "pop"
            urls += [(edge.server.url, edge.create_population())] * 3
            edge.start()
        weights, rounds = run_round(root.url, root.admin_token, urls, client_threads)
        assert rounds[0].reports == 6
        with deploy.Admin(root.url, root.admin_token) as admin:
            answer = admin.status()
            shares = admin.edge_shares(answer["rounds"][0]["id"])
        assert [(s["edge"], s["state"], s["reports"]) for s in shares] == [
            ("east", "reported", 3), ("west", "reported", 3)]
        assert answer["reports"]["accepted"] == 6
        for edge in edges:  # each edge folded its own three clients
            (r,) = edge.state.rounds.rounds()
            assert (r.state, r.reports) == ("closed", 3)
            assert [m.outcome for m in edge.mirrors.all()] == ["accepted"]
        with deploy.Admin(root.url, root.admin_token) as admin:
            admin.finish_population("pop")  # the edges' clients are told so too
        for edge in edges:
            wait_for(lambda e=edge: e.state.store.populations()[0]["finished"], "finished",
                     timeout=30)
    finally:
        for edge in edges:
            edge.stop()
    assert_same(weights, one_server)
    assert_same(weights, process.get_model_weights(simulated))


@pytest.mark.slow
def test_an_edge_killed_mid_round_restarts_and_forwards_every_report_it_acknowledged(
    db_url, tmp_path, client_threads
):
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(6)]
    with RootAndEdges(db_url, tmp_path) as d:  # the root on SQLite, then PostgreSQL
        try:
            east = d.east
            errors = d.clients(client_threads, gates)
            d.drive(batch_sum, target=6, deadline=120)
            wait_for(lambda: (r := local_round(east.url)) and r["assigned"] == 3,
                     "east's clients")
            for g in gates[:2]:  # two of east's clients report, acknowledged by east only
                g.release.set()
            wait_for(lambda: local_round(east.url)["reports"] == 2, "two reports at east")
            east.kill()
            for g in gates[2:]:  # the others finish while east is down; east's retry
                g.release.set()
            time.sleep(0.5)
            east.start()
            result = d.join()
            want = sum(np.full((2, 3), i + 1, np.float32).sum(axis=0) for i in range(6))
            np.testing.assert_allclose(result["value"], want)
            assert result["rounds"][0].reports == 6
            local = local_round(east.url)
            assert (local["state"], local["reports"]) == ("closed", 3)  # each report once
            assert status(d.root.url)["reports"]["accepted"] == 6
            assert not any(errors)
        finally:
            for g in gates:
                g.release.set()


@pytest.mark.slow
def test_a_killed_ephemeral_edge_s_clients_are_dropouts_and_the_round_closes(
    tmp_path, client_threads
):
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(6)]
    with RootAndEdges(tmp_path / "root.db", tmp_path, west_args=["--ephemeral"]) as d:
        try:
            errors = d.clients(client_threads, gates, patience=5)
            d.drive(batch_sum, target=6, quorum=3, deadline=20)
            wait_for(lambda: (r := local_round(d.west.url)) and r["assigned"] == 3,
                     "west's clients")
            d.west.kill()  # with its store: nothing of its clients reaches the root
            for g in gates[:3]:
                g.release.set()
            result = d.join(timeout=120)
            want = sum(np.full((2, 3), i + 1, np.float32).sum(axis=0) for i in range(3))
            np.testing.assert_allclose(result["value"], want)
            (r,) = status(d.root.url)["rounds"]
            assert (r["state"], r["reports"], r["dropped"]) == ("closed", 3, 3)
            assert not any(errors[:3])
        finally:
            for g in gates:
                g.release.set()


def test_an_edge_refuses_a_root_whose_key_is_not_the_one_it_pinned(tmp_path, server_factory):
    root = server_factory(tmp_path / "root.db")
    with deploy.Admin(root.url, root.admin_token) as admin:
        admin.create_population("pop")
        token = admin.create_edge("east", "pop")
    edge = make_edge(tmp_path, "east", root.url, token, upstream_key=bytes(32))
    try:
        with pytest.raises(edge_lib.KeyMismatch, match=r"Expected the root .* to sign with the key"):
            edge.connect()
    finally:
        edge.stop()
