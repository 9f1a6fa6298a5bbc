"""Nothing a stranger sends costs the server more than its headers and a small body
(issue 23, item 1): a tokenless admin request is refused (401) before its body is read,
and the body of every route but the binary uploads is bounded (413). Against a real
`fedlang serve` process, with raw sockets so that the client controls what is sent."""

import contextlib
import json
import socket

import httpx
import numpy as np
import pytest

from fedlang.deploy.server import guard

from ..conftest import ServerProcess

HUGE = 300_000_000  # declared, never sent


@pytest.fixture
def server(tmp_path, server_process):
    return server_process(tmp_path / "server.db").start()


def _rss_kib(proc) -> int:
    with open(f"/proc/{proc.pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def _raw(server: ServerProcess, head: str, body_bytes: int, chunk: int = 1 << 20) -> tuple[int, dict]:
    """Sends `head` then up to `body_bytes` of body (stopping when the server answers or
    closes); returns the status and the JSON answer."""
    host, port = "127.0.0.1", server.port
    with socket.create_connection((host, port), timeout=60) as s:
        s.sendall(head.encode())
        sent, block = 0, b"{" * chunk
        s.setblocking(False)
        answer = b""
        while sent < body_bytes:
            with contextlib.suppress(BlockingIOError):
                answer += s.recv(65536)
            if answer:
                break  # answered before the body was sent
            try:
                sent += s.send(block[: body_bytes - sent])
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
        s.setblocking(True)
        while b"\r\n\r\n" not in answer or not _complete(answer):
            part = s.recv(65536)
            if not part:
                break
            answer += part
    head_part, _, payload = answer.partition(b"\r\n\r\n")
    status = int(head_part.split()[1])
    return status, json.loads(payload.decode()) if payload else {}


def _complete(answer: bytes) -> bool:
    head, _, payload = answer.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(payload) >= int(line.split(b":")[1])
    return False


def _post(path: str, length: int | None, token: str | None = None) -> str:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Content-Type: application/json"]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    lines.append(f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked")
    return "\r\n".join(lines) + "\r\n\r\n"


def test_a_tokenless_admin_request_is_refused_before_its_body(server):
    before = _rss_kib(server.proc)
    # 64 MiB actually sent on a body that declares 300 MB: the answer comes first.
    status, answer = _raw(server, _post("/v1/admin/rounds", HUGE), 64 << 20)
    assert (status, answer["reason"]) == (401, "unauthorized")
    assert "admin token" in answer["detail"]
    assert _rss_kib(server.proc) - before < 32 << 10  # KiB: the body was never held
    assert httpx.get(f"{server.url}/v1/status").status_code == 200


@pytest.mark.parametrize("path", ["/v1/admin/populations", "/v1/admin/sessions"])
def test_a_wrong_token_is_refused_before_the_body_is_parsed(server, path):
    r = httpx.post(f"{server.url}{path}", content=b"not json", headers={"Authorization": "Bearer nope"})
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
    r = httpx.post(f"{server.url}{path}", content=b"not json")
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")  # not 422


def test_an_admin_json_body_over_the_limit_is_refused(server):
    status, answer = _raw(server, _post("/v1/admin/rounds", HUGE, server.admin_token), 8 << 20)
    assert (status, answer["reason"]) == (413, "too_large")
    # Without a declared length, refused as it streams in.
    chunk = b"{" * (guard.JSON_LIMIT // 2)
    chunked = (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 3 + b"0\r\n\r\n"
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(_post("/v1/admin/rounds", None, server.admin_token).encode() + chunked)
        reply = s.recv(65536)
        while not _complete(reply) and (more := s.recv(65536)):
            reply += more
    assert reply.split()[1] == b"413" and b"too_large" in reply


def test_any_other_route_bounds_its_body_too(server):
    # (issue 36) a route that takes no body, or no route, refuses a declared one at once
    for path in ["/v1/checkin", "/v1/no-such-route"]:
        status, answer = _raw(server, _post(path, HUGE), 8 << 20)
        assert (status, answer["reason"]) == (413, "body_not_allowed")
        assert "takes none" in answer["detail"] and str(HUGE) in answer["detail"]
    assert httpx.get(f"{server.url}/v1/status").status_code == 200


def test_admin_routes_still_work_and_binary_uploads_keep_their_own_limit(server):
    admin = {"Authorization": f"Bearer {server.admin_token}"}
    r = httpx.post(f"{server.url}/v1/admin/populations", json={"name": "pop"}, headers=admin)
    assert r.status_code == 201
    blob = np.arange(1 << 16, dtype=np.float32).tobytes()  # 256 KiB: above the JSON limit
    r = httpx.post(f"{server.url}/v1/admin/blobs", content=blob,
                   headers={**admin, "Content-Type": "application/octet-stream"})
    assert r.status_code == 201, r.text
    r = httpx.post(f"{server.url}/v1/admin/blobs", content=blob,
                   headers={"Content-Type": "application/octet-stream"})
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
