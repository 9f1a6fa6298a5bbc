"""`DifferentiallyPrivateFactory`: the Gaussian mechanism (DP-FedAvg) and DP-FTRL tree noise.

Each client's value is clipped to global L2 norm `C`; the clipped values are summed by
an inner *record aggregation* factory (`SumFactory()` by default; `SecureSumFactory`
for DP over secure aggregation, as TFF's `DifferentiallyPrivateFactory(query,
record_aggregation_factory)`); the server adds noise to the sum and divides by the
*expected* number of clients per round (`clients_per_round`), so the result is a noised
mean whose denominator does not leak the actual count (McMahan et al., "Learning
Differentially Private Recurrent Language Models", 2018). Noise is drawn from a PRNG
key carried in the state, so a run is reproducible from its seed.

A DP aggregation is a clip (a number, or a `QuantileEstimator` for an adaptive clip)
and a `NoiseMechanism`, an object of pure functions (`GAUSSIAN`, `TREE`):

* `gaussian_fixed(z, n, C)`: `GAUSSIAN` noise `N(0, (z C)^2)` per coordinate.
* `gaussian_adaptive(z, n, ...)`: `GAUSSIAN`, with `C` following a private quantile
  estimate of the client norms (Andrew et al., 2021); the noise budget is split between
  the value (`z_value`) and the clipped-count query so the whole round has multiplier
  `z`: `z^-2 = z_value^-2 + (2 sigma_b)^-2`.
* `tree_aggregation(z, n, C)`: `TREE`, DP-FTRL (Kairouz et al., 2021). Round `t`
  releases `sum_t + N(t+1) - N(t)`, where `N(m)` is the sum of the Gaussian noises of
  the dyadic tree nodes covering rounds `[0, m)`; the *cumulative* sum of the results
  (what an FTRL / SGD server accumulates) carries only `O(log t)` node noises.

Type signature (unweighted):

    create(V) -> AggregationProcess
      initialize: ( -> <clip=...,key=uint32[2],round=int32,record_aggregation=S>@SERVER)
      next: (<state, {V}@CLIENTS> -> <state, V@SERVER,
             <dp_clip=float32,noise_stddev=float32,clipped_count=int32,num_clients=int32
              [,record_aggregation=M]>@SERVER>)

`clip` is a `float32` for a fixed clip, the `QuantileEstimator` state when adaptive;
`S` and `M` are the record aggregation's state and measurements (`M` only when it has
some). Privacy is accounted with `fedlang.aggregators.dp_epsilon` / `PrivacyAccountant`
(`mechanism=` the `NoiseMechanism`'s `accounting`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import clipping, factory, quantile, tools
from fedlang.aggregators import sum as sum_lib
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import operators, processes, tracing, types

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


class NoiseMechanism(NamedTuple):
    """How the server noises the sum of clipped values: a pure JAX function and facts.

    Attributes:
      name: its name (also accepted by `DifferentiallyPrivateFactory(mechanism=...)`).
      noise: `noise(key, round_num, like, stddev) -> (noise, next_key)`: the noise to
        add to the sum `like` in round `round_num` (an int32 scalar) and the key of the
        next round (raw `uint32[2]` keys).
      adaptive_clip: whether it may be used with an adaptive clip.
      accounting: the `mechanism` argument of `dp_epsilon` / `PrivacyAccountant`.
    """

    name: str
    noise: Callable[[Any, Any, Any, Any], tuple[Any, Any]]
    adaptive_clip: bool
    accounting: str


def _gaussian_noise(key: Any, round_num: Any, like: Any, stddev: Any) -> tuple[Any, Any]:
    del round_num
    next_key, round_key = tools.split(key)
    return tools.gaussian_like(tools.wrap(round_key), like, stddev), next_key


def _tree_noise(key: Any, round_num: Any, like: Any, stddev: Any) -> tuple[Any, Any]:
    k = tools.wrap(key)
    noise = jax.tree.map(lambda a, b: a - b, tree_noise(k, round_num + 1, like, stddev),
                         tree_noise(k, round_num, like, stddev))
    return noise, key  # node noises are regenerated from the same key every round


# Fresh N(0, (z C)^2) noise each round: DP-FedAvg, with a fixed or an adaptive clip.
GAUSSIAN = NoiseMechanism("gaussian", _gaussian_noise, adaptive_clip=True, accounting="gaussian")
# DP-FTRL's dyadic tree noise (module docstring): a fixed clip only.
TREE = NoiseMechanism("tree", _tree_noise, adaptive_clip=False, accounting="tree")
MECHANISMS = {m.name: m for m in (GAUSSIAN, TREE)}


def as_mechanism(mechanism: str | NoiseMechanism) -> NoiseMechanism:
    """A `NoiseMechanism` from itself or its name.

    Raises:
      ValueError: for an unknown name; TypeError: for anything else.
    """
    if isinstance(mechanism, NoiseMechanism):
        return mechanism
    if isinstance(mechanism, str):
        if mechanism not in MECHANISMS:
            raise ValueError(f"Expected mechanism in {sorted(MECHANISMS)}, found {mechanism!r}.")
        return MECHANISMS[mechanism]
    raise TypeError(
        "Expected a NoiseMechanism (dp.GAUSSIAN, dp.TREE) or its name, found "
        f"{type(mechanism).__name__}."
    )


class DifferentiallyPrivateFactory(factory.UnweightedAggregationFactory):
    """A differentially private noised mean of clipped client values.

    Build it with `gaussian_fixed`, `gaussian_adaptive` or `tree_aggregation`; the
    constructor takes the same arguments in their general form.

    Args:
      noise_multiplier: `z >= 0`, the ratio of the noise's standard deviation to the
        clip norm (the sensitivity of the sum).
      clients_per_round: the expected number of clients per round (the denominator).
      clip: a positive L2 norm, or a `QuantileEstimator` (adaptive).
      mechanism: a `NoiseMechanism` (`GAUSSIAN`; `TREE` for DP-FTRL with a fixed clip),
        or its name.
      value_noise_multiplier: the multiplier applied to the value (defaults to
        `noise_multiplier`; smaller when part of the budget goes to adaptive clipping).
      seed: the seed of the noise (None: a random seed at `create`).
      record_aggregation_factory: the unweighted factory summing the clipped values
        (default `SumFactory()`), e.g. `SecureSumFactory(C)` for a fixed clip `C` (each
        coordinate of a value of L2 norm at most `C` lies in `[-C, C]`).

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
        mechanism: str | NoiseMechanism = GAUSSIAN,
        value_noise_multiplier: float | None = None,
        seed: int | None = None,
        record_aggregation_factory: factory.UnweightedAggregationFactory | None = None,
    ):
        self.noise_multiplier = tools.check_number("noise_multiplier", noise_multiplier)
        self.clients_per_round = tools.check_number(
            "clients_per_round", clients_per_round, 0.0, strict=True
        )
        self.clip = quantile.as_norm(clip, "clip")
        self.mechanism = as_mechanism(mechanism)
        if not self.mechanism.adaptive_clip and isinstance(self.clip, quantile.QuantileEstimator):
            raise ValueError(
                f"Expected a fixed clip for the {self.mechanism.name!r} mechanism (tree "
                "aggregation), found a QuantileEstimator; DP-FTRL's accounting assumes a fixed "
                "sensitivity."
            )
        self.value_noise_multiplier = (
            self.noise_multiplier
            if value_noise_multiplier is None
            else tools.check_number("value_noise_multiplier", value_noise_multiplier)
        )
        self.seed = seed
        inner = sum_lib.SumFactory() if record_aggregation_factory is None else (
            record_aggregation_factory)
        if not isinstance(inner, factory.UnweightedAggregationFactory):
            raise TypeError(
                "Expected record_aggregation_factory to be an UnweightedAggregationFactory "
                f"(SumFactory(), SecureSumFactory(...)), found {type(inner).__name__}."
            )
        self.record_aggregation_factory = inner

    @classmethod
    def gaussian_fixed(
        cls, noise_multiplier: float, clients_per_round: float, clip: float,
        seed: int | None = None,
        record_aggregation_factory: factory.UnweightedAggregationFactory | None = None,
    ) -> DifferentiallyPrivateFactory:
        """The Gaussian mechanism with a fixed clip norm (DP-FedAvg).

        Args:
          noise_multiplier: `z`; the noise has standard deviation `z * clip`.
          clients_per_round: the expected cohort size (the mean's denominator).
          clip: the L2 norm each client's value is clipped to.
          seed: the noise seed (None: random).
          record_aggregation_factory: sums the clipped values (default `SumFactory()`).

        Returns:
          A `DifferentiallyPrivateFactory`.
        """
        return cls(noise_multiplier, clients_per_round, clip, seed=seed,
                   record_aggregation_factory=record_aggregation_factory)

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
        record_aggregation_factory: factory.UnweightedAggregationFactory | None = None,
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
          record_aggregation_factory: sums the clipped values (default `SumFactory()`;
            a secure sum needs bounds that follow the clip, e.g. adaptive ones).

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
        return cls(z, n, estimator, value_noise_multiplier=z_value, seed=seed,
                   record_aggregation_factory=record_aggregation_factory)

    @classmethod
    def tree_aggregation(
        cls, noise_multiplier: float, clients_per_round: float, clip: float,
        seed: int | None = None,
        record_aggregation_factory: factory.UnweightedAggregationFactory | None = None,
    ) -> DifferentiallyPrivateFactory:
        """DP-FTRL's tree-aggregated noise (see the module docstring).

        Use it with a server optimizer that applies the sum of the results (SGD with
        momentum 0 is FTRL); each node noise has standard deviation `z * clip`.

        Returns:
          A `DifferentiallyPrivateFactory`.
        """
        return cls(noise_multiplier, clients_per_round, clip, mechanism=TREE, seed=seed,
                   record_aggregation_factory=record_aggregation_factory)

    def create(self, value_type: Any) -> processes.AggregationProcess:
        """Returns the DP process for floating `value_type` (see the module docstring)."""
        value_t = factory.check_value_type(value_type, "f")
        clip, adaptive = self.clip, isinstance(self.clip, quantile.QuantileEstimator)
        noise_fn = self.mechanism.noise
        z, n_expected = self.value_noise_multiplier, self.clients_per_round
        inner = self.record_aggregation_factory.create(value_t)
        clip_t = quantile.STATE_TYPE if adaptive else types.TensorType(np.float32)
        state_t = types.to_type({"clip": clip_t, "key": tools.KEY_TYPE, "round": np.int32})
        limited_t = types.to_type({"value": value_t, "hit": np.int32, "report": np.float32})
        norms_t = types.to_type({"threshold": np.float32, "estimate": np.float32})
        initial = {
            "clip": (
                clip.initial_state()
                if isinstance(clip, quantile.QuantileEstimator)  # i.e. adaptive
                else np.float32(clip)
            ),
            "key": tools.seed_key(self.seed),
            "round": np.int32(0),
        }

        @jax_backend.jax_computation(value_t, norms_t, result_type=limited_t)
        def limit(value, norms):
            out, hit, norm = clipping.limit_norm(value, norms["threshold"], "clip")
            return {"value": out, "hit": hit,
                    "report": quantile.QuantileEstimator.report(norm, norms["estimate"])}

        def clip_of(state):
            return clip.threshold(state["clip"]) if adaptive else state["clip"]

        @jax_backend.jax_computation(state_t, result_type=norms_t)
        def current_norms(state):
            estimate = state["clip"]["estimate"] if adaptive else state["clip"]
            return {"threshold": clip_of(state), "estimate": estimate}

        @jax_backend.jax_computation(state_t, value_t, np.float32, np.int32)
        def noised_mean(state, total, report_sum, n):
            stddev = jnp.float32(z) * clip_of(state)
            noise, next_key = noise_fn(state["key"], state["round"], total, stddev)
            mean = jax.tree.map(lambda s, e: (s + e) / jnp.float32(n_expected).astype(s.dtype),
                                total, noise)
            new_clip = clip.update(state["clip"], report_sum, n) if adaptive else state["clip"]
            new_state = {"clip": new_clip, "key": next_key, "round": state["round"] + 1}
            return {"state": new_state, "mean": mean, "stddev": stddev}

        @tracing.federated_computation()
        def initialize():
            return operators.federated_zip({
                **{k: operators.federated_value(v, types.SERVER) for k, v in initial.items()},
                "record_aggregation": inner.initialize(),
            })

        @tracing.federated_computation(initialize.type_signature.result,
                                       types.type_at_clients(value_t))
        def next_fn(state, value):
            dp_state = operators.federated_zip({k: getattr(state, k) for k in initial})
            norms = operators.federated_map(current_norms, dp_state)
            limited = operators.federated_map(limit, (value, operators.federated_broadcast(norms)))
            agg = inner.next(state.record_aggregation, limited.value)
            report_sum = operators.federated_sum(limited.report)
            n = tools.count_clients(value)
            out = operators.federated_map(noised_mean, (dp_state, agg.result, report_sum, n))
            measurements = {
                "dp_clip": norms.threshold,
                "noise_stddev": out.stddev,
                "clipped_count": operators.federated_sum(limited.hit),
                "num_clients": n,
            }
            if len(agg.measurements.type_signature.member):
                measurements["record_aggregation"] = agg.measurements
            new_state = operators.federated_zip({
                **{k: getattr(out.state, k) for k in initial},
                "record_aggregation": agg.state,
            })
            return processes.MeasuredProcessOutput(
                new_state, out.mean, operators.federated_zip(measurements)
            )

        return processes.AggregationProcess(initialize, next_fn)
