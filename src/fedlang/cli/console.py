"""What every `fedlang` command prints with: one console for results, one for errors,
and one way to fail.

Results go to stdout (`out`); errors, warnings and progress go to stderr (`err`). A
command that cannot go on calls `fail(error, status)`: one sentence on stderr
("Error: Expected X, found Y; do Z"), never a traceback, and the exit status (1 for
bad input files, 2 for an invalid config or data that does not fit it, 130 after
Ctrl-C, said as "Interrupted: ...").
"""

from __future__ import annotations

from typing import NoReturn

import typer
from rich.console import Console
from rich.markup import escape

out = Console()
err = Console(stderr=True)

# Input problems become one sentence on stderr, never a traceback.
INPUT_ERRORS = (OSError, ValueError, TypeError, ImportError)


def fail(error: BaseException | str, status: int = 1, advice: str = "", *,
         label: str = "Error") -> NoReturn:
    """Prints `<label>: <error> <advice>` on stderr and exits with `status`.

    Call it inside the `except` that caught `error`: the exit keeps it as its context.
    A stop that is not an error says so in `label` (Ctrl-C: "Interrupted", status 130).
    """
    # escape: messages quote config tables such as [training], which are not markup
    text = escape(f"{error}{' ' + advice if advice else ''}")
    err.print(f"[bold red]{escape(label)}:[/] {text}", highlight=False, soft_wrap=True)
    raise typer.Exit(status)


def warn(text: str) -> None:
    """Prints `Warning: <text>` on stderr."""
    err.print(f"[bold yellow]Warning:[/] {escape(text)}", highlight=False, soft_wrap=True)
