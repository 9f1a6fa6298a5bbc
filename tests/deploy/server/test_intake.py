"""The upload contract, one test for every kind of upload on every database: a plain
round's report, a secure round's masked input (stage 3, which carries the plain report),
a buffered session's report, an edge aggregator's partial aggregate of a round (one
upload standing for its clients' reports) and an edge's batch of session reports all
pass the one intake (`server/intake.py`), so each is accepted, replayed, refused with the
same status and reason, and counted the same way.

Each kind is a harness with uploaders `a` and `b`, which were given the task, and `c`,
which was not; `good(name)` is a valid upload of that uploader, `other`, `malformed` and
`non_finite` variants of it."""

import base64
import json
import threading
import time

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import serialization, structure
from fedlang.deploy import protocol, secagg
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import execution, folding

from ..conftest import POINT, capture, vector_sum, wait_for
from .conftest import Clock, bearer

API = "/v1"


def task_header(task):
    """The `Fedlang-Task` header of an upload computed for `task` (written out here as
    docs/deploy.md gives it: canonical JSON of its round, session and version)."""
    named = {k: task.get(k) for k in ("round", "session", "version")}
    return {"Fedlang-Task": json.dumps(named, sort_keys=True, separators=(",", ":"))}


TOO_LARGE = b"\0" * (3 << 20)  # above every limit of these small plans


class Harness:
    """A population `pop` on a server, enrolled clients `a`, `b`, `c` (and `d`, given
    the task but silent), and the admin's view of the task."""

    closed_reason = "late"
    c_checks_in = True  # and finds the task full (rounds); a session has room for all
    # what `c`'s upload gets: (status, reason, counted, counted in the task)
    not_given = (403, "not_assigned", True, True)

    def __init__(self, server, clock):
        self.server, self.clock = server, clock
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)
        token = self.ok(self.http.post(f"{API}/admin/populations", json={"name": "pop"},
                                       headers=self.admin))["token"]
        self.open_task()
        self.credentials = {}
        for name in "abdc":
            enrolled = self.ok(self.http.post(f"{API}/populations/pop/enroll",
                                              headers=bearer(token)))
            self.credentials[name] = enrolled["credential"]
            if name != "c" or self.c_checks_in:
                task = self.ok(self.http.post(f"{API}/checkin", headers=bearer(enrolled["credential"])))
                assert (task.get("task") is None) == (name == "c"), task

    @staticmethod
    def ok(response):
        assert response.status_code in (200, 201), response.text
        return response.json()

    def blob(self, data):
        return self.ok(self.http.post(f"{API}/admin/blobs", content=data, headers=self.admin))["hash"]

    def put(self, name, body, task=None, computed_for=None):
        """`name`'s upload of `body` to `task` (this one by default), computed for task
        `computed_for` (the same by default: its `Fedlang-Task` header)."""
        headers = {} if name is None else bearer(self.credentials[name])
        headers.update(task_header(self.bound(computed_for or task or self.task)))
        return self.http.put(self.path(task or self.task), content=body, headers=headers)

    def bound(self, task):
        """The task an upload to `task` answers (`protocol.task_of`)."""
        return {"round": task}

    def good(self, name):
        return self.report([1, 2, 3])

    def other(self, name):
        return self.report([9, 9, 9])

    def malformed(self, name):
        return b"not a report"

    def non_finite(self, name):
        return self.report([np.inf, 0, 0])

    def close(self):
        """Ends the round at its deadline, on the server's clock."""
        self.clock.now += 3600
        end = time.monotonic() + 30
        while self.task_row()["state"] == "open":
            assert time.monotonic() < end, "the round did not end at its deadline"
            time.sleep(0.02)

    def task_row(self):
        return self.ok(self.http.get(f"{API}/admin/rounds/{self.task}", headers=self.admin))

    def accepted(self):
        return self.task_row()["reports"]

    def task_refusals(self):
        r = self.task_row()
        return {"late": r["late"], "refused": r["refused"]}

    def counted_in_task(self, reason):
        """How a round counts a refused upload: late ones as late, the others as refused."""
        return {"late": 1, "refused": 0} if reason == "late" else {"late": 0, "refused": 1}


