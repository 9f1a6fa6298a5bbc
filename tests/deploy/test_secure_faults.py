"""Secure rounds with a real server process and real client processes (`fedlang serve`,
`fedlang client`): results equal the simulation runtime's exactly; clients killed after
sending their keys, their shares or their masked input; too few left; and the server
killed (-9) between stages and in the middle of the masked inputs, restarted on the same
database (SQLite and PostgreSQL). A `Gate` in front of the server holds a stage's
messages, so each fault happens exactly where the test says."""

import os
import signal
import subprocess
import sys
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.deploy.client import data as data_lib
from fedlang.deploy.store import store as store_lib

from .conftest import ROOT, wait_for

ROWS = fl.to_type({"n": fl.TensorType(np.int32, [None])})


@fl.jax_computation(fl.SequenceType(ROWS))
def _ints(ds):
    return ds.reduce(
        {"q": np.int32(0), "r": np.zeros(3, np.int32)},
        lambda st, b: {"q": st["q"] + b["n"].sum(),
                       "r": st["r"] + b["n"].sum() * jnp.arange(1, 4, dtype=np.int32)},
    )


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(ROWS)))
def secure_and_plain(data):
    ints = fl.federated_map(_ints, data)
    return {
        "bits": fl.federated_secure_sum_bitwidth(ints, 8),
        "mod": fl.federated_secure_modular_sum(ints, 11),
        "plain": fl.federated_sum(ints),
    }



class Clients:
    """`fedlang client` processes, each with its own .npz file; killed at the end."""

    def __init__(self, tmp_path, token):
        self.tmp_path, self.token, self.procs, self.files = tmp_path, token, {}, {}

    def start(self, i, url, max_tasks=None):
        path = self.tmp_path / f"c{i}.npz"
        rng = np.random.default_rng(i)
        np.savez(path, n=rng.integers(-20, 60, size=3 + i % 4).astype(np.int32))
        self.files[i] = path
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        args = [sys.executable, "-m", "fedlang", "client", "--server", url, "--population", "pop",
                "--token", self.token, "--data", f"train={path}", "--batch-size", "2",
                "--patience", "120"]
        if max_tasks is not None:
            args += ["--max-tasks", str(max_tasks)]
        with open(self.tmp_path / f"client{i}.log", "ab") as log:
            self.procs[i] = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, env=env,
                                             start_new_session=True)
        return i

    def kill(self, *which):
        for i in which:
            os.killpg(self.procs[i].pid, signal.SIGKILL)
            self.procs[i].wait(timeout=30)

    def expected(self, which):
        """The simulation runtime's result over these clients' data."""
        with fl.runtime.simulation_context():
            return secure_and_plain(
                [list(data_lib.NpzDataset(self.files[i], batch_size=2)) for i in which]
            )

    def close(self):
        for p in self.procs.values():
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
            p.wait(timeout=30)


class Driver:
    """The driver loop on a thread: one secure round of `secure_and_plain`."""

    def __init__(self, server, **options):
        self.result = {}
        # the plain sum of q = sum(n) and r = q * [1, 2, 3], each client's n a few values
        # within [-20, 60): declared as a user would
        options.setdefault("bounds", deploy.ReportBounds(ranges={"[2].q": (-10**4, 10**4),
                                                                 "[2].r": (-10**4, 10**4)}))
        self.ctx = deploy.deployment_context(server.url, server.admin_token, "pop",
                                             patience=120, backoff=(0.05, 0.5), **options)
        self.thread = threading.Thread(target=self._run)
        self.thread.start()

    def _run(self):
        try:
            with context.with_context(self.ctx):
                self.result["value"] = secure_and_plain(deploy.client_data("train"))
        except Exception as e:
            self.result["error"] = e
        finally:
            self.ctx.runner.close()

    def join(self):
        self.thread.join(timeout=240)
        assert not self.thread.is_alive()
        return self.result


def _assert_equal(got, want):
    for k in ("bits", "mod", "plain"):
        for name in ("q", "r"):
            np.testing.assert_array_equal(got[k][name], want[k][name])


def _enrolled(admin, n):
    return wait_for(lambda: admin.populations()[0]["clients"] >= n, f"{n} enrollments")


