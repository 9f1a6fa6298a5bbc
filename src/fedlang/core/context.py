"""Execution contexts: where calling a computation runs it.

Calling a computation asks the current context to invoke it. Outside any trace and any
`with` block that is the default context (a runtime, made on first use by the factory
`fedlang` registers, so importing fedlang starts nothing); while a federated
computation is being traced it is the tracing context, which records the call as IR
instead of running it. The stack of entered contexts is per thread, so two threads can
run computations in two different contexts at once.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol


class Context(Protocol):
    def invoke(self, computation: Any, arg: Any) -> Any:
        """Runs (or records) `computation` applied to the packed Python argument."""


class _State(threading.local):
    def __init__(self) -> None:
        self.stack: list[Context] = []


_local = _State()
_default: Context | None = None
_default_factory: Callable[[], Context] | None = None
_default_lock = threading.Lock()


def get_context() -> Context:
    """The innermost context of this thread: a tracing context, else the default runtime."""
    stack = _local.stack
    if stack:
        return stack[-1]
    default = get_default_context()
    if default is None:
        raise RuntimeError(
            "No execution context is set. Import fedlang (which makes the default runtime on "
            "first use) or call fedlang.set_default_context(...)."
        )
    return default


def get_default_context() -> Context | None:
    """The default context, made by the registered factory on first use."""
    global _default
    if _default is None and _default_factory is not None:
        with _default_lock:
            if _default is None:
                _default = _default_factory()
    return _default


def set_default_context(ctx: Context | None) -> None:
    """Makes `ctx` the context that runs computations called outside a trace."""
    global _default
    _default = ctx


def set_default_factory(factory: Callable[[], Context] | None) -> None:
    """Registers how the default context is made when first needed (and none is set)."""
    global _default_factory
    _default_factory = factory


def current_stack() -> tuple[Context, ...]:
    """The contexts this thread has entered, outermost first."""
    return tuple(_local.stack)


@contextlib.contextmanager
def with_context(ctx: Context) -> Iterator[Context]:
    """Runs the body with `ctx` as this thread's current context."""
    _local.stack.append(ctx)
    try:
        yield ctx
    finally:
        _local.stack.pop()


def innermost(kind: type) -> Any:
    """The innermost context of the given class on this thread's stack, or None."""
    for ctx in reversed(_local.stack):
        if isinstance(ctx, kind):
            return ctx
    return None
