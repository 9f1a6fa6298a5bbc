"""Reports travel in the model's dtype (issue 40, item 3): a client's report holds each
tensor as its model holds it (float32 for a float32 model), and only the server's
aggregate is wide (float64 totals); the fold is the same to the bit."""

import jax
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization, structure
from fedlang.deploy.plans import execution, folding

from .conftest import capture
from .server.conftest import Clock
from .server.test_rounds import Setup

N = 512  # values per tensor: a report is mostly its tensors


def _computation(dtype):
    """Per client the sum of its rows (`N` values of `dtype`) and their number, then a
    sum, a mean and a weighted mean of the sums over clients (a sum only, for integers:
    means are of floats)."""
    row = fl.TensorType(dtype, [N])

    @fl.jax_computation(fl.SequenceType(row))
    def total(ds):
        return ds.reduce(np.zeros(N, dtype), lambda s, x: s + x)

    @fl.jax_computation(fl.SequenceType(row))
    def count(ds):
        return ds.reduce(np.float32(0), lambda n, x: n + np.float32(1))

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(row)))
    def three(data):
        totals, weights = fl.federated_map(total, data), fl.federated_map(count, data)
        if np.dtype(dtype).kind == "i":
            return {"sum": fl.federated_sum(totals)}
        return {"sum": fl.federated_sum(totals), "mean": fl.federated_mean(totals),
                "weighted": fl.federated_mean(totals, weights)}

    return three


def _bounds(dtype):
    """What `_computation(dtype)`'s reports hold, declared as a user would: a client sums
    at most 5 of `_clients`' rows (integers within +-100, or 10 x normal draws)."""
    ranges = {"[0]": (-1e4, 1e4)}
    if np.dtype(dtype).kind != "i":
        ranges.update({"[1].total": (-1e4, 1e4), "[1].count": (0, 1)})
    return deploy.ReportBounds(ranges=ranges)


def _clients(dtype, n=5):
    rng = np.random.default_rng(0)
    # within the default bounds (`ReportBounds`: a weighted total's norm <= 1e4 x weight)
    draw = (lambda k: rng.integers(-100, 100, (k, N))) if np.dtype(dtype).kind == "i" \
        else (lambda k: rng.normal(size=(k, N)) * 10)
    return {f"c{i}": [r.astype(dtype) for r in draw(int(rng.integers(1, 6)))] for i in range(n)}


def _wide(folder, report):
    """`report` as clients sent it before: each partial in the aggregate's wide type."""
    value = structure.to_internal(
        serialization.deserialize_value(report, expected_type=folder.report_type),
        folder.report_type)
    wide = []
    for i, partial in zip(folder.plain, value):
        acc = folder.plan.aggregations[i].make()
        acc.merge(partial)
        wide.append(acc.partial())
    t = folder.wide_report_type
    return serialization.serialize_value(structure.to_python(tuple(wide), t), t)


def _x64(dtype):
    # a float64 model's JAX programs need 64-bit JAX; the others run as the suite does
    return jax.enable_x64(np.dtype(dtype).itemsize == 8)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, np.float64])
def test_a_report_holds_the_model_s_dtype_and_its_fold_is_the_simulation_s(dtype):
    with _x64(dtype):
        comp, clients = _computation(dtype), _clients(dtype)
        plan, broadcast = capture(comp, deploy.client_data("train"), bounds=_bounds(dtype))
        folder = folding.Folder(plan)
        # the report's totals are in the model's dtype; counts and weights as before; the
        # aggregate stays wide (it sums many clients): float64, or int64 for integers
        wide = np.int64 if np.dtype(dtype).kind == "i" else np.float64
        paths = ["[0]", "[1].total", "[1].count", "[2].total", "[2].weight"]
        want = {"[0]": (dtype, wide), "[1].total": (dtype, wide), "[1].count": (np.int64,) * 2,
                "[2].total": (dtype, wide), "[2].weight": (np.float64,) * 2}
        assert plan.report_paths == paths[:1 if np.dtype(dtype).kind == "i" else 5]
        for path, narrow, agg in zip(plan.report_paths, structure.leaf_types(plan.report_type),
                                     structure.leaf_types(plan.aggregate_type)):
            assert (narrow.dtype, agg.dtype) == tuple(np.dtype(d) for d in want[path]), path

        # folded from narrow reports: the same bytes as from the wide partials of before
        reports = [execution.run_plan(plan, broadcast, {"train": rows}) for rows in clients.values()]
        narrow, before = folder.empty(), folder.accumulators()
        for report in reports:
            narrow = folder.fold(narrow, folder.check(report))
            old = folding.decode(_wide(folder, report), folder.wide_report_type, None, "a report")
            for i, partial in zip(folder.plain, structure.to_internal(old, folder.wide_report_type)):
                before[i].merge(partial)
        assert narrow == folder.serialize(before)

        # a deployment round equals the simulation runtime, one client per chunk, to the bit
        ctx = deploy.DeploymentContext(deploy.LocalRounds({c: {"train": r} for c, r in clients.items()}),
                                       bounds=_bounds(dtype))
        with context.with_context(ctx):
            got = comp(deploy.client_data("train"))
        with fl.runtime.simulation_context(chunk_size=1):
            want = comp(list(clients.values()))
    assert len(ctx.rounds) == 1 and ctx.rounds[0].reports == len(clients)
    assert set(got) == set(want)
    for key in want:
        assert np.asarray(got[key]).dtype == np.dtype(dtype)
        np.testing.assert_array_equal(got[key], want[key])


def test_a_float32_report_is_the_size_of_the_model_not_twice_it():
    comp = _computation(np.float32)
    plan, broadcast = capture(comp, deploy.client_data("train"), bounds=_bounds(np.float32))
    folder = folding.Folder(plan)
    report = execution.run_plan(plan, broadcast, {"train": _clients(np.float32)["c0"]})
    model = 3 * N * 4  # the float32 totals of the sum, the mean and the weighted mean
    assert folder.max_report_bytes == model + 8 + 8  # the mean's count, the weight
    assert model < len(report) < 1.2 * model  # the rest: the header and the frame
    assert 2 * model < len(_wide(folder, report))  # what it was


def test_a_report_in_the_old_wide_format_is_refused_as_malformed(server_factory, sum_round):
    # arrange: a round of `vector_sum` (float32[3]) and a client assigned to it
    folder = folding.Folder(sum_round[0])
    s = Setup(server_factory(clock=Clock()), sum_round)
    try:
        (client, *_) = s.clients
        s.checkin(client)
        honest = s.report([1, 2, 3])
        old = _wide(folder, honest)
        # act: the wide report, then the honest one
        refused = s.put(client, old)
        accepted = s.put(client, honest)
    finally:
        s.http.close()
    # assert: a 400 naming the tensor and both dtypes; the honest report still taken
    assert (refused.status_code, refused.json()["reason"]) == (400, "malformed"), refused.text
    detail = refused.json()["detail"]
    assert "in the model's dtype" in detail and "[0] is float64[3], not float32[3]" in detail
    assert "Update the client" in detail
    assert accepted.status_code == 200, accepted.text
    with pytest.raises(folding.ReportError, match="wide format of older clients") as e:
        folder.check(old)
    assert e.value.reason == "malformed"
