"""Bulk enrollment over HTTP (`POST /v1/admin/populations/{name}/clients:bulk`), through
`Admin.enroll_bulk` and `fedlang enroll-bulk`, on SQLite and PostgreSQL."""

import io
import json
import os
import stat

import httpx
import pytest

from fedlang import deploy
from fedlang.deploy.driver import admin as admin_lib
from fedlang.deploy.store import bulk

from ...cli._run import fedlang, one_sentence_error
from ..conftest import wait_for
from .conftest import bearer

API = "/v1"


@pytest.fixture
def server(db_url, server_factory):
    return server_factory(db=db_url, admin_token="admin-token")


def test_each_bulk_credential_checks_in_and_the_cap_and_token_are_enforced(server):
    http = httpx.Client(base_url=server.url, timeout=30)
    admin = deploy.Admin(server.url, "admin-token")
    admin.create_population("pop")
    out = io.BytesIO()
    assert admin.enroll_bulk("pop", 7, out, per_call=3) == 7  # three requests
    lines = out.getvalue().splitlines()
    head = json.loads(lines[0])
    assert (head["population"], head["count"], head["server"]) == ("pop", 7, server.url)
    assert head["public_key"] == http.get(f"{API}/status").json()["server"]["public_key"]
    docs = list(admin_lib.read_credentials(io.BytesIO(out.getvalue())))
    assert len(docs) == len({d["client_id"] for d in docs}) == 7
    for doc in docs:
        r = http.post(f"{API}/checkin", headers=bearer(doc["credential"]))
        assert r.status_code == 200 and "retry_after" in r.json(), r.text
    (pop,) = admin.populations()
    assert pop["clients"] == 7

    path = f"{API}/admin/populations/pop/clients:bulk"
    for headers in ({}, bearer("wrong")):  # no admin token: 401 before the body is read
        r = http.post(path, json={"count": 5}, headers=headers)
        assert (r.status_code, r.json()["reason"]) == (401, "unauthorized"), r.text
    for count in (0, bulk.MAX_BULK + 1):
        r = http.post(path, json={"count": count}, headers=bearer("admin-token"))
        assert r.status_code == 422, r.text
    r = http.post(f"{API}/admin/populations/nope/clients:bulk", json={"count": 1},
                  headers=bearer("admin-token"))
    assert r.status_code == 404, r.text
    assert admin.populations()[0]["clients"] == 7
    assert wait_for(lambda: http.get(f"{API}/status").json()["admin_refused"]  # within 1 s
                    == {"unauthorized": 2}, "the refusals counted", 10)
    audited = [(e["path"], e["status"]) for e in admin.audit_log()]
    assert audited.count((path, 201)) == 3 and (path, 422) in audited
    admin.close()
    http.close()


def test_a_bulk_credential_is_a_clients_credential_file(server, tmp_path):
    """A line of the file, as `read_credentials` gives it, is what a `Client` keeps between
    runs: the client runs with it and never enrolls."""
    admin = deploy.Admin(server.url, "admin-token")
    admin.create_population("pop")
    out = io.BytesIO()
    admin.enroll_bulk("pop", 1, out)
    (doc,) = admin_lib.read_credentials(io.BytesIO(out.getvalue()))
    (tmp_path / "cred.json").write_text(json.dumps(doc))
    client = deploy.Client(server.url, "pop", None, {}, credential_file=tmp_path / "cred.json")
    assert client.client_id == doc["client_id"]
    admin.finish_population("pop")
    assert client.run() == 0  # checked in with the credential (no token to enroll with)
    client.close()
    admin.close()


def test_fedlang_enroll_bulk_writes_a_new_private_file(server, tmp_path):
    with deploy.Admin(server.url, "admin-token") as admin:
        admin.create_population("pop")
    out = tmp_path / "creds.ndjson"
    status, stdout, err = fedlang("enroll-bulk", server.url, "pop", 5, "--out", out,
                                  "--admin-token", "admin-token")
    assert status == 0, err
    assert f"enrolled 5 clients of pop; their credentials are in {out}" in stdout
    assert stat.S_IMODE(os.stat(out).st_mode) == 0o600
    with open(out, "rb") as f:
        assert len(list(admin_lib.read_credentials(f))) == 5
    one_sentence_error(fedlang("enroll-bulk", server.url, "pop", 5, "--out", out,
                               "--admin-token", "admin-token"), 1, "to name a new file")
    other = tmp_path / "other.ndjson"
    one_sentence_error(fedlang("enroll-bulk", server.url, "pop", 5, "--out", other,
                               "--admin-token", "wrong"), 1, "admin token")
    assert not other.exists()  # nothing enrolled, no file left
