"""An upload is bound to the task it was computed for (issue 36, attack 5): its
`Fedlang-Task` header names the round, or the session and version, and the intake
refuses one computed for another task (409 `stale`), before its body is read, in every
mode: a plain round's report, a secure round's answer, a buffered session's report, an
edge's partial aggregate and batch; counted like any refusal, on both databases.

The attack: a client's report for round 1 uploaded to round 3 (a round it holds a seat
in) was accepted as new (`200`, `replay: false`): a client could free-ride on a stale
update."""

import socket
import time

import numpy as np
import pytest

from fedlang.core import serialization
from fedlang.deploy import secagg

from .conftest import Clock, bearer
from .test_intake import API, WEIGHTS, Batch, Buffered, Partial, Plain, Secure, counts, task_header


class StalePlain(Plain):
    def rejoin(self):
        """The clients check in: each is given the new task."""
        for name in "abd":
            task = self.ok(self.http.post(f"{API}/checkin",
                                          headers=bearer(self.credentials[name])))["task"]
            assert task["round"] == self.task, task


class StaleSecure(Secure):
    def rejoin(self):
        """The clients check in to the new round and answer its stages 1 and 2: it waits
        for their masked inputs (stage 3)."""
        StalePlain.rejoin(self)
        for stage in (secagg.Stage.ADVERTISE_KEYS, secagg.Stage.SHARE_KEYS):
            for name in "abd":
                request = self.request(name)
                if stage == secagg.Stage.ADVERTISE_KEYS:
                    self.sa[name] = secagg.SecAggClient(self.client_id(name), request)
                    body = self.sa[name].advertise_keys()
                else:
                    body = self.sa[name].share_keys(request)
                self.ok(self.put(name, body, path=f"{API}/rounds/{self.task}/secagg/{int(stage)}"))
        for name in "ab":
            self.masked[name] = self.sa[name].masked_input(self.request(name),
                                                           self.parts(name, 1.0).secure)

    def put(self, name, body, task=None, computed_for=None, path=None):
        if path is None:
            return super().put(name, body, task, computed_for)
        headers = {**bearer(self.credentials[name]), **task_header({"round": self.task})}
        return self.http.put(path, content=body, headers=headers)


class StaleBuffered(Buffered):
    def rejoin(self):
        task = self.ok(self.http.post(f"{API}/checkin", headers=bearer(self.credentials["a"])))
        assert task["task"]["session"] == self.task, task
        return task["task"]

    def counted_in_task(self, reason):
        """A session counts its stale uploads (`refused_stale`)."""
        return {"stale": int(reason == "stale")}


class StalePartial(Partial):
    def rejoin(self):
        """The edges join the new round (a seat each)."""
        for name in "abd":
            self.ok(self.http.post(f"{API}/edge/rounds/{self.task}/join",
                                   headers=bearer(self.credentials[name])))


class StaleBatch(Batch):
    def rejoin(self):
        """(any edge of the population forwards to its open session)"""

    def counted_in_task(self, reason):
        return {"stale": int(reason == "stale")}


@pytest.fixture(params=[StalePlain, StaleSecure, StaleBuffered, StalePartial, StaleBatch],
                ids=["plain", "secure", "buffered", "partial", "batch"])
def harness(request, db_url, server_factory):
    clock = Clock()
    h = request.param(server_factory(db=db_url, clock=clock), clock)
    yield h
    h.http.close()


def refused(h, upload, status, reason):
    """`upload()`'s answer, asserted refused (status, reason), counted once by reason in
    `GET /v1/status` and in the task, and nothing accepted."""
    refusals, accepted, task = counts(h)
    response = upload()
    assert (response.status_code, response.json().get("reason")) == (status, reason), response.text
    after, accepted_after, task_after = counts(h)
    assert after.get(reason, 0) - refusals.get(reason, 0) == 1, (reason, after)
    assert accepted_after == accepted
    assert {k: task_after[k] - task[k] for k in task} == h.counted_in_task(reason)
    return response


