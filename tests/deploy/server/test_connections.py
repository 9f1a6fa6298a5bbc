"""Connection budgets no stranger can exhaust (issue 36, attacks 1-3), against a real
`fedlang serve` process: attackers from 127.0.0.2 hold or churn connections (a trickled
body without a token, partial headers, trickled report uploads with credentials) while a
legitimate client from 127.0.0.1 checks in, on a fresh connection each try; it must be
served at least 95% of its tries. Then the budgets' edge cases: a fast honest upload is
never cut, a trickle is, routes without a body refuse a declared one at once, the
per-address caps, and each refusal counted by reason in /v1/status and /metrics.

The server runs the fedlang this test imports (so `PYTHONPATH=OLD/src pytest ...` runs
these tests against an older server). Every server listens on loopback and every attack
stops by itself."""

import contextlib
import json
import os
import pathlib
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

import fedlang
from fedlang.deploy.plans import execution
from fedlang.deploy.server import serve

from ..conftest import _free_port, wait_for
from .conftest import bearer

ATTACKER, HONEST = "127.0.0.2", "127.0.0.1"
SRC = pathlib.Path(fedlang.__file__).resolve().parents[1]  # the fedlang under test


class Serving:
    """`fedlang serve` as a process on 127.0.0.1, from `SRC`."""

    def __init__(self, tmp_path, db, *args):
        self.port, self.admin_token = _free_port(), "admin-token"
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tmp_path / "server.log"
        env = {**os.environ, "PYTHONPATH": str(SRC), "FEDLANG_ADMIN_TOKEN": self.admin_token}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "fedlang", "serve", "--db", str(db), "--port",
                 str(self.port), "--min-retry", "0.05", "--key-file", str(tmp_path / "key"),
                 *args],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        end = time.monotonic() + 60
        while time.monotonic() < end:
            assert self.proc.poll() is None, self.log.read_text()
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{self.url}/v1/status", timeout=2).status_code == 200:
                    return
            time.sleep(0.1)
        raise AssertionError(f"the server did not start:\n{self.log.read_text()}")

    def kill(self):
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)

    def refused(self):
        """The connections refused by reason, as /v1/status shows them (within a second)."""
        return httpx.get(f"{self.url}/v1/status", timeout=10).json().get("connections_refused", {})


@pytest.fixture
def serving(tmp_path):
    made = []

    def make(*args, db=None):
        s = Serving(tmp_path, db or tmp_path / "server.db", *args)
        made.append(s)
        return s

    yield make
    for s in made:
        s.kill()


class Attack:
    """`n` connections from `ATTACKER`, each sending `head`, then `trickle` every `every`
    seconds; a connection the server closes is made again after `reconnect` seconds. Runs
    on a thread until `stop()`; `held()` is how many are connected now."""

    def __init__(self, port, head, trickle, every, n, reconnect=0.5):
        self.port, self.head, self.trickle, self.every = port, head, trickle, every
        self.n, self.reconnect = n, reconnect
        self.connects = self.closed = 0
        self.answers: dict[bytes, int] = {}  # status line codes the server answered
        self._stop = threading.Event()
        self._sel = selectors.DefaultSelector()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self.stop()

    def stop(self):
        self._stop.set()
        self._thread.join(timeout=30)

    def held(self):
        return len(self._sel.get_map()) if not self._stop.is_set() else 0

    def _open(self):
        s = socket.socket()
        s.setblocking(False)
        try:
            s.bind((ATTACKER, 0))
            s.connect_ex(("127.0.0.1", self.port))
        except OSError:
            s.close()
            return False
        self.connects += 1
        self._sel.register(s, selectors.EVENT_WRITE | selectors.EVENT_READ, {"sent": False})
        return True

    def _drop(self, s, now, again):
        with contextlib.suppress(KeyError, ValueError):
            self._sel.unregister(s)
        s.close()
        self.closed += 1
        again.append(now + self.reconnect)

    def _run(self):
        again = [0.0] * self.n  # when to (re)connect each missing connection
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                due = [t for t in again if t <= now]
                again = [t for t in again if t > now]
                for _ in due:
                    if not self._open():
                        again.append(now + self.reconnect)
                for key, events in self._sel.select(timeout=0.02):
                    s, state = key.fileobj, key.data
                    try:
                        if events & selectors.EVENT_READ:
                            got = s.recv(65536)
                            if not got:
                                self._drop(s, now, again)
                                continue
                            code = got.split(b" ", 2)[1] if got.startswith(b"HTTP/") else b"?"
                            self.answers[code] = self.answers.get(code, 0) + 1
                        if events & selectors.EVENT_WRITE and not state["sent"]:
                            s.sendall(self.head)
                            state["sent"], state["next"] = True, now + self.every
                            self._sel.modify(s, selectors.EVENT_READ, state)
                    except OSError:
                        self._drop(s, now, again)
                for key in list(self._sel.get_map().values()):
                    state = key.data
                    if state["sent"] and state["next"] <= now:
                        state["next"] = now + self.every
                        try:
                            key.fileobj.send(self.trickle)
                        except OSError:
                            self._drop(key.fileobj, now, again)
        finally:
            for key in list(self._sel.get_map().values()):
                key.fileobj.close()
            self._sel.close()


