"""fedlang's build: setuptools (configured in pyproject.toml) plus one step.

`build_py` also puts onnxruntime-web's files into the wheel (`fedlang/deploy/browser/
static/ort/`), each checked against its pinned SHA-256 by `fedlang.deploy.browser.
assets`, so that every wheel is complete and the same whatever ran before the build:
`fedlang serve --browser` / `--demo-page` work from a plain `pip install fedlang`, with
no npm anywhere. The files come from `FEDLANG_ORT_DIR`, else from this checkout's
`static/ort/` (filled by `python -m fedlang.deploy.browser.assets`), else from npm's
registry tarball (a build without network access needs one of the first two). The
checkout's own `static/ort/` is never packaged as it is: the step writes the checked
files into the build directory. Editable installs skip the step (the checkout is the
package).
"""

import importlib.util
import os
import pathlib
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
ASSETS = ROOT / "src" / "fedlang" / "deploy" / "browser" / "assets.py"


def _assets():
    # Loaded by path: the package's dependencies are not installed at build time, and
    # this module imports only the standard library.
    spec = importlib.util.spec_from_file_location("_fedlang_browser_assets", ASSETS)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


class BuildPyWithBrowserAssets(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        target = pathlib.Path(self.build_lib) / "fedlang" / "deploy" / "browser" / "static" / "ort"
        shutil.rmtree(target, ignore_errors=True)
        sources = [os.environ.get("FEDLANG_ORT_DIR") or "", ASSETS.parent / "static" / "ort"]
        done = _assets().install(target, sources=[s for s in sources if s])
        self.announce(f"onnxruntime-web's checked files in {done}", level=2)


setup(cmdclass={"build_py": BuildPyWithBrowserAssets})
