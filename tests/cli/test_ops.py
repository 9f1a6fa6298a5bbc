"""An operator's commands (src/fedlang/cli/ops.py) through the real `fedlang` command
against a real server: listings (full width in a file, `--json` equal to the API),
following a round live, stopping a round and a session."""

import contextlib
import json
import logging
import signal
import subprocess
import sys
import threading

import httpx
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import execution

from ._run import ENV, fedlang, fedlang_all, fedlang_in_terminal

WIDE = "a-population-whose-name-makes-the-row-wider-than-80-columns"


@fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [2])))
def _total(ds):
    return ds.reduce(np.zeros(2, np.float32), lambda s, x: s + x)


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [2]))))
def _vector_sum(data):
    return fl.federated_sum(fl.federated_map(_total, data))


class _Captured(Exception):
    pass


class _Capture:
    def run_round(self, plan, broadcast):
        self.plan, self.broadcast = plan, broadcast
        raise _Captured


class Operated:
    """A server with population WIDE, three clients, and rounds of `_vector_sum`."""

    def __init__(self, server):
        self.server = server
        runner = _Capture()
        # each client reports the sum of its one row of ones: declared as a user would
        bounds = deploy.ReportBounds(ranges={"[0]": (-10.0, 10.0)})
        ctx = deploy.DeploymentContext(runner, bounds=bounds)
        with contextlib.suppress(_Captured), context.with_context(ctx):
            _vector_sum(deploy.client_data("train"))
        self.plan, self.broadcast = runner.plan, runner.broadcast
        self.admin = deploy.Admin(server.url, server.admin_token)
        self.http = httpx.Client(base_url=server.url, timeout=30)
        token = self.admin.create_population(WIDE)
        self.clients = [self.http.post(f"/v1/populations/{WIDE}/enroll",
                                       headers={"Authorization": f"Bearer {token}"}).json()
                        for _ in range(3)]
        self.token_args = ["--admin-token", server.admin_token]

    def open_round(self, target):
        return self.admin.create_round(WIDE, self.admin.put_blob(self.plan.to_bytes()),
                                       self.admin.put_blob(self.broadcast), target=target)

    def _bearer(self, client):
        return {"Authorization": f"Bearer {client['credential']}"}

    def checkin(self, client):
        return self.http.post("/v1/checkin", headers=self._bearer(client)).json()

    def report(self, client, round_id):
        data = execution.run_plan(self.plan, self.broadcast, {"train": [np.ones(2, np.float32)]})
        return self.http.put(f"/v1/rounds/{round_id}/report", content=data,
                             headers={**self._bearer(client), "Fedlang-Task": f'{{"round":{round_id},"session":null,"version":null}}'})


@pytest.fixture
def operated(tmp_path):
    with deploy.Server(db=tmp_path / "server.db", port=0, tick=0.05) as s:
        o = Operated(s)
        yield o
        o.http.close()
        o.admin.close()


def test_listings_keep_their_width_in_a_file_and_print_the_api_as_json(operated):
    o = operated
    r = o.open_round(target=2)
    o.checkin(o.clients[0])
    assert o.report(o.clients[0], r["id"]).status_code == 200
    assert o.report(o.clients[1], r["id"]).status_code == 403  # not assigned
    url = o.server.url
    pops, rounds, sessions, pops_json, rounds_json, other = fedlang_all(
        ["populations", url, *o.token_args], ["rounds", url, *o.token_args],
        ["sessions", url, *o.token_args], ["populations", url, "--json", *o.token_args],
        ["rounds", url, "--json", "--population", WIDE, *o.token_args],
        ["rounds", url, "--json", "--population", "other", *o.token_args],
    )
    for status, _, err in (pops, rounds, sessions, pops_json, rounds_json, other):
        assert status == 0, err
    overview = o.admin.overview()
    assert WIDE in pops[1] and "…" not in pops[1] and "…" not in rounds[1]
    assert json.loads(pops_json[1]) == overview["populations"]
    assert [p["seen_last_hour"] for p in json.loads(pops_json[1])] == [3]
    (row,) = json.loads(rounds_json[1])
    assert (row["reports"], row["target"], row["refused_by_reason"]) == (1, 2, {"not_assigned": 1})
    assert json.loads(other[1]) == []
    assert "1/2" in rounds[1] and "not_assigned 1" in rounds[1]
    assert "Buffered sessions" in sessions[1]
    status, _, err = fedlang("rounds", url, "--admin-token", "wrong")
    assert status == 1 and "Expected the server's admin token" in " ".join(err.split())


def test_follow_prints_a_line_per_change_until_the_round_closes(operated):
    o = operated
    r = o.open_round(target=2)
    follower = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "follow", o.server.url, str(r["id"]), *o.token_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        first = follower.stdout.readline()  # the round as it is
        assert first.startswith(f"round {r['id']} open: 0/2 reports"), first
        for c in o.clients[:2]:
            o.checkin(c)
            assert o.report(c, r["id"]).status_code == 200
        out, err = follower.communicate(timeout=120)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 0, err
    lines = [first.strip(), *out.strip().splitlines()]
    assert lines[-2].startswith(f"round {r['id']} closed: 2/2 reports"), lines
    assert lines[-1].startswith(f"round {r['id']} closed with 2 reports in"), lines
    # every line says something new
    assert len(set(lines)) == len(lines)