def _honest(url, credential, seconds):
    """(served, tries) of a client from `HONEST` checking in on a new connection each try
    (its own timeout 5 s) for `seconds`."""
    transport = httpx.HTTPTransport(local_address=HONEST, retries=0)
    served = tries = 0
    with httpx.Client(base_url=url, transport=transport, timeout=5,
                      limits=httpx.Limits(max_keepalive_connections=0)) as http:
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            tries += 1
            with contextlib.suppress(httpx.TransportError):
                r = http.post("/v1/checkin", headers=bearer(credential))
                served += r.status_code == 200
            time.sleep(0.05)
    return served, tries


def _deployment(server, sum_round, clients=21):
    """A population `pop` with `clients` clients enrolled with its one token, and an open
    round of `sum_round`: (round id, credentials)."""
    with httpx.Client(base_url=server.url, timeout=30,
                      transport=httpx.HTTPTransport(local_address=HONEST)) as http:
        admin = bearer(server.admin_token)
        token = http.post("/v1/admin/populations", json={"name": "pop"}, headers=admin).json()["token"]
        plan, broadcast = sum_round
        blobs = [http.post("/v1/admin/blobs", content=b, headers=admin).json()["hash"]
                 for b in (plan.to_bytes(), broadcast)]
        r = http.post("/v1/admin/rounds", headers=admin, json={
            "population": "pop", "plan": blobs[0], "broadcast": blobs[1], "target": 1000,
            "deadline": 600})
        assert r.status_code == 201, r.text
        credentials = [http.post("/v1/populations/pop/enroll", headers=bearer(token)).json()["credential"]
                       for _ in range(clients)]
    return r.json()["id"], credentials


def _trickled_body(path, length, method="POST", headers=""):
    return (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"{headers}Content-Length: {length}\r\n\r\n").encode()


def _attacks(round_id, credentials):
    """The issue's attacks 1-3 as (head, trickle) of each attacking connection."""
    task = json.dumps({"round": round_id, "session": None, "version": None},
                      separators=(",", ":"))
    uploads = [  # report uploads with credentials enrolled from one token
        _trickled_body(f"/v1/rounds/{round_id}/report", 60_000, "PUT",
                       f"Authorization: Bearer {c}\r\nFedlang-Task: {task}\r\n")
        for c in credentials[1:]]
    return {
        "trickled_body_no_token": (_trickled_body("/v1/checkin", 60_000), b"{"),
        "partial_headers": (b"POST /v1/checkin HTTP/1.1\r\nHost: x\r\n", b"X"),
        "trickled_reports": (uploads, b"\0"),
    }


