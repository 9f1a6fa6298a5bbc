"""Buffered (FedBuff) sessions over HTTP on 127.0.0.1: the task a client gets, what it
uploads, refusals (stale, bad bytes, not given), and the status endpoint."""

import base64

import httpx
import numpy as np
import pytest
import rich.console

import fedlang as fl
from fedlang import deploy
from fedlang.cli import deploy as deploy_cli
from fedlang.core import serialization
from fedlang.deploy import protocol
from fedlang.deploy.plans import buffered as buffered_plan

from .conftest import bearer

API = "/v1"
WEIGHTS = fl.to_type({"w": fl.TensorType(np.float32, [3])})
BATCHES = fl.SequenceType(fl.to_type({"x": fl.TensorType(np.float32, [None, 3])}))


@fl.jax_computation(WEIGHTS, BATCHES)
def train(weights, ds):
    """The report: the weights minus the client's column sums, and its row count."""
    total = ds.reduce(
        (np.zeros(3, np.float32), np.float32(0)),
        lambda s, b: (s[0] + b["x"].sum(axis=0), s[1] + b["x"].shape[0]),
    )
    return {"delta": weights["w"] - total[0], "n": total[1]}


PLAN = buffered_plan.BufferedPlan.build(train)


def weights(v):
    return serialization.serialize_value({"w": np.full(3, v, np.float32)}, WEIGHTS)


class Session:
    """A server with a population, an open buffered session (K=2, max staleness 1) and
    enrolled clients."""

    def __init__(self, server, k=2, max_staleness=1, clients=3):
        self.server = server
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)
        self.token = self.post("/admin/populations", json={"name": "pop"}).json()["token"]
        self.session = self.post("/admin/sessions", json={
            "population": "pop", "plan": self.upload(PLAN.to_bytes()),
            "weights": self.upload(weights(0)), "buffer_size": k, "max_staleness": max_staleness,
        }).json()
        self.clients = [
            self.http.post(f"{API}/populations/pop/enroll", headers=bearer(self.token)).json()
            for _ in range(clients)
        ]

    def post(self, path, status=(200, 201), **kwargs):
        r = self.http.post(API + path, headers=self.admin, **kwargs)
        assert r.status_code in status, r.text
        return r

    def upload(self, data):
        return self.post("/admin/blobs", content=data).json()["hash"]

    def checkin(self, client):
        return self.http.post(f"{API}/checkin", headers=bearer(client["credential"])).json()

    def put(self, client, version, data):
        sid = self.session['id']
        return self.http.put(f"{API}/sessions/{sid}/reports/{version}",
                             content=data, headers={**bearer(client["credential"]),
                             **protocol.task_header({"session": sid, "version": version})})

    def publish(self, version, through):
        return self.post(f"/admin/sessions/{self.session['id']}/versions", json={
            "version": version, "weights": self.upload(weights(version)),
            "server_state": self.upload(b"state %d" % version), "through": through,
        }).json()

    def status(self):
        return self.http.get(f"{API}/status").json()["sessions"][0]


@pytest.fixture
def session(server_factory):
    s = Session(server_factory())
    yield s
    s.http.close()


def _report(rows, version=0):
    return PLAN.run(weights(version), {"train": [{"x": np.asarray(rows, np.float32)}]})


def test_a_client_gets_the_signed_plan_and_the_current_weights(session):
    task = session.checkin(session.clients[0])["task"]
    assert (task["kind"], task["session"], task["round"], task["version"]) == (
        "buffered", session.session["id"], None, 0)
    key = base64.b64decode(session.clients[0]["public_key"])
    signed = session.http.get(f"{API}/blobs/{task['plan']}",
                              headers=bearer(session.clients[0]["credential"])).content
    plan = buffered_plan.load(signed, key)  # verified against the pinned key
    assert plan.report_type == PLAN.report_type and plan.weights_type == WEIGHTS
    blob = session.http.get(f"{API}/blobs/{task['broadcast']}",
                            headers=bearer(session.clients[0]["credential"])).content
    assert blob == weights(0)


