"""Revoking a client, rotating and capping an enrollment token (issue 23, item 5),
against a real `fedlang serve` process, through the HTTP API and the `fedlang revoke`
and `fedlang rotate-token` commands."""

import httpx
import pytest

from ...cli._run import fedlang, one_sentence_error
from .conftest import bearer

API = "/v1"


@pytest.fixture
def server(tmp_path, server_process):
    return server_process(tmp_path / "server.db").start()


def test_a_capped_token_is_rotated_and_a_client_revoked(server):
    http = httpx.Client(base_url=server.url, timeout=30)
    admin = bearer(server.admin_token)
    r = http.post(f"{API}/admin/populations", json={"name": "pop", "max_enrollments": 1}, headers=admin)
    assert r.status_code == 201, r.text
    token = r.json()["token"]
    first = http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).json()
    r = http.post(f"{API}/populations/pop/enroll", headers=bearer(token))
    assert (r.status_code, r.json()["reason"]) == (403, "enrollment_cap")

    status, out, err = fedlang("rotate-token", server.url, "pop", "--max-enrollments", 2,
                               "--admin-token", server.admin_token)
    assert status == 0, err
    new = out.split(": ")[-1].strip()
    assert http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).status_code == 401
    second = http.post(f"{API}/populations/pop/enroll", headers=bearer(new)).json()
    (pop,) = http.get(f"{API}/admin/populations", headers=admin).json()
    assert (pop["clients"], pop["token_enrollments"], pop["max_enrollments"]) == (2, 1, 2)

    status, out, err = fedlang("revoke", server.url, first["client_id"],
                               "--admin-token", server.admin_token)
    assert status == 0 and f"revoked client {first['client_id']} of population pop" in out, err
    r = http.post(f"{API}/checkin", headers=bearer(first["credential"]))
    assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
    assert http.post(f"{API}/checkin", headers=bearer(second["credential"])).status_code == 200
    one_sentence_error(fedlang("revoke", server.url, first["client_id"], "--admin-token",
                               server.admin_token), 1, "enrolled client's id")
    one_sentence_error(fedlang("revoke", server.url, second["client_id"], "--admin-token",
                               "wrong"), 1, "admin token")
    assert http.post(f"{API}/checkin", headers=bearer(second["credential"])).status_code == 200
    http.close()


def test_device_tokens_enroll_one_device_each(server):
    status, out, err = fedlang("device-tokens", server.url, "pop", "--count", 3,
                               "--admin-token", server.admin_token)
    assert status == 1 and "Expected an existing population" in err  # not made yet
    http = httpx.Client(base_url=server.url, timeout=30)
    http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=bearer(server.admin_token))
    status, out, err = fedlang("device-tokens", server.url, "pop", "--count", 3,
                               "--admin-token", server.admin_token)
    assert status == 0, err
    tokens = out.split()
    assert len(set(tokens)) == 3
    for token in tokens:
        assert http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).status_code == 201
        r = http.post(f"{API}/populations/pop/enroll", headers=bearer(token))
        assert (r.status_code, r.json()["reason"]) == (401, "unauthorized")
    http.close()