def _run_attack(server, sum_round, which, n, seconds, reconnect):
    round_id, credentials = _deployment(server, sum_round)
    head, trickle = _attacks(round_id, credentials)[which]
    heads = head if isinstance(head, list) else [head]
    attacks = [Attack(server.port, h, trickle, 1.0, n // len(heads), reconnect) for h in heads]
    with contextlib.ExitStack() as stack:
        for a in attacks:
            stack.enter_context(a)
        time.sleep(1.0)  # the attackers connect and hold what they can
        served, tries = _honest(server.url, credentials[0], seconds)
    return served, tries, attacks


ATTACKS = ["trickled_body_no_token", "partial_headers"]


@pytest.mark.parametrize("which", ATTACKS)
def test_a_stranger_from_one_address_cannot_starve_another(serving, sum_round, which):
    # 200 attacking connections against a server that takes 150: before the budgets the
    # attackers held them all and the honest client got 503
    server = serving("--max-connections", "150")
    served, tries, _ = _run_attack(server, sum_round, which, 200, 3.0, 0.5)
    assert served >= 0.95 * tries, f"served {served} of {tries}"
    reason = {"trickled_body_no_token": "body_not_allowed",
              "partial_headers": "unfinished_per_address"}[which]
    assert wait_for(lambda: server.refused().get(reason, 0) > 0, f"{reason} counted", 10)


def test_trickled_reports_with_credentials_cannot_starve_another(serving, sum_round, db_url):
    server = serving("--max-connections", "150", db=db_url)
    served, tries, _ = _run_attack(server, sum_round, "trickled_reports", 200, 3.0, 0.5)
    assert served >= 0.95 * tries, f"served {served} of {tries}"
    assert wait_for(lambda: server.refused().get("connections_per_address", 0) > 0,
                    "connections_per_address counted", 10)


@pytest.mark.slow
@pytest.mark.parametrize("which", [*ATTACKS, "trickled_reports"])
def test_attacks_at_2500_connections_leave_others_served(serving, sum_round, which):
    # the measure: 2,500 connections from one address, the server's defaults
    server = serving()
    served, tries, attacks = _run_attack(server, sum_round, which, 2500, 12.0, 1.0)
    assert served >= 0.95 * tries, f"served {served} of {tries}"
    assert sum(a.connects for a in attacks) >= 2500


# -- the budgets' edge cases

RATE = ["--body-min-rate", "2000", "--body-rate-window", "1"]


def _raw(port, data, source=HONEST, timeout=10.0):
    s = socket.socket()
    s.bind((source, 0))
    s.settimeout(timeout)
    s.connect(("127.0.0.1", port))
    if data:
        s.sendall(data)
    return s


def _answer(s, deadline=10.0):
    """What the server sends until it closes (a reset ends it too)."""
    s.settimeout(deadline)
    got = b""
    with contextlib.suppress(ConnectionResetError):
        while chunk := s.recv(65536):
            got += chunk
    return got


def test_a_trickled_body_is_cut_within_the_window_and_a_fast_one_never(serving, sum_round):
    server = serving(*RATE)
    round_id, credentials = _deployment(server, sum_round, clients=2)
    admin = bearer(server.admin_token)
    # an honest upload at loopback speed, hours long at the floor's rate: a 16 MiB blob
    blob = np.random.default_rng(0).bytes(16 << 20)
    r = httpx.post(f"{server.url}/v1/admin/blobs", content=blob, headers=admin, timeout=60)
    assert r.status_code == 201, r.text
    # an 80 KB-class report, and a check-in: served
    plan, broadcast = sum_round
    report = execution.run_plan(plan, broadcast, {"train": [np.ones(3, np.float32)]})
    for c in credentials:
        assert httpx.post(f"{server.url}/v1/checkin", headers=bearer(c)).json()["task"]
    task = json.dumps({"round": round_id, "session": None, "version": None}, separators=(",", ":"))
    r = httpx.put(f"{server.url}/v1/rounds/{round_id}/report", content=report,
                  headers={**bearer(credentials[0]), "Fedlang-Task": task})
    assert r.status_code == 200, r.text
    # a report trickled at 1 byte every 0.2 s (5 B/s, the floor is 2000 B/s): cut
    with _raw(server.port, _trickled_body(
            f"/v1/rounds/{round_id}/report", 60_000, "PUT",
            f"Authorization: Bearer {credentials[1]}\r\nFedlang-Task: {task}\r\n")) as s:
        start, reply = time.monotonic(), b""
        with contextlib.suppress(OSError):
            while time.monotonic() - start < 8 and not reply:
                s.sendall(b"\0")
                s.settimeout(0.2)
                with contextlib.suppress(TimeoutError):
                    reply = s.recv(65536)
        took = time.monotonic() - start
        reply += _answer(s)
    assert reply.split()[1] == b"408", reply[:300]
    assert b"bytes/s" in reply and b"--body-min-rate" in reply and took < 4
    assert wait_for(lambda: server.refused().get("body_rate", 0) >= 1, "body_rate counted", 10)
    metrics = httpx.get(f"{server.url}/metrics", headers=admin).text
    assert 'fedlang_connections_refused_total{reason="body_rate"} 1.0' in metrics


BODYLESS = [
    "GET /v1/status HTTP/1.1\r\nContent-Length: 5\r\n",
    "POST /v1/checkin HTTP/1.1\r\nContent-Length: 60000\r\n",
    "POST /v1/checkin HTTP/1.1\r\nTransfer-Encoding: chunked\r\n",
    "POST /v1/populations/pop/enroll HTTP/1.1\r\nContent-Length: 100\r\n",
    "GET /dashboard/ HTTP/1.1\r\nContent-Length: 100\r\n",
]


def test_a_route_without_a_body_refuses_a_declared_one_at_once(serving):
    server = serving()
    for request_head in BODYLESS:
        with _raw(server.port, f"{request_head}Host: x\r\n\r\n".encode()) as s:
            start = time.monotonic()
            reply = _answer(s)  # sent nothing of the body: answered, and closed
        assert reply.split()[1] == b"413" and time.monotonic() - start < 2, reply[:300]
        answer = json.loads(reply.partition(b"\r\n\r\n")[2])
        assert answer["reason"] == "body_not_allowed" and "takes none" in answer["detail"]
    assert wait_for(lambda: server.refused().get("body_not_allowed") == len(BODYLESS),
                    "counted", 10)
    # no body, or an empty one, is served as before
    assert httpx.get(f"{server.url}/v1/status", headers={"Content-Length": "0"}).status_code == 200
    assert httpx.post(f"{server.url}/v1/checkin").status_code == 401


def test_the_per_address_caps(serving):
    server = serving("--max-connections-per-address", "4", "--max-unfinished-per-address", "2",
                     "--forwarded-allow-ips", "")
    with contextlib.ExitStack() as stack:
        # two connections whose headers have not ended: a third is refused at once
        partial = [stack.enter_context(_raw(server.port, b"GET /v1/status HTTP/1.1\r\n", ATTACKER))
                   for _ in range(2)]
        time.sleep(0.2)
        with _raw(server.port, None, ATTACKER) as s:
            reply = _answer(s)
        assert reply.split()[1] == b"503" and b"unfinished_per_address" in reply, reply[:300]
        assert b"--max-unfinished-per-address" in reply
        # the other address is not affected
        assert httpx.get(f"{server.url}/v1/status", timeout=5).status_code == 200
        # their headers end: two idle keep-alive connections, two more may open (4 open)
        for s in partial:
            s.sendall(b"Host: x\r\n\r\n")
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        more = [stack.enter_context(_raw(server.port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n",
                                         ATTACKER)) for _ in range(2)]
        for s in more:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")
        with _raw(server.port, None, ATTACKER) as s:  # a fifth: over the open cap
            reply = _answer(s)
        assert reply.split()[1] == b"503" and b"connections_per_address" in reply, reply[:300]
        assert httpx.get(f"{server.url}/v1/status", timeout=5).status_code == 200
    # once closed, the address may connect again
    time.sleep(0.3)
    with _raw(server.port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", ATTACKER) as s:
        assert s.recv(65536).startswith(b"HTTP/1.1 200")
    refused = wait_for(lambda: (r := server.refused()).get("connections_per_address") and r,
                       "counted", 10)
    assert refused == {"unfinished_per_address": 1, "connections_per_address": 1}


def test_a_trusted_proxy_is_not_capped(serving):
    server = serving("--max-unfinished-per-address", "1", "--forwarded-allow-ips", ATTACKER)
    with contextlib.ExitStack() as stack:
        for _ in range(3):
            stack.enter_context(_raw(server.port, b"GET /v1/status HTTP/1.1\r\n", ATTACKER))
        with _raw(server.port, b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n", ATTACKER) as s:
            assert s.recv(65536).startswith(b"HTTP/1.1 200")


def test_the_header_deadline_is_counted(serving):
    server = serving("--header-timeout", "0.5")
    with _raw(server.port, b"GET /v1/status HTTP/1.1\r\n") as s:
        reply = _answer(s)
    assert reply.startswith(b"HTTP/1.1 408")
    assert wait_for(lambda: server.refused().get("header_timeout") == 1, "counted", 10)


def test_the_budgets_are_checked_and_documented():
    for name in ("max_connections_per_address", "max_unfinished_per_address", "body_min_rate"):
        with pytest.raises(ValueError, match=f"Expected {name} >= 0"):
            serve.Limits(**{name: -1})
    with pytest.raises(ValueError, match="body_rate_window > 0"):
        serve.Limits(body_rate_window=0)
    limits = serve.Limits()
    assert limits.max_connections_per_address < limits.max_connections
    assert limits.max_unfinished_per_address < limits.max_connections_per_address
    text = pathlib.Path(__file__).resolve().parents[3].joinpath("docs", "deploy.md").read_text()
    for flag, default in [("--max-connections-per-address", "100"),
                          ("--max-unfinished-per-address", "10"),
                          ("--body-min-rate", "1024"), ("--body-rate-window", "10")]:
        assert f"`{flag}` ({default}" in text, flag


def test_a_stalled_body_is_counted_apart_and_a_zero_rate_is_no_minimum(serving):
    server = serving("--body-min-rate", "0", "--body-timeout", "1")
    head = _trickled_body("/v1/admin/populations", 1000,
                          headers=f"Authorization: Bearer {server.admin_token}\r\n")
    with _raw(server.port, head + b'{"name": ') as s:
        for _ in range(4):  # 2 bytes a second for 2 s: slow, but no minimum rate
            time.sleep(0.5)
            s.sendall(b" ")
        reply = _answer(s)  # then nothing: a stall
    assert reply.split()[1] == b"408" and b"found nothing for 1 s" in reply, reply[:300]
    assert wait_for(lambda: server.refused() == {"body_stall": 1}, "body_stall counted", 10)


def test_fedlang_status_shows_refused_connections_on_their_own_line():
    from rich.console import Console

    from fedlang.cli import deploy as cli_deploy

    doc = {"populations": [], "enrollments": 0, "checkins": 0, "dropouts": 0,
           "rounds_closed": 0, "rounds_failed": 0, "rounds": [],
           "reports": {"accepted": 0, "late": 0, "refused": {}}, "admin_refused": {},
           "connections_refused": {"body_rate": 2, "connections_per_address": 5}}
    console = Console(width=200, record=True)
    console.print(cli_deploy.status_tables(doc))
    assert "connections refused 7 (body_rate 2, connections_per_address 5)" in {
        " ".join(line.split()) for line in console.export_text().splitlines()}
