"""fedlang.js in headless Chromium against a real server: browsers and Python clients in
one deployment, dropouts and garbage uploads."""

import base64
import threading
import time

import jax
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization
from fedlang.deploy.plans import execution
from fedlang.runtime import simulation

from ..conftest import capture
from .conftest import batches, digits_clients, start_page_client

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")

FAST = {"backoff": (0.02, 0.2)}
ROUNDS = 3


def _wait(condition, timeout=120.0, what="the condition", page=None):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return
        time.sleep(0.05)
    seen = page.evaluate("window.events") if page is not None else None
    raise AssertionError(f"timed out waiting for {what}; the page's events: {seen}")


def _decoded(report, report_type):
    value = serialization.deserialize_value(report, expected_type=report_type)
    import jax

    return [np.asarray(x, np.float64) for x in jax.tree.leaves(value)]


@pytest.mark.slow  # about 50 s: Chromium, the preflight, 3 rounds of 5 clients
def test_browsers_and_python_clients_train_together(
    server_factory, client_threads, pages, logreg_process
):
    # arrange: a server serving the browser client, 2 pages and 3 Python clients
    shares = digits_clients(5)
    server = server_factory(browser=True)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    browsers = [pages(f"{server.url}/v1/status") for _ in range(2)]
    for page, share in zip(browsers, shares[:2]):
        start_page_client(page, "digits", token, share)
    errors = [
        client_threads(deploy.Client(server.url, "digits", token, {"train": batches(s)}, **FAST))
        for s in shares[2:]
    ]
    process = logreg_process
    state = process.initialize()
    ctx = deploy.deployment_context(server.url, server.admin_token, "digits", target=5,
                                    deadline=120, browser=True)
    # act: the ordinary driver loop
    with context.with_context(ctx):
        for _ in range(ROUNDS):
            state, _ = process.next(state, deploy.client_data("train"))
    ctx.runner.finish()
    ctx.runner.close()
    # assert: every round had all 5 clients, the browsers' included
    assert [r.reports for r in ctx.rounds] == [5] * ROUNDS
    assert not any(errors)
    # each browser report equals the Python reference computation of the same task
    with deploy.Admin(server.url, server.admin_token) as admin:
        for page, share in zip(browsers, shares[:2]):
            _wait(lambda p=page: p.evaluate("window.outcome") is not None, what="the page to stop")
            assert page.evaluate("window.outcome") == {"done": ROUNDS}
            reports = page.evaluate("window.reports")
            assert len(reports) == ROUNDS
            for entry in reports.values():
                signed = admin.connection.request(
                    "GET", f"/v1/blobs/{entry['plan']}", token=admin.token).content
                broadcast = admin.connection.request(
                    "GET", f"/v1/blobs/{entry['broadcast']}", token=admin.token).content
                plan = execution.load_plan(signed, server.public_key)
                want = execution.run_plan(plan, broadcast, {"train": batches(share)})
                got = base64.b64decode(entry["report"])
                for g, w in zip(_decoded(got, plan.report_type), _decoded(want, plan.report_type)):
                    np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    # the round results equal the simulation runtime's on the same clients
    sim_state = process.initialize()
    with context.with_context(simulation.SimulationContext()):
        for _ in range(ROUNDS):
            sim_state, _ = process.next(sim_state, [batches(s) for s in shares])
    got_w, want_w = process.get_model_weights(state), process.get_model_weights(sim_state)
    for key in ("w", "b"):
        np.testing.assert_allclose(got_w.trainable[key], want_w.trainable[key], rtol=1e-5, atol=1e-5)


class _Held:
    """A client's batches, given only once `release` is set (so the page is assigned first)."""

    def __init__(self, share):
        self.batches, self.release = batches(share), threading.Event()

    def __iter__(self):
        assert self.release.wait(120), "the test never released this client"
        return iter(self.batches)


