"""fedlang.js and large blobs, in headless Chromium against a real server: a page refuses
a blob over its `maxBlobBytes` before reading it, streams the others into one buffer and
tells its download progress."""

import itertools
import time

import jax.numpy as jnp
import optax
import pytest

from fedlang import deploy
from fedlang.learning import algorithms, models

from ..conftest import capture
from .conftest import SPEC, digits_clients

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")

MiB = 2**20
PADDING = 1 << 20  # float32 weights the model does not use: a 4 MiB broadcast


def padded_model_fn():
    """Logistic regression with 4 MiB of weights it never reads, so that its broadcast
    (the weights) is much larger than its plan (~170 KB)."""
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([64, 10]), "b": jnp.zeros([10]),
                             "pad": jnp.zeros([PADDING])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
    )


@pytest.fixture(scope="module")
def padded_round(browser_tasks):
    """(plan bytes, broadcast bytes) of a FedAvg round of `padded_model_fn`."""
    process = algorithms.build_weighted_fed_avg(padded_model_fn, optax.sgd(0.5))
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    return browser_tasks(plan, broadcast).to_bytes(), broadcast


def _open_round(server, plan, broadcast, name):
    """A population, its token and a round of `plan` for one client; the round's id and
    the blobs its clients download: {hash: bytes} of the signed plan and the broadcast."""
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
        r = admin.create_round("digits", admin.put_blob(plan), admin.put_blob(broadcast),
                               target=1, deadline=60, request_id=name)
        signed = admin.connection.request("GET", f"/v1/blobs/{r['plan']}", token=admin.token)
    return token, r["id"], {r["plan"]: signed.content, r["broadcast"]: broadcast}


def _size(n):
    """A size as fedlang.js writes it in messages."""
    return f"{n / MiB:.1f} MiB ({n} bytes)" if n >= MiB else f"{n} bytes"


def _wait(page, condition, what):
    end = time.monotonic() + 120
    while not page.evaluate(condition):
        assert time.monotonic() < end, f"timed out waiting for {what}: {page.evaluate('window.events')}"
        time.sleep(0.05)


RUN_CLIENT = """
async ([population, token, x, y, maxBlobBytes]) => {
  const m = await import('/browser/fedlang.js');
  const n = y.length;
  const data = {train: m.batches({x: {data: Float32Array.from(x), shape: [n, 64]},
                                  y: {data: Int32Array.from(y), shape: [n]}}, 20)};
  window.events = [];
  window.outcome = null;
  const client = new m.FedlangClient({population, token, data, backoff: [0.02, 0.3], maxBlobBytes,
    onEvent: (e) => window.events.push({type: e.type, round: e.round, hash: e.hash,
                                        received: e.received, total: e.total})});
  client.run({maxTasks: 1}).then((n) => { window.outcome = {done: n}; },
                                 (e) => { window.outcome = {error: String(e), reason: e.reason}; });
  return true;
}
"""


def _run_page(pages, server, token, share, max_blob_bytes):
    page = pages(f"{server.url}/v1/status")
    page.evaluate(RUN_CLIENT, ["digits", token, share["x"].reshape(-1).tolist(),
                               share["y"].tolist(), max_blob_bytes])
    _wait(page, "window.outcome !== null", "the page to stop")
    return page.evaluate("window.outcome"), page.evaluate("window.events")


def test_a_page_refuses_a_broadcast_over_its_limit_before_reading_it(
    server_factory, pages, padded_round
):
    # arrange: a round whose broadcast (4 MiB) is over the page's limit, its plan under it
    plan, broadcast = padded_round
    limit = 2 * MiB
    (share,) = digits_clients(1, per_client=40)
    server = server_factory(browser=True)
    token, round_id, blobs = _open_round(server, plan, broadcast, "over")
    plan_hash, broadcast_hash = blobs
    assert len(blobs[plan_hash]) < limit < len(broadcast)
    # act
    outcome, events = _run_page(pages, server, token, share, limit)
    # assert: the refusal names the blob, its size, the limit and the fix
    assert outcome == {"reason": "too_large", "error": (
        f"FedlangError: Expected blob {broadcast_hash} within maxBlobBytes, this client's limit "
        f"of {_size(limit)}, found {_size(len(broadcast))}; pass a larger maxBlobBytes to "
        "FedlangClient if this browser has the memory, or use the Python client "
        "(fedlang.deploy.Client) for models this large.")}
    # the plan was read; not one chunk of the broadcast was (refused on its Content-Length)
    downloads = [e for e in events if e["type"] == "download"]
    assert downloads and {e["hash"] for e in downloads} == {plan_hash}
    assert [e["type"] for e in events if e["type"] in ("task", "step", "report")] == ["task"]
    with deploy.Admin(server.url, server.admin_token) as admin:
        assert admin.round(round_id)["reports"] == 0
        assert admin.status()["reports"]["accepted"] == 0


def test_a_round_streams_its_blobs_and_tells_the_progress(
    server_factory, pages, logreg_process, browser_tasks
):
    # arrange: an ordinary round (logistic regression), the page's limit well above it
    plan, broadcast = capture(logreg_process.next, logreg_process.initialize(),
                              deploy.client_data("train"))
    plan = browser_tasks(plan, broadcast).to_bytes()
    (share,) = digits_clients(1, per_client=40)
    server = server_factory(browser=True)
    token, round_id, blobs = _open_round(server, plan, broadcast, "normal")
    # act
    outcome, events = _run_page(pages, server, token, share, 2 * max(map(len, blobs.values())))
    # assert: the report was accepted after both downloads, each ending at its whole length
    assert outcome == {"done": 1}
    types = [e["type"] for e in events]
    assert types.index("report") > max(i for i, t in enumerate(types) if t == "download")
    for hash_, blob in blobs.items():
        seen = [(e["received"], e["total"]) for e in events
                if e["type"] == "download" and e["hash"] == hash_]
        assert 1 <= len(seen) <= 21, seen  # each 5% at most, and the end
        assert all(total == len(blob) for _, total in seen)
        received = [r for r, _ in seen]
        assert received == sorted(set(received)) and received[-1] == len(blob)
    with deploy.Admin(server.url, server.admin_token) as admin:
        assert admin.round(round_id)["reports"] == 1


