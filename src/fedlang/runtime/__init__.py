"""Runtimes that execute computations.

`reference_context()` is the interpreter every other runtime is checked against.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from fedlang.core import context as _context
from fedlang.runtime.reference import ReferenceContext as ReferenceContext


@contextlib.contextmanager
def reference_context(num_clients: int | None = None) -> Iterator[ReferenceContext]:
    """Runs computations called in the body on the reference runtime."""
    with _context.with_context(ReferenceContext(num_clients)) as ctx:
        yield ctx  # type: ignore[misc]


def set_default_context(ctx: _context.Context | None) -> None:
    """Makes `ctx` the runtime for computations called outside any `with` block."""
    _context.set_default_context(ctx)


def get_default_context() -> _context.Context | None:
    """The runtime computations run on outside any `with` block."""
    return _context.get_default_context()
