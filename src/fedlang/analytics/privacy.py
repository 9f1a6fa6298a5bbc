"""How the analytics aggregate: plainly, securely, or with differential privacy.

Every analytic sums one vector per client (counts, sums, votes, sketches). `Privacy`
says how that sum is taken, always through the aggregators' factories:

* `None` (the default): `federated_sum`, exact.
* `Privacy(noise_multiplier=z, clip=C)`: the Gaussian mechanism of
  `aggregators.DifferentiallyPrivateFactory.gaussian_fixed(z, 1, C)`: each client's
  vector is clipped to L2 norm `C` and the server adds `N(0, (z C)^2)` to each entry of
  the sum (the factory's mean over `clients_per_round=1` is that noised sum).
  `secure=True` sums the clipped vectors with `SecureSumFactory(C)` inside it (DP over
  secure aggregation).
* `secure_bound=B` on an analytic without DP: `SecureSumFactory(B)` alone.

The privacy cost of `rounds` aggregations is `(epsilon, delta)` from
`aggregators.dp_epsilon` (the accountant): `Privacy.spent(rounds)`.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple

import jax.numpy as jnp
import numpy as np

from fedlang import aggregators
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, types


class Spent(NamedTuple):
    """The privacy cost of a run: `(epsilon, delta)`."""

    epsilon: float
    delta: float


@dataclasses.dataclass(frozen=True)
class Privacy:
    """Differential privacy for an analytic (see the module docstring).

    Attributes:
      noise_multiplier: `z > 0`; the noise's standard deviation is `z * clip`.
      clip: the L2 norm each client's contribution vector is clipped to (the
        sensitivity of the sum). Each analytic's docstring says what one client adds.
      delta: the `delta` of the reported `(epsilon, delta)`.
      sampling_probability: the chance that a client takes part (cohort / population);
        1 when every client of the population is in the computation.
      seed: the noise seed (None: random).
      secure: sum the clipped vectors with secure aggregation (`SecureSumFactory`).
    """

    noise_multiplier: float
    clip: float
    delta: float = 1e-6
    sampling_probability: float = 1.0
    seed: int | None = None
    secure: bool = False

    def __post_init__(self) -> None:
        for name in ("noise_multiplier", "clip", "delta", "sampling_probability"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
                raise ValueError(f"Expected Privacy.{name} to be a positive number, found {value!r}.")
        if not self.delta < 1 or self.sampling_probability > 1:
            raise ValueError(
                "Expected Privacy.delta in (0, 1) and sampling_probability in (0, 1], found "
                f"{self.delta} and {self.sampling_probability}."
            )

    @property
    def stddev(self) -> float:
        """The standard deviation of the noise on each entry of a sum."""
        return self.noise_multiplier * self.clip

    def spent(self, rounds: int = 1) -> Spent:
        """`(epsilon, delta)` of `rounds` noised sums, from the aggregators' accountant."""
        eps = aggregators.dp_epsilon(
            self.noise_multiplier, self.sampling_probability, rounds, self.delta
        )
        return Spent(float(eps), self.delta)

    def factory(self) -> aggregators.DifferentiallyPrivateFactory:
        """The aggregators' DP factory this configuration stands for."""
        inner = aggregators.SecureSumFactory(self.clip) if self.secure else None
        return aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
            self.noise_multiplier, 1.0, self.clip, seed=self.seed, record_aggregation_factory=inner
        )


def check_privacy(privacy: Any) -> Privacy | None:
    if privacy is not None and not isinstance(privacy, Privacy):
        raise TypeError(
            f"Expected privacy=None or a fedlang.analytics.Privacy, found {types.describe(privacy)}."
        )
    return privacy


def float_type(t: types.Type) -> types.Type:
    """`t` with float32 leaves (DP and secure sums add noise or quantize: floats)."""
    if isinstance(t, types.StructType):
        return types.StructType([(n, float_type(e)) for n, e in t.elements], t.container)
    assert isinstance(t, types.TensorType)
    return types.TensorType(np.float32, t.shape)


def aggregate(value: Any, privacy: Privacy | None, secure_bound: float | None = None) -> Any:
    """Sums `{T}@CLIENTS` into `T@SERVER` (or float32 `T` with DP or secure aggregation).

    Used inside a `federated_computation`; see the module docstring for the three ways.
    """
    member = value.type_signature.member
    if privacy is None and secure_bound is None:
        return operators.federated_sum(value)
    if not isinstance(member, types.TensorType):
        raise TypeError(f"Expected a tensor to aggregate privately, found {member}.")
    f_t = float_type(member)

    @jax_backend.jax_computation(member)
    def to_float(v):
        return jnp.asarray(v, jnp.float32)

    floats = operators.federated_map(to_float, value)
    if privacy is not None:
        process = privacy.factory().create(f_t)
    else:
        assert secure_bound is not None
        if not (isinstance(secure_bound, int | float) and secure_bound > 0 and math.isfinite(secure_bound)):
            raise ValueError(f"Expected a positive finite secure_bound, found {secure_bound!r}.")
        process = aggregators.SecureSumFactory(float(secure_bound)).create(f_t)
    return process.next(process.initialize(), floats).result
