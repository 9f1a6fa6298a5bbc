"""DP-FedAvg: the differentially private model aggregator for the FedAvg family."""

from __future__ import annotations

from fedlang import aggregators


def dp_aggregator(
    noise_multiplier: float,
    clients_per_round: float,
    clip: float = 0.1,
    adaptive: bool = False,
    target_unclipped_quantile: float = 0.5,
    seed: int | None = None,
) -> aggregators.DifferentiallyPrivateFactory:
    """The `model_aggregator` of DP-FedAvg (McMahan et al., 2018).

    Pass it to `build_unweighted_fed_avg(..., model_aggregator=dp_aggregator(...))` (or
    the weighted builder: the DP mean is unweighted). Account the privacy spent with
    `fedlang.aggregators.PrivacyAccountant(noise_multiplier, clients_per_round /
    population, delta)`, stepping it once per round.

    Args:
      noise_multiplier: `z`, the noise's standard deviation over the clip norm.
      clients_per_round: the expected number of clients per round.
      clip: the L2 clip norm (the initial one when `adaptive`).
      adaptive: adapt the clip to the `target_unclipped_quantile` of update norms.
      target_unclipped_quantile: see `DifferentiallyPrivateFactory.gaussian_adaptive`.
      seed: the noise seed (None: random).

    Returns:
      A `DifferentiallyPrivateFactory`.

    Example:
      >>> from fedlang.learning import dp
      >>> type(dp.dp_aggregator(1.0, 10, clip=0.5)).__name__
      'DifferentiallyPrivateFactory'
    """
    if adaptive:
        return aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(
            noise_multiplier, clients_per_round, initial_l2_norm_clip=clip,
            target_unclipped_quantile=target_unclipped_quantile, seed=seed,
        )
    return aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        noise_multiplier, clients_per_round, clip, seed=seed
    )
