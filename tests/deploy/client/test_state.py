"""A device's client states: atomic files, and committed only once a report is in."""

import pathlib
import threading
import time

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.deploy.client import state as state_lib

from ..conftest import BATCH, Gated, wait_for

S = fl.TensorType(np.float32, [3])
FAST = {"backoff": (0.02, 0.2)}


@fl.jax_computation()
def _zero():
    return np.zeros(3, np.float32)


@fl.jax_computation(fl.SequenceType(BATCH), S)
def _step(ds, s):
    total = ds.reduce(np.zeros(3, np.float32), lambda a, b: a + b["x"].sum(axis=0))
    return {"total": total, "state": s + total}


@fl.jax_computation(_step.type_signature.result)
def _total(out):
    return out["total"]


@fl.jax_computation(_step.type_signature.result)
def _state(out):
    return out["state"]


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(BATCH)), fl.type_at_clients(S))
def _running_sums(data, states):
    """Each client's state: the sum of every row it ever saw; the round: this round's sum."""
    out = fl.federated_map(_step, fl.federated_zip((data, states)))
    return fl.federated_sum(fl.federated_map(_total, out)), fl.federated_map(_state, out)


running_sums = fl.with_client_state(_running_sums, _zero, parameter="states", result=1)
# the round's sum of a client's rows (ones, or fives: a few rows a round), declared as a
# user would
BOUNDS = deploy.ReportBounds(ranges={"[0]": (-1e3, 1e3)})


def test_states_are_replaced_whole_and_refused_for_another_type(tmp_path):
    states = state_lib.DeviceStates(tmp_path)
    assert states.read("pop", "sums", S) is None
    states.commit("pop", "sums", S, np.array([1, 2, 3], np.float32))
    states.commit("pop", "sums", S, np.array([4, 5, 6], np.float32))
    np.testing.assert_array_equal(states.read("pop", "sums", S), [4, 5, 6])
    assert sorted(p.name for p in (tmp_path / "pop").iterdir()) == ["sums.state"]  # no temp left
    # A crash before os.replace leaves only a temporary file, which is never read.
    (tmp_path / "pop" / ".sums.crashed.tmp").write_bytes(b"half a state")
    np.testing.assert_array_equal(states.read("pop", "sums", S), [4, 5, 6])
    with pytest.raises(state_lib.StateFileError, match="another computation"):
        states.read("pop", "sums", fl.TensorType(np.int32, [3]))
    with pytest.raises(ValueError, match="file name"):
        states.path("pop", "../escape")


def _round(url):
    with httpx.Client(base_url=url, timeout=10) as h:
        rounds = h.get("/v1/status").json()["rounds"]
    return rounds[0] if rounds else None


def test_a_state_is_committed_only_when_its_report_is_accepted(server_factory, client_threads, tmp_path):
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    gates = [Gated([[1, 2, 3]]), Gated([[10, 20, 30]])]
    clients = [deploy.Client(server.url, "pop", token, {"train": g}, state_dir=tmp_path / f"d{i}",
                             **FAST) for i, g in enumerate(gates)]
    errors = [client_threads(c) for c in clients]
    result = {}

    def drive():
        ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=1,
                                        over_selection=1.0, bounds=BOUNDS)
        try:
            with context.with_context(ctx):
                result["value"] = running_sums(deploy.client_data("train"),
                                               deploy.client_state("sums"))
        finally:
            ctx.runner.close()

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        wait_for(lambda: (r := _round(server.url)) and r["assigned"] == 2, "both assigned")
        gates[0].release.set()
        driver.join(timeout=120)
        assert not driver.is_alive()
        np.testing.assert_allclose(result["value"][0], [1, 2, 3])
        wait_for(lambda: clients[0].tasks_done == 1, "the first client's acknowledgement")
        gates[1].release.set()  # too late: the round closed with the first report
        wait_for(lambda: _round(server.url)["late"] == 1, "the late report refused")
    finally:
        for g in gates:
            g.release.set()
        driver.join(timeout=60)
    np.testing.assert_array_equal(clients[0].states.read("pop", "sums", S), [1, 2, 3])
    assert clients[1].states.read("pop", "sums", S) is None  # refused: nothing committed
    assert not (tmp_path / "d1" / "pop").exists() or not any((tmp_path / "d1" / "pop").iterdir())
    assert not any(errors)


