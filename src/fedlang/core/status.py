"""A long run's status: what a slow step is doing now, and whether to stop.

Status lines: the runtime says, for example, "measuring loop vs scan for
client_update" while `auto` measures; a progress display (the experiment driver's bar)
shows it in place while it is live. A line printed under a live display would break it,
so a speaker prints itself only when `say` finds no display. Displays nest (the
innermost shows) and work across threads.

Stopping: within `defer_interrupts()`, Ctrl-C (and, if asked, SIGTERM) asks a loop to
stop at its next safe point (the driver: the end of a round; a deployment client: the
end of its task) instead of raising inside JAX.

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
    """What `defer_interrupts` yields: whether Ctrl-C asked to stop (and by which
    signal: `signum`), and blocks a second Ctrl-C must not break (writing the last
    checkpoint, closing metrics files)."""

    def __init__(self, message: str = "", at_once: Callable[[], None] | None = None,
                 on_request: Callable[[], None] | None = None) -> None:
        self.message = message
        self.signum: int | None = None  # the signal that asked to stop (SIGINT, SIGTERM)
        self._at_once = at_once
        self._on_request = on_request
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
        self.signum = signum
        if self._requested.is_set() and not self._shields:
            if self._at_once is not None:
                self._at_once()
            raise KeyboardInterrupt
        message = self.message if not self._requested.is_set() else "finishing up; one moment"
        first = not self._requested.is_set()
        self._requested.set()
        if first and self._on_request is not None:
            # on a thread of its own: the main thread, which runs this handler, may be
            # holding a lock that `on_request` takes (e.g. inside `threading.Event.wait`)
            threading.Thread(target=self._on_request, name="fedlang-stop", daemon=True).start()
        if not say(message):  # no progress display to show it: a line on stderr
            os.write(2, f"\nfedlang: {message}\n".encode())  # no buffered I/O in a handler


@contextlib.contextmanager
def defer_interrupts(
    message: str = "stopping at the next safe point (Ctrl-C again to stop now)",
    at_once: Callable[[], None] | None = None,
    *,
    on_request: Callable[[], None] | None = None,
    sigterm: bool = False,
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

    `on_request()`, if given, is called once on the first Ctrl-C, on a thread of its own
    (to wake a loop that waits, e.g. `threading.Event.set`). With `sigterm=True`,
    SIGTERM is handled like Ctrl-C (where it has its default action): a service manager
    stopping a process gets the same clean stop. `Interrupts.signum` says which came.

    It takes effect in the main thread, where Python runs signal handlers, and only on
    a signal that has its default handler (or an enclosing block's); an ignored SIGINT
    (`nohup`) stays ignored. Elsewhere `requested()` is always False and Ctrl-C behaves
    as before.
    """
    current, term = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
    for handler in (current, term):
        outer = getattr(handler, "__self__", None)
        if isinstance(outer, Interrupts):  # an enclosing block's: share it
            yield outer
            return
    main = threading.current_thread() is threading.main_thread()
    take = [signum for signum, handler, wanted in (
        (signal.SIGINT, current, signal.default_int_handler),  # not SIG_IGN (nohup)
        (signal.SIGTERM, term, signal.SIG_DFL if sigterm else None),
    ) if main and handler is wanted]
    if not take:
        yield Interrupts()  # never requested: Ctrl-C behaves as before
        return
    interrupts = Interrupts(message, at_once, on_request)
    for signum in take:
        signal.signal(signum, interrupts._handle)
    try:
        yield interrupts
    finally:
        for signum in take:
            signal.signal(signum, current if signum == signal.SIGINT else term)
