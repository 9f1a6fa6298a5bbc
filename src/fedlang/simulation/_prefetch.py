"""A background-thread prefetching iterator that never leaks its thread."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from typing import Any


def close(it: Any) -> None:
    """Closes an iterator if it supports it (generators: runs their `finally`)."""
    method = getattr(it, "close", None)
    if method is not None:
        method()


_DONE = object()


class _Raised:
    def __init__(self, error: BaseException):
        self.error = error


def prefetch(make_iter: Callable[[], Iterator[Any]], size: int) -> Iterator[Any]:
    """Yields the items of `make_iter()`, produced up to `size` ahead on a thread.

    The thread starts at the first `next`. A producer exception is re-raised here;
    closing this generator early (or its garbage collection) stops and joins it.
    """
    q: queue.Queue[Any] = queue.Queue(maxsize=size)
    stop = threading.Event()

    def put(item: Any) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=0.05)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        it = None
        try:
            it = make_iter()
            for x in it:
                if not put(x):
                    return
            put(_DONE)
        except BaseException as e:  # handed to the consumer, which re-raises it
            put(_Raised(e))
        finally:
            if it is not None:
                close(it)

    thread = threading.Thread(target=produce, name="fedlang-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = q.get()
            if item is _DONE:
                return
            if isinstance(item, _Raised):
                raise item.error
            yield item
    finally:
        stop.set()
        thread.join()
