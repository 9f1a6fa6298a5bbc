"""Fault injection: the server killed (-9) mid-round and restarted on the same database
(SQLite and PostgreSQL), and client processes killed mid-round."""

import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import numpy as np
import pytest

from fedlang import deploy
from fedlang.core import context

from .conftest import ROOT, Gated, batch_sum, run_driver, wait_for


def _round(url, token):
    with httpx.Client(base_url=url, timeout=10) as h:
        try:
            rounds = h.get("/v1/status").json()["rounds"]
        except (httpx.TransportError, ValueError):
            return None
    return rounds[0] if rounds else None


@pytest.mark.slow
def test_a_killed_server_restarts_and_counts_every_report_once(
    db_url, server_process, client_threads
):
    server = server_process(db_url).start()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    n = 6
    gates = [Gated(np.full((2, 3), i + 1)) for i in range(n)]
    clients = [deploy.Client(server.url, "pop", token, {"train": g}, max_tasks=1, patience=120,
                             backoff=(0.05, 0.5)) for g in gates]
    errors = [client_threads(c) for c in clients]
    result = {}

    driver = threading.Thread(target=run_driver, args=(server.url, server.admin_token, result,
                                                       batch_sum), kwargs={"target": n})
    driver.start()
    try:
        wait_for(lambda: (r := _round(server.url, token)) and r["assigned"] == n, "assignments")
        for g in gates[:3]:  # half the clients report before the crash
            g.release.set()
        wait_for(lambda: _round(server.url, token)["reports"] == 3, "three reports")
        server.kill()
        for g in gates[3:]:  # the others finish while the server is down, and retry
            g.release.set()
        time.sleep(0.5)
        server.start()
        driver.join(timeout=180)
        assert not driver.is_alive() and "error" not in result, result
        want = sum(np.full((2, 3), i + 1, np.float32).sum(axis=0) for i in range(n))
        np.testing.assert_allclose(result["value"], want)
        assert result["rounds"][0].reports == n
        # a replayed report after the restart changes nothing
        replay = clients[0]
        with httpx.Client(base_url=server.url, timeout=10) as h:
            status = h.get("/v1/status").json()
            assert status["reports"]["accepted"] == n
            assert status["rounds"][0]["reports"] == n and status["rounds"][0]["state"] == "closed"
            task_round = status["rounds"][0]["id"]
            report = h.put(f"/v1/rounds/{task_round}/report", content=b"x", headers={
                "Authorization": f"Bearer {replay.credential}", "Fedlang-Task": f'{{"round":{task_round},"session":null,"version":null}}'})
            assert report.status_code == 409  # not its report: refused, nothing counted
            assert h.get("/v1/status").json()["reports"]["accepted"] == n
        assert not any(errors)
    finally:
        for g in gates:
            g.release.set()
        driver.join(timeout=60)


def _npz(path, i):
    np.savez(path, x=np.full((3, 3), i + 1, np.float32))
    return path


def _client_process(url, token, data, log):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(log, "ab") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "fedlang", "client", "--server", url, "--population", "pop",
             "--token", token, "--data", f"train={data}", "--batch-size", "2", "--max-tasks", "1",
             "--patience", "60"],
            stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )


@pytest.mark.slow
def test_a_round_closes_at_its_quorum_when_clients_are_killed(tmp_path, server_process):
    server = server_process(tmp_path / "store.db").start()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    n, killed = 10, 3
    stuck = tmp_path / "stuck.npz"  # a FIFO nobody writes: these clients hang in their task
    os.mkfifo(stuck)
    procs = []
    try:
        for i in range(n):
            data = stuck if i < killed else _npz(tmp_path / f"c{i}.npz", i)
            procs.append(_client_process(server.url, token, data, tmp_path / f"client{i}.log"))
        ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=n,
                                        quorum=n - killed, deadline=45)
        done = {}

        def drive():
            with context.with_context(ctx):
                done["value"] = batch_sum(deploy.client_data("train"))

        driver = threading.Thread(target=drive)
        driver.start()
        wait_for(lambda: (r := _round(server.url, token)) and r["assigned"] == n, "assignments")
        for p in procs[:killed]:
            os.killpg(p.pid, signal.SIGKILL)
        driver.join(timeout=180)
        ctx.runner.close()
        assert "value" in done
        want = sum(np.full((3, 3), i + 1, np.float32).sum(axis=0) for i in range(killed, n))
        np.testing.assert_allclose(done["value"], want)
        r = ctx.rounds[0].details
        assert (r["state"], r["reports"], r["dropped"]) == ("closed", n - killed, killed)
    finally:
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)
