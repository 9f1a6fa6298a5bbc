"""onnxruntime-web's files: checked by SHA-256, taken from a directory or from npm's registry
tarball (no npm needed), never from a CDN."""

import functools
import http.server
import io
import socket
import tarfile
import threading

import pytest

from fedlang.deploy.browser import assets


def test_files_of_another_version_count_as_missing(tmp_path):
    for name in assets.FILES:
        (tmp_path / name).write_bytes(b"not onnxruntime-web " + name.encode())
    assert assets.missing(tmp_path) == list(assets.FILES)


def _closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_installing_with_no_source_reachable_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"could not be downloaded .*npm is not installed.*"
                                                r"FEDLANG_NPM_REGISTRY.*FEDLANG_ORT_DIR"):
        assets.install(tmp_path / "ort", registry=_closed_port_url(), npm="/nonexistent/npm")
    assert not (tmp_path / "ort").exists()


def test_installed_files_are_not_fetched_again(ort_assets):
    assert assets.install(ort_assets, registry=_closed_port_url(), npm="/nonexistent/npm") == ort_assets


def test_files_come_from_a_directory_that_holds_them(tmp_path, ort_assets):
    out = assets.install(tmp_path / "ort", sources=[tmp_path / "nothing-here", ort_assets],
                         registry=_closed_port_url(), npm="/nonexistent/npm")
    assert assets.missing(out) == [] and (out / "README.txt").read_text() == assets.README


def _tarball(ort_dir, tamper=None):
    """An npm package tarball (package/dist/...) holding the checked files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name in [*assets.FILES, "package.json"]:
            data = (ort_dir / name).read_bytes() if name in assets.FILES else b"{}"
            if name == tamper:
                data = data[:-1] + bytes([data[-1] ^ 1])
            info = tarfile.TarInfo(f"package/dist/{name}" if name in assets.FILES else f"package/{name}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def registry(tmp_path):
    """A registry on 127.0.0.1 serving files from tmp_path/registry (npm's URL layout)."""
    root = tmp_path / "registry"
    (root / "onnxruntime-web" / "-").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root / "onnxruntime-web" / "-" / f"onnxruntime-web-{assets.ORT_WEB_VERSION}.tgz", \
        f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_the_registry_tarball_is_read_without_npm(tmp_path, ort_assets, registry):
    path, url = registry
    path.write_bytes(_tarball(ort_assets))
    assert assets.tarball_url(url) == f"{url}/onnxruntime-web/-/onnxruntime-web-{assets.ORT_WEB_VERSION}.tgz"
    out = assets.install(tmp_path / "ort", registry=url, npm="/nonexistent/npm")
    assert assets.missing(out) == [] and sorted(p.name for p in out.iterdir()) == sorted(
        [*assets.FILES, "README.txt"])


def test_a_tarball_with_a_changed_file_is_refused_and_nothing_is_written(tmp_path, ort_assets, registry):
    path, url = registry
    path.write_bytes(_tarball(ort_assets, tamper="ort-wasm-simd-threaded.wasm"))
    with pytest.raises(RuntimeError, match=r"pinned SHA-256 .* found \['ort-wasm-simd-threaded.wasm'\] "
                                           r"missing or differing; refusing them"):
        assets.install(tmp_path / "ort", registry=url, npm="/nonexistent/npm")
    assert not (tmp_path / "ort").exists()
