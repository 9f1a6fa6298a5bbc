"""Shared assembly of the algorithms: the model, its initial weights, and the parts."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, TypeVar

import jax

from fedlang import aggregators
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, types
from fedlang.learning import (
    composers,
    distributors,
    finalizers,
    model_update_aggregator,
    optimizers,
    templates,
)
from fedlang.learning.models import model as model_lib

# TFF's keyword arguments of its algorithm builders -> fedlang's, or what to do instead.
TFF_KEYWORDS = {
    "client_optimizer_fn": "client_optimizer",
    "server_optimizer_fn": "server_optimizer",
    "model_update_aggregation_factory": "model_aggregator",
    "model_aggregator_factory": "model_aggregator",
}
TFF_DROPPED = {
    "use_experimental_simulation_loop": "the runtime chooses how to loop over a client's "
    "data (fedlang.runtime.simulation_context(strategy=...)); drop the argument",
    "loop_implementation": "the runtime chooses how to loop over a client's data "
    "(fedlang.runtime.simulation_context(strategy=...)); drop the argument",
    "metrics_aggregator": "each metric's statistics are summed over the clients and "
    "finalized once at the server (fedlang.learning.metrics); drop the argument",
}

_F = TypeVar("_F", bound=Callable[..., Any])


def tff_keywords(builder: _F) -> _F:
    """Answers TFF's keyword spellings passed to `builder` with fedlang's.

    `build_weighted_fed_avg(model_fn, client_optimizer_fn=...)` would fail with Python's
    "unexpected keyword argument"; this names the keyword fedlang uses (and how to pass
    an optimizer), or says why the argument has no counterpart.
    """
    params = inspect.signature(builder).parameters
    renames = {tff: ours for tff, ours in TFF_KEYWORDS.items() if tff not in params and ours in params}
    dropped = {tff: why for tff, why in TFF_DROPPED.items() if tff not in params}

    @functools.wraps(builder)
    def checked(*args: Any, **kwargs: Any) -> Any:
        for tff in kwargs.keys() & renames.keys():
            ours = renames[tff]
            how = ("an optax.GradientTransformation (optax.sgd(0.1)) or a no-argument function "
                   "returning one" if ours.endswith("optimizer") else "the aggregation factory")
            raise TypeError(
                f"{builder.__name__}() takes {ours}=, not TFF's {tff}=: pass {ours}= {how}."
            )
        for tff in kwargs.keys() & dropped.keys():
            raise TypeError(f"{builder.__name__}() has no {tff}= (TFF's): {dropped[tff]}.")
        return builder(*args, **kwargs)

    return checked  # type: ignore[return-value]


def make_model(model_fn: Callable[[], model_lib.Model]) -> model_lib.Model:
    """Calls `model_fn()` and checks it returns a fedlang model.

    Raises:
      TypeError: when `model_fn` is not a no-argument function returning a `Model`, or
        the model's `input_spec` has a 64-bit field while JAX runs in 32 bits.
    """
    if isinstance(model_fn, model_lib.Model) or not callable(model_fn):
        raise TypeError(
            "Expected model_fn to be a no-argument function returning a model (e.g. "
            f"`lambda: models.from_keras_model(...)`), found {type(model_fn).__name__}."
        )
    model = model_fn()
    if not isinstance(model, model_lib.Model):
        raise TypeError(
            "Expected model_fn() to return a fedlang.learning.models.Model (FunctionalModel, "
            f"from_keras_model, from_flax), found {type(model).__name__}."
        )
    model_lib.check_32_bit(model.input_spec)  # a Model subclass sets input_spec itself
    return model


def check_weighted_aggregator(
    model_aggregator: Any, client_weighting: str, builder: str, fix: str = ""
) -> None:
    """Refuses an unweighted `model_aggregator` for a builder that weighs the clients.

    An unweighted factory averages the updates as if every client had the same weight;
    TFF's weighted builders take only weighted factories, so a port that passes
    `dp_aggregator()` to `build_weighted_fed_avg` would silently change. With
    `client_weighting='uniform'` every weight is 1 and the two means agree, so it is
    taken.

    Args:
      model_aggregator: the factory passed (None: the builder's default).
      client_weighting: the builder's `client_weighting`.
      builder: the builder's name, for the message.
      fix: what to do instead; default: pass `client_weighting='uniform'`.

    Raises:
      TypeError: for an unweighted factory with weights other than uniform, naming it.
    """
    if client_weighting == "uniform" or not isinstance(
            model_aggregator, aggregators.UnweightedAggregationFactory):
        return
    fix = fix or ("Pass client_weighting='uniform' to weigh every client equally with an "
                  "unweighted aggregator")
    raise TypeError(
        f"Expected a weighted model_aggregator for {builder}() (a WeightedAggregationFactory, "
        f"e.g. MeanFactory() or robust_aggregator()), found {type(model_aggregator).__name__}, "
        "an unweighted one, which would average the clients' updates without their weights "
        f"(client_weighting={client_weighting!r}). {fix} (such as dp_aggregator() or "
        "MedianFactory()), or pass a weighted one.")


def initial_weights_fn(model: model_lib.Model, seed: int = 0) -> computation.Computation:
    """A computation `( -> ModelWeights)` initializing the model from `seed`."""

    @jax_backend.jax_computation()
    def initial_model_weights():
        return model.initial_weights(jax.random.key(seed))

    return initial_model_weights


def build_process(
    model: model_lib.Model,
    client_work: templates.ClientWorkProcess,
    server_optimizer: optimizers.Optimizer,
    model_distributor: templates.DistributionProcess | None,
    model_aggregator: model_update_aggregator.AggregationFactory | None,
    default_aggregator: model_update_aggregator.AggregationFactory,
    seed: int = 0,
    update_type: types.Type | None = None,
    model_finalizer: templates.FinalizerProcess | None = None,
) -> templates.LearningProcess:
    """The four parts around `client_work`, composed (`model_finalizer` replaces the
    one applying `server_optimizer`, for an update of another type than the weights).

    Raises:
      TypeError: when `model_aggregator` is not an aggregation factory.
    """
    init_fn = initial_weights_fn(model, seed)
    weights_t = init_fn.type_signature.result
    update_t = update_type or weights_t["trainable"]  # type: ignore[index]
    factory = default_aggregator if model_aggregator is None else model_aggregator
    aggregator = model_update_aggregator.create_aggregator(factory, update_t, "model_aggregator")
    distributor = model_distributor or distributors.build_broadcast_process(weights_t)
    finalizer = model_finalizer or finalizers.build_apply_optimizer_finalizer(
        server_optimizer, weights_t)
    return composers.compose_learning_process(init_fn, distributor, client_work, aggregator, finalizer)
