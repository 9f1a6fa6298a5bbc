"""Every leaf of a report bounded (issue 36, item 2): the bounds `plans/bounds.py`
derives for the learning algorithms' metric accumulators (a loss sum and each metric's
statistics at most the plan's per-example bound times the examples, counts >= 0 and at
most the client's examples, a maximum of update norms within `clip`, a count of clients
exactly 1), signed with the plan, and the error a leaf with no derivable bound gives."""

import contextlib

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import aggregators, deploy
from fedlang.core import context
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import execution, folding
from fedlang.learning import algorithms, models

from .. import conftest as deploy_conftest

SPEC = {"x": (np.float32, [None, 4]), "y": (np.int32, [None])}


def _abs_error(predictions, y):
    return jnp.abs(predictions[:, 0] - y.astype(jnp.float32))


def _model():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([4, 3])},
        apply_fn=lambda p, x: x @ p["w"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy(), _abs_error],
    )


STRICT = deploy.ReportBounds()  # the constructor's default: every leaf bounded


def _capture(comp, *args, bounds=STRICT):
    """The plan and broadcast of the first round `comp(*args)` runs on clients."""
    runner = deploy_conftest._Capture()
    with contextlib.suppress(deploy_conftest._Captured), \
            context.with_context(deploy.DeploymentContext(runner, bounds=bounds)):
        comp(*args)
    return runner.plan, runner.broadcast


def _plan(comp, *args, bounds=STRICT):
    return _capture(comp, *args, bounds=bounds)[0]


def _honest(plan, broadcast):
    """An honest client's report to `plan` (one batch of 8 examples) by leaf, checked
    against the plan's bounds."""
    rng = np.random.default_rng(0)
    batch = {"x": rng.random((8, 4), dtype=np.float32),
             "y": rng.integers(0, 3, 8).astype(np.int32)}
    folder = folding.Folder(plan)
    report = folder.check(execution.run_plan(plan, broadcast, {"train": [batch]}))
    folder.check_bounds(report)  # within every bound
    return folder.leaves(report)


@pytest.fixture(scope="module")
def fedavg_round():
    process = algorithms.build_weighted_fed_avg(_model, optax.sgd(0.1))
    return _capture(process.next, process.initialize(), deploy.client_data("train"))


def _ranges(bounds):
    return {(r.leaf, r.scale): (r.low, r.high) for r in bounds.ranges}


def test_every_leaf_of_a_fedavg_report_with_metrics_has_a_derived_bound(fedavg_round):
    fedavg = fedavg_round[0]
    # a strict ReportBounds made the plan: no leaf is left unbounded
    bounded = {r.leaf for r in fedavg.bounds.ranges} | {
        x for n in fedavg.bounds.norms for x in n.leaves}
    assert bounded == set(fedavg.report_paths)
    r = _ranges(fedavg.bounds)
    m, b, clip = 1e6, bounds_lib.DEFAULT_PER_EXAMPLE, bounds_lib.DEFAULT_CLIP
    count = "[1].num_examples"
    assert r["[1].loss_sum", count] == (-b, b)
    assert r["[1].metrics.accuracy.count", None] == (0.0, m)  # counts: >= 0, <= examples
    assert r["[1].metrics.accuracy.count", count] == (0.0, b)
    assert r["[1].metrics.accuracy.correct", None] == (0.0, m)
    assert r["[1].metrics._abs_error.total", count] == (-b, b)
    assert r["[3].best", None] == (0.0, clip * (1 + bounds_lib.NORM_SLACK))  # update_norm_max
    assert r["[3].seen", None] == (0.0, 1.0)
    assert r["[5]", None] == (1.0, 1.0)  # a count of clients: each reports 1
    again = type(fedavg).from_bytes(fedavg.to_bytes())  # signed with the plan
    assert again.bounds == fedavg.bounds
    leaves = _honest(*fedavg_round)  # an honest client's report is within all of them
    assert int(leaves["[1].num_examples"]) == 8 and float(leaves["[1].loss_sum"]) > 0


ALGORITHMS = {
    "fed_prox": lambda: algorithms.build_fed_prox(_model, 0.1, optax.sgd(0.1)),
    "fed_adagrad": lambda: algorithms.build_fed_adagrad(_model, optax.sgd(0.1)),
    "fed_sgd": lambda: algorithms.build_fed_sgd(_model),
    "mime_lite": lambda: algorithms.build_mime_lite(_model, optax.sgd(0.1)),
    "q_fed_avg": lambda: algorithms.build_q_fed_avg(_model, 1.0, 0.1),
    "fed_eval": lambda: algorithms.build_fed_eval(_model),
}


@pytest.mark.parametrize("name", sorted(ALGORITHMS))
def test_every_leaf_of_the_learning_algorithms_reports_is_bounded(name):
    process = ALGORITHMS[name]()
    plan = _plan(process.next, process.initialize(), deploy.client_data("train"))  # strict
    bounded = {r.leaf for r in plan.bounds.ranges} | {
        x for n in plan.bounds.norms for x in n.leaves}
    assert bounded == set(plan.report_paths)


