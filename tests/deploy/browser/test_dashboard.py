"""The dashboard (src/fedlang/deploy/server/static/dashboard/) in headless Chromium against
a `fedlang serve` process: nothing shown without the admin token and a wrong one refused,
a round filling up as Python clients report, released metrics plotted, each checked
against the admin API's answer, under the page's strict content-security policy. It
leaves a screenshot in build/dashboard.png (docs/images/dashboard.png is one)."""

import json
import threading

import httpx
import numpy as np
import pytest

from fedlang import deploy
from fedlang.core import context

from ..conftest import Gated, batch_sum, wait_for
from ..server.test_sessions import Session, _report
from .conftest import ROOT

N = 3


@pytest.fixture
def page(chromium):
    """A page of its own (its own sessionStorage) and the console's errors."""
    ctx = chromium.new_context(viewport={"width": 1280, "height": 1000})
    page = ctx.new_page()
    page.set_default_timeout(60_000)
    errors = []
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page, errors
    ctx.close()


def _api(server, path, **kwargs):
    with httpx.Client(base_url=server.url, timeout=10,
                      headers={"Authorization": f"Bearer {server.admin_token}"}) as h:
        answer = h.request(kwargs.pop("method", "GET"), path, **kwargs)
        answer.raise_for_status()
        return answer.json()


def _row(page, what, key):
    """The cells (data-field -> text) of a table row of the page, or None."""
    return page.evaluate(
        """([what, key]) => {
             const tr = document.querySelector(`tr[data-${what}="${key}"]`);
             if (tr === null) return null;
             return Object.fromEntries([...tr.querySelectorAll('td')].map(
               (td) => [td.dataset.field, td.textContent]));
           }""", [what, key])


def _chart(page, key):
    """A chart's data as the page gave it to uPlot, and as uPlot holds it."""
    return page.evaluate(
        """(key) => {
             const c = window.fedlangDashboard.charts.get(key);
             return c === undefined ? null : {data: c.data, plotted: c.plot && c.plot.data,
                                              names: c.names};
           }""", key)


def _login(page, server):
    page.goto(f"{server.url}/dashboard/?interval=0.5")
    page.fill("#token", server.admin_token)
    page.click("#login button[type=submit]")
    page.wait_for_selector("#board", state="visible")


def _round_seen(page, server, reports, state="open"):
    """The page's row of the round, once it shows `reports` and `state`, equal to the API's."""
    def agreed():
        rounds = _api(server, "/v1/admin/overview")["rounds"]
        if not rounds:  # the driver has not opened it yet
            return False
        (r,) = rounds
        row = _row(page, "round", r["id"])
        return (row is not None and r["reports"] == reports and r["state"] == state
                and row["reports"] == f"{r['reports']} / {r['target']}" and row["state"] == state
                and row["dropouts"] == str(r["dropouts"]) and row["late"] == str(r["late"])
                and (r, row))
    return wait_for(agreed, f"the page to show {reports} reports ({state})", timeout=60)


@pytest.mark.slow  # about 30 s: a server process, Chromium, a round of 3 Python clients
def test_the_dashboard_shows_a_deployment_live_as_the_api_does(
    tmp_path, server_process, client_threads, page
):
    page, errors = page
    server = server_process(tmp_path / "store.db").start()
    assert f"dashboard: {server.url}/dashboard/ (log in" in server.log.read_text()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")

    # nothing but the form without the token; a wrong one is refused
    page.goto(f"{server.url}/dashboard/?interval=0.3")
    page.wait_for_selector("#login", state="visible")
    assert page.is_hidden("#board") and page.evaluate("window.fedlangDashboard.overview") is None
    page.fill("#token", "not-the-admin-token")
    page.click("#login button[type=submit]")
    # (page.wait_for_function evaluates a string: the page's policy forbids it, rightly)
    wait_for(lambda: page.text_content("#login-error"), "the login form's error", timeout=30)
    assert "Expected the server's admin token, found another token" in page.text_content("#login-error")
    assert page.is_hidden("#board") and page.evaluate("sessionStorage.length") == 0

    # logged in: the populations as the API has them
    page.fill("#token", server.admin_token)
    page.click("#login button[type=submit]")
    page.wait_for_selector("#board", state="visible")
    assert page.text_content("#login-error") == ""

    # a round of N gated clients: the page follows its reports
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(N)]
    clients = [deploy.Client(server.url, "pop", token, {"train": g}, max_tasks=1, patience=60,
                             backoff=(0.05, 0.3)) for g in gates]
    failures = [client_threads(c) for c in clients]
    result = {}

    def drive():
        ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=N,
                                        patience=60, backoff=(0.05, 0.3))
        try:
            with context.with_context(ctx):
                result["value"] = batch_sum(deploy.client_data("train"))
        except Exception as e:
            result["error"] = e
        finally:
            ctx.runner.close()

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        _round_seen(page, server, 0)
        gates[0].release.set()
        _round_seen(page, server, 1)
        for g in gates[1:]:
            g.release.set()
        _, row = _round_seen(page, server, N, "closed")
        driver.join(timeout=60)
        assert not driver.is_alive() and "error" not in result, result
        assert not any(failures)
        assert row["duration"].endswith(" s") and row["refused"] == "0"

        def populations_agree():
            (p,) = _api(server, "/v1/admin/overview")["populations"]
            row = _row(page, "population", "pop")
            return row and p["enrolled"] == N and row["enrolled"] == str(p["enrolled"]) \
                and row["seen_last_hour"] == str(p["seen_last_hour"])
        wait_for(populations_agree, "the populations' row")

        # metrics released for two rounds: one chart per name, a series per kind
        for round_, train, evaluation, accuracy in [(1, 0.9, 1.1, 0.25), (2, 0.6, 0.8, 0.5)]:
            _api(server, "/v1/admin/populations/pop/metrics", method="POST", json={
                "round": round_, "metrics": {"train": {"loss": train, "accuracy": accuracy},
                                             "eval": {"loss": evaluation}}})
            want = [[1, 2][:round_], [0.9, 0.6][:round_], [1.1, 0.8][:round_]]
            chart = wait_for(lambda w=want: (c := _chart(page, "pop/loss")) and c["data"] == w and c,
                             f"the loss chart with round {round_}")
            assert chart["plotted"] == want and chart["names"] == ["train", "eval"]
        released = _api(server, "/v1/admin/populations/pop/metrics")["metrics"]
        loss = sorted((m["kind"], m["round"], m["value"]) for m in released if m["name"] == "loss")
        assert loss == [("eval", 1, 1.1), ("eval", 2, 0.8), ("train", 1, 0.9), ("train", 2, 0.6)]
        assert page.text_content("#metric-pop-loss figcaption") == \
            "loss · train 0.6 (round 2) · eval 0.8 (round 2)"
        assert _chart(page, "pop/accuracy")["data"] == [[1, 2], [0.25, 0.5]]

        # the check-in and report rates, plotted as the API gives them
        rates = _api(server, "/v1/admin/overview")["rates"]
        plotted = _chart(page, "rates")
        assert rates["checkins"] and plotted["names"] == ["check-ins", "reports"]
        assert len(plotted["plotted"][0]) >= 1

        page.screenshot(path=str(ROOT / "build" / "dashboard.png"), full_page=True)

        # the token stays in this tab only, and logging out forgets it and the data
        page.reload()
        page.wait_for_selector("#board", state="visible")
        page.click("#logout")
        page.wait_for_selector("#login", state="visible")
        assert page.evaluate("sessionStorage.length") == 0
        assert page.evaluate("document.querySelectorAll('tbody tr').length") == 0
    finally:
        for g in gates:
            g.release.set()
        driver.join(timeout=60)

    # nothing was blocked by the content-security policy, nothing failed but the wrong token
    assert [e for e in errors if "401" not in e] == [], json.dumps(errors, indent=1)