class Plain(Harness):
    """A plain round of `vector_sum` (target 3, so it stays open)."""

    def open_task(self):
        self.plan, broadcast = capture(vector_sum, deploy.client_data("train"))
        self.broadcast = broadcast
        self.task = self.ok(self.http.post(f"{API}/admin/rounds", headers=self.admin, json={
            "population": "pop", "plan": self.blob(self.plan.to_bytes()),
            "broadcast": self.blob(broadcast), "target": 3, "deadline": 600.0,
        }))["id"]

    def path(self, task):
        return f"{API}/rounds/{task}/report"

    def report(self, row):
        return execution.run_plan(self.plan, self.broadcast,
                                  {"train": [np.array(row, np.float32)]})


@fl.jax_computation(fl.SequenceType(POINT))
def _count(ds):
    return ds.reduce(np.int32(0), lambda s, p: s + p["n"])


@fl.jax_computation(fl.SequenceType(POINT))
def _total(ds):
    return ds.reduce(np.float32(0), lambda s, p: s + p["a"])


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(POINT)))
def secure_count_and_total(data):
    """A secure sum of counts, and a plain sum of floats (so a report can be non-finite)."""
    return {"count": fl.federated_secure_sum_bitwidth(fl.federated_map(_count, data), 8),
            "total": fl.federated_sum(fl.federated_map(_total, data))}


class Secure(Harness):
    """A secure round (target 3) whose clients a, b, d took part in stages 1 and 2: the
    uploads are stage 3's masked inputs, each with its client's plain report."""

    def open_task(self):
        # the plain total carries the contract's extremes (3e38, NaN): any finite value
        bounds = deploy.ReportBounds(unbounded=("[1]",))
        self.plan, self.broadcast = capture(secure_count_and_total, deploy.client_data("d"),
                                            bounds=bounds)
        self.task = self.ok(self.http.post(f"{API}/admin/rounds", headers=self.admin, json={
            "population": "pop", "plan": self.blob(self.plan.to_bytes()),
            "broadcast": self.blob(self.broadcast), "target": 3, "deadline": 600.0,
            "stage_timeout": 100.0,
        }))["id"]

    def __init__(self, server, clock):
        super().__init__(server, clock)
        self.sa, self.masked = {}, {}
        for stage in (secagg.Stage.ADVERTISE_KEYS, secagg.Stage.SHARE_KEYS):
            for name in "abd":
                request = self.request(name)
                if stage == secagg.Stage.ADVERTISE_KEYS:
                    self.sa[name] = secagg.SecAggClient(self.client_id(name), request)
                    body = self.sa[name].advertise_keys()
                else:
                    body = self.sa[name].share_keys(request)
                self.ok(self.http.put(f"{API}/rounds/{self.task}/secagg/{int(stage)}",
                                      content=body, headers={**bearer(self.credentials[name]),
                                      **task_header({"round": self.task})}))
        assert self.task_row()["stage"] == secagg.Stage.MASKED_INPUT
        for name in "ab":
            parts = self.parts(name, 1.0)
            self.masked[name] = self.sa[name].masked_input(self.request(name), parts.secure)

    def client_id(self, name):
        return self.server.store.authenticate(self.credentials[name])[0]

    def request(self, name):
        step = self.ok(self.http.get(f"{API}/rounds/{self.task}/secagg",
                                     headers=bearer(self.credentials[name])))
        return base64.b64decode(step["request"])

    def parts(self, name, a):
        rows = [{"a": np.float32(a), "n": np.int32(2)}]
        return execution.run_plan_parts(self.plan, self.broadcast, {"d": rows})

    def path(self, task):
        return f"{API}/rounds/{task}/secagg/{int(secagg.Stage.MASKED_INPUT)}"

    def good(self, name):
        return protocol.pack_masked_input(self.parts(name, 1.0).report, self.masked[name])

    def other(self, name):
        return protocol.pack_masked_input(self.parts(name, 5.0).report, self.masked[name])

    def malformed(self, name):
        return protocol.pack_masked_input(b"not a report", self.masked[name])

    def non_finite(self, name):
        return protocol.pack_masked_input(self.parts(name, np.inf).report, self.masked[name])


