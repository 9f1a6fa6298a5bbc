"""Buffered (FedBuff) sessions through edge aggregators: a root, edges and their clients
give the model the same reports give sent straight to one server (and the process run
in process); a resent batch is a replay at the root; an edge killed after it
acknowledged reports forwards them after its restart, each once."""

import threading

import httpx
import jax
import numpy as np
import optax
import pytest

from fedlang import deploy
from fedlang.deploy import protocol
from fedlang.deploy.driver import buffered as buffered_driver
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.learning import algorithms

from ..conftest import ServerProcess, wait_for
from ..driver import test_buffered as buffered_tests
from .harness import edge_process, make_edge, population_token, status, two_edges

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def digits():
    dd = buffered_tests._digits()
    clients, _ = dd.partition(10)
    return dd, [buffered_tests._batches(c) for c in clients[:4]]


def _fed_buff(dd, k, max_staleness=2):
    return algorithms.build_fed_buff(dd.model_fn, optax.sgd(0.1), optax.sgd(1.0),
                                     buffer_size=k, max_staleness=max_staleness)


def _assert_same(process, got, want):
    assert process.status(got) == process.status(want)
    g, w = process.get_model_weights(got), process.get_model_weights(want)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def _one_task(client):
    client.max_tasks = client.tasks_done + 1
    client.run()
    assert client.tasks_done == client.max_tasks


def _run_versions(driver, clients, versions, steps):
    """Runs the driver for `steps` steps while, at each version, every client trains it
    once (`versions()`: the versions its server and the edges serve now)."""
    result = {}

    def drive():
        try:
            result["state"] = driver.run(steps, timeout=240)
        except Exception as e:
            result["error"] = e

    t = threading.Thread(target=drive)
    t.start()
    try:
        wait_for(lambda: driver.session_id is not None, "the session")
        for v in range(steps):
            wait_for(lambda v=v: set(versions()) == {v}, f"version {v} everywhere")
            for c in clients:
                _one_task(c)
    finally:
        t.join(timeout=240)
        driver.close()
        for c in clients:
            c.close()
    assert "error" not in result, result
    return result["state"]


def _local_version(edge):
    sessions = edge.state.sessions.sessions()
    return sessions[0].version if sessions and sessions[0].state == "open" else -1


@pytest.mark.slow
def test_a_session_through_two_edges_equals_one_server_and_the_process(
    tmp_path, server_factory, digits
):
    dd, datasets = digits
    process, steps = _fed_buff(dd, 4), 2
    reference = buffered_tests._in_process(process, datasets * steps, 4)

    single = server_factory(tmp_path / "single.db")
    with deploy.Admin(single.url, single.admin_token) as admin:
        token = admin.create_population("pop")
    driver = buffered_driver.BufferedDriver(process, single.url, single.admin_token, "pop",
                                            patience=60)
    clients = [deploy.Client(single.url, "pop", token, {"train": ds}, backoff=(0.05, 0.2))
               for ds in datasets]
    one_server = _run_versions(
        driver, clients, lambda: [single.app_state.sessions.session(driver.session_id).version],
        steps)

    root = server_factory(tmp_path / "root.db")
    edges = two_edges(tmp_path, root)
    try:
        clients = []
        for edge, mine in zip(edges, (datasets[:2], datasets[2:])):
            edge.connect()
            token = edge.create_population()
            clients += [deploy.Client(edge.server.url, "pop", token, {"train": ds},
                                      backoff=(0.05, 0.2)) for ds in mine]
            edge.start()
        driver = buffered_driver.BufferedDriver(process, root.url, root.admin_token, "pop",
                                                patience=60)
        through_edges = _run_versions(driver, clients,
                                      lambda: [_local_version(e) for e in edges], steps)
        session = root.app_state.sessions.session(driver.session_id)
        batches = root.app_state.status()["sessions"][0]
        assert (session.version, session.reports, batches["staleness_histogram"]) == (
            2, 8, {"0": 8})
        for edge in edges:  # each edge forwarded its own clients' four reports, each once
            (m,) = edge.mirrors.all()
            assert (m.forwarded_through, m.sending_through, m.outcome) == (4, None, "")
    finally:
        for edge in edges:
            edge.stop()
    _assert_same(process, through_edges, one_server)
    _assert_same(process, through_edges, reference)


