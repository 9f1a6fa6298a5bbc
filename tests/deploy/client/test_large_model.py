"""A large model through a client (issue 40): the broadcast read into the model's own
aligned tensors as it downloads, the report written a slice at a time, the upload sent
in pieces; every byte the same as the whole-value path's."""

import hashlib

import jax
import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import errors, serialization
from fedlang.deploy.client import connection
from fedlang.deploy.plans import execution

from ..conftest import capture
from .test_connection import FakeTime, _CuttingServer

N = 2_501  # values per tensor: slices of 1,000 (below) leave a tail


def _round():
    """(plan, broadcast) of a round of a sum, a mean and a weighted mean of each
    client's update (its rows' sum, plus the broadcast model) and a max of its count."""
    row = fl.TensorType(np.float32, [N])
    model_t = fl.to_type({"w": fl.TensorType(np.float32, [N]), "b": np.float32})

    @fl.jax_computation(model_t, fl.SequenceType(row))
    def update(model, ds):
        return ds.reduce(model["w"] * model["b"], lambda s, x: s + x)

    @fl.jax_computation(fl.SequenceType(row))
    def count(ds):
        return ds.reduce(np.float32(0), lambda n, x: n + np.float32(1))

    @fl.federated_computation(fl.type_at_server(model_t),
                              fl.type_at_clients(fl.SequenceType(row)))
    def four(model, data):
        updates = fl.federated_map(update, (fl.federated_broadcast(model), data))
        weights = fl.federated_map(count, data)
        return {"sum": fl.federated_sum(updates), "mean": fl.federated_mean(updates),
                "weighted": fl.federated_mean(updates, weights),
                "max": fl.federated_max(weights)}

    rng = np.random.default_rng(0)
    model = {"w": rng.normal(size=N).astype(np.float32), "b": np.float32(-0.5)}
    # the rows hold 1e38, NaN and infinities (the point is how a report is streamed): the
    # leaves no bound is derived for are accepted finite, declared as a user would
    bounds = deploy.ReportBounds(unbounded=("[0]", "[1].total", "[1].count", "[3].best"))
    return capture(four, model, deploy.client_data("train"), bounds=bounds)


def _rows():
    rng = np.random.default_rng(1)
    rows = (rng.normal(size=(3, N)) * 10).astype(np.float32)
    rows[0, :7] = [np.nan, np.inf, -np.inf, -0.0, 0.0, 1e38, -1e-45]
    return {"train": list(rows)}


def test_a_report_made_a_slice_at_a_time_is_the_whole_report_to_the_bit(monkeypatch):
    # arrange
    plan, broadcast = _round()
    monkeypatch.setattr(execution, "SMALL", 1 << 62)  # no aggregation sliced
    whole = execution.run_plan(plan, broadcast, _rows())
    # act: every aggregation but the max sliced, in slices of 1,000 values
    monkeypatch.setattr(execution, "SMALL", 0)
    monkeypatch.setattr(execution, "SLICE", 1_000)
    sliced = execution.run_plan(plan, broadcast, _rows())
    # assert
    assert isinstance(sliced, bytearray) and not isinstance(whole, bytearray)
    assert bytes(sliced) == whole


def test_a_broadcast_read_as_it_arrives_is_the_deserialized_value_in_aligned_tensors():
    plan, broadcast = _round()
    layout = execution.broadcast_layout(plan)
    assert layout is not None
    scan = execution.BroadcastScan(layout)
    for start in range(0, len(broadcast), 777):  # pieces that cut tensors anywhere
        scan.feed(broadcast[start:start + 777])
    got = scan.value()
    want = serialization.deserialize_value(broadcast, expected_type=plan.broadcast_type)
    assert jax.tree_util.tree_structure(got) == jax.tree_util.tree_structure(want)
    for x, y in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)):
        assert type(x) is type(y) and np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(x, y)
    assert (execution.run_plan(plan, scan, _rows())
            == execution.run_plan(plan, broadcast, _rows()))


def test_a_large_tensor_of_a_broadcast_is_read_into_an_aligned_buffer():
    t = fl.to_type({"w": fl.TensorType(np.float32, [100_003]), "flag": np.bool_})
    value = {"w": np.arange(100_003, dtype=np.float32), "flag": np.bool_(True)}
    scan = execution.BroadcastScan(serialization.dense_layout(t))
    scan.feed(serialization.serialize_value(value, t))
    got = scan.value()
    assert got["w"].ctypes.data % 64 == 0  # XLA:CPU reads it in place, not a copy
    np.testing.assert_array_equal(got["w"], value["w"])
    assert got["flag"] == np.bool_(True) and got["flag"].dtype == np.bool_


def test_a_broadcast_of_another_type_or_damaged_is_refused_as_it_arrives(sum_round):
    plan, broadcast = _round()
    layout = execution.broadcast_layout(plan)
    assert layout is not None
    other = execution.BroadcastScan(layout)
    with pytest.raises(errors.SerializationError, match="of type"):
        other.feed(sum_round[1])  # the header says float32[3]: refused before any tensor
    damaged = bytearray(broadcast)
    damaged[-6] ^= 1  # in the last tensor's bytes (before the 4 of the checksum)
    scan = execution.BroadcastScan(layout)
    with pytest.raises(errors.SerializationError, match="checksum"):
        scan.feed(damaged)
        scan.value()


@pytest.mark.parametrize("ranges", [True, False])
def test_a_broadcast_cut_part_way_is_read_on_from_the_bytes_received(ranges):
    # arrange: a server that cuts the first answer half way
    plan, broadcast = _round()
    layout = execution.broadcast_layout(plan)
    want = serialization.deserialize_value(broadcast, expected_type=plan.broadcast_type)
    server = _CuttingServer(broadcast, cut_at=len(broadcast) // 2, ranges=ranges)
    t = FakeTime()
    c = connection.Connection(server.url, sleep=t.sleep, clock=t.clock)
    made = []

    def reader(size):
        made.append(execution.BroadcastScan(layout))
        return made[-1]

    try:
        # act
        scan = c.download_into("/value", reader,
                               expected_hash=hashlib.sha256(broadcast).hexdigest())
    finally:
        c.close()
        server.close()
    # assert: one reader, fed on; a value sent again from its start goes to a new one
    assert len(made) == (1 if ranges else 2) and scan is made[-1]
    for x, y in zip(jax.tree_util.tree_leaves(scan.value()), jax.tree_util.tree_leaves(want)):
        np.testing.assert_array_equal(x, y)


def test_a_body_is_sent_in_pieces_of_its_bytes_again_on_each_try():
    data = bytearray(np.random.default_rng(0).bytes(2 * connection.PIECE + 5))
    body = connection.Body(data)
    assert body.headers == {"Content-Length": str(len(data))}
    for _ in range(2):  # a retry iterates it again
        pieces = list(body)
        assert [len(p) for p in pieces] == [connection.PIECE, connection.PIECE, 5]
        assert b"".join(pieces) == data
