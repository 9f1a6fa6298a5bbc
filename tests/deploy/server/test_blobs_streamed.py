"""Blobs and aggregates streamed (issue 40): an upload is written to the store a chunk at
a time and appears only whole, a download is read from it a chunk at a time, whole or in
ranges (206, 416), on both databases (servers in this process); and a real `fedlang
serve` holds neither an upload nor a download whole (its peak memory)."""

import contextlib
import hashlib
import json
import os
import socket
import time

import httpx
import pytest

from fedlang import deploy
from fedlang.deploy import protocol
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import values

from ..conftest import wait_for
from .conftest import bearer

API = "/v1"
SIZE = 2 * values.CHUNK + 12345  # three chunks, the last one short
LIMIT = 3 * values.CHUNK


@pytest.fixture
def served(server_factory, db_url):
    """A server in this process on each database (blobs up to `LIMIT` bytes), and an
    HTTP client with its admin token."""
    server = server_factory(db=db_url, limits=deploy.Limits(max_blob_bytes=LIMIT))
    with httpx.Client(base_url=server.url, timeout=60,
                      headers=bearer(server.admin_token)) as http:
        yield server, http


def counts(server):
    """(chunk rows, value heads) in the server's store."""
    with server.store.transaction() as tx:
        return (tx.one("SELECT COUNT(*) FROM value_chunks")[0],
                tx.one("SELECT COUNT(*) FROM value_heads")[0])


def upload(http, content):
    r = http.post(f"{API}/admin/blobs", content=content,
                  headers={"Content-Type": protocol.BINARY})
    assert r.status_code == 201, r.text
    return r.json()


def test_a_blob_of_several_chunks_round_trips_byte_exact(served):
    server, http = served
    data = os.urandom(SIZE)
    h = protocol.blob_hash(data)
    assert upload(http, data) == {"hash": h, "size": SIZE}  # with its Content-Length
    assert counts(server) == (3, 1)
    pieces = (data[i : i + 65536] for i in range(0, SIZE, 65536))
    assert upload(http, pieces) == {"hash": h, "size": SIZE}  # chunked: no length
    assert counts(server) == (3, 1)  # the same blob: stored once
    r = http.get(f"{API}/blobs/{h}")
    assert r.status_code == 200 and r.content == data
    assert (r.headers["content-length"], r.headers["etag"], r.headers["accept-ranges"]) == (
        str(SIZE), f'"{h}"', "bytes")
    assert "immutable" in r.headers["cache-control"]
    assert http.get(f"{API}/blobs/{h}", headers={"If-None-Match": f'"{h}"'}).status_code == 304


def _round_naming(server, population, plan, broadcast, aggregate=b""):
    """A round of `population` naming blobs `plan` and `broadcast`, opened in the store."""
    return server.app_state.rounds.create(population, plan, broadcast,
                                          rounds_lib.CohortOptions(1), aggregate)


