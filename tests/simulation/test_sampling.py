import json

import numpy as np
import pytest

from fedlang.simulation import sampling

IDS = [f"c{i}" for i in range(20)]


def test_uniform_sampler_distinct_and_deterministic():
    a = sampling.UniformSampler(IDS, 5, seed=1)
    b = sampling.UniformSampler(IDS, 5, seed=1)
    rounds = [a.sample() for _ in range(10)]
    assert rounds == [b.sample() for _ in range(10)]
    assert all(len(set(r)) == 5 and set(r) <= set(IDS) for r in rounds)
    assert len({tuple(r) for r in rounds}) > 1


def test_state_round_trips_through_json_and_resumes_exactly():
    s = sampling.UniformSampler(IDS, 3, seed=7)
    s.sample()
    state = json.loads(json.dumps(s.get_state()))
    expected = [s.sample() for _ in range(5)]
    resumed = sampling.UniformSampler(IDS, 3, seed=999)
    resumed.set_state(state)
    assert [resumed.sample() for _ in range(5)] == expected


def test_unseeded_sampler_state_still_reproducible():
    s = sampling.UniformSampler(IDS, 3)
    state = s.get_state()
    first = s.sample()
    s.set_state(state)
    assert s.sample() == first


def test_set_state_rejects_foreign_state():
    s = sampling.UniformSampler(IDS, 3, seed=0)
    w = sampling.WeightedSampler(IDS, np.ones(20), 3, seed=0)
    with pytest.raises(ValueError, match="UniformSampler state"):
        s.set_state(w.get_state())


def test_weighted_sampler_follows_weights():
    weights = {c: (100.0 if c in ("c0", "c1") else 1.0) for c in IDS}
    s = sampling.WeightedSampler(IDS, weights, 1, seed=0)
    picks = [s.sample()[0] for _ in range(300)]
    assert picks.count("c0") + picks.count("c1") > 200
    zero = sampling.WeightedSampler(IDS, [0.0] * 19 + [1.0], 1, seed=0)
    assert {zero.sample()[0] for _ in range(10)} == {"c19"}


def test_weighted_sampler_errors():
    with pytest.raises(ValueError, match="positive weights"):
        sampling.WeightedSampler(IDS, [0.0] * 19 + [1.0], 2)
    with pytest.raises(ValueError, match="non-negative"):
        sampling.WeightedSampler(IDS, [-1.0] * 20, 2)


def test_cohort_size_checked():
    with pytest.raises(ValueError, match="cohort_size"):
        sampling.UniformSampler(IDS, 21)
    with pytest.raises(ValueError, match="at least one client"):
        sampling.UniformSampler([], 1)


def test_bernoulli_availability_samples_only_available():
    s = sampling.AvailabilitySampler(IDS, 5, sampling.BernoulliAvailability(0.3), seed=2)
    for r in range(10):
        cohort = s.sample_round(r)
        available = s.available_clients(r)
        assert set(cohort) <= set(available) and len(cohort) == min(5, len(available))
    assert s.sample_round(3) == s.sample_round(3)


def test_periodic_availability_is_diurnal():
    s = sampling.AvailabilitySampler(IDS, 20, sampling.PeriodicAvailability(period=10, fraction=0.5), seed=0)
    counts = [len(s.available_clients(r)) for r in range(10)]
    assert all(5 <= c <= 15 for c in counts)
    assert s.available_clients(3) == s.available_clients(13)  # same phase each period
    with pytest.raises(ValueError, match="period"):
        sampling.PeriodicAvailability(0, 0.5)
