"""Clients and the driver's transport against a server on 127.0.0.1 (clients on threads)."""

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from fedlang import cli, deploy
from fedlang.core import context, signing
from fedlang.deploy import protocol
from fedlang.deploy.client import connection
from fedlang.deploy.client import data as data_lib

from ..conftest import Gated, batch_sum, bounds_of

FAST = {"backoff": (0.02, 0.2)}


def _population(server):
    with deploy.Admin(server.url, server.admin_token) as admin:
        return admin.create_population("pop")


def rows(i):
    return np.array([[i, 1, 0], [0, i, 1]], np.float32)


def test_the_driver_loop_runs_rounds_on_clients(server_factory, client_threads):
    server = server_factory()
    admin = deploy.Admin(server.url, server.admin_token)
    token = admin.create_population("pop")
    admin.close()
    errors = [
        client_threads(deploy.Client(server.url, "pop", token, {"train": [{"x": rows(i)}]}, **FAST))
        for i in range(4)
    ]
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=4, progress=True,
                                    bounds=bounds_of(batch_sum))
    with context.with_context(ctx):
        first = batch_sum(deploy.client_data("train"))
        second = batch_sum(deploy.client_data("train"))
    ctx.runner.finish()  # the clients stop at their next check-in
    ctx.runner.close()
    want = sum(rows(i).sum(axis=0) for i in range(4))
    np.testing.assert_allclose(first, want)
    np.testing.assert_allclose(second, want)
    assert [r.reports for r in ctx.rounds] == [4, 4]
    assert ctx.rounds[0].details["state"] == "closed"
    with deploy.Admin(server.url, server.admin_token) as admin:
        status = admin.status()
    assert status["reports"]["accepted"] == 8 and status["rounds_closed"] == 2
    assert not any(errors)


def test_a_round_below_its_quorum_fails_with_a_clear_error(server_factory):
    server = server_factory()
    _population(server)
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=2, deadline=0.3,
                                    bounds=bounds_of(batch_sum))
    with context.with_context(ctx), pytest.raises(deploy.RoundFailedError, match="0 of the 2 reports"):
        batch_sum(deploy.client_data("train"))
    ctx.runner.close()


def test_clients_keep_their_credential_and_pin_the_server_key(server_factory, tmp_path):
    server = server_factory()
    token = _population(server)
    path = tmp_path / "credential.json"
    with deploy.Client(server.url, "pop", token, credential_file=path) as c:
        client_id = c.enroll()
    assert json.loads(path.read_text())["client_id"] == client_id
    with deploy.Client(server.url, "pop", credential_file=path) as again:
        assert again.client_id == client_id and again.pinned == server.public_key
    wrong = signing.public_key_bytes(signing.generate_key())
    with pytest.raises(signing.SignatureError, match="pinned"), \
            deploy.Client(server.url, "pop", token, public_key=wrong) as c:
        c.enroll()
    with pytest.raises(protocol.Unauthorized, match="enrollment token"), \
            deploy.Client(server.url, "pop", "bad-token") as c:
        c.enroll()


def test_a_client_with_an_expired_credential_enrolls_again(server_factory, client_threads):
    server = server_factory(credential_ttl=0.5)
    token = _population(server)
    c = deploy.Client(server.url, "pop", token, **FAST)
    first = c.enroll()
    import time

    time.sleep(0.6)
    errors = client_threads(c)
    deadline = time.monotonic() + 30
    while c.client_id == first and time.monotonic() < deadline:
        time.sleep(0.05)
    assert c.client_id != first and not errors


def test_npz_data_are_read_in_batches(tmp_path):
    path = tmp_path / "client.npz"
    np.savez(path, x=np.arange(10, dtype=np.float32).reshape(5, 2), y=np.arange(5, dtype=np.int32))
    batches = list(data_lib.NpzDataset(path, batch_size=2))
    assert [len(b["y"]) for b in batches] == [2, 2, 1] and list(batches[0]) == ["x", "y"]
    with pytest.raises(ValueError, match=r"\.npz"):
        deploy.Client("http://127.0.0.1:9", "pop", "t", {"train": str(tmp_path / "data.csv")})


def test_an_unreachable_server_is_reported_after_the_patience(tmp_path):
    c = connection.Connection("http://127.0.0.1:9", patience=0.3, backoff=(0.05, 0.1))
    with pytest.raises(deploy.ServerUnavailable, match="check that it runs"):
        c.request("GET", "/v1/status")
    c.close()


def test_status_prints_a_table(server_factory, client_threads):
    server = server_factory()
    token = _population(server)
    gate = Gated(rows(1))
    gate.release.set()
    client_threads(deploy.Client(server.url, "pop", token, {"train": gate}, **FAST))
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=1,
                                    bounds=bounds_of(batch_sum))
    with context.with_context(ctx):
        batch_sum(deploy.client_data("train"))
    ctx.runner.close()
    result = CliRunner().invoke(cli.app, ["status", server.url], env={"COLUMNS": "160"})
    assert result.exit_code == 0, result.output
    for text in ("reports accepted", "check-ins", "dropouts", "closed", "pop (1 clients)"):
        assert text in result.output
    unreachable = CliRunner().invoke(cli.app, ["status", "http://127.0.0.1:9", "--patience", "0.2"])
    assert unreachable.exit_code == 1 and "check that it runs" in unreachable.output


def test_a_task_whose_broadcast_was_swapped_in_transit_is_not_run(server_factory, sum_round):
    # Issue 23 item 6: the broadcast (the model's weights) was checked only against the
    # hash the check-in named, which the plan's signature did not cover.
    server = server_factory()
    token = _population(server)
    plan, broadcast = sum_round
    with deploy.Admin(server.url, server.admin_token) as admin:
        other = admin.put_blob(b"weights an attacker prefers")
        admin.create_round("pop", admin.put_blob(plan.to_bytes()), admin.put_blob(broadcast),
                           target=1)
    with deploy.Client(server.url, "pop", token, {"train": [np.ones(3, np.float32)]}) as c:
        c.enroll()
        task = c.connection.json("POST", "/v1/checkin", token=c.credential)["task"]
        for changed in ({**task, "broadcast": other}, {**task, "round": task["round"] + 1},
                        {**task, "ticket": ""}, {**task, "ticket": "!!"}):
            with pytest.raises(signing.SignatureError):
                c.run_task(changed)
        assert server.app_state.rounds.round(task["round"]).reports == 0  # nothing ran
        assert c.run_task(task) is True
