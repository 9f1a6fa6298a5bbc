"""onnxruntime-web's files, served by `fedlang serve --browser` (nothing comes from a CDN).

The browser client runs its programs with onnxruntime-web's WebAssembly backend: three
files of the npm package `onnxruntime-web` (pinned below, 14 MB, 3.7 MB gzipped). They
are not kept in the repository; `install()` fetches the package with npm at build or
test time (`python -m fedlang.deploy.browser.assets`, which `scripts/test.sh` runs),
checks each file's SHA-256 against the pinned version's, and copies them into the Python
package (`fedlang/deploy/browser/static/ort/`), so a wheel built afterwards ships them.
`FEDLANG_ORT_DIR` points the server at another directory holding the same files.
"""

from __future__ import annotations

import hashlib
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile

ORT_WEB_VERSION = "1.30.0"
FILES = {  # file of the package's dist/ -> its SHA-256 in ORT_WEB_VERSION
    "ort.wasm.min.mjs": "219e6a1fc8a9938268d18efca3c91d310bd2f4a59bbd13744df5b2b7fc6cee3b",
    "ort-wasm-simd-threaded.mjs": "e13f7f94fc51b4ca72b12faeb1ee95f4ace6dfbc8939bc718aabdc0a27c4299b",
    "ort-wasm-simd-threaded.wasm": "3398c10d07d229bd91b364548e130e0e51a8e5704b88c7c083ebbeb78842dee2",
}
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
            "fedlang.deploy.browser.assets` (needs npm) or set FEDLANG_ORT_DIR."
        )
    return directory


def install(destination: pathlib.Path | None = None, npm: str = "npm") -> pathlib.Path:
    """Fetches onnxruntime-web with npm and copies its files to `destination`.

    Raises:
      FileNotFoundError: when npm is missing; RuntimeError: when npm fails or a file's
        SHA-256 is not the pinned version's.
    """
    destination = destination or STATIC / "ort"
    if not missing(destination):
        return destination
    if shutil.which(npm) is None:
        raise FileNotFoundError(
            f"Expected npm to fetch onnxruntime-web {ORT_WEB_VERSION}, found none; install "
            "Node.js (npm), or copy the package's dist/ files "
            f"{sorted(FILES)} into {destination}."
        )
    with tempfile.TemporaryDirectory(prefix="fedlang-ort-") as work:
        done = subprocess.run(
            [npm, "install", "--prefix", work, "--no-save", "--ignore-scripts", "--no-audit",
             "--no-fund", "--loglevel=error", f"onnxruntime-web@{ORT_WEB_VERSION}"],
            capture_output=True, text=True, timeout=600,
        )
        if done.returncode != 0:
            raise RuntimeError(f"npm could not install onnxruntime-web: {done.stderr[-2000:]}")
        dist = pathlib.Path(work) / "node_modules" / "onnxruntime-web" / "dist"
        lacking = missing(dist)
        if lacking:
            raise RuntimeError(
                f"Expected onnxruntime-web {ORT_WEB_VERSION}'s files with their pinned SHA-256, "
                f"found {lacking} differing; refusing them."
            )
        destination.mkdir(parents=True, exist_ok=True)
        for name in FILES:
            shutil.copyfile(dist / name, destination / name)
    (destination / "README.txt").write_text(
        f"onnxruntime-web {ORT_WEB_VERSION} (MIT License, Microsoft), dist/ files fetched from "
        "npm by fedlang.deploy.browser.assets.install().\n"
    )
    return destination


def main() -> None:
    try:
        print(f"onnxruntime-web {ORT_WEB_VERSION} in {install()}")
    except (FileNotFoundError, RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        print(f"fedlang: {e}", file=sys.stderr)
        raise SystemExit(1) from e


if __name__ == "__main__":
    main()
