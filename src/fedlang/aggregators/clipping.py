"""L2 clipping and zeroing of client values before an inner aggregation.

`clipping_factory(clip, inner)` scales each client's value `x` to
`x * min(1, C / ||x||)`, so no contribution has a global L2 norm above `C`.
`zeroing_factory(norm, inner)` replaces a value whose norm exceeds `C` (or is not
finite) by zeros, a guard against corrupted updates. `C` is a fixed number or a
`QuantileEstimator`, which adapts it each round towards a quantile of the client norms.

Both wrap any inner factory and are weighted exactly when the inner one is:

    create(V) / create(V, W) -> AggregationProcess
      initialize: ( -> <norm=<estimate=float32,key=uint32[2]>,inner=S>@SERVER)
                  (no `norm` field for a fixed norm)
      next: (<state, {V}@CLIENTS[, {W}@CLIENTS]> ->
             <state, V@SERVER, <clipping=M,clipping_norm=float32,clipped_count=int32>@SERVER>)

(`zeroing`, `zeroing_norm`, `zeroed_count` for zeroing). The norm reported is the one
used this round.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import factory, quantile, tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types

_NAMES = {
    "clip": ("clipping", "clipping_norm", "clipped_count"),
    "zero": ("zeroing", "zeroing_norm", "zeroed_count"),
}


def limit_norm(value: Any, norm: Any, mode: str) -> tuple[Any, Any, Any]:
    """JAX: `(limited value, 1 if it was clipped/zeroed else 0, its L2 norm)`."""
    n = tools.global_norm(value)
    if mode == "clip":
        hit = n > norm
        scale = jnp.where(hit, norm / jnp.where(n > 0, n, 1.0), jnp.float32(1))
        out = tools.tree_scale(value, scale)
    else:
        hit = (n > norm) | ~jnp.isfinite(n)
        out = jax.tree.map(lambda x: jnp.where(hit, jnp.zeros_like(x), x), value)
    return out, hit.astype(jnp.int32), n


def build(
    mode: str, norm: Any, inner_factory: Any, value_type: Any, weight_type: Any = None
) -> processes.AggregationProcess:
    """The clipping (`mode='clip'`) or zeroing (`'zero'`) process around an inner process."""
    value_t = factory.check_value_type(value_type, "f")
    weighted = weight_type is not None
    weight_t = factory.check_weight_type(weight_type) if weighted else None
    inner = inner_factory.create(value_t, weight_t) if weighted else inner_factory.create(value_t)
    adaptive = isinstance(norm, quantile.QuantileEstimator)
    inner_name, norm_name, count_name = _NAMES[mode]
    limited_t = types.to_type({"value": value_t, "hit": np.int32, "report": np.float32})
    norms_t = types.to_type({"threshold": np.float32, "estimate": np.float32})

    @jax_backend.jax_computation(value_t, norms_t, result_type=limited_t)
    def limit(value, norms):
        out, hit, n = limit_norm(value, norms["threshold"], mode)
        return {"value": out, "hit": hit,
                "report": quantile.QuantileEstimator.report(n, norms["estimate"])}

    @tracing.federated_computation()
    def initialize():
        state = {"inner": inner.initialize()}
        if adaptive:
            state = {"norm": operators.federated_value(norm.initial_state(), types.SERVER), **state}
        return operators.federated_zip(state)

    if adaptive:

        @jax_backend.jax_computation(quantile.STATE_TYPE, np.float32, np.int32,
                                     result_type=quantile.STATE_TYPE)
        def update_norm(s, report_sum, n):
            return norm.update(s, report_sum, n)

        @jax_backend.jax_computation(quantile.STATE_TYPE, result_type=norms_t)
        def norms_of(s):
            return {"threshold": norm.threshold(s), "estimate": s["estimate"]}

    def body(state, value, *weight):
        norms = (
            operators.federated_map(norms_of, state.norm)
            if adaptive
            else operators.federated_value(
                {"threshold": np.float32(norm), "estimate": np.float32(norm)}, types.SERVER)
        )
        c = norms.threshold
        limited = operators.federated_map(limit, (value, operators.federated_broadcast(norms)))
        out = inner.next(state.inner, limited.value, *weight)
        new_state = {"inner": out.state}
        if adaptive:
            n = tools.count_clients(value)
            report_sum = operators.federated_sum(limited.report)
            new_state = {
                "norm": operators.federated_map(update_norm, (state.norm, report_sum, n)),
                **new_state,
            }
        measurements = {
            inner_name: out.measurements,
            norm_name: c,
            count_name: operators.federated_sum(limited.hit),
        }
        return processes.MeasuredProcessOutput(
            operators.federated_zip(new_state), out.result, operators.federated_zip(measurements)
        )

    return make_process(initialize, body, value_t, weight_t)


def make_process(
    initialize: Any, body: Any, value_t: types.Type, weight_t: types.Type | None
) -> processes.AggregationProcess:
    """An `AggregationProcess` whose `next` is `body(state, value[, weight])`, traced."""
    state_t = initialize.type_signature.result
    if weight_t is None:

        @tracing.federated_computation(state_t, types.type_at_clients(value_t))
        def next_fn(state, value):
            return body(state, value)

    else:

        @tracing.federated_computation(
            state_t, types.type_at_clients(value_t), types.type_at_clients(weight_t)
        )
        def next_fn(state, value, weight):
            return body(state, value, weight)

    return processes.AggregationProcess(initialize, next_fn)


class _UnweightedNorm(factory.UnweightedAggregationFactory):
    def __init__(self, mode: str, norm: Any, inner: Any):
        self._mode, self._norm, self._inner = mode, norm, inner

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the process for floating `value_type` (see the module docstring)."""
        return build(self._mode, self._norm, self._inner, value_type)


