"""`SumFactory`: the plain `federated_sum`, as an aggregation process."""

from __future__ import annotations

from typing import Any

from fedlang.aggregators import factory
from fedlang.core import operators, processes, tracing, types


class SumFactory(factory.UnweightedAggregationFactory):
    """Sums client values at the server; stateless, no measurements.

    Example:
      >>> import numpy as np, fedlang as fl
      >>> from fedlang import aggregators
      >>> process = aggregators.SumFactory().create(np.float32)
      >>> print(process.next(process.initialize(), [1.0, 2.0, 3.0]).result)
      6.0
    """

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the sum process for `value_type` (numeric tensors).

        Raises:
          TypeError: when `value_type` is not a numeric local type.
        """
        value_t = factory.check_value_type(value_type)

        @tracing.federated_computation()
        def initialize():
            return operators.federated_value((), types.SERVER)

        @tracing.federated_computation(
            initialize.type_signature.result, types.type_at_clients(value_t)
        )
        def next_fn(state, value):
            return processes.MeasuredProcessOutput(
                state, operators.federated_sum(value), operators.federated_value((), types.SERVER)
            )

        return processes.AggregationProcess(initialize, next_fn)
