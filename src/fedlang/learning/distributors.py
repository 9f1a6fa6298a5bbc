"""Distributors: how the server's model weights reach the clients."""

from __future__ import annotations

from typing import Any

from fedlang.core import operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import templates


def build_broadcast_process(weights_type: Any) -> templates.DistributionProcess:
    """Broadcasts the weights unchanged: stateless, no measurements.

    Args:
      weights_type: the local type of the model weights.

    Returns:
      A `DistributionProcess` `next(state, weights@SERVER) -> weights@CLIENTS`.
    """
    weights_t = types.to_type(weights_type)

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value((), types.SERVER)

    @tracing.federated_computation(initialize.type_signature.result, types.type_at_server(weights_t))
    def next_fn(state, weights):
        return core_processes.MeasuredProcessOutput(
            state, operators.federated_broadcast(weights), operators.federated_value({}, types.SERVER)
        )

    return templates.DistributionProcess(initialize, next_fn)
