"""scripts/: what the README's commands do to the machine is said, and can be declined."""

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_readme_says_the_test_command_installs_system_packages():
    readme = " ".join((ROOT / "README.md").read_text().split())
    test_command = readme[readme.index("./scripts/test.sh"):]
    for said in ("npm", "as root", "apt-get", "chromium", "a change to the system",
                 "skipped with that reason", "FEDLANG_BROWSER_SETUP=0 ./scripts/test.sh"):
        assert said in test_command, said


def _setup_copy(tmp_path, **env):
    """A copy of browser_setup.sh (it writes build/browser_setup.log next to scripts/),
    with npm and apt-get on the PATH leaving their arguments in called-TOOL if called;
    and the environment to run it in."""
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "browser_setup.sh", tmp_path / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("npm", "apt-get"):
        (bin_dir / tool).write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/called-{tool}\nexit 0\n')
        (bin_dir / tool).chmod(0o755)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "FEDLANG_PYTHON": sys.executable, **env}


def test_browser_setup_installs_nothing_when_declined_and_says_so(tmp_path):
    env = _setup_copy(tmp_path, FEDLANG_BROWSER_SETUP="0")
    done = subprocess.run(["bash", tmp_path / "scripts" / "browser_setup.sh"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "installing nothing (no npm, no apt-get)" in done.stderr
    assert "will be skipped" in (tmp_path / "build" / "browser_setup.log").read_text()
    assert not list(tmp_path.glob("called-*"))


@pytest.mark.skipif(os.geteuid() != 0, reason="the script installs Chromium only as root")
def test_browser_setup_installs_chromium_without_recommended_packages(tmp_path):
    # Chromium's recommends (avahi, cups, ...) are 160 packages the browser tests do not use.
    # (`true` for Python: the npm step is not what this test is about.)
    env = _setup_copy(tmp_path, FEDLANG_CHROMIUM=str(tmp_path / "no-chromium"),
                      FEDLANG_PYTHON="true")
    done = subprocess.run(["bash", tmp_path / "scripts" / "browser_setup.sh"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    installs = [line for line in (tmp_path / "called-apt-get").read_text().splitlines()
                if " install " in f" {line} "]
    assert installs and all("--no-install-recommends" in line.split() for line in installs)
