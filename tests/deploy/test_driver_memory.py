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
    plan, _ = capture(many, data("x"), data("i"), data("w"), data("s"), data("d"))
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
