"""The driver's rounds without model-sized copies: results made a slice at a time (in the
aggregate's own memory when the driver owns it), the broadcast sent from the arrays'
memory, the aggregate not kept. Each is bit for bit what it replaces."""

import gc

import numpy as np
import optax
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import context, serialization, structure
from fedlang.deploy.client import connection
from fedlang.deploy.driver import context as context_lib
from fedlang.deploy.plans import bounds, folding
from fedlang.learning import algorithms, models

from .conftest import capture

BIG = bounds.SLICE + 12_345  # elements: more than one slice (of either size), the last partial


def _sums(n):
    x_t = fl.TensorType(np.float32, [n])

    @fl.federated_computation(
        fl.type_at_clients(x_t),
        fl.type_at_clients(fl.TensorType(np.int32, [n])),
        fl.type_at_clients(fl.TensorType(np.float32)),
        fl.type_at_clients(fl.TensorType(np.float32, [3])),
        fl.type_at_clients(fl.TensorType(np.float64, [n])),
    )
    def many(x, i, w, small, d):
        return (fl.federated_sum(x), fl.federated_sum(i), fl.federated_mean(x),
                fl.federated_mean(x, w), fl.federated_max(small),
                fl.federated_sum((small, w)), fl.federated_mean(d))

    data = deploy.client_data
    # the values are drawn (the point is the memory results take): the leaves no bound is
    # derived for are accepted finite, declared as a user would
    bounds = deploy.ReportBounds(unbounded=("[0]", "[1]", "[2].total", "[2].count", "[4].best",
                                            "[5][0]", "[5][1]", "[6].total", "[6].count"))
    plan, _ = capture(many, data("x"), data("i"), data("w"), data("s"), data("d"), bounds=bounds)
    return folding.Folder(plan)


def _aggregate(folder, seed, count=3, weight=2.5):
    """An aggregate of `folder`'s round as the server would store it (values drawn)."""
    rng = np.random.default_rng(seed)
    value = []
    for t in folder.aggregate_type.types:
        leaves = []
        for lt in structure.leaf_types(t):
            shape = tuple(lt.shape)
            if np.dtype(lt.dtype).kind == "f":
                x = rng.normal(scale=1e3, size=shape)
            elif np.dtype(lt.dtype).kind == "b":
                x = np.ones(shape, bool)
            else:
                x = rng.integers(-1000, 1000, size=shape)
            leaves.append(np.asarray(x, lt.dtype))
        value.append(structure.unflatten(leaves, t))
    for i, t in enumerate(folder.aggregate_type.types):  # the counts and weights asked for
        names = getattr(t, "names", ())
        if "count" in names:
            value[i] = (value[i][0], np.int64(count))
        if "weight" in names:
            value[i] = (value[i][0], np.float64(weight))
    python = structure.to_python(tuple(value), folder.aggregate_type)
    return serialization.serialize_value(python, folder.aggregate_type)


def _same_bits(got, want):
    got_leaves, want_leaves = (
        [np.asarray(x) for x in __import__("jax").tree.leaves(v)] for v in (got, want))
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert g.tobytes() == w.tobytes()


@pytest.mark.parametrize("count,weight", [(3, 2.5), (0, 0.0), (7, -0.0)])
@pytest.mark.parametrize("reuse", [False, True])
def test_results_a_slice_at_a_time_are_the_results_bit_for_bit(count, weight, reuse):
    # arrange: sums, means and weighted means over more than a slice, with and without
    # reports (a mean of none is empty; a weight of zero gives NaN), and a max
    folder = _sums(BIG)
    data = _aggregate(folder, seed=count, count=count, weight=weight)
    want = folder.results(data)

    # act
    got = folding.results_sliced(folder, bytearray(data) if reuse else data, reuse=reuse)

    # assert
    assert [type(r) for r in got] == [type(r) for r in want]
    for g, w in zip(got, want):
        _same_bits(g, w)


def test_results_reusing_the_aggregate_keep_only_their_own_bytes_of_it():
    # arrange
    folder = _sums(BIG)
    aggregate = bytearray(_aggregate(folder, seed=1))
    size = len(aggregate)

    # act
    results = folding.results_sliced(folder, aggregate, reuse=True)

    # assert: the large results are views of what is left of the aggregate, which holds
    # them and no more (alignment aside)
    large = [x for x in __import__("jax").tree.leaves(results) if np.size(x) > bounds.SLICE]
    assert len(large) == 5
    assert all(not x.flags.owndata and x.base is not None for x in large)
    assert sum(x.nbytes for x in large) <= len(aggregate) <= sum(x.nbytes for x in large) + 5 * 64
    assert len(aggregate) < 0.65 * size  # float32 results of float64 totals, but one mean
    assert all(x.ctypes.data % 64 == 0 for x in large)


