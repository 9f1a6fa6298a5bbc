"""Bounded reports (issue 23, item 2), replayed against a real `fedlang serve` process on
SQLite and PostgreSQL: a FedAvg round and a FedBuff session, whose plans declare the
default bounds, refuse the issue's three finite attacks (a weight of -1e300, a client
count of 10^6, update values of 1.7e308 and of 1e30) with 400 `out_of_bounds` naming
the leaf, count them, fold nothing of them, and accept the honest reports of the same
clients; and (issue 36, attack 4) a round refuses metric accumulators outside theirs (a
loss sum of +-1e30, an accuracy count of -5, an `update_norm_max` past the clip) while
its honest reports release the simulation's metrics."""

import contextlib
import json

import httpx
import numpy as np
import optax
import pytest

from fedlang import deploy
from fedlang.core import context, serialization, structure
from fedlang.deploy import protocol
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import execution, folding
from fedlang.learning import algorithms

from .. import conftest as deploy_conftest
from ..conftest import capture
from . import conftest as server_conftest
from . import test_intake
from .conftest import bearer

API = "/v1"
SPEC = {"x": (np.float32, [None, 64]), "y": (np.int32, [None])}


def _model():
    import jax.numpy as jnp

    from fedlang.learning import models

    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([64, 10]), "b": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
    )


def _batch(seed):
    rng = np.random.default_rng(seed)
    return {"x": rng.random((8, 64), dtype=np.float32), "y": rng.integers(0, 10, 8).astype(np.int32)}


@pytest.fixture(scope="module")
def fedavg_round():
    process = algorithms.build_weighted_fed_avg(_model, optax.sgd(0.1))
    return capture(process.next, process.initialize(), deploy.client_data("train"))


class Server:
    """A population `pop` on a `fedlang serve` process, three enrolled clients."""

    def __init__(self, proc):
        self.proc = proc
        self.http = httpx.Client(base_url=proc.url, timeout=60)
        self.admin = bearer(proc.admin_token)
        token = self.ok(self.http.post(f"{API}/admin/populations", json={"name": "pop"},
                                       headers=self.admin))["token"]
        self.clients = [self.ok(self.http.post(f"{API}/populations/pop/enroll",
                                               headers=bearer(token)))["credential"]
                        for _ in range(3)]

    @staticmethod
    def ok(r):
        assert r.status_code in (200, 201), r.text
        return r.json()

    def blob(self, data):
        return self.ok(self.http.post(f"{API}/admin/blobs", content=data, headers=self.admin))["hash"]

    def checkin(self):
        for c in self.clients:
            assert self.ok(self.http.post(f"{API}/checkin", headers=bearer(c)))["task"] is not None

    def refusals(self):
        return self.ok(self.http.get(f"{API}/status"))["reports"]["refused"].get("out_of_bounds", 0)

    def put(self, path, client, body, task):
        """`client`'s upload of `body` to `path`, computed for `task` (`{"round": id}`)."""
        bound = {"round": None, "session": None, "version": None, **task}
        header = json.dumps(bound, sort_keys=True, separators=(",", ":"))  # protocol.task_header
        return self.http.put(path, content=body, headers={**bearer(client), "Fedlang-Task": header})

    def refused(self, path, client, body, leaf, task):
        """Asserts that uploading `body` is refused for `leaf`, and counted."""
        before = self.refusals()
        r = self.put(path, client, body, task)
        assert (r.status_code, r.json().get("reason")) == (400, "out_of_bounds"), r.text
        assert leaf in r.json()["detail"], r.json()["detail"]
        assert self.refusals() == before + 1


@pytest.fixture
def server(db_url, server_process):
    s = Server(server_process(db_url).start())
    yield s
    s.http.close()


def _tampered(report, t, paths, changes):
    """`report` (bytes of type `t`) with the leaves at `paths` set as `changes` say."""
    value = structure.to_internal(serialization.deserialize_value(report, expected_type=t), t)
    leaves = [np.array(x) for x in structure.flatten(value, t)]
    for path, fill in changes.items():
        i = paths.index(path)
        leaves[i] = np.full_like(leaves[i], fill)
    return serialization.serialize_value(
        structure.to_python(structure.unflatten(leaves, t), t), t)


