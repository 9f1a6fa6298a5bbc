"""A round's task for browsers: what it compiles to, and that running it (with onnxruntime,
as fedlang.js does) gives the report a Python client gives."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import serialization
from fedlang.deploy.plans import execution

from ..conftest import capture
from .conftest import batches, digits_clients

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")

from fedlang.deploy import browser as deploy_browser
from fedlang.deploy.browser import onnx_export, runner, task


def assert_same_report(got, want, report_type):
    assert got[:64] == want[:64]  # the same header: type, shapes, dtypes
    g = jax.tree.leaves(serialization.deserialize_value(got, expected_type=report_type))
    w = jax.tree.leaves(serialization.deserialize_value(want, expected_type=report_type))
    for a, b in zip(g, w, strict=True):
        np.testing.assert_allclose(np.asarray(a, np.float64), np.asarray(b, np.float64),
                                   rtol=1e-5, atol=1e-5)


def test_a_fedavg_task_is_three_programs_and_reports_what_python_reports(logreg_process):
    process = logreg_process
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    bt = task.compile_task(plan)
    description = bt.description()
    assert [s["kind"] for s in description["run"]] == ["run", "loop", "run"]
    assert description["data"]["train"]["leaves"] == [
        {"path": ["x"], "dtype": "float32", "shape": [None, 64]},
        {"path": ["y"], "dtype": "int32", "shape": [None]},
    ]
    data = {"train": batches(digits_clients(1, per_client=70)[0])}  # a last, smaller batch
    assert_same_report(runner.run_task(description, broadcast, data),
                       execution.run_plan(plan, broadcast, data), plan.report_type)


ELEMENT = fl.to_type({"x": fl.TensorType(np.float32, [None, 3])})


@fl.jax_computation(fl.SequenceType(ELEMENT))
def _sums(dataset):
    def step(state, batch):
        return {"total": state["total"] + batch["x"].sum(axis=0),
                "rows": state["rows"] + jnp.float32(batch["x"].shape[0])}

    return dataset.reduce({"total": np.zeros(3, np.float32), "rows": np.float32(0)}, step)


@fl.jax_computation(fl.TensorType(np.float32, [3]), fl.TensorType(np.float32, [3]))
def _accumulate(acc, x):
    return acc + 2 * x


@fl.jax_computation(fl.TensorType(np.float32, [3]), fl.TensorType(np.float32, [3]))
def _merge(a, b):
    return a + b


@fl.jax_computation(fl.TensorType(np.float32, [3]))
def _report(a):
    return a


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(ELEMENT)))
def every_aggregation(data):
    s = fl.federated_map(_sums, data)
    return (
        fl.federated_mean(s.total), fl.federated_mean(s.total, s.rows), fl.federated_max(s.rows),
        fl.federated_min(s.total), fl.federated_sum(s.rows),
        fl.federated_aggregate(s.total, np.zeros(3, np.float32), _accumulate, _merge, _report),
    )


def test_each_kind_of_aggregation_is_pre_aggregated_as_python_does():
    # the clients' rows are 0..14: declared as a user would (totals, counts, doubled totals)
    bounds = deploy.ReportBounds(ranges={
        "[0].total": (-1e3, 1e3), "[0].count": (0, 1), "[2].best": (0, 100),
        "[3].best": (-1e3, 1e3), "[4]": (0, 100), "[5].value": (-1e4, 1e4)})
    plan, broadcast = capture(every_aggregation, deploy.client_data("train"), bounds=bounds)
    description = task.compile_task(plan).description()
    kinds = [task.KINDS[a.uri] for a in plan.aggregations]
    assert kinds == ["mean", "weighted_mean", "extremum", "extremum", "sum", "aggregate"]
    rows = np.arange(15, dtype=np.float32).reshape(5, 3)
    data = {"train": [{"x": rows[:2]}, {"x": rows[2:]}]}
    assert_same_report(runner.run_task(description, broadcast, data),
                       execution.run_plan(plan, broadcast, data), plan.report_type)


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(ELEMENT)))
def secure_total(data):
    rows = fl.federated_map(fl.jax_computation(fl.SequenceType(ELEMENT))(
        lambda ds: ds.reduce(np.int32(0), lambda n, b: n + b["x"].shape[0])), data)
    return fl.federated_secure_sum_bitwidth(rows, 16)


def test_what_browsers_cannot_run_is_refused_by_name():
    plan, _ = capture(secure_total, deploy.client_data("train"))
    with pytest.raises(onnx_export.BrowserExportError, match=r"secure aggregation.*secure_sum"):
        task.compile_task(plan)


def test_a_task_with_client_state_runs_as_the_python_client_runs_it_state_included():
    from ...learning.test_client_state_algorithms import client_batches, scaffold

    process = scaffold()
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"),
                              deploy.client_state("scaffold"))
    section = deploy_browser.BrowserTasks().section(plan, broadcast)  # with the preflight
    assert section["state"]["name"] == "scaffold" and section["state"]["outputs"]
    data = {"train": client_batches("c1", 0)}
    with pytest.raises(ValueError, match="run_task_with_state"):
        runner.run_task(section, broadcast, data)
    stored, python_state = None, None
    for _ in range(2):  # the second run starts from the state the first one left
        report, stored = runner.run_task_with_state(section, broadcast, data, stored)
        want = execution.run_plan_parts(plan, broadcast, data, state=python_state)
        python_state = want.state
        for got, ref in zip(runner.read_value(report), runner.read_value(want.report)):
            np.testing.assert_allclose(got.astype(np.float64), ref.astype(np.float64),
                                       rtol=1e-5, atol=1e-5)
        for got, ref in zip(runner.read_value(stored), jax.tree.leaves(python_state)):
            np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    assert np.abs(runner.read_value(stored)[0]).max() > 0  # the control variate moved
    other = serialization.serialize_value(np.zeros(2, np.float32), fl.TensorType(np.float32, [2]))
    with pytest.raises(ValueError, match="another task"):
        runner.run_task_with_state(section, broadcast, data, other)
