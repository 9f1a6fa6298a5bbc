"""Runs the code snippets of docs/core.md (doctest format, one shared namespace)."""

import doctest
import pathlib
import re

DOC = pathlib.Path(__file__).resolve().parents[2] / "docs" / "core.md"

_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def test_core_docs_snippets_run():
    text = DOC.read_text()
    blocks = _BLOCK.findall(text)
    assert len(blocks) > 10

    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace: dict = {"__name__": "core_docs"}
    for i, block in enumerate(blocks):
        test = parser.get_doctest(block, namespace, f"core.md block {i}", str(DOC), 0)
        runner.run(test, clear_globs=False)
        namespace = test.globs
    failed, attempted = runner.summarize(verbose=False)
    assert attempted > 50
    assert failed == 0, f"{failed} of {attempted} doc examples failed (see the output above)"
