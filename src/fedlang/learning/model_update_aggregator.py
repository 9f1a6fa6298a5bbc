"""Model update aggregators as TFF configures them: robust, DP, secure, compressed.

The four helpers of `tff.learning` (`robust_aggregator`, `dp_aggregator`,
`secure_aggregator`, `compression_aggregator`), with TFF's defaults, built from
`fedlang.aggregators`. Pass one as `model_aggregator=` to a learning algorithm:

    process = algorithms.build_weighted_fed_avg(
        model_fn, optax.sgd(0.1), model_aggregator=robust_aggregator())

`create_aggregator` makes the aggregation process of the updates from any factory, as
the algorithms do with their `model_aggregator`.

The adaptive norms are TFF's: *zeroing* drops updates above `2 * C + 1`, with `C`
adapting quickly (learning rate `ln 10`) to the 98th percentile of the update norms
from 10.0; *clipping* clips to `C`, adapting (learning rate 0.2) to their 80th
percentile from 1.0. Zeroing wraps clipping, which wraps the mean. The norm
estimates are summed in the clear (TFF's `secure_aggregator` sums them securely too);
the differences from TFF are listed in docs/from-tff.md.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from fedlang import aggregators
from fedlang.aggregators import factory
from fedlang.core import processes, types

AggregationFactory = factory.UnweightedAggregationFactory | factory.WeightedAggregationFactory


def create_aggregator(
    aggregation_factory: Any, update_type: types.Type, name: str
) -> processes.AggregationProcess:
    """The aggregation process of the clients' updates of type `update_type`, weighted by
    their float32 update weights when the factory is a weighted one.

    Args:
      aggregation_factory: a weighted or unweighted aggregation factory.
      update_type: the type of one client's update.
      name: the argument the factory was passed as (the error names it).

    Raises:
      TypeError: when `aggregation_factory` is not an aggregation factory.
    """
    if isinstance(aggregation_factory, factory.WeightedAggregationFactory):
        return aggregation_factory.create(update_type, np.float32)
    if isinstance(aggregation_factory, factory.UnweightedAggregationFactory):
        return aggregation_factory.create(update_type)
    raise TypeError(
        f"Expected {name} to be an aggregation factory (e.g. "
        f"fedlang.aggregators.MeanFactory()), found {type(aggregation_factory).__name__}."
    )


def _zeroing(inner: AggregationFactory) -> AggregationFactory:
    # Adapts very quickly to a value somewhat above the largest norms seen so far.
    norm = aggregators.QuantileEstimator(10.0, target_quantile=0.98, learning_rate=math.log(10.0),
                                         multiplier=2.0, increment=1.0)
    return aggregators.zeroing_factory(norm, inner)


def _clipping(inner: AggregationFactory) -> AggregationFactory:
    # Adapts relatively quickly to a moderately high norm.
    norm = aggregators.QuantileEstimator(1.0, target_quantile=0.8, learning_rate=0.2)
    return aggregators.clipping_factory(norm, inner)


def _robust(mean: AggregationFactory, zeroing: bool, clipping: bool) -> AggregationFactory:
    if clipping:
        mean = _clipping(mean)
    if zeroing:
        mean = _zeroing(mean)
    return mean


def robust_aggregator(*, zeroing: bool = True, clipping: bool = True,
                      weighted: bool = True) -> AggregationFactory:
    """A mean with adaptive zeroing and clipping (TFF's default model aggregator).

    Args:
      zeroing: drop (zero) updates whose L2 norm exceeds twice the adaptive 98th
        percentile plus one, or that are not finite (data corruption).
      clipping: clip updates to the adaptive 80th percentile of the norms (outliers).
      weighted: `MeanFactory()` (weighted by the clients' update weights) or
        `UnweightedMeanFactory()`.

    Returns:
      An aggregation factory, weighted iff `weighted`.
    """
    mean = aggregators.MeanFactory() if weighted else aggregators.UnweightedMeanFactory()
    return _robust(mean, zeroing, clipping)


def dp_aggregator(
    noise_multiplier: float,
    clients_per_round: float,
    zeroing: bool = True,
    *,
    adaptive: bool = True,
    clip: float = 0.1,
    target_unclipped_quantile: float = 0.5,
    seed: int | None = None,
) -> AggregationFactory:
    """DP-FedAvg's model aggregator (McMahan et al., 2018), adaptive as in TFF.

    By default (TFF's `dp_aggregator`): the Gaussian mechanism with an adaptive clip
    (`DifferentiallyPrivateFactory.gaussian_adaptive`: from 0.1 towards the median
    update norm, learning rate 0.2, clipped-count noise `0.05 * clients_per_round`),
    inside adaptive zeroing. The mean is unweighted: pass it to
    `build_unweighted_fed_avg` (a weighted builder ignores the example weights). Account
    the privacy spent with `fedlang.aggregators.PrivacyAccountant(noise_multiplier,
    clients_per_round / population, delta)`, stepped once per round.

    Args:
      noise_multiplier: `z`, the noise's standard deviation over the clip norm (of the
        whole round, clipped-count query included, when adaptive).
      clients_per_round: the expected number of clients per round (> 0).
      zeroing: wrap the DP mean in adaptive zeroing (TFF's default).
      adaptive: adapt the clip (TFF's behaviour); False clips at `clip` exactly.
      clip: the initial clip when adaptive, else the fixed clip.
      target_unclipped_quantile: the fraction of unclipped clients the adaptive clip
        aims at.
      seed: the noise seed (None: random).

    Returns:
      An unweighted aggregation factory.

    Raises:
      ValueError: on out-of-range arguments, e.g. an adaptive clip whose clipped-count
        noise would use the whole budget (`noise_multiplier >= 0.1 * clients_per_round`).

    Example:
      >>> from fedlang import aggregators
      >>> from fedlang.learning import model_update_aggregator as mua
      >>> isinstance(mua.dp_aggregator(1.0, 100), aggregators.UnweightedAggregationFactory)
      True
    """
    if adaptive:
        dp = aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(
            noise_multiplier, clients_per_round, initial_l2_norm_clip=clip,
            target_unclipped_quantile=target_unclipped_quantile, seed=seed,
        )
    else:
        dp = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
            noise_multiplier, clients_per_round, clip, seed=seed)
    return _zeroing(dp) if zeroing else dp


def secure_aggregator(*, zeroing: bool = True, clipping: bool = True,
                      weighted: bool = True) -> AggregationFactory:
    """A mean whose sums are secure sums, with adaptive zeroing and clipping.

    The weighted values are summed with `SecureSumFactory` whose bounds adapt to twice
    the 95th percentile of the clients' largest absolute value (from 50.0); the weights
    with `SecureSumFactory(2**20 - 1, 0, bits=20)` (integer weights such as example
    counts up to about a million are exact), or, unweighted, the client count with
    `SecureSumFactory(1, 0)`.

    Args:
      zeroing: adaptive zeroing (see `robust_aggregator`).
      clipping: adaptive L2 clipping before the secure sum's per-coordinate bounds.
      weighted: a weighted or an unweighted mean.

    Returns:
      An aggregation factory, weighted iff `weighted`.
    """
    bound = aggregators.QuantileEstimator(50.0, target_quantile=0.95, learning_rate=1.0,
                                          multiplier=2.0)
    values = aggregators.SecureSumFactory(bound)
    mean: AggregationFactory
    if weighted:
        mean = aggregators.MeanFactory(
            value_sum_factory=values,
            weight_sum_factory=aggregators.SecureSumFactory(float(2**20 - 1), 0.0, bits=20))
    else:
        mean = aggregators.UnweightedMeanFactory(
            value_sum_factory=values, count_sum_factory=aggregators.SecureSumFactory(1, 0))
    return _robust(mean, zeroing, clipping)


def compression_aggregator(*, zeroing: bool = True, clipping: bool = True,
                           weighted: bool = True) -> AggregationFactory:
    """A mean of 8-bit quantized updates, with adaptive zeroing and clipping.

    Tensors with more than 20,000 elements are uniformly quantized to 8 bits with
    stochastic rounding (`EncodedSumFactory.quantize(8, threshold=20_000)`); smaller
    ones travel as they are (Suresh et al., 2017; TFF's defaults).

    Args:
      zeroing: adaptive zeroing (see `robust_aggregator`).
      clipping: adaptive L2 clipping.
      weighted: a weighted or an unweighted mean.

    Returns:
      An aggregation factory, weighted iff `weighted`.
    """
    encoded = aggregators.EncodedSumFactory.quantize(8, threshold=20_000)
    mean = (aggregators.MeanFactory(value_sum_factory=encoded) if weighted
            else aggregators.UnweightedMeanFactory(value_sum_factory=encoded))
    return _robust(mean, zeroing, clipping)
