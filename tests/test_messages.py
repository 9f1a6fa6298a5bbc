"""What fedlang says to a user (errors, warnings, printed lines, CLI help) never sends
them to a file under docs/: a pip user has no docs/ directory. Messages name the
installed help (`fedlang train --help`) or a section by name instead."""

import ast
import pathlib

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "fedlang"
# Calls whose string arguments a user reads: printing, logging, warnings, the CLI's
# console and typer's help texts.
SAYING = {"print", "fail", "warn", "warning", "info", "error", "exception", "critical",
          "echo", "secho", "Option", "Argument", "Typer", "Exit"}


def _strings(node):
    return [n for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)]


def said(tree):
    """The string constants (f-string parts included) of raised exceptions, of calls in
    SAYING, of `help=` arguments, and the docstrings of functions typer shows as help
    (those decorated with, or passed to, `.command(...)`)."""
    out = []
    commands = {a.id for node in ast.walk(tree) if isinstance(node, ast.Call)
                and isinstance(node.func, ast.Call) and isinstance(node.func.func, ast.Attribute)
                and node.func.func.attr == "command"
                for a in node.args if isinstance(a, ast.Name)}
    for node in ast.walk(tree):
        if isinstance(node, ast.Raise) and node.exc is not None:
            out += _strings(node.exc)
        elif isinstance(node, ast.Call):
            f = node.func
            if (f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")) in SAYING:
                out += _strings(node)
            out += [s for kw in node.keywords if kw.arg == "help" for s in _strings(kw.value)]
        elif isinstance(node, ast.FunctionDef) and (node.name in commands or any(
                isinstance(d, ast.Call) and isinstance(d.func, ast.Attribute)
                and d.func.attr == "command" for d in node.decorator_list)):
            doc = ast.get_docstring(node, clean=False)
            out += [ast.Constant(doc, lineno=node.lineno)] if doc else []
    return list({id(s): s for s in out}.values())


def test_no_message_points_to_a_file_under_docs():
    found = [f"{path.relative_to(SRC)}:{s.lineno}: {s.value.strip()[:100]!r}"
             for path in sorted(SRC.rglob("*.py"))
             for s in said(ast.parse(path.read_text()))
             if "docs/" in s.value or ".md" in s.value]
    assert not found, "\n".join(found)


def test_the_scanner_sees_each_kind_of_message():
    tree = ast.parse('''
def train():
    """Trains (docs/a.md)."""
raise ValueError(f"Expected x, found {y}. See docs/b.md.")
console.fail(e, 1, "docs/c.md")
typer.Option(help="docs/d.md")
app.command()(train)
''')
    assert sorted(s.value.strip() for s in said(tree) if "docs/" in s.value) == [
        ". See docs/b.md.", "Trains (docs/a.md).", "docs/c.md", "docs/d.md"]
