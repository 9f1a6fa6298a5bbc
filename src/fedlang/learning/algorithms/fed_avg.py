"""Federated Averaging and its family: weighted, unweighted, FedProx, FedOpt.

Each is a few lines: model-delta client work (with or without a proximal term), a
mean aggregator, and a finalizer applying the server optimizer.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import optax

from fedlang import aggregators
from fedlang.learning import client_works, model_update_aggregator, optimizers, templates
from fedlang.learning.algorithms import common
from fedlang.learning.models import model as model_lib

ModelFn = Callable[[], model_lib.Model]

# The default server optimizer: plain averaging of the client models.
SERVER_SGD = optax.sgd(1.0)
# What a weighted builder given an unweighted aggregator says to do instead.
_USE_UNWEIGHTED = ("Use build_unweighted_fed_avg or client_weighting='uniform' for an "
                   "unweighted aggregator")


@common.tff_keywords
def build_weighted_fed_avg(
    model_fn: ModelFn,
    client_optimizer: optimizers.Optimizer,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Federated Averaging (McMahan et al., 2017) with weighted client updates.

    Args:
      model_fn: a no-argument function returning a `fedlang.learning.models.Model`.
      client_optimizer: an Optax transformation (or `round_num -> transformation`).
      server_optimizer: applied to the averaged update (`optax.sgd(1.0)`: plain
        averaging; `optax.adam(...)`: FedAdam).
      client_weighting: 'num_examples' (default) or 'uniform'.
      model_distributor: replaces the broadcast of the weights.
      model_aggregator: a weighted aggregation factory for the updates (default
        `MeanFactory()`, weighted by `client_weighting`); an unweighted one (e.g.
        `dp_aggregator()`) only with `client_weighting='uniform'`, as TFF's weighted
        builder takes only weighted ones (or use `build_unweighted_fed_avg`).
      seed: the seed of the model's initial weights.

    Returns:
      A `LearningProcess`; training metrics are under
      `metrics['client_work']['train']`.

    Raises:
      TypeError: for an unweighted `model_aggregator` with `client_weighting`
        other than 'uniform'.

    Example:
      >>> process = build_weighted_fed_avg(model_fn, optax.sgd(0.1))  # doctest: +SKIP
      >>> state = process.initialize()  # doctest: +SKIP
      >>> state, metrics = process.next(state, client_datasets)  # doctest: +SKIP
    """
    model = common.make_model(model_fn)
    work = client_works.build_model_delta_client_work(model, client_optimizer, client_weighting)
    common.check_weighted_aggregator(model_aggregator, client_weighting, "build_weighted_fed_avg",
                                     _USE_UNWEIGHTED)
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )


@common.tff_keywords
def build_unweighted_fed_avg(
    model_fn: ModelFn,
    client_optimizer: optimizers.Optimizer,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """Federated Averaging where every client's update counts equally.

    Args are as for `build_weighted_fed_avg`; `model_aggregator` defaults to
    `UnweightedMeanFactory()` (a weighted factory is given weight 1 per client).

    Returns:
      A `LearningProcess`.
    """
    model = common.make_model(model_fn)
    work = client_works.build_model_delta_client_work(model, client_optimizer, "uniform")
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.UnweightedMeanFactory(), seed,
    )


@common.tff_keywords
def build_fed_prox(
    model_fn: ModelFn,
    proximal_strength: float,
    client_optimizer: optimizers.Optimizer,
    server_optimizer: optimizers.Optimizer = SERVER_SGD,
    *,
    client_weighting: str = "num_examples",
    model_distributor: templates.DistributionProcess | None = None,
    model_aggregator: model_update_aggregator.AggregationFactory | None = None,
    seed: int = 0,
) -> templates.LearningProcess:
    """FedProx (Li et al., 2020): FedAvg whose clients minimize
    `loss + proximal_strength / 2 * ||w - w_server||^2`.

    Args:
      proximal_strength: mu >= 0 (0 is FedAvg).
      Others: as for `build_weighted_fed_avg`.

    Returns:
      A `LearningProcess`.

    Raises:
      ValueError: when `proximal_strength` is negative.
      TypeError: for an unweighted `model_aggregator` with `client_weighting` other
        than 'uniform'.
    """
    model = common.make_model(model_fn)
    work = client_works.build_model_delta_client_work(
        model, client_optimizer, client_weighting, proximal_strength=proximal_strength
    )
    common.check_weighted_aggregator(model_aggregator, client_weighting, "build_fed_prox")
    return common.build_process(
        model, work, server_optimizer, model_distributor, model_aggregator,
        aggregators.MeanFactory(), seed,
    )


def _fed_opt(
    server: Callable[..., optax.GradientTransformation],
) -> Callable[..., templates.LearningProcess]:
    def build(
        model_fn: ModelFn,
        client_optimizer: optimizers.Optimizer,
        server_learning_rate: float = 1e-2,
        *,
        client_weighting: str = "num_examples",
        model_distributor: templates.DistributionProcess | None = None,
        model_aggregator: model_update_aggregator.AggregationFactory | None = None,
        seed: int = 0,
        **server_kwargs: Any,
    ) -> templates.LearningProcess:
        common.check_weighted_aggregator(
            model_aggregator, client_weighting, build.__name__,
            f"Use build_unweighted_fed_avg(model_fn, client_optimizer, optax.{server.__name__}(...)) "
            "or client_weighting='uniform' for an unweighted aggregator")
        return build_weighted_fed_avg(
            model_fn, client_optimizer,
            optax.inject_hyperparams(server)(learning_rate=server_learning_rate, **server_kwargs),
            client_weighting=client_weighting, model_distributor=model_distributor,
            model_aggregator=model_aggregator, seed=seed,
        )

    build.__name__ = f"build_fed_{server.__name__}"
    build.__doc__ = (
        f"Adaptive federated optimization (Reddi et al., 2021) with `optax.{server.__name__}` "
        "on the server (its hyperparameters injected, so settable with `set_hparams`);\n"
        "otherwise `build_weighted_fed_avg`. Extra keyword arguments go to the server "
        "optimizer (e.g. `eps=1e-3`, as the paper tunes it).\n\nReturns:\n  A `LearningProcess`."
    )
    return common.tff_keywords(build)


build_fed_adam = _fed_opt(optax.adam)
build_fed_yogi = _fed_opt(optax.yogi)
build_fed_adagrad = _fed_opt(optax.adagrad)
