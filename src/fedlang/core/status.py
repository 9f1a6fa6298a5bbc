"""A long run's status: what a slow step is doing now, and whether to stop.

Status lines: the runtime says, for example, "measuring loop vs scan for
client_update" while `auto` measures; a progress display (the experiment driver's bar)
shows it in place while it is live. A line printed under a live display would break it,
so a speaker prints itself only when `say` finds no display. Displays nest (the
innermost shows) and work across threads.

Stopping: within `defer_interrupts()`, Ctrl-C asks a loop to stop at its next safe
point (the driver: the end of a round) instead of raising inside JAX.

Importing this module does no work.

Example:
  >>> shown = []
  >>> say("measuring")  # no display: the caller prints it if it should
  False
  >>> with showing(shown.append):
  ...     say("measuring")
  True
  >>> shown
  ['measuring']
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Callable, Iterator
from typing import Any

_displays: list[Callable[[str], None]] = []
_lock = threading.RLock()  # reentrant: a signal handler may say something mid-`say`


@contextlib.contextmanager
def showing(display: Callable[[str], None]) -> Iterator[None]:
    """Within the block, `say(message)` calls `display(message)` (from any thread)."""
    with _lock:
        _displays.append(display)
    try:
        yield
    finally:
        with _lock:
            _displays.remove(display)


def say(message: str) -> bool:
    """Hands `message` to the innermost live display; False when there is none."""
    with _lock:
        display = _displays[-1] if _displays else None
    if display is None:
        return False
    display(message)
    return True


class Interrupts:
    """What `defer_interrupts` yields: whether Ctrl-C asked to stop, and blocks a second
    Ctrl-C must not break (writing the last checkpoint, closing metrics files)."""

    def __init__(self, message: str = "", at_once: Callable[[], None] | None = None) -> None:
        self.message = message
        self._at_once = at_once
        self._requested = threading.Event()
        self._shields = 0

    def requested(self) -> bool:
        """Whether Ctrl-C asked to stop (the loop stops at its next safe point)."""
        return self._requested.is_set()

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Within the block, a further Ctrl-C is noted, not raised: the block finishes."""
        self._shields += 1
        try:
            yield
        finally:
            self._shields -= 1

    def _handle(self, signum: int, frame: Any) -> None:
        if self._requested.is_set() and not self._shields:
            if self._at_once is not None:
                self._at_once()
            raise KeyboardInterrupt
        message = self.message if not self._requested.is_set() else "finishing up; one moment"
        self._requested.set()
        if not say(message):  # no progress display to show it: a line on stderr
            os.write(2, f"\nfedlang: {message}\n".encode())  # no buffered I/O in a handler


@contextlib.contextmanager
def defer_interrupts(
    message: str = "stopping at the next safe point (Ctrl-C again to stop now)",
    at_once: Callable[[], None] | None = None,
) -> Iterator[Interrupts]:
    """Defers Ctrl-C to a loop's next safe point; yields its `Interrupts`.

    A `KeyboardInterrupt` raised inside JAX can be swallowed (jax#18246: it lands in a
    garbage-collection callback and the work goes on) or leave XLA's threads mid-work
    (a crash at exit), so within this block the first Ctrl-C (SIGINT) only sets
    `requested()` and says `message`; the loop checks it where stopping is safe
    (`fedlang.simulation.run_training`: before and after each round). A second Ctrl-C
    calls `at_once()` if given (a command line exits the process there: a
    `KeyboardInterrupt` in a library's I/O thread can hang its close) and else raises
    `KeyboardInterrupt` at once, except inside `shielded()` blocks. Blocks nest:
    an inner one shares the outer one's `Interrupts`, so a command can enter it before
    its set-up and the driver again.

    It takes effect in the main thread, where Python runs signal handlers, and only
    when SIGINT has Python's default handler (or an enclosing block's); elsewhere
    `requested()` is always False and Ctrl-C behaves as before.
    """
    current = signal.getsignal(signal.SIGINT)
    outer = getattr(current, "__self__", None)
    if isinstance(outer, Interrupts):  # an enclosing block's: share it
        yield outer
        return
    if threading.current_thread() is not threading.main_thread() or (
            current is not signal.default_int_handler):
        yield Interrupts()  # never requested: Ctrl-C behaves as before
        return
    interrupts = Interrupts(message, at_once)
    signal.signal(signal.SIGINT, interrupts._handle)
    try:
        yield interrupts
    finally:
        signal.signal(signal.SIGINT, current)
