"""The import rules of docs/architecture.md ("Who may import whom"): each arrow points
down, nothing points up; the core imports no JAX; no package reaches into another's
private names."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fedlang"

# docs/architecture.md, "Who may import whom". Libraries written in the language
# (learning, aggregators, analytics) may use the JAX backend to define local computations.
ALLOWED = {
    "core": {"core"},
    "backends": {"backends", "core"},
    "runtime": {"runtime", "backends", "core"},
    "deploy": {"deploy", "runtime", "backends", "core"},
    "aggregators": {"aggregators", "backends", "core"},
    "learning": {"learning", "aggregators", "backends", "core"},
    "analytics": {"analytics", "aggregators", "backends", "core"},
    "simulation": {"simulation", "core"},
    "templates": {"templates", "core"},
}
TOP_LEVEL = ""  # fedlang/__init__.py, cli.py, _experiment.py, __main__.py


def _package_of(rel: pathlib.PurePath) -> str:
    return rel.parts[0] if len(rel.parts) > 1 else TOP_LEVEL


def _target_package(dotted: str) -> str | None:
    """The fedlang package a dotted module path lies in ('' for top-level modules)."""
    parts = dotted.split(".")
    if parts[0] != "fedlang":
        return None
    if len(parts) == 1:
        return TOP_LEVEL
    return parts[1] if (SRC / parts[1]).is_dir() else TOP_LEVEL


def _imports(tree: ast.AST) -> list[tuple[str, ast.AST]]:
    """(dotted module name, node) for every absolute import of a fedlang module or name."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(a.name, node) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out += [(f"{node.module}.{a.name}", node) for a in node.names]
    return out


def _sources():
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC)
        yield rel, _package_of(rel), ast.parse(path.read_text())


def test_each_package_imports_only_what_it_may():
    violations = []
    for rel, package, tree in _sources():
        if package not in ALLOWED:
            continue  # the top-level modules may import anything
        for dotted, _ in _imports(tree):
            target = _target_package(dotted)
            if target is not None and target != TOP_LEVEL and target not in ALLOWED[package]:
                violations.append(f"{rel} imports fedlang.{target}")
            if target == TOP_LEVEL and dotted not in ("fedlang",):
                violations.append(f"{rel} imports the top-level module {dotted}")
    assert not violations, "\n".join(sorted(set(violations)))


def test_the_core_imports_no_jax():
    offenders = []
    for rel, package, tree in _sources():
        if package != "core":
            continue
        for dotted, node in _imports(tree):
            name = dotted.split(".")[0] if isinstance(node, ast.Import) else node.module  # type: ignore[attr-defined]
            if name == "jax" or (name or "").startswith(("jax.", "jaxlib")):
                offenders.append(f"{rel}:{node.lineno} imports {dotted}")
    assert not offenders, "\n".join(offenders)


def test_no_package_uses_another_packages_private_names():
    violations = []
    for rel, package, tree in _sources():
        module_aliases: dict[str, str] = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                for a in node.names:
                    dotted = f"{node.module}.{a.name}"
                    target = _target_package(dotted)
                    if target is None:
                        continue
                    if a.name.startswith("_") and not a.name.startswith("__") and target != package:
                        violations.append(f"{rel}:{node.lineno} imports {dotted}")
                    module_aliases[a.asname or a.name] = target
            elif isinstance(node, ast.Import):
                for a in node.names:
                    target = _target_package(a.name)
                    if target is not None and a.asname:
                        module_aliases[a.asname] = target
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Attribute)
                and isinstance(node.value, ast.Name)
                and node.value.id in module_aliases
                and node.attr.startswith("_")
                and not node.attr.startswith("__")
                and module_aliases[node.value.id] != package
            ):
                violations.append(f"{rel}:{node.lineno} uses {node.value.id}.{node.attr}")
    assert not violations, "\n".join(violations)


def test_the_map_for_maintainers_exists_and_states_these_rules():
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    assert "Who may import whom" in text
    for package in ALLOWED:
        assert f"`{package}`" in text, f"docs/architecture.md does not mention `{package}`"
