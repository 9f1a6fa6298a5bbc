"""Runs docs/quickstart.md's code blocks in order, in one namespace, and checks it learns."""

import pytest

from .doc_snippets import DOCS, python_blocks

DOC = DOCS / "quickstart.md"


@pytest.mark.slow  # about 15 s, mostly compiling the round and the evaluation
def test_the_quickstart_runs_end_to_end(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    blocks = python_blocks("quickstart.md")
    assert len(blocks) == 6  # data, model, process, loop, evaluation, plot
    namespace: dict = {"__name__": "quickstart"}
    for i, block in enumerate(blocks):
        exec(compile(block, f"{DOC}:block {i + 1}", "exec"), namespace)
    assert namespace["held_out"]["accuracy"] > 0.5  # chance is 0.1
    assert (tmp_path / "quickstart.png").read_bytes()[:4] == b"\x89PNG"