WEIGHTS = fl.to_type({"w": fl.TensorType(np.float32, [3])})


@fl.jax_computation(WEIGHTS, fl.SequenceType(fl.TensorType(np.float32, [3])))
def train(weights, ds):
    return {"delta": weights["w"] - ds.reduce(np.zeros(3, np.float32), lambda s, x: s + x)}


class Buffered(Harness):
    """A buffered session (K = 3, so its buffer has room) at version 0."""

    closed_reason = "closed"
    c_checks_in = False

    def open_task(self):
        self.plan = buffered_plan.BufferedPlan.build(train)
        self.weights = serialization.serialize_value({"w": np.zeros(3, np.float32)}, WEIGHTS)
        self.task = self.ok(self.http.post(f"{API}/admin/sessions", headers=self.admin, json={
            "population": "pop", "plan": self.blob(self.plan.to_bytes()),
            "weights": self.blob(self.weights), "buffer_size": 3, "max_staleness": 1,
        }))["id"]

    def path(self, task):
        return f"{API}/sessions/{task}/reports/0"

    def bound(self, task):
        return {"session": task, "version": 0}

    def report(self, row):
        return self.plan.run(self.weights, {"train": [np.array(row, np.float32)]})

    def close(self):
        self.ok(self.http.post(f"{API}/admin/sessions/{self.task}/close", headers=self.admin))

    def task_row(self):
        return self.ok(self.http.get(f"{API}/admin/sessions/{self.task}", headers=self.admin))

    def task_refusals(self):
        return {"stale": self.task_row()["refused_stale"]}

    def counted_in_task(self, reason):
        """A session counts only its stale reports (`refused_stale`)."""
        return {"stale": 0}


class Partial(Plain):
    """Edges `a`, `b` and `d` of the population joined a plain round of `vector_sum`
    (target 3: one seat each); edge `c` did not. An upload is an edge's partial aggregate:
    its clients' reports folded together, standing for them."""

    def __init__(self, server, clock):
        self.server, self.clock = server, clock
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)
        self.ok(self.http.post(f"{API}/admin/populations", json={"name": "pop"},
                               headers=self.admin))
        self.credentials = {name: self.ok(self.http.post(
            f"{API}/admin/edges", json={"name": name, "population": "pop"},
            headers=self.admin))["token"] for name in "abdc"}
        self.open_task()
        for name in "abd":
            joined = self.ok(self.http.post(f"{API}/edge/rounds/{self.task}/join",
                                            headers=bearer(self.credentials[name])))
            assert joined["share"]["capacity"] == 1, joined
        self.folder = folding.Folder(self.plan)

    def path(self, task):
        return f"{API}/edge/rounds/{task}/partial"

    def report(self, row):
        aggregate = self.folder.fold(self.folder.empty(), self.folder.check(super().report(row)))
        return self.folder.encode_partial(aggregate, 1, 0)

    def malformed(self, name):
        return b"not a partial aggregate"

    def non_finite(self, name):
        t = self.folder.aggregate_type
        aggregate = serialization.serialize_value((np.array([np.inf, 0, 0]),), t)
        return self.folder.encode_partial(aggregate, 1, 0)