def test_results_of_a_malformed_aggregate_are_refused_as_results_refuses_them():
    folder = _sums(10)
    data = bytearray(_aggregate(folder, seed=2))
    data[-1] ^= 1  # the checksum
    with pytest.raises(folding.ReportError, match="an aggregate"):
        folder.results(bytes(data))
    with pytest.raises(folding.ReportError, match="an aggregate"):
        folding.results_sliced(folder, data, reuse=True)


def test_a_frame_from_the_arrays_memory_is_the_bytes_serialize_value_writes():
    t = fl.to_type({"w": fl.TensorType(np.float32, [300, 7001]), "b": fl.TensorType(np.float64, [3]),
                    "n": fl.TensorType(np.int32), "on": fl.TensorType(np.bool_, [2]),
                    "c": fl.TensorType(np.complex64, [2, 2])})
    rng = np.random.default_rng(0)
    value = {"w": rng.normal(size=(300, 7001)).astype(np.float32),
             "b": np.arange(3.0), "n": np.int32(7), "on": np.array([True, False]),
             "c": (rng.normal(size=(2, 2)) + 1j).astype(np.complex64)}
    internal = structure.to_internal(value, t)

    parts = context_lib.FrameParts(internal, t)

    want = serialization.serialize_value(value, t)
    assert parts.size == len(want)
    assert b"".join(parts) == want
    assert b"".join(parts) == want  # a retried upload sends the same bytes
    assert max(memoryview(p).nbytes for p in parts) <= connection.PIECE
    assert any(np.shares_memory(np.frombuffer(p, np.uint8), internal[4]) for p in parts)


def test_a_value_not_of_dense_tensors_has_no_frame_parts():
    t = fl.to_type(fl.SequenceType(fl.TensorType(np.float32, [2])))
    with pytest.raises(TypeError, match="dense tensors"):
        context_lib.FrameParts([], t)


def _wide_fed_avg(d_in):
    spec = {"x": (np.float32, [None, d_in]), "y": (np.int32, [None])}

    def model_fn():
        return models.FunctionalModel(
            init_fn=lambda rng: {"w": np.full([d_in, 4], 0.01, np.float32)},
            apply_fn=lambda p, x: x @ p["w"],
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y).mean(),
            input_spec=spec,
        )

    return algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1))


def _train(i, d_in):
    rng = np.random.default_rng(i)
    return [{"x": rng.normal(size=(3, d_in)).astype(np.float32),
             "y": rng.integers(0, 4, 3).astype(np.int32)}]


def test_server_rounds_stream_and_give_the_local_rounds_results(server_factory, client_threads):
    # arrange: a model of more than a slice, so that its update's result is made in the
    # downloaded aggregate's memory and its broadcast is sent from its arrays
    d_in = bounds.SLICE // 4 + 1000
    process = _wide_fed_avg(d_in)
    clients = {f"c{i}": {"train": _train(i, d_in)} for i in range(2)}
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    errors = [client_threads(deploy.Client(server.url, "pop", token, data, backoff=(0.02, 0.2)))
              for data in clients.values()]
    local = deploy.DeploymentContext(deploy.LocalRounds(clients))
    remote = deploy.deployment_context(server.url, server.admin_token, "pop", target=2)
    assert isinstance(remote.runner, context_lib.StreamingRoundRunner)
    assert not isinstance(local.runner, context_lib.StreamingRoundRunner)

    # act: two rounds each (the second from the first's streamed results)
    with context.with_context(local):
        want = process.initialize()
        for _ in range(2):
            want, want_metrics = process.next(want, deploy.client_data("train"))
    with context.with_context(remote):
        got = process.initialize()
        for _ in range(2):
            got, got_metrics = process.next(got, deploy.client_data("train"))
    remote.runner.finish()
    remote.close()

    # assert: the same bits (the clients' reports do not depend on who runs the round)
    _same_bits(process.get_model_weights(got), process.get_model_weights(want))
    _same_bits(got_metrics, want_metrics)
    assert [r.reports for r in remote.rounds] == [2, 2]
    assert all(r.aggregate == b"" for r in remote.rounds + local.rounds)  # not kept
    assert not any(errors)