def test_a_buffered_session_fills_its_buffer_on_the_page_as_in_the_api(server_factory, page):
    page, errors = page
    session = Session(server_factory())
    try:
        _login(page, session.server)

        def shown(**want):
            (s,) = _api(session.server, "/v1/admin/overview")["sessions"]
            row = _row(page, "session", s["id"])
            return (row is not None and all(s[k] == v for k, v in want.items())
                    and row["buffer"] == f"{s['buffer_fill']} / {s['buffer_size']}"
                    and row["version"] == str(s["version"]) and row["accepted"] == str(s["accepted"])
                    and row["refused"] == (", ".join(f"{k} {n}" for k, n in sorted(
                        s["refused_by_reason"].items())) or "0") and (s, row))

        wait_for(lambda: shown(buffer_fill=0, version=0), "an empty buffer", timeout=30)
        a, b, c = session.clients
        for client in (a, b, c):
            session.checkin(client)
        assert session.put(a, 0, _report([[1, 1, 1]])).status_code == 200
        wait_for(lambda: shown(buffer_fill=1, accepted=1), "one report buffered", timeout=30)
        assert session.put(b, 0, _report([[2, 2, 2]])).status_code == 200
        session.publish(1, through=2)
        session.publish(2, through=2)  # c is now 2 versions behind: its report is stale
        assert session.put(c, 0, _report([[3, 3, 3]])).status_code == 410
        s, row = wait_for(lambda: shown(version=2, buffer_fill=0, accepted=2), "two versions on",
                          timeout=30)
        assert s["refused_by_reason"] == {"stale": 1} and row["refused"] == "stale 1"
        assert row["state"] == "open" and row["duration"].endswith(" so far")
    finally:
        session.http.close()
    assert [e for e in errors if "401" not in e] == [], json.dumps(errors, indent=1)


def test_refused_connections_are_shown_by_reason_as_in_the_api(server_factory, page):
    # issue 36: a connection over its address's cap of unfinished headers is refused
    # and counted; the page shows the refusals the overview's totals hold
    import socket

    from fedlang.deploy.server import serve

    page, errors = page
    # the browser's address (127.0.0.1, several connections at once) is not capped
    server = server_factory(limits=serve.Limits(max_unfinished_per_address=1,
                                                header_timeout=600),
                            forwarded_allow_ips="127.0.0.1")
    held = []
    try:
        for _ in range(3):  # one held with its headers unfinished, two refused
            s = socket.socket()
            s.bind(("127.0.0.2", 0))
            s.connect(("127.0.0.1", server.port))
            s.sendall(b"GET /v1/status HTTP/1.1\r\n")
            held.append(s)
        wait_for(lambda: _api(server, "/v1/admin/overview")["totals"]["connections_refused"]
                 == {"unfinished_per_address": 2}, "the refusals counted", timeout=30)
        _login(page, server)
        row = wait_for(lambda: (r := _row(page, "kind", "connections")) and
                       r["refused"] != "0" and r, "the refusals shown", timeout=30)
        assert row["refused"] == "unfinished_per_address 2"
    finally:
        for s in held:
            s.close()
    assert [e for e in errors if "401" not in e] == [], json.dumps(errors, indent=1)
