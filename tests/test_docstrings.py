"""Every `>>>` example in the package's docstrings runs (doctest), module by module."""

import doctest
import importlib
import pathlib

import pytest

SRC = pathlib.Path(__file__).resolve().parents[1] / "src"
# Modules that need an optional extra: their examples run where the extra is installed.
OPTIONAL = {"ray": "ray", "deploy": "fastapi"}


def _modules():
    for path in sorted((SRC / "fedlang").rglob("*.py")):
        rel = path.relative_to(SRC).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__main__":
            continue
        if parts[-1] == "__init__":
            parts = parts[:-1]
        yield ".".join(parts)


def _with_examples():
    for name in _modules():
        text = (SRC / pathlib.Path(*name.split("."))).with_suffix(".py")
        if not text.exists():
            text = SRC / pathlib.Path(*name.split(".")) / "__init__.py"
        if ">>>" in text.read_text():
            yield name


@pytest.mark.parametrize("module_name", list(_with_examples()))
def test_docstring_examples_run(module_name):
    for package, extra in OPTIONAL.items():
        if f".{package}" in module_name:
            pytest.importorskip(extra)
    module = importlib.import_module(module_name)
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} of {result.attempted} examples failed in {module_name}"
