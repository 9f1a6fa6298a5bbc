"""The `fedlang` app (src/fedlang/cli/__init__.py): the entry points and the command groups."""

import re
import subprocess
import sys

from ._run import ENV, fedlang, fedlang_all


def test_python_dash_m_fedlang_help():
    out = subprocess.run([sys.executable, "-m", "fedlang", "--help"], capture_output=True,
                         text=True, timeout=60, env=ENV)
    assert out.returncode == 0, out.stderr
    for command in ("demo", "train", "data", "serve", "client", "status", "revoke", "rotate-token",
                    "device-tokens"):
        assert command in out.stdout, command


def test_version():
    status, stdout, _ = fedlang("--version")
    assert status == 0 and stdout.strip() == "fedlang 0.1.0"


COMMANDS = [[], ["demo"], ["train"], ["serve"], ["client"], ["status"], ["data"],
            ["data", "inspect"], ["data", "convert"]]


def test_help_shows_flags_bare_and_names_what_each_option_takes():
    # typer's rich panels printed <bool> beside flags, which take no value, and <str>
    # beside options whose value a user must guess
    for command, (status, stdout, stderr) in zip(
            COMMANDS, fedlang_all(*([*c, "--help"] for c in COMMANDS)), strict=True):
        assert status == 0, (command, stderr)
        assert "Options:\n" in stdout, stdout  # click's plain help, not typer's panels
        options = stdout.split("Options:\n", 1)[1].split("\n\n", 1)[0]
        for line in options.splitlines():
            if not line.startswith("  -"):
                continue  # a wrapped help text
            usage = line.strip().split("  ", 1)[0]
            assert "<" not in usage, (command, line)
            flag = " / " in usage or usage in ("--help", "--version")
            assert flag or re.fullmatch(r"--[a-z-]+ [A-Z=]+", usage), (command, line)
