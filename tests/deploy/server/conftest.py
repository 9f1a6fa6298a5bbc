"""Helpers of the server's tests: a clock the test moves, a bearer header."""

import time


class Clock:
    """The server's clock in a test: the time when made, then what the test sets."""

    def __init__(self):
        self.now = time.time()

    def __call__(self):
        return self.now


def bearer(token):
    return {"Authorization": f"Bearer {token}"}
