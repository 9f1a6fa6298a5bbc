"""`fedlang serve --workers N` on one PostgreSQL database: one port, N worker processes
(src/fedlang/deploy/server/workers.py). A round through two workers equals the
reference runtime's, with reports folded by both; kill -9 of one worker mid-round
loses no acknowledged report and the parent replaces it; SIGTERM stops them all."""

import concurrent.futures
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest

from fedlang import deploy
from fedlang.deploy.plans import execution

from .conftest import wait_for
from .test_scale import checkin, open_round, reference, result, rows, upload

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("db_url", ["postgresql"], indirect=True)]

STARTED = re.compile(r"worker (\d) of (\d) started \(pid (\d+)\)")


def started(server):
    """{worker number: its latest pid}, from the parent's log."""
    return {int(n): int(pid) for n, _, pid in STARTED.findall(server.log.read_text())}


def serve_workers(server_process, db_url, n=2):
    server = server_process(db_url, extra_args=["--workers", str(n)]).start()
    wait_for(lambda: len(started(server)) == n, f"{n} workers", timeout=120)
    return server


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is dead too
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def shards(db_url, round_id):
    """The round's shard rows: {shard: reports} (each server process has its own)."""
    import psycopg

    with psycopg.connect(db_url, autocommit=True) as conn:
        return dict(conn.execute("SELECT shard, reports FROM aggregate_shards WHERE round = %s",
                                 (round_id,)).fetchall())


def test_a_round_through_two_workers_is_folded_by_both_and_equals_the_reference(
    db_url, server_process, sum_round
):
    server = serve_workers(server_process, db_url)
    pids = started(server)
    assert len(set(pids.values())) == 2 and server.proc.pid not in pids.values()
    n = 24
    round_id, creds = open_round(server, sum_round, n)
    for cred in creds:
        assert checkin(server.url, cred)["round"] == round_id
    bodies = [execution.run_plan(*sum_round, {"train": [rows(i)]}) for i in range(n)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:  # all but the last: open still
        answers = list(pool.map(lambda i: upload(server.url, round_id, creds[i], bodies[i]),
                                range(n - 1)))
    assert [r.status_code for r in answers] == [200] * (n - 1)
    folded = shards(db_url, round_id)
    # both workers took reports: each folds into its own shard
    assert len([s for s, count in folded.items() if count > 0]) == 2, folded
    assert sum(folded.values()) == n - 1
    assert upload(server.url, round_id, creds[-1], bodies[-1]).status_code == 200
    r, value = result(server, sum_round, round_id)
    assert (r["reports"], r["assigned"]) == (n, n)
    np.testing.assert_allclose(value, reference(n))


def test_kill_9_of_a_worker_mid_round_loses_no_acknowledged_report_and_it_is_replaced(
    db_url, server_process, sum_round
):
    server = serve_workers(server_process, db_url)
    first = started(server)
    n = 16
    round_id, creds = open_round(server, sum_round, n)
    for cred in creds:
        assert checkin(server.url, cred)["round"] == round_id
    bodies = [execution.run_plan(*sum_round, {"train": [rows(i)]}) for i in range(n)]
    acked, lock, enough = set(), threading.Lock(), threading.Event()

    def send(i):
        try:
            if upload(server.url, round_id, creds[i], bodies[i]).status_code == 200:
                with lock:
                    acked.add(i)
                    if len(acked) >= 4:
                        enough.set()
        except httpx.TransportError:
            pass  # in flight at the killed worker: never acknowledged

    threads = [threading.Thread(target=send, args=(i,)) for i in range(n - 2)]
    for t in threads:
        t.start()
    assert enough.wait(60)
    os.kill(first[1], signal.SIGKILL)  # mid-round: some acknowledged, some in flight
    for t in threads:
        t.join(timeout=60)
    # the parent replaces it: worker 1 again, another pid; worker 2 untouched
    wait_for(lambda: started(server)[1] != first[1], "worker 1 replaced", timeout=120)
    now = started(server)
    assert now[2] == first[2] and alive(now[1]) and alive(now[2])
    assert f"worker 1 of 2 (pid {first[1]}) ended (killed by signal 9)" in server.log.read_text()
    with deploy.Admin(server.url, server.admin_token) as admin:
        assert admin.round(round_id)["reports"] >= len(acked)
    for i in sorted(acked):  # every acknowledged report is there: its replay changes nothing
        assert upload(server.url, round_id, creds[i], bodies[i]).json()["replay"] is True
    for i in range(n):
        if i not in acked:
            assert upload(server.url, round_id, creds[i], bodies[i]).status_code == 200
    r, value = result(server, sum_round, round_id)
    assert r["reports"] == n
    np.testing.assert_allclose(value, reference(n))


def all_end(pids, timeout=30):
    end = time.monotonic() + timeout
    while any(alive(pid) for pid in pids):
        assert time.monotonic() < end, [pid for pid in pids if alive(pid)]
        time.sleep(0.05)


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_stops_the_parent_and_every_worker(db_url, server_process, signum):
    server = serve_workers(server_process, db_url)
    pids = list(started(server).values())
    if signum == signal.SIGINT:  # Ctrl-C in a terminal: the whole process group gets it
        os.killpg(server.proc.pid, signal.SIGINT)
    else:  # SIGTERM: the parent only (a service manager's stop)
        server.proc.send_signal(signal.SIGTERM)
    assert server.proc.wait(timeout=90) == 128 + signum
    all_end(pids)
    label = "Terminated" if signum == signal.SIGTERM else "Interrupted"
    text = " ".join(server.log.read_text().split())
    assert f"{label}: the server stopped; every report it acknowledged is kept in the " \
           "PostgreSQL database" in text
    assert "Traceback" not in text
    with pytest.raises(httpx.TransportError):  # the port is closed
        httpx.get(f"{server.url}/v1/status", timeout=5)


def test_workers_stop_by_themselves_when_their_parent_is_killed(db_url, server_process):
    server = serve_workers(server_process, db_url)
    pids = list(started(server).values())
    os.kill(server.proc.pid, signal.SIGKILL)  # the parent only: no one to restart them
    server.proc.wait(timeout=30)
    all_end(pids)


def test_a_worker_that_cannot_serve_stops_them_all_with_its_error(
    db_url, server_process, tmp_path
):
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate")
    server = server_process(db_url, extra_args=["--workers", "2", "--ssl-certfile", str(bad),
                                                "--ssl-keyfile", str(bad)])
    with pytest.raises(AssertionError):  # it ends before it answers
        server.start()
    assert server.proc.wait(timeout=60) == 1
    text = " ".join(server.log.read_text().split())
    assert "Error: Expected worker" in text and "to start serving, found it ended first" in text
