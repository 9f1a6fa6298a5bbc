"""Timeouts and the connection limit (issue 23, item 5), against a real `fedlang serve`
process with short limits: headers that never end (slowloris), a body that stalls, an
idle connection, and more connections than the server takes. Each test is bounded by
its sockets' timeouts."""

import contextlib
import select
import socket
import time
import types

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.cli.deploy import parse_size
from fedlang.deploy.server import intake, serve

from ...cli._run import fedlang, one_sentence_error
from ..conftest import capture
from .conftest import bearer

LIMITS = ["--header-timeout", "1", "--body-timeout", "1", "--keep-alive", "1",
          "--max-connections", "8"]


@pytest.fixture
def server(tmp_path, server_process):
    return server_process(tmp_path / "server.db", extra_args=LIMITS).start()


def _connect(server):
    s = socket.create_connection(("127.0.0.1", server.port), timeout=10)
    return s


def _until_closed(s, deadline=10.0, *, reset_ok=False):
    """What the server sends until it closes the connection (bounded by `deadline`).

    `reset_ok`: a reset also ends the connection. A server that closes a connection with
    unread bytes in its receive buffer (a slowloris's last header byte) makes the kernel
    send RST, which may discard its reply before we read it (RFC 9112 section 9.6)."""
    s.settimeout(deadline)
    got = b""
    try:
        while chunk := s.recv(65536):
            got += chunk
    except ConnectionResetError:
        if not reset_ok:
            raise
    return got


def test_headers_that_never_end_are_cut_off(server):
    with contextlib.ExitStack() as stack:
        conns = [stack.enter_context(_connect(server)) for _ in range(5)]
        for s in conns:
            s.sendall(b"POST /v1/checkin HTTP/1.1\r\nHost: x\r\n")
        start, answered = time.monotonic(), {}
        while len(answered) < len(conns) and time.monotonic() - start < 8:
            for s in conns:  # a header byte now and then, as a slowloris sends
                if s not in answered:
                    with contextlib.suppress(OSError):
                        s.sendall(b"X")
            readable, _, _ = select.select([s for s in conns if s not in answered], [], [], 0.2)
            for s in readable:
                answered[s] = _until_closed(s, reset_ok=True)
        assert len(answered) == len(conns) and time.monotonic() - start < 8
    # each was cut off; those whose reply outran the reset got a 408
    assert all(reply.startswith(b"HTTP/1.1 408") for reply in answered.values() if reply)
    assert httpx.get(f"{server.url}/v1/status").status_code == 200


def test_a_silent_connection_gets_408(server):
    with _connect(server) as s:
        reply = _until_closed(s)
    assert reply.startswith(b"HTTP/1.1 408") and b'"reason": "timeout"' in reply


@pytest.mark.parametrize("path,content_type", [
    ("/v1/admin/populations", "application/json"),   # a JSON body (read by the guard)
    ("/v1/admin/blobs", "application/octet-stream"),  # a binary body (read by its route)
])
def test_a_stalled_body_gets_408(server, path, content_type):
    with _connect(server) as s:
        s.sendall((f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {server.admin_token}"
                   f"\r\nContent-Type: {content_type}\r\nContent-Length: 1000\r\n\r\n").encode()
                  + b"{" * 10)
        start = time.monotonic()
        reply = _until_closed(s)
    assert reply.split()[1] == b"408" and b"timeout" in reply, reply[:300]
    assert time.monotonic() - start < 8


def test_an_idle_connection_is_closed_after_keep_alive(server):
    with _connect(server) as s:
        s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: x\r\n\r\n")
        start = time.monotonic()
        reply = _until_closed(s)
    assert reply.startswith(b"HTTP/1.1 200") and time.monotonic() - start < 8


def test_more_connections_than_the_limit_get_503(server):
    held = [_connect(server) for _ in range(8)]
    for s in held:
        s.sendall(b"GET /v1/status HTTP/1.1\r\n")  # unfinished: each holds a connection
    time.sleep(0.3)
    try:
        r = httpx.get(f"{server.url}/v1/status", timeout=10)
        assert r.status_code == 503
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    assert httpx.get(f"{server.url}/v1/status", timeout=10).status_code == 200


