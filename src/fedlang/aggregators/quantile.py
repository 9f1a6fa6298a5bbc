"""`QuantileEstimator`: a private, geometric-update estimate of a quantile of client values.

Andrew et al., "Differentially Private Learning with Adaptive Clipping" (2021). Each
round every client reports whether its value (e.g. its update's L2 norm) is at most the
current estimate `C`; the server sums the reports (optionally with Gaussian noise for
differential privacy), forms the fraction `b` of clients at or below `C`, and updates

    C <- C * exp(-learning_rate * (b - target_quantile)).

The value used as a norm or bound is `multiplier * C + increment` (TFF's
`PrivateQuantileEstimationProcess`: e.g. zeroing at twice the 98th percentile plus one),
while clients report against `C` itself. So `C` grows while fewer than `target_quantile` of the clients are below it, and
shrinks otherwise. Clients report `below - 0.5` (sensitivity 0.5), as in TF Privacy's
`QuantileEstimatorQuery`, so `noise_stddev` is in units of clients.

Adaptive clipping (`clipping_factory`), adaptive DP (`DifferentiallyPrivateFactory.
gaussian_adaptive`) and adaptive secure-sum bounds (`SecureSumFactory`) use it.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import tools
from fedlang.core import types

STATE_TYPE = types.to_type({"estimate": np.float32, "key": tools.KEY_TYPE})


@dataclasses.dataclass(frozen=True)
class QuantileEstimator:
    """Configuration of an adaptive quantile estimate (see the module docstring).

    Args:
      initial_estimate: the estimate `C` of the first round (> 0).
      target_quantile: the fraction of clients that should be at or below `C`, in [0, 1].
      learning_rate: the geometric update's step (>= 0; 0 keeps `C` fixed).
      noise_stddev: the standard deviation of Gaussian noise added to the sum of the
        clients' reports (0 for no privacy of the estimate).
      expected_clients: the denominator of the fraction; None uses the actual number of
        clients (DP uses the expected cohort size so the count is not revealed).
      seed: the seed of the noise (None: random).
      multiplier: the threshold used is `multiplier * estimate + increment` (> 0).
      increment: see `multiplier` (>= 0).

    Raises:
      ValueError: when a parameter is out of range.

    Example:
      >>> from fedlang import aggregators
      >>> est = aggregators.QuantileEstimator(1.0, target_quantile=0.8)
      >>> float(est.initial_state()['estimate'])
      1.0
    """

    initial_estimate: float
    target_quantile: float = 0.5
    learning_rate: float = 0.2
    noise_stddev: float = 0.0
    expected_clients: float | None = None
    seed: int | None = None
    multiplier: float = 1.0
    increment: float = 0.0

    def __post_init__(self) -> None:
        tools.check_number("initial_estimate", self.initial_estimate, 0.0, strict=True)
        q = tools.check_number("target_quantile", self.target_quantile)
        if q > 1:
            raise ValueError(f"Expected target_quantile in [0, 1], found {q}.")
        tools.check_number("learning_rate", self.learning_rate)
        tools.check_number("noise_stddev", self.noise_stddev)
        tools.check_number("multiplier", self.multiplier, 0.0, strict=True)
        tools.check_number("increment", self.increment)
        if self.expected_clients is not None:
            tools.check_number("expected_clients", self.expected_clients, 0.0, strict=True)

    def initial_state(self) -> dict[str, Any]:
        """The estimator's state `<estimate=float32,key=uint32[2]>` before the first round."""
        return {"estimate": np.float32(self.initial_estimate), "key": tools.seed_key(self.seed)}

    def threshold(self, state: Any) -> Any:
        """JAX: the norm or bound to use this round, `multiplier * estimate + increment`."""
        if self.multiplier == 1.0 and self.increment == 0.0:
            return state["estimate"]
        return (state["estimate"] * jnp.float32(self.multiplier)
                + jnp.float32(self.increment)).astype(jnp.float32)

    @staticmethod
    def report(value: Any, estimate: Any) -> Any:
        """JAX, at a client: `+0.5` when `value <= estimate`, else `-0.5` (float32)."""
        return jnp.where(value <= estimate, jnp.float32(0.5), jnp.float32(-0.5))

    def update(self, state: Any, report_sum: Any, num_clients: Any) -> dict[str, Any]:
        """JAX, at the server: the next state from the sum of the clients' reports."""
        next_key, round_key = tools.split(state["key"])
        noise = jax.random.normal(tools.wrap(round_key), (), jnp.float32) * self.noise_stddev
        denom = (
            jnp.float32(self.expected_clients)
            if self.expected_clients is not None
            else jnp.maximum(num_clients.astype(jnp.float32), 1.0)
        )
        below = (report_sum + noise) / denom + 0.5
        step = jnp.exp(-self.learning_rate * (below - self.target_quantile))
        # No clients: keep the estimate (the fraction would be meaningless).
        step = jnp.where(num_clients > 0, step, jnp.float32(1))
        return {"estimate": (state["estimate"] * step).astype(jnp.float32), "key": next_key}


def as_norm(x: Any, name: str) -> float | QuantileEstimator:
    """A positive fixed number or a `QuantileEstimator`.

    Raises:
      TypeError / ValueError: otherwise.
    """
    if isinstance(x, QuantileEstimator):
        return x
    if isinstance(x, bool) or not isinstance(x, int | float | np.integer | np.floating):
        raise TypeError(
            f"Expected {name} to be a positive number or a QuantileEstimator (adaptive), "
            f"found {type(x).__name__}."
        )
    return tools.check_number(name, x, 0.0, strict=True)
