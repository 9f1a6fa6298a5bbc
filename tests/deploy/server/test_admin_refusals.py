"""A refused admin request is counted as what it is (issue 37, item 9): apart from the
refused reports and client requests, in `GET /v1/status` (`admin_refused`) and in
`/metrics` (`fedlang_admin_requests_refused_total`)."""

import httpx
from prometheus_client import parser

from fedlang.deploy.store import metrics

from ..conftest import wait_for
from .conftest import bearer

API = "/v1"


def _samples(text):
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in parser.text_string_to_metric_families(text) for s in family.samples}


def test_refused_admin_requests_are_not_counted_as_refused_reports(server_factory):
    server = server_factory()
    http = httpx.Client(base_url=server.url, timeout=30)
    admin = bearer(server.admin_token)
    token = http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=admin).json()["token"]
    http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).raise_for_status()

    for stranger in ({}, bearer("wrong")):  # two failed admin logins
        assert http.get(f"{API}/admin/overview", headers=stranger).status_code == 401
    assert http.post(f"{API}/checkin", headers=bearer("no-such-client")).status_code == 401

    # counted in memory, written within a second (telemetry.Refusals)
    assert wait_for(lambda: http.get(f"{API}/status").json()["admin_refused"], "counted", 10)
    status = http.get(f"{API}/status").json()
    scraped = _samples(http.get("/metrics", headers=admin).text)
    http.close()
    assert status["admin_refused"] == {"unauthorized": 2}
    assert status["reports"]["refused"] == {"unauthorized": 1}  # the client's check-in
    assert scraped[("fedlang_admin_requests_refused_total", (("reason", "unauthorized"),))] == 2
    refused = {dict(k[1])["reason"]: v for k, v in scraped.items()
               if k[0] == "fedlang_reports_refused_total"}
    assert refused == {"unauthorized": 1}
    overview_totals = httpx.get(f"{server.url}{API}/admin/overview", headers=admin,
                                timeout=30).json()["totals"]
    assert overview_totals["admin_refused"] == {"unauthorized": 2}


def test_an_older_servers_count_of_refused_admin_requests_is_read_as_an_admin_refusal():
    counters = {"refused:admin_unauthorized": 3, "admin_refused:unauthorized": 1,
                "refused:late": 2, "checkins": 9}
    assert metrics.refusal_counts(counters) == ({"late": 2}, {"unauthorized": 4})


def test_fedlang_status_shows_refused_admin_requests_on_their_own_line():
    from rich.console import Console

    from fedlang.cli import deploy as cli_deploy

    doc = {"populations": [], "enrollments": 1, "checkins": 3, "dropouts": 0,
           "rounds_closed": 0, "rounds_failed": 0, "rounds": [],
           "reports": {"accepted": 0, "late": 0, "refused": {"unauthorized": 1}},
           "admin_refused": {"unauthorized": 2}}
    console = Console(width=200, record=True)
    console.print(cli_deploy.status_tables(doc))
    lines = {" ".join(line.split()) for line in console.export_text().splitlines()
             if "refused" in line and "(" in line}
    assert lines == {"reports and client requests refused 1 (unauthorized 1)",
                     "admin requests refused 2 (unauthorized 2)"}
