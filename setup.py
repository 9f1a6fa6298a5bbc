"""fedlang's build: setuptools (configured in pyproject.toml) plus one step.

`build_py` also puts the npm packages the server serves into the wheel (onnxruntime-web
in `fedlang/deploy/browser/static/ort/`, uPlot for the dashboard in `fedlang/deploy/
server/static/uplot/`: `fedlang.deploy.assets.PACKAGES`), each file checked against its
pinned SHA-256, so that every wheel is complete and the same whatever ran before the
build: `fedlang serve --browser` / `--demo-page` and `/dashboard` work from a plain `pip
install fedlang`, with no npm anywhere. A package's files come from the directory its
variable names (`FEDLANG_ORT_DIR`, `FEDLANG_UPLOT_DIR`), else from this checkout's copy
(filled by `python -m fedlang.deploy.assets`), else from npm's registry tarball (a build
without network access needs one of the first two). The checkout's own copies are never
packaged as they are: the step writes the checked files into the build directory.
Editable installs skip the step (the checkout is the package).
"""

import importlib.util
import os
import pathlib
import shutil
import sys

from setuptools import setup
from setuptools.command.build_py import build_py

ROOT = pathlib.Path(__file__).resolve().parent
ASSETS = ROOT / "src" / "fedlang" / "deploy" / "assets.py"


def _assets():
    # Loaded by path: the package's dependencies are not installed at build time, and
    # this module imports only the standard library.
    spec = importlib.util.spec_from_file_location("_fedlang_npm_assets", ASSETS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


class BuildPyWithNpmAssets(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):
            return
        for package in _assets().PACKAGES:
            target = pathlib.Path(self.build_lib) / "fedlang" / package.home
            shutil.rmtree(target, ignore_errors=True)
            sources = [os.environ.get(package.env) or "", ROOT / "src" / "fedlang" / package.home]
            done = package.install(target, sources=[s for s in sources if s])
            self.announce(f"{package.name}'s checked files in {done}", level=2)


setup(cmdclass={"build_py": BuildPyWithNpmAssets})
