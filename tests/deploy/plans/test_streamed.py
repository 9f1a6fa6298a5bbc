"""A large model's reports checked as they arrive and folded from storage a slice at a
time (issue 40): the same checks, refusals and aggregate, to the byte, as a report held
whole (`Folder.check`, `Folder.fold`)."""

import struct
import zlib

import numpy as np
import pytest

import fedlang as fl
from fedlang import deploy
from fedlang.core import serialization
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import execution, folding

from ..conftest import capture
from ..test_report_dtype import _bounds, _clients, _computation


@pytest.fixture(scope="module")
def rounds():
    """(folder, broadcast, plan, reports) of the sum, mean and weighted mean of float32[512]."""
    plan, broadcast = capture(_computation(np.float32), deploy.client_data("train"),
                              bounds=_bounds(np.float32))
    reports = [execution.run_plan(plan, broadcast, {"train": rows})
               for rows in _clients(np.float32).values()]
    return folding.Folder(plan), reports


@pytest.fixture(autouse=True)
def small_leaves_summarised(monkeypatch):
    # the tensors here are 2 KB: summarise them as a model's would be
    monkeypatch.setattr(folding, "SMALL_LEAF", 64)


def _scan(folder, data, piece):
    scan = folder.scan()
    for start in range(0, len(data), piece):
        scan.feed(data[start:start + piece])
    return scan.result()


def _stored(datas):
    """`read` over frames held in a list, by index (what the store's chunks give)."""
    return lambda handle, start, stop: bytes(datas[handle][start:stop])


@pytest.mark.parametrize("piece", [1, 7, 4096, 10**9])
def test_a_scanned_report_is_checked_and_folded_as_one_held_whole(rounds, piece):
    folder, reports = rounds
    assert folder.streamable
    for report in reports[:2] if piece == 1 else reports:
        scanned = _scan(folder, report, piece)
        held = folder.check(report)
        # the bounds see the same leaves: equal summaries, and the small ones equal
        for path, leaf in folder.leaves(scanned.value).items():
            whole = folder.leaves(held)[path]
            if isinstance(leaf, bounds_lib.Summary):
                want = bounds_lib.Summary.of(whole)
                assert (leaf.size, leaf.low, leaf.high, leaf.finite) == (
                    want.size, want.low, want.high, want.finite)
                assert leaf.sumsq == pytest.approx(want.sumsq, rel=1e-12)
            else:
                np.testing.assert_array_equal(leaf, whole)
        folder.check_bounds(scanned.value)
    # folded from storage a slice at a time: the aggregate `fold` makes, byte for byte
    aggregate = folder.empty()
    for report in reports:
        aggregate = folder.fold(aggregate, folder.check(report))
    frames = [folder.empty(), *reports]
    stored = b"".join(bytes(p) for p in folder.fold_stored(
        _stored(frames), 0, [], list(range(1, len(frames)))))
    assert stored == aggregate
    # and a shard (an aggregate of some reports) folds in as an aggregate
    half = folder.empty()
    for report in reports[:2]:
        half = folder.fold(half, folder.check(report))
    frames = [folder.empty(), half, *reports[2:]]
    stored = b"".join(bytes(p) for p in folder.fold_stored(
        _stored(frames), 0, [1], list(range(2, len(frames)))))
    assert stored == aggregate


def test_the_empty_aggregate_made_in_slices_is_the_empty_aggregate(rounds):
    folder, _ = rounds
    assert b"".join(bytes(p) for p in folder.empty_parts()) == folder.empty()


def _refusal(folder, data):
    with pytest.raises(folding.ReportError) as e:
        _scan(folder, data, 1000)
    return e.value


