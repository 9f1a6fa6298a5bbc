"""Runs the code snippets of docs/analytics.md (doctest format, one shared namespace)."""

from .doc_snippets import run_as_doctests


def test_analytics_docs_snippets_run():
    blocks, failed, attempted = run_as_doctests("analytics.md")
    assert blocks >= 8
    assert attempted >= 15
    assert failed == 0, f"{failed} of {attempted} doc examples failed (see the output above)"
