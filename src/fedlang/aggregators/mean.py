"""`MeanFactory` (weighted) and `UnweightedMeanFactory`: means built from inner sums.

Each divides a sum by a sum: the value sum and the weight (or count) sum are produced
by inner unweighted factories (`SumFactory` by default), so replacing them (e.g. with a
secure sum) changes how the sums are computed without touching the mean. The state
and measurements of the inner processes are reported under `value_sum_process` /
`weight_sum_process` (state) and `mean_value` / `mean_weight` (measurements), as in TFF.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fedlang.aggregators import factory
from fedlang.aggregators import sum as sum_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types


def _inner(f: Any, name: str) -> factory.UnweightedAggregationFactory:
    if f is None:
        return sum_lib.SumFactory()
    if not isinstance(f, factory.UnweightedAggregationFactory):
        raise TypeError(
            f"Expected {name} to be an UnweightedAggregationFactory (such as SumFactory()), "
            f"found {type(f).__name__}."
        )
    return f


def _divide(total: Any, weight: Any, no_nan: bool) -> Any:
    def div(x: Any) -> Any:
        w = weight.astype(x.dtype)
        if no_nan:
            return jnp.where(w == 0, jnp.zeros_like(x), x / jnp.where(w == 0, 1, w).astype(x.dtype))
        return x / w

    return jax.tree.map(div, total)


class MeanFactory(factory.WeightedAggregationFactory):
    """The weighted mean `sum(w * x) / sum(w)` of client values.

    Args:
      value_sum_factory: sums the weighted values (default `SumFactory()`).
      weight_sum_factory: sums the weights (default `SumFactory()`).
      no_nan_division: return zeros instead of NaN when the weights sum to zero.

    Raises:
      TypeError: when an inner factory is not unweighted, or at `create` when the
        values are not floating or the weight is not a numeric scalar.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> process = aggregators.MeanFactory().create(np.float32, np.float32)
      >>> print(process.next(process.initialize(), [1.0, 4.0], [3.0, 1.0]).result)
      1.75
    """

    def __init__(
        self,
        value_sum_factory: factory.UnweightedAggregationFactory | None = None,
        weight_sum_factory: factory.UnweightedAggregationFactory | None = None,
        no_nan_division: bool = False,
    ):
        self._value_sum = _inner(value_sum_factory, "value_sum_factory")
        self._weight_sum = _inner(weight_sum_factory, "weight_sum_factory")
        self._no_nan = bool(no_nan_division)

    def create(self, value_type: Any, weight_type: Any) -> processes.AggregationProcess:
        """Returns the weighted mean process for floating `value_type` and scalar `weight_type`."""
        value_t = factory.check_value_type(value_type, "f")
        weight_t = factory.check_weight_type(weight_type)
        value_sum = self._value_sum.create(value_t)
        weight_sum = self._weight_sum.create(weight_t)
        no_nan = self._no_nan

        @jax_backend.jax_computation(value_t, weight_t, result_type=value_t)
        def multiply(value, weight):
            return jax.tree.map(lambda x: x * weight.astype(x.dtype), value)

        @jax_backend.jax_computation(value_t, weight_t, result_type=value_t)
        def divide(total, weight):
            return _divide(total, weight, no_nan)

        @tracing.federated_computation()
        def initialize():
            return operators.federated_zip(
                {
                    "value_sum_process": value_sum.initialize(),
                    "weight_sum_process": weight_sum.initialize(),
                }
            )

        @tracing.federated_computation(
            initialize.type_signature.result,
            types.type_at_clients(value_t),
            types.type_at_clients(weight_t),
        )
        def next_fn(state, value, weight):
            weighted = operators.federated_map(multiply, (value, weight))
            v = value_sum.next(state.value_sum_process, weighted)
            w = weight_sum.next(state.weight_sum_process, weight)
            mean = operators.federated_map(divide, (v.result, w.result))
            new_state = operators.federated_zip(
                {"value_sum_process": v.state, "weight_sum_process": w.state}
            )
            measurements = operators.federated_zip(
                {"mean_value": v.measurements, "mean_weight": w.measurements}
            )
            return processes.MeasuredProcessOutput(new_state, mean, measurements)

        return processes.AggregationProcess(initialize, next_fn)


class UnweightedMeanFactory(factory.UnweightedAggregationFactory):
    """The plain mean `sum(x) / n` of client values (every client counts once).

    Args:
      value_sum_factory: sums the values (default `SumFactory()`).
      count_sum_factory: sums the per-client count of 1 (default `SumFactory()`).
      no_nan_division: return zeros instead of NaN when there are no clients.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> process = aggregators.UnweightedMeanFactory().create(np.float32)
      >>> print(process.next(process.initialize(), [1.0, 4.0]).result)
      2.5
    """

    def __init__(
        self,
        value_sum_factory: factory.UnweightedAggregationFactory | None = None,
        count_sum_factory: factory.UnweightedAggregationFactory | None = None,
        no_nan_division: bool = False,
    ):
        self._value_sum = _inner(value_sum_factory, "value_sum_factory")
        self._count_sum = _inner(count_sum_factory, "count_sum_factory")
        self._no_nan = bool(no_nan_division)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the unweighted mean process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        count_t = types.TensorType("int32")
        value_sum = self._value_sum.create(value_t)
        count_sum = self._count_sum.create(count_t)
        no_nan = self._no_nan

        @jax_backend.jax_computation(value_t)
        def one(value):
            del value
            return jnp.int32(1)

        @jax_backend.jax_computation(value_t, count_t, result_type=value_t)
        def divide(total, count):
            return _divide(total, count, no_nan)

        @tracing.federated_computation()
        def initialize():
            return operators.federated_zip(
                {
                    "value_sum_process": value_sum.initialize(),
                    "count_sum_process": count_sum.initialize(),
                }
            )

        @tracing.federated_computation(
            initialize.type_signature.result, types.type_at_clients(value_t)
        )
        def next_fn(state, value):
            v = value_sum.next(state.value_sum_process, value)
            c = count_sum.next(state.count_sum_process, operators.federated_map(one, value))
            mean = operators.federated_map(divide, (v.result, c.result))
            new_state = operators.federated_zip(
                {"value_sum_process": v.state, "count_sum_process": c.state}
            )
            measurements = operators.federated_zip(
                {"mean_value": v.measurements, "mean_count": c.measurements}
            )
            return processes.MeasuredProcessOutput(new_state, mean, measurements)

        return processes.AggregationProcess(initialize, next_fn)
