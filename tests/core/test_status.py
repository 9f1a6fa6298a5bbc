"""Status lines go to the innermost live display, from any thread, and to none after it."""

import threading

from fedlang.core import status


def test_the_innermost_display_shows_from_any_thread_until_it_closes():
    outer, inner = [], []
    with status.showing(outer.append):
        with status.showing(inner.append):
            worker = threading.Thread(target=status.say, args=("measuring",))
            worker.start()
            worker.join()
        assert status.say("picked")
    assert inner == ["measuring"] and outer == ["picked"]
    assert status.say("nobody shows this") is False
