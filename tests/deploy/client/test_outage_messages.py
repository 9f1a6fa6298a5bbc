"""What a connection says while its server is unreachable (`Connection(say=...)`, which a
`Client` points at its log; src/fedlang/deploy/client/connection.py): once when it stops
answering, once when it answers again, nothing at each try."""

import httpx
import pytest

from fedlang.deploy import protocol
from fedlang.deploy.client import connection


class Outage:
    """A server that is down for its first `down` requests (an unanswered connection),
    then answers `status`; and a clock that only the waits move."""

    def __init__(self, down, status=200):
        self.down, self.status, self.tries, self.now, self.said = down, status, 0, 1000.0, []

    def handle(self, request):
        self.tries += 1
        if self.tries <= self.down:
            raise httpx.ConnectError("[Errno 111] Connection refused", request=request)
        return httpx.Response(self.status, json={"detail": "no such client"})

    def connection(self, patience=60.0):
        c = connection.Connection("http://fl.example:8000", patience=patience,
                                  sleep=self.sleep, clock=lambda: self.now, say=self.said.append)
        c.http = httpx.Client(base_url=c.url, transport=httpx.MockTransport(self.handle))
        return c

    def sleep(self, seconds):
        self.now += seconds


def test_an_outage_is_said_once_when_it_starts_and_once_when_it_ends():
    outage = Outage(down=6)
    c = outage.connection()
    assert c.request("GET", "/v1/status").status_code == 200
    assert outage.tries == 7
    assert len(outage.said) == 2, outage.said
    assert outage.said[0] == ("server unreachable at http://fl.example:8000 (ConnectError: "
                              "[Errno 111] Connection refused), retrying for up to 60 s")
    assert outage.said[1] == f"server reachable again after {outage.now - 1000.0:.1f} s"


def test_a_refusal_after_an_outage_is_an_answer_too():
    outage = Outage(down=2, status=404)
    with pytest.raises(protocol.ProtocolError):
        outage.connection().request("GET", "/v1/status")
    assert [s.split(" at ")[0].split(" after ")[0] for s in outage.said] == [
        "server unreachable", "server reachable again"]


def test_an_outage_past_the_patience_is_said_once_then_raised():
    outage = Outage(down=10**6)
    with pytest.raises(connection.ServerUnavailable, match=r"patience 5 s"):
        outage.connection(patience=5.0).request("GET", "/v1/status")
    assert outage.tries > 2
    assert outage.said == ["server unreachable at http://fl.example:8000 (ConnectError: "
                           "[Errno 111] Connection refused), retrying for up to 5 s"]


def test_a_server_that_answers_is_never_said_to_be_back():
    outage = Outage(down=0)
    c = outage.connection()
    for _ in range(3):
        c.request("GET", "/v1/status")
    assert outage.said == []