def test_an_uploaded_report_is_stored_as_sent_and_a_replay_changes_nothing(session):
    c = session.clients[0]
    session.checkin(c)
    report = _report([[1, 2, 3], [1, 1, 1]])
    first = session.put(c, 0, report)
    assert first.status_code == 200 and first.json()["replay"] is False
    again = session.put(c, 0, report)
    assert again.status_code == 200 and again.json()["replay"] is True
    items = session.http.get(f"{API}/admin/sessions/{session.session['id']}/reports",
                             headers=session.admin).json()
    assert [(i["seq"], i["version"], i["staleness"]) for i in items] == [(1, 0, 0)]
    value = serialization.deserialize_value(base64.b64decode(items[0]["data"]))
    np.testing.assert_array_equal(value["delta"], [-2, -3, -4])
    assert value["n"] == 2
    assert session.status()["buffer_fill"] == 1


@pytest.mark.parametrize("bad, reason", [
    (b"not a value", "malformed"),
    (serialization.serialize_value({"w": np.zeros(3, np.float32)}, WEIGHTS), "malformed"),
    ("nan", "non_finite"),
    (b"x" * (1 << 21), "too_large"),
])
def test_bad_uploads_are_refused_with_a_reason_and_change_nothing(session, bad, reason):
    c = session.clients[0]
    session.checkin(c)
    if bad == "nan":
        bad = serialization.serialize_value(
            {"delta": np.array([np.nan, 0, 0], np.float32), "n": np.float32(1)}, PLAN.report_type)
    r = session.put(c, 0, bad)
    assert 400 <= r.status_code < 500 and r.json()["reason"] == reason, r.text
    assert session.status()["accepted"] == 0
    assert session.put(c, 0, _report([[1, 1, 1]])).status_code == 200  # still may report


def test_a_report_for_a_version_not_given_is_refused(session):
    r = session.put(session.clients[0], 0, _report([[1, 1, 1]]))
    assert r.status_code == 403 and "check in" in r.json()["detail"]


def test_stale_reports_are_refused_the_client_told_and_the_status_counts_them(session):
    a, b, c = session.clients
    for client in (a, b, c):
        session.checkin(client)  # all train version 0
    assert session.put(a, 0, _report([[1, 1, 1]])).status_code == 200
    assert session.put(b, 0, _report([[2, 2, 2]])).status_code == 200
    full = session.put(c, 0, _report([[3, 3, 3]]))  # K=2 waiting: 503, clients retry
    assert full.status_code == 503 and full.json()["reason"] == "buffer_full"
    session.publish(1, through=2)
    session.publish(2, through=2)  # an empty step, for the test: c is now 2 versions behind
    stale = session.put(c, 0, _report([[3, 3, 3]]))
    assert stale.status_code == 410 and stale.json()["reason"] == "stale"
    assert "staleness 2" in stale.json()["detail"]
    assert session.checkin(c)["task"]["version"] == 2  # it may train the current version
    status = session.status()
    assert status == {
        "id": 1, "population": "pop", "state": "open", "version": 2, "buffer_fill": 0,
        "buffer_size": 2, "max_staleness": 1, "accepted": 2, "refused_stale": 1,
        "staleness_histogram": {"0": 2},
    }
    console = rich.console.Console(width=200, record=True)
    console.print(deploy_cli.status_tables(session.http.get(f"{API}/status").json()))
    shown = console.export_text()
    assert "Buffered sessions" in shown and "0/2" in shown and "0: 2" in shown


def test_a_client_trains_and_reports_through_the_client_loop(session, client_threads):
    rows = np.array([[1, 2, 3]], np.float32)
    client = deploy.Client(session.server.url, "pop", session.token, {"train": [{"x": rows}]},
                           max_tasks=1, backoff=(0.05, 0.2))
    errors = client_threads(client)
    items = []
    for _ in range(600):
        items = session.http.get(f"{API}/admin/sessions/{session.session['id']}/reports",
                                 headers=session.admin).json()
        if items:
            break
        import time

        time.sleep(0.05)
    assert not errors and len(items) == 1
    value = serialization.deserialize_value(base64.b64decode(items[0]["data"]))
    np.testing.assert_array_equal(value["delta"], -rows[0])


def test_publishing_needs_the_plan_s_weights_and_a_stored_state(session):
    sid = session.session["id"]
    r = session.http.post(f"{API}/admin/sessions/{sid}/versions", headers=session.admin, json={
        "version": 1, "weights": session.upload(b"junk"), "server_state": "0" * 64, "through": 0})
    assert r.status_code == 400 and "model weights" in r.json()["detail"]
    r = session.http.post(f"{API}/admin/sessions/{sid}/versions", headers=session.admin, json={
        "version": 1, "weights": session.upload(weights(1)), "server_state": "0" * 64,
        "through": 0})
    assert r.status_code == 404 and "server state" in r.json()["detail"]
