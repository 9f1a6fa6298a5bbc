import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from fedlang import aggregators

pytestmark = pytest.mark.usefixtures("runtime")
_SUM = {}


def _collect_process():
    # the clipped values themselves: a sum over one client
    if "p" not in _SUM:
        _SUM["p"] = aggregators.clipping_factory(1.5, aggregators.SumFactory()).create(
            (np.float32, [5]))
    return _SUM["p"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(hnp.arrays(np.float32, 5, elements=st.floats(-100, 100, width=32, allow_subnormal=False)))
def test_clipping_bounds_every_contribution(x):
    p = _collect_process()
    out = p.next(p.initialize(), [x])
    assert np.linalg.norm(out.result) <= 1.5 * (1 + 1e-5)
    if np.linalg.norm(x) <= 1.5:
        np.testing.assert_allclose(out.result, x, rtol=1e-6)


def test_weighted_clipping_and_zeroing_report_counts():
    f = aggregators.zeroing_factory(1.0, aggregators.MeanFactory())
    p = f.create((np.float32, [2]), np.float32)
    vals = [np.array([3.0, 4.0]), np.array([0.3, 0.4]), np.array([np.nan, 0.0])]
    out = p.next(p.initialize(), vals, [1.0, 1.0, 2.0])
    np.testing.assert_allclose(out.result, [0.075, 0.1], rtol=1e-5)
    assert int(out.measurements["zeroed_count"]) == 2
    assert float(out.measurements["zeroing_norm"]) == 1.0


def test_adaptive_norm_tracks_the_quantile():
    est = aggregators.QuantileEstimator(0.5, target_quantile=0.8, learning_rate=0.5)
    p = aggregators.clipping_factory(est, aggregators.UnweightedMeanFactory()).create(np.float32)
    state = p.initialize()
    values = [float(v) for v in range(1, 11)]
    for _ in range(25):
        out = p.next(state, values)
        state = out.state
    assert 6.5 < float(out.measurements["clipping_norm"]) < 10.5


def test_bad_arguments():
    with pytest.raises(ValueError, match="clip > 0"):
        aggregators.clipping_factory(0.0, aggregators.SumFactory())
    with pytest.raises(TypeError, match="aggregation factory"):
        aggregators.clipping_factory(1.0, "sum")
    with pytest.raises(TypeError, match="dense tensors of kind 'f'"):
        aggregators.clipping_factory(1.0, aggregators.SumFactory()).create(np.int32)
