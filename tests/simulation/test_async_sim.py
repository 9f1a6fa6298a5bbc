"""run_async / run_sync on the virtual clock: FedBuff as FedAvg, determinism, staleness."""

import functools

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models
from fedlang.simulation import async_sim, clock, sampling

SPEC = {"x": (np.float32, [None, 3]), "y": (np.int32, [None])}
W0 = {"b": np.array([0.1, -0.2, 0.05], np.float32),
      "w": np.linspace(-0.5, 0.5, 9, dtype=np.float32).reshape(3, 3)}


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {k: jnp.asarray(v) for k, v in W0.items()},
        apply_fn=lambda p, x: x @ p["w"] + p["b"],
        loss_fn=lambda logits, y: optax.softmax_cross_entropy_with_integer_labels(logits, y).mean(),
        input_spec=SPEC,
        metrics=[models.Accuracy()],
    )


def population(n=12, seed=0):
    r = np.random.default_rng(seed)
    data = {}
    for c in range(n):
        k = 5 + c % 4
        x = r.normal(size=(k, 3)).astype(np.float32)
        data[f"c{c:02d}"] = [{"x": x, "y": (x.argmax(1)).astype(np.int32)}]
    return data


@functools.cache
def fed_buff(k=3, max_staleness=100):
    return algorithms.build_fed_buff(model_fn, optax.sgd(0.3), optax.sgd(0.7), buffer_size=k,
                                     max_staleness=max_staleness)


@functools.cache
def fed_avg():
    return algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.3), optax.sgd(0.7))


def flat(weights):
    return np.concatenate([np.ravel(weights.trainable[k]) for k in sorted(weights.trainable)])


def test_concurrency_k_without_latency_variance_is_fed_avg():
    # arrange
    data = population()
    times = clock.ClientTimes(compute=clock.Constant(2.0))
    # act
    history = async_sim.run_async(fed_buff(3), data, concurrency=3, num_steps=3,
                                  client_times=times, seed=5)
    # assert: every step used K fresh reports, at 2 s intervals, with no staleness
    assert [r.time for r in history] == [0.0, 2.0, 4.0, 6.0]
    assert [r.client_updates for r in history] == [0, 3, 6, 9]
    assert fed_buff(3).status(history.state)["staleness_histogram"] == {0: 9}
    assert history.train_calls == 3  # each version's 3 clients trained in one call
    state = fed_avg().initialize()
    for r in history[1:]:
        assert len(set(r.clients)) == 3
        state, _ = fed_avg().next(state, [data[c] for c in r.clients])
    np.testing.assert_allclose(flat(fed_buff(3).get_model_weights(history.state)),
                               flat(fed_avg().get_model_weights(state)), rtol=1e-6, atol=1e-7)


def test_a_seed_reproduces_a_run_bit_for_bit():
    data = population()
    times = clock.ClientTimes(compute=clock.LogNormal(1.0, 1.0),
                              network=clock.Pareto(0.1, 1.5))

    def run(seed):
        return async_sim.run_async(fed_buff(3), data, concurrency=6, num_steps=4,
                                   client_times=times, seed=seed)

    a, b, c = run(1), run(1), run(2)
    assert [(r.time, r.clients) for r in a] == [(r.time, r.clients) for r in b]
    assert np.array_equal(flat(fed_buff(3).get_model_weights(a.state)),
                          flat(fed_buff(3).get_model_weights(b.state)))
    assert [(r.time, r.clients) for r in a] != [(r.time, r.clients) for r in c]
    # with more clients training than the buffer holds, reports go stale
    hist = fed_buff(3).status(a.state)["staleness_histogram"]
    assert sum(hist.values()) == a[-1].client_updates == 12
    assert max(hist) >= 1
    assert a.train_calls < 12 + 6  # grouped: fewer calls than clients trained