def test_a_resent_batch_is_a_replay_and_each_report_reaches_the_root_once(
    tmp_path, server_factory, digits
):
    dd, datasets = digits
    process = _fed_buff(dd, 4)
    root = server_factory(tmp_path / "root.db")
    with deploy.Admin(root.url, root.admin_token) as admin:
        admin.create_population("pop")
        edge_token = admin.create_edge("east", "pop")
    edge = make_edge(tmp_path, "east", root.url, edge_token)
    driver = buffered_driver.BufferedDriver(process, root.url, root.admin_token, "pop",
                                            patience=60)
    clients = []
    try:
        edge.connect()
        token = edge.create_population()
        edge.server.start()  # the sync passes are run by hand below
        driver.start()
        edge.sync()  # mirrors the session
        clients = [deploy.Client(edge.server.url, "pop", token, {"train": ds},
                                 backoff=(0.05, 0.2)) for ds in datasets[:3]]
        for c in clients[:2]:
            _one_task(c)
        # the edge records its batch of the two reports, sends it, and dies before it
        # records the root's answer (its send is made here by hand)
        sid = driver.session_id
        (m,) = edge.mirrors.all()
        m = edge.mirrors.sending(m, edge.state.sessions.session(m.local).reports, 4)
        assert (m.uploads, m.forwarded_through, m.sending_through) == (0, 0, 2)
        reports = edge.state.sessions.reports(m.local, 0)
        body = buffered_plan.encode_batch([(r.version, r.data) for r in reports])
        headers = {"Authorization": f"Bearer {edge_token}", "Content-Type": protocol.BINARY,
                   **protocol.task_header({"session": sid})}
        with httpx.Client(base_url=root.url, timeout=30, headers=headers) as h:
            first = h.put(f"/v1/edge/sessions/{sid}/batches/1", content=body)
            assert first.status_code == 200, first.text
            assert first.json() == {"session": sid, "batch": 1, "accepted": 2, "stale": 0,
                                    "replay": False}
            # act: the restarted edge sends the batch it was sending again
            assert edge.sync() == 2
            # other bytes for the same batch, and a batch out of order, are refused
            other = h.put(f"/v1/edge/sessions/{sid}/batches/1",
                          content=buffered_plan.encode_batch([(0, reports[0].data)]))
            assert (other.status_code, other.json()["reason"]) == (409, "conflict")
            skipped = h.put(f"/v1/edge/sessions/{sid}/batches/3", content=body)
            assert (skipped.status_code, skipped.json()["reason"]) == (409, "conflict")
            garbled = h.put(f"/v1/edge/sessions/{sid}/batches/2", content=b"FLB1" + body[8:])
            assert (garbled.status_code, garbled.json()["reason"]) == (400, "malformed")
        (m,) = edge.mirrors.all()
        assert (m.uploads, m.forwarded_through, m.sending_through) == (1, 2, None)
        s = root.app_state.sessions.session(sid)
        assert (s.reports, s.pending) == (2, 2)  # each report once
        stored = root.app_state.sessions.reports(sid, 0)
        assert [r.data for r in stored] == [r.data for r in reports]
        assert [r.client for r in stored] == ["edge:east/1.0", "edge:east/1.1"]
        # a third report goes in batch 2, and the buffer's room limits a batch
        _one_task(clients[2])
        assert edge.sync() == 1
        with httpx.Client(base_url=root.url, timeout=30) as h:
            taken = h.get(f"/v1/admin/sessions/{sid}/edges",
                          headers={"Authorization": f"Bearer {root.admin_token}"}).json()
        assert [(b["edge"], b["batch"], b["reports"], b["stale"]) for b in taken] == [
            ("east", 1, 2, 0), ("east", 2, 1, 0)]
    finally:
        for c in clients:
            c.close()
        driver.close()
        edge.stop()


