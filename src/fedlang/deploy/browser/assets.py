"""onnxruntime-web's files, served by `fedlang serve --browser` (nothing comes from a CDN).

The browser client runs its programs with onnxruntime-web's WebAssembly backend: three
files of the npm package `onnxruntime-web` (pinned below, 14 MB, 3.7 MB gzipped). They
are not kept in the repository. `install()` takes them, each checked against its pinned
SHA-256, from a directory that already holds them, or else from the package's tarball
on npm's registry (`https://registry.npmjs.org/onnxruntime-web/-/onnxruntime-web-
VERSION.tgz`, read with the standard library: no npm needed), and copies them into the
Python package (`fedlang/deploy/browser/static/ort/`).

Building a wheel runs the same step (`setup.py`'s `build_py`), so every wheel holds the
same checked files whatever ran before the build; a build without network access takes
them from `FEDLANG_ORT_DIR` or from a checkout where `python -m
fedlang.deploy.browser.assets` (which `scripts/browser_setup.sh` runs) put them. An
editable install (`pip install -e .`) uses the checkout's `static/ort/`, filled by that
command. `FEDLANG_ORT_DIR` also points the server at another directory holding the same
files, and `FEDLANG_NPM_REGISTRY` the download at another registry (a mirror).
This module imports only the standard library: the build loads it by path.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tarfile
import tempfile
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import IO

ORT_WEB_VERSION = "1.30.0"
FILES = {  # file of the package's dist/ -> its SHA-256 in ORT_WEB_VERSION
    "ort.wasm.min.mjs": "219e6a1fc8a9938268d18efca3c91d310bd2f4a59bbd13744df5b2b7fc6cee3b",
    "ort-wasm-simd-threaded.mjs": "e13f7f94fc51b4ca72b12faeb1ee95f4ace6dfbc8939bc718aabdc0a27c4299b",
    "ort-wasm-simd-threaded.wasm": "3398c10d07d229bd91b364548e130e0e51a8e5704b88c7c083ebbeb78842dee2",
}
REGISTRY = "https://registry.npmjs.org"
README = (
    f"onnxruntime-web {ORT_WEB_VERSION} (MIT License, Microsoft): the dist/ files of npm's "
    "package, each checked against its pinned SHA-256 by fedlang.deploy.browser.assets.\n"
)
STATIC = pathlib.Path(__file__).resolve().parent / "static"
DEMO = pathlib.Path(__file__).resolve().parent / "demo"


def ort_dir() -> pathlib.Path:
    """Where the server looks for onnxruntime-web's files."""
    return pathlib.Path(os.environ.get("FEDLANG_ORT_DIR") or STATIC / "ort")


def missing(directory: pathlib.Path | None = None) -> list[str]:
    """The files of onnxruntime-web that `directory` lacks (or holds in another version)."""
    directory = directory or ort_dir()
    out = []
    for name, digest in FILES.items():
        path = directory / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            out.append(name)
    return out


def check() -> pathlib.Path:
    """The directory of onnxruntime-web's files.

    Raises:
      FileNotFoundError: naming the missing files and how to install them.
    """
    directory = ort_dir()
    lacking = missing(directory)
    if lacking:
        raise FileNotFoundError(
            f"Expected onnxruntime-web {ORT_WEB_VERSION}'s files {lacking} in {directory}, found "
            "them missing or of another version; install them with `python -m "
            "fedlang.deploy.browser.assets` (it downloads them from npm's registry; no npm "
            "needed) or set FEDLANG_ORT_DIR to a directory holding them."
        )
    return directory


def tarball_url(registry: str | None = None) -> str:
    """The pinned package's tarball on `registry` (default: `FEDLANG_NPM_REGISTRY`, or
    npm's public registry)."""
    base = registry or os.environ.get("FEDLANG_NPM_REGISTRY") or REGISTRY
    return f"{base.rstrip('/')}/onnxruntime-web/-/onnxruntime-web-{ORT_WEB_VERSION}.tgz"


def _write(files: dict[str, bytes], destination: pathlib.Path) -> pathlib.Path:
    """Writes checked files (all of FILES) and the README; nothing else."""
    destination.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        (destination / name).write_bytes(files[name])
    (destination / "README.txt").write_text(README)
    return destination


