"""The import rules of DESIGN.md section 2: each arrow points down, nothing points up."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fedlang"

ALLOWED = {
    "core": {"core"},
    "backends": {"backends", "core"},
    "runtime": {"runtime", "backends", "core"},
    "deploy": {"deploy", "runtime", "backends", "core"},
    "aggregators": {"aggregators", "core"},
    "learning": {"learning", "aggregators", "core"},
    "analytics": {"analytics", "aggregators", "core"},
    "simulation": {"simulation", "core"},
    "templates": {"templates", "core"},
}


def imported_packages(path: pathlib.Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names if node.module == "fedlang"]
        for name in names:
            parts = name.split(".")
            if parts[0] == "fedlang" and len(parts) > 1:
                found.add(parts[1])
    return found


def test_each_package_imports_only_what_it_may():
    violations = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        package = rel.parts[0] if len(rel.parts) > 1 else None
        if package not in ALLOWED:
            continue  # fedlang/__init__.py, cli.py, __main__.py may import anything
        for imported in imported_packages(path) - ALLOWED[package]:
            violations.append(f"{rel} imports fedlang.{imported}")
    assert not violations, "\n".join(violations)
