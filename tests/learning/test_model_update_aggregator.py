"""TFF's model update aggregators: robust, DP (adaptive by default), secure, compressed."""

import numpy as np
import pytest

from fedlang import aggregators, learning
from fedlang.core import context
from fedlang.learning import model_update_aggregator as mua
from fedlang.runtime import ReferenceContext

VALUES = [np.array([0.5, -0.25, 1.0], np.float32), np.array([0.1, 0.2, -0.3], np.float32),
          np.array([np.nan, 0.0, 0.0], np.float32)]
WEIGHTS = [3.0, 1.0, 2.0]


@pytest.fixture(autouse=True)
def reference_runtime():
    previous = context.get_default_context()
    context.set_default_context(ReferenceContext())
    yield
    context.set_default_context(previous)


def _run(f, weighted=True):
    p = f.create((np.float32, [3]), np.float32) if weighted else f.create((np.float32, [3]))
    return p.next(p.initialize(), VALUES, WEIGHTS) if weighted else p.next(p.initialize(), VALUES)


def test_robust_secure_and_compression_aggregators_are_tff_shaped_means():
    # clipped at the initial norm 1.0, then the weighted mean; the NaN client is zeroed
    # (its value, not its weight, as in TFF)
    clipped = VALUES[0] / np.linalg.norm(VALUES[0])
    expected = (3 * clipped + 1 * VALUES[1]) / 6
    outputs = {}
    for make in (learning.robust_aggregator, learning.secure_aggregator,
                 learning.compression_aggregator):
        f = make()
        assert isinstance(f, aggregators.WeightedAggregationFactory), make.__name__
        out = outputs[make.__name__] = _run(f)
        np.testing.assert_allclose(out.result, expected, atol=2e-3, err_msg=make.__name__)
        m = out.measurements
        assert int(m["zeroed_count"]) == 1 and float(m["zeroing_norm"]) == 2 * 10.0 + 1
        assert float(m["zeroing"]["clipping_norm"]) == 1.0
    secure_sums = outputs["secure_aggregator"].measurements["zeroing"]["clipping"]
    assert float(secure_sums["mean_value"]["secure_upper_threshold"]) == 2 * 50.0
    assert float(secure_sums["mean_weight"]["secure_upper_threshold"]) == 2**20 - 1
    unweighted = learning.robust_aggregator(weighted=False, zeroing=False, clipping=False)
    assert isinstance(unweighted, aggregators.UnweightedMeanFactory)


def test_dp_aggregator_is_adaptive_with_zeroing_by_default():
    f = learning.dp_aggregator(0.5, 100, seed=0)
    assert isinstance(f, aggregators.UnweightedAggregationFactory)
    out = _run(f, weighted=False)
    assert float(out.measurements["zeroing"]["dp_clip"]) == pytest.approx(0.1)
    assert "key" in out.state["inner"]["clip"]  # a QuantileEstimator's state: adaptive
    fixed = mua.dp_aggregator(1.0, 10, zeroing=False, adaptive=False, clip=0.5, seed=0)
    assert isinstance(fixed, aggregators.DifferentiallyPrivateFactory)
    assert fixed.clip == 0.5 and fixed.value_noise_multiplier == 1.0


def test_dp_aggregator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="clients_per_round"):
        mua.dp_aggregator(1.0, 0)
    with pytest.raises(ValueError, match="clipped_count_stddev"):
        mua.dp_aggregator(1.0, 10)  # adaptive: 1.0 >= 2 * 0.05 * 10
