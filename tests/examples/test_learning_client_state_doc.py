"""The client-state examples of docs/learning.md run as written."""

from .doc_snippets import python_blocks


def test_the_client_state_blocks_run(tmp_path, monkeypatch):
    blocks = [b for b in python_blocks("learning.md")
              if "with_client_state" in b or "ClientStateStore(" in b]
    assert len(blocks) == 2
    monkeypatch.chdir(tmp_path)  # the store is made under ./run
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/learning.md", "exec"), namespace)
    assert (tmp_path / "run" / "client_states" / "HEAD").exists()