def test_sums_are_bounded_by_their_count_times_the_per_example_bound():
    process = algorithms.build_weighted_fed_avg(_model, optax.sgd(0.1))
    bounds = deploy.ReportBounds(per_example=100.0, per_metric={"loss": 5.0})
    plan = _plan(process.next, process.initialize(), deploy.client_data("train"), bounds=bounds)
    leaves = {p: np.zeros(()) for p in plan.report_paths}
    leaves.update({"[1].num_examples": np.int32(8), "[5]": np.int32(1)})
    leaves["[1].loss_sum"] = np.float32(5.0 * 8)
    leaves["[1].metrics._abs_error.total"] = np.float32(-100.0 * 8)
    plan.bounds.check(leaves)
    for leaf, value, bound in [
            ("[1].loss_sum", 5.0 * 8 * 1.001, "[-5, 5] x [1].num_examples = [-40, 40]"),
            ("[1].loss_sum", -1e30, "[-5, 5] x [1].num_examples = [-40, 40]"),
            ("[1].metrics._abs_error.total", 1e4, "[-100, 100] x [1].num_examples"),
            ("[1].metrics.accuracy.count", -5.0, "[0, 1e+06]"),
            ("[3].best", 2 * bounds_lib.DEFAULT_CLIP, "[0, 10000.1]")]:
        bad = dict(leaves, **{leaf: np.float32(value)})
        with pytest.raises(bounds_lib.OutOfBounds) as e:
            plan.bounds.check(bad)
        assert f"leaf {leaf} within {bound}" in str(e.value)
    with pytest.raises(ValueError, match="per_example to be a finite number"):
        deploy.ReportBounds(per_example=-1.0)
    with pytest.raises(ValueError, match=r"per_metric\['loss'\] to be a finite number"):
        deploy.ReportBounds(per_metric={"loss": float("inf")})


def test_a_fedbuff_reports_statistics_are_bounded_too():
    process = algorithms.build_fed_buff(_model, optax.sgd(0.1), optax.sgd(1.0), buffer_size=3)
    plan = buffered_plan.BufferedPlan.build(process.train, bounds=deploy.ReportBounds())
    r = _ranges(plan.bounds)
    assert r[".stats.loss_sum", ".stats.num_examples"] == (-1e6, 1e6)
    assert r[".stats.metrics.accuracy.count", None] == (0.0, 1e6)
    assert r[".update_norm", None][0] == 0.0


@fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [3])))
def _total(ds):
    return ds.reduce(np.zeros(3, np.float32), lambda s, x: s + x)


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [3]))))
def _users_sum(data):
    return fl.federated_sum(fl.federated_map(_total, data))


def test_a_users_leaf_without_a_derivable_bound_fails_plan_creation_naming_it():
    data = deploy.client_data("train")
    with pytest.raises(bounds_lib.UnboundedLeaf) as e:
        _plan(_users_sum, data)
    message = str(e.value)
    assert "found none for [0] (float32[3])" in message
    assert "ranges={'[0]': (low, high)}" in message and "unbounded=('[0]',)" in message
    # declared, it is signed with the plan; accepted as unbounded, the plan is made
    plan = _plan(_users_sum, data, bounds=deploy.ReportBounds(ranges={"[0]": (-10.0, 10.0)}))
    assert _ranges(plan.bounds) == {("[0]", None): (-10.0, 10.0)}
    plan = _plan(_users_sum, data, bounds=deploy.ReportBounds(unbounded=("[0]",)))
    assert not plan.bounds
    with pytest.raises(TypeError, match=r"write unbounded=\('\[0\]',\)"):
        deploy.ReportBounds(unbounded="[0]")
    # strict=False keeps such a program running (its leaf checked for finiteness)
    assert not _plan(_users_sum, data, bounds=deploy.ReportBounds(strict=False)).bounds


def test_a_strict_driver_refuses_a_users_leaf_without_a_bound_as_deploy_unboundedleaf():
    # arrange: a driver given strict bounds, as a user declares them
    runner = deploy_conftest._Capture()
    ctx = deploy.DeploymentContext(runner, bounds=deploy.ReportBounds())
    # act / assert: the plan is refused before any round, naming the leaf and the remedy,
    # as the error the package exports next to ReportBounds
    with context.with_context(ctx), pytest.raises(deploy.UnboundedLeaf) as e:
        _users_sum(deploy.client_data("train"))
    assert not hasattr(runner, "plan")
    assert "found none for [0] (float32[3])" in str(e.value)
    assert "ReportBounds: ranges={'[0]': (low, high)}" in str(e.value)
    assert isinstance(e.value, ValueError)


def test_an_unweighted_sum_of_updates_is_bounded_by_clip():
    process = algorithms.build_unweighted_fed_avg(_model, optax.sgd(0.1))
    plan = _plan(process.next, process.initialize(), deploy.client_data("train"))
    assert bounds_lib.Norm(("[0].w",), bounds_lib.DEFAULT_CLIP) in plan.bounds.norms
    leaves = {p: np.zeros(()) for p in plan.report_paths}
    leaves.update({"[4]": np.int32(1), "[5]": np.int32(1), "[0].w": np.full((4, 3), 1e4)})
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaves \[0\].w at most 10000 "):
        plan.bounds.check(leaves)


