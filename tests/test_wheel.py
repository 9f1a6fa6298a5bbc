"""The wheel: built from a clean copy of the tree, complete (the checked files of the npm
packages the server serves in it: onnxruntime-web, uPlot; the dashboard's files), the same
whatever the checkout held, and `fedlang serve --demo-page` serves the demo page and the
dashboard from it in a fresh virtual environment.

Slow: about 75 s on two cores with a warm pip cache (two wheel builds of ~10 s each, a
fresh environment with `fedlang[deploy]`'s dependencies ~55 s, the server a few seconds).
Nothing is downloaded but what pip installs: the build takes the packages' files from
the checkout's checked copies (`FEDLANG_ORT_DIR`, `FEDLANG_UPLOT_DIR`), as a build
without network does; tests/deploy/test_assets.py covers the registry download.
"""

import hashlib
import os
import pathlib
import re
import shutil
import subprocess
import sys
import time
import zipfile

import httpx
import pytest

from fedlang.deploy import assets as npm_assets
from fedlang.deploy.browser import assets

ROOT = pathlib.Path(__file__).resolve().parents[1]
ORT_IN_WHEEL = "fedlang/deploy/browser/static/ort/"
UPLOT_IN_WHEEL = "fedlang/deploy/server/static/uplot/"
DASHBOARD = ROOT / "src" / "fedlang" / "deploy" / "server" / "static" / "dashboard"


def _clean_copy(destination):
    """The checkout's tracked and untracked-but-not-ignored files (what a fresh clone with
    these changes holds): no build output, no .venv, no fetched onnxruntime-web."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, destination / name)
    return destination


def _build_wheel(tree, out, env):
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w", str(out), str(tree)],
        capture_output=True, text=True, env=env, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (wheel,) = out.glob("fedlang-*.whl")
    return wheel


def _contents(wheel):
    with zipfile.ZipFile(wheel) as z:
        return {n: hashlib.sha256(z.read(n)).hexdigest() for n in z.namelist()}


def _env(**changes):
    env = {k: v for k, v in os.environ.items()
           if k not in ("FEDLANG_ORT_DIR", "FEDLANG_UPLOT_DIR", "PYTHONPATH", "VIRTUAL_ENV")}
    env.update(changes)
    return env


@pytest.fixture(scope="module")
def checked_ort():
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("the wheel is built from the git checkout's files; this is not one")
    for package in npm_assets.PACKAGES:
        if package.missing(npm_assets.FEDLANG / package.home):
            pytest.skip(f"{package.name}'s files are missing from the checkout; "
                        "`python -m fedlang.deploy.assets` fetches them")
    return assets.STATIC / "ort"


@pytest.mark.slow
def test_the_wheel_is_complete_the_same_whatever_ran_before_and_serves_the_pages(
    tmp_path, checked_ort
):
    # arrange: a clean copy (as a fresh clone), and a copy whose static/ort/ holds what an
    # earlier `assets` run and an older version left (as after scripts/test.sh)
    clean = _clean_copy(tmp_path / "clean")
    used = _clean_copy(tmp_path / "used")
    stale = used / "src" / "fedlang" / "deploy" / "browser" / "static" / "ort"
    shutil.copytree(checked_ort, stale)
    (stale / "ort.webgpu.min.mjs").write_text("// another version's file\n")
    uplot = npm_assets.FEDLANG / npm_assets.UPLOT.home
    stale_uplot = used / "src" / "fedlang" / npm_assets.UPLOT.home
    shutil.copytree(uplot, stale_uplot)
    (stale_uplot / "uPlot.min.css").write_text("/* another version's file */\n")

    # act: build both
    wheel = _build_wheel(clean, tmp_path / "dist-clean", _env(
        FEDLANG_ORT_DIR=str(checked_ort), FEDLANG_UPLOT_DIR=str(uplot)))
    other = _build_wheel(used, tmp_path / "dist-used", _env())

    # assert: complete, and the same
    contents = _contents(wheel)
    shipped = {n.removeprefix(ORT_IN_WHEEL): h for n, h in contents.items() if n.startswith(ORT_IN_WHEEL)}
    assert shipped == {**assets.FILES, "README.txt": hashlib.sha256(assets.README.encode()).hexdigest()}
    shipped = {n.removeprefix(UPLOT_IN_WHEEL): h for n, h in contents.items() if n.startswith(UPLOT_IN_WHEEL)}
    readme = hashlib.sha256(npm_assets.UPLOT.readme.encode()).hexdigest()
    assert shipped == {**npm_assets.UPLOT.stored, "README.txt": readme}
    assert _contents(other) == contents
    assert "fedlang/deploy/browser/demo/favicon.svg" in contents
    for page_file in sorted(DASHBOARD.iterdir()):
        assert contents[f"fedlang/deploy/server/static/dashboard/{page_file.name}"] == \
            hashlib.sha256(page_file.read_bytes()).hexdigest()

    # act: a fresh virtual environment with the wheel and the deploy extra
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    done = subprocess.run(
        [str(venv / "bin" / "python"), "-m", "pip", "install", "--quiet", f"{wheel}[deploy]"],
        capture_output=True, text=True, env=_env(), timeout=900,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import fedlang; print(fedlang.__file__)"],
                           capture_output=True, text=True, cwd=tmp_path, env=_env(), check=True)
    assert where.stdout.startswith(str(venv))  # the installed wheel, not the checkout

    # assert: `fedlang serve --demo-page` starts (and stops on SIGTERM)
    server = subprocess.Popen(
        [str(venv / "bin" / "fedlang"), "serve", "--db", str(tmp_path / "store.db"), "--port", "0",
         "--demo-page"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path, env=_env(),
    )
    try:
        lines = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not any("demo page:" in line for line in lines):
            line = server.stdout.readline()
            if not line and server.poll() is not None:
                break
            lines.append(line)
        demo = next((re.search(r"demo page: (\S+)", line) for line in lines if "demo page:" in line), None)
        assert demo is not None, "".join(lines)
        with httpx.Client(timeout=30) as http:
            assert http.get(demo.group(1)).status_code == 200
            wasm = http.get(demo.group(1).replace("/demo/", "/browser/ort/ort-wasm-simd-threaded.wasm"))
            assert wasm.status_code == 200
            assert hashlib.sha256(wasm.content).hexdigest() == assets.FILES["ort-wasm-simd-threaded.wasm"]
            dashboard = demo.group(1).replace("/demo/", "/dashboard/")
            assert "dashboard.js" in http.get(dashboard).text
            chart = http.get(dashboard + "uplot/uPlot.esm.js")
            assert hashlib.sha256(chart.content).hexdigest() == npm_assets.UPLOT.stored["uPlot.esm.js"]
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=30)
        server.stdout.close()
