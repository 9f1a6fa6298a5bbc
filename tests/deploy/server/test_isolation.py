"""Populations are isolated (issue 23, item 4): a client reads only the blobs a task of
its own population names, and `/v1/status` without the admin token names no plan or
blob. On SQLite and PostgreSQL, over HTTP."""

import httpx
import pytest

from .conftest import bearer
from .test_rounds import API, Setup
from .test_sessions import Session, weights


@pytest.fixture
def server(server_factory, db_url):
    return server_factory(db=db_url)


def _other_client(http, admin):
    token = http.post(f"{API}/admin/populations", json={"name": "other"}, headers=admin).json()["token"]
    r = http.post(f"{API}/populations/other/enroll", headers=bearer(token))
    assert r.status_code == 201, r.text
    return r.json()


def test_a_client_of_another_population_reads_no_blob_of_a_round(server, sum_round):
    s = Setup(server, sum_round)
    try:
        other = _other_client(s.http, s.admin)
        own = s.clients[0]
        task = s.checkin(own)["task"]
        for h in (task["plan"], task["broadcast"]):
            assert s.http.get(f"{API}/blobs/{h}", headers=bearer(own["credential"])).status_code == 200
            assert s.http.get(f"{API}/blobs/{h}", headers=s.admin).status_code == 200
            r = s.http.get(f"{API}/blobs/{h}", headers=bearer(other["credential"]))
            assert (r.status_code, r.json()["reason"]) == (404, "not_found")
            assert "population 'other'" in r.json()["detail"]
            r = s.http.get(f"{API}/blobs/{h}", headers={**bearer(other["credential"]),
                                                        "If-None-Match": f'"{h}"'})
            assert r.status_code == 404  # not even whether it exists
            assert s.http.get(f"{API}/blobs/{h}").status_code == 401
        # The unsigned plan the admin uploaded is named by no task: only the admin reads it.
        unsigned = s.upload(s.plan.to_bytes())
        assert s.http.get(f"{API}/blobs/{unsigned}", headers=bearer(own["credential"])).status_code == 404
    finally:
        s.http.close()


def test_a_client_of_another_population_reads_no_weights_of_a_session(server):
    s = Session(server)
    try:
        other = _other_client(s.http, s.admin)
        own = s.clients[0]
        s.publish(1, through=0)
        task = s.checkin(own)["task"]
        first = s.upload(weights(0))  # version 0's weights, the same bytes: the same hash
        for h in (task["plan"], task["broadcast"], first):
            assert s.http.get(f"{API}/blobs/{h}", headers=bearer(own["credential"])).status_code == 200
            assert s.http.get(f"{API}/blobs/{h}", headers=bearer(other["credential"])).status_code == 404
    finally:
        s.http.close()


def test_the_public_status_names_no_plan_or_blob(server, sum_round):
    s = Setup(server, sum_round)
    try:
        public = httpx.get(f"{server.url}{API}/status").json()
        assert public["rounds"] and all(r["plan"] is None and r["broadcast"] is None
                                        for r in public["rounds"])
        assert s.round["plan"] not in str(public) and s.round["broadcast"] not in str(public)
        admin = httpx.get(f"{server.url}{API}/status", headers=s.admin).json()
        assert admin["rounds"][0]["plan"] == s.round["plan"]
        assert admin["rounds"][0]["broadcast"] == s.round["broadcast"]
    finally:
        s.http.close()
