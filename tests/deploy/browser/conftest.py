"""Fixtures of the browser client tests: headless Chromium driven by playwright, digits
split across clients, and a logistic regression process.

Chromium is Debian's (`/usr/bin/chromium`, installed by `scripts/browser_setup.sh`, which
the test command runs); playwright drives it through `executable_path` (it cannot
download its own browsers here). Tests that need it are skipped, saying why, only when
it could not be installed.
"""

import os
import pathlib
import shutil

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models

CHROMIUM = os.environ.get("FEDLANG_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_FLAGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
]
ROOT = pathlib.Path(__file__).resolve().parents[3]
SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}
BATCH = 20


def model_fn():
    """Multinomial logistic regression, 64 pixels -> 10 digits (as examples/deploy_digits.py)."""
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([64, 10]), "b": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


@pytest.fixture(scope="session")
def logreg_process():
    return algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.5))


def digits_clients(num_clients, seed=0, per_client=None):
    """Shares of scikit-learn's digits (shuffled), one {'x', 'y'} dict per client."""
    from sklearn.datasets import load_digits

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(y))
    shares = np.array_split(order, num_clients)
    return [{"x": x[s[:per_client]], "y": y[s[:per_client]]} for s in shares]


def batches(share, batch_size=BATCH):
    """A client's dataset: a list of batches, as a page's `batches(...)` cuts them."""
    n = len(share["y"])
    return [{k: v[i : i + batch_size] for k, v in share.items()} for i in range(0, n, batch_size)]


@pytest.fixture(scope="session")
def chromium():
    """A headless Chromium (playwright's Browser), or a skip saying why there is none."""
    sync_api = pytest.importorskip("playwright.sync_api", reason="playwright is not installed "
                                   "(pip install 'fedlang[dev]')")
    if not (pathlib.Path(CHROMIUM).exists() or shutil.which(CHROMIUM)):
        log = ROOT / "build" / "browser_setup.log"
        why = log.read_text().strip().splitlines()[-3:] if log.exists() else ["it did not run"]
        pytest.skip(f"Chromium is not installed at {CHROMIUM}, and scripts/browser_setup.sh "
                    f"could not install it (it needs apt-get as root): {' '.join(why)}")
    playwright = sync_api.sync_playwright().start()
    try:
        browser = playwright.chromium.launch(
            executable_path=CHROMIUM, headless=True, args=CHROMIUM_FLAGS
        )
        try:
            yield browser
        finally:
            browser.close()
    finally:
        playwright.stop()


@pytest.fixture
def pages(chromium, ort_assets):
    """Opens pages (each in its own context: its own storage); closes them at the end."""
    contexts = []

    def open_page(url):
        ctx = chromium.new_context()
        contexts.append(ctx)
        page = ctx.new_page()
        page.set_default_timeout(120_000)
        page.goto(url)
        return page

    yield open_page
    for ctx in contexts:
        ctx.close()


START_CLIENT = """
async ([population, token, x, y, batchSize, options]) => {
  const m = await import('/browser/fedlang.js');
  const n = y.length;
  const data = {train: m.batches({x: {data: Float32Array.from(x), shape: [n, x.length / n]},
                                  y: {data: Int32Array.from(y), shape: [n]}}, batchSize)};
  window.reports = {};
  window.events = [];
  window.client = new m.FedlangClient({population, token, data, backoff: [0.02, 0.3], ...options,
    onEvent: (e) => {
      if (e.type === 'report') {
        window.reports[e.round] = {report: m.toBase64(e.report), plan: e.plan, broadcast: e.broadcast};
      }
      window.events.push({type: e.type, round: e.round, status: e.status, reason: e.reason});
    }});
  window.outcome = null;
  window.client.run().then((n) => { window.outcome = {done: n}; },
                           (e) => { window.outcome = {error: String(e)}; });
  return true;
}
"""


def start_page_client(page, population, token, share, batch_size=BATCH, **options):
    """Starts a `FedlangClient` in `page` on a client's share of the data."""
    page.evaluate(START_CLIENT, [population, token, share["x"].reshape(-1).tolist(),
                                 share["y"].tolist(), batch_size, options])


@pytest.fixture(scope="session")
def ort_assets():
    """onnxruntime-web's files for the server to serve, or a skip saying how to get them."""
    from fedlang.deploy.browser import assets

    lacking = assets.missing()
    if lacking:
        pytest.skip(f"onnxruntime-web's files {lacking} are missing from {assets.ort_dir()}; "
                    "`python -m fedlang.deploy.assets` (run by scripts/browser_setup.sh) "
                    "fetches them with npm.")
    return assets.ort_dir()


@pytest.fixture(scope="session")
def browser_tasks():
    """One `BrowserTasks` for the session: each task is exported and checked once."""
    pytest.importorskip("jax2onnx", reason="the browser extra is not installed")
    from fedlang.deploy import browser

    return browser.BrowserTasks()


@pytest.fixture
def serve_process(server_process, tmp_path):
    """A `fedlang serve --browser` process (killed at the end of the test)."""
    return server_process(tmp_path / "store.db", extra_args=["--browser"])
