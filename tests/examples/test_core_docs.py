"""Runs the code snippets of docs/core.md (doctest format, one shared namespace)."""

from .doc_snippets import run_as_doctests


def test_core_docs_snippets_run():
    blocks, failed, attempted = run_as_doctests("core.md")
    assert blocks > 10
    assert attempted > 50
    assert failed == 0, f"{failed} of {attempted} doc examples failed (see the output above)"
