"""FedSGD: one gradient step per round on the cohort's mean gradient."""

from __future__ import annotations

import optax

from fedlang import aggregators
from fedlang.learning import client_works, model_update_aggregator, optimizers, templates
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import ModelFn

_SERVER_SGD = optax.sgd(0.1)


@common.tff_keywords
def build_fed_sgd(
    model_fn: ModelFn,
    server_optimizer: optimizers.Optimizer = _SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Federated SGD (Shokri & Shmatikov, 2015; McMahan et al., 2017).

    Each client computes the mean gradient of its examples at the server weights; the
    server averages them (weighted by examples: the gradient of the mean loss over all
    the cohort's examples) and takes one `server_optimizer` step.

    Args:
      model_fn: a no-argument function returning a model.
      server_optimizer: applied to the averaged gradient (default `optax.sgd(0.1)`).
      client_weighting: 'num_examples' (default) or 'uniform'.
      model_distributor: replaces the broadcast of the weights.
      model_aggregator: an aggregation factory for the gradients (default `MeanFactory()`).
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess`.

    Raises:
      TypeError: for an unweighted `model_aggregator` with `client_weighting` other
        than 'uniform'.
    """
    model = common.make_model(model_fn)
    work = client_works.build_gradient_client_work(model, client_weighting)
    common.check_weighted_aggregator(model_aggregator, client_weighting, "build_fed_sgd")
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )
