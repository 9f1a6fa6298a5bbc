"""The server serves the browser client, onnxruntime-web and (on request) the demo page."""

import httpx
import pytest

from fedlang import deploy
from fedlang.deploy.browser import assets


def test_the_client_and_onnxruntime_web_are_served_with_the_types_browsers_require(
    server_factory, ort_assets
):
    server = server_factory(browser=True)
    with httpx.Client(base_url=server.url) as http:
        js = http.get("/browser/fedlang.js")
        assert js.status_code == 200 and js.headers["content-type"] == "text/javascript"
        assert 'from "./ort/ort.wasm.min.mjs"' in js.text
        wasm = http.get("/browser/ort/ort-wasm-simd-threaded.wasm")
        assert wasm.headers["content-type"] == "application/wasm"
        assert wasm.content == (ort_assets / "ort-wasm-simd-threaded.wasm").read_bytes()
        assert http.get("/browser/ort/ort.wasm.min.mjs").headers["content-type"] == "text/javascript"
        assert http.get("/demo/").status_code == 404  # only with demo_page=True
        assert http.get("/v1/status").status_code == 200


def test_the_demo_page_is_served_on_request(server_factory, ort_assets):
    server = server_factory(demo_page=True)
    with httpx.Client(base_url=server.url) as http:
        page = http.get("/demo/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'src="demo.js"' in page.text
        assert http.get("/browser/npz.js").status_code == 200
        # a declared icon, served: browsers asked for /favicon.ico and logged its 404
        assert '<link rel="icon" href="favicon.svg" type="image/svg+xml">' in page.text
        icon = http.get("/demo/favicon.svg")
        assert icon.status_code == 200 and icon.headers["content-type"] == "image/svg+xml"
        assert icon.text.startswith("<svg")


def test_a_server_without_onnxruntime_web_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("FEDLANG_ORT_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"python -m fedlang.deploy.assets"):
        deploy.Server(db=tmp_path / "store.db", port=0, browser=True)
    assert assets.missing(tmp_path) == sorted(assets.FILES, key=list(assets.FILES).index)
