"""SumFactory, MeanFactory, UnweightedMeanFactory: results, nesting, state, errors."""

import numpy as np
import pytest

import fedlang as fl
from fedlang import aggregators
from fedlang.core import processes

pytestmark = pytest.mark.usefixtures("runtime")

VALUE = {"b": (np.float32, [2]), "a": np.float32}  # unsorted keys on purpose


def _values():
    return [
        {"b": np.array([1.0, 2.0], np.float32), "a": np.float32(1.0)},
        {"b": np.array([3.0, 6.0], np.float32), "a": np.float32(5.0)},
    ]


def test_sum_factory_sums_and_is_stateless():
    process = aggregators.SumFactory().create(VALUE)
    assert isinstance(process, processes.AggregationProcess)
    assert not process.is_weighted
    out = process.next(process.initialize(), _values())
    np.testing.assert_allclose(out.result["b"], [4.0, 8.0])
    assert float(out.result["a"]) == 6.0
    assert out.state == () and out.measurements == ()


def test_weighted_mean_is_sum_of_weighted_values_over_sum_of_weights():
    process = aggregators.MeanFactory().create(VALUE, np.float32)
    assert process.is_weighted
    out = process.next(process.initialize(), _values(), [1.0, 3.0])
    np.testing.assert_allclose(out.result["b"], [2.5, 5.0])
    np.testing.assert_allclose(out.result["a"], 4.0)
    assert out.state == {"value_sum_process": (), "weight_sum_process": ()}
    assert out.measurements == {"mean_value": (), "mean_weight": ()}


def test_unweighted_mean_counts_every_client_once():
    process = aggregators.UnweightedMeanFactory().create(VALUE)
    out = process.next(process.initialize(), _values())
    np.testing.assert_allclose(out.result["b"], [2.0, 4.0])
    assert out.measurements == {"mean_value": (), "mean_count": ()}


def test_no_nan_division_gives_zeros_when_the_weights_sum_to_zero():
    plain = aggregators.MeanFactory().create(np.float32, np.float32)
    safe = aggregators.MeanFactory(no_nan_division=True).create(np.float32, np.float32)
    assert np.isnan(plain.next(plain.initialize(), [1.0, 2.0], [0.0, 0.0]).result)
    assert float(safe.next(safe.initialize(), [1.0, 2.0], [0.0, 0.0]).result) == 0.0


class _CountingSum(aggregators.UnweightedAggregationFactory):
    """An inner factory with state and measurements, to test nesting."""

    def create(self, value_type):
        inner = aggregators.SumFactory().create(value_type)

        @fl.federated_computation()
        def initialize():
            return fl.federated_value(np.int32(0), fl.SERVER)

        add_one = fl.jax_computation(np.int32)(lambda n: n + 1)

        @fl.federated_computation(initialize.type_signature.result, fl.type_at_clients(value_type))
        def next_fn(state, value):
            out = inner.next(fl.federated_value((), fl.SERVER), value)
            calls = fl.federated_map(add_one, state)
            return processes.MeasuredProcessOutput(calls, out.result, calls)

        return processes.AggregationProcess(initialize, next_fn)


def test_mean_nests_inner_factories_and_reports_their_state_and_measurements():
    process = aggregators.MeanFactory(value_sum_factory=_CountingSum()).create(
        np.float32, np.float32
    )
    state = process.initialize()
    for _ in range(2):
        out = process.next(state, [2.0, 4.0], [1.0, 1.0])
        state = out.state
    assert float(out.result) == 3.0
    assert int(state["value_sum_process"]) == 2
    assert int(out.measurements["mean_value"]) == 2


def test_bad_types_fail_with_expected_found():
    with pytest.raises(TypeError, match=r"Expected a value type made of dense tensors of kind 'f'"):
        aggregators.MeanFactory().create(np.int32, np.float32)
    with pytest.raises(TypeError, match=r"Expected a numeric scalar weight type"):
        aggregators.MeanFactory().create(np.float32, (np.float32, [2]))
    with pytest.raises(TypeError, match=r"Expected a local value type"):
        aggregators.SumFactory().create(fl.type_at_clients(np.float32))
    with pytest.raises(TypeError, match=r"UnweightedAggregationFactory"):
        aggregators.MeanFactory(value_sum_factory=aggregators.MeanFactory())
