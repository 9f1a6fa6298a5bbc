"""The virtual clock: distributions, client times, availability windows, the event queue."""

import numpy as np
import pytest

from fedlang.simulation import clock, sampling


def test_distributions_are_deterministic_per_counter_and_have_their_shape():
    gen = lambda c: clock.rng(7, clock.STREAM_TIMES, c)  # noqa: E731
    ln = clock.LogNormal(median=2.0, sigma=0.5)
    assert np.array_equal(ln.sample(gen(0), 5), ln.sample(gen(0), 5))
    assert not np.array_equal(ln.sample(gen(0), 5), ln.sample(gen(1), 5))
    big = ln.sample(gen(2), 20000)
    assert abs(np.median(big) - 2.0) < 0.05
    par = clock.Pareto(scale=1.0, alpha=1.5).sample(gen(3), 20000)
    assert par.min() >= 1.0 and par.max() > 50 * np.median(par)  # heavy tail
    assert np.array_equal(clock.Constant(3.0).sample(gen(4), 3), [3.0, 3.0, 3.0])
    slow = clock.Stragglers(clock.Constant(1.0), fraction=0.2, slowdown=10.0).sample(gen(5), 10000)
    assert set(np.unique(slow)) == {1.0, 10.0} and abs((slow == 10.0).mean() - 0.2) < 0.02


def test_client_times_combine_compute_speed_and_network():
    times = clock.ClientTimes(compute=clock.Constant(2.0), network=clock.Constant(0.5),
                              device_speed=clock.LogNormal(1.0, 1.0))
    speeds = times.speeds(seed=1, num_clients=4)
    d = times.durations(seed=1, counter=0, clients=[2, 0], num_clients=4)
    np.testing.assert_allclose(d, [2.0 * speeds[2] + 0.5, 2.0 * speeds[0] + 0.5])
    assert np.array_equal(times.speeds(1, 4), speeds)
    assert np.array_equal(clock.ClientTimes(compute=clock.Constant(1.0)).speeds(1, 3), np.ones(3))


def test_availability_windows_follow_the_sampler_models():
    periodic = clock.AvailabilityWindows(sampling.PeriodicAvailability(4, 0.5), window=10.0)
    masks = [periodic.mask(0, 50, t) for t in (0.0, 9.9, 10.0, 40.0)]
    assert np.array_equal(masks[0], masks[1])  # the same window
    assert np.array_equal(masks[0], masks[3])  # one period later
    assert not np.array_equal(masks[0], masks[2])
    assert all(abs(m.mean() - 0.5) <= 0.2 for m in masks)
    assert periodic.next_change(12.0) == 20.0
    bern = clock.AvailabilityWindows(sampling.BernoulliAvailability(0.3), window=1.0)
    assert np.array_equal(bern.mask(3, 100, 5.2), bern.mask(3, 100, 5.7))


def test_event_queue_orders_by_time_then_push_order():
    q = clock.EventQueue()
    for t, e in [(2.0, "a"), (1.0, "b"), (2.0, "c"), (1.0, "d")]:
        q.push(t, e)
    assert [q.nth_time(k) for k in (1, 2, 3, 4, 5)] == [1.0, 1.0, 2.0, 2.0, float("inf")]
    assert q.pop_simultaneous() == (1.0, ["b", "d"])
    assert q.pop_simultaneous() == (2.0, ["a", "c"])
    assert len(q) == 0
    with pytest.raises(IndexError):
        q.pop_simultaneous()


@pytest.mark.parametrize("make, match", [
    (lambda: clock.LogNormal(0.0), "LogNormal.median"),
    (lambda: clock.Pareto(1.0, -1.0), "Pareto.alpha"),
    (lambda: clock.Constant(float("nan")), "Constant.value"),
    (lambda: clock.Stragglers(clock.Constant(1.0), fraction=1.5), "fraction"),
    (lambda: clock.AvailabilityWindows(sampling.BernoulliAvailability(0.5), window=0), "window"),
])
def test_bad_parameters_are_named(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_bad_kinds_are_named():
    with pytest.raises(TypeError, match="compute to be a distribution"):
        clock.ClientTimes(compute=3.0)
    with pytest.raises(TypeError, match="BernoulliAvailability"):
        clock.AvailabilityWindows(0.5, window=1.0)