def test_dp_fed_avgs_clipped_updates_flags_and_quantile_reports_are_bounded():
    dp = aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(
        noise_multiplier=0.1, clients_per_round=3)
    process = algorithms.build_unweighted_fed_avg(_model, optax.sgd(0.1), model_aggregator=dp)
    plan, broadcast = _capture(process.next, process.initialize(), deploy.client_data("train"))
    r = _ranges(plan.bounds)  # (each client's count, [5] and [7], is 1)
    assert (r["[4]", None], r["[6]", None]) == ((-0.5, 0.5), (0.0, 1.0))  # report, hit
    assert bounds_lib.Norm(("[0].w",), bounds_lib.DEFAULT_CLIP) in plan.bounds.norms  # clipped
    leaves = _honest(plan, broadcast)
    leaves["[4]"] = np.float32(3.0)  # a quantile report is +-0.5
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaf \[4\] within \[-0.5, 0.5\]"):
        plan.bounds.check(leaves)


ROBUST = {
    "median": aggregators.MedianFactory(),
    "trimmed_mean": aggregators.TrimmedMeanFactory(0.2),
    "geometric_median": aggregators.GeometricMedianFactory(),
    "krum": aggregators.KrumFactory(num_byzantine=1),
}


@pytest.mark.parametrize("name", sorted(ROBUST))
def test_a_robust_aggregators_partial_is_bounded_by_clip_and_one_count(name):
    process = algorithms.build_unweighted_fed_avg(_model, optax.sgd(0.1),
                                                  model_aggregator=ROBUST[name])
    plan, broadcast = _capture(process.next, process.initialize(), deploy.client_data("train"),
                               bounds=deploy.ReportBounds(clip=5.0))  # strict
    # each client's update is one row of the buffer: its L2 norm at most clip
    assert bounds_lib.Norm(("[0].value.w",), 5.0) in plan.bounds.norms
    assert _ranges(plan.bounds)["[0].count", None] == (0.0, 1.0)
    leaves = _honest(plan, broadcast)  # an honest client's row is within them
    assert leaves["[0].value.w"].shape == (1, 4, 3)
    long = dict(leaves, **{"[0].value.w": np.full((1, 4, 3), 2.0, np.float32)})  # |u| = 6.9
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaves \[0\].value.w at most 5 "):
        plan.bounds.check(long)
    negative = dict(leaves, **{"[0].count": np.int64(-1)})
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaf \[0\].count within \[0, 1\]"):
        plan.bounds.check(negative)


@fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [3])))
def _losses(ds):
    return ds.reduce({"loss_sum": np.float32(0), "num_examples": np.float32(0)},
                     lambda s, x: {"loss_sum": s["loss_sum"] + x.sum(),
                                   "num_examples": s["num_examples"] + 1.0})


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(fl.TensorType(np.float32, [3]))))
def _summed_apart(data):
    # how `learning.sparse` reports its loss: two sums of the clients' outputs' fields
    out = fl.federated_map(_losses, data)
    return fl.federated_sum(out.loss_sum), fl.federated_sum(out.num_examples)


def test_a_loss_summed_apart_from_its_examples_is_bounded_by_their_sum():
    plan = _plan(_summed_apart, deploy.client_data("train"),
                 bounds=deploy.ReportBounds(per_metric={"loss": 3.0}))  # strict
    assert _ranges(plan.bounds) == {("[0]", "[1]"): (-3.0, 3.0), ("[1]", None): (0.0, 1e6)}
    plan.bounds.check({"[0]": np.float32(-3.0 * 8), "[1]": np.float32(8)})
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaf \[0\] within \[-3, 3\] x \[1\]"):
        plan.bounds.check({"[0]": np.float32(1e30), "[1]": np.float32(8)})


def test_dp_over_secure_sums_clear_flags_are_bounded():
    dp = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=0.1, clients_per_round=3, clip=1.0,
        record_aggregation_factory=aggregators.SecureSumFactory(1.0, -1.0, bits=20))
    process = algorithms.build_unweighted_fed_avg(_model, optax.sgd(0.1), model_aggregator=dp)
    plan = _plan(process.next, process.initialize(), deploy.client_data("train"))
    r = _ranges(plan.bounds)  # strict: every plain leaf bounded; the codes go masked ([0])
    # included, nonfinite: 0 or 1; elements above, below the range: at most the 4 x 3 of w
    assert [r[f"[{i}]", None] for i in (4, 5, 6, 7)] == [(0.0, 1.0)] * 2 + [(0.0, 12.0)] * 2
    leaves = {p: np.zeros((), np.int32) for p in plan.report_paths}  # all scalars here
    leaves.update({"[9]": np.int32(1), "[11]": np.int32(1), "[6]": np.int32(12)})
    plan.bounds.check(leaves)
    with pytest.raises(bounds_lib.OutOfBounds, match=r"leaf \[6\] within \[0, 12\]"):
        plan.bounds.check(dict(leaves, **{"[6]": np.int32(13)}))
