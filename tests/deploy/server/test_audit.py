"""The audit log (issue 23): every request made with the admin token that may change
something is recorded with its answer's status; a stranger's admin request is refused
and counted, not logged (so strangers cannot fill the log). On SQLite and PostgreSQL."""

import httpx
import pytest

from ..conftest import wait_for
from .conftest import bearer

API = "/v1"


@pytest.fixture
def server(server_factory, db_url):
    return server_factory(db=db_url)


def test_admin_actions_are_audited(server):
    http = httpx.Client(base_url=server.url, timeout=30)
    admin = bearer(server.admin_token)
    token = http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=admin).json()["token"]
    assert http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=admin).status_code == 409
    client = http.post(f"{API}/populations/pop/enroll", headers=bearer(token)).json()
    assert http.delete(f"{API}/admin/clients/{client['client_id']}", headers=admin).status_code == 200
    assert http.post(f"{API}/admin/populations", content=b"x" * 100_000, headers=admin).status_code == 413
    http.get(f"{API}/admin/populations", headers=admin)  # reads are not logged
    for stranger in ({}, bearer("wrong"), bearer(client["credential"])):
        assert http.post(f"{API}/admin/populations", json={"name": "x"}, headers=stranger).status_code == 401
    log = http.get(f"{API}/admin/audit", headers=admin).json()
    assert [(e["seq"], e["method"], e["path"], e["status"]) for e in log] == [
        (1, "POST", f"{API}/admin/populations", 201),
        (2, "POST", f"{API}/admin/populations", 409),
        (3, "DELETE", f"{API}/admin/clients/{client['client_id']}", 200),
        (4, "POST", f"{API}/admin/populations", 413),
    ]
    assert all(e["remote"].startswith("127.0.0.1:") for e in log)
    assert http.get(f"{API}/admin/audit", params={"after": 3}, headers=admin).json() == log[3:]
    assert wait_for(lambda: http.get(f"{API}/status").json()["admin_refused"], "counted", 10)
    status = http.get(f"{API}/status").json()  # (written within a second)
    assert status["admin_refused"] == {"unauthorized": 3}  # not reports (issue 37, item 9)
    assert "admin_unauthorized" not in status["reports"]["refused"]
    assert http.get(f"{API}/admin/audit").status_code == 401
    http.close()
