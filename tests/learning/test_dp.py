import pytest

from fedlang import aggregators
from fedlang.learning import dp


def test_dp_aggregator_configures_the_factory():
    fixed = dp.dp_aggregator(1.0, 10, clip=0.5, seed=0)
    assert isinstance(fixed, aggregators.DifferentiallyPrivateFactory)
    assert fixed.clip == 0.5 and fixed.value_noise_multiplier == 1.0
    adaptive = dp.dp_aggregator(0.5, 100, clip=0.1, adaptive=True)
    assert isinstance(adaptive.clip, aggregators.QuantileEstimator)
    assert adaptive.value_noise_multiplier > 0.5


def test_dp_aggregator_rejects_bad_arguments():
    with pytest.raises(ValueError, match="clients_per_round"):
        dp.dp_aggregator(1.0, 0)
