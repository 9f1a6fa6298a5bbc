"""Runs the code snippets of docs/analytics.md (doctest format, one shared namespace)."""

import doctest
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "analytics.md"

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_analytics_docs_snippets_run():
    blocks = _BLOCK.findall(DOC.read_text())
    assert len(blocks) >= 8
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace: dict = {"__name__": "analytics_docs"}
    for i, block in enumerate(blocks):
        test = parser.get_doctest(block, namespace, f"analytics.md block {i}", str(DOC), 0)
        runner.run(test, clear_globs=False)
        namespace = test.globs
    failed, attempted = runner.summarize(verbose=False)
    assert attempted >= 15
    assert failed == 0, f"{failed} of {attempted} doc examples failed (see the output above)"