def test_a_browser_that_closes_mid_round_is_a_dropout(
    server_factory, client_threads, pages, logreg_process, browser_tasks
):
    # arrange: a page whose data never arrive (it holds its task), 2 Python clients held
    # back until the page has its task; the round wants 2 reports of 3 assigned clients
    shares = digits_clients(3)
    server = server_factory(browser=True)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    page = pages(f"{server.url}/v1/status")
    page.evaluate(STALLED_CLIENT, ["digits", token])
    held = [_Held(s) for s in shares[:2]]
    errors = [client_threads(deploy.Client(server.url, "digits", token, {"train": h}, **FAST))
              for h in held]
    process = logreg_process
    runner = deploy.ServerRounds(server.url, server.admin_token, "digits", target=2,
                               over_selection=0.5, deadline=120)
    ctx = deploy.DeploymentContext(runner, browser_tasks)
    out = {}

    def drive():
        try:
            with context.with_context(ctx):
                out["state"], _ = process.next(process.initialize(), deploy.client_data("train"))
        except Exception as e:  # shown by the assertion below
            out["error"] = e

    driver = threading.Thread(target=drive, daemon=True)
    driver.start()
    # act: the page closes once it holds the round's task; then the others run theirs
    _wait(lambda: any(e["type"] == "task" for e in page.evaluate("window.events")),
          what="the page to receive a task")
    page.close()
    for h in held:
        h.release.set()
    driver.join(timeout=120)
    runner.close()
    # assert: the round closed with the others' reports; the page is a dropout
    assert "error" not in out, out.get("error")
    assert not any(errors)
    (result,) = ctx.rounds
    assert result.reports == 2 and result.details["state"] == "closed"
    assert result.details["assigned"] == 3 and result.details["dropped"] == 1
    with deploy.Admin(server.url, server.admin_token) as admin:
        assert admin.status()["dropouts"] == 1
    with context.with_context(simulation.SimulationContext()):
        want, _ = process.next(process.initialize(), [batches(s) for s in shares[:2]])
    got_w, want_w = process.get_model_weights(out["state"]), process.get_model_weights(want)
    np.testing.assert_allclose(got_w.trainable["w"], want_w.trainable["w"], rtol=1e-5, atol=1e-6)


STALLED_CLIENT = """
async ([population, token]) => {
  const m = await import('/browser/fedlang.js');
  const never = (async function* () { await new Promise(() => {}); })();
  window.events = [];
  window.client = new m.FedlangClient({population, token, data: {train: never},
    backoff: [0.02, 0.3], onEvent: (e) => window.events.push({type: e.type})});
  window.client.run().catch(() => {});
  return true;
}
"""

GARBAGE_THEN_HONEST = """
async ([population, token, x, y]) => {
  const m = await import('/browser/fedlang.js');
  const n = y.length;
  const data = {train: m.batches({x: {data: Float32Array.from(x), shape: [n, 64]},
                                  y: {data: Int32Array.from(y), shape: [n]}}, 20)};
  const c = new m.FedlangClient({population, token, data, backoff: [0.02, 0.3]});
  let task = null;
  while (!task) {
    task = (await (await c.authorized('POST', '/v1/checkin')).json()).task;
    if (!task) await new Promise((r) => setTimeout(r, 50));
  }
  const honest = await (await c.task(task.plan)).run(await c.blob(task.broadcast), data);
  const nan = honest.slice();  // the honest report with its first float32 set to NaN
  const view = new DataView(nan.buffer);
  view.setFloat32(11 + view.getUint32(7, true) + 8, NaN, true);
  view.setUint32(nan.length - 4, m.crc32(nan.subarray(0, nan.length - 4)), true);
  const uploads = {
    garbage: new TextEncoder().encode('not a report'), empty: new Uint8Array(0),
    truncated: honest.subarray(0, honest.length - 9), nan,
  };
  const refused = {};
  for (const [name, body] of Object.entries(uploads)) {
    try {
      await c.authorized('PUT', `/v1/rounds/${task.round}/report`,
                         {body, headers: {'Content-Type': 'application/octet-stream',
                                          ...m.taskHeader(task)}});
      refused[name] = 'accepted';
    } catch (e) {
      refused[name] = [e.status, e.reason];
    }
  }
  const accepted = await c.runTask(task);
  return {refused, accepted, round: task.round, report: m.toBase64(c.lastReport),
          same: m.toBase64(c.lastReport) === m.toBase64(honest)};
}
"""