def test_follow_is_stopped_by_ctrl_c_and_a_stopped_round_fails_it(operated):
    o = operated
    r = o.open_round(target=3)
    url = o.server.url
    follower = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "follow", url, str(r["id"]), *o.token_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert follower.stdout.readline().startswith(f"round {r['id']} open")
        follower.send_signal(signal.SIGINT)
        _, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 130, err
    assert " ".join(err.split()).startswith(f"Interrupted: stopped following round {r['id']}")
    assert o.admin.round(r["id"])["state"] == "open"  # the round goes on
    # stopped by the operator: a follower ends with status 1 and says why
    o.checkin(o.clients[0])
    follower = subprocess.Popen(
        [sys.executable, "-m", "fedlang", "rounds", url, "--follow", str(r["id"]), *o.token_args],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    try:
        assert follower.stdout.readline().startswith(f"round {r['id']} open")
        status, out, err = fedlang("stop-round", url, str(r["id"]), *o.token_args)
        assert status == 0, err
        assert out.strip() == f"round {r['id']} failed: 0/3 reports, 1 dropped"
        _, err = follower.communicate(timeout=60)
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()
    assert follower.returncode == 1, err
    assert "stopped by the operator" in " ".join(err.split())
    assert o.report(o.clients[0], r["id"]).status_code == 410


WEIGHTS = fl.to_type({"w": fl.TensorType(np.float32, [2])})


@fl.jax_computation(WEIGHTS, fl.SequenceType(fl.TensorType(np.float32, [2])))
def _train(weights, ds):
    return {"delta": weights["w"] - ds.reduce(np.zeros(2, np.float32), lambda s, x: s + x)}


def test_stop_session_closes_it(operated):
    o = operated
    status, _, err = fedlang("stop-session", o.server.url, "7", *o.token_args)
    assert status == 1 and "Expected an existing session id, found 7" in " ".join(err.split())
    plan = buffered_plan.BufferedPlan.build(_train)
    weights = serialization.serialize_value({"w": np.zeros(2, np.float32)}, WEIGHTS)
    opened = o.http.post("/v1/admin/sessions", headers={"Authorization": f"Bearer {o.server.admin_token}"},
                         json={"population": WIDE, "plan": o.admin.put_blob(plan.to_bytes()),
                               "weights": o.admin.put_blob(weights), "buffer_size": 2,
                               "max_staleness": 1})
    assert opened.status_code == 201, opened.text
    sid = opened.json()["id"]
    assert o.checkin(o.clients[0])["task"]["kind"] == "buffered"
    status, out, err = fedlang("stop-session", o.server.url, str(sid), *o.token_args)
    assert status == 0, err
    assert out.strip() == f"session {sid} closed at version 0 with 0 reports"
    (s,) = o.admin.overview()["sessions"]
    assert (s["id"], s["state"]) == (sid, "closed")
    assert o.checkin(o.clients[1]).get("task") is None  # no more tasks
    status, out, _ = fedlang("sessions", o.server.url, *o.token_args)
    assert status == 0 and f"{sid}" in out and "closed" in out


def test_follow_shows_a_progress_bar_in_a_terminal(operated):
    o = operated
    r = o.open_round(target=2)
    asked = threading.Event()

    class Asked(logging.Handler):  # the follower's first look at the round
        def emit(self, record):
            if getattr(record, "path", "") == f"/v1/admin/rounds/{r['id']}":
                asked.set()

    log = logging.getLogger("fedlang.deploy.server.requests")
    handler, level = Asked(), log.level
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    result = {}
    follower = threading.Thread(target=lambda: result.update(zip(
        ("status", "screen"),
        fedlang_in_terminal("follow", o.server.url, str(r["id"]), *o.token_args))))
    follower.start()
    try:
        assert asked.wait(60), "the follower never asked for the round"
        for c in o.clients[:2]:
            o.checkin(c)
            assert o.report(c, r["id"]).status_code == 200
    finally:
        if o.admin.round(r["id"])["state"] == "open":  # (a failure above) the follower ends
            o.admin.stop_round(r["id"])
        follower.join(timeout=120)
        log.removeHandler(handler)
        log.setLevel(level)
    assert result["status"] == 0, result
    screen = result["screen"]
    assert any("open: 0/2 reports" in line and "0/2" in line.split("reports")[-1] for line in screen), screen
    assert any(f"round {r['id']} closed: 2/2 reports" in line for line in screen), screen
    assert screen[-1].startswith(f"round {r['id']} closed with 2 reports in"), screen


@pytest.mark.parametrize("width", [80, 50])
def test_follow_never_cuts_the_elapsed_time(monkeypatch, width):
    # issue 37, item 12b: at 80 columns the round's line took them all ("0:0…")
    import io

    from rich import progress
    from rich.console import Console

    from fedlang.cli import console, ops

    screen = io.StringIO()
    terminal = Console(file=screen, width=width, color_system=None)
    monkeypatch.setattr(console, "out", terminal)
    bar = progress.Progress(*ops.follow_columns(20), console=terminal)
    bar.add_task("round 12 open, secure stage 3: 0/20 reports, 30 assigned, 0 dropped, 0 late, "
                 "0 refused", total=20, completed=3)
    terminal.print(bar.make_tasks_table(bar.tasks))
    (line,) = screen.getvalue().splitlines()
    assert len(line) <= width and line.startswith("round 12") and "…" in line
    assert line.endswith(" 3/20  0:00:00"), line
