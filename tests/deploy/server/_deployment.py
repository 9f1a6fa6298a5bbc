"""A deployment driven over HTTP in the operator's tests (test_ops.py, test_telemetry.py):
a population `pop`, three enrolled clients, rounds of `vector_sum` they report to."""

import httpx
import numpy as np

from fedlang.deploy import protocol
from fedlang.deploy.plans import execution

from .conftest import bearer

API = "/v1"


class Deployment:
    """A server with population `pop`, three enrolled clients and an HTTP client."""

    def __init__(self, server, sum_round):
        self.server, (self.plan, self.broadcast) = server, sum_round
        self.http = httpx.Client(base_url=server.url, timeout=30)
        self.admin = bearer(server.admin_token)
        self.token = self.post("/admin/populations", json={"name": "pop"})["token"]
        self.clients = [
            self.http.post(f"{API}/populations/pop/enroll", headers=bearer(self.token)).json()
            for _ in range(3)
        ]

    def post(self, path, status=(200, 201), **kwargs):
        r = self.http.post(API + path, headers=self.admin, **kwargs)
        assert r.status_code in status, r.text
        return r.json()

    def get(self, path, **kwargs):
        r = self.http.get(API + path, headers=self.admin, **kwargs)
        assert r.status_code == 200, r.text
        return r.json()

    def open_round(self, target=2, **options):
        def blob(data):
            return self.http.post(f"{API}/admin/blobs", content=data, headers=self.admin).json()["hash"]

        return self.post("/admin/rounds", json={
            "population": "pop", "plan": blob(self.plan.to_bytes()),
            "broadcast": blob(self.broadcast), "target": target, "deadline": 600, **options,
        })

    def checkin(self, client):
        return self.http.post(f"{API}/checkin", headers=bearer(client["credential"])).json()

    def report(self, client, round_id, value=1.0):
        data = execution.run_plan(self.plan, self.broadcast,
                                  {"train": [np.full(3, value, np.float32)]})
        return self.http.put(f"{API}/rounds/{round_id}/report", content=data,
                             headers={**bearer(client["credential"]),
                                      **protocol.task_header({"round": round_id})})

    def close(self):
        self.http.close()