def test_the_session_routes_refuse_strangers_clients_other_populations_and_revoked_edges(
    tmp_path, server_factory, digits
):
    dd, _ = digits
    root = server_factory(tmp_path / "root.db")
    with deploy.Admin(root.url, root.admin_token) as admin:
        token = admin.create_population("pop")
        admin.create_population("other")
        east = admin.create_edge("east", "pop")
        far = admin.create_edge("far", "other")  # an edge, of another population
    driver = buffered_driver.BufferedDriver(_fed_buff(dd, 4), root.url, root.admin_token, "pop",
                                            patience=60)
    try:
        driver.start()
        sid = driver.session_id
        body = buffered_plan.encode_batch([(0, b"not a report")])  # refused before it is read
        with httpx.Client(base_url=root.url, timeout=30) as h:
            client = h.post("/v1/populations/pop/enroll",
                            headers={"Authorization": f"Bearer {token}"}).json()["credential"]

            def calls(credential):
                auth = {} if credential is None else {"Authorization": f"Bearer {credential}"}
                return [
                    h.get("/v1/edge/tasks", headers=auth),
                    h.post(f"/v1/edge/sessions/{sid}/join", headers=auth),
                    h.put(f"/v1/edge/sessions/{sid}/batches/1", content=body,
                          headers={**auth, "Content-Type": protocol.BINARY}),
                ]

            # a stranger, a wrong token, an enrolled client of the population: not edges
            for credential in (None, "nope", client):
                assert [r.status_code for r in calls(credential)] == [401, 401, 401]
            # an edge of another population sees no session and cannot reach this one
            listing, joined, batch = calls(far)
            assert listing.status_code == 200 and listing.json()["tasks"] == []
            assert (joined.status_code, batch.status_code) == (404, 404)
            # the edge's token is not the admin's
            admin_route = h.get(f"/v1/admin/sessions/{sid}/edges",
                                headers={"Authorization": f"Bearer {east}"})
            assert admin_route.status_code == 401
            listing, joined, _ = calls(east)  # the population's edge is let in ...
            assert [(t["kind"], t["id"]) for t in listing.json()["tasks"]] == [("buffered", sid)]
            assert joined.status_code == 200
            with deploy.Admin(root.url, root.admin_token) as admin:
                admin.revoke_edge("east")
            assert [r.status_code for r in calls(east)] == [401, 401, 401]  # ... until revoked
        assert root.app_state.sessions.session(sid).reports == 0  # nothing was taken
    finally:
        driver.close()


def _session(url):
    answer = status(url)
    return answer["sessions"][0] if answer and answer["sessions"] else None


@pytest.mark.slow
def test_an_edge_killed_before_it_forwarded_restarts_and_forwards_each_report_once(
    db_url, tmp_path, digits
):
    dd, datasets = digits
    process = _fed_buff(dd, 2)
    # the reference: two clients straight to the root fill the first buffer; the edge's
    # two clients trained version 0 too, and reach the root after the first step
    state = process.initialize()
    weights, _ = process.client_model(state)
    reports = [process.train(weights, ds) for ds in datasets]
    for r in reports[:2]:
        state = process.fold(state, r, 0)
    state, _ = process.apply(state)
    for r in reports[2:]:
        state = process.fold(state, r, 0)
    reference, _ = process.apply(state)

    root = ServerProcess(db_url, tmp_path).start()  # the root on SQLite, then PostgreSQL
    edge = driver = None
    try:
        with deploy.Admin(root.url, root.admin_token) as admin:
            token = admin.create_population("pop")
            edge = edge_process(tmp_path, "east", root, admin.create_edge("east", "pop"))
        driver = buffered_driver.BufferedDriver(process, root.url, root.admin_token, "pop",
                                                patience=60)
        driver.start()  # the driver does not step yet: the root's buffer stays full
        for ds in datasets[:2]:
            with deploy.Client(root.url, "pop", token, {"train": ds}, backoff=(0.05, 0.2)) as c:
                _one_task(c)
        wait_for(lambda: (s := _session(edge.url)) and s["version"] == 0, "the edge's session")
        edge_token = population_token(edge)
        for ds in datasets[2:]:  # acknowledged by the edge, which cannot forward them
            with deploy.Client(edge.url, "pop", edge_token, {"train": ds},
                               backoff=(0.05, 0.2), patience=60) as c:
                _one_task(c)
        assert _session(edge.url)["accepted"] == 2
        assert _session(root.url)["accepted"] == 2
        edge.kill()
        edge.start()
        state = driver.run(2, timeout=240)  # the driver steps; the edge then forwards
        shown = _session(root.url)
        assert (shown["version"], shown["accepted"]) == (2, 4)
        assert shown["staleness_histogram"] == {"0": 2, "1": 2}
        assert _session(edge.url)["accepted"] == 2
        _assert_same(process, state, reference)
    finally:
        if driver is not None:
            driver.close()
        for p in (edge, root):
            if p is not None:
                p.kill()