def test_ranges_of_a_blob_resume_a_download_for_the_admin_an_edge_and_a_client(served):
    server, http = served
    data = os.urandom(SIZE)
    h = upload(http, data)["hash"]
    token = http.post(f"{API}/admin/populations", json={"name": "pop"}).json()["token"]
    credential = httpx.post(f"{server.url}{API}/populations/pop/enroll",
                            headers=bearer(token)).json()["credential"]
    edge = http.post(f"{API}/admin/edges", json={"name": "east", "population": "pop"}).json()
    _round_naming(server, "pop", upload(http, b"plan")["hash"], h)
    readers = {"admin": (f"{API}/blobs/{h}", bearer(server.admin_token)),
               "client": (f"{API}/blobs/{h}", bearer(credential)),
               "edge": (f"{API}/edge/blobs/{h}", bearer(edge["token"]))}
    cut = values.CHUNK - 5
    for who, (path, auth) in readers.items():
        def get(byte_range, path=path, auth=auth, **headers):
            return httpx.get(server.url + path, headers={**auth, "Range": byte_range, **headers})

        for byte_range, start, stop in [
            (f"bytes={cut}-", cut, SIZE),  # a download cut off, resumed
            (f"bytes={cut}-{cut + 10}", cut, cut + 11),  # across two chunks
            ("bytes=0-0", 0, 1),
            ("bytes=-7", SIZE - 7, SIZE),  # the last 7 bytes
            (f"bytes=100-{SIZE + 99}", 100, SIZE),  # past the end: up to it
        ]:
            r = get(byte_range)
            assert r.status_code == 206, (who, byte_range, r.text)
            assert r.content == data[start:stop], (who, byte_range)
            assert r.headers["content-range"] == f"bytes {start}-{stop - 1}/{SIZE}"
            assert r.headers["content-length"] == str(stop - start)
        r = get(f"bytes={SIZE}-")
        assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{SIZE}", who
        assert r.json()["reason"] == "range" and "bytes=" in r.json()["detail"]
        assert get("bytes=5-2").content == data  # not a range: ignored, the whole
        assert get("bytes=0-9,20-29").content == data  # several ranges: the whole
        assert get("bytes=10-", **{"If-Range": '"another"'}).content == data  # changed since
        assert get("bytes=10-", **{"If-Range": f'"{h}"'}).content == data[10:]
    other = http.post(f"{API}/admin/populations", json={"name": "other"}).json()["token"]
    stranger = httpx.post(f"{server.url}{API}/populations/other/enroll",
                          headers=bearer(other)).json()["credential"]
    r = httpx.get(f"{server.url}{API}/blobs/{h}", headers={**bearer(stranger), "Range": "bytes=0-"})
    assert r.status_code == 404  # a blob no task of its population names, as before


def _closed_round(server, aggregate):
    """A round closed with one report: `aggregate` is what it holds."""
    rounds = server.app_state.rounds
    blob = server.store.put_blob(b"plan")
    r = _round_naming(server, "pop", blob, blob, aggregate)
    with server.store.transaction(write=True) as tx:
        rounds_lib.fold_report(tx, r.id, "c-1", lambda a: a, server.store.clock())
    rounds.close_if_done(r.id)
    assert rounds.round(r.id).state == "closed"
    return r.id


def test_an_aggregate_is_streamed_in_ranges_and_gone_once_swept(served):
    server, http = served
    http.post(f"{API}/admin/populations", json={"name": "pop"})
    data = os.urandom(SIZE)
    first = _closed_round(server, data)
    path = f"{API}/admin/rounds/{first}/aggregate"
    r = http.get(path)
    assert r.status_code == 200 and r.content == data
    etag = f'"{hashlib.sha256(data).hexdigest()}"'
    assert (r.headers["content-length"], r.headers["etag"], r.headers["accept-ranges"]) == (
        str(SIZE), etag, "bytes")
    r = http.get(path, headers={"Range": f"bytes={values.CHUNK}-"})
    assert (r.status_code, r.content) == (206, data[values.CHUNK :])
    assert r.headers["content-range"] == f"bytes {values.CHUNK}-{SIZE - 1}/{SIZE}"
    r = http.get(path, headers={"Range": "bytes=10-19", "If-Range": etag})
    assert (r.status_code, r.content) == (206, data[10:20])
    r = http.get(path, headers={"Range": f"bytes={SIZE + 1}-"})
    assert r.status_code == 416 and r.headers["content-range"] == f"bytes */{SIZE}"
    for _ in range(rounds_lib.KEPT_AGGREGATES):  # later rounds closed: its turn to go
        _closed_round(server, b"later")
    server.app_state.rounds.sweep()
    r = http.get(path)
    assert (r.status_code, r.json()["reason"]) == (410, "deleted")
    assert f"latest {rounds_lib.KEPT_AGGREGATES} closed rounds" in r.json()["detail"]


def _send(server, head, body=b"", hold=False):
    """Sends `head` (and `body`) on a new connection; the answer's status and JSON (or,
    with `hold`, the open socket)."""
    s = socket.create_connection(("127.0.0.1", int(server.url.rsplit(":", 1)[1])), timeout=30)
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # answered before the end
        s.sendall(head.encode() + body)
    if hold:
        return s
    with s:
        answer = b""
        while not _whole(answer) and (part := s.recv(65536)):
            answer += part
    head_part, _, payload = answer.partition(b"\r\n\r\n")
    return int(head_part.split()[1]), json.loads(payload)


