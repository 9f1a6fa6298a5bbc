"""The operator's routes (server/ops.py): released metrics, the overview, stopping a
round, `/metrics`, request ids; on SQLite and PostgreSQL."""

import math

import numpy as np
import pytest
from prometheus_client import parser

from fedlang import deploy
from fedlang.deploy.driver import metrics as driver_metrics
from fedlang.deploy.store import metrics as store_metrics

from ..conftest import capture, secure_and_plain
from ._deployment import API, Deployment
from .conftest import bearer


@pytest.fixture
def deployment(server_factory, db_url, sum_round):
    d = Deployment(server_factory(db=db_url), sum_round)
    yield d
    d.http.close()


def test_released_metrics_are_stored_replaced_and_read_since(deployment):
    d = deployment
    assert d.post("/admin/populations/pop/metrics", json={
        "round": 1, "metrics": {"train": {"loss": 0.5, "client": {"n": 3}}, "eval": {"acc": 0.25}},
    }) == {"stored": 3}
    first = d.get("/admin/populations/pop/metrics")
    assert first["population"] == "pop"
    assert [(m["round"], m["kind"], m["name"], m["value"]) for m in first["metrics"]] == [
        (1, "eval", "acc", 0.25), (1, "train", "client/n", 3.0), (1, "train", "loss", 0.5)]
    since = max(m["released"] for m in first["metrics"])
    d.server.store.clock = lambda: since + 5  # a later release
    d.post("/admin/populations/pop/metrics", json={"round": 1, "metrics": {"train": {"loss": 0.4}}})
    d.post("/admin/populations/pop/metrics", json={"round": 2, "metrics": {"train": {"loss": 0.3}}})
    newer = d.get("/admin/populations/pop/metrics", params={"since": since})["metrics"]
    assert [(m["round"], m["name"], m["value"], m["released"]) for m in newer] == [
        (1, "loss", 0.4, since + 5), (2, "loss", 0.3, since + 5)]
    assert len(d.get("/admin/populations/pop/metrics")["metrics"]) == 4  # replaced, not added


@pytest.mark.parametrize("metrics, key", [
    ({"train": {"loss": "low"}}, "train/loss"),
    ({"train": {"a": {"b": None}}}, "train/a/b"),
    ({"train": {"ok": True}}, "train/ok"),
    ({"loss": 0.5}, "'loss'"),
])
def test_bad_metrics_are_refused_naming_the_key(deployment, metrics, key):
    r = deployment.http.post(f"{API}/admin/populations/pop/metrics", headers=deployment.admin,
                             json={"round": 1, "metrics": metrics})
    assert r.status_code == 400, r.text
    assert key in r.json()["detail"]
    assert deployment.get("/admin/populations/pop/metrics")["metrics"] == []


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_metrics_are_refused(deployment, bad):
    # JSON has no NaN; Python's json writes one anyway (NaN, Infinity), and the server's
    # parser reads it: the store refuses it
    with pytest.raises(ValueError, match="finite number for metric 'eval/x'"):
        store_metrics.flatten({"eval": {"x": bad}})
    r = deployment.http.post(
        f"{API}/admin/populations/pop/metrics", headers={**deployment.admin, "Content-Type": "application/json"},
        content=f'{{"round": 1, "metrics": {{"eval": {{"x": {bad!r}}}}}}}'.replace("nan", "NaN").replace("inf", "Infinity"),
    )
    assert r.status_code in (400, 422), r.text


def test_metrics_of_an_unknown_population_are_404(deployment):
    r = deployment.http.post(f"{API}/admin/populations/nobody/metrics", headers=deployment.admin,
                             json={"round": 1, "metrics": {"train": {"loss": 1.0}}})
    assert r.status_code == 404, r.text
    assert deployment.http.get(f"{API}/admin/populations/nobody/metrics",
                               headers=deployment.admin).status_code == 404


def test_the_driver_releases_a_process_metrics(deployment):
    form = driver_metrics.release_form({
        "train": {"loss": np.float32(0.5), "per_class": np.arange(3), "nan": np.nan},
        "eval": {"acc": np.array(0.75)}, "round_time_s": 2, "note": "text",
    })
    assert form == {"train": {"loss": 0.5}, "eval": {"acc": 0.75}, "round": {"round_time_s": 2.0}}
    assert driver_metrics.release_metrics(deployment.server.url, deployment.server.admin_token,
                                          "pop", 4, form) == 3
    writer = driver_metrics.ServerMetricsWriter(deployment.server.url, deployment.server.admin_token, "pop")
    writer.write(5, {"train": {"loss": 0.25}})
    writer.close()
    runner = deploy.ServerRounds(deployment.server.url, deployment.server.admin_token, "pop", target=1)
    # what process.next returned is released under `train` (issue 37, item 10)
    assert runner.release_metrics(6, {"loss": np.float32(0.125), "note": "x"}) == 1
    assert runner.release_metrics(7, {"note": "nothing to plot"}) == 0
    runner.close()
    got = deployment.get("/admin/populations/pop/metrics")["metrics"]
    assert [(m["round"], m["kind"], m["name"], m["value"]) for m in got] == [
        (4, "eval", "acc", 0.75), (4, "round", "round_time_s", 2.0), (4, "train", "loss", 0.5),
        (5, "train", "loss", 0.25), (6, "train", "loss", 0.125)]