def _checked(files: dict[str, bytes], where: str) -> dict[str, bytes]:
    bad = [n for n in FILES if n not in files or hashlib.sha256(files[n]).hexdigest() != FILES[n]]
    if bad:
        raise RuntimeError(
            f"Expected onnxruntime-web {ORT_WEB_VERSION}'s files with their pinned SHA-256 in "
            f"{where}, found {bad} missing or differing; refusing them."
        )
    return files


def from_tarball(tarball: IO[bytes], destination: pathlib.Path, where: str = "the tarball") -> pathlib.Path:
    """Copies FILES out of the npm package's tarball (`package/dist/NAME`), reading no
    other member and writing nothing unless every file checks.

    Raises:
      RuntimeError: when a file is missing or differs from the pinned version's.
      tarfile.TarError: when `tarball` is not a gzipped tar file.
    """
    wanted = {f"package/dist/{name}": name for name in FILES}
    files: dict[str, bytes] = {}
    with tarfile.open(fileobj=tarball, mode="r:gz") as tar:
        for member in tar:
            if member.name in wanted and member.isfile():
                extracted = tar.extractfile(member)
                if extracted is not None:
                    files[wanted[member.name]] = extracted.read()
    return _write(_checked(files, where), destination)


def fetch(destination: pathlib.Path, registry: str | None = None, timeout: float = 120) -> pathlib.Path:
    """Downloads the pinned package's tarball and copies its checked files to `destination`.

    Raises:
      urllib.error.URLError, OSError: when the registry cannot be reached.
      RuntimeError: when a file is not the pinned version's.
    """
    url = tarball_url(registry)
    with tempfile.TemporaryFile() as spool:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            shutil.copyfileobj(response, spool)
        spool.seek(0)
        return from_tarball(spool, destination, url)


def install(destination: pathlib.Path | None = None, *, sources: Sequence[pathlib.Path | str] = (),
            registry: str | None = None, npm: str = "npm") -> pathlib.Path:
    """Puts onnxruntime-web's checked files in `destination` (default: the package's
    `static/ort/`), unless they are there already.

    They come from the first of `sources` (directories) that holds them all; else from
    the registry's tarball (`fetch`); else, when that fails and npm is installed, from
    `npm install` (which follows npm's own proxy and mirror settings). Every file is
    checked against its pinned SHA-256 whatever its source.

    Raises:
      FileNotFoundError: when no source is reachable, saying what was tried and what to do.
      RuntimeError: when a source's files are not the pinned version's.
    """
    destination = pathlib.Path(destination or STATIC / "ort")
    if not missing(destination):
        return destination
    for source in map(pathlib.Path, sources):
        if source.is_dir() and not missing(source):
            return _write({name: (source / name).read_bytes() for name in FILES}, destination)
    try:
        return fetch(destination, registry)
    except (urllib.error.URLError, OSError) as e:
        unreachable = f"{tarball_url(registry)} could not be downloaded ({e})"
    if shutil.which(npm) is None:
        raise FileNotFoundError(
            f"Expected onnxruntime-web {ORT_WEB_VERSION}'s files, found none: {unreachable}, and "
            f"npm is not installed. Set FEDLANG_NPM_REGISTRY to a registry you can reach, or put "
            f"the package's dist/ files {sorted(FILES)} in a directory named by FEDLANG_ORT_DIR."
        )
    return _install_with_npm(destination, npm)


def _install_with_npm(destination: pathlib.Path, npm: str) -> pathlib.Path:
    with tempfile.TemporaryDirectory(prefix="fedlang-ort-") as work:
        done = subprocess.run(
            [npm, "install", "--prefix", work, "--no-save", "--ignore-scripts", "--no-audit",
             "--no-fund", "--loglevel=error", f"onnxruntime-web@{ORT_WEB_VERSION}"],
            capture_output=True, text=True, timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"npm could not install onnxruntime-web: {done.stderr[-2000:]}")
        dist = pathlib.Path(work) / "node_modules" / "onnxruntime-web" / "dist"
        files = {name: (dist / name).read_bytes() for name in FILES if (dist / name).is_file()}
        return _write(_checked(files, str(dist)), destination)


def main() -> None:
    try:
        print(f"onnxruntime-web {ORT_WEB_VERSION} in {install()}")
    except (FileNotFoundError, RuntimeError, OSError, tarfile.TarError,
            subprocess.TimeoutExpired) as e:
        print(f"fedlang: {e}", file=sys.stderr)
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