def test_a_page_that_uploads_garbage_gets_a_4xx_and_changes_nothing(
    server_factory, pages, logreg_process, browser_tasks
):
    # arrange: a round for one client, with the browser section
    (share,) = digits_clients(1, per_client=60)
    server = server_factory(browser=True)
    process = logreg_process
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    plan = browser_tasks(plan, broadcast)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
        r = admin.create_round("digits", admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast),
                               target=1, deadline=60, request_id="garbage")
        # act: garbage, an empty body, a truncated and a NaN report, then the honest one
        page = pages(f"{server.url}/v1/status")
        out = page.evaluate(GARBAGE_THEN_HONEST, ["digits", token, share["x"].reshape(-1).tolist(),
                                                  share["y"].tolist()])
        final = admin.round(r["id"])
        aggregate = admin.aggregate(r["id"])
        status = admin.status()
    # assert: each refusal is a 4xx; only the honest report is in the aggregate
    assert out["refused"] == {
        "garbage": [400, "malformed"], "empty": [400, "malformed"],
        "truncated": [400, "malformed"], "nan": [400, "non_finite"],
    }
    assert out["accepted"] is True and out["same"] is True
    assert final["state"] == "closed" and final["reports"] == 1 and final["refused"] == 4
    assert status["reports"]["refused"] == {"malformed": 3, "non_finite": 1}
    folder = deploy.Folder(plan)
    want = folder.fold(folder.empty(), folder.check(base64.b64decode(out["report"])))
    assert aggregate == want
    reference = execution.run_plan(plan, broadcast, {"train": batches(share)})
    for g, w in zip(_decoded(base64.b64decode(out["report"]), plan.report_type),
                    _decoded(reference, plan.report_type)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)


def test_the_demo_page_trains_on_an_npz_file_the_user_picks(
    server_factory, pages, logreg_process, browser_tasks, tmp_path
):
    (share,) = digits_clients(1, per_client=100)
    np.savez_compressed(tmp_path / "mine.npz", x=share["x"], y=share["y"])
    np.savez(tmp_path / "stored.npz", x=share["x"], y=share["y"])
    server = server_factory(demo_page=True)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    page = pages(f"{server.url}/demo/#population=digits&token={token}")
    failed, errors = [], []  # nothing the page loads may fail (a missing favicon did)
    page.on("response", lambda r: r.status >= 400 and failed.append((r.status, r.url)))
    page.on("console", lambda m: m.type == "error" and errors.append(m.text))
    page.reload()
    # np.savez's stored (zip64) entries read as np.savez_compressed's deflated ones
    stored = base64.b64encode((tmp_path / "stored.npz").read_bytes()).decode()
    arrays = page.evaluate(
        """async (b64) => { const m = await import('/browser/npz.js');
             const f = await import('/browser/fedlang.js');
             const a = await m.readNpz(f.fromBase64(b64));
             return {y: Array.from(a.y.data), shape: a.x.shape, dtype: a.x.dtype}; }""", stored)
    assert arrays == {"y": share["y"].tolist(), "shape": [100, 64], "dtype": "float32"}
    page.set_input_files("#file", str(tmp_path / "mine.npz"))
    page.click("#start")
    process = logreg_process
    runner = deploy.ServerRounds(server.url, server.admin_token, "digits", target=1, deadline=120)
    with context.with_context(deploy.DeploymentContext(runner, browser_tasks)):
        process.next(process.initialize(), deploy.client_data("train"))
    runner.finish()
    runner.close()
    page.wait_for_function("document.getElementById('reports').textContent === '1'")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('Done')")
    assert "round 1: report accepted (loss " in page.text_content("#log")
    # the page shows its own training loss and accuracy: its report's statistics, divided
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    report = execution.run_plan(plan, broadcast, {"train": batches(share)})
    stats = serialization.deserialize_value(report, expected_type=plan.report_type)[1]
    loss = float(stats["loss_sum"]) / float(stats["num_examples"])
    accuracy = float(stats["metrics"]["accuracy"]["correct"]) / float(stats["metrics"]["accuracy"]["count"])
    assert float(page.text_content("#loss")) == pytest.approx(loss, abs=2e-4)
    assert float(page.text_content("#accuracy")) == pytest.approx(accuracy, abs=2e-4)
    assert 0 < accuracy < 1 and loss > 0
    assert failed == [] and errors == [], (failed, errors)


