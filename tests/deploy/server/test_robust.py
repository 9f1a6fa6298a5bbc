"""Robust aggregators (median, trimmed mean) chosen by the operator run through a real server:
each client reports one row of the growing buffer, the server folds the rows and computes the
statistic, and the result equals the simulation runtime's."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.aggregators import MedianFactory, TrimmedMeanFactory
from fedlang.core import context, serialization
from fedlang.deploy.plans import execution, folding
from fedlang.learning import algorithms, models

from ..conftest import capture
from ._deployment import Deployment

SPEC = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}
FAST = {"backoff": (0.02, 0.2)}


def _model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.ones([2, 2]) * 0.1, "b": jnp.zeros([6])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"][:2],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
    )


def _client_batches(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    x = rng.normal(size=(n, 2)).astype(np.float32)
    y = (x[:, 0] > x[:, 1]).astype(np.int32)
    return [{"x": x[i : i + 2], "y": y[i : i + 2]} for i in range(0, n, 2)]


CLIENTS = [_client_batches(i) for i in range(5)]


@pytest.mark.parametrize("aggregator", [MedianFactory(), TrimmedMeanFactory(0.2)], ids=["median", "trimmed"])
def test_robust_fed_avg_through_a_server_equals_the_simulation(aggregator, server_factory, client_threads):
    process = algorithms.build_unweighted_fed_avg(_model_fn, optax.sgd(0.5), model_aggregator=aggregator)
    with fl.runtime.simulation_context():
        state = sim_state = process.initialize()
        for _ in range(2):
            sim_state, _ = process.next(sim_state, CLIENTS)
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    errors = [client_threads(deploy.Client(server.url, "pop", token, {"train": batches}, **FAST))
              for batches in CLIENTS]
    ctx = deploy.deployment_context(server.url, server.admin_token, "pop", target=len(CLIENTS), deadline=60)
    with context.with_context(ctx):
        dep_state = state
        for _ in range(2):
            dep_state, _ = process.next(dep_state, deploy.client_data("train"))
    ctx.runner.finish()
    ctx.runner.close()
    assert [r.reports for r in ctx.rounds] == [5, 5]
    for a, b in zip(jax.tree.leaves(process.get_model_weights(dep_state)),
                    jax.tree.leaves(process.get_model_weights(sim_state))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert not any(errors)


def _median_round():
    process = algorithms.build_unweighted_fed_avg(_model_fn, optax.sgd(0.5), model_aggregator=MedianFactory())
    with fl.runtime.simulation_context():
        state = process.initialize()
    return capture(process.next, state, deploy.client_data("train"))


def _with_rows(plan, report, rows):
    """`report` with each leaf of the median's buffer (aggregation 0) replaced by `rows`(leaf)."""
    value = serialization.deserialize_value(report, expected_type=plan.report_type)
    buffers = value[0]["value"]
    value[0]["value"] = jax.tree.map(rows, buffers)
    return serialization.serialize_value(value, plan.report_type)


def test_a_report_is_one_row_and_the_aggregate_one_row_per_client():
    plan, broadcast = _median_round()
    folder = folding.Folder(plan)
    one = execution.run_plan(plan, broadcast, {"train": CLIENTS[0]})
    rows = len(jax.tree.leaves(folder.check(one)[0][0])[0])
    assert rows == 1
    # The report limit counts one row per buffer, not 2^20.
    assert folder.max_report_bytes < 200 < folding.max_bytes(plan.report_type)
    # Two rows of the small leaf, none of the large one: within the bytes, not one client.
    b_two_w_none = _with_rows(plan, one, lambda x: np.concatenate([x, x]) if x.size == 4 else x[:0])
    with pytest.raises(folding.ReportError, match="one row per client") as e:
        folder.check(b_two_w_none)
    assert e.value.reason == "not_one_client"
    with pytest.raises(folding.ReportError):  # two rows of every leaf: too many bytes
        folder.check(_with_rows(plan, one, lambda x: np.concatenate([x, x])))
    # Shards' aggregates merge into one of a row per report.
    shards = [folder.fold(folder.empty(), folder.check(
        execution.run_plan(plan, broadcast, {"train": batches}))) for batches in CLIENTS]
    merged = folder.merge([folder.merge(shards[:2]), folder.merge(shards[2:])])
    assert folder.count(merged) == 5
    partial = folder.check_partial(folder.encode_partial(merged, 5, 0))
    assert [np.shape(x)[0] for x in jax.tree.leaves(partial.value[0][0])] == [5, 5]
    double = folding.decode(folder.merge([merged, merged]), folder.aggregate_type, None, "ten rows")
    double[0]["count"] = np.int64(5)  # an edge claiming 5 reports with 10 rows
    forged = serialization.serialize_value(double, folder.aggregate_type)
    with pytest.raises(folding.ReportError, match="one row per client"):
        folder.check_partial(folder.encode_partial(forged, 5, 0))


def test_the_server_refuses_a_report_of_two_rows(server_factory):
    plan, broadcast = _median_round()
    d = Deployment(server_factory(), (plan, broadcast))
    try:
        round_id = d.open_round(target=2)["id"]
        client = d.clients[0]
        assert d.checkin(client)["task"]["round"] == round_id
        one = execution.run_plan(plan, broadcast, {"train": CLIENTS[0]})
        two = _with_rows(plan, one, lambda x: np.concatenate([x, x]) if x.size == 4 else x[:0])
        r = d.http.put(f"/v1/rounds/{round_id}/report", content=two, headers={
            "Authorization": f"Bearer {client['credential']}", "Fedlang-Task": f'{{"round":{round_id},"session":null,"version":null}}'})
        assert (r.status_code, r.json()["reason"]) == (400, "not_one_client"), r.text
        r = d.http.put(f"/v1/rounds/{round_id}/report", content=one, headers={
            "Authorization": f"Bearer {client['credential']}", "Fedlang-Task": f'{{"round":{round_id},"session":null,"version":null}}'})
        assert r.status_code == 200, r.text
    finally:
        d.close()
