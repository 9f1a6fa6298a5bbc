"""The deployment runtime: the same computation, its client work run as rounds on clients."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context
from fedlang.learning import algorithms, models

from ...learning.test_client_state_algorithms import (
    COHORTS,
    assert_close,
    client_batches,
    ditto,
    numpy_ditto,
    numpy_scaffold,
    scaffold,
)
from ..conftest import POINT, bounds_of, secure_and_plain

SPEC = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}


def _model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.ones([2, 2]) * 0.1},
        apply_fn=lambda p, x: x @ p["w"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
    )


def _client_batches(seed):
    rng = np.random.default_rng(seed)
    n = int(rng.integers(3, 9))
    x = rng.normal(size=(n, 2)).astype(np.float32)
    y = (x[:, 0] > x[:, 1]).astype(np.int32)
    return [{"x": x[i : i + 2], "y": y[i : i + 2]} for i in range(0, n, 2)]


CLIENTS = {f"client{i}": _client_batches(i) for i in range(5)}


def _deployment():
    return deploy.DeploymentContext(
        deploy.LocalRounds({cid: {"train": batches} for cid, batches in CLIENTS.items()})
    )


def test_fedavg_on_clients_equals_the_simulation_runtime():
    process = algorithms.build_weighted_fed_avg(_model_fn, optax.sgd(0.5))
    with fl.runtime.simulation_context():
        state = process.initialize()
        sim_state = state
        for _ in range(3):
            sim_state, sim_metrics = process.next(sim_state, list(CLIENTS.values()))
    with _deployment() as ctx:  # computations called in the block run on the clients
        dep_state = state
        for _ in range(3):
            dep_state, dep_metrics = process.next(dep_state, deploy.client_data("train"))
    assert context.current_stack() == ()
    assert len(ctx.rounds) == 3 and all(r.reports == 5 for r in ctx.rounds)
    for a, b in zip(jax.tree.leaves(process.get_model_weights(dep_state)),
                    jax.tree.leaves(process.get_model_weights(sim_state))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    assert int(dep_metrics["client_work"]["train"]["num_examples"]) == int(
        sim_metrics["client_work"]["train"]["num_examples"]
    )




@fl.jax_computation(fl.SequenceType(POINT))
def _stats(ds):
    return ds.reduce(
        {"s": np.float32(0), "m": np.int32(-1000)},
        lambda st, p: {"s": st["s"] + p["a"], "m": jnp.maximum(st["m"], p["n"])},
    )


@fl.jax_computation({"s": np.float32, "m": np.int32})
def _first(st):
    return st["s"]


@fl.jax_computation({"s": np.float32, "m": np.int32})
def _second(st):
    return st["m"]


@fl.federated_computation(fl.type_at_clients(fl.SequenceType(POINT)), fl.type_at_server(np.float32))
def _summary(data, scale):
    stats = fl.federated_map(_stats, data)
    sums = fl.federated_map(_first, stats)
    return {
        "sum": fl.federated_sum(sums),
        "mean": fl.federated_mean(sums),
        "max": fl.federated_max(fl.federated_map(_second, stats)),
        "scale": scale,
    }


# What `_summary`'s reports hold, declared as a user would: sums of a few points' `a`
# (|a| < 100) and the largest `n` (from -1000, a client without points)
SUMMARY_BOUNDS = deploy.ReportBounds(ranges={
    "[0]": (-100.0, 100.0), "[1].total": (-100.0, 100.0), "[1].count": (0, 1),
    "[2].best": (-1000, 1000)})


def test_one_round_serves_every_aggregation_of_a_wave():
    data = {f"c{i}": [[{"a": np.float32(i + k), "n": np.int32(k * i)} for k in range(3)]] for i in range(4)}
    local = {cid: {"d": batches[0]} for cid, batches in data.items()}
    ctx = deploy.DeploymentContext(deploy.LocalRounds(local), bounds=SUMMARY_BOUNDS)
    with context.with_context(ctx):
        got = _summary(deploy.client_data("d"), np.float32(2.0))
    want = _summary([b[0] for b in data.values()], np.float32(2.0))
    assert len(ctx.rounds) == 1
    for k in ("sum", "mean", "max", "scale"):
        np.testing.assert_allclose(got[k], want[k], rtol=1e-6)


def test_client_values_cannot_come_back_to_the_driver():
    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(POINT)))
    def raw(data):
        return fl.federated_map(_stats, data)

    with context.with_context(_deployment()), pytest.raises(deploy.DeploymentError, match="placed at CLIENTS"):
        raw(deploy.client_data("train"))


def test_the_driver_cannot_pass_client_data_itself():
    with context.with_context(_deployment()), pytest.raises(deploy.DeploymentError, match="client_data"):
        _summary([[{"a": np.float32(1), "n": np.int32(1)}]], np.float32(1.0))


def test_sequence_operations_at_the_server_are_refused_before_running():
    @fl.federated_computation(fl.SequenceType(np.float32))
    def server_sum(ds):
        return fl.sequence_sum(ds)

    with context.with_context(_deployment()), pytest.raises(TypeError, match="deployment runtime cannot run sequence_sum"):
        server_sum([np.float32(1)])


def test_a_task_needing_data_the_client_lacks_says_which():
    ctx = deploy.DeploymentContext(deploy.LocalRounds({"c": {"other": []}}), bounds=SUMMARY_BOUNDS)
    with context.with_context(ctx), pytest.raises(KeyError, match="--data train=PATH"):
        _summary(deploy.client_data("train"), np.float32(1.0))


# ----------------------------------------------------------------------------
# Secure aggregation: inputs are summed by SecAgg+, results equal the simulation's exactly




def test_secure_sums_on_clients_equal_the_simulation_exactly():
    rng = np.random.default_rng(3)
    data = {
        f"c{i}": [{"a": np.float32(0), "n": np.int32(v)} for v in rng.integers(-40, 90, size=4)]
        for i in range(9)
    }
    ctx = deploy.DeploymentContext(deploy.LocalRounds({c: {"d": b} for c, b in data.items()}),
                                   bounds=bounds_of(secure_and_plain))
    with context.with_context(ctx):
        got = secure_and_plain(deploy.client_data("d"))
    want = secure_and_plain(list(data.values()))
    for k in ("bits", "mod", "plain"):
        for name in ("q", "r"):
            np.testing.assert_array_equal(got[k][name], want[k][name])
    assert ctx.rounds[0].reports == 9 and ctx.rounds[0].details["secagg_degree"] >= 2


class _Recording:
    """A round runner that records each plan and runs it with LocalRounds."""

    def __init__(self, clients):
        self.local = deploy.LocalRounds(clients)
        self.plans = []

    def run_round(self, plan, broadcast):
        self.plans.append(plan)
        return self.local.run_round(plan, broadcast)


def test_plain_reports_of_a_secure_round_carry_no_secure_input():
    runner = _Recording({"c": {"d": [{"a": np.float32(0), "n": np.int32(5)}]}})
    with context.with_context(deploy.DeploymentContext(runner, bounds=bounds_of(secure_and_plain))):
        secure_and_plain(deploy.client_data("d"))
    (plan,) = runner.plans
    assert plan.secure == (0, 1)
    # Only federated_sum's partial travels in the plain report; the others go masked.
    assert len(plan.report_type) == 1 and len(plan.aggregate_type) == 3
    assert plan.secure_segments(1) == [(1, 2**6), (3, 2**6), (1, 7), (3, 7)]


def test_dp_over_secure_aggregation_trains_the_same_weights_as_simulation():
    from fedlang import aggregators

    factory = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier=0.5,
        clients_per_round=5,
        clip=1.0,
        record_aggregation_factory=aggregators.SecureSumFactory(1.0, -1.0, bits=20),
    )
    process = algorithms.build_unweighted_fed_avg(_model_fn, optax.sgd(0.5), model_aggregator=factory)
    state = process.initialize()
    with fl.runtime.simulation_context():
        sim_state, _ = process.next(state, list(CLIENTS.values()))
    ctx = _deployment()
    with context.with_context(ctx):
        dep_state, _ = process.next(state, deploy.client_data("train"))
    for a, b in zip(jax.tree.leaves(process.get_model_weights(dep_state)),
                    jax.tree.leaves(process.get_model_weights(sim_state))):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


# ----------------------------------------------------------------------------
# Client state: kept by each client, never in a report; results equal the paper's


def _stateful_rounds(process, name):
    """Runs the learning tests' cohorts (client data changing per round) on LocalRounds,
    yielding after each round (the runner, its context's state and metrics)."""
    runner = _Recording({})
    state = process.initialize()
    for round_num, cohort in enumerate(COHORTS):
        runner.local.clients = {cid: {"train": client_batches(cid, round_num)} for cid in cohort}
        with context.with_context(deploy.DeploymentContext(runner)):
            state, metrics, bound = process.next(
                state, deploy.client_data("train"), deploy.client_state(name))
        assert bound == deploy.client_state(name)
        yield runner, state, metrics


def test_scaffold_on_clients_equals_the_paper_with_each_control_variate_on_its_client():
    process = scaffold()
    rounds = _stateful_rounds(process, "scaffold")
    for cohort, (x, c, c_i), (runner, state, metrics) in zip(COHORTS, numpy_scaffold(), rounds):
        assert int(metrics["client_work"]["diagnostics"]["num_clients"]) == len(cohort)
        weights = process.get_model_weights(state).trainable
        assert_close(weights["w"], x[0], "x.w")
        assert_close(weights["b"], x[1], "x.b")
        assert_close(state.client_work["control_variate"]["w"], c[0], "c.w")
        for cid, (cw, cb) in c_i.items():
            assert_close(runner.local.states[cid]["scaffold"]["w"], cw, f"c_{cid}.w")
            assert_close(runner.local.states[cid]["scaffold"]["b"], cb, f"c_{cid}.b")
    assert len(runner.plans) == len(COHORTS)  # one round per call, reading and writing
    plan = runner.plans[-1]
    assert plan.state.name == "scaffold" and plan.state.writes
    assert plan.state.state_type == process.client_state.state_type
    # the report holds the aggregations' partials only; the state is the task's extra output
    assert len(plan.report_type) == len(plan.aggregations)
    assert len(plan.task.type_signature.result.member) == len(plan.aggregations) + 1
    again = deploy.RoundPlan.from_bytes(plan.to_bytes())
    assert again.state.name == "scaffold" and again.state.state_type == plan.state.state_type
    for a, b in zip(jax.tree.leaves(again.state.initialize()),
                    jax.tree.leaves(process.client_state.initial_state())):
        np.testing.assert_array_equal(a, b)  # a first-seen client starts from c_i = 0


def test_ditto_on_clients_equals_the_paper_with_each_personal_model_on_its_client():
    process = ditto()
    for (w, v, loss), (runner, state, metrics) in zip(numpy_ditto(), _stateful_rounds(process, "v")):
        weights = process.get_model_weights(state).trainable
        assert_close(weights["w"], w[0], "w.w")
        assert_close(weights["b"], w[1], "w.b")
        for cid, (vw, vb) in v.items():
            personal = runner.local.states[cid]["v"].trainable
            assert_close(personal["w"], vw, f"v_{cid}.w")
            assert_close(personal["b"], vb, f"v_{cid}.b")
        assert_close(metrics["client_work"]["personal"]["loss"], loss, "personal loss")


def test_client_state_is_passed_only_for_a_declared_state_parameter():
    with context.with_context(_deployment()), pytest.raises(deploy.DeploymentError, match="with_client_state"):
        _summary(deploy.client_state("x"), np.float32(1.0))
    process = scaffold()
    with context.with_context(_deployment()), pytest.raises(deploy.DeploymentError, match="client_state"):
        process.next(process.initialize(), deploy.client_data("train"), [])
    with pytest.raises(ValueError, match="client state name"):
        deploy.client_state("not a name")


_INTS = fl.TensorType(np.int32, [3])


@fl.jax_computation()
def _no_ints():
    return np.zeros(3, np.int32)


@fl.jax_computation(_INTS, _INTS)
def _add_ints(a, b):
    return a + b


@fl.federated_computation(fl.type_at_clients(_INTS), fl.type_at_clients(_INTS))
def _secure_counts(x, states):
    """Each client's state adds up its inputs; the round sums the new states securely."""
    new = fl.federated_map(_add_ints, fl.federated_zip((states, x)))
    return fl.federated_secure_sum_bitwidth(new, 8), new


secure_counts = fl.with_client_state(_secure_counts, _no_ints, parameter="states", result=1)


@fl.federated_computation(fl.type_at_clients(_INTS))
def _recentred(states):
    """New states need the sum of the old ones: a second round, on other clients."""
    total = fl.federated_sum(states)
    return total, fl.federated_map(_add_ints, fl.federated_zip((states, fl.federated_broadcast(total))))


recentred = fl.with_client_state(_recentred, _no_ints, parameter=0, result=1)


def test_secure_rounds_keep_each_survivor_s_new_state():
    @fl.jax_computation(fl.SequenceType(_INTS))
    def first(ds):
        return ds.reduce(np.zeros(3, np.int32), lambda s, v: s + v)

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(_INTS)), fl.type_at_clients(_INTS))
    def from_data(data, states):
        return secure_counts(fl.federated_map(first, data), states)

    stateful = fl.with_client_state(from_data, _no_ints, parameter="states", result=1)
    clients = {f"c{i}": {"d": [np.array([i, 1, 2], np.int32)]} for i in range(4)}
    runner = deploy.LocalRounds(clients)
    for round_num in (1, 2):
        with context.with_context(deploy.DeploymentContext(runner)):
            total, _ = stateful(deploy.client_data("d"), deploy.client_state("n"))
        want = round_num * np.array([0 + 1 + 2 + 3, 4, 8])
        np.testing.assert_array_equal(total, want)  # the secure sum of the new states
        for i in range(4):
            np.testing.assert_array_equal(runner.states[f"c{i}"]["n"], round_num * np.array([i, 1, 2]))


def test_a_round_reading_states_whose_new_values_need_its_result_is_refused():
    runner = _Recording({"c": {}})
    bounds = deploy.ReportBounds(ranges={"[0]": (-100, 100)})  # the states: small counts
    with context.with_context(deploy.DeploymentContext(runner, bounds=bounds)), \
            pytest.raises(deploy.DeploymentError, match="another round would write"):
        recentred(deploy.client_state("n"))
    assert runner.plans == [] and runner.local.states == {}  # refused before it started
