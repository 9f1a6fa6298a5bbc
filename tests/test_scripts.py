"""scripts/: what the README's commands do to the machine is said, and can be declined."""

import os
import pathlib
import shutil
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_readme_says_the_test_command_installs_system_packages():
    readme = " ".join((ROOT / "README.md").read_text().split())
    test_command = readme[readme.index("./scripts/test.sh"):]
    for said in ("npm", "as root", "apt-get", "chromium", "a change to the system",
                 "skipped with that reason", "FEDLANG_BROWSER_SETUP=0 ./scripts/test.sh"):
        assert said in test_command, said


def test_browser_setup_installs_nothing_when_declined_and_says_so(tmp_path):
    # A copy of the script (it writes build/browser_setup.log next to scripts/), with
    # npm and apt-get on the PATH leaving a mark if called.
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / "scripts" / "browser_setup.sh", tmp_path / "scripts")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("npm", "apt-get"):
        (bin_dir / tool).write_text(f"#!/bin/sh\ntouch {tmp_path}/called-{tool}\nexit 1\n")
        (bin_dir / tool).chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
           "FEDLANG_PYTHON": sys.executable, "FEDLANG_BROWSER_SETUP": "0"}
    done = subprocess.run(["bash", tmp_path / "scripts" / "browser_setup.sh"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "installing nothing (no npm, no apt-get)" in done.stderr
    assert "will be skipped" in (tmp_path / "build" / "browser_setup.log").read_text()
    assert not list(tmp_path.glob("called-*"))