def test_limits_are_checked():
    with pytest.raises(ValueError, match="header_timeout > 0"):
        serve.Limits(header_timeout=0)
    with pytest.raises(ValueError, match="max_connections >= 1"):
        serve.Limits(max_connections=0)
    with pytest.raises(ValueError, match="stream_report_bytes >= 0"):
        serve.Limits(stream_report_bytes=-1)
    one_sentence_error(fedlang("serve", "--db", ":memory:", "--body-timeout", "-1"), 1,
                       "body_timeout > 0")


# -- sizes: --max-report-bytes, --max-blob-bytes (issue 40, item 4)

_WIDE = 40_000  # float32 elements of each client's value: a report of 160 KB or more


@fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [_WIDE])))
def _wide_total(ds):
    return ds.reduce(np.zeros(_WIDE, np.float32), lambda s, x: s + x)


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [_WIDE]))))
def _wide_sum(data):
    return fl.federated_sum(fl.federated_map(_wide_total, data))


def _open(http, admin, plan, broadcast):
    """(the answer to opening a round of `plan` for population `pop`, its token)."""
    blobs = [http.post("/v1/admin/blobs", content=b, headers=admin).json()["hash"]
             for b in (plan.to_bytes(), broadcast)]
    token = http.post("/v1/admin/populations", json={"name": "pop"}, headers=admin).json()["token"]
    return http.post("/v1/admin/rounds", headers=admin, json={
        "population": "pop", "plan": blobs[0], "broadcast": blobs[1], "target": 1,
        "deadline": 600}), token


def test_a_round_whose_reports_exceed_max_report_bytes_is_refused_when_opened(server_factory):
    server = server_factory(limits=serve.Limits(max_report_bytes=100 << 10))
    bounds = deploy.ReportBounds(ranges={"[0]": (-1e6, 1e6)})  # (no report is sent)
    plan, broadcast = capture(_wide_sum, deploy.client_data("train"), bounds=bounds)
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r, _ = _open(http, bearer(server.admin_token), plan, broadcast)
    assert r.status_code == 400 and r.json()["reason"] == "too_large", r.text
    assert "--max-report-bytes" in r.json()["detail"] and str(100 << 10) in r.json()["detail"]


def test_an_upload_over_the_limit_is_refused_before_its_body_is_read_naming_what_sets_it(
        server_factory, sum_round):
    server = server_factory()
    with httpx.Client(base_url=server.url, timeout=30) as http:
        r, token = _open(http, bearer(server.admin_token), *sum_round)
        round_id = r.json()["id"]
        client = http.post("/v1/populations/pop/enroll", headers=bearer(token)).json()
    with _connect(server) as s:  # declares 10 GB, sends none of it
        s.sendall((f"PUT /v1/rounds/{round_id}/report HTTP/1.1\r\nHost: x\r\n"
                   f"Authorization: Bearer {client['credential']}\r\n"
                   f'Fedlang-Task: {{"round":{round_id},"session":null,"version":null}}\r\n'
                   f"Content-Type: application/octet-stream\r\nContent-Length: {10 ** 10}"
                   "\r\n\r\n").encode())
        reply = _until_closed(s, reset_ok=True)
    assert reply.split()[1] == b"413", reply[:300]
    assert b"what the task's plan lets it hold" in reply and str(10 ** 10).encode() in reply


def test_the_server_limit_is_named_when_it_is_the_smaller():
    state = types.SimpleNamespace(max_report_bytes=1000)
    assert intake.upload_limit(state, 5000) == intake.Limit(
        1000, "fedlang serve --max-report-bytes raises it")
    assert intake.upload_limit(state, 500).most == 500
    assert "--max-report-bytes" in str(intake.upload_limit(state, 5000).refuse("2000 bytes"))


def test_serve_reads_sizes_and_names_a_bad_one():
    assert parse_size("4G", "x") == 4 << 30 and parse_size("1500M", "x") == 1500 << 20
    assert parse_size("512KiB", "x") == 512 << 10 and parse_size("65536", "x") == 65536
    one_sentence_error(fedlang("serve", "--db", ":memory:", "--max-blob-bytes", "lots"), 1,
                       "--max-blob-bytes as a size")
    one_sentence_error(fedlang("serve", "--db", ":memory:", "--max-report-bytes", "1K"), 1,
                       "max_report_bytes >= 64 KiB")
