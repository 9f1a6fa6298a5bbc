import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedlang import aggregators

pytestmark = pytest.mark.usefixtures("runtime")
_P = {}


def _p(key, make):
    if key not in _P:
        _P[key] = make()
    return _P[key]


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(-2**31, 2**31 - 1), min_size=1, max_size=6), st.sampled_from([7, 2**16, 2**31 - 1]))
def test_modular_sum_equals_the_modular_integer_sum(xs, m):
    p = _p(("mod", m), lambda: aggregators.SecureModularSumFactory(m).create(np.int32))
    out = p.next(p.initialize(), [np.int32(x) for x in xs])
    assert int(out.result) % m == sum(x % m for x in xs) % m


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.integers(-50, 50), min_size=1, max_size=6))
def test_integer_secure_sum_is_exact_after_clipping(xs):
    p = _p("int", lambda: aggregators.SecureSumFactory(20, -10).create(np.int32))
    out = p.next(p.initialize(), xs)
    assert int(out.result) == sum(min(max(x, -10), 20) for x in xs)
    assert int(out.measurements["secure_upper_clipped_count"]) == sum(x > 20 for x in xs)


def test_float_sum_has_the_quantization_error_and_no_more():
    p = aggregators.SecureSumFactory(1.0, -1.0, bits=8, rounding="deterministic").create(
        (np.float32, [50]))
    rng = np.random.default_rng(0)
    vals = [rng.uniform(-1.5, 1.5, 50).astype(np.float32) for _ in range(5)]
    out = p.next(p.initialize(), vals)
    step = 2.0 / 255
    clipped = np.clip(np.stack(vals), -1, 1)
    codes = np.floor((clipped + 1) / step + 0.5)
    np.testing.assert_allclose(out.result, (codes * step - 1).sum(0), atol=1e-4)
    assert np.abs(out.result - clipped.sum(0)).max() <= 5 * step / 2 + 1e-4


def test_overflow_wraps_as_a_32_bit_protocol():
    # 24 bits + ceil(log2 512) = 33 bits > 32: the uint32 group wraps modulo 2^32
    p = aggregators.SecureSumFactory(1.0, 0.0, bits=24, rounding="deterministic").create(
        np.float32)
    out = p.next(p.initialize(), [1.0] * 512)
    levels = 2**24 - 1
    wrapped = (512 * levels) % 2**32
    assert float(out.result) == pytest.approx(wrapped / levels, rel=1e-5)
    assert float(out.result) != pytest.approx(512.0)


def test_adaptive_bounds_grow_to_fit():
    est = aggregators.QuantileEstimator(0.1, target_quantile=0.9, learning_rate=1.0)
    p = aggregators.SecureSumFactory(est, seed=0).create((np.float32, [3]))
    state = p.initialize()
    for _ in range(8):
        out = p.next(state, [np.array([1.0, -2.0, 0.5], np.float32)] * 3)
        state = out.state
    assert float(out.measurements["secure_upper_threshold"]) > 2.0
    assert float(out.measurements["secure_lower_threshold"]) < -2.0
    np.testing.assert_allclose(out.result, [3.0, -6.0, 1.5], atol=0.01)


def test_bad_bounds():
    with pytest.raises(ValueError, match="lower_bound < upper_bound"):
        aggregators.SecureSumFactory(1.0, 2.0)
    with pytest.raises(ValueError, match="modulus"):
        aggregators.SecureModularSumFactory(1)


def _on_two_runtimes(request):
    if request.node.callspec.params.get("runtime") not in ("reference", "simulation"):
        pytest.skip("the reference and the default simulation runtime suffice")


def test_the_bits_a_cohort_needs_and_the_overflow_risk_are_measured(request):
    _on_two_runtimes(request)
    # 24-bit codes from 300 clients need 33 bits: the 32-bit sum wraps (300 -> 44)
    p = _p("24", lambda: aggregators.SecureSumFactory(1, 0, bits=24).create(np.float32))
    out = p.next(p.initialize(), [np.float32(1)] * 300)
    assert float(out.result) == pytest.approx(44.0, abs=1e-3)
    assert int(out.measurements["secure_bits_needed"]) == 33
    assert int(out.measurements["secure_overflow_risk"]) == 1
    fine = p.next(p.initialize(), [np.float32(1)] * 256)
    assert float(fine.result) == pytest.approx(256.0, rel=1e-5)
    assert (int(fine.measurements["secure_bits_needed"]),
            int(fine.measurements["secure_overflow_risk"])) == (32, 0)


def test_non_finite_values_are_left_out_and_counted_never_a_bound(request):
    _on_two_runtimes(request)
    p = _p("nan", lambda: aggregators.SecureSumFactory(
        1.0, 0.5, bits=12, rounding="deterministic").create((np.float32, [2])))
    values = [np.array([np.nan, 0.75], np.float32), np.array([0.75, 0.75], np.float32),
              np.array([np.inf, 0.6], np.float32)]
    out = p.next(p.initialize(), values)
    np.testing.assert_allclose(out.result, [0.75, 0.75], atol=1e-3)  # only the finite client
    assert int(out.measurements["secure_nonfinite_count"]) == 2
    assert int(out.measurements["secure_upper_clipped_count"]) == 0
