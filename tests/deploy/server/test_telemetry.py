"""What the server tells its operator besides its API (server/telemetry.py): the rates of
the overview, and a real `fedlang serve` process's /metrics (parsed by prometheus-client's
own parser, equal to the API's counts) and JSON logs (every line of its stderr parsed)."""

import contextlib
import io
import json
import logging
import os
import re
import subprocess
import sys
import time
import types

import httpx
import pytest
from prometheus_client import parser

from fedlang.deploy.server import telemetry

from ..conftest import ROOT, _free_port
from ._deployment import API, Deployment
from .conftest import bearer


def test_rates_count_each_minute_from_notes_of_the_counters():
    rates = telemetry.Rates()
    t0 = 1_000_000 * 60.0  # a minute's start
    rates.note(t0 + 5, {"checkins": 10, "reports:accepted": 1})
    assert not rates.due(t0 + 50) and rates.due(t0 + 60)
    rates.note(t0 + 61, {"checkins": 14, "reports:accepted": 3})
    rates.note(t0 + 70, {"checkins": 99})  # a minute keeps its first note
    # nothing came in minutes 2 and 3; minute 4 is the current one
    series = rates.series(t0 + 250, {"checkins": 20, "reports:accepted": 3})
    assert series["checkins"] == [[t0, 4.0], [t0 + 60, 6.0], [t0 + 120, 0.0], [t0 + 180, 0.0],
                                  [t0 + 240, 0.0]]
    assert [n for _, n in series["reports:accepted"]] == [2.0, 0.0, 0.0, 0.0, 0.0]
    # an hour later only the last hour is shown
    late = rates.series(t0 + 2 * 3600, {"checkins": 20, "reports:accepted": 3})
    assert len(late["checkins"]) == 60 and late["checkins"][-1] == [t0 + 2 * 3600, 0.0]


class ServeProcess:
    """`fedlang serve` with JSON logs and a loopback metrics port; stdout and stderr apart."""

    def __init__(self, db, tmp_path):
        self.port, self.admin_token = _free_port(), "admin-token"
        self.url = f"http://127.0.0.1:{self.port}"
        self.out, self.err = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "FEDLANG_ADMIN_TOKEN": self.admin_token}
        with open(self.out, "wb") as out, open(self.err, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fedlang", "serve", "--db", str(db), "--port", str(self.port),
                 "--min-retry", "0.05", "--key-file", str(tmp_path / "signing.key"),
                 "--log-format", "json", "--log-level", "info", "--metrics-port", "0"],
                stdout=out, stderr=err, env=env, start_new_session=True,
            )
        end = time.monotonic() + 60
        while not (found := re.search(r"metrics: (http://127\.0\.0\.1:\d+/metrics)", self.out.read_text())):
            assert self.proc.poll() is None and time.monotonic() < end, self.err.read_text()
            time.sleep(0.1)
        self.metrics_url = found.group(1)
        while True:
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/v1/status", timeout=2).status_code == 200:
                    break
            assert self.proc.poll() is None and time.monotonic() < end, self.err.read_text()
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=15)