class _Failing:
    def __iter__(self):
        yield {"x": np.ones((1, 3), np.float32)}
        raise OSError("the disk went away mid-task")


def test_a_task_that_fails_leaves_the_state_as_it_was(server_factory, tmp_path):
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    states = state_lib.DeviceStates(tmp_path / "device")
    states.commit("pop", "sums", S, np.array([7, 7, 7], np.float32))
    client = deploy.Client(server.url, "pop", token, {"train": _Failing()},
                           state_dir=tmp_path / "device", **FAST)
    errors = []

    def run():
        try:
            client.run()
        except OSError as e:
            errors.append(e)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=1, deadline=3,
                                    bounds=BOUNDS)
    try:
        with context.with_context(ctx), pytest.raises(deploy.RoundFailedError):
            running_sums(deploy.client_data("train"), deploy.client_state("sums"))
    finally:
        ctx.runner.close()
        client.stop()
        t.join(timeout=60)
        client.close()
    assert errors and "mid-task" in str(errors[0])
    np.testing.assert_array_equal(states.read("pop", "sums", S), [7, 7, 7])


def test_a_client_without_a_state_directory_refuses_a_stateful_task(server_factory):
    from fedlang.deploy.plans import execution

    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    client = deploy.Client(server.url, "pop", token, {"train": [{"x": np.ones((1, 3), np.float32)}]})
    from ..conftest import capture

    plan, broadcast = capture(running_sums, deploy.client_data("train"), deploy.client_state("sums"),
                              bounds=BOUNDS)
    with pytest.raises(state_lib.StateFileError, match="--state-dir"):
        client._run_parts(plan, broadcast)
    with pytest.raises(ValueError, match="run_plan_parts"):
        execution.run_plan(plan, broadcast, client.data)
    client.close()


_CLIENT_PROCESS = """
import pathlib, sys, time
import numpy as np
from fedlang import deploy

url, token, state_dir, gate = sys.argv[1:5]


class Waiting:  # the client's data, readable once the test creates `gate`
    def __iter__(self):
        pathlib.Path(gate + ".started").touch()  # the task runs: plan and broadcast fetched
        while not pathlib.Path(gate).exists():
            time.sleep(0.02)
        yield {"x": np.full((2, 3), 5, np.float32)}
        pathlib.Path(gate + ".read").touch()  # the task has read its data


deploy.Client(url, "pop", token, {"train": Waiting()}, state_dir=state_dir, patience=120,
              backoff=(0.05, 0.2)).run()
"""


def test_a_client_killed_before_its_report_is_acknowledged_keeps_its_old_state(
    server_factory, tmp_path
):
    import os
    import signal
    import subprocess
    import sys

    from ..conftest import ROOT

    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    states = state_lib.DeviceStates(tmp_path / "device")
    states.commit("pop", "sums", S, np.array([7, 7, 7], np.float32))
    before = states.path("pop", "sums").read_bytes()
    script, gate = tmp_path / "client.py", tmp_path / "gate"
    script.write_text(_CLIENT_PROCESS)
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    with open(tmp_path / "client.log", "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, str(script), server.url, token, str(tmp_path / "device"), str(gate)],
            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    outcome = {}

    def drive():
        ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=1,
                                        patience=1, backoff=(0.05, 0.2), bounds=BOUNDS)
        try:
            with context.with_context(ctx):
                running_sums(deploy.client_data("train"), deploy.client_state("sums"))
        except Exception as e:  # the server goes away mid-round
            outcome["error"] = e
        finally:
            ctx.runner.close()

    driver = threading.Thread(target=drive)
    driver.start()
    try:
        wait_for(lambda: pathlib.Path(f"{gate}.started").exists(), "the task to start")
        server.stop()  # the report will find no server
        gate.touch()  # the client computes its new state and tries to upload its report
        wait_for(lambda: pathlib.Path(f"{gate}.read").exists(), "the task to read its data")
        time.sleep(1.0)  # its upload finds no server and is retried
        assert proc.poll() is None, (tmp_path / "client.log").read_text()
        os.killpg(proc.pid, signal.SIGKILL)  # killed while retrying the upload
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        driver.join(timeout=60)
    assert not driver.is_alive() and "error" in outcome
    assert "reported" not in (tmp_path / "client.log").read_text()
    assert states.path("pop", "sums").read_bytes() == before  # never acknowledged: unchanged
    assert [p.name for p in (tmp_path / "device" / "pop").iterdir()] == ["sums.state"]