def _whole(answer):
    head, found, payload = answer.partition(b"\r\n\r\n")
    lengths = [int(line.split(b":")[1]) for line in head.split(b"\r\n")
               if line.lower().startswith(b"content-length:")]
    return bool(found) and bool(lengths) and len(payload) >= lengths[0]


def _blob_post(server, length=None):
    lines = ["POST /v1/admin/blobs HTTP/1.1", "Host: 127.0.0.1",
             f"Authorization: Bearer {server.admin_token}",
             "Content-Type: application/octet-stream",
             f"Content-Length: {length}" if length is not None else "Transfer-Encoding: chunked"]
    return "\r\n".join(lines) + "\r\n\r\n"


def test_a_blob_above_the_limit_is_refused_before_its_body_naming_the_flag(served):
    server, _ = served
    status, answer = _send(server, _blob_post(server, 300_000_000))  # no byte of it sent
    assert (status, answer["reason"]) == (413, "too_large")
    assert answer["detail"] == (f"Expected a blob of at most {LIMIT} bytes (fedlang serve "
                                "--max-blob-bytes), found 300000000.")
    piece = b"x" * 65536
    body = b"".join(b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range(LIMIT // 65536 + 2))
    status, answer = _send(server, _blob_post(server), body)  # no length: as it streams
    assert (status, answer["reason"]) == (413, "too_large")
    assert f"at most {LIMIT} bytes (fedlang serve --max-blob-bytes), found at least" in (
        answer["detail"])
    wait_for(lambda: counts(server) == (0, 0), "the refused upload's chunks to be deleted", 30)


def test_an_upload_cut_off_leaves_no_blob_and_no_chunk(served):
    server, http = served
    data = os.urandom(SIZE)
    s = _send(server, _blob_post(server, SIZE), data[: values.CHUNK + 1000], hold=True)
    with s:
        wait_for(lambda: counts(server)[0] == 1, "the upload's first chunk, staged", 30)
        assert not server.store.has_blob(protocol.blob_hash(data))
    wait_for(lambda: counts(server) == (0, 0), "the cut upload's chunks to be deleted", 30)
    assert http.get(f"{API}/blobs/{protocol.blob_hash(data)}").status_code == 404
    assert upload(http, data)["hash"] == protocol.blob_hash(data)  # sent again: whole


# -- a real server process holds no value whole


def _peak_rss(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) << 10 for line in f if line.startswith("VmHWM:"))


@pytest.mark.slow
def test_the_server_never_holds_a_large_blob_whole(tmp_path, server_process):
    server = server_process(tmp_path / "server.db").start()
    size, piece = 300_000_000, 1 << 20
    block = os.urandom(piece)
    sent = hashlib.sha256()

    def body():
        for i in range(0, size, piece):  # each piece its own bytes: its offset first
            part = i.to_bytes(8, "little") + block[8 : min(piece, size - i)]
            sent.update(part)
            yield part

    admin = bearer(server.admin_token)
    before = _peak_rss(server.proc.pid)
    with httpx.Client(base_url=server.url, timeout=300, headers=admin) as http:
        r = http.post(f"{API}/admin/blobs", content=body(),
                      headers={"Content-Type": protocol.BINARY, "Content-Length": str(size)})
        assert r.status_code == 201, r.text
        h = r.json()["hash"]
        assert h == sent.hexdigest()
        after_upload = _peak_rss(server.proc.pid)
        got, start = hashlib.sha256(), time.monotonic()
        with http.stream("GET", f"{API}/blobs/{h}") as r:
            assert r.headers["content-length"] == str(size)
            for part in r.iter_bytes():
                got.update(part)
        assert got.hexdigest() == h, f"downloaded in {time.monotonic() - start:.1f} s"
        with http.stream("GET", f"{API}/blobs/{h}", headers={"Range": f"bytes={size - 10}-"}) as r:
            assert r.status_code == 206 and len(r.read()) == 10
    after_download = _peak_rss(server.proc.pid)
    grown = after_download - before
    assert grown < size // 4, (
        f"the server's peak memory grew by {grown >> 20} MiB (upload: "
        f"{(after_upload - before) >> 20} MiB) for a blob of {size >> 20} MiB")
    with contextlib.suppress(Exception):
        server.stop()
