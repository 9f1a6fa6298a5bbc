"""Count, sum, mean, variance, min and max of client records.

Each client holds a dataset of records (`sequence<float32[?,*shape]>`, see
`analytics.data`). A client reduces its records to `[count, sum, sum of squares]`
(one row each, per feature); those vectors are summed across clients (plainly, with
secure aggregation, or with DP: see `analytics.privacy`) and the server derives the
mean and the (population) variance `E[x^2] - E[x]^2`. Min and max come from
`federated_min` / `federated_max` of the clients' own extremes; they are released only
without DP and secure aggregation (an extreme is one client's value: use DP quantiles).

With DP, records are first clamped to `bounds` (required), and one client adds
`[n, sum x, sum x^2]` to the sum: choose `Privacy.clip` for the clients' sizes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang.analytics import data
from fedlang.analytics import privacy as privacy_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, tracing, types


class Statistics(NamedTuple):
    """What `statistics` returns (arrays of the records' feature shape).

    `min` and `max` are None with DP or secure aggregation; `privacy` is the spent
    `(epsilon, delta)` with DP, else None.
    """

    count: Any
    sum: Any
    mean: Any
    variance: Any
    min: Any
    max: Any
    privacy: privacy_lib.Spent | None


def _bounds(bounds: Any) -> tuple[float, float] | None:
    if bounds is None:
        return None
    lo, hi = (float(b) for b in bounds)
    if not lo < hi:
        raise ValueError(f"Expected bounds (lower, upper) with lower < upper, found {bounds!r}.")
    return lo, hi


def build_statistics(
    shape: Sequence[int] = (),
    *,
    bounds: tuple[float, float] | None = None,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> computation.Computation:
    """The federated computation of the statistics.

    Type signature: `({sequence<float32[?,*shape]>}@CLIENTS -> <count=float32[*shape],
    sum=...,mean=...,variance=...[,min=...,max=...]>@SERVER)`.

    Args:
      shape: the feature shape of one record (`()` for scalars).
      bounds: `(lower, upper)`: records are clamped to it (required with DP).
      privacy: a `Privacy` for DP sums, or None.
      secure_bound: without DP, sum with `SecureSumFactory(secure_bound)` (each entry
        of a client's `[n, sum, sum of squares]` clipped to it).

    Raises:
      ValueError: DP without bounds, or bad bounds.
    """
    privacy = privacy_lib.check_privacy(privacy)
    clamp = _bounds(bounds)
    if privacy is not None and clamp is None:
        raise ValueError(
            "Expected bounds=(lower, upper) with DP: the records' range bounds each client's "
            "contribution."
        )
    shape = tuple(int(d) for d in shape)
    extremes = privacy is None and secure_bound is None
    seq_t = data.number_type(np.float32, shape)
    local_t = types.to_type(
        {"moments": (np.float32, [3, *shape]), "min": (np.float32, shape), "max": (np.float32, shape)}
    )

    @jax_backend.jax_computation(seq_t, result_type=local_t)
    def client_moments(dataset):
        zero = jnp.zeros(shape, jnp.float32)
        init = {"moments": jnp.zeros((3, *shape), jnp.float32),
                "min": zero + jnp.inf, "max": zero - jnp.inf}

        def step(state, batch, mask):
            x = batch if clamp is None else jnp.clip(batch, clamp[0], clamp[1])
            m = mask.reshape((-1,) + (1,) * len(shape))
            moments = jnp.stack([jnp.sum(m + 0 * x, 0), jnp.sum(m * x, 0), jnp.sum(m * x * x, 0)])
            real = m > 0
            return {"moments": state["moments"] + moments,
                    "min": jnp.minimum(state["min"], jnp.min(jnp.where(real, x, jnp.inf), 0)),
                    "max": jnp.maximum(state["max"], jnp.max(jnp.where(real, x, -jnp.inf), 0))}

        return dataset.reduce(init, step, masked=True)

    moments_t = types.TensorType(np.float32, [3, *shape])

    @jax_backend.jax_computation(moments_t)
    def finish(moments):
        count, total, squares = moments[0], moments[1], moments[2]
        safe = jnp.where(count > 0, count, jnp.nan)
        mean = total / safe
        return {"count": count, "sum": total, "mean": mean,
                "variance": jnp.maximum(squares / safe - mean * mean, 0.0)}

    @tracing.federated_computation(types.type_at_clients(seq_t))
    def run(datasets):
        local = operators.federated_map(client_moments, datasets)
        moments = privacy_lib.aggregate(local.moments, privacy, secure_bound)
        out = operators.federated_map(finish, moments)
        fields = {k: getattr(out, k) for k in ("count", "sum", "mean", "variance")}
        if extremes:
            fields["min"] = operators.federated_min(local.min)
            fields["max"] = operators.federated_max(local.max)
        return operators.federated_zip(fields)

    return run


def statistics(
    client_values: Sequence[Any],
    *,
    shape: Sequence[int] = (),
    bounds: tuple[float, float] | None = None,
    privacy: privacy_lib.Privacy | None = None,
    secure_bound: float | None = None,
) -> Statistics:
    """Statistics of the records of `client_values` (one array-like of records per
    client), computed by `build_statistics` in the current runtime.

    Example:
      >>> s = statistics([[1.0, 2.0], [3.0], []])
      >>> float(s.count), float(s.mean), round(float(s.variance), 4), float(s.max)
      (3.0, 2.0, 0.6667, 3.0)
    """
    comp = build_statistics(shape, bounds=bounds, privacy=privacy, secure_bound=secure_bound)
    out = comp([data.number_batches(v, np.float32, shape) for v in client_values])
    spent = None if privacy is None else privacy.spent(1)
    return Statistics(out["count"], out["sum"], out["mean"], out["variance"],
                      out.get("min"), out.get("max"), spent)
