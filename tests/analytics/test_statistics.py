import numpy as np
import pytest

from fedlang import analytics


def _clients(seed=0, n=12):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, size=n)
    sizes[0] = 0  # an empty client
    return [rng.normal(2.0, 3.0, size=s).astype(np.float32) for s in sizes]


def test_exact_statistics_match_numpy(rt):
    clients = _clients()
    every = np.concatenate(clients).astype(np.float64)
    s = analytics.statistics(clients)
    assert s.count == len(every)
    np.testing.assert_allclose(s.sum, every.sum(), rtol=1e-5)
    np.testing.assert_allclose(s.mean, every.mean(), rtol=1e-5)
    np.testing.assert_allclose(s.variance, every.var(), rtol=1e-4)
    assert s.min == np.float32(every.min()) and s.max == np.float32(every.max())
    assert s.privacy is None


def test_vector_records_and_bounds(rt):
    clients = [np.array([[1.0, 10.0], [3.0, -10.0]]), np.array([[5.0, 0.0]])]
    s = analytics.statistics(clients, shape=(2,), bounds=(-4.0, 4.0))
    np.testing.assert_allclose(s.mean, [8 / 3, 0.0], rtol=1e-6)  # clamped: 1, 3, 4 and 4, -4, 0
    np.testing.assert_allclose(s.max, [4.0, 4.0])


def test_no_records_at_all(rt):
    s = analytics.statistics([[], []])
    assert s.count == 0 and np.isnan(s.mean) and s.min == np.inf


def test_secure_aggregation_is_close_to_exact(rt):
    clients = [np.array([0.5, 1.0]), np.array([2.0])]
    s = analytics.statistics(clients, secure_bound=8.0)
    np.testing.assert_allclose([s.count, s.sum], [3.0, 3.5], atol=0.01)
    assert s.min is None and s.max is None


def test_dp_noise_has_the_configured_scale():
    # Clients with no records contribute [0, 0, 0]: the released sums are pure noise.
    privacy = analytics.Privacy(noise_multiplier=2.0, clip=1.5, seed=3)
    comp = analytics.build_statistics((200,), bounds=(-1, 1), privacy=privacy)
    import fedlang as fl

    with fl.runtime.reference_context():
        out = comp([[], []])
    noise = np.concatenate([out["count"], out["sum"]])
    assert abs(noise.std() / privacy.stddev - 1) < 0.15
    assert abs(noise.mean()) < 4 * privacy.stddev / np.sqrt(len(noise))


def test_dp_reports_the_accountants_epsilon(rt):
    from fedlang import aggregators

    privacy = analytics.Privacy(1.0, 1.0, delta=1e-5, seed=0)
    s = analytics.statistics([[0.5]], bounds=(0, 1), privacy=privacy)
    assert s.privacy == (aggregators.dp_epsilon(1.0, 1.0, 1, 1e-5), 1e-5)
    assert s.min is None


def test_bad_configurations_are_refused():
    with pytest.raises(ValueError, match="bounds"):
        analytics.build_statistics(privacy=analytics.Privacy(1.0, 1.0))
    with pytest.raises(ValueError, match="lower < upper"):
        analytics.build_statistics(bounds=(1, 0))
    with pytest.raises(ValueError, match="noise_multiplier"):
        analytics.Privacy(-1.0, 1.0)
    with pytest.raises(TypeError, match=r"analytics\.Privacy"):
        analytics.build_statistics(bounds=(0, 1), privacy={"z": 1})
