"""The root's routes for edge aggregators over HTTP: edge tokens, the edge's check-in
(the tasks it may hold seats in) and its seats, blobs kept to the edge's population, and
partial aggregates through the intake (the upload contract itself is
`test_intake.py`'s)."""

import base64

import httpx
import numpy as np
import pytest

from fedlang.core import signing
from fedlang.deploy import protocol
from fedlang.deploy.plans import execution, folding
from fedlang.deploy.plans import round as plan_lib

from .conftest import bearer
from .test_rounds import API, Setup


@pytest.fixture
def root(server_factory, sum_round):
    setup = Setup(server_factory(), sum_round, target=4)
    yield setup
    setup.http.close()


def make_edge(root, name, population="pop"):
    r = root.http.post(f"{API}/admin/edges", headers=root.admin,
                       json={"name": name, "population": population})
    assert r.status_code == 201, r.text
    return bearer(r.json()["token"])


def partial(root, rows, dropped=0):
    folder = folding.Folder(root.plan)
    aggregate = folder.empty()
    for r in rows:
        report = execution.run_plan(root.plan, root.broadcast, {"train": [np.array(r, np.float32)]})
        aggregate = folder.fold(aggregate, folder.check(report))
    return folder.encode_partial(aggregate, len(rows), dropped)


def test_an_edge_joins_reads_its_round_and_forwards_one_partial(root):
    east, west = make_edge(root, "east"), make_edge(root, "west")
    listing = root.http.get(f"{API}/edge/tasks", headers=east).json()
    (r,) = listing["tasks"]
    assert r["kind"] == "aggregate"
    assert (listing["population"], r["id"], r["share"]) == ("pop", root.round["id"], None)
    joined = root.http.post(f"{API}/edge/rounds/{r['id']}/join", headers=east).json()
    assert (joined["share"]["target"], joined["share"]["capacity"]) == (2, 2)
    # the root-signed plan, which the edge verifies with the root's key
    signed = root.http.get(f"{API}/edge/blobs/{joined['plan']}", headers=east).content
    key = root.http.get(f"{API}/status").json()["server"]["public_key"]
    assert listing["public_key"] == key
    plan = plan_lib.RoundPlan.from_bytes(signing.verify(signed, base64.b64decode(key)))
    assert plan.aggregate_type == root.plan.aggregate_type
    body = partial(root, [[1, 2, 3], [4, 5, 6]])
    url = f"{API}/edge/rounds/{r['id']}/partial"
    bound = {**east, **protocol.task_header({"round": r["id"]})}
    first = root.http.put(url, content=body, headers=bound)
    assert first.status_code == 200 and first.json()["replay"] is False, first.text
    again = root.http.put(url, content=body, headers=bound)
    assert again.status_code == 200 and again.json()["replay"] is True
    other = root.http.put(url, content=partial(root, [[1, 1, 1]]), headers=bound)
    assert other.status_code == 409
    west_bound = {**west, **protocol.task_header({"round": r["id"]})}
    not_joined = root.http.put(url, content=body, headers=west_bound)
    assert not_joined.status_code == 403
    root.http.post(f"{API}/edge/rounds/{r['id']}/join", headers=west)
    junk = root.http.put(url, content=b"junk", headers=west_bound)
    assert junk.status_code == 400 and junk.json()["reason"] == "malformed"
    status = root.http.get(f"{API}/admin/rounds/{r['id']}", headers=root.admin).json()
    assert (status["reports"], status["assigned"]) == (2, 4)
    counters = root.http.get(f"{API}/status").json()
    assert counters["reports"]["accepted"] == 2
    assert counters["reports"]["refused"] == {"conflict": 1, "not_assigned": 1, "malformed": 1}


def test_edge_tokens_are_checked_and_revocable(root):
    east = make_edge(root, "east")
    assert root.http.get(f"{API}/edge/tasks", headers=bearer("nope")).status_code == 401
    assert root.http.get(f"{API}/edge/tasks").status_code == 401
    # a client's credential is not an edge token, nor the other way round
    client = bearer(root.clients[0]["credential"])
    assert root.http.get(f"{API}/edge/tasks", headers=client).status_code == 401
    assert root.http.post(f"{API}/checkin", headers=east).status_code == 401
    assert root.http.post(f"{API}/admin/edges", headers=east,
                          json={"name": "x", "population": "pop"}).status_code == 401
    revoked = root.http.delete(f"{API}/admin/edges/east", headers=root.admin)
    assert revoked.status_code == 200 and revoked.json()["revoked"] is not None
    assert root.http.get(f"{API}/edge/tasks", headers=east).status_code == 401


def test_an_edge_sees_only_its_population(root):
    root.http.post(f"{API}/admin/populations", json={"name": "other"}, headers=root.admin)
    stranger = make_edge(root, "stranger", "other")
    assert root.http.get(f"{API}/edge/tasks", headers=stranger).json()["tasks"] == []
    rid = root.round["id"]
    assert root.http.post(f"{API}/edge/rounds/{rid}/join", headers=stranger).status_code == 404
    plan = root.http.get(f"{API}/admin/rounds/{rid}", headers=root.admin).json()["plan"]
    assert root.http.get(f"{API}/edge/blobs/{plan}", headers=stranger).status_code == 404
    body = partial(root, [[1, 2, 3]])
    put = root.http.put(f"{API}/edge/rounds/{rid}/partial", content=body, headers=stranger)
    assert put.status_code == 404


def test_a_partial_larger_than_its_plan_allows_is_refused_before_it_is_read(root):
    east = make_edge(root, "east")
    rid = root.round["id"]
    root.http.post(f"{API}/edge/rounds/{rid}/join", headers=east)
    with httpx.Client(base_url=root.server.url, timeout=30) as h:
        r = h.put(f"{API}/edge/rounds/{rid}/partial", content=b"x" * (3 << 20),
                  headers={**east, **protocol.task_header({"round": rid})})
    assert r.status_code == 413
