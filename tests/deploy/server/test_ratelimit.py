"""Rate limits (issue 23): a token bucket per enrolled client and per address that fails
to enroll, against a real `fedlang serve` process with small limits; the Python client
waits out a 429's Retry-After."""

import time

import httpx
import pytest

from fedlang.deploy.client import connection
from fedlang.deploy.server import ratelimit, serve

from ...cli._run import fedlang, one_sentence_error
from ..conftest import wait_for
from .conftest import bearer

API = "/v1"


@pytest.fixture
def server(tmp_path, server_process):
    return server_process(tmp_path / "server.db", extra_args=[
        "--client-rate", "2", "--client-burst", "4", "--enroll-rate", "0.5",
        "--enroll-burst", "3"]).start()


def _population(http, admin_token):
    r = http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=bearer(admin_token))
    assert r.status_code == 201, r.text
    return r.json()["token"]


def _enroll(http, token):
    r = http.post(f"{API}/populations/pop/enroll", headers=bearer(token))
    assert r.status_code == 201, r.text
    return r.json()["credential"]


def _refused(http):
    return http.get(f"{API}/status").json()["reports"]["refused"].get("rate_limited", 0)


def test_a_client_past_its_rate_gets_429_with_retry_after(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        token = _population(http, server.admin_token)
        a, b = _enroll(http, token), _enroll(http, token)
        answers = [http.post(f"{API}/checkin", headers=bearer(a)) for _ in range(8)]
        codes = [r.status_code for r in answers]
        assert codes[:4] == [200] * 4 and 429 in codes[4:], codes
        limited = next(r for r in answers if r.status_code == 429)
        assert limited.json()["reason"] == "rate_limited"
        assert "at most 2 requests per second from one client" in limited.json()["detail"]
        assert int(limited.headers["Retry-After"]) >= 1
        assert _refused(http) == codes.count(429)
        # another client has its own bucket; the limited one gets in again after waiting
        assert http.post(f"{API}/checkin", headers=bearer(b)).status_code == 200
        time.sleep(int(limited.headers["Retry-After"]))
        assert http.post(f"{API}/checkin", headers=bearer(a)).status_code == 200


def test_an_address_guessing_enrollment_tokens_is_refused_before_its_token_is_read(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        token = _population(http, server.admin_token)
        _enroll(http, token)  # good tokens take nothing from the bucket
        guesses = [http.post(f"{API}/populations/pop/enroll", headers=bearer(f"guess-{i}"))
                   for i in range(3)]
        assert [r.status_code for r in guesses] == [401] * 3
        r = http.post(f"{API}/populations/pop/enroll", headers=bearer("guess-3"))
        assert (r.status_code, r.json()["reason"]) == (429, "rate_limited")
        r = http.post(f"{API}/populations/pop/enroll", headers=bearer(token))
        assert r.status_code == 429  # the right token too: a guesser learns nothing
        assert "from one address" in r.json()["detail"]
        time.sleep(int(r.headers["Retry-After"]))
        assert http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).status_code == 201


def test_the_python_client_waits_out_a_429(server):
    with httpx.Client(base_url=server.url, timeout=30) as http:
        credential = _enroll(http, _population(http, server.admin_token))
    conn = connection.Connection(server.url, patience=30)
    try:
        start = time.monotonic()
        for _ in range(7):  # 4 at once, then 2 a second
            conn.json("POST", f"{API}/checkin", token=credential)
        assert time.monotonic() - start >= 1.0  # it waited, and got every answer
    finally:
        conn.close()


def test_buckets_refill_at_their_rate():
    now = [0.0]
    buckets = ratelimit.Buckets(ratelimit.Rate(2.0, 3), "client", clock=lambda: now[0], max_keys=2)
    assert [buckets.take("a") for _ in range(3)] == [0.0] * 3
    assert buckets.take("a") == pytest.approx(0.5)
    now[0] += 0.5
    assert buckets.take("a") == 0.0 and buckets.take("a") > 0
    for key in "bcd":  # past max_keys, full buckets are dropped
        buckets.take(key)
    now[0] += 10
    buckets.take("e")
    assert len(buckets._buckets) <= 2


def test_rate_limits_are_checked():
    with pytest.raises(ValueError, match="client_burst >= 1, found 50 and 0"):
        serve.Limits(client_burst=0)
    assert serve.Limits(client_rate=0).rate("client") is None  # off
    one_sentence_error(fedlang("serve", "--db", ":memory:", "--enroll-rate", "-1"), 1,
                       "enroll_rate > 0")


def test_an_address_guessing_the_admin_token_is_refused_before_its_token_is_read(
        tmp_path, server_process):
    # issue 36: admin-token guesses were not limited (1,500 at 410/s, each a database
    # write); now, like enrollments, per address, on every route that takes the token
    server = server_process(tmp_path / "server.db", extra_args=[
        "--admin-rate", "0.5", "--admin-burst", "3"]).start()
    guesser = httpx.Client(base_url=server.url, timeout=30,
                           transport=httpx.HTTPTransport(local_address="127.0.0.2"))
    other = httpx.Client(base_url=server.url, timeout=30)  # 127.0.0.1
    with guesser, other:
        codes = [guesser.get(f"{API}/admin/overview", headers=bearer(f"guess-{i}")).status_code
                 for i in range(3)]
        assert codes == [401] * 3
        limited = [guesser.get(path, headers=bearer(token)) for path, token in (
            (f"{API}/admin/overview", "guess-3"),
            (f"{API}/admin/overview", server.admin_token),  # the right one too
            ("/metrics", "guess-4"), (f"{API}/status", "guess-5"),  # every route with it
            (f"{API}/blobs/{'0' * 64}", "guess-6"))]
        for r in limited:
            assert (r.status_code, r.json()["reason"]) == (429, "rate_limited"), r.text
        assert "wrong admin tokens" in limited[1].json()["detail"]
        assert int(limited[1].headers["Retry-After"]) >= 1
        # another address is not held back, and its token works
        assert other.get(f"{API}/admin/overview", headers=bearer(server.admin_token)).status_code == 200
        assert other.get(f"{API}/status").status_code == 200  # no token, no guess
        # counted as admin refusals by reason (within a second: telemetry.Refusals)
        assert wait_for(lambda: other.get(f"{API}/status").json()["admin_refused"]
                        == {"unauthorized": 3, "rate_limited": 2}, "the refusals counted", 10)
        time.sleep(int(limited[1].headers["Retry-After"]))
        r = guesser.get(f"{API}/admin/overview", headers=bearer(server.admin_token))
        assert r.status_code == 200, r.text


def test_a_flood_of_admin_guesses_costs_the_database_a_write_a_second(server):
    # the default limit (20 at once, then 1 a second): 200 guesses from one address
    with httpx.Client(base_url=server.url, timeout=30,
                      transport=httpx.HTTPTransport(local_address="127.0.0.2")) as http:
        before = _db_writes(http, server.admin_token)
        start = time.monotonic()
        codes = [http.post(f"{API}/admin/populations", json={"name": "x"},
                           headers=bearer("guess")).status_code for _ in range(200)]
        took = time.monotonic() - start
        assert codes.count(401) <= 20 + took + 1 and codes.count(429) >= 150, codes
        assert wait_for(lambda: sum(http.get(f"{API}/status").json()["admin_refused"].values())
                        == 200, "every guess counted", 10)
        writes = _db_writes(http, server.admin_token) - before
    assert writes <= took + 4, (writes, took)  # not one each
    assert serve.Limits(admin_rate=0).rate("admin") is None  # --admin-rate 0: off


def _db_writes(http, admin_token):
    """Write transactions the server made so far (its `/metrics` histogram)."""
    from prometheus_client import parser

    text = httpx.get(str(http.base_url.join("/metrics")), headers=bearer(admin_token),
                     timeout=30).text
    return sum(s.value for family in parser.text_string_to_metric_families(text)
               for s in family.samples
               if s.name == "fedlang_db_transaction_seconds_count"
               and s.labels.get("kind") == "write")
