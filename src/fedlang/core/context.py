"""Execution contexts: where calling a computation runs it.

Calling a computation asks the current context to invoke it. Outside any trace that
is the default context (a runtime, registered by `fedlang` on import); while a
federated computation is being traced it is the tracing context, which records the
call as IR instead of running it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, Protocol


class Context(Protocol):
    def invoke(self, computation: Any, arg: Any) -> Any:
        """Runs (or records) `computation` applied to the packed Python argument."""


_default: Context | None = None
_stack: list[Context] = []


def get_context() -> Context:
    """The innermost context: a tracing context, else the default runtime."""
    if _stack:
        return _stack[-1]
    if _default is None:
        raise RuntimeError(
            "No execution context is set. Import fedlang (which installs the default runtime) "
            "or call fedlang.set_default_context(...)."
        )
    return _default


def get_default_context() -> Context | None:
    return _default


def set_default_context(ctx: Context | None) -> None:
    """Makes `ctx` the context that runs computations called outside a trace."""
    global _default
    _default = ctx


@contextlib.contextmanager
def with_context(ctx: Context) -> Iterator[Context]:
    """Runs the body with `ctx` as the current context."""
    _stack.append(ctx)
    try:
        yield ctx
    finally:
        _stack.pop()


def innermost(kind: type) -> Any:
    """The innermost context of the given class on the stack, or None."""
    for ctx in reversed(_stack):
        if isinstance(ctx, kind):
            return ctx
    return None