def test_a_large_round_collects_the_garbage_it_left(monkeypatch):
    # arrange: a runner that leaves a cycle holding a model-sized array (as the lazy
    # graph of an invocation does)
    collected = []
    monkeypatch.setattr(gc, "collect", lambda *a: collected.append(a) or 0)
    ctx = deploy.DeploymentContext(deploy.LocalRounds({"c": {"x": [np.float32(1)]}}))
    ctx._garbage = context_lib.COLLECT_BYTES

    # act
    ctx._collect_garbage()
    ctx._collect_garbage()

    # assert: once, and the count starts over
    assert len(collected) == 1 and ctx._garbage == 0


# -- the driver's peak memory, a process of its own (issue 40)

_DRIVER = """
import json, pathlib, sys
import numpy as np, optax
from fedlang import deploy
from fedlang.learning import algorithms, models

url, token, d_in, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
spec = {"x": (np.float32, [None, d_in]), "y": (np.int32, [None])}
process = algorithms.build_weighted_fed_avg(lambda: models.FunctionalModel(
    init_fn=lambda rng: {"w": np.full([d_in, 4], 0.01, np.float32)},
    apply_fn=lambda p, x: x @ p["w"],
    loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
    input_spec=spec), optax.sgd(0.1))


def status():
    lines = pathlib.Path("/proc/self/status").read_text().splitlines()
    return {k: int(v.split()[0]) * 1024 for k, v in (l.split(":", 1) for l in lines)
            if k in ("VmRSS", "VmHWM")}


def peak():
    now = status()
    return max(now["VmHWM"], now["VmRSS"])


state = process.initialize()  # the idle driver holds the model, as bench/big_models.py's
pathlib.Path("/proc/self/clear_refs").write_text("5")  # VmHWM from here
idle = status()["VmRSS"]
runner_peaks = []
with deploy.deployment_context(url, token, "pop", target=1, patience=120) as ctx:
    run_round_parts = ctx.runner.run_round_parts

    def measured(plan, broadcast):  # the runner's part: broadcast sent, results read
        before = peak()
        pathlib.Path("/proc/self/clear_refs").write_text("5")
        start = status()["VmRSS"]
        try:
            return run_round_parts(plan, broadcast)
        finally:
            runner_peaks.append(peak() - start)
            pathlib.Path("/proc/self/clear_refs").write_text("5")
            rounds_peaks.append(before)  # (the peak before it, kept)

    rounds_peaks = []
    ctx.runner.run_round_parts = measured
    for _ in range(rounds):
        state, _ = process.next(state, deploy.client_data("train"))
    ctx.runner.finish()
print(json.dumps({"idle": idle, "runner": max(runner_peaks),
                  "round": max([peak(), *rounds_peaks, *(p + idle for p in runner_peaks)])}))
"""


@pytest.mark.slow
def test_the_driver_reads_a_large_rounds_results_in_one_model_size(
        server_factory, client_threads, tmp_path):
    # arrange: FedAvg of a float32 model of S = 128 MiB (`w`: [8 Mi, 4]), a real server
    # and a client in this process, the driver a process of its own (its memory alone)
    import json
    import os
    import pathlib
    import subprocess
    import sys

    size = 128 << 20
    d_in = size // 16
    server = server_factory()
    with deploy.Admin(server.url, server.admin_token) as admin:
        token = admin.create_population("pop")
    errors = client_threads(deploy.Client(server.url, "pop", token, {"train": _train(0, d_in)},
                                          backoff=(0.02, 0.2)))
    script = tmp_path / "driver.py"
    script.write_text(_DRIVER)
    src = pathlib.Path(fl.__file__).resolve().parents[1]  # the sources under test

    # act: two rounds, as bench/big_models.py runs them
    done = subprocess.run(
        [sys.executable, str(script), server.url, server.admin_token, str(d_in), "2"],
        capture_output=True, text=True, timeout=500, env={**os.environ, "PYTHONPATH": str(src)})

    # assert: while the runner sends the broadcast and reads the results, the driver
    # adds the results (1 x S, float32) and pieces in flight, never the float64
    # aggregate (2 x S). (The round as a whole peaks later, in FedAvg's server
    # computations: the sum's result, its division by the weight and the new weights,
    # about 3 x S over idle, held by the lazy evaluation until the invocation ends.)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    runner = got["runner"] / size
    whole = (got["round"] - got["idle"]) / size
    assert runner <= 1.25, f"the driver's rounds added {runner:.2f} x S reading results"
    assert whole <= 3.5, f"the driver peaked at {whole:.2f} x S over idle in its rounds"
    assert not any(errors)
