"""fedlang.js refuses a task whose check-in answer was changed on the way (issue 23,
item 6): Chromium's requests are intercepted (playwright routes, as a proxy between the
page and the server would) and the check-in's task is made to name other model
weights than the ones the server signed in its ticket. The page refuses to run it,
says why, and the server gets no report."""

import json

import pytest

from fedlang import deploy

from ..conftest import capture
from .conftest import digits_clients, start_page_client
from .test_fedlang_js import FAST, _wait

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")


@pytest.mark.parametrize("field", ["broadcast", "plan"])
def test_a_page_refuses_a_task_whose_ticket_does_not_match(
    server_factory, pages, logreg_process, browser_tasks, field
):
    (share,) = digits_clients(1, per_client=40)
    server = server_factory(browser=True)
    process = logreg_process
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    plan = browser_tasks(plan, broadcast)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
        r = admin.create_round("digits", admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast),
                               target=1, deadline=120, request_id="tampered")
        other = admin.put_blob(b"weights (or a plan) the server did not sign for this task")
        swapped = []

        def tamper(route):
            answer = route.fetch()
            body = answer.json()
            if body.get("task"):
                body["task"][field] = other
                swapped.append(body["task"][field])
            route.fulfill(response=answer, body=json.dumps(body))

        page = pages(f"{server.url}/v1/status")
        page.route("**/v1/checkin", tamper)
        start_page_client(page, "digits", token, share, **FAST)
        _wait(lambda: page.evaluate("window.outcome") is not None, what="the page to stop",
              page=page)
        outcome = page.evaluate("window.outcome")
        events = [e["type"] for e in page.evaluate("window.events")]
        final = admin.round(r["id"])
    assert swapped, "the check-in was not intercepted"
    assert "error" in outcome, outcome
    assert f"Expected the task the server signed, found another {field}" in outcome["error"]
    assert "changed it" in outcome["error"]
    assert "report" not in events and "step" not in events  # nothing ran, nothing was sent
    assert final["reports"] == 0 and final["state"] == "open"
