"""onnxruntime-web's files, served by `fedlang serve --browser` (nothing comes from a CDN).

The browser client runs its programs with onnxruntime-web's WebAssembly backend: three
files of the npm package `onnxruntime-web`, pinned and SHA-256 checked like every npm
package the server serves (`fedlang.deploy.assets.ORT_WEB`, which fetches them; see that
module). This module names them for the browser's routes: where the server finds them
(`ort_dir`, `FEDLANG_ORT_DIR` or `static/ort/`) and whether they are all there.
`python -m fedlang.deploy.browser.assets` installs them (and the other packages).
"""

from __future__ import annotations

import pathlib

from fedlang.deploy import assets

ORT = assets.ORT_WEB
ORT_WEB_VERSION = ORT.version
FILES = ORT.stored  # file name -> its SHA-256 in ORT_WEB_VERSION
README = ORT.readme
STATIC = pathlib.Path(__file__).resolve().parent / "static"
DEMO = pathlib.Path(__file__).resolve().parent / "demo"


def ort_dir() -> pathlib.Path:
    """Where the server looks for onnxruntime-web's files."""
    return ORT.directory()


def missing(directory: pathlib.Path | None = None) -> list[str]:
    """The files of onnxruntime-web that `directory` lacks (or holds in another version)."""
    return ORT.missing(directory)


def check() -> pathlib.Path:
    """The directory of onnxruntime-web's files.

    Raises:
      FileNotFoundError: naming the missing files and how to install them.
    """
    return ORT.check()


if __name__ == "__main__":
    assets.main()
