"""Robust aggregation: coordinate-wise median, trimmed mean, geometric median (RFA).

None of these can be computed from a running sum, so each collects the client values
with `federated_aggregate`: the accumulator is a growing buffer `float32[?, ...]` per
tensor (a client appends a row, partial buffers concatenate), and the server computes
the statistic in `report`. Memory at the server is O(cohort size x model size), and
the simulation runtime compiles the append once per buffer length it meets (so once
per cohort size over a run). Use them with cohorts of tens to a few hundred clients.

* `MedianFactory()`: the coordinate-wise median.
* `TrimmedMeanFactory(trim_fraction)`: per coordinate, drop the `floor(trim_fraction
  * n)` smallest and largest values and average the rest.
* `GeometricMedianFactory()`: the point minimizing the sum of Euclidean distances to
  the clients' values (over the whole structure), by the smoothed Weiszfeld iterations
  of RFA (Pillutla et al., "Robust Aggregation for Federated Learning", 2022).

All are unweighted (every client counts once; as a FedAvg `model_aggregator` the
example weights are ignored). Type signature:

    create(V) -> AggregationProcess
      initialize: ( -> <>@SERVER)
      next: (<<>@SERVER, {V}@CLIENTS> -> <<>@SERVER, V@SERVER, <num_clients=int32>@SERVER>)

(the geometric median also reports `weiszfeld_iterations` and `objective`). With no
clients the result is zeros.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import factory, tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types


def _buffer_type(value_t: types.Type) -> types.Type:
    return tools.map_type(lambda lt: types.TensorType(lt.dtype, [None, *lt.shape]), value_t)


def collect_process(value_t: types.Type, statistic: Callable[[list[Any]], tuple[list[Any], Any]],
                    extra_t: Any) -> processes.AggregationProcess:
    """A process collecting client values and reporting `statistic(stacked leaves)`.

    Args:
      value_t: the type of one client's value (floating tensors).
      statistic: JAX, `(leaves, each float32[n, ...] with n >= 1 known) -> (result
        leaves, extra)`; it may raise (at the server, when the round's cohort is known)
        for a cohort it cannot aggregate.
      extra_t: `{name: dtype}` of the scalar measurements `statistic` adds (zeros when
        there are no clients).

    Returns:
      An unweighted `AggregationProcess` (its result is zeros when there are no clients).
    """
    buffer_t = _buffer_type(value_t)
    leaf_types = types.tensor_leaves(value_t)
    report_t = types.to_type({"value": value_t, "extra": extra_t})

    @jax_backend.jax_computation(result_type=buffer_t)
    def empty():
        return tools.from_leaves(buffer_t, [jnp.zeros([0, *lt.shape], lt.dtype) for lt in leaf_types])

    # Exported (deployment plans) with buffers of any number of rows, each its own.
    @jax_backend.growing_buffers
    @jax_backend.jax_computation(buffer_t, value_t, result_type=buffer_t)
    def accumulate(buffer, value):
        return tools.from_leaves(buffer_t, [
            jnp.concatenate([b, v[None]], 0)
            for b, v in zip(tools.leaves_of(buffer, buffer_t), tools.leaves_of(value, value_t))])

    @jax_backend.growing_buffers
    @jax_backend.jax_computation(buffer_t, buffer_t, result_type=buffer_t)
    def merge(a, b):
        return tools.from_leaves(buffer_t, [
            jnp.concatenate([x, y], 0)
            for x, y in zip(tools.leaves_of(a, buffer_t), tools.leaves_of(b, buffer_t))])

    @jax_backend.growing_buffers
    @jax_backend.jax_computation(buffer_t, result_type=report_t)
    def report(buffer):
        leaves = tools.leaves_of(buffer, buffer_t)
        n = leaves[0].shape[0] if leaves else 0
        if not isinstance(n, int):  # typing with a symbolic cohort size: shapes only
            out, extra = [jnp.mean(x, axis=0) for x in leaves], _zeros_extra(extra_t)
        elif n == 0:
            out, extra = tools.leaves_of(tools.zeros(value_t), value_t), _zeros_extra(extra_t)
        else:
            out, extra = statistic([x.astype(jnp.float32) for x in leaves])
        out = [x.astype(lt.dtype) for x, lt in zip(out, leaf_types)]
        return {"value": tools.from_leaves(value_t, out), "extra": extra}

    @tracing.federated_computation()
    def initialize():
        return operators.federated_value((), types.SERVER)

    @tracing.federated_computation(initialize.type_signature.result, types.type_at_clients(value_t))
    def next_fn(state, value):
        out = operators.federated_aggregate(value, empty(), accumulate, merge, report)
        measurements = {"num_clients": tools.count_clients(value), **{
            k: out.extra[k] for k in types.to_type(extra_t).names}}
        return processes.MeasuredProcessOutput(state, out.value, operators.federated_zip(
            measurements))

    return processes.AggregationProcess(initialize, next_fn)


def _zeros_extra(extra_t: Any) -> dict[str, Any]:
    return {k: jnp.zeros([], dt) for k, dt in extra_t.items()}


class MedianFactory(factory.UnweightedAggregationFactory):
    """The coordinate-wise median of client values (module docstring).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.MedianFactory().create((np.float32, [2]))
      >>> vals = [np.array([1.0, 5.0]), np.array([2.0, -1.0]), np.array([100.0, 0.0])]
      >>> print(p.next(p.initialize(), vals).result)
      [2. 0.]
    """

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the median process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        return collect_process(
            value_t, lambda xs: ([jnp.median(x, axis=0) for x in xs], {}), {})


def trimmed_mean(x: Any, trim_fraction: float) -> Any:
    """JAX: the mean over axis 0 without the `floor(trim_fraction * n)` extremes each side."""
    n = x.shape[0]
    k = min(int(np.floor(trim_fraction * n)), (n - 1) // 2)
    s = jnp.sort(x, axis=0)
    return jnp.mean(s[k:n - k], axis=0)


class TrimmedMeanFactory(factory.UnweightedAggregationFactory):
    """The coordinate-wise trimmed mean (module docstring).

    Args:
      trim_fraction: the fraction of clients dropped at *each* end, in [0, 0.5); at least
        one value is always kept.

    Raises:
      ValueError: when `trim_fraction` is outside [0, 0.5).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.TrimmedMeanFactory(0.25).create(np.float32)
      >>> print(p.next(p.initialize(), [1.0, 2.0, 3.0, 1000.0]).result)
      2.5
    """

    def __init__(self, trim_fraction: float = 0.1):
        t = tools.check_number("trim_fraction", trim_fraction)
        if t >= 0.5:
            raise ValueError(f"Expected trim_fraction in [0, 0.5), found {t}.")
        self.trim_fraction = t

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the trimmed mean process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        frac = self.trim_fraction
        return collect_process(
            value_t, lambda xs: ([trimmed_mean(x, frac) for x in xs], {}), {})


def weiszfeld(xs: list[Any], max_iterations: int, eps: float, tolerance: float) -> tuple[Any, Any]:
    """JAX: the smoothed Weiszfeld iterations over stacked leaves `xs` (`[n, ...]` each).

    Returns `(leaves of the geometric median, {'weiszfeld_iterations', 'objective'})`.
    """
    n = xs[0].shape[0]

    def dists(z: list[Any]) -> Any:
        sq = sum(jnp.sum(jnp.square(x - zi[None]).reshape(n, -1), axis=1) for x, zi in zip(xs, z))
        return jnp.sqrt(sq)

    def step(carry: Any) -> Any:
        z, _, i, _ = carry
        d = dists(z)
        w = 1.0 / jnp.maximum(d, eps)
        w = w / jnp.sum(w)
        new = [jnp.tensordot(w, x, axes=1) for x in xs]
        moved = jnp.sqrt(sum(jnp.sum(jnp.square(a - b)) for a, b in zip(new, z)))
        return new, jnp.sum(d), i + 1, moved

    def cond(carry: Any) -> Any:
        _, _, i, moved = carry
        return (i < max_iterations) & (moved > tolerance)

    z0 = [jnp.mean(x, axis=0) for x in xs]
    z, _, iters, _ = jax.lax.while_loop(
        cond, step, (z0, jnp.float32(0), jnp.int32(0), jnp.float32(jnp.inf)))
    return z, {"weiszfeld_iterations": iters, "objective": jnp.sum(dists(z))}


class GeometricMedianFactory(factory.UnweightedAggregationFactory):
    """The geometric median of client values, by RFA's smoothed Weiszfeld (module docstring).

    Args:
      max_iterations: the most Weiszfeld iterations per round.
      eps: the smoothing: distances are floored at `eps` (so a client's value equal to
        the current estimate does not divide by zero).
      tolerance: stop when an iteration moves the estimate by less than this (L2).

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> p = aggregators.GeometricMedianFactory().create((np.float32, [2]))
      >>> vals = [np.array([0.0, 0.0]), np.array([1.0, 0.0]), np.array([0.0, 1.0]),
      ...         np.array([1.0, 1.0]), np.array([1000.0, 1000.0])]
      >>> print(np.round(p.next(p.initialize(), vals).result, 2))
      [0.79 0.79]
    """

    def __init__(self, max_iterations: int = 100, eps: float = 1e-6, tolerance: float = 1e-5):
        if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or (
            max_iterations < 1
        ):
            raise ValueError(f"Expected max_iterations >= 1, found {max_iterations!r}.")
        self.max_iterations = max_iterations
        self.eps = tools.check_number("eps", eps, 0.0, strict=True)
        self.tolerance = tools.check_number("tolerance", tolerance)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the geometric median process for floating `value_type`."""
        value_t = factory.check_value_type(value_type, "f")
        args = (self.max_iterations, self.eps, self.tolerance)
        return collect_process(
            value_t, lambda xs: weiszfeld(xs, *args),
            {"weiszfeld_iterations": np.int32, "objective": np.float32})
