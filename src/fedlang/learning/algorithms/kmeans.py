"""Federated k-means (TFF's `build_fed_kmeans`): mini-batch k-means over the clients' points.

Sculley, "Web-Scale K-Means Clustering", WWW 2010, federated as in TFF 0.87
(`tff.learning.algorithms.build_fed_kmeans`, `kmeans_clustering.py`), whose source is
the specification:

* the centroids start as `tf.random.stateless_normal((num_clusters, *data_shape),
  random_seed)`, reproduced exactly (`fedlang.learning.tf_random`);
* each client assigns each of its points (a dataset of *unbatched* points) to the
  nearest centroid in squared Euclidean distance, ties going to the lowest index
  (`argmin`), and reports per cluster the sum of its points and their count;
* the server sums the reports (`sum_aggregator`, `SumFactory()` by default) and moves
  each centroid that received points to the weighted mean of its old value, weighted by
  the points it has absorbed in all rounds so far (the weights start at a pseudo-count
  of 1), and the new points: `c <- (w c + sum) / (w + count)`, `w <- w + count`. A
  centroid no point reaches keeps its place and weight.

The weights are the finalizer's state (`state.finalizer`); `get_model_weights(state)`
returns the centroids, `float32[num_clusters, *data_shape]`, and
`set_model_weights(state, centroids)` replaces them (the weights stay, as in TFF).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, cast

import jax.numpy as jnp
import numpy as np

from fedlang import aggregators
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types
from fedlang.learning import composers, distributors, templates, tf_random

# TFF's fallback seed when none is given: the clock, in units of 10 microseconds.
_CLOCK_SCALE = 100000.0


def _check_shape(num_clusters: Any, data_shape: Any) -> tuple[int, tuple[int, ...]]:
    if isinstance(num_clusters, bool) or not isinstance(num_clusters, int | np.integer) or (
        num_clusters < 1
    ):
        raise ValueError(f"Expected num_clusters to be a positive integer, found {num_clusters!r}.")
    shape = tuple(data_shape) if isinstance(data_shape, Sequence) else None
    if shape is None or not all(
        isinstance(d, int | np.integer) and not isinstance(d, bool) and d >= 0 for d in shape
    ):
        raise ValueError(
            "Expected data_shape to be the shape of one (unbatched) point, a tuple of "
            f"non-negative integers such as (2,), found {data_shape!r}."
        )
    return int(num_clusters), tuple(int(d) for d in shape)


def _client_work(centroids_t: types.Type, point_t: types.Type, k: int) -> templates.ClientWorkProcess:
    data_t = types.SequenceType(point_t)

    @jax_backend.jax_computation(centroids_t, data_t)
    def client_update(centroids, dataset):
        data_axes = tuple(range(1, centroids.ndim))

        def step(state, point):
            sums, counts, n = state
            shifted = centroids - point[None]
            closest = jnp.argmin(jnp.sum(shifted * shifted, axis=data_axes))  # ties: lowest index
            return sums.at[closest].add(point), counts.at[closest].add(1.0), n + 1.0

        zero = (jnp.zeros_like(centroids), jnp.zeros([k], jnp.float32), jnp.float32(0))
        sums, counts, n = dataset.reduce(zero, step)
        # update_weight is not used by the sum; it is the count of points, for the composer.
        return {"result": templates.ClientResult((sums, counts), n, ()), "num_examples": n}

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value((), types.SERVER)

    @tracing.federated_computation(
        initialize.type_signature.result, types.type_at_clients(centroids_t),
        types.type_at_clients(data_t),
    )
    def next_fn(state, centroids, client_data):
        outputs = operators.federated_map(client_update, (centroids, client_data))
        measurements = operators.federated_zip(
            {"num_examples": operators.federated_sum(outputs.num_examples)})
        return processes.MeasuredProcessOutput(state, outputs.result, measurements)

    return templates.ClientWorkProcess(initialize, next_fn)


def _finalizer(centroids_t: types.Type, k: int) -> templates.FinalizerProcess:
    weights_t = types.TensorType(np.float32, [k])
    summed_t = types.to_type((centroids_t, weights_t))

    @jax_backend.jax_computation()
    def initial_weights():
        return jnp.ones([k], jnp.float32)  # TFF's pseudo-count: centroids never collapse to 0

    @jax_backend.jax_computation(centroids_t, weights_t, summed_t,
                                 result_type=(weights_t, centroids_t))
    def update(centroids, weights, summed):
        sums, counts = summed
        total = weights + counts
        # TFF's _update_centroids: divide_no_nan, and new points count only where there are some.
        safe = jnp.where(total == 0, 1.0, total)
        old_scale = jnp.where(total == 0, 0.0, weights / safe)
        new_scale = jnp.where(total == 0, 0.0, (counts > 0).astype(jnp.float32) / safe)
        shape = (k,) + (1,) * (centroids.ndim - 1)
        new = old_scale.reshape(shape) * centroids + new_scale.reshape(shape) * sums
        return total, new

    @tracing.federated_computation()
    def initialize():
        return operators.federated_eval(initial_weights, types.SERVER)

    @tracing.federated_computation(
        initialize.type_signature.result, types.type_at_server(centroids_t),
        types.type_at_server(summed_t),
    )
    def next_fn(weights, centroids, summed):
        out = operators.federated_map(update, (centroids, weights, summed))
        return processes.MeasuredProcessOutput(
            out[0], out[1], operators.federated_value({}, types.SERVER))

    return templates.FinalizerProcess(initialize, next_fn)


def build_fed_kmeans(
    num_clusters: int,
    data_shape: Sequence[int],
    random_seed: tuple[int, int] | None = None,
    distributor: templates.DistributionProcess | None = None,
    sum_aggregator: aggregators.UnweightedAggregationFactory | None = None,
) -> templates.LearningProcess:
    """Federated k-means clustering (module docstring), TFF's arguments and results.

    Args:
      num_clusters: k, the number of centroids.
      data_shape: the shape of one point; each client's dataset yields unbatched points
        of this shape (float32).
      random_seed: two integers seeding the initial centroids, standard normal values
        equal to TFF's for the same seed; None seeds from the clock, as TFF does.
      distributor: replaces the broadcast of the centroids.
      sum_aggregator: an unweighted factory summing the clients' `(sums, counts)`
        (default `SumFactory()`; e.g. a secure sum).

    Returns:
      A `LearningProcess`; metrics: `metrics['client_work']['num_examples']` (points
      assigned this round, float32) and `metrics['traffic']`.

    Raises:
      ValueError: for a bad `num_clusters`, `data_shape` or `random_seed`; TypeError:
        when `sum_aggregator` is not an unweighted aggregation factory.

    Example:
      >>> import numpy as np
      >>> from fedlang.learning import algorithms
      >>> process = algorithms.build_fed_kmeans(2, (1,), random_seed=(0, 0))
      >>> state = process.set_model_weights(process.initialize(), np.array([[0.0], [10.0]]))
      >>> data = [np.array([[1.0], [9.0]], np.float32), np.array([[11.0]], np.float32)]
      >>> state, metrics = process.next(state, data)
      >>> print(process.get_model_weights(state).ravel(), state.finalizer)
      [ 0.5 10. ] [2. 3.]
    """
    k, shape = _check_shape(num_clusters, data_shape)
    if random_seed is None:
        random_seed = (int(time.time() * _CLOCK_SCALE), 0)
    initial = tf_random.stateless_normal((k, *shape), random_seed)
    factory = aggregators.SumFactory() if sum_aggregator is None else sum_aggregator
    if not isinstance(factory, aggregators.UnweightedAggregationFactory):
        raise TypeError(
            "Expected sum_aggregator to be an UnweightedAggregationFactory (such as "
            f"SumFactory() or SecureSumFactory(...)), found {type(factory).__name__}."
        )
    centroids_t = types.TensorType(np.float32, [k, *shape])
    point_t = types.TensorType(np.float32, list(shape))

    @jax_backend.jax_computation()
    def initial_centroids():
        return jnp.asarray(initial)

    process = composers.compose_learning_process(
        initial_centroids,
        distributor or distributors.build_broadcast_process(centroids_t),
        _client_work(centroids_t, point_t, k),
        factory.create(types.to_type((centroids_t, types.TensorType(np.float32, [k])))),
        _finalizer(centroids_t, k),
    )

    def get_model_weights(state: templates.ServerState) -> np.ndarray:
        return np.asarray(state.global_model_weights)

    def set_model_weights(state: templates.ServerState, centroids: Any) -> templates.ServerState:
        value = np.asarray(centroids)
        if value.shape != (k, *shape) or value.dtype.kind not in "fiu":
            raise ValueError(
                f"Expected centroids of shape {(k, *shape)} (num_clusters, *data_shape), "
                f"found {value.dtype}{list(value.shape)}."
            )
        return state._replace(global_model_weights=value.astype(np.float32))

    # The model weights are the centroids (a tensor, as in TFF), not a ModelWeights.
    return templates.LearningProcess(
        process.initialize, process.next, cast(Any, get_model_weights), set_model_weights)
