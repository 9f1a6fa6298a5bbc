"""onnxruntime-web's files as the browser's routes see them: the pinned package of
`fedlang.deploy.assets` (tests/deploy/test_assets.py tests the fetching and checking)."""

from fedlang.deploy import assets as npm_assets
from fedlang.deploy.browser import assets


def test_the_browser_serves_the_pinned_onnxruntime_web(tmp_path, monkeypatch):
    assert npm_assets.ORT_WEB.version == assets.ORT_WEB_VERSION
    assert set(assets.FILES) == {"ort.wasm.min.mjs", "ort-wasm-simd-threaded.mjs",
                                 "ort-wasm-simd-threaded.wasm"}
    monkeypatch.setenv("FEDLANG_ORT_DIR", str(tmp_path))
    assert assets.ort_dir() == tmp_path
    for name in assets.FILES:
        (tmp_path / name).write_bytes(b"not onnxruntime-web " + name.encode())
    assert assets.missing() == list(assets.FILES)


def test_installed_files_pass_the_check(ort_assets):
    assert assets.missing(ort_assets) == [] and assets.check() == ort_assets
