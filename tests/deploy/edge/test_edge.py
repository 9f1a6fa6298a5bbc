"""Edge aggregators end to end: a root, two edges and their clients; the round's result
equals one server's and the simulation runtime's."""

import jax
import numpy as np
import optax

import fedlang as fl
from fedlang import deploy
from fedlang.deploy.edge import edge as edge_lib
from fedlang.learning import algorithms

from ..driver.test_context import _client_batches, _model_fn

CLIENTS = [_client_batches(i) for i in range(6)]


def make_edge(tmp_path, name, root_url, token, **options):
    server = deploy.Server(db=tmp_path / f"{name}.db", port=0, key=tmp_path / f"{name}.key",
                           pace=deploy.Pace(min_retry=0.05, max_retry=0.2), tick=0.05)
    return edge_lib.Edge(server, root_url, token, poll=0.2, **options)


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
    with deploy.Admin(root.url, root.admin_token) as admin:
        admin.create_population("pop")
        edge_tokens = [admin.create_edge(name, "pop") for name in ("east", "west")]
    edges = [make_edge(tmp_path, name, root.url, t) for name, t in zip(("east", "west"), edge_tokens)]
    try:
        urls = []
        for edge in edges:
            assert edge.connect() == "pop"
            urls += [(edge.server.url, edge.create_population())] * 3
            edge.start()
        weights, rounds = run_round(root.url, root.admin_token, urls, client_threads)
        assert rounds[0].reports == 6
        with deploy.Admin(root.url, root.admin_token) as admin:
            status = admin.status()
            shares = admin.edge_shares(status["rounds"][0]["id"])
        assert [(s["edge"], s["state"], s["reports"]) for s in shares] == [
            ("east", "reported", 3), ("west", "reported", 3)]
        assert status["reports"]["accepted"] == 6
        for edge in edges:  # each edge folded its own three clients
            (r,) = edge.state.rounds.rounds()
            assert (r.state, r.reports) == ("closed", 3)
            assert [m.outcome for m in edge.upstream.mirrors()] == ["accepted"]
    finally:
        for edge in edges:
            edge.stop()
    assert_same(weights, one_server)
    assert_same(weights, process.get_model_weights(simulated))
