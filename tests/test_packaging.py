"""pyproject.toml installs what the examples and the CLI's advice need."""

import ast
import pathlib
import re
import sys
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
# import name -> distribution name, where they differ
DISTRIBUTIONS = {"sklearn": "scikit-learn", "yaml": "pyyaml"}


def _names(requirements):
    return {re.split(r"[<>=\[; ]", r, maxsplit=1)[0].lower() for r in requirements}


def extra(name, seen=()):
    """The distributions `pip install 'fedlang[name]'` brings, self-references resolved."""
    out = _names(PYPROJECT["project"]["dependencies"])
    for r in PYPROJECT["project"]["optional-dependencies"][name]:
        inner = re.fullmatch(r"fedlang\[(\w+)\]", r)
        if inner and inner.group(1) not in seen:
            out |= extra(inner.group(1), (*seen, name))
        elif not inner:
            out |= _names([r])
    return out


def third_party_imports(path):
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return {DISTRIBUTIONS.get(n, n).lower() for n in found
            if n not in sys.stdlib_module_names and n != "fedlang"}


def test_the_examples_extra_installs_what_every_example_imports():
    installed = extra("examples")
    for path in sorted((ROOT / "examples").glob("*.py")):
        missing = third_party_imports(path) - installed
        assert not missing, f"{path.name} imports {sorted(missing)}, not in fedlang[examples]"


def test_the_tensorboard_extra_installs_the_viewer_the_cli_names():
    assert "tensorboard" in extra("tensorboard")
    cli = (ROOT / "src" / "fedlang" / "cli" / "training.py").read_text()
    assert "pip install 'fedlang[tensorboard]'" in cli


def test_the_extras_the_readme_installs_exist():
    readme = (ROOT / "README.md").read_text()
    named = set(re.findall(r"\.\[(\w+)\]", readme)) | set(
        re.findall(r"fedlang\[(\w+)\]", readme))
    assert {"examples", "keras", "dev"} <= named
    assert named <= set(PYPROJECT["project"]["optional-dependencies"]), named
