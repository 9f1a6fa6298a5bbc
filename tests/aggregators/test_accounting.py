import pytest

from fedlang import aggregators

dp_accounting = pytest.importorskip("dp_accounting")  # an extra's package: skipped without it


@pytest.mark.parametrize("z,q,rounds,delta", [(1.1, 0.01, 100, 1e-5), (0.8, 0.05, 500, 1e-6),
                                              (2.0, 1.0, 10, 1e-5)])
def test_rdp_epsilon_matches_dp_accounting(z, q, rounds, delta):
    acc = dp_accounting.rdp.RdpAccountant()
    event = dp_accounting.GaussianDpEvent(z)
    if q < 1:
        event = dp_accounting.PoissonSampledDpEvent(q, event)
    acc.compose(event, rounds)
    assert aggregators.dp_epsilon(z, q, rounds, delta) == pytest.approx(acc.get_epsilon(delta))


def test_pld_epsilon_matches_dp_accounting():
    acc = dp_accounting.pld.PLDAccountant()
    acc.compose(dp_accounting.PoissonSampledDpEvent(0.02, dp_accounting.GaussianDpEvent(1.0)), 50)
    eps = aggregators.dp_epsilon(1.0, 0.02, 50, 1e-5, accountant="pld")
    assert eps == pytest.approx(acc.get_epsilon(1e-5))
    assert eps <= aggregators.dp_epsilon(1.0, 0.02, 50, 1e-5)


def test_accountant_reports_after_each_round():
    acc = aggregators.PrivacyAccountant(1.0, 0.05, delta=1e-5)
    eps = [acc.step()[0] for _ in range(3)]
    assert eps == sorted(eps) and acc.rounds == 3
    assert eps[-1] == pytest.approx(aggregators.dp_epsilon(1.0, 0.05, 3, 1e-5))


def test_tree_and_zero_rounds():
    assert aggregators.dp_epsilon(1.0, 0.1, 0, 1e-5) == 0.0
    assert aggregators.dp_epsilon(5.0, 1.0, 64, 1e-5, mechanism="tree") > 0


@pytest.mark.parametrize("kwargs,match", [
    ({"sampling_probability": 1.5}, "sampling_probability"),
    ({"delta": 0.0}, "delta"),
    ({"rounds": -1}, "rounds"),
    ({"accountant": "moments"}, "accountant"),
])
def test_bad_arguments(kwargs, match):
    args = {"noise_multiplier": 1.0, "sampling_probability": 0.1, "rounds": 10, "delta": 1e-5,
            **kwargs}
    with pytest.raises(ValueError, match=match):
        aggregators.dp_epsilon(**args)
