"""The ```python blocks of the docs, and how tests/examples/test_docs.py runs them.

A page's blocks run in order in one namespace, as a reader pastes them into one session:

- a block written as doctests (`>>>` lines) runs as doctests;
- any other block runs as a script, its printed output captured; when a ```text block
  follows it (nothing but blank lines between), that is the output the page shows, and
  it must match what the block printed (a block without one may not show a printed
  value in a comment, `print(x)  # 16`, which nothing would check);
- a block preceded by the HTML comment `<!-- not run: why -->` is not run; the test keeps
  such blocks to a listed set (`NOT_RUN` in test_docs.py).

Output matches (doctests and ```text blocks alike) when, whitespace normalized, the text
is the same, `...` standing for any text; integers must be equal, and a number with a
decimal point or exponent may differ from the printed one by `TOLERANCE`: 0.02 or 2% of
the larger, whichever is more, so that pages stay true across platforms (CPU, GPU, JAX
versions) but a shown `loss 0.5` for a printed `loss 0.850` fails.
"""

from __future__ import annotations

import contextlib
import dataclasses
import doctest
import io
import pathlib
import re
import textwrap

DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs"
TOLERANCE = (0.02, 0.02)  # (absolute, relative): a number may differ by the larger
_FENCE = re.compile(r"^( *)```(\w*)\s*$")
_NOT_RUN = re.compile(r"^\s*<!--\s*not run:\s*(.+?)\s*-->\s*$")
_NUMBER = r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?"
_TOKEN = re.compile(rf"(\.\.\.)|((?<![\w.]){_NUMBER}(?![\w.]))|(\s+)|(.)", re.DOTALL)
_PRINT_COMMENT = re.compile(r"^\s*print\(.*\)\s+#\s*\S")


@dataclasses.dataclass
class Block:
    page: str
    line: int  # of the opening fence, 1-based
    code: str
    not_run: str | None  # why, when marked `<!-- not run: why -->`
    output: str | None  # the ```text block that follows, if any

    @property
    def is_doctest(self) -> bool:
        return any(line.lstrip().startswith(">>>") for line in self.code.splitlines())

    @property
    def where(self) -> str:
        return f"docs/{self.page}:{self.line}"


def _fences(lines: list[str]) -> list[tuple[int, int, str, str]]:
    """(start, end, language, dedented body) of every fenced block; end is the closing line."""
    out = []
    i = 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, lang = m.group(1), m.group(2)
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != f"{indent}```":
            j += 1
        body = "\n".join(line[len(indent):] if line.startswith(indent) else line.lstrip()
                         for line in lines[i + 1 : j])
        out.append((i, j, lang, textwrap.dedent(body) + "\n"))
        i = j + 1
    return out


def blocks(page: str) -> list[Block]:
    """The ```python blocks of docs/`page`, in order."""
    lines = (DOCS / page).read_text().splitlines()
    fences = _fences(lines)
    out = []
    for k, (start, end, lang, body) in enumerate(fences):
        if lang != "python":
            continue
        before = start - 1
        while before >= 0 and not lines[before].strip():
            before -= 1
        marker = _NOT_RUN.match(lines[before]) if before >= 0 else None
        output = None
        if k + 1 < len(fences) and fences[k + 1][2] == "text":
            between = lines[end + 1 : fences[k + 1][0]]
            if all(not line.strip() for line in between):
                output = fences[k + 1][3]
        out.append(Block(page, start + 1, body, marker.group(1) if marker else None, output))
    return out


def python_blocks(page: str) -> list[str]:
    """The code of docs/`page`'s ```python blocks, in order."""
    return [b.code for b in blocks(page)]


def _close(want: str, got: str) -> bool:
    if not re.search(r"[.eE]", want):  # an integer: exactly
        return want == got
    a, b = float(want), float(got)
    return abs(a - b) <= max(TOLERANCE[0], TOLERANCE[1] * max(abs(a), abs(b)))


def matches(want: str, got: str) -> bool:
    """Whether printed `got` matches the page's `want` (see the module docstring)."""
    pattern, numbers = [], []
    for ellipsis, number, space, other in _TOKEN.findall(want.strip()):
        if ellipsis:
            pattern.append(r".*?")
        elif number:
            pattern.append(rf"(?<![\w.])({_NUMBER})(?![\w.])")
            numbers.append(number)
        elif space:
            pattern.append(r"\s+")
        else:
            pattern.append(re.escape(other))
    m = re.fullmatch("".join(pattern), got.strip(), re.DOTALL)
    return m is not None and all(_close(w, g) for w, g in zip(numbers, m.groups()))


class _Checker(doctest.OutputChecker):
    def check_output(self, want: str, got: str, optionflags: int) -> bool:
        return matches(want, got)


def run(block: Block, namespace: dict) -> list[str]:
    """Runs one block in `namespace`; returns its failures (empty when it passed)."""
    if block.is_doctest:
        test = doctest.DocTestParser().get_doctest(block.code, namespace, block.where, block.where, 0)
        out = io.StringIO()
        runner = doctest.DocTestRunner(checker=_Checker(), optionflags=doctest.ELLIPSIS)
        runner.run(test, out=out.write, clear_globs=False)
        namespace.update(test.globs)  # the doctest ran in a copy
        return [out.getvalue()] if runner.failures else []
    failures = [f"{block.where}: `{line.strip()}` shows a printed value in a comment; show it in a "
                "```text block after the code, where it is checked"
                for line in block.code.splitlines()
                if block.output is None and _PRINT_COMMENT.match(line)]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block.code, block.where, "exec"), namespace)
    if block.output is not None and not matches(block.output, printed.getvalue()):
        failures.append(f"{block.where}: the page shows\n{block.output}but the block printed\n"
                        f"{printed.getvalue()}")
    return failures
