"""Federated k-means: TFF 0.87's results (tff_reference/) on the runtime
sample (tests/conftest.py)."""

import functools
import json
import pathlib

import numpy as np
import pytest

from fedlang import aggregators
from fedlang.learning import algorithms, tf_random

REFERENCE = json.loads(
    (pathlib.Path(__file__).parent / "tff_reference" / "tff_reference.json").read_text()
)["fed_kmeans"]


def f32(x):
    return np.asarray(x, np.float32)


@functools.cache
def process(k, shape, seed):
    return algorithms.build_fed_kmeans(k, shape, random_seed=seed)


def run(case, state, p):
    clients = [f32(c) for c in case["clients"]]
    for expected in case["rounds"]:
        state, metrics = p.next(state, clients)
        np.testing.assert_allclose(p.get_model_weights(state), expected["centroids"],
                                   rtol=1e-6, atol=1e-6)
        np.testing.assert_array_equal(state.finalizer, expected["cluster_weights"])
        assert float(metrics["client_work"]["num_examples"]) == expected["num_examples"]
    return state


@pytest.mark.usefixtures("runtime")
def test_seeded_initialization_and_rounds_equal_tff():
    case = REFERENCE["seeded"]
    p = process(3, (2,), (5, 7))
    state = p.initialize()
    np.testing.assert_allclose(p.get_model_weights(state), case["initial_centroids"],
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(state.finalizer, np.ones(3, np.float32))
    run(case, state, p)


@pytest.mark.usefixtures("runtime")
def test_ties_go_to_the_lowest_index_and_unreached_centroids_stay_as_in_tff():
    case = REFERENCE["hand_set"]
    p = process(3, (2,), (1, 1))
    state = p.set_model_weights(p.initialize(), f32(case["centroids"]))
    state = run(case, state, p)
    # The third centroid (0, 50) is nearest to no point: its place and weight stay.
    np.testing.assert_array_equal(p.get_model_weights(state)[2], [0.0, 50.0])
    assert float(state.finalizer[2]) == 1.0


def test_initial_centroids_equal_tff_for_other_seeds_and_shapes():
    for case in REFERENCE["seeds"]:
        shape = (case["num_clusters"], *case["data_shape"])
        np.testing.assert_allclose(
            tf_random.stateless_normal(shape, case["random_seed"]), case["initial_centroids"],
            rtol=1e-5, atol=1e-6)


def test_without_a_seed_the_clock_seeds_the_centroids():
    a = algorithms.build_fed_kmeans(2, (3,))
    b = algorithms.build_fed_kmeans(2, (3,))
    wa, wb = (p.get_model_weights(p.initialize()) for p in (a, b))
    assert wa.shape == (2, 3) and not np.array_equal(wa, wb)


@pytest.mark.usefixtures("runtime")
def test_an_empty_cohort_keeps_the_centroids_and_weights():
    p = process(3, (2,), (5, 7))
    state = p.initialize()
    new, metrics = p.next(state, [])
    np.testing.assert_array_equal(p.get_model_weights(new), p.get_model_weights(state))
    np.testing.assert_array_equal(new.finalizer, state.finalizer)
    assert float(metrics["client_work"]["num_examples"]) == 0.0


def test_a_secure_sum_aggregates_the_cluster_sums():
    case = REFERENCE["hand_set"]
    p = algorithms.build_fed_kmeans(
        3, (2,), random_seed=(1, 1),
        sum_aggregator=aggregators.SecureSumFactory(8.0, -8.0, bits=20))
    state = p.set_model_weights(p.initialize(), f32(case["centroids"]))
    state, _ = p.next(state, [f32(c) for c in case["clients"]])
    # 20-bit codes over [-8, 8], stochastically rounded: each of the 3 clients' sums and
    # counts is off by up to one step: a centroid at 50 moves by up to (50 + 1) x 3 steps.
    step = 16.0 / (2**20 - 1)
    np.testing.assert_allclose(p.get_model_weights(state), case["rounds"][0]["centroids"],
                               atol=51 * 3 * step)
    np.testing.assert_allclose(state.finalizer, case["rounds"][0]["cluster_weights"],
                               atol=3 * step)


def test_bad_arguments_say_what_to_pass():
    with pytest.raises(ValueError, match="num_clusters"):
        algorithms.build_fed_kmeans(0, (2,))
    with pytest.raises(ValueError, match="data_shape"):
        algorithms.build_fed_kmeans(2, 2)
    with pytest.raises(ValueError, match="two integers"):
        algorithms.build_fed_kmeans(2, (2,), random_seed=(1.5, 2))
    with pytest.raises(TypeError, match="UnweightedAggregationFactory"):
        algorithms.build_fed_kmeans(2, (2,), random_seed=(1, 2),
                                    sum_aggregator=aggregators.MeanFactory())
    p = process(3, (2,), (5, 7))
    with pytest.raises(ValueError, match=r"shape \(3, 2\)"):
        p.set_model_weights(p.initialize(), np.zeros([2, 2]))
