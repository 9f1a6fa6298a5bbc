"""A large model's reports through `fedlang serve` processes (issue 40): a report larger
than the server may hold is taken (its address space capped below the body's size:
RLIMIT_AS), and `kill -9` of the server while a report is half uploaded loses no
acknowledged report and folds the cut one exactly once after its client sends it again."""

import hashlib
import resource
import threading

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import serialization
from fedlang.deploy.plans import folding
from fedlang.deploy.store import store as store_lib
from fedlang.deploy.store import values

from .conftest import capture

API = "/v1"
pytestmark = pytest.mark.slow


def _sum_of(n):
    @fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [n])))
    def total(ds):
        return ds.reduce(np.zeros(n, np.float32), lambda s, x: s + x)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [n]))))
    def vector_sum(data):
        return fl.federated_sum(fl.federated_map(total, data))

    # the reports fill the sum with 0.5, 1 or 2: declared as a user would
    return capture(vector_sum, deploy.client_data("train"),
                   bounds=deploy.ReportBounds(ranges={"[0]": (-10.0, 10.0)}))


def _report(folder, value, cut=None):
    """The frame of a report whose every element is `value`, made as it is sent (1 MiB
    at a time); `cut(sent)` is called once half of it was made, before the rest."""
    layout = serialization.dense_layout(folder.report_type)
    (n,) = layout.lengths
    block = np.full(1 << 18, value, np.float32).tobytes()

    def tensor():
        for start in range(0, n, len(block)):
            yield block[:min(len(block), n - start)]

    sent = 0
    for part in layout.parts([tensor()]):
        sent += memoryview(part).nbytes
        if cut is not None and sent > layout.size // 2:
            cut()
            cut = None
        yield bytes(part)


def _expected_sha(folder, totals):
    """The SHA-256 of the aggregate whose every element is `totals` (float64)."""
    layout = serialization.dense_layout(folder.aggregate_type)
    (n,) = layout.lengths
    block = np.full(1 << 17, totals, np.float64).tobytes()
    digest = hashlib.sha256()
    for part in layout.parts([(block[:min(len(block), n - s)] for s in range(0, n, len(block)))]):
        digest.update(part)
    return digest.hexdigest()


class _Round:
    """A population, an enrolled client per report, and an open round of `plan`."""

    def __init__(self, server, plan, broadcast, target):
        self.http = httpx.Client(base_url=server.url, timeout=120)
        self.admin = {"Authorization": f"Bearer {server.admin_token}"}
        made = self.http.post(f"{API}/admin/populations", json={"name": "pop"}, headers=self.admin)
        token = made.json()["token"]
        blob = self.http.post(f"{API}/admin/blobs", content=plan.to_bytes(), headers=self.admin)
        sent = self.http.post(f"{API}/admin/blobs", content=broadcast, headers=self.admin)
        assert (blob.status_code, sent.status_code) == (201, 201), sent.text
        self.clients = [
            self.http.post(f"{API}/populations/pop/enroll",
                           headers={"Authorization": f"Bearer {token}"}).json()
            for _ in range(target)]
        r = self.http.post(f"{API}/admin/rounds", headers=self.admin, json={
            "population": "pop", "plan": blob.json()["hash"], "target": target,
            "broadcast": sent.json()["hash"]})
        assert r.status_code == 201, r.text
        self.id = r.json()["id"]
        for client in self.clients:
            assert self.http.post(f"{API}/checkin", headers=self._as(client)).status_code == 200

    @staticmethod
    def _as(client):
        return {"Authorization": f"Bearer {client['credential']}"}

    def put(self, client, body):
        return self.http.put(f"{API}/rounds/{self.id}/report", content=body,
                             headers={**self._as(client), "Fedlang-Task": f'{{"round":{self.id},"session":null,"version":null}}'})

    def state(self, closing=None):
        """The round's state; with `closing` (its report count), once it is no longer
        open (a round of stored reports closes right after the answer to the last)."""
        params = {} if closing is None else {"wait": 60, "seen": closing}
        return self.http.get(f"{API}/admin/rounds/{self.id}", headers=self.admin,
                             params=params).json()


def _aggregate_sha(db, round_id):
    store = store_lib.Store(db)
    try:
        with store.transaction() as tx:
            (value,) = tx.one("SELECT value FROM aggregates WHERE round = ?", (round_id,))
            return values.head(tx, str(value)).sha256
    finally:
        store.close()


def _vm_size(pid):
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))


def test_a_report_larger_than_the_server_may_hold_is_taken(server_process, tmp_path):
    n = 96 << 20  # float32[96 Mi]: a 384 MiB report, a 768 MiB aggregate
    plan, broadcast = _sum_of(n)
    folder = folding.Folder(plan)
    db = tmp_path / "server.db"
    server = server_process(db, extra_args=["--stream-report-bytes", "1M",
                                            "--max-report-bytes", "1G", "--max-blob-bytes", "1G"])
    server.start()
    r = _Round(server, plan, broadcast, target=1)
    try:
        # the server's address space capped at what it has now plus 256 MiB: less than
        # the report, less than its aggregate
        pid = server.proc.pid
        cap = _vm_size(pid) + (256 << 20)
        resource.prlimit(pid, resource.RLIMIT_AS, (cap, cap))
        answer = r.put(r.clients[0], _report(folder, 0.5))
        assert answer.status_code == 200, answer.text
        assert r.state(closing=1)["state"] == "closed"
    finally:
        r.http.close()
    assert server.proc.poll() is None, server.log.read_text()[-3000:]
    assert _aggregate_sha(str(db), r.id) == _expected_sha(folder, 0.5)


def test_kill_9_while_a_report_is_half_uploaded_loses_nothing(server_process, tmp_path):
    n = 16 << 20  # a 64 MiB report
    plan, broadcast = _sum_of(n)
    folder = folding.Folder(plan)
    db = tmp_path / "server.db"
    server = server_process(db, extra_args=["--stream-report-bytes", "1M"])
    server.start()
    r = _Round(server, plan, broadcast, target=2)
    try:
        first, second = r.clients
        assert r.put(first, _report(folder, 1.0)).status_code == 200  # acknowledged
        killed = threading.Event()

        def kill():
            server.kill()
            killed.set()

        with pytest.raises(httpx.TransportError):
            r.put(second, _report(folder, 2.0, cut=kill))
        assert killed.is_set()
        server.start()  # on the same database
        state = r.state()
        assert (state["state"], state["reports"]) == ("open", 1)  # the first kept
        again = r.put(second, _report(folder, 2.0))  # the client sends it again, whole
        assert again.status_code == 200, again.text
        replay = r.put(second, _report(folder, 2.0))  # and once more: nothing changes
        assert replay.status_code == 200, replay.text
        state = r.state(closing=2)
        assert (state["state"], state["reports"]) == ("closed", 2)
    finally:
        r.http.close()
    # the fault-free aggregate: each report folded exactly once
    assert _aggregate_sha(str(db), r.id) == _expected_sha(folder, 3.0)
    store = store_lib.Store(str(db))
    try:  # what the cut upload wrote is staged, for the sweep; nothing else is left
        with store.transaction() as tx:
            assert tx.all("SELECT * FROM stored_reports") == []
            staged = tx.all("SELECT id FROM value_heads WHERE staged IS NOT NULL")
        assert len(staged) <= 1
        store.staged_grace = 0.0
        store.sweep_values()
        with store.transaction() as tx:
            assert tx.all("SELECT id FROM value_heads WHERE staged IS NOT NULL") == []
    finally:
        store.close()
