"""HTTP to a task store (src/fedlang/deploy/client/connection.py): URLs checked at once,
`patience` is the seconds spent retrying an unreachable server, a cut download resumes."""

import hashlib
import http.server
import socket
import threading

import numpy as np
import pytest

from fedlang.deploy import protocol
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


# -- downloads: streamed, resumed after a cut (issue 40, item 1)


class _CuttingServer:
    """A real HTTP server of one value that honours `Range` (or not) and cuts the first
    `cuts` answers after `cut_at` bytes, as a dropped link would."""

    def __init__(self, value, *, cut_at, cuts=1, ranges=True):
        self.value, self.cut_at, self.cuts, self.ranges = value, cut_at, cuts, ranges
        self.asked = []  # the Range header of each request
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_GET(self):
                asked = self.headers.get("Range")
                outer.asked.append(asked)
                start = int(asked[6:-1]) if asked and outer.ranges else 0
                body = outer.value[start:]
                self.send_response(206 if start else 200)
                if start:
                    self.send_header("Content-Range",
                                     f"bytes {start}-{len(outer.value) - 1}/{len(outer.value)}")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if outer.cuts:
                    outer.cuts -= 1
                    self.wfile.write(body[: outer.cut_at])
                    self.wfile.flush()
                    self.connection.shutdown(socket.SHUT_RDWR)  # cut mid-body
                    self.close_connection = True
                    return
                self.wfile.write(body)

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.mark.parametrize("ranges", [True, False])
def test_a_download_cut_part_way_resumes_from_the_bytes_received(ranges):
    value = np.random.default_rng(0).bytes(3_000_000)
    server = _CuttingServer(value, cut_at=2_700_000, ranges=ranges)  # cut at 90%
    t = FakeTime()
    c = connection.Connection(server.url, sleep=t.sleep, clock=t.clock)
    try:
        got = c.download("/value", expected_hash=hashlib.sha256(value).hexdigest())
    finally:
        c.close()
        server.close()
    assert bytes(got) == value
    # the second request asks for the rest; a server without ranges sends it all again
    assert server.asked == [None, "bytes=2700000-"]
    assert len(t.waits) == 1


def test_a_download_of_another_hash_is_refused():
    server = _CuttingServer(b"x" * 1000, cut_at=0, cuts=0)
    c = connection.Connection(server.url)
    try:
        with pytest.raises(protocol.BadRequest, match="another hash"):
            c.download("/value", expected_hash="0" * 64)
    finally:
        c.close()
        server.close()


def test_a_download_cut_for_longer_than_patience_gives_up_naming_the_bytes_received():
    server = _CuttingServer(b"y" * 100_000, cut_at=50_000, cuts=10**6, ranges=False)
    t = FakeTime()
    c = connection.Connection(server.url, patience=5.0, sleep=t.sleep, clock=t.clock)
    try:
        with pytest.raises(connection.ServerUnavailable, match=r"cut after 50000 bytes"):
            c.download("/value")
    finally:
        c.close()
        server.close()
