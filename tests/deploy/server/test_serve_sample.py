"""docs/deploy.md's samples of what `fedlang serve` prints are what it prints (issue 37,
item 12f: the sample lacked the dashboard's line): each line of a sample, its secrets
and port aside, is a line the real command printed, in the same order."""

import os
import re
import subprocess
import sys
import time

import pytest

from ..conftest import ROOT, _free_port

SECRET = re.compile(r"(admin token: |public key: |token: |token=)\S+?(?=[ &]|$)")


def _samples():
    """The (arguments, printed lines) of each block of docs/deploy.md that shows one
    `$ fedlang serve` and what it printed."""
    blocks, block = [], None
    for line in (ROOT / "docs" / "deploy.md").read_text().splitlines():
        if line.strip().startswith("```"):
            block = [] if block is None else blocks.append(block)  # opens, or closes
        elif block is not None and line.strip():
            block.append(line.strip())
    return [(b[0].removeprefix("$ fedlang ").split(), b[1:]) for b in blocks
            if b and b[0].startswith("$ fedlang serve")
            and not any(line.startswith("$") for line in b[1:])]  # one command, its output


def _shape(line):
    return SECRET.sub(r"\1...", re.sub(r"127\.0\.0\.1:\d+", "127.0.0.1:PORT", line))


@pytest.mark.parametrize("sample", _samples(), ids=lambda s: " ".join(s[0]))
def test_the_docs_sample_of_fedlang_serve_is_what_it_prints(tmp_path, sample):
    args, documented = sample
    assert documented, args
    args = [str(_free_port()) if a == "8000" else a for a in args]
    (tmp_path / "fl").mkdir()
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    env.pop("FEDLANG_ADMIN_TOKEN", None)
    out = tmp_path / "stdout.txt"
    with open(out, "wb") as sink:
        proc = subprocess.Popen([sys.executable, "-m", "fedlang", *args], stdout=sink,
                                stderr=subprocess.DEVNULL, env=env, cwd=tmp_path)

    def printed():
        return [_shape(line.strip()) for line in out.read_text().splitlines() if line.strip()]

    try:
        end = time.monotonic() + 120
        while len(printed()) < len(documented):
            assert proc.poll() is None and time.monotonic() < end, out.read_text()
            time.sleep(0.1)
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    assert printed()[:len(documented)] == [_shape(line) for line in documented]
