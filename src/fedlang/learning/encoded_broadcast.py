"""A compressed broadcast: the server encodes the model, clients decode it.

`build_encoded_broadcast_process(weights_type, encoder)` is a `DistributionProcess`
for the `model_distributor` argument of the algorithms. The server encodes the weights
once per round with a `fedlang.aggregators.Encoder` (stochastic rounding from a key in
the state), broadcasts the encoded message, and each client decodes it. It reports
`broadcast_bits`: the message's bits times the number of clients.

    initialize: ( -> <key=uint32[2]>@SERVER)
    next: (<state, W@SERVER> -> <state, W@CLIENTS, <broadcast_bits=float32>@SERVER>)
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import encoding, tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import templates


def build_encoded_broadcast_process(
    weights_type: Any, encoder: encoding.Encoder, seed: int | None = None
) -> templates.DistributionProcess:
    """Broadcasts `encoder`-compressed weights (module docstring).

    Args:
      weights_type: the local type of the model weights (e.g. `ModelWeights` of the
        model's `weights_type()`).
      encoder: a `fedlang.aggregators.Encoder` (e.g. `Encoder.quantize(8)`).
      seed: the seed of the stochastic rounding (None: random).

    Returns:
      A `DistributionProcess`.

    Raises:
      TypeError: when `encoder` is not an `Encoder`.
    """
    if not isinstance(encoder, encoding.Encoder):
        raise TypeError(f"Expected an Encoder, found {type(encoder).__name__}.")
    weights_t = types.to_type(weights_type)
    msg_t = encoder.message_type(weights_t)
    bits = float(encoder.bits_per_value(weights_t))
    state_t = types.to_type({"key": tools.KEY_TYPE})
    initial = {"key": tools.seed_key(seed)}

    @jax_backend.jax_computation(state_t, weights_t,
                                 result_type={"state": state_t, "message": msg_t})
    def encode(state, weights):
        next_key, round_key = tools.split(state["key"])
        message = encoder.encode(weights, tools.wrap(round_key), weights_t)
        return {"state": {"key": next_key}, "message": message}

    @jax_backend.jax_computation(msg_t, result_type=weights_t)
    def decode(message):
        return tools.from_leaves(weights_t, encoder.decode(list(message), weights_t))

    @jax_backend.jax_computation(np.int32)
    def count_bits(n):
        return {"broadcast_bits": n.astype(jnp.float32) * bits}

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value(initial, types.SERVER)

    @tracing.federated_computation(types.type_at_server(state_t), types.type_at_server(weights_t))
    def next_fn(state, weights):
        encoded = operators.federated_map(encode, (state, weights))
        received = operators.federated_broadcast(encoded.message)
        decoded = operators.federated_map(decode, received)
        measurements = operators.federated_map(count_bits, tools.count_clients(received))
        return core_processes.MeasuredProcessOutput(encoded.state, decoded, measurements)

    return templates.DistributionProcess(initialize, next_fn)
