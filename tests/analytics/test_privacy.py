import numpy as np
import pytest

import fedlang as fl
from fedlang import aggregators, analytics
from fedlang.analytics import privacy


def test_spent_is_the_accountants():
    p = analytics.Privacy(noise_multiplier=1.3, clip=2.0, delta=1e-5, sampling_probability=0.1)
    assert p.spent(10) == (aggregators.dp_epsilon(1.3, 0.1, 10, 1e-5), 1e-5)
    assert p.stddev == pytest.approx(2.6)
    assert p.factory().noise_multiplier == 1.3


def _sum_of(value_t, clients, how):
    @fl.federated_computation(fl.type_at_clients(value_t))
    def total(x):
        return privacy.aggregate(x, *how)

    with fl.runtime.reference_context():
        return np.asarray(total(clients))


def test_plain_secure_and_dp_sums():
    clients = [np.array([1, 2, 3], np.int32), np.array([4, 5, 6], np.int32)]
    t = fl.TensorType(np.int32, [3])
    assert _sum_of(t, clients, (None,)).tolist() == [5, 7, 9]
    np.testing.assert_allclose(_sum_of(t, clients, (None, 10.0)), [5, 7, 9], atol=0.01)
    p = analytics.Privacy(noise_multiplier=1e-3, clip=100.0, seed=0, secure=True)
    np.testing.assert_allclose(_sum_of(t, clients, (p,)), [5, 7, 9], atol=1.0)


def test_dp_sum_clips_each_client_to_the_norm():
    p = analytics.Privacy(noise_multiplier=1e-6, clip=1.0, seed=0)
    out = _sum_of(fl.TensorType(np.float32, [2]), [np.array([3.0, 4.0], np.float32)], (p,))
    np.testing.assert_allclose(out, [0.6, 0.8], atol=1e-4)


def test_bad_values_are_refused():
    with pytest.raises(ValueError, match="delta"):
        analytics.Privacy(1.0, 1.0, delta=2.0)
    with pytest.raises(ValueError, match="sampling_probability"):
        analytics.Privacy(1.0, 1.0, sampling_probability=1.5)
    with pytest.raises(ValueError, match="clip"):
        analytics.Privacy(1.0, 0.0)