def test_stale_reports_are_refused_and_counted_as_discarded():
    data = population()
    times = clock.ClientTimes(compute=clock.LogNormal(1.0, 1.5))
    history = async_sim.run_async(fed_buff(2, max_staleness=0), data, concurrency=6,
                                  num_steps=4, client_times=times, seed=3)
    status = fed_buff(2, max_staleness=0).status(history.state)
    assert status["refused_stale"] > 0
    assert history[-1].discarded == status["refused_stale"]
    assert status["staleness_histogram"] == {0: status["accepted"]}


class Ramp:
    """Durations 1, 2, 3, ... in the order the clients were picked."""

    def sample(self, gen, size):
        del gen
        return np.arange(1.0, size + 1.0)


def test_sync_over_selection_and_deadline():
    data = population()
    times = clock.ClientTimes(compute=Ramp())
    evaluated = []

    def evaluate(weights):
        evaluated.append(flat(weights))
        return {"accuracy": 0.1 * len(evaluated)}

    # 3 selected for a cohort of 2: the round closes at the 2nd report (2 s)
    h = async_sim.run_sync(fed_avg(), data, cohort_size=2, num_rounds=3, over_selection=0.5,
                           client_times=times, seed=0, evaluate=evaluate, eval_every=2)
    assert [r.time for r in h] == [0.0, 2.0, 4.0, 6.0]
    assert [len(r.clients) for r in h] == [0, 2, 2, 2]
    assert h[-1].discarded == 3 and h[-1].client_updates == 6
    assert [("eval" in r.metrics) for r in h] == [True, False, True, False]
    assert h.time_to("accuracy", 0.2) == 4.0 and h.time_to("accuracy", 0.9) is None
    # a 1.5 s deadline: only the first report of each round arrives
    d = async_sim.run_sync(fed_avg(), data, cohort_size=2, num_rounds=2, over_selection=0.5,
                           deadline=1.5, client_times=times, seed=0)
    assert [r.time for r in d] == [0.0, 1.5, 3.0] and [len(r.clients) for r in d] == [0, 1, 1]
    # without over-selection or deadline a round waits for its slowest client
    w = async_sim.run_sync(fed_avg(), data, cohort_size=3, num_rounds=1, client_times=times)
    assert w[-1].time == 3.0


def test_availability_windows_limit_who_starts():
    data = population()
    windows = clock.AvailabilityWindows(sampling.PeriodicAvailability(period=4, fraction=0.25),
                                        window=1.0)
    times = clock.ClientTimes(compute=clock.Constant(0.5))
    h = async_sim.run_async(fed_buff(2), data, concurrency=4, num_steps=3,
                            client_times=times, availability=windows, seed=0)
    ids = list(data)
    for r in h[1:]:
        for c in r.clients:
            # a client reporting at time t (after 0.5 s) was available when it started
            start = r.time - 0.5
            assert windows.mask(0, len(ids), start)[ids.index(c)]


@pytest.mark.parametrize("kwargs, match", [
    ({"concurrency": 0}, "concurrency to be an int in"),
    ({"concurrency": 100}, "concurrency to be an int in"),
    ({"num_steps": -1}, "num_steps"),
    ({"eval_every": 0}, "eval_every"),
])
def test_bad_async_arguments(kwargs, match):
    args = {"concurrency": 2, "num_steps": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        async_sim.run_async(fed_buff(3), population(), **args)


def test_bad_sync_arguments():
    with pytest.raises(ValueError, match="over_selection"):
        async_sim.run_sync(fed_avg(), population(), cohort_size=2, num_rounds=1,
                           over_selection=-0.1)
    with pytest.raises(ValueError, match="deadline"):
        async_sim.run_sync(fed_avg(), population(), cohort_size=2, num_rounds=1, deadline=0)
    with pytest.raises(TypeError, match="ClientTimes"):
        async_sim.run_sync(fed_avg(), population(), cohort_size=2, num_rounds=1,
                           client_times=clock.Constant(1.0))
    with pytest.raises(TypeError, match="client_data"):
        async_sim.run_sync(fed_avg(), [1, 2], cohort_size=2, num_rounds=1)
