import jax
import numpy as np
import pytest

from fedlang import aggregators
from fedlang.aggregators import dp

pytestmark = pytest.mark.usefixtures("runtime")


def test_noise_has_the_stated_standard_deviation():
    # arrange: zero values, so the result is noise / clients_per_round
    f = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(2.0, 4, clip=0.5, seed=7)
    p = f.create((np.float32, [4000]))
    # act
    out = p.next(p.initialize(), [np.zeros(4000, np.float32)] * 3)
    # assert: std of the noise = z * clip = 1.0, divided by 4
    noise = np.asarray(out.result) * 4
    assert float(out.measurements["noise_stddev"]) == pytest.approx(1.0)
    assert noise.std() == pytest.approx(1.0, rel=0.05)
    assert abs(noise.mean()) < 0.05


def test_clips_sums_and_is_deterministic_given_the_seed():
    f = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(0.1, 2, clip=1.0, seed=1)
    p = f.create((np.float32, [2]))
    values = [np.array([3.0, 4.0], np.float32), np.array([0.3, 0.4], np.float32)]
    a, b = p.next(p.initialize(), values), p.next(p.initialize(), values)
    np.testing.assert_array_equal(a.result, b.result)
    np.testing.assert_allclose(a.result, [0.45, 0.6], atol=0.5)
    assert int(a.measurements["clipped_count"]) == 1


def test_adaptive_clip_moves_towards_the_target_quantile():
    f = aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(
        0.01, 10, initial_l2_norm_clip=0.1, target_unclipped_quantile=0.5, learning_rate=0.5,
        seed=0)
    p = f.create((np.float32, [1]))
    values = [np.array([v], np.float32) for v in np.linspace(1, 10, 10)]
    state = p.initialize()
    for _ in range(15):
        out = p.next(state, values)
        state = out.state
    assert 2.0 < float(out.measurements["dp_clip"]) < 9.0


def test_tree_noise_cumulative_sum_uses_few_nodes():
    f = aggregators.DifferentiallyPrivateFactory.tree_aggregation(1.0, 1, clip=1.0, seed=0)
    p = f.create((np.float32, [2000]))
    state, total = p.initialize(), np.zeros(2000)
    for _ in range(4):
        out = p.next(state, [np.zeros(2000, np.float32)])
        state, total = out.state, total + out.result
    # after 4 rounds the prefix [0, 4) is one tree node: std 1, not sqrt(4)
    assert total.std() == pytest.approx(1.0, rel=0.1)


def test_adaptive_rejects_an_infeasible_budget():
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        aggregators.DifferentiallyPrivateFactory.gaussian_adaptive(1.0, 4)
    with pytest.raises(ValueError, match="fixed clip"):
        dp.DifferentiallyPrivateFactory(1.0, 4, aggregators.QuantileEstimator(1.0),
                                        mechanism="tree")


def _only_on(request, *runtimes):
    if request.node.callspec.params.get("runtime") not in runtimes:
        pytest.skip(f"checked on {', '.join(runtimes)}: the arithmetic is the inner factory's")


def test_dp_composes_with_a_secure_sum(request):
    _only_on(request, "reference", "simulation")
    # arrange: noise 0, so the result is the clipped mean, summed exactly or securely
    values = [np.array([3.0, 4.0], np.float32), np.array([0.3, -0.4], np.float32)]
    plain = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(0.0, 2, clip=1.0)
    secure = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        0.0, 2, clip=1.0, record_aggregation_factory=aggregators.SecureSumFactory(
            1.0, bits=16, rounding="deterministic"))
    # act
    p, q = plain.create((np.float32, [2])), secure.create((np.float32, [2]))
    a, b = p.next(p.initialize(), values), q.next(q.initialize(), values)
    # assert: the same up to 16-bit quantization, and the secure sum reports its own
    np.testing.assert_allclose(b.result, a.result, atol=2 * 2 / 65535)
    inner = b.measurements["record_aggregation"]
    assert float(inner["secure_upper_threshold"]) == 1.0 and int(inner["secure_bits_needed"]) == 17
    assert "record_aggregation" not in a.measurements  # SumFactory measures nothing
    assert set(b.state) == {"clip", "key", "round", "record_aggregation"}


def test_a_noise_mechanism_is_an_object_of_pure_functions(request):
    _only_on(request, "reference")
    halves = dp.NoiseMechanism(
        "halves", lambda key, r, like, s: (jax.tree.map(lambda x: x * 0 + 0.5 * s, like), key),
        adaptive_clip=True, accounting="gaussian")
    f = dp.DifferentiallyPrivateFactory(2.0, 1, clip=1.0, mechanism=halves)
    p = f.create((np.float32, [2]))
    out = p.next(p.initialize(), [np.array([0.3, 0.4], np.float32)])
    np.testing.assert_allclose(out.result, [0.3 + 1.0, 0.4 + 1.0])  # + 0.5 * (z C)
    assert dp.as_mechanism("tree") is dp.TREE
    with pytest.raises(ValueError, match=r"mechanism in \['gaussian', 'tree'\]"):
        dp.as_mechanism("laplace")


def test_dp_over_secure_sum_trains_on_the_simulation_runtime(request):
    _only_on(request, "simulation")
    import jax.numpy as jnp
    import optax

    from fedlang.learning import algorithms, models

    def model_fn():
        return models.FunctionalModel(
            init_fn=lambda rng: {"w": jnp.zeros([2, 2])}, apply_fn=lambda p, x: x @ p["w"],
            loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(
                logits, y).mean(),
            input_spec={"x": (np.float32, [None, 2]), "y": (np.int32, [None])})

    data = [[{"x": np.array([[1, 0], [0, 1]], np.float32), "y": np.array([0, 1], np.int32)}]] * 3
    dp_secure = aggregators.DifferentiallyPrivateFactory.gaussian_fixed(
        0.01, 3, clip=0.5, seed=0, record_aggregation_factory=aggregators.SecureSumFactory(0.5))
    process = algorithms.build_unweighted_fed_avg(model_fn, optax.sgd(0.5),
                                                  model_aggregator=dp_secure)
    state = process.initialize()
    for _ in range(2):
        state, metrics = process.next(state, data)
    w = process.get_model_weights(state).trainable["w"]
    assert w[0, 0] > 0.1 and w[1, 1] > 0.1  # learned the diagonal
    assert int(metrics["aggregator"]["record_aggregation"]["secure_overflow_risk"]) == 0
