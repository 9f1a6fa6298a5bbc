"""The import rules of docs/architecture.md ("Who may import whom"): each arrow points
down, nothing points up; the core imports no JAX; no package reaches into another's
private names; the core's modules follow one order; no modules import each other in a
circle."""

import ast
import pathlib
import re

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
TOP_LEVEL = ""  # fedlang/__init__.py, __main__.py; like them, cli/ (not in ALLOWED) may import anything


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


# ----------------------------------------------------------------------------
# The order inside the core, and no import circles anywhere

# docs/architecture.md, "The order of the core": each module imports only modules
# earlier in this list (imports inside functions count), so the language reads
# bottom-up. A new core module is added at its place here and in the docs.
CORE_ORDER = [
    "errors",  # the error types
    "status",  # status lines: what a slow step is doing, for a progress display
    "tff_names",  # hints naming fedlang's spelling of TFF's methods
    "types",  # the type system and its TFF notation
    "type_format",  # long types in error messages, and where two types differ
    "sparse",  # sparse tensors
    "structure",  # Python values in and out of the internal form
    "local",  # the local-program contract
    "ir",  # the immutable IR
    "context",  # the stack of execution contexts
    "signing",  # signed bytes
    "intrinsics",  # the intrinsic registry
    "sparse_intrinsics",  # the sparse family
    "intrinsic_defs",  # the standard intrinsics
    "wire",  # the binary frame and its codecs (tensors, types, IR, local programs)
    "computation",  # Computation, and its bytes
    "serialization",  # the entry points for types, values and computations to bytes
    "tracing",  # federated_computation, traced Values, call_intrinsic
    "operators",  # the user-facing federated operators
    "client_state",  # with_client_state and the ClientStates binding protocol
    "processes",  # iterative, measured and aggregation processes
    "traffic",  # the bytes a computation sends
]

def _in_type_checking(parents: list[ast.AST]) -> bool:
    return any(isinstance(p, ast.If) and "TYPE_CHECKING" in ast.unparse(p.test) for p in parents)


def _import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """{module: the modules of the package at `root` it imports}, counting imports inside
    functions and leaving out `if TYPE_CHECKING:` blocks. An import of a package counts as
    none (its `__init__` only re-exports), as in /work/shared/hooks/import_circles.py."""
    modules: dict[str, tuple[pathlib.Path, bool]] = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        is_package = parts[-1] == "__init__"
        modules[".".join(parts[:-1] if is_package else parts)] = (path, is_package)
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, (path, is_package) in modules.items():
        package = name if is_package else name.rpartition(".")[0]
        stack: list[tuple[ast.AST, list[ast.AST]]] = [(ast.parse(path.read_text()), [])]
        while stack:
            node, parents = stack.pop()
            stack += [(child, [*parents, node]) for child in ast.iter_child_nodes(node)]
            if not isinstance(node, ast.Import | ast.ImportFrom) or _in_type_checking(parents):
                continue
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            else:
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                targets = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base
                    for a in node.names
                ]
            graph[name] |= {t for t in targets if t in modules and t != name and not modules[t][1]}
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles: the strongly connected components of more than one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_circle_check_counts_imports_in_functions_but_not_type_checking_blocks(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a, b, c, d\n")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg import a\n")  # closes a <-> b
    (pkg / "c.py").write_text("from pkg import d\n")
    (pkg / "d.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from . import c\n"
    )
    graph = _import_graph(pkg)
    assert graph["pkg.b"] == {"pkg.a"} and graph["pkg.d"] == set()
    assert _circles(graph) == [["pkg.a", "pkg.b"]]


def test_no_import_circles():
    circles = _circles(_import_graph(SRC))
    assert not circles, "Import circles (move code to where it belongs):\n" + "\n".join(
        " <-> ".join(c) for c in circles
    )


def test_the_core_modules_import_only_modules_earlier_in_their_order():
    graph = _import_graph(SRC)
    core = {m.removeprefix("fedlang.core.") for m in graph if m.startswith("fedlang.core.")}
    assert core == set(CORE_ORDER), (
        f"Core modules missing from CORE_ORDER: {sorted(core - set(CORE_ORDER))}; listed but "
        f"absent: {sorted(set(CORE_ORDER) - core)}. List each at its place in the order."
    )
    violations = [
        f"core.{m} imports core.{t}, which comes after it in CORE_ORDER"
        for i, m in enumerate(CORE_ORDER)
        for t in sorted(graph[f"fedlang.core.{m}"])
        if t.startswith("fedlang.core.") and CORE_ORDER.index(t.removeprefix("fedlang.core.")) > i
    ]
    assert not violations, "\n".join(violations)