def test_a_scanned_report_is_refused_as_a_held_one_would_be(rounds):
    folder, reports = rounds
    report = bytes(reports[0])
    # cut, damaged, or trailing bytes: malformed
    assert _refusal(folder, report[:-100]).reason == "malformed"
    damaged = bytearray(report)
    damaged[len(report) // 2] ^= 0x40
    assert _refusal(folder, bytes(damaged)).reason == "malformed"
    assert _refusal(folder, report + b"\0").reason == "malformed"
    # another type (int32 tensors): malformed, from its header, before any tensor
    other, broadcast = capture(_computation(np.int32), deploy.client_data("train"),
                               bounds=_bounds(np.int32))
    ints = execution.run_plan(other, broadcast, {"train": _clients(np.int32)["c0"]})
    refused = _refusal(folder, ints)
    assert refused.reason == "malformed" and "int32" in str(refused)
    # a NaN in a large tensor: non_finite; values beyond the plan's norm: out_of_bounds
    layout = serialization.dense_layout(folder.report_type)
    at = layout.offsets[0] + 3 * 4
    poisoned = bytearray(report)
    poisoned[at:at + 4] = np.float32(np.nan).tobytes()
    fixed = _refix_crc(poisoned)
    assert _refusal(folder, fixed).reason == "non_finite"
    huge = bytearray(report)
    for k in (1, 3):  # the mean's and the weighted mean's totals
        start = layout.offsets[k]
        huge[start:start + layout.lengths[k]] = np.full(512, 1e30, np.float32).tobytes()
    scanned = _scan(folder, _refix_crc(huge), 1000)
    with pytest.raises(folding.ReportError) as e:
        folder.check_bounds(scanned.value)
    assert e.value.reason == "out_of_bounds"
    assert scanned.max_abs == pytest.approx(1e30, rel=1e-6)


def _refix_crc(data):
    data = bytearray(data)
    data[-4:] = struct.pack("<I", zlib.crc32(bytes(data[:-4])))
    return bytes(data)


@pytest.mark.parametrize("piece", [1, 5, 10**6])
def test_a_value_is_checked_against_its_layout_as_it_arrives(piece):
    # what the server checks of a model's broadcast, a chunk at a time
    t = fl.to_type({"w": fl.TensorType(np.float32, [3, 4]), "b": fl.TensorType(np.int8, [5])})
    layout = serialization.dense_layout(t)
    good = serialization.serialize_value(
        {"w": np.ones((3, 4), np.float32), "b": np.arange(5, dtype=np.int8)}, t)

    def scan(data):
        check = serialization.LayoutScan(layout)
        for start in range(0, len(data), piece):
            check.feed(data[start:start + piece])
        check.finish()

    scan(good)
    other = serialization.serialize_value(
        {"w": np.ones((4, 3), np.float32), "b": np.arange(5, dtype=np.int8)},
        {"w": fl.TensorType(np.float32, [4, 3]), "b": fl.TensorType(np.int8, [5])})
    for bad, says in [(good[:-3], "whole frame"), (good + b"x", "end of the frame"),
                      (other, r"found one of <w=float32\[4,3\]"), (b"FEDX" + good[4:], "starting with")]:
        with pytest.raises(serialization.SerializationError, match=says):
            scan(bad)


def test_fed_avg_s_reports_are_folded_from_storage_as_held_ones(monkeypatch):
    # FedAvg's round: sums of the model's update and metrics, and a small federated_max
    # (merged in memory by its accumulator)
    import flax.linen as nn
    import optax

    from fedlang.learning import algorithms, models

    class Wide(nn.Module):
        @nn.compact
        def __call__(self, x):
            return nn.Dense(8)(x)

    def model_fn():
        return models.from_flax(
            Wide(), lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
            {"x": (np.float32, [None, 16]), "y": (np.int32, [None])})

    process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1))
    state = process.initialize()
    plan, broadcast = capture(lambda s, d: process.next(s, d), state, deploy.client_data("train"))
    folder = folding.Folder(plan)
    assert folder.streamable and "federated_max" in [a.uri for a in plan.aggregations]
    rng = np.random.default_rng(1)
    reports = [execution.run_plan(plan, broadcast, {"train": [
        {"x": rng.normal(size=(4, 16)).astype(np.float32), "y": rng.integers(0, 8, 4).astype(np.int32)}
        for _ in range(2)]}) for _ in range(3)]
    held = folder.empty()
    for report in reports:
        scanned = _scan(folder, report, 333)
        folder.check_bounds(scanned.value)
        held = folder.fold(held, folder.check(report))
    frames = [folder.empty(), *reports]
    stored = b"".join(bytes(p) for p in folder.fold_stored(_stored(frames), 0, [], [1, 2, 3]))
    assert stored == held
