"""Fault injection in a buffered (FedBuff) session: the server, with its driver, killed
(-9) mid-buffer and restarted on the same database (SQLite and PostgreSQL). No accepted
report is lost or counted twice: the restarted driver folds again exactly the reports
stored since the last published version."""

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import httpx
import jax
import numpy as np
import pytest

from fedlang import deploy
from fedlang.core import serialization
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib

from .conftest import ROOT, _free_port, wait_for

EXAMPLE = ROOT / "examples" / "deploy_fedbuff.py"
K, STEPS = 3, 4


class SlowList:
    """A client's batches, given after a random delay (clients report at different times)."""

    def __init__(self, batches, seed):
        self.batches, self.rng = batches, random.Random(seed)

    def __iter__(self):
        time.sleep(self.rng.uniform(0.05, 0.6))
        yield from self.batches


def _example():
    sys.path.insert(0, str(ROOT / "examples"))
    import deploy_fedbuff

    return deploy_fedbuff


def _status(url):
    with contextlib.suppress(httpx.TransportError, ValueError, IndexError):
        return httpx.get(f"{url}/v1/status", timeout=5).json()["sessions"][0]
    return None



class ServeProcess:
    """`deploy_fedbuff.py serve`: the server and the driver in one process."""

    def __init__(self, db, tmp_path):
        self.db, self.port, self.tmp = str(db), _free_port(), tmp_path
        self.url = f"http://127.0.0.1:{self.port}"
        self.log, self.out = tmp_path / "serve.log", tmp_path / "result.json"
        self.proc = None

    def start(self):
        env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, str(EXAMPLE), "serve", "--db", self.db, "--port",
                 str(self.port), "--admin-token", "admin", "--steps", str(STEPS),
                 "--buffer-size", str(K), "--max-staleness", "2", "--out", str(self.out),
                 "--key-file", str(self.tmp / "signing.key")],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )
        return self

    def kill(self):
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_killed_server_and_driver_lose_no_accepted_report(db_url, tmp_path, client_threads):
    ex = _example()
    clients, _ = ex.deploy_digits.partition(10)
    served = ServeProcess(db_url if "://" in db_url and not db_url.startswith("sqlite")
                          else db_url.removeprefix("sqlite:///"), tmp_path).start()
    try:
        token = wait_for(lambda: re.search(r"population digits token: (\S+)",
                                            served.log.read_text()), "the token", 180)[1]
        for i, c in enumerate(clients[:6]):
            batches = [{"x": c["x"][j:j + 20], "y": c["y"][j:j + 20]}
                       for j in range(0, len(c["y"]), 20)]
            client_threads(deploy.Client(served.url, "digits", token,
                                         {"train": SlowList(batches, i)}, patience=180,
                                         backoff=(0.05, 0.5)))
        # kill -9 mid-buffer: a version published and reports waiting in the next buffer
        wait_for(lambda: (s := _status(served.url)) and s["version"] >= 1
                  and s["buffer_fill"] >= 1, "a buffer being filled", 180)
        served.kill()
        st = store_lib.Store(db_url)
        s = sessions_lib.Sessions(st).sessions()[0]
        assert s.pending >= 1  # accepted reports that no published version holds yet
        version, applied = s.version, s.applied_through
        st.close()
        time.sleep(0.5)  # clients retry while the server is down
        served.start()
        wait_for(lambda: served.proc.poll() is not None, "the driver's last step", 600)
        log = served.log.read_text()
        assert served.proc.returncode == 0, log
        assert f"resumed at version {version} after report {applied};" in log, log
        assert json.loads(served.out.read_text())["version"] == STEPS
    finally:
        served.kill()

    # assert: the published state holds every applied report once, as a replay shows
    process = ex.build_process(K, 2)
    st = store_lib.Store(db_url)
    sessions = sessions_lib.Sessions(st)
    s = sessions.sessions()[0]
    published = serialization.deserialize_value(st.get_blob(s.server_state))
    reports = sessions.reports(s.id, 0)
    st.close()
    assert [r.seq for r in reports] == list(range(1, s.reports + 1))
    assert process.status(published)["accepted"] == s.applied_through == K * STEPS
    state = process.initialize()
    for r in reports[: s.applied_through]:
        report = serialization.deserialize_value(r.data, expected_type=process.report_type)
        state = process.fold(state, report, r.version)
        if process.is_full(state):
            state, _ = process.apply(state)
    assert process.status(state) == process.status(published)
    for a, b in zip(jax.tree.leaves(process.get_model_weights(state)),
                    jax.tree.leaves(process.get_model_weights(published)), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
