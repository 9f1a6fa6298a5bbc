"""Process helpers: hyperparameters, round-indexed schedules, FedOpt, state as a pytree."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models

SPEC = {"x": (np.float32, [None, 2]), "y": (np.int32, [None])}
DATA = [[{"x": np.array([[1, 2], [0, 1], [1, 0], [2, 2]], np.float32), "y": np.array([0, 0, 0, 1], np.int32)}]]


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"w": jnp.ones([2, 2]) * 0.1},
        apply_fn=lambda p, x: x @ p["w"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC)


def test_client_and_server_hparams_are_read_and_written():
    process = algorithms.build_weighted_fed_avg(
        model_fn, optax.inject_hyperparams(optax.sgd)(learning_rate=0.1),
        optax.inject_hyperparams(optax.sgd)(learning_rate=1.0))
    state = process.initialize()
    hp = process.get_hparams(state)
    assert float(hp["client_work"]["learning_rate"]) == pytest.approx(0.1)
    assert float(hp["finalizer"]["learning_rate"]) == 1.0
    state = process.set_hparams(state, {"client_work": {"learning_rate": 0.0}})
    out = process.next(state, DATA)
    np.testing.assert_allclose(process.get_model_weights(out.state).trainable["w"], 0.1)
    with pytest.raises(ValueError, match=r"Unknown client hyperparameters \['lr'\]"):
        process.set_hparams(state, {"client_work": {"lr": 1.0}})


def test_a_client_learning_rate_indexed_by_round():
    process = algorithms.build_weighted_fed_avg(
        model_fn, lambda round_num: optax.sgd(jnp.where(round_num == 0, 0.5, 0.0)))
    state = process.initialize()
    state, _ = process.next(state, DATA)
    after_one = process.get_model_weights(state).trainable["w"]
    assert not np.allclose(after_one, 0.1)
    state, _ = process.next(state, DATA)
    np.testing.assert_allclose(process.get_model_weights(state).trainable["w"], after_one)
    assert int(state.client_work["round_num"]) == 2


@pytest.fixture
def standard_promotion():
    # Optax's Adam mixes int32 step counts with floats (`b1 ** count`), which the test
    # suite's strict dtype promotion rejects; users run with JAX's standard promotion.
    with jax.numpy_dtype_promotion("standard"):
        yield


@pytest.mark.usefixtures("standard_promotion")
def test_fed_adam_keeps_adam_state_in_a_checkpointable_pytree():
    process = algorithms.build_fed_adam(model_fn, optax.sgd(0.1), server_learning_rate=0.01)
    state, metrics = process.next(process.initialize(), DATA)
    leaves = jax.tree.leaves(state)
    assert all(isinstance(x, np.ndarray | np.generic) for x in leaves)
    assert float(process.get_hparams(state)["finalizer"]["learning_rate"]) == pytest.approx(0.01)
    assert set(metrics) == {"distributor", "client_work", "aggregator", "finalizer", "traffic"}
    restored = jax.tree.unflatten(jax.tree.structure(state), leaves)
    state2, _ = process.next(restored, DATA)
    assert int(state2.finalizer["round_num"]) == 2


def test_set_model_weights_round_trips():
    process = algorithms.build_unweighted_fed_avg(model_fn, optax.sgd(0.1))
    state = process.initialize()
    new = models.ModelWeights({"w": np.full([2, 2], 3.0, np.float32)}, ())
    state = process.set_model_weights(state, new)
    np.testing.assert_allclose(process.get_model_weights(state).trainable["w"], 3.0)


def test_masked_batches_ignore_padding():
    process = algorithms.build_fed_sgd(model_fn, optax.sgd(1.0))
    padded = {"x": np.concatenate([DATA[0][0]["x"], np.full([2, 2], 9.0, np.float32)]),
              "y": np.concatenate([DATA[0][0]["y"], np.ones([2], np.int32)]),
              "mask": np.array([1, 1, 1, 1, 0, 0], np.float32)}
    spec = dict(SPEC, mask=(np.float32, [None]))

    def masked_model_fn():
        m = model_fn()
        return models.FunctionalModel(m._init_fn, m._apply_fn, m._loss_fn, spec)

    masked = algorithms.build_fed_sgd(masked_model_fn, optax.sgd(1.0))
    a = process.get_model_weights(process.next(process.initialize(), DATA).state)
    b_state, metrics = masked.next(masked.initialize(), [[padded]])
    np.testing.assert_allclose(masked.get_model_weights(b_state).trainable["w"], a.trainable["w"],
                               rtol=1e-6)
    assert int(metrics["client_work"]["train"]["num_examples"]) == 4


@pytest.mark.parametrize("runtime_name", ["reference", "simulation"])
def test_an_empty_cohort_changes_no_weights_and_reports_zero_clients(runtime_name):
    # arrange
    from fedlang.core import context
    from fedlang.runtime import ReferenceContext, SimulationContext

    previous = context.get_default_context()
    context.set_default_context(
        ReferenceContext() if runtime_name == "reference" else SimulationContext())
    try:
        process = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1))
        state = process.initialize()
        # act
        new_state, metrics = process.next(state, [])
    finally:
        context.set_default_context(previous)
    # assert: weights and optimizer state unchanged, NaN-free; only the round counters move
    np.testing.assert_array_equal(process.get_model_weights(new_state).trainable["w"],
                                  process.get_model_weights(state).trainable["w"])
    assert all(np.all(np.isfinite(x)) for x in jax.tree.leaves(new_state))
    assert int(new_state.finalizer["round_num"]) == 1
    diagnostics = metrics["client_work"]["diagnostics"]
    assert int(diagnostics["num_clients"]) == 0 and float(diagnostics["update_norm_max"]) == 0.0
    assert int(metrics["client_work"]["train"]["num_examples"]) == 0
    assert float(metrics["client_work"]["train"]["loss"]) == 0.0
    assert int(metrics["traffic"]["num_clients"]) == 0


@pytest.mark.parametrize("builder", [algorithms.build_weighted_fed_avg, algorithms.build_unweighted_fed_avg,
                                     algorithms.build_fed_adam])
def test_tffs_keyword_spellings_are_answered_with_fedlangs(builder):
    with pytest.raises(TypeError, match=r"takes client_optimizer=, not TFF's client_optimizer_fn=: pass "
                                        r"client_optimizer= an optax.GradientTransformation"):
        builder(model_fn, client_optimizer_fn=lambda: optax.sgd(0.1))
    with pytest.raises(TypeError, match=r"has no use_experimental_simulation_loop= \(TFF's\)"):
        builder(model_fn, optax.sgd(0.1), use_experimental_simulation_loop=True)


def test_tffs_aggregation_and_server_keywords_are_answered():
    with pytest.raises(TypeError, match="takes model_aggregator=, not TFF's model_update_aggregation_factory="):
        algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1), model_update_aggregation_factory=None)
    with pytest.raises(TypeError, match="takes server_optimizer=, not TFF's server_optimizer_fn="):
        algorithms.build_fed_sgd(model_fn, server_optimizer_fn=lambda: optax.sgd(1.0))
    with pytest.raises(TypeError, match="has no loop_implementation="):
        algorithms.build_fed_eval(model_fn, loop_implementation=None)


# -- issue 37, item 11: a weighted builder given an unweighted aggregator ------------------

def test_a_weighted_builder_refuses_an_unweighted_aggregator_as_tff_does():
    from fedlang import aggregators
    from fedlang.learning import dp_aggregator, robust_aggregator

    # arrange: dp_aggregator() is unweighted; it averaged the updates without their weights
    dp = dp_aggregator(1.0, 100)
    # act / assert
    with pytest.raises(TypeError) as e:
        algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1), model_aggregator=dp)
    assert str(e.value) == (
        "Expected a weighted model_aggregator for build_weighted_fed_avg() (a "
        "WeightedAggregationFactory, e.g. MeanFactory() or robust_aggregator()), found "
        f"{type(dp).__name__}, an unweighted one, which would average the clients' updates "
        "without their weights (client_weighting='num_examples'). Use build_unweighted_fed_avg "
        "or client_weighting='uniform' for an unweighted aggregator (such as dp_aggregator() or "
        "MedianFactory()), or pass a weighted one.")
    median = aggregators.MedianFactory()
    builds = {
        "build_fed_prox": lambda: algorithms.build_fed_prox(
            model_fn, 0.1, optax.sgd(0.1), model_aggregator=median),
        "build_fed_adam": lambda: algorithms.build_fed_adam(
            model_fn, optax.sgd(0.1), model_aggregator=median),
        "build_fed_sgd": lambda: algorithms.build_fed_sgd(model_fn, model_aggregator=median),
        "build_mime_lite": lambda: algorithms.build_mime_lite(
            model_fn, optax.sgd(0.1), model_aggregator=median),
    }
    for name, build in builds.items():
        with pytest.raises(TypeError, match=rf"for {name}\(\) .*found MedianFactory, an unweighted"):
            build()
    with pytest.raises(TypeError, match=r"Use build_unweighted_fed_avg\(model_fn, client_optimizer, "
                                        r"optax\.adam\(\.\.\.\)\) or client_weighting='uniform'"):
        builds["build_fed_adam"]()
    # the unweighted builder, uniform weights (every weight 1) and weighted factories are taken
    algorithms.build_unweighted_fed_avg(model_fn, optax.sgd(0.1), model_aggregator=dp)
    algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1), client_weighting="uniform",
                                      model_aggregator=dp)
    algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1), model_aggregator=robust_aggregator())
