"""Every ```python block of every page under docs/ runs, and what a page shows as printed
output is what the code prints (doc_snippets.py says how blocks run and how output is
compared: text exactly, integers exactly, decimals within 0.02 or 2%).

Blocks run in order, in one namespace per page, in a fresh working directory. Pages that
talk to a server get a real one on 127.0.0.1 from `deploy_page` (the page's
`http://127.0.0.1:8000` is replaced by its URL, as a reader would type theirs). Blocks a
test cannot run are marked on the page with `<!-- not run: why -->` and listed in
`NOT_RUN`: a marked block missing from the list, or a listed one no longer marked, fails.
"""

import dataclasses
import secrets
import threading
import time

import pytest

from .doc_snippets import DOCS, blocks, run

PAGES = sorted(p.name for p in DOCS.glob("*.md"))
# Pages whose blocks take more than a few seconds: (about how long, on two cores).
SLOW = {
    "quickstart.md": "about 40 s: 15 rounds, an evaluation and a plot",
    "learning.md": "about 35 s: FedAvg, FedBuff and hyperparameters, each compiled",
    "data.md": "about 25 s: run_training with checkpoints and writers",
    "runtimes.md": "about 15 s: a round with the 'auto' strategy's measurements",
}
# (page, the block's first line) -> why it is not run; the page says the same.
NOT_RUN = {
    ("data.md", "from fedlang.simulation.datasets import emnist, shakespeare, stackoverflow, cifar100"):
        "reads TFF's SQLite files, which tests do not download",
    ("runtimes.md", "import fedlang as fl"):
        "starts a Ray instance and joins a cluster",
    ("deploy.md", "from fedlang import deploy"):
        "needs clients reporting 300 updates",
    ("deploy.md", "process = fl.learning.algorithms.build_scaffold(model_fn, 0.05, total_clients=1000)"):
        "needs a server and clients",
}


def test_no_block_is_left_out_without_being_listed():
    marked = {(b.page, b.code.splitlines()[0]): b.not_run for page in PAGES for b in blocks(page)
              if b.not_run is not None}
    assert marked.keys() == NOT_RUN.keys()
    for key, why in marked.items():
        assert NOT_RUN[key] in why, (key, why)
    total = sum(len(blocks(page)) for page in PAGES)
    assert total > 60 and len(NOT_RUN) <= 4  # a small, listed set


def _run_page(page, namespace):
    failures = []
    for block in blocks(page):
        if block.not_run is None:
            failures += run(block, namespace)
    return failures


@pytest.mark.parametrize("page", [
    pytest.param(p, marks=pytest.mark.slow) if p in SLOW else p
    for p in PAGES if p != "deploy.md" and any(b.not_run is None for b in blocks(p))
])
def test_the_pages_python_blocks_run_and_print_what_they_show(page, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    namespace = {"__name__": page.removesuffix(".md").replace("-", "_") + "_docs"}
    failures = _run_page(page, namespace)
    assert not failures, "\n".join(failures)
    if page == "quickstart.md":
        assert namespace["held_out"]["accuracy"] > 0.5  # chance is 0.1
        assert (tmp_path / "quickstart.png").read_bytes()[:4] == b"\x89PNG"


# The clients the deploy page's walkthroughs talk about: (population, data file) each.
DEPLOY_CLIENTS = [("digits", f"fl/client{i}.npz") for i in range(3)] + [
    ("digits-web", f"fl/client{i}.npz") for i in range(2)]


@pytest.mark.slow  # about 45 s: a server, five client threads, 8 rounds, the browser preflight
def test_the_deploy_pages_python_blocks_run_against_a_real_server(tmp_path, monkeypatch):
    pytest.importorskip("fastapi", reason="the deploy extra is not installed")
    pytest.importorskip("jax2onnx", reason="the browser extra is not installed (the preflight)")
    from fedlang import deploy

    monkeypatch.chdir(tmp_path)
    admin_token = secrets.token_urlsafe(16)
    monkeypatch.setenv("FEDLANG_ADMIN_TOKEN", admin_token)  # the page reads it, as a reader may
    with deploy.Server(db=tmp_path / "server.db", port=0, admin_token=admin_token,
                       pace=deploy.Pace(min_retry=0.1)) as server:
        with deploy.Admin(server.url, admin_token) as admin:
            tokens = {p: admin.create_population(p) for p in {p for p, _ in DEPLOY_CLIENTS}}
        clients, stop = [], threading.Event()

        def client(population, path):
            # As `fedlang client --data train=PATH` in step 3: it starts once step 2 wrote PATH.
            while True:  # the client checks its file at start: wait until it is whole
                try:
                    c = deploy.Client(server.url, population, tokens[population],
                                      {"train": path}, batch_size=20, patience=60)
                    break
                except (FileNotFoundError, ValueError):  # not yet written, or half
                    if stop.wait(0.05):
                        return
            clients.append(c)
            with c:
                if not stop.is_set():
                    c.run()

        threads = [threading.Thread(target=client, args=spec, daemon=True) for spec in DEPLOY_CLIENTS]
        for t in threads:
            t.start()
        namespace = {"__name__": "deploy_docs"}
        failures = []
        try:
            for block in blocks("deploy.md"):
                if block.not_run is None:
                    here = dataclasses.replace(block, code=block.code.replace("http://127.0.0.1:8000", server.url))
                    failures += run(here, namespace)
        finally:
            stop.set()
            for c in clients:
                c.stop()
            deadline = time.monotonic() + 60
            for t in threads:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        assert not failures, "\n".join(failures)
        assert all(not t.is_alive() for t in threads)
        assert len(namespace["ctx"].rounds) == 3  # the browser walkthrough's rounds, done