class Batch(Buffered):
    """Edges `a`, `b` and `d` of the population, and `c` of another one; a buffered
    session (K = 3) at version 0. An upload is an edge's first batch of its clients'
    reports, each with the version it trained."""

    # any edge of the population may forward reports to its session: an edge of
    # another population finds none (as if it did not exist)
    not_given = (404, "not_found", False, False)

    def __init__(self, server, clock):
        self.server, self.clock = server, clock
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)
        for population in ("pop", "other"):
            self.ok(self.http.post(f"{API}/admin/populations", json={"name": population},
                                   headers=self.admin))
        self.credentials = {name: self.ok(self.http.post(
            f"{API}/admin/edges", json={"name": name, "population": "other" if name == "c"
                                        else "pop"}, headers=self.admin))["token"]
            for name in "abdc"}
        self.open_task()

    def path(self, task):
        return f"{API}/edge/sessions/{task}/batches/1"

    def bound(self, task):
        return {"session": task}  # each of its reports names its version

    def report(self, row):
        return buffered_plan.encode_batch([(0, super().report(row))])

    def malformed(self, name):
        return b"not a batch"


@pytest.fixture(params=[Plain, Secure, Buffered, Partial, Batch],
                ids=["plain", "secure", "buffered", "partial", "batch"])
def harness(request, db_url, server_factory):
    clock = Clock()
    h = request.param(server_factory(db=db_url, clock=clock), clock)
    yield h
    h.http.close()


def counts(h):
    status = h.ok(h.http.get(f"{API}/status"))
    return status["reports"]["refused"], status["reports"]["accepted"], h.task_refusals()


def refused(h, upload, status, reason, counted=True, in_task=True):
    """Asserts that `upload()` is refused (status, reason) and how it is counted: in
    `GET /v1/status` by reason, in the task (`counted_in_task`); nothing is accepted."""
    refusals, accepted, task = counts(h)
    response = upload()
    assert (response.status_code, response.json()["reason"]) == (status, reason), response.text
    after, accepted_after, task_after = counts(h)
    assert after.get(reason, 0) - refusals.get(reason, 0) == int(counted), (reason, after)
    assert accepted_after == accepted
    want = h.counted_in_task(reason) if in_task else dict.fromkeys(task, 0)
    assert {k: task_after[k] - task[k] for k in task} == want


def test_the_upload_contract(harness):
    h = harness
    refusals, _, task = counts(h)

    # accepted once; the same bytes again are a replay that changes nothing
    first = h.put("a", h.good("a"))
    assert first.status_code == 200 and first.json()["accepted"]  # (a batch: its count)
    assert first.json()["replay"] is False and h.accepted() == 1
    again = h.put("a", h.good("a"))
    assert again.status_code == 200 and again.json()["replay"] is True and h.accepted() == 1
    assert counts(h)[0] == refusals and counts(h)[2] == task

    # refused before anything is decoded: another upload, a client not given the task
    refused(h, lambda: h.put("a", h.other("a")), 409, "conflict")
    status, reason, counted, in_task = h.not_given
    refused(h, lambda: h.put("c", h.good("a")), status, reason, counted, in_task)

    # refused by the check against the plan, and by the size limit
    refused(h, lambda: h.put("b", h.malformed("b")), 400, "malformed")
    refused(h, lambda: h.put("b", h.non_finite("b")), 400, "non_finite")
    refused(h, lambda: h.put("b", TOO_LARGE), 413, "too_large")

    # no credential: counted, not in the task; no such task: not counted at all
    refused(h, lambda: h.put(None, h.good("b")), 401, "unauthorized", in_task=False)
    refused(h, lambda: h.put("b", h.good("b"), task=2**40), 404, "not_found", counted=False,
            in_task=False)

    # a task that takes no more uploads
    h.close()
    refused(h, lambda: h.put("b", h.good("b")), 410, h.closed_reason)
    assert h.accepted() == 1  # only a's upload, once


