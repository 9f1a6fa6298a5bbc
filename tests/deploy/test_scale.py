"""Several `fedlang serve` processes on one PostgreSQL database: one round's reports
taken by two processes at once (the result is the reference runtime's), check-ins to
both assigned exactly, and `kill -9` of one process mid-round losing no acknowledged
report."""

import concurrent.futures
import threading

import httpx
import numpy as np
import pytest

from fedlang import deploy
from fedlang.core import context
from fedlang.deploy.plans import execution, folding
from fedlang.runtime import ReferenceContext

from .conftest import vector_sum

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)]


def two_servers(server_process, db_url):
    """Two processes on one database (the first makes the signing key, the second reads it)."""
    return server_process(db_url).start(), server_process(db_url).start()


def open_round(server, sum_round, n, target=None, **options):
    """A population of `n` enrolled clients and a round of `vector_sum`: (round id,
    credentials)."""
    plan, broadcast = sum_round
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
        created = admin.create_round("pop", admin.put_blob(plan.to_bytes()),
                                     admin.put_blob(broadcast), target=target or n,
                                     deadline=600, **options)
    with httpx.Client(base_url=server.url, timeout=30) as h:
        creds = [h.post("/v1/populations/pop/enroll",
                        headers={"Authorization": f"Bearer {token}"}).json()["credential"]
                 for _ in range(n)]
    return created["id"], creds


def checkin(url, cred):
    with httpx.Client(base_url=url, timeout=30) as h:
        r = h.post("/v1/checkin", headers={"Authorization": f"Bearer {cred}"})
        r.raise_for_status()
        return r.json()["task"]


def upload(url, round_id, cred, body):
    with httpx.Client(base_url=url, timeout=30) as h:
        return h.put(f"/v1/rounds/{round_id}/report", content=body,
                     headers={"Authorization": f"Bearer {cred}",
                              "Fedlang-Task": f'{{"round":{round_id},"session":null,"version":null}}'})


def rows(i):
    return np.array([i + 1, 2 * i, -i], np.float32)


def result(server, sum_round, round_id):
    with deploy.Admin(server.url, server.admin_token) as admin:
        r = admin.round(round_id, wait=30)
        assert r["state"] == "closed", r
        return r, folding.Folder(sum_round[0]).results(admin.aggregate(round_id))[0]


def reference(n):
    with context.with_context(ReferenceContext()):
        return vector_sum([[rows(i)] for i in range(n)])


def test_two_processes_take_one_rounds_reports_and_agree_with_the_reference(
    db_url, server_process, sum_round
):
    a, b = two_servers(server_process, db_url)
    n = 16
    round_id, creds = open_round(a, sum_round, n)
    servers = [a.url, b.url]
    for i, cred in enumerate(creds):  # check in at one process ...
        assert checkin(servers[i % 2], cred)["round"] == round_id
    bodies = [execution.run_plan(*sum_round, {"train": [rows(i)]}) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # ... upload to the other
        answers = list(pool.map(lambda i: upload(servers[(i + 1) % 2], round_id, creds[i],
                                                 bodies[i]), range(n)))
    assert [r.status_code for r in answers] == [200] * n
    r, value = result(b, sum_round, round_id)
    assert (r["reports"], r["assigned"]) == (n, n)
    np.testing.assert_allclose(value, reference(n))
    np.testing.assert_allclose(value, sum(rows(i) for i in range(n)))
    # a replay to either process changes nothing
    assert upload(a.url, round_id, creds[0], bodies[0]).json()["replay"] is True
    assert result(a, sum_round, round_id)[0]["reports"] == n


def test_concurrent_checkins_at_two_processes_assign_each_client_once_within_capacity(
    db_url, server_process, sum_round
):
    a, b = two_servers(server_process, db_url)
    n, target = 30, 8  # capacity 12
    round_id, creds = open_round(a, sum_round, n, target=target, over_selection=0.5)
    jobs = [(url, cred) for cred in creds for url in (a.url, b.url)]  # each client at both
    with concurrent.futures.ThreadPoolExecutor(16) as pool:
        tasks = list(pool.map(lambda job: checkin(*job), jobs))
    given = {}
    for (_, cred), task in zip(jobs, tasks):
        if task is not None:
            assert task["round"] == round_id
            given.setdefault(cred, 0)
            given[cred] += 1
    with deploy.Admin(a.url, a.admin_token) as admin:
        assigned = admin.round(round_id)["assigned"]
    assert assigned == len(given) == 12  # each client counted once, capacity never passed
    # a client given the task at one process is given the same one at the other
    assert all(count in (1, 2) for count in given.values())
    for cred in list(given)[:3]:
        assert checkin(b.url, cred)["round"] == round_id


def test_kill_9_of_one_process_mid_round_loses_no_acknowledged_report(
    db_url, server_process, sum_round
):
    a, b = two_servers(server_process, db_url)
    n = 12
    round_id, creds = open_round(a, sum_round, n)
    for cred in creds:
        assert checkin(a.url, cred)["round"] == round_id
    bodies = [execution.run_plan(*sum_round, {"train": [rows(i)]}) for i in range(n)]
    acked, lock, enough = set(), threading.Lock(), threading.Event()

    def send(i):
        try:
            if upload(a.url, round_id, creds[i], bodies[i]).status_code == 200:
                with lock:
                    acked.add(i)
                    if len(acked) >= 4:
                        enough.set()
        except httpx.TransportError:
            pass  # in flight when the process died: never acknowledged

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n - 2)]
    for t in threads:
        t.start()
    assert enough.wait(60)
    a.kill()  # mid-round: some reports acknowledged, some in flight, two not sent
    for t in threads:
        t.join(timeout=60)
    with deploy.Admin(b.url, b.admin_token) as admin:
        assert admin.round(round_id)["reports"] >= len(acked)
    for i in sorted(acked):  # every acknowledged report is there: its replay changes nothing
        assert upload(b.url, round_id, creds[i], bodies[i]).json()["replay"] is True
    a.start()  # restarted on the same database; the others report to either process
    for i in range(n):
        if i not in acked:
            assert upload([a.url, b.url][i % 2], round_id, creds[i], bodies[i]).status_code == 200
    r, value = result(a, sum_round, round_id)
    assert r["reports"] == n
    np.testing.assert_allclose(value, reference(n))
