"""`DifferentiallyPrivateFactory`: the Gaussian mechanism (DP-FedAvg) and DP-FTRL tree noise.

Each client's value is clipped to global L2 norm `C`; the server sums the clipped
values, adds Gaussian noise, and divides by the *expected* number of clients per round
(`clients_per_round`), so the result is a noised mean whose denominator does not leak
the actual count (McMahan et al., "Learning Differentially Private Recurrent Language
Models", 2018). Noise is added on the server after summing; it is drawn from a PRNG
key carried in the state, so a run is reproducible from its seed.

* `gaussian_fixed(z, n, C)`: noise `N(0, (z C)^2)` per coordinate.
* `gaussian_adaptive(z, n, ...)`: `C` follows a private quantile estimate of the client
  norms (Andrew et al., 2021); the noise budget is split between the value
  (`z_value`) and the clipped-count query so the whole round has multiplier `z`:
  `z^-2 = z_value^-2 + (2 sigma_b)^-2`.
* `tree_aggregation(z, n, C)`: DP-FTRL (Kairouz et al., 2021). Round `t` releases
  `sum_t + N(t+1) - N(t)`, where `N(m)` is the sum of the Gaussian noises of the
  dyadic tree nodes covering rounds `[0, m)`; the *cumulative* sum of the results (what
  an FTRL / SGD server accumulates) carries only `O(log t)` node noises.

Type signature (unweighted):

    create(V) -> AggregationProcess
      initialize: ( -> <clip=..., key=uint32[2], round=int32>@SERVER)
      next: (<state, {V}@CLIENTS> -> <state, V@SERVER,
             <dp_clip=float32,noise_stddev=float32,clipped_count=int32,num_clients=int32>@SERVER>)

`clip` is a `float32` for fixed clipping, the `QuantileEstimator` state when adaptive.
Privacy is accounted with `fedlang.aggregators.dp_epsilon` / `PrivacyAccountant`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import clipping, factory, quantile, tools
from fedlang.core import jax_computation as jax_backend
from fedlang.core import operators, templates, tracing, types

TREE_LEVELS = 24  # supports 2^24 rounds


def tree_noise(key: Any, m: Any, like: Any, stddev: Any) -> Any:
    """JAX: the sum of the node noises of the dyadic decomposition of rounds `[0, m)`.

    For each set bit `l` of `m`, the node at level `l` with index `(m >> l) - 1`
    covers `2^l` rounds; its noise is drawn from `key` folded with `(l, index)`, so any
    node's noise can be regenerated without storing it.
    """
    def add_level(level: Any, total: Any) -> Any:
        bit = (m >> level) & 1
        index = jnp.maximum((m >> level) - 1, 0)
        node_key = jax.random.fold_in(jax.random.fold_in(key, level), index)
        noise = tools.gaussian_like(node_key, like, stddev)
        return jax.tree.map(lambda t, z: t + jnp.where(bit == 1, z, 0).astype(t.dtype),
                            total, noise)

    return jax.lax.fori_loop(0, TREE_LEVELS, add_level, jax.tree.map(jnp.zeros_like, like))


class DifferentiallyPrivateFactory(factory.UnweightedAggregationFactory):
    """A differentially private noised mean of clipped client values.

    Build it with `gaussian_fixed`, `gaussian_adaptive` or `tree_aggregation`; the
    constructor takes the same arguments in their general form.

    Args:
      noise_multiplier: `z >= 0`, the ratio of the noise's standard deviation to the
        clip norm (the sensitivity of the sum).
      clients_per_round: the expected number of clients per round (the denominator).
      clip: a positive L2 norm, or a `QuantileEstimator` (adaptive).
      mechanism: 'gaussian' or 'tree' (DP-FTRL tree aggregation; fixed clip only).
      value_noise_multiplier: the multiplier applied to the value (defaults to
        `noise_multiplier`; smaller when part of the budget goes to adaptive clipping).
      seed: the seed of the noise (None: a random seed at `create`).

    Raises:
      TypeError / ValueError: on out-of-range or ill-typed arguments.

    Example:
      >>> import numpy as np
      >>> from fedlang import aggregators
      >>> f = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
      ...     noise_multiplier=0.0, clients_per_round=2, clip=1.0)
      >>> p = f.create((np.float32, [2]))
      >>> out = p.next(p.initialize(), [np.array([3.0, 4.0]), np.array([0.3, 0.4])])
      >>> print(np.round(out.result, 4), int(out.measurements['clipped_count']))
      [0.45 0.6 ] 1
    """

    def __init__(
        self,
        noise_multiplier: float,
        clients_per_round: float,
        clip: float | quantile.QuantileEstimator,
        *,
        mechanism: str = "gaussian",
        value_noise_multiplier: float | None = None,
        seed: int | None = None,
    ):
        self.noise_multiplier = tools.check_number("noise_multiplier", noise_multiplier)
        self.clients_per_round = tools.check_number(
            "clients_per_round", clients_per_round, 0.0, strict=True
        )
        self.clip = quantile.as_norm(clip, "clip")
        if mechanism not in ("gaussian", "tree"):
            raise ValueError(f"Expected mechanism 'gaussian' or 'tree', found {mechanism!r}.")
        if mechanism == "tree" and isinstance(self.clip, quantile.QuantileEstimator):
            raise ValueError(
                "Expected a fixed clip for tree aggregation, found a QuantileEstimator; "
                "DP-FTRL's accounting assumes a fixed sensitivity."
            )
        self.mechanism = mechanism
        self.value_noise_multiplier = (
            self.noise_multiplier
            if value_noise_multiplier is None
            else tools.check_number("value_noise_multiplier", value_noise_multiplier)
        )
        self.seed = seed

    @classmethod
    def gaussian_fixed(
        cls, noise_multiplier: float, clients_per_round: float, clip: float,
        seed: int | None = None,
    ) -> DifferentiallyPrivateFactory:
        """The Gaussian mechanism with a fixed clip norm (DP-FedAvg).

        Args:
          noise_multiplier: `z`; the noise has standard deviation `z * clip`.
          clients_per_round: the expected cohort size (the mean's denominator).
          clip: the L2 norm each client's value is clipped to.
          seed: the noise seed (None: random).

        Returns:
          A `DifferentiallyPrivateFactory`.
        """
        return cls(noise_multiplier, clients_per_round, clip, seed=seed)

    @classmethod
    def gaussian_adaptive(
        cls,
        noise_multiplier: float,
        clients_per_round: float,
        initial_l2_norm_clip: float = 0.1,
        target_unclipped_quantile: float = 0.5,
        learning_rate: float = 0.2,
        clipped_count_stddev: float | None = None,
        seed: int | None = None,
    ) -> DifferentiallyPrivateFactory:
        """The Gaussian mechanism with an adaptive clip (Andrew et al., 2021).

        Args:
          noise_multiplier: `z` of the whole round (value and clipped count together).
          clients_per_round: the expected cohort size.
          initial_l2_norm_clip: the first round's clip.
          target_unclipped_quantile: the fraction of clients whose values should be
            unclipped.
          learning_rate: the geometric update's step.
          clipped_count_stddev: the noise on the count of unclipped clients (default
            `0.05 * clients_per_round`, as in TFF).
          seed: the noise seed (None: random).

        Returns:
          A `DifferentiallyPrivateFactory`.

        Raises:
          ValueError: when `noise_multiplier >= 2 * clipped_count_stddev` (the count
            would use the whole budget); raise `clipped_count_stddev`.
        """
        z = tools.check_number("noise_multiplier", noise_multiplier)
        n = tools.check_number("clients_per_round", clients_per_round, 0.0, strict=True)
        sigma_b = 0.05 * n if clipped_count_stddev is None else tools.check_number(
            "clipped_count_stddev", clipped_count_stddev)
        if z == 0:
            z_value, sigma_b = 0.0, 0.0
        else:
            if sigma_b <= 0 or z >= 2 * sigma_b:
                raise ValueError(
                    f"Expected noise_multiplier < 2 * clipped_count_stddev, found {z} >= "
                    f"{2 * sigma_b}. Pass a larger clipped_count_stddev."
                )
            z_value = (z**-2 - (2 * sigma_b) ** -2) ** -0.5
        estimator = quantile.QuantileEstimator(
            initial_l2_norm_clip, target_unclipped_quantile, learning_rate,
            noise_stddev=sigma_b, expected_clients=n,
            seed=None if seed is None else seed + 1,
        )
        return cls(z, n, estimator, value_noise_multiplier=z_value, seed=seed)

    @classmethod
    def tree_aggregation(
        cls, noise_multiplier: float, clients_per_round: float, clip: float,
        seed: int | None = None,
    ) -> DifferentiallyPrivateFactory:
        """DP-FTRL's tree-aggregated noise (see the module docstring).

        Use it with a server optimizer that applies the sum of the results (SGD with
        momentum 0 is FTRL); each node noise has standard deviation `z * clip`.

        Returns:
          A `DifferentiallyPrivateFactory`.
        """
        return cls(noise_multiplier, clients_per_round, clip, mechanism="tree", seed=seed)

    def create(self, value_type: Any) -> templates.AggregationProcess:
        """Returns the DP process for floating `value_type` (see the module docstring)."""
        value_t = factory.check_value_type(value_type, "f")
        clip, adaptive, tree = self.clip, isinstance(self.clip, quantile.QuantileEstimator), (
            self.mechanism == "tree")
        z, n_expected = self.value_noise_multiplier, self.clients_per_round
        clip_t = quantile.STATE_TYPE if adaptive else types.TensorType(np.float32)
        state_t = types.to_type({"clip": clip_t, "key": tools.KEY_TYPE, "round": np.int32})
        limited_t = types.to_type({"value": value_t, "hit": np.int32, "report": np.float32})
        seed_key = tools.seed_key(self.seed)
        initial = {
            "clip": (
                clip.initial_state()
                if isinstance(clip, quantile.QuantileEstimator)  # i.e. adaptive
                else np.float32(clip)
            ),
            "key": seed_key,
            "round": np.int32(0),
        }

        @jax_backend.jax_computation(value_t, np.float32, result_type=limited_t)
        def limit(value, c):
            out, hit, norm = clipping.limit_norm(value, c, "clip")
            return {"value": out, "hit": hit, "report": quantile.QuantileEstimator.report(norm, c)}

        def clip_of(state):
            return state["clip"]["estimate"] if adaptive else state["clip"]

        @jax_backend.jax_computation(state_t, result_type=np.float32)
        def current_clip(state):
            return clip_of(state)

        @jax_backend.jax_computation(state_t, value_t, np.float32, np.int32)
        def noised_mean(state, total, report_sum, n):
            c = clip_of(state)
            stddev = jnp.float32(z) * c
            if tree:
                key = tools.wrap(state["key"])
                t = state["round"]
                noise = jax.tree.map(
                    lambda a, b: a - b,
                    tree_noise(key, t + 1, total, stddev),
                    tree_noise(key, t, total, stddev),
                )
                next_key = state["key"]
            else:
                next_key, round_key = tools.split(state["key"])
                noise = tools.gaussian_like(tools.wrap(round_key), total, stddev)
            mean = jax.tree.map(lambda s, e: (s + e) / jnp.float32(n_expected).astype(s.dtype),
                                total, noise)
            new_clip = clip.update(state["clip"], report_sum, n) if adaptive else state["clip"]
            new_state = {"clip": new_clip, "key": next_key, "round": state["round"] + 1}
            return {"state": new_state, "mean": mean, "stddev": stddev}

        @tracing.federated_computation()
        def initialize():
            return operators.federated_value(initial, types.SERVER)

        @tracing.federated_computation(types.type_at_server(state_t), types.type_at_clients(value_t))
        def next_fn(state, value):
            c = operators.federated_map(current_clip, state)
            limited = operators.federated_map(limit, (value, operators.federated_broadcast(c)))
            total = operators.federated_sum(limited.value)
            report_sum = operators.federated_sum(limited.report)
            n = tools.count_clients(value)
            out = operators.federated_map(noised_mean, (state, total, report_sum, n))
            measurements = {
                "dp_clip": c,
                "noise_stddev": out.stddev,
                "clipped_count": operators.federated_sum(limited.hit),
                "num_clients": n,
            }
            return templates.MeasuredProcessOutput(
                out.state, out.mean, operators.federated_zip(measurements)
            )

        return templates.AggregationProcess(initialize, next_fn)