def test_the_overview_shows_a_round_as_the_api_counts_it(deployment):
    d = deployment
    later = d.server.store.clock() + 2 * 3600  # the enrollments (which count as seen) are old
    d.server.store.clock = lambda: later
    r = d.open_round(target=2)
    for c in d.clients[:2]:
        assert d.checkin(c)["task"]["round"] == r["id"]
    assert d.report(d.clients[0], r["id"]).status_code == 200
    assert d.report(d.clients[2], r["id"]).status_code == 403  # not assigned: refused
    view = d.get("/admin/overview")
    (pop,) = view["populations"]
    assert (pop["name"], pop["enrolled"], pop["seen_last_hour"]) == ("pop", 3, 2)
    (row,) = view["rounds"]
    assert (row["id"], row["state"], row["reports"], row["target"], row["assigned"]) == (
        r["id"], "open", 1, 2, 2)
    assert row["refused_by_reason"] == {"not_assigned": 1}
    assert row["refused"] == 1 and row["duration"] >= 0 and row["closed"] is None
    status = d.http.get(f"{API}/status").json()
    assert view["totals"]["checkins"] == status["checkins"] == 2
    assert view["totals"]["reports"] == status["reports"]
    # the rates: one minute (or two, at a minute's turn) holding what happened
    assert sum(n for _, n in view["rates"]["checkins"]) == 2
    assert sum(n for _, n in view["rates"]["reports"]) == 1
    assert all(t % 60 == 0 for t, _ in view["rates"]["checkins"])


def test_an_operator_stops_a_round(deployment):
    d = deployment
    r = d.open_round(target=3)
    d.checkin(d.clients[0])
    stopped = d.post(f"/admin/rounds/{r['id']}/stop")
    assert stopped["state"] == "failed" and "stopped by the operator" in stopped["failure"]
    assert stopped["dropped"] == 1
    assert d.report(d.clients[0], r["id"]).status_code == 410  # the round is over
    again = d.post(f"/admin/rounds/{r['id']}/stop")  # stopping an ended round changes nothing
    assert again == {**stopped, "late": 1}  # but the late report was counted
    r404 = d.http.post(f"{API}/admin/rounds/999/stop", headers=d.admin)
    assert r404.status_code == 404


def test_stopping_a_secure_round_keeps_nothing_of_its_protocol(deployment):
    d = deployment
    plan, broadcast = capture(secure_and_plain, deploy.client_data("d"))

    def blob(data):
        return d.http.post(f"{API}/admin/blobs", content=data, headers=d.admin).json()["hash"]

    r = d.post("/admin/rounds", json={"population": "pop", "plan": blob(plan.to_bytes()),
                                      "broadcast": blob(broadcast), "target": 3})
    assert r["kind"] == "secure"
    for c in d.clients:
        assert d.checkin(c)["task"]["kind"] == "secure"
    stopped = d.post(f"/admin/rounds/{r['id']}/stop")
    assert stopped["state"] == "failed" and "stopped by the operator" in stopped["failure"]
    assert stopped["dropped"] == 3
    with d.server.store.transaction() as tx:
        assert tx.one("SELECT COUNT(*) FROM secure_requests WHERE round = ?", (r["id"],))[0] == 0
        assert tx.one("SELECT stage FROM secure_rounds WHERE round = ?", (r["id"],))[0] == 6  # failed


def test_prometheus_metrics_need_the_admin_token_and_count_as_the_api(deployment):
    d = deployment
    r = d.open_round(target=1)
    d.checkin(d.clients[0])
    assert d.report(d.clients[0], r["id"]).status_code == 200
    assert d.http.get("/metrics").status_code == 401
    assert d.http.get("/metrics", headers=bearer(d.clients[0]["credential"])).status_code == 401
    text = d.http.get("/metrics", headers=d.admin)
    assert text.status_code == 200 and text.headers["content-type"].startswith("text/plain")
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in parser.text_string_to_metric_families(text.text)
               for s in family.samples}
    status = d.http.get(f"{API}/status").json()
    assert samples[("fedlang_checkins_total", ())] == status["checkins"] == 1
    assert samples[("fedlang_reports_accepted_total", ())] == status["reports"]["accepted"] == 1
    assert samples[("fedlang_rounds_ended_total", (("state", "closed"),))] == 1
    assert samples[("fedlang_round_duration_seconds_count", ())] == 1
    assert samples[("fedlang_db_transaction_seconds_count", (("kind", "write"),))] > 0
    assert samples[("fedlang_request_body_bytes_count", ())] > 0


def test_every_answer_has_a_request_id(deployment):
    d = deployment
    given = d.http.get(f"{API}/status", headers={"X-Request-Id": "abc-123"})
    assert given.headers["x-request-id"] == "abc-123"
    made = d.http.get(f"{API}/status", headers={"X-Request-Id": "bad id!" * 20})
    assert made.headers["x-request-id"] != given.headers["x-request-id"]
    assert len(made.headers["x-request-id"]) == 32
    assert d.http.get("/nowhere").headers["x-request-id"]