@pytest.mark.slow
def test_secure_rounds_on_client_processes_equal_the_simulation_and_survive_killed_clients(
    tmp_path, server_process, gates
):
    # About 90 s: five rounds of five or six clients; four wait out a stage timeout.
    server = server_process(tmp_path / "store.db", min_retry=0.1).start()
    admin = deploy.Admin(server.url, server.admin_token)
    clients = Clients(tmp_path, admin.create_population("pop"))
    options = {"target": 5, "quorum": 3, "deadline": 150, "stage_timeout": 8}
    try:
        stay = [clients.start(i, server.url) for i in range(3)]  # in every round
        # No dropouts: the results equal the simulation runtime's exactly.
        extra = [clients.start(i, server.url, max_tasks=1) for i in (3, 4)]
        _enrolled(admin, 5)
        done = Driver(server, **options).join()
        assert "error" not in done, done
        _assert_equal(done["value"], clients.expected(stay + extra))
        n = 5
        # Two clients killed before they send their shares, their masked inputs, or
        # their unmasking shares: the sum is the survivors' (with the masked inputs that
        # arrived).
        for stage in (2, 3, 4):
            gate = gates(server.url)
            gate.drop(stage)
            victims = [clients.start(i, gate.url) for i in (n, n + 1)]
            n += 2
            _enrolled(admin, n)
            driver = Driver(server, **options)
            wait_for(lambda g=gate, s=stage: g.waiting[s] == 2, f"the victims at stage {stage}")
            clients.kill(*victims)
            done = driver.join()
            assert "error" not in done, done
            in_sum = stay + victims if stage == 4 else stay
            _assert_equal(done["value"], clients.expected(in_sum))
            r = driver.ctx.rounds[0].details
            # the two victims dropped out, at stage 4 with their inputs in the sum
            assert (r["state"], r["reports"], r["dropped"]) == ("closed", len(in_sum), 2)
        # Three of six killed before sending their shares: fewer than the threshold (4)
        # are left, and the round fails before any share is asked for.
        gate = gates(server.url)
        gate.drop(2)
        victims = [clients.start(i, gate.url) for i in (n, n + 1, n + 2)]
        _enrolled(admin, n + 3)
        driver = Driver(server, **{**options, "target": 6})
        wait_for(lambda: gate.waiting[2] == 3, "the victims at stage 2")
        clients.kill(*victims)
        done = driver.join()
        assert isinstance(done.get("error"), deploy.RoundFailedError), done
        assert "Expected at least 4 clients to share their keys" in str(done["error"])
        status = admin.status()
        failed = status["rounds"][0]
        assert (failed["state"], status["rounds_closed"]) == ("failed", 4)
        store = store_lib.Store(tmp_path / "store.db")
        try:  # no share was asked for: no masked input, no unmasking request
            with store.transaction() as tx:
                assert tx.one("SELECT MAX(stage) FROM reports WHERE round = ?",
                              (failed["id"],))[0] == 2
                assert tx.all("SELECT * FROM secure_requests WHERE round = ?",
                              (failed["id"],)) == []
        finally:
            store.close()
    finally:
        clients.close()
        admin.close()


@pytest.mark.slow
def test_a_server_killed_between_stages_and_amid_masked_inputs_continues_the_round(
    db_url, tmp_path, server_process, gates
):
    # About 40 s per database: five client processes, the server killed twice.
    server = server_process(db_url, min_retry=0.1).start()
    admin = deploy.Admin(server.url, server.admin_token, patience=120)
    clients = Clients(tmp_path, admin.create_population("pop"))
    gate = gates(server.url)
    gate.hold(2)
    gate.hold(3)
    try:
        which = [clients.start(i, gate.url, max_tasks=1) for i in range(5)]
        _enrolled(admin, 5)
        driver = Driver(server, target=5, deadline=200, stage_timeout=60)
        # Between stages: every key is in, stage 2 is open and none of its messages arrived.
        wait_for(lambda: gate.waiting[2] == 5, "five share messages")
        assert admin.status()["rounds"][0]["stage"] == 2
        server.kill()
        gate.release(2)  # they meet a dead server (502) and retry
        time.sleep(0.5)
        server.start()
        # In the middle of the masked inputs: two are in when the server dies.
        wait_for(lambda: gate.waiting[3] == 5, "five masked inputs")
        gate.release(3, 2)
        wait_for(lambda: admin.status()["rounds"][0]["reports"] == 2, "two masked inputs")
        server.kill()
        gate.release(3)
        time.sleep(0.5)
        server.start()
        done = driver.join()
        assert "error" not in done, done
        _assert_equal(done["value"], clients.expected(which))
        status = admin.status()
        r = status["rounds"][0]
        assert (r["state"], r["stage"], r["reports"], r["dropped"]) == ("closed", 5, 5, 0)
        assert status["reports"]["accepted"] == 5  # each masked input counted once
        for i in which:
            clients.procs[i].wait(timeout=60)  # each client finished its one task
    finally:
        clients.close()
        admin.close()
