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