def test_a_report_that_would_make_the_aggregate_overflow_is_refused(db_url, server_factory):
    # Each report is finite; two of them add up to infinity (issue 23, item 2).
    h = Plain(server_factory(db=db_url, clock=Clock()), Clock())
    try:
        report_t = folding.Folder(h.plan).report_type
        def report(value):  # a float32 sum, as honest clients send it
            return serialization.serialize_value(
                structure.to_python((np.full(3, value, np.float32),), report_t), report_t)

        # two that add up to infinity (one float32 report cannot exceed float32's range)
        assert h.put("a", report(3e38)).status_code == 200
        refused(h, lambda: h.put("b", report(3e38)), 400, "overflow")
        assert "overflow to infinity" in h.put("b", report(3e38)).json()["detail"]
        refused(h, lambda: h.put("b", report(np.finfo(np.float32).max)), 400, "overflow")
        assert h.put("b", h.good("b")).status_code == 200  # nothing of the refusal stayed
        assert h.accepted() == 2
        _, aggregate = h.server.app_state.rounds.aggregate(h.task)
        assert np.all(np.isfinite(np.asarray(folding.Folder(h.plan).results(aggregate)[0])))
    finally:
        h.http.close()


def test_reports_waiting_for_their_group_commit_hold_no_thread(server_factory):
    # More reports wait for one commit than the thread pool has threads (40): they wait
    # on the event loop, so the server still answers other requests meanwhile, and
    # every one of them is taken once the commit goes through.
    n = 48
    server = server_factory(clock=Clock())
    http = httpx.Client(base_url=server.url, timeout=30)
    ok, admin = Harness.ok, bearer(server.admin_token)
    plan, broadcast = capture(vector_sum, deploy.client_data("train"))
    shards = server.app_state.shards
    gate, held = threading.Event(), []
    commit = shards._commit

    def gated(batch):  # the writer's transaction, held until the test opens the gate
        held.append(len(batch))
        assert gate.wait(60), "the test did not open the gate"
        return commit(batch)

    def blob(data):
        return ok(http.post(f"{API}/admin/blobs", content=data, headers=admin))["hash"]

    try:
        token = ok(http.post(f"{API}/admin/populations", json={"name": "pop"},
                             headers=admin))["token"]
        round_id = ok(http.post(f"{API}/admin/rounds", headers=admin, json={
            "population": "pop", "plan": blob(plan.to_bytes()), "broadcast": blob(broadcast),
            "target": n, "deadline": 600.0,
        }))["id"]
        credentials = []
        for _ in range(n):
            credential = ok(http.post(f"{API}/populations/pop/enroll",
                                      headers=bearer(token)))["credential"]
            task = ok(http.post(f"{API}/checkin", headers=bearer(credential)))
            assert task["task"]["round"] == round_id, task
            credentials.append(credential)
        bodies = [execution.run_plan(plan, broadcast, {"train": [np.array([i, 1, 0], np.float32)]})
                  for i in range(n)]
        shards._commit = gated
        answers = [None] * n

        def upload(i):
            with httpx.Client(base_url=server.url, timeout=90) as client:
                answers[i] = client.put(f"{API}/rounds/{round_id}/report", content=bodies[i],
                                        headers={**bearer(credentials[i]),
                                                 **task_header({"round": round_id})})

        threads = [threading.Thread(target=upload, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        wait_for(lambda: held and held[0] + len(shards._waiting) == n,
                 "every report waiting for the writer", timeout=60)
        status = http.get(f"{API}/status", timeout=10)  # a route run on the thread pool
        assert status.status_code == 200 and status.json()["reports"]["accepted"] == 0
        gate.set()
        for t in threads:
            t.join(timeout=60)
        assert [a.status_code for a in answers] == [200] * n, [a.text for a in answers if a]
        row, aggregate = server.app_state.rounds.aggregate(round_id)
        assert (row.state, row.reports) == ("closed", n)
        np.testing.assert_allclose(folding.Folder(plan).results(aggregate)[0],
                                   [sum(range(n)), n, 0])
    finally:
        gate.set()
        http.close()
