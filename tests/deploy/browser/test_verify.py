"""The preflight accepts what browsers can run, and names what they cannot."""

import dataclasses
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.deploy.plans import round as plan_lib
from fedlang.learning import algorithms, models

from ..conftest import ROOT, capture

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")

from fedlang.deploy import browser
from fedlang.deploy.browser import onnx_export, task, verify


def test_logistic_regression_passes_and_the_section_rides_in_the_plan(logreg_process, browser_tasks):
    process = logreg_process
    (section,) = browser.preflight(process.next, process.initialize(),
                                   deploy.client_data("train"), tasks=browser_tasks)
    assert section["format"] == "fedlang-browser-task" and len(section["programs"]) == 3
    plan, broadcast = capture(process.next, process.initialize(), deploy.client_data("train"))
    with_section = browser_tasks(plan, broadcast)
    assert with_section.browser is section  # made once per task
    assert plan_lib.RoundPlan.from_bytes(with_section.to_bytes()).browser == section
    assert b'"browser"' not in plan.to_bytes()  # Python clients' plans are unchanged


def cnn_fn():
    sys.path.insert(0, str(ROOT))
    from bench import workloads  # the FedAvg paper's CNN

    return models.FunctionalModel(
        init_fn=workloads._cnn_init, apply_fn=workloads._cnn_apply,
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec={"x": (np.float32, [None, 28, 28]), "y": (np.int32, [None])},
        metrics=[models.Accuracy()],
    )


@pytest.mark.slow  # about 40 s: exporting and checking the CNN's training step
def test_the_fedavg_papers_cnn_passes():
    process = algorithms.build_weighted_fed_avg(cnn_fn, optax.sgd(0.1))
    (section,) = browser.preflight(process.next, process.initialize(), deploy.client_data("train"))
    step = next(s for s in section["run"] if s["kind"] == "loop")
    assert len(section["programs"][step["program"]]) < 400_000  # base64 of the step's ONNX


_unsupported = jax.extend.core.Primitive("fedlang_test_unsupported")
_unsupported.def_impl(lambda x: x)
_unsupported.def_abstract_eval(lambda x: x)
ELEMENT = fl.to_type({"x": fl.TensorType(np.float32, [None, 3])})


def _computation(per_batch):
    @fl.jax_computation(fl.SequenceType(ELEMENT))
    def local(dataset):
        return dataset.reduce(np.zeros(3, np.float32), lambda s, b: s + per_batch(b["x"]))

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(ELEMENT)))
    def total(data):
        return fl.federated_sum(fl.federated_map(local, data))

    return total


def test_a_primitive_without_a_rule_is_refused_by_name():
    comp = _computation(lambda x: _unsupported.bind(x).sum(axis=0))
    with pytest.raises(browser.BrowserExportError,
                       match=r"primitive 'fedlang_test_unsupported'.*program p1 \(local state\)"):
        browser.preflight(comp, deploy.client_data("train"))


def test_a_forward_mode_derivative_of_max_pooling_is_refused_by_name():
    def pool(v):
        return jax.lax.reduce_window(v, -jnp.inf, jax.lax.max, (1, 3), (1, 3), "VALID")

    def per_batch(x):
        return jax.jvp(pool, (x,), (jnp.ones_like(x),))[1].sum(axis=0).repeat(3)

    with pytest.raises(browser.BrowserExportError, match="'select_and_gather_add'"):
        browser.preflight(_computation(per_batch), deploy.client_data("train"))


def test_a_program_that_computes_something_else_is_refused_with_the_difference():
    bounds = deploy.ReportBounds(unbounded=("[0]",))  # (the point is the browser's program)
    plan, broadcast = capture(_computation(lambda x: x.sum(axis=0)), deploy.client_data("train"),
                              bounds=bounds)
    bt = task.compile_task(plan)
    bt.export()
    step = next(p for p in bt.plan.programs if p.name == "p1")
    off_by_one = dataclasses.replace(step, fn=lambda *xs: [y + 1 for y in step.fn(*xs)])
    step.onnx = onnx_export.export(off_by_one.fn, step.avals, step.input_names,
                                   step.output_names, "wrong")  # a converter's wrong model
    with pytest.raises(browser.BrowserExportError,
                       match=r"program p1 \(local state\).*differing by 1 .*batch of 1"):
        verify.check(bt, broadcast)
