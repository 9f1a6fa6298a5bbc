"""The buffered-session driver against an in-process server on 127.0.0.1: with one client
at a time and no staleness, the deployment's state equals the process run in this
process on the same clients' data; a restarted driver rebuilds its buffer from the store."""

import threading
import time

import jax
import numpy as np
import optax
import pytest

from fedlang import deploy
from fedlang.deploy.driver import buffered as buffered_driver
from fedlang.deploy.driver import metrics as driver_metrics
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.learning import algorithms
from fedlang.learning.models import model as model_lib

from ..conftest import ROOT

pytestmark = pytest.mark.timeout(300)


def _digits():
    import sys

    sys.path.insert(0, str(ROOT / "examples"))
    import deploy_digits

    return deploy_digits


def _batches(data, size=20):
    return [{"x": data["x"][i:i + size], "y": data["y"][i:i + size]}
            for i in range(0, len(data["y"]), size)]


@pytest.fixture(scope="module")
def setting():
    dd = _digits()
    clients, _ = dd.partition(10)
    process = algorithms.build_fed_buff(dd.model_fn, optax.sgd(0.1), optax.sgd(1.0),
                                        buffer_size=2, max_staleness=2)
    return process, [_batches(c) for c in clients[:2]]


def _wait_for(predicate, what, timeout=120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def _in_process(process, datasets, k):
    """The process run here: each client in turn trains the current model and is folded."""
    state = process.initialize()
    for i, ds in enumerate(datasets):
        weights, version = process.client_model(state)
        state = process.fold(state, process.train(weights, ds), version)
        if (i + 1) % k == 0:
            assert process.is_full(state)
            state, _ = process.apply(state)
    return state


def _one_at_a_time(server, token, datasets, driver, steps):
    """Each client in turn reports once the previous reports are applied (no staleness);
    K clients, each reporting once per version."""
    clients = [deploy.Client(server.url, "digits", token, {"train": ds}, backoff=(0.05, 0.2))
               for ds in datasets]
    try:
        for i in range(steps * len(clients)):
            want = i // driver.buffer_size
            _wait_for(lambda want=want: driver.session_id is not None and
                      server.app_state.sessions.session(driver.session_id).version == want,
                      f"version {want}")
            c = clients[i % len(clients)]
            c.max_tasks = c.tasks_done + 1
            c.run()
            assert c.tasks_done == i // len(clients) + 1
    finally:
        for c in clients:
            c.close()


def _assert_same(process, got, want):
    assert process.status(got) == process.status(want)
    g, w = process.get_model_weights(got), process.get_model_weights(want)
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(w), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_one_client_at_a_time_equals_the_process_run_in_process(server_factory, setting):
    process, datasets = setting
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    driver = buffered_driver.BufferedDriver(process, server.url, server.admin_token, "digits",
                                         patience=60)
    result = {}
    steps = 2

    def drive():
        try:
            result["state"] = driver.run(steps, timeout=240)
        except Exception as e:
            result["error"] = e

    t = threading.Thread(target=drive)
    t.start()
    try:
        _one_at_a_time(server, token, datasets, driver, steps)
    finally:
        t.join(timeout=240)
        driver.close()
    assert "error" not in result, result
    assert [s.version for s in driver.steps] == [1, 2]
    _assert_same(process, result["state"], _in_process(process, datasets * steps, 2))
    shown = server.app_state.status()["sessions"][0]
    assert (shown["version"], shown["accepted"], shown["buffer_fill"]) == (2, 4, 0)
    assert shown["staleness_histogram"] == {"0": 4}
    # each server step's metrics were released, the version as the round (the dashboard)
    with deploy.Admin(server.url, server.admin_token) as admin:
        released = admin.released_metrics("digits")
    expected = {(step.version, kind, name): value for step in driver.steps
                for kind, values in driver_metrics.release_form(
                    driver_metrics.round_record(step.metrics)).items()
                for name, value in values.items()}
    assert {kind for _, kind, _ in expected} == {"train"}  # as fedlang train releases them
    assert expected and {(m["round"], m["kind"], m["name"]): m["value"] for m in released} == expected


def test_a_restarted_driver_rebuilds_the_buffer_from_the_stored_reports(server_factory, setting):
    process, datasets = setting
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("digits")
    first = buffered_driver.BufferedDriver(process, server.url, server.admin_token, "digits",
                                        request_id="digits-fedbuff", patience=60)
    first.start()
    clients = [deploy.Client(server.url, "digits", token, {"train": ds}) for ds in datasets]
    for i in range(3):  # a full buffer and one report of the next
        c = clients[i % 2]
        c.max_tasks = c.tasks_done + 1
        c.run()
        first.poll()  # folds what arrived (and applies a full buffer)
    assert first.version == 1 and first.process.status(first.state)["buffer_fill"] == 1
    first.close()  # the driver goes away with one report in its buffer

    # act: a new driver on the same session
    second = buffered_driver.BufferedDriver(process, server.url, server.admin_token, "digits",
                                         request_id="digits-fedbuff", patience=60)
    second.start()
    assert (second.session_id, second.version, second.refolded) == (first.session_id, 1, 1)
    assert process.status(second.state) == process.status(first.state)
    clients[1].max_tasks = 2
    clients[1].run()
    state = second.run(1, timeout=120)
    second.close()
    for c in clients:
        c.close()

    # assert: the same as the process on the same reports, each counted once
    assert process.status(state)["accepted"] == 4
    _assert_same(process, state, _in_process(process, datasets * 2, 2))


def test_the_driver_ships_train_as_a_signed_plan(setting):
    process, _ = setting
    plan = buffered_plan.BufferedPlan.build(process.train)
    assert plan.report_type == process.report_type
    assert plan.weights_type == process.model_weights_type
    assert isinstance(process.client_model(process.initialize())[0], model_lib.ModelWeights)



def _bias_only():
    """A digits model without its weight matrix (another model type)."""
    import jax.numpy as jnp

    from fedlang.learning import models

    return models.FunctionalModel(
        init_fn=lambda rng: {"b": jnp.zeros([10])},
        apply_fn=lambda p, x: jnp.zeros([x.shape[0], 10]) + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
            logits, y).mean(),
        input_spec=_digits().SPEC,
    )


def test_a_driver_of_another_model_does_not_resume_the_session(server_factory, setting):
    process, _ = setting
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        admin.create_population("digits")
    with buffered_driver.BufferedDriver(process, server.url, server.admin_token, "digits",
                                     request_id="s") as first:
        first.start()
    other = algorithms.build_fed_buff(_bias_only, optax.sgd(0.1), buffer_size=2, max_staleness=2)
    with buffered_driver.BufferedDriver(other, server.url, server.admin_token, "digits",
                                     request_id="s") as second, \
            pytest.raises(ValueError, match="another request_id"):
        second.start()
