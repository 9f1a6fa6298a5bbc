"""The ```python blocks of the docs, for the tests that run them."""

import doctest
import pathlib
import re

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.DOTALL | re.MULTILINE)


def python_blocks(name: str) -> list[str]:
    """The ```python blocks of docs/`name`, in order."""
    return _BLOCK.findall((DOCS / name).read_text())


def run_as_doctests(name: str) -> tuple[int, int, int]:
    """Runs docs/`name`'s blocks as doctests in one shared namespace, in order; returns
    (blocks, failed, attempted) examples. Failures are printed by doctest."""
    blocks = python_blocks(name)
    parser = doctest.DocTestParser()
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    namespace: dict = {"__name__": name.removesuffix(".md") + "_docs"}
    for i, block in enumerate(blocks):
        test = parser.get_doctest(block, namespace, f"{name} block {i}", str(DOCS / name), 0)
        runner.run(test, clear_globs=False)
        namespace = test.globs
    failed, attempted = runner.summarize(verbose=False)
    return len(blocks), failed, attempted