def test_a_round_refuses_the_three_attacks_and_folds_only_honest_reports(server, fedavg_round):
    plan, broadcast = fedavg_round
    folder = folding.Folder(plan)
    paths, t = plan.report_paths, folder.report_type
    assert plan.bounds  # the default bounds of the learning algorithms, signed with the plan
    rid = server.ok(server.http.post(f"{API}/admin/rounds", headers=server.admin, json={
        "population": "pop", "plan": server.blob(plan.to_bytes()),
        "broadcast": server.blob(broadcast), "target": 3, "deadline": 600.0}))["id"]
    server.checkin()
    honest = [execution.run_plan(plan, broadcast, {"train": [_batch(i)]}) for i in range(3)]
    path, a = f"{API}/rounds/{rid}/report", server.clients[0]
    (norm,) = plan.bounds.norms  # FedAvg's weighted update, scaled by its weight: an
    weight = norm.scale  # unnamed float sum
    task = {"round": rid}
    for negative in (-3e38, -1.0):  # at float32's range, and a small one
        server.refused(path, a, _tampered(honest[0], t, paths, {weight: negative}), weight, task)
    server.refused(path, a, _tampered(honest[0], t, paths, {"[2].num_clients": 10**6}),
                   "[2].num_clients", task)
    for huge in (3e38, 1e30):
        server.refused(path, a, _tampered(honest[0], t, paths, {norm.leaves[-1]: huge}),
                       ", ".join(norm.leaves), task)
    for c, report in zip(server.clients, honest):
        assert server.ok(server.put(path, c, report, task))["accepted"]
    r = server.ok(server.http.get(f"{API}/admin/rounds/{rid}?wait=30", headers=server.admin))
    assert (r["state"], r["reports"], r["refused"]) == ("closed", 3, 5)
    aggregate = server.http.get(f"{API}/admin/rounds/{rid}/aggregate", headers=server.admin).content
    expected = folder.empty()
    for report in honest:
        expected = folder.fold(expected, folder.check(report))
    assert aggregate == expected  # the honest reports, folded in order; nothing else
    value = serialization.deserialize_value(aggregate, expected_type=plan.aggregate_type)
    assert all(np.isfinite(np.asarray(x, np.float64)).all() for x in
               structure.flatten(structure.to_internal(value, plan.aggregate_type),
                                 plan.aggregate_type))


def test_a_session_refuses_the_three_attacks(server):
    # A raw report holds float32 values: the attacks at float32's range (-1e300 is -inf).
    process = algorithms.build_fed_buff(_model, optax.sgd(0.1), optax.sgd(1.0), buffer_size=3)
    plan = buffered_plan.BufferedPlan.build(process.train, bounds=deploy.ReportBounds())
    paths, t = plan.report_paths, plan.report_type
    assert plan.bounds
    weights_t = plan.weights_type
    w0 = process.get_model_weights(process.initialize())
    weights = serialization.serialize_value(structure.to_python(
        structure.to_internal(w0, weights_t), weights_t), weights_t)
    sid = server.ok(server.http.post(f"{API}/admin/sessions", headers=server.admin, json={
        "population": "pop", "plan": server.blob(plan.to_bytes()),
        "weights": server.blob(weights), "buffer_size": 3, "max_staleness": 1}))["id"]
    server.checkin()
    honest = plan.run(weights, {"train": [_batch(0)]})
    path, a = f"{API}/sessions/{sid}/reports/0", server.clients[0]
    task = {"session": sid, "version": 0}
    server.refused(path, a, _tampered(honest, t, paths, {".update_weight": -3e38}),
                   ".update_weight", task)
    server.refused(path, a, _tampered(honest, t, paths, {".diagnostics.num_clients": 10**6}),
                   ".diagnostics.num_clients", task)
    server.refused(path, a, _tampered(honest, t, paths, {".update.w": 3e38}),
                   ".update.b, .update.w", task)
    server.refused(path, a, _tampered(honest, t, paths, {".stats.loss_sum": -1e30}),
                   ".stats.loss_sum", task)
    assert server.ok(server.put(path, a, honest, task))["accepted"]
    s = server.ok(server.http.get(f"{API}/admin/sessions/{sid}", headers=server.admin))
    assert s["reports"] == 1


def test_bounds_are_checked_and_travel_in_the_signed_plan(fedavg_round):
    plan, _ = fedavg_round
    doc = plan.bounds.to_json()
    (norm,) = plan.bounds.norms
    assert {"leaf": norm.scale, "min": 0.0, "max": 1e6} in doc["ranges"]
    assert {"leaf": "[2].num_clients", "min": 0.0, "max": 1.0} in doc["ranges"]
    assert norm.bound == bounds_lib.DEFAULT_CLIP
    again = type(plan).from_bytes(plan.to_bytes())
    assert again.bounds == plan.bounds
    # the norm bound is on w * u: |w u| <= clip * w, i.e. |u| <= clip
    leaves = {p: np.zeros(1) for p in plan.report_paths}
    leaves["[5]"] = np.int32(1)  # how many clients a report stands for: one
    leaves[norm.scale] = np.float64(3.0)
    leaves[norm.leaves[-1]] = np.full(1, 3.0 * bounds_lib.DEFAULT_CLIP)
    plan.bounds.check(leaves)
    leaves[norm.leaves[-1]] = np.full(1, 3.0 * bounds_lib.DEFAULT_CLIP * 1.001)
    with pytest.raises(bounds_lib.OutOfBounds, match=r"at most 10000 x \[\d\] = 30000"):
        plan.bounds.check(leaves)
    with pytest.raises(ValueError, match="a report leaf among"):
        bounds_lib.ReportBounds(ranges={"[9].nope": (0, 1)}).for_buffered(plan.report_type)
    with pytest.raises(ValueError, match="clip to be a finite number"):
        bounds_lib.ReportBounds(clip=-1)