# The page's blob downloads, with or without the Content-Length the server sends (the
# wrapper strips it, as some proxies' chunked answers lack it).
DOWNLOADS = """
async ([population, token, broadcast]) => {
  const m = await import('/browser/fedlang.js');
  const real = window.fetch.bind(window);
  let strip = false;
  const lengths = [];
  window.fetch = async (...args) => {
    const r = await real(...args);
    if (!strip || !new URL(r.url).pathname.startsWith('/v1/blobs/')) return r;
    const headers = new Headers(r.headers);
    headers.delete('Content-Length');
    const stripped = new Response(r.body, {status: r.status, statusText: r.statusText, headers});
    lengths.push(stripped.headers.get('Content-Length'));
    return stripped;
  };
  const events = [];
  const client = new m.FedlangClient({population, token, backoff: [0.02, 0.3],
    onEvent: (e) => { if (e.type === 'download') events.push(e); }});
  const download = async (limit, stripLength) => {
    strip = stripLength;
    client.maxBlobBytes = limit;
    client.blobs.clear();
    events.length = 0;
    try {
      const bytes = await client.blob(broadcast);  // checks the SHA-256 of the whole
      return {bytes: bytes.length, events: [...events]};
    } catch (e) {
      return {error: String(e), reason: e.reason, events: [...events]};
    }
  };
  return {refused: await download(3 * 2 ** 20, true), read: await download(8 * 2 ** 20, true),
          announced: await download(8 * 2 ** 20, false), lengths};
}
"""


def test_a_blob_without_a_length_is_read_until_the_limit(server_factory, pages, padded_round):
    # arrange: the 4 MiB broadcast of a round; a page whose fetch drops Content-Length
    plan, broadcast = padded_round
    server = server_factory(browser=True)
    token, _, blobs = _open_round(server, plan, broadcast, "unannounced")
    _, broadcast_hash = blobs
    page = pages(f"{server.url}/v1/status")
    # act: limits of 3 MiB and 8 MiB without the length, 8 MiB with it
    out = page.evaluate(DOWNLOADS, ["digits", token, broadcast_hash])
    # assert: the wrapper did hide the length (twice)
    assert out["lengths"] == [None, None]
    # under 3 MiB: refused once past the limit, having read no more than the limit
    refused = out["refused"]
    assert refused["reason"] == "too_large"
    assert f"found more than {_size(3 * MiB)}; pass a larger maxBlobBytes" in refused["error"]
    assert all(e["total"] is None and e["received"] <= 3 * MiB for e in refused["events"])
    # under 8 MiB: the buffer grows to the whole blob, whose hash checks
    read = out["read"]
    assert read["bytes"] == len(broadcast)
    assert read["events"][-1] == {"type": "download", "hash": broadcast_hash,
                                  "received": len(broadcast), "total": None}
    # with the length: one buffer of that length; progress each 5% at most
    announced = out["announced"]
    assert announced["bytes"] == len(broadcast)
    received = [e["received"] for e in announced["events"]]
    assert 2 <= len(received) <= 21, received
    assert received == sorted(set(received)) and received[-1] == len(broadcast)
    marks = [0, *received[:-1]]  # each event but the last: 5% or more after the one before
    assert all(b - a >= 0.05 * len(broadcast) for a, b in itertools.pairwise(marks))
    assert {e["total"] for e in announced["events"]} == {len(broadcast)}



# The blobs a page keeps after downloading `broadcast`, from a cache filled beforehand
# with `kept` ([name, bytes], oldest first: values the page had downloaded).
KEPT_AFTER = """
async ([population, token, broadcast, kept]) => {
  const m = await import('/browser/fedlang.js');
  const client = new m.FedlangClient({population, token, backoff: [0.02, 0.3]});
  for (const [name, n] of kept) client.blobs.set(name, new Uint8Array(n));
  await client.blob(broadcast);
  return [...client.blobs.keys()];
}
"""


def test_the_blob_cache_keeps_8_blobs_of_64_mib_at_most(server_factory, pages, padded_round):
    # arrange: the 4 MiB broadcast of a round
    plan, broadcast = padded_round
    server = server_factory(browser=True)
    token, _, blobs = _open_round(server, plan, broadcast, "kept")
    _, broadcast_hash = blobs
    page = pages(f"{server.url}/v1/status")
    # act: after 8 small blobs; after 8 of 11 MiB; after one of 70 MiB and a small one
    by_count = page.evaluate(KEPT_AFTER, ["digits", token, broadcast_hash,
                                          [[f"small{i}", 100] for i in range(8)]])
    by_bytes = page.evaluate(KEPT_AFTER, ["digits", token, broadcast_hash,
                                          [[f"large{i}", 11 * MiB] for i in range(8)]])
    past_one = page.evaluate(KEPT_AFTER, ["digits", token, broadcast_hash,
                                          [["huge", 70 * MiB], ["small", 100]]])
    # assert: the oldest go first; the blob just downloaded stays
    assert by_count == [*(f"small{i}" for i in range(1, 8)), broadcast_hash]
    assert by_bytes == [*(f"large{i}" for i in range(3, 8)), broadcast_hash]  # 5 x 11 + 4 MiB
    assert past_one == ["small", broadcast_hash]
