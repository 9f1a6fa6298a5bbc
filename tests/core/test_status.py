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


def test_sigterm_and_the_first_ctrl_c_ask_to_stop_and_wake_a_waiting_loop():
    import os
    import signal

    woken = threading.Event()
    # SIGTERM as in a fresh process: a test before this one (ray.init) may have set its own
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    try:
        with status.defer_interrupts("stopping", on_request=woken.set, sigterm=True) as interrupts:
            assert signal.getsignal(signal.SIGTERM) == interrupts._handle
            os.kill(os.getpid(), signal.SIGTERM)  # handled before kill returns (main thread)
            assert interrupts.requested() and interrupts.signum == signal.SIGTERM
            assert woken.wait(10)  # on_request ran (on its own thread)
        assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
    finally:
        signal.signal(signal.SIGTERM, before)