def test_the_map_for_maintainers_states_the_core_order():
    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    line = next((ln for ln in text.splitlines() if ln.startswith("The order of the core")), "")
    paragraph = text[text.index(line) :].split("\n\n")[0] if line else ""
    assert [m.strip("`") for m in re.findall(r"`\w+`", paragraph)] == CORE_ORDER, (
        "docs/architecture.md should have a paragraph starting 'The order of the core' that "
        "lists CORE_ORDER's modules in order, each in backticks."
    )


# -- inside deploy/: grouped by role (docs/architecture.md, "deploy")

DEPLOY = SRC / "deploy"
# What doing I/O takes; what is only wanted of the plans (`deploy/plans/`) is pure.
IO_MODULES = {"sqlite3", "psycopg", "httpx", "fastapi", "starlette", "uvicorn", "socket",
              "http", "urllib", "requests", "io", "os", "pathlib", "shutil", "tempfile"}
WEB_MODULES = {"fastapi", "starlette", "uvicorn", "httpx", "pydantic"}


def _module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(dotted: str) -> bool:
    rel = pathlib.Path(*dotted.split(".")[1:])
    return (SRC / rel).with_suffix(".py").exists() or (SRC / rel / "__init__.py").exists()


def _all_imports(path: pathlib.Path) -> list[tuple[str, int]]:
    """(imported module, line) of every import in a source file, at the top or inside a
    function, relative ones resolved; `from m import name` names `m.name` when that is a
    module, else `m`."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for a in node.names:
                dotted = f"{base}.{a.name}"
                out.append((dotted if _is_module(dotted) else base, node.lineno))
    return out


def _deploy_graph() -> dict[str, set[str]]:
    """Module -> the fedlang.deploy modules it imports."""
    graph = {}
    for path in sorted(DEPLOY.rglob("*.py")):
        graph[_module_name(path)] = {
            m for m, _ in _all_imports(path) if m.startswith("fedlang.deploy") and _is_module(m)
        }
    return graph


def _deploy_files(role: str) -> list[pathlib.Path]:
    return sorted((DEPLOY / role).rglob("*.py"))


def test_a_device_client_never_reaches_the_store_the_server_or_the_driver():
    graph = _deploy_graph()
    offenders = []
    for path in _deploy_files("client"):
        start = _module_name(path)
        seen, todo = {start}, [start]
        while todo:
            for m in graph.get(todo.pop(), ()):
                if m not in seen:
                    seen.add(m)
                    todo.append(m)
        offenders += [f"{start} reaches {m}" for m in sorted(seen) if m.startswith(
            ("fedlang.deploy.store", "fedlang.deploy.server", "fedlang.deploy.driver"))]
    assert not offenders, "\n".join(offenders)


def test_the_store_is_sql_only():
    offenders = []
    for path in _deploy_files("store"):
        for dotted, line in _all_imports(path):
            if dotted.startswith("fedlang.deploy.server") or dotted.split(".")[0] in WEB_MODULES:
                offenders.append(f"{path.relative_to(SRC)}:{line} imports {dotted}")
    assert not offenders, "\n".join(offenders)


def test_the_plans_do_no_io():
    offenders = []
    for path in _deploy_files("plans"):
        for dotted, line in _all_imports(path):
            role = dotted.split(".")[2] if dotted.startswith("fedlang.deploy.") else ""
            if dotted.split(".")[0] in IO_MODULES or role in ("store", "server", "client",
                                                              "driver", "browser"):
                offenders.append(f"{path.relative_to(SRC)}:{line} imports {dotted}")
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "open":
                offenders.append(f"{path.relative_to(SRC)}:{node.lineno} opens a file")
    assert not offenders, "\n".join(offenders)


def test_only_serve_imports_the_server_app():
    offenders = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(DEPLOY.rglob("*.py")) if path != DEPLOY / "server" / "serve.py"
        for dotted, line in _all_imports(path) if dotted == "fedlang.deploy.server.app"
    ]
    assert not offenders, "the server's routes must not import app.py: " + ", ".join(offenders)


def test_the_deploy_rules_see_imports_inside_functions():
    imports = dict(_all_imports(DEPLOY / "driver" / "rounds.py"))
    assert "fedlang.deploy.browser" in imports  # imported inside deployment_context


def test_only_the_command_line_imports_the_edge():
    offenders = [
        f"{path.relative_to(SRC)}:{line}"
        for path in sorted(DEPLOY.rglob("*.py")) if DEPLOY / "edge" not in path.parents
        for dotted, line in _all_imports(path) if dotted.startswith("fedlang.deploy.edge")
    ]
    assert not offenders, "an edge is built on a server, never under one: " + ", ".join(offenders)