def test_a_round_1_upload_to_round_3_is_refused_stale(harness):
    # arrange: round (session) 1, its upload accepted; 1 ends, 2 opens and ends, 3 opens
    h = harness
    first, body = h.task, h.good("a")
    assert h.put("a", body).status_code == 200
    h.close()
    h.open_task()
    h.close()
    h.open_task()
    h.rejoin()
    assert h.task != first

    # act: the same bytes, computed for task 1, uploaded to task 3
    r = refused(h, lambda: h.put("a", body, computed_for=first), 409, "stale")

    # assert: refused and counted, naming both tasks; an honest upload to task 3 is taken,
    # and the same bytes again are a replay
    what = "session" if isinstance(h, Buffered) else "round"
    expected, found = r.json()["detail"].split("found one computed for")
    assert f"{what} {h.task}" in expected and f"{what} {first}" in found, r.text
    honest = h.good("a")
    taken = h.put("a", honest)
    assert taken.status_code == 200 and taken.json()["replay"] is False, taken.text
    again = h.put("a", honest)
    assert again.status_code == 200 and again.json()["replay"] is True
    assert h.accepted() == 1


def test_an_upload_without_its_task_is_refused_naming_the_header(harness):
    h = harness
    path = h.path(h.task)
    response = refused(h, lambda: h.http.put(path, content=h.good("a"),
                                             headers=bearer(h.credentials["a"])),
                       400, "unbound")
    detail = response.json()["detail"]
    assert "Fedlang-Task" in detail and task_header(h.bound(h.task))["Fedlang-Task"] in detail


def test_a_report_for_version_0_uploaded_as_version_2_is_refused_stale(db_url, server_factory):
    # A buffered session's report names the version it trained: one trained on version 0
    # is not a report for version 2 (a 409 stale), and, uploaded as version 0's, it is
    # staler than the session's bound of 1 (410 stale, as before).
    clock = Clock()
    h = StaleBuffered(server_factory(db=db_url, clock=clock), clock)
    try:
        body = h.good("a")
        for version in (1, 2):
            weights = serialization.serialize_value({"w": np.full(3, version, np.float32)},
                                                    WEIGHTS)
            h.ok(h.http.post(f"{API}/admin/sessions/{h.task}/versions", headers=h.admin, json={
                "version": version, "weights": h.blob(weights),
                "server_state": h.blob(b"state %d" % version), "through": 0}))
        h.rejoin()  # a is given version 2
        to_2 = f"{API}/sessions/{h.task}/reports/2"
        r = refused(h, lambda: h.http.put(to_2, content=body, headers={
            **bearer(h.credentials["a"]), **task_header({"session": h.task, "version": 0})
        }), 409, "stale")
        assert f"version 2 of session {h.task}" in r.json()["detail"]
        assert f"version 0 of session {h.task}" in r.json()["detail"]
        late = h.put("a", body)  # bound to version 0, uploaded as version 0's
        assert (late.status_code, late.json()["reason"]) == (410, "stale"), late.text
    finally:
        h.http.close()


def test_a_stale_upload_is_refused_before_its_body_is_read(server_factory):
    # A stale upload declares 1 MB and sends none of it: the answer comes at once,
    # without waiting for the body (the server's body timeout is 30 s).
    clock = Clock()
    h = StalePlain(server_factory(clock=clock), clock)
    try:
        first = h.task
        h.close()
        h.open_task()
        h.rejoin()
        header = task_header({"round": first})["Fedlang-Task"]
        host, port = h.server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall((f"PUT {API}/rounds/{h.task}/report HTTP/1.1\r\nHost: x\r\n"
                       f"Authorization: Bearer {h.credentials['a']}\r\n"
                       f"Fedlang-Task: {header}\r\nContent-Type: application/octet-stream\r\n"
                       f"Content-Length: {1 << 20}\r\n\r\n").encode())
            started = time.monotonic()
            answer = s.recv(65536)
        assert answer.startswith(b"HTTP/1.1 409"), answer[:200]
        assert b'"stale"' in answer and time.monotonic() - started < 5
    finally:
        h.http.close()


def test_a_header_that_is_not_a_task_is_refused(server_factory):
    clock = Clock()
    h = StalePlain(server_factory(clock=clock), clock)
    try:
        for junk in ("round 1", '{"round": true}', '["round", 1]', '{"round": "1"}'):
            r = h.http.put(h.path(h.task), content=h.good("a"), headers={
                **bearer(h.credentials["a"]), "Fedlang-Task": junk})
            assert (r.status_code, r.json().get("reason")) == (400, "unbound"), (junk, r.text)
    finally:
        h.http.close()
