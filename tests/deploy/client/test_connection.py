"""HTTP to a task store (src/fedlang/deploy/client/connection.py): URLs checked at once,
`patience` is the seconds spent retrying an unreachable server."""

import socket

import pytest

from fedlang.deploy.client import connection


@pytest.mark.parametrize("url", ["not-a-url", "htp://127.0.0.1:8000", "127.0.0.1:8000",
                                 "localhost:8000", "http://", ""])
def test_a_malformed_url_is_refused_before_any_request(url):
    with pytest.raises(ValueError, match=r"Expected the server's URL as http://HOST:PORT.*did "
                                         r"you mean http://"):
        connection.Connection(url)


def test_a_url_keeps_its_scheme_host_and_path():
    assert connection.check_url("https://fl.example.org:8443/") == "https://fl.example.org:8443"
    assert connection.check_url("http://[::1]:8000") == "http://[::1]:8000"


class FakeTime:
    """A clock that only the waits move (so the test neither sleeps nor races)."""

    def __init__(self):
        self.now = 1000.0
        self.waits = []

    def clock(self):
        return self.now

    def sleep(self, seconds):
        self.waits.append(seconds)
        self.now += seconds


def test_patience_is_the_seconds_spent_retrying_a_closed_port():
    # the last random wait (up to 10 s) overshot: `patience 5` gave up after 9-13 s
    with socket.socket() as closed:  # bound, not listening: connections are refused
        closed.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{closed.getsockname()[1]}"
        for _ in range(20):  # the waits are random: many draws
            t = FakeTime()
            c = connection.Connection(url, patience=5.0, sleep=t.sleep, clock=t.clock)
            with pytest.raises(connection.ServerUnavailable, match=r"for 5 s \(patience 5 s\)"):
                c.request("GET", "/v1/status")
            c.close()
            assert sum(t.waits) == pytest.approx(5.0) and len(t.waits) >= 2


def test_no_patience_gives_up_after_one_try():
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        t = FakeTime()
        c = connection.Connection(f"http://127.0.0.1:{closed.getsockname()[1]}", patience=0,
                                  sleep=t.sleep, clock=t.clock)
        with pytest.raises(connection.ServerUnavailable):
            c.request("GET", "/v1/status")
        c.close()
        assert t.waits == []


def test_a_thousand_retries_do_not_overflow_the_backoff():
    # first * 2**attempt overflowed a float past attempt 1023 and crashed a patient client
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        t = FakeTime()
        c = connection.Connection(f"http://127.0.0.1:{closed.getsockname()[1]}", patience=1500.0,
                                  backoff=(1e-3, 2.0), sleep=t.sleep, clock=t.clock)
        with pytest.raises(connection.ServerUnavailable, match="patience 1500 s"):
            c.request("GET", "/v1/status")
        c.close()
        assert len(t.waits) > 1100