def test_a_page_rides_out_a_server_restart(serve_process, pages, logreg_process, browser_tasks):
    # arrange: a page checking in with a server that then dies (kill -9)
    (share,) = digits_clients(1, per_client=60)
    server = serve_process.start()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
        public_key = base64.b64decode(admin.status()["server"]["public_key"])
    page = pages(f"{server.url}/v1/status")
    start_page_client(page, "digits", token, share)
    _wait(lambda: any(e["type"] == "wait" for e in page.evaluate("window.events")),
          what="the page to check in")
    server.kill()
    _wait(lambda: any(e["type"] == "retry" for e in page.evaluate("window.events")),
          what="the page to retry", page=page)
    # act: the server comes back on the same database; the driver opens a round
    server.start()
    process = logreg_process
    runner = deploy.ServerRounds(server.url, server.admin_token, "digits", target=1, deadline=120)
    with context.with_context(deploy.DeploymentContext(runner, browser_tasks)):
        state, _ = process.next(process.initialize(), deploy.client_data("train"))
    runner.finish()
    runner.close()
    # assert: the page kept its credential and pinned key, and reported the round
    _wait(lambda: page.evaluate("window.outcome") is not None, what="the page to stop")
    assert page.evaluate("window.outcome") == {"done": 1}
    with deploy.Admin(server.url, server.admin_token) as admin:
        status = admin.status()
    assert status["enrollments"] == 1 and status["reports"]["accepted"] == 1
    assert base64.b64decode(status["server"]["public_key"]) == public_key
    with context.with_context(simulation.SimulationContext()):
        want, _ = process.next(process.initialize(), [batches(share)])
    np.testing.assert_allclose(process.get_model_weights(state).trainable["w"],
                               process.get_model_weights(want).trainable["w"], rtol=1e-5, atol=1e-6)


READ_STATE = """
async ([key]) => {
  const m = await import('/browser/fedlang.js');
  const bytes = await new m.StateStore().get(key);  // a new handle: what IndexedDB holds
  return bytes ? m.toBase64(bytes) : null;
}
"""


@pytest.mark.slow  # about 60 s: Chromium, the preflight, 2 rounds of 3 clients
def test_browsers_keep_their_client_state_in_indexeddb(server_factory, client_threads, pages, tmp_path):
    # arrange: 2 pages and a Python client, SCAFFOLD (a control variate per client)
    from fedlang.deploy.browser import runner
    from fedlang.learning import algorithms

    from .conftest import model_fn

    shares = digits_clients(3, per_client=60)
    server = server_factory(browser=True)
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    browsers = [pages(f"{server.url}/v1/status") for _ in range(2)]
    for page, share in zip(browsers, shares[:2]):
        start_page_client(page, "digits", token, share)
    python = deploy.Client(server.url, "digits", token, {"train": batches(shares[2])},
                           state_dir=tmp_path / "device", **FAST)
    errors = client_threads(python)
    process = algorithms.build_scaffold(model_fn, 0.1, total_clients=3)
    state = initial = process.initialize()
    ctx = deploy.deployment_context(server.url, server.admin_token, "digits", target=3,
                                    deadline=120, browser=True)
    # act
    with context.with_context(ctx):
        for _ in range(2):
            state, _, _ = process.next(state, deploy.client_data("train"),
                                       deploy.client_state("scaffold"))
    ctx.runner.finish()
    ctx.runner.close()
    # assert: the reference runtime on the same 3 clients gives the same model and states
    with fl.runtime.reference_context():
        want, states = initial, [process.client_state.initial_state()] * 3
        for _ in range(2):
            want, _, states = process.next(want, [batches(s) for s in shares], states)
    for got, ref in zip(jax.tree.leaves(process.get_model_weights(state)),
                        jax.tree.leaves(process.get_model_weights(want))):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)
    for page, ref in zip(browsers, states[:2]):
        _wait(lambda p=page: p.evaluate("window.outcome") is not None, what="the page to stop",
              page=page)
        assert page.evaluate("window.outcome") == {"done": 2}
        kept = page.evaluate(READ_STATE, ["digits/scaffold"])
        for got, r in zip(runner.read_value(base64.b64decode(kept)), jax.tree.leaves(ref)):
            np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-5)
    _wait(lambda: python.tasks_done == 2, what="the Python client's second report")
    on_device = python.states.read("digits", "scaffold", process.client_state.state_type)
    for got, r in zip(jax.tree.leaves(on_device), jax.tree.leaves(states[2])):
        np.testing.assert_allclose(got, r, rtol=1e-5, atol=1e-5)
    assert not errors