class _WeightedNorm(factory.WeightedAggregationFactory):
    def __init__(self, mode: str, norm: Any, inner: Any):
        self._mode, self._norm, self._inner = mode, norm, inner

    def create(self, value_type: Any, weight_type: Any) -> processes.AggregationProcess:
        """Returns the process for floating `value_type` and scalar `weight_type`."""
        return build(self._mode, self._norm, self._inner, value_type, weight_type)


def _make(mode: str, norm: Any, inner: Any) -> Any:
    norm = quantile.as_norm(norm, "clip" if mode == "clip" else "norm")
    tools.check_inner(inner)
    cls = _WeightedNorm if isinstance(inner, factory.WeightedAggregationFactory) else _UnweightedNorm
    return cls(mode, norm, inner)


def clipping_factory(clip: float | quantile.QuantileEstimator, inner: Any) -> Any:
    """Clips each client value to global L2 norm `clip`, then aggregates with `inner`.

    Args:
      clip: a positive number, or a `QuantileEstimator` to adapt it each round.
      inner: the factory aggregating the clipped values; the result is weighted iff
        `inner` is.

    Returns:
      An aggregation factory (type signature in the module docstring).

    Raises:
      TypeError: when `clip` or `inner` has the wrong kind.
      ValueError: when `clip` is not positive.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> f = aggregators.clipping_factory(1.0, aggregators.SumFactory())
      >>> p = f.create((np.float32, [2]))
      >>> out = p.next(p.initialize(), [np.array([3.0, 4.0]), np.array([0.3, 0.4])])
      >>> print(out.result, int(out.measurements['clipped_count']))
      [0.90000004 1.2       ] 1
    """
    return _make("clip", clip, inner)


def zeroing_factory(norm: float | quantile.QuantileEstimator, inner: Any) -> Any:
    """Replaces client values with L2 norm above `norm` (or not finite) by zeros.

    Args:
      norm: a positive number, or a `QuantileEstimator` to adapt it each round.
      inner: the factory aggregating the results; weighted iff `inner` is.

    Returns:
      An aggregation factory (type signature in the module docstring).

    Raises:
      TypeError: when `norm` or `inner` has the wrong kind.
      ValueError: when `norm` is not positive.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> f = aggregators.zeroing_factory(1.0, aggregators.SumFactory())
      >>> p = f.create((np.float32, [2]))
      >>> out = p.next(p.initialize(), [np.array([3.0, 4.0]), np.array([0.3, 0.4])])
      >>> print(out.result, int(out.measurements['zeroed_count']))
      [0.3 0.4] 1
    """
    return _make("zero", norm, inner)
