"""How the clients' non-trainable weights reach the server model: a part of the process.

A model's non-trainable weights (BatchNorm statistics, RNG states) are not trained by
the optimizer, so the update does not carry them; clients report the floating ones in
`ClientResult.non_trainable`. A *non-trainable update* is a federated computation

    (<weights@SERVER, {non_trainable}@CLIENTS, {float32}@CLIENTS> -> weights@SERVER)

taking the server's new weights, the clients' reports and their update weights; the
composer calls it after the finalizer. `build_weighted_mean_update` (the default)
averages the floating non-trainable weights with the update weights;
`build_keep_server_update` keeps the server's. Write another one to, e.g., average
them unweighted or aggregate them with a secure sum.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, tracing, types
from fedlang.learning.models import model as model_lib


def _types(weights_type: Any, non_trainable_type: Any) -> tuple[types.Type, types.Type]:
    return types.to_type(weights_type), types.to_type(non_trainable_type)


def build_weighted_mean_update(weights_type: Any, non_trainable_type: Any) -> computation.Computation:
    """The clients' floating non-trainable weights, averaged with the update weights,
    replace the server's; other non-trainable weights (integer seed states) keep the
    server's values, and so does everything when the weights sum to 0 (no client, or
    only excluded ones).

    Args:
      weights_type: the local type of `ModelWeights`.
      non_trainable_type: the type of `ClientResult.non_trainable` (a list of the
        floating non-trainable leaves, in `jax.tree.leaves` order).

    Returns:
      The federated computation of the module docstring.
    """
    weights_t, nt_t = _types(weights_type, non_trainable_type)
    params = (types.type_at_server(weights_t), types.type_at_clients(nt_t),
              types.type_at_clients(np.float32))
    if isinstance(nt_t, types.StructType) and not len(nt_t):

        @tracing.federated_computation(*params)
        def unchanged(weights, non_trainable, weight):
            del non_trainable, weight
            return weights

        return unchanged

    @jax_backend.jax_computation(nt_t, np.float32)
    def weigh(nt, w):
        return [x * w.astype(x.dtype) for x in nt], w

    @jax_backend.jax_computation(weights_t, (nt_t, np.float32), result_type=weights_t)
    def set_non_trainable(weights, nt_sum):
        total, w = nt_sum
        leaves, treedef = jax.tree.flatten(weights.non_trainable)
        it = iter(total)
        new = [
            jnp.where(w > 0, next(it) / jnp.where(w > 0, w, 1).astype(x.dtype), x)
            if jnp.issubdtype(x.dtype, jnp.floating)
            else x
            for x in leaves
        ]
        return model_lib.ModelWeights(weights.trainable, jax.tree.unflatten(treedef, new))

    @tracing.federated_computation(*params)
    def weighted_mean(weights, non_trainable, weight):
        nt_sum = operators.federated_sum(operators.federated_map(weigh, (non_trainable, weight)))
        return operators.federated_map(set_non_trainable, (weights, nt_sum))

    return weighted_mean


def build_keep_server_update(weights_type: Any, non_trainable_type: Any) -> computation.Computation:
    """Ignores the clients' non-trainable weights: the server's stay (nothing is sent).

    Args:
      weights_type, non_trainable_type: as for `build_weighted_mean_update`.

    Returns:
      The federated computation of the module docstring.
    """
    weights_t, nt_t = _types(weights_type, non_trainable_type)

    @tracing.federated_computation(types.type_at_server(weights_t), types.type_at_clients(nt_t),
                                   types.type_at_clients(np.float32))
    def keep_server(weights, non_trainable, weight):
        del non_trainable, weight
        return weights

    return keep_server