class _BoundedSecure(test_intake.Secure):
    """test_intake's secure round, its plan declaring a range on the plain `total`."""

    def open_task(self):
        runner = deploy_conftest._Capture()
        bounds = deploy.ReportBounds(ranges={"[1]": (0.0, 10.0)})
        with contextlib.suppress(deploy_conftest._Captured), \
                context.with_context(deploy.DeploymentContext(runner, bounds=bounds)):
            test_intake.secure_count_and_total(deploy.client_data("d"))
        self.plan, self.broadcast = runner.plan, runner.broadcast
        assert self.plan.secure == (0,) and self.plan.report_paths == ["[1]"]
        self.task = self.ok(self.http.post(f"{API}/admin/rounds", headers=self.admin, json={
            "population": "pop", "plan": self.blob(self.plan.to_bytes()),
            "broadcast": self.blob(self.broadcast), "target": 3, "deadline": 600.0,
            "stage_timeout": 100.0,
        }))["id"]


def test_a_secure_rounds_plain_report_is_bounded_too(db_url, server_factory):
    # The masked input is bounded by its modulus; the plain report with it by the plan.
    clock = server_conftest.Clock()
    h = _BoundedSecure(server_factory(db=db_url, clock=clock), clock)
    try:
        far = protocol.pack_masked_input(h.parts("a", 100.0).report, h.masked["a"])
        test_intake.refused(h, lambda: h.put("a", far), 400, "out_of_bounds")
        assert "[1] within [0, 10]" in h.put("a", far).json()["detail"]
        assert h.put("a", h.good("a")).status_code == 200
        assert h.accepted() == 1
    finally:
        h.http.close()


def _metered_model():
    import jax.numpy as jnp

    from fedlang.learning import models

    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.zeros([64, 10]), "b": jnp.zeros([10])},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


def test_a_round_refuses_metric_leaves_outside_their_bounds_and_equals_the_simulation(server):
    # Issue 36's attack 4: a loss sum of +-1e30, an accuracy count of -5, an update norm
    # maximum past clip; each refused for its leaf and bound, counted, nothing folded.
    from fedlang import runtime

    process = algorithms.build_weighted_fed_avg(_metered_model, optax.sgd(0.1))
    state = process.initialize()
    plan, broadcast = capture(process.next, state, deploy.client_data("train"))
    folder = folding.Folder(plan)
    paths, t = plan.report_paths, folder.report_type
    rid = server.ok(server.http.post(f"{API}/admin/rounds", headers=server.admin, json={
        "population": "pop", "plan": server.blob(plan.to_bytes()),
        "broadcast": server.blob(broadcast), "target": 3, "deadline": 600.0}))["id"]
    server.checkin()
    data = [[_batch(i)] for i in range(3)]
    honest = [execution.run_plan(plan, broadcast, {"train": d}) for d in data]
    path, a = f"{API}/rounds/{rid}/report", server.clients[0]
    # 8 examples, at most 1e6 each (`DEFAULT_PER_EXAMPLE`)
    examples = "[-1e+06, 1e+06] x [1].num_examples = [-8e+06, 8e+06]"
    task = {"round": rid}
    for leaf, value, bound in [("[1].loss_sum", 1e30, examples),
                               ("[1].loss_sum", -1e30, examples),
                               ("[1].metrics.accuracy.count", -5, "[0, 1e+06]"),
                               ("[3].best", 1e30, "[0, 10000.1]")]:
        server.refused(path, a, _tampered(honest[0], t, paths, {leaf: value}),
                       f"leaf {leaf} within {bound}", task)
    for c, report in zip(server.clients, honest):
        assert server.ok(server.put(path, c, report, task))["accepted"]
    r = server.ok(server.http.get(f"{API}/admin/rounds/{rid}?wait=30", headers=server.admin))
    assert (r["state"], r["reports"], r["refused"]) == ("closed", 3, 4)
    aggregate = server.http.get(f"{API}/admin/rounds/{rid}/aggregate", headers=server.admin).content
    expected = folder.empty()
    for report in honest:
        expected = folder.fold(expected, folder.check(report))
    assert aggregate == expected  # the honest reports, folded in order; nothing else
    # ... whose released metrics are the simulation's
    value = structure.to_internal(
        serialization.deserialize_value(aggregate, expected_type=plan.aggregate_type),
        plan.aggregate_type)
    stats = dict(zip([p for p in paths if p.startswith("[1]")],
                     structure.flatten(value[1], plan.aggregate_type[1])))
    with runtime.simulation_context():
        _, metrics = process.next(state, data)
    train = metrics["client_work"]["train"]
    assert int(stats["[1].num_examples"]) == int(train["num_examples"]) == 24
    np.testing.assert_allclose(float(stats["[1].loss_sum"]) / 24, train["loss"], rtol=1e-5)
    np.testing.assert_allclose(float(stats["[1].metrics.accuracy.correct"])
                               / float(stats["[1].metrics.accuracy.count"]),
                               train["accuracy"], rtol=1e-6)