@pytest.fixture
def serve_process(db_url, tmp_path):
    p = ServeProcess(db_url, tmp_path)
    yield p
    p.stop()


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def test_a_served_round_is_counted_in_metrics_and_logged_as_json(serve_process, sum_round):
    p = serve_process
    d = Deployment(types.SimpleNamespace(url=p.url, admin_token=p.admin_token), sum_round)
    try:
        r = d.open_round(target=2, over_selection=0.5)  # three clients assigned
        for c in d.clients:
            assert d.checkin(c)["task"]["round"] == r["id"]
        for c in d.clients[:2]:
            assert d.report(c, r["id"]).status_code == 200
        assert d.get(f"/admin/rounds/{r['id']}")["state"] == "closed"  # the third dropped out
        assert d.report(d.clients[2], r["id"]).status_code == 410  # late
        assert d.http.post(f"{API}/admin/populations", json={"name": "more"},
                           headers={**d.admin, "X-Request-Id": "op-42"}).status_code == 201
        status = d.http.get(f"{API}/status").json()
        assert d.http.get("/metrics").status_code == 401  # the API's port needs the token
        scraped = d.http.get("/metrics", headers=bearer(p.admin_token))
        local = httpx.get(p.metrics_url, timeout=30)  # the loopback port needs none
    finally:
        d.close()
    assert scraped.status_code == 200 and local.status_code == 200
    for text in (scraped.text, local.text):
        s = _samples(text)
        assert s[("fedlang_checkins_total", ())] == status["checkins"] == 3
        assert s[("fedlang_assignments_total", ())] == status["assignments"] == 3
        assert s[("fedlang_enrollments_total", ())] == status["enrollments"] == 3
        assert s[("fedlang_reports_accepted_total", ())] == status["reports"]["accepted"] == 2
        refused = {dict(k[1])["reason"]: v for k, v in s.items()
                   if k[0] == "fedlang_reports_refused_total"}
        assert refused == status["reports"]["refused"] == {"late": 1}
        assert s[("fedlang_dropouts_total", ())] == status["dropouts"] == 1
        assert s[("fedlang_rounds_ended_total", (("state", "closed"),))] == status["rounds_closed"] == 1
        assert s[("fedlang_round_duration_seconds_count", ())] == 1
        assert s[("fedlang_round_duration_seconds_bucket", (("le", "+Inf"),))] == 1
        assert s[("fedlang_db_transaction_seconds_count", (("kind", "write"),))] > 0
        assert s[("fedlang_request_body_bytes_count", ())] > 0
    p.stop()
    lines = [line for line in p.err.read_text().splitlines() if line.strip()]
    logs = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all({"time", "level", "message", "request_id"} <= set(e) for e in logs)
    requests = [e for e in logs if e["logger"] == "fedlang.deploy.server.requests"]
    assert {(e["method"], e["path"], e["status"]) for e in requests} >= {
        ("POST", f"{API}/checkin", 200), ("PUT", f"{API}/rounds/{r['id']}/report", 200),
        ("PUT", f"{API}/rounds/{r['id']}/report", 410), ("GET", "/metrics", 401)}
    assert all(e["duration"] >= 0 and len(e["request_id"]) == 32 for e in requests
               if e["request_id"] != "op-42")
    (action,) = [e for e in logs if e.get("audit") and e["request_id"] == "op-42"]
    assert (action["method"], action["path"], action["status"]) == ("POST", f"{API}/admin/populations", 201)
    assert any(e["request_id"] == "op-42" and e["logger"].endswith("requests") for e in logs)


def test_the_text_log_is_one_readable_line_with_the_request_id_under_a_request():
    handler = logging.StreamHandler(io.StringIO())
    handler.addFilter(telemetry._RequestId())
    handler.setFormatter(telemetry._TextFormatter())
    log = logging.getLogger("fedlang.test.telemetry")
    log.addHandler(handler)
    log.propagate = False
    log.setLevel(logging.INFO)
    try:
        log.info("outside %s", "requests")
        token = telemetry.request_id.set("req-7")
        log.warning("inside", extra={"status": 503})
        telemetry.request_id.reset(token)
    finally:
        log.removeHandler(handler)
    first, second = handler.stream.getvalue().splitlines()
    assert first.endswith(" INFO fedlang.test.telemetry: outside requests")
    assert second.endswith(" WARNING fedlang.test.telemetry: inside [request req-7]")
    doc = json.loads(telemetry.JSONFormatter().format(logging.makeLogRecord(
        {"name": "n", "levelname": "ERROR", "msg": "m", "request_id": "r", "status": 503})))
    assert {k: doc[k] for k in ("level", "logger", "message", "request_id", "status")} == {
        "level": "error", "logger": "n", "message": "m", "request_id": "r", "status": 503}


def test_an_unknown_log_format_or_level_is_refused():
    with pytest.raises(ValueError, match="log format 'text' or 'json', found 'xml'"):
        telemetry.configure_logging("xml")
    with pytest.raises(ValueError, match="log level of debug, info, warning, error, critical, found 'loud'"):
        telemetry.configure_logging("json", "loud")
