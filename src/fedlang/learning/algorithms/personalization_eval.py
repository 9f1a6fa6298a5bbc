"""Personalization evaluation (TFF's `build_personalization_eval_computation`).

TFF 0.87's `personalization_eval.py` is the specification. The computation broadcasts
the server's weights; each client evaluates them on its test data (the baseline), then,
for each personalization strategy, starts again from the broadcast weights, adapts
them on its training data and evaluates the result on the same test data. The server
collects every client's metrics, one value per client (the order of the clients;
when more than `max_num_clients` take part, a random subset of them, still in client
order): TFF's warning applies, each client's metrics reach the server on their own.

Each client's metrics are the model's evaluation statistics, finalized on the client:
`{'loss', <model metrics>, 'num_examples', 'num_batches'}` of its test data. Client
data are batched (`{'train_data': batches, 'test_data': batches}`); every strategy
sees the same training batches. The departures from TFF are in docs/from-tff.md.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp

from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, operators, tracing, types
from fedlang.learning import evaluation, personalization, templates
from fedlang.learning.algorithms import common
from fedlang.learning.algorithms.fed_avg import ModelFn

BASELINE = "baseline_metrics"


def _check_strategies(personalize_fn_dict: Any) -> dict[str, personalization.PersonalizationStrategy]:
    if not isinstance(personalize_fn_dict, Mapping):
        raise TypeError(
            "Expected personalize_fn_dict to map names to personalization strategies (e.g. "
            "{'finetune': personalization.finetune(optax.sgd(0.1))}), found "
            f"{type(personalize_fn_dict).__name__}."
        )
    out = {}
    for name, strategy in personalize_fn_dict.items():
        if not isinstance(name, str):
            raise TypeError(f"Expected strategy names to be strings, found {name!r}.")
        if name == BASELINE:
            raise ValueError(f"{BASELINE!r} names the baseline metrics; rename that strategy.")
        if not isinstance(strategy, personalization.PersonalizationStrategy):
            raise TypeError(
                f"Expected personalize_fn_dict[{name!r}] to be a personalization strategy "
                "(personalization.finetune(...), or an object with num_epochs, "
                f"initial_state, step and weights), found {type(strategy).__name__}."
            )
        out[name] = strategy
    return out


def _collector(
    metrics_t: types.Type, max_num_clients: int, seed: int
) -> tuple[computation.Computation, ...]:
    """`federated_aggregate`'s parts collecting each client's metrics, one row per client,
    and keeping `max_num_clients` rows chosen at random (in client order) beyond that."""
    leaf_types = types.tensor_leaves(metrics_t)
    buffer_t = tools.map_type(lambda lt: types.TensorType(lt.dtype, [None, *lt.shape]), metrics_t)

    @jax_backend.jax_computation(result_type=buffer_t)
    def empty():
        return tools.from_leaves(buffer_t, [jnp.zeros([0, *lt.shape], lt.dtype) for lt in leaf_types])

    @jax_backend.jax_computation(buffer_t, metrics_t, result_type=buffer_t)
    def accumulate(buffer, value):
        return tools.from_leaves(buffer_t, [
            jnp.concatenate([b, v[None]], 0)
            for b, v in zip(tools.leaves_of(buffer, buffer_t), tools.leaves_of(value, metrics_t))])

    @jax_backend.jax_computation(buffer_t, buffer_t, result_type=buffer_t)
    def merge(a, b):
        return tools.from_leaves(buffer_t, [
            jnp.concatenate([x, y], 0)
            for x, y in zip(tools.leaves_of(a, buffer_t), tools.leaves_of(b, buffer_t))])

    @jax_backend.jax_computation(buffer_t, result_type=buffer_t)
    def report(buffer):
        leaves = tools.leaves_of(buffer, buffer_t)
        n = leaves[0].shape[0]
        if isinstance(n, int) and n > max_num_clients:  # n is symbolic while typing
            chosen = jax.random.choice(jax.random.key(seed), n, (max_num_clients,), replace=False)
            rows = jnp.sort(chosen)
            leaves = [x[rows] for x in leaves]
        return tools.from_leaves(buffer_t, leaves)

    return empty, accumulate, merge, report


def build_personalization_eval(
    model_fn: ModelFn,
    personalize_fn_dict: Mapping[str, personalization.PersonalizationStrategy],
    max_num_clients: int = 100,
    *,
    seed: int = 0,
) -> computation.Computation:
    """Personalization evaluation (module docstring), TFF's arguments and result.

    Args:
      model_fn: a no-argument function returning a model.
      personalize_fn_dict: `{name: strategy}`, e.g. `{'finetune':
        personalization.finetune(optax.sgd(0.1), num_epochs=2)}`; the name
        'baseline_metrics' is reserved.
      max_num_clients: the most clients whose metrics are collected (> 0).
      seed: chooses which clients are collected when more than `max_num_clients` take
        part (TFF seeds from the clock).

    Returns:
      A federated computation `(<ModelWeights@SERVER, {<train_data=sequence<B>,
      test_data=sequence<B>>}@CLIENTS> -> metrics@SERVER)`: `metrics['baseline_metrics']`
      and `metrics[name]` for each strategy are dicts of the model's evaluation metrics,
      each a vector with one entry per collected client (the same client at the same
      position in every vector).

    Raises:
      TypeError: for a bad model_fn or strategy; ValueError: for a reserved name or a
        `max_num_clients` below 1.

    Example:
      >>> evaluate = build_personalization_eval(  # doctest: +SKIP
      ...     model_fn, {'finetune': personalization.finetune(optax.sgd(0.1))})
      >>> metrics = evaluate(weights, [{'train_data': train_batches,  # doctest: +SKIP
      ...                               'test_data': test_batches}])
      >>> metrics['finetune']['accuracy'] - metrics['baseline_metrics']['accuracy']  # doctest: +SKIP
    """
    strategies = _check_strategies(personalize_fn_dict)
    if isinstance(max_num_clients, bool) or not isinstance(max_num_clients, int) or (
        max_num_clients < 1
    ):
        raise ValueError(f"Expected max_num_clients to be a positive integer, found "
                         f"{max_num_clients!r}.")
    model = common.make_model(model_fn)
    weights_t = model.weights_type()
    data_t = types.SequenceType(model.input_spec)
    input_t = types.to_type({"train_data": data_t, "test_data": data_t})
    local_eval = evaluation.build_local_evaluation(model)
    finalize = evaluation.build_finalize(model, local_eval.type_signature.result)
    metrics_t = finalize.type_signature.result

    def personalize(
        name: str, strategy: personalization.PersonalizationStrategy,
        weights: templates.ClientValue, train_data: templates.ClientValue,
        test_data: templates.ClientValue,
    ) -> templates.ClientValue:
        @jax_backend.jax_computation(weights_t)
        def start(w):
            return strategy.initial_state(model, w)

        state_t = start.type_signature.result

        @jax_backend.jax_computation(state_t, data_t, result_type=state_t)
        def epoch(state, dataset):
            return dataset.reduce(
                state, lambda s, batch, mask: strategy.step(model, s, batch, mask), masked=True)

        @jax_backend.jax_computation(state_t, result_type=weights_t)
        def personalized(state):
            return strategy.weights(state)

        state = operators.federated_map(start, weights)
        for _ in range(strategy.num_epochs):
            state = operators.federated_map(epoch, (state, train_data))
        tuned = operators.federated_map(personalized, state)
        return operators.federated_map(finalize, operators.federated_map(
            local_eval, (tuned, test_data)))

    names = [BASELINE, *strategies]
    all_t = types.to_type({name: metrics_t for name in names})
    parts = _collector(all_t, max_num_clients, seed)

    @jax_backend.jax_computation(types.to_type(tuple([metrics_t] * len(names))), result_type=all_t)
    def together(each):
        return dict(zip(names, each))

    @tracing.federated_computation(types.type_at_server(weights_t), types.type_at_clients(input_t))
    def personalization_eval(server_model_weights, client_input):
        weights = operators.federated_broadcast(server_model_weights)
        train_data, test_data = client_input.train_data, client_input.test_data
        baseline = operators.federated_map(finalize, operators.federated_map(
            local_eval, (weights, test_data)))
        tuned = [personalize(name, s, weights, train_data, test_data)
                 for name, s in strategies.items()]
        per_client = operators.federated_map(
            together, operators.federated_zip((baseline, *tuned)))
        return operators.federated_aggregate(per_client, parts[0](), *parts[1:])

    return personalization_eval
