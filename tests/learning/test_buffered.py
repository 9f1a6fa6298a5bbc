"""FedBuff: the buffered process against synchronous FedAvg, staleness, refusals, errors."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, buffered, model_update_aggregator, models

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


def client_data(n_clients, seed=0):
    r = np.random.default_rng(seed)
    out = []
    for c in range(n_clients):
        n = 4 + 3 * c
        out.append([{"x": r.normal(size=(n, 3)).astype(np.float32),
                     "y": r.integers(0, 3, n).astype(np.int32)}])
    return out


def fed_buff(**kwargs):
    kwargs.setdefault("buffer_size", 3)
    return algorithms.build_fed_buff(model_fn, optax.sgd(0.3), optax.sgd(0.7), **kwargs)


def flat(weights):
    return np.concatenate([np.ravel(weights.trainable[k]) for k in sorted(weights.trainable)])


def test_no_staleness_equals_fed_avg():
    # arrange: the same parts, the same cohort of K clients each round
    k, rounds = 3, 3
    data = client_data(k * rounds)
    avg = algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.3), optax.sgd(0.7))
    buff = fed_buff(buffer_size=k)
    avg_state, buff_state = avg.initialize(), buff.initialize()
    for r in range(rounds):
        cohort = data[r * k:(r + 1) * k]
        # act
        avg_state, avg_metrics = avg.next(avg_state, cohort)
        for ds in cohort:
            weights, version = buff.client_model(buff_state)
            assert version == r
            buff_state = buff.fold(buff_state, buff.train(weights, ds), version)
        assert buff.is_full(buff_state)
        buff_state, metrics = buff.apply(buff_state)
        # assert
        np.testing.assert_allclose(
            flat(buff.get_model_weights(buff_state)), flat(avg.get_model_weights(avg_state)),
            rtol=1e-6, atol=1e-7)
        assert metrics["client_work"]["train"]["num_examples"] == (
            avg_metrics["client_work"]["train"]["num_examples"])
        np.testing.assert_allclose(metrics["client_work"]["train"]["loss"],
                                   avg_metrics["client_work"]["train"]["loss"], rtol=1e-6)
    status = buff.status(buff_state)
    assert status == {"version": rounds, "buffer_fill": 0, "buffer_size": k,
                      "max_staleness": 100, "accepted": k * rounds, "refused_stale": 0,
                      "staleness_histogram": {0: k * rounds}}


def test_staleness_weight_scales_updates_and_bound_refuses():
    seen = []

    def weight(tau):
        seen.append(tau)
        return 0.25 if tau else 1.0

    buff = fed_buff(buffer_size=2, max_staleness=1, staleness_weight=weight)
    data = client_data(6, seed=1)
    s0 = buff.initialize()
    w0, v0 = buff.client_model(s0)
    old_reports = [buff.train(w0, ds) for ds in data[:4]]
    s = buff.fold(buff.fold(s0, old_reports[0], v0), old_reports[1], v0)
    s, _ = buff.apply(s)                     # version 1
    s1 = buff.fold(s, old_reports[2], v0)   # tau 1: accepted, weight 0.25
    np.testing.assert_allclose(
        flat(models.ModelWeights(s1.buffer[0]["update"], ())),
        0.25 * flat(models.ModelWeights(old_reports[2]["update"], ())), rtol=1e-6)
    assert s1.buffer_staleness[0] == 1 and s1.buffer_weight[0] == np.float32(0.25)
    w1, v1 = buff.client_model(s1)
    s2 = buff.fold(s1, buff.train(w1, data[4]), v1)
    s2, metrics = buff.apply(s2)            # version 2
    assert metrics["staleness"]["max"] == 1 and metrics["staleness"]["mean"] == 0.5
    # act: a report from version 0 is now 2 versions stale, past the bound
    s3 = buff.fold(s2, old_reports[3], v0)
    # assert: refused and counted; nothing else changed
    assert int(s3.refused_stale) == 1 and int(s3.buffer_fill) == 0
    assert s3.buffer is s2.buffer and int(s3.accepted) == int(s2.accepted) == 4
    status = buff.status(s3)
    assert status["staleness_histogram"] == {0: 3, 1: 1} and status["refused_stale"] == 1
    assert seen == [0, 0, 1, 0]


def test_fold_is_pure_and_checks_its_arguments():
    buff = fed_buff(buffer_size=1)
    s0 = buff.initialize()
    w, v = buff.client_model(s0)
    report = buff.train(w, client_data(1)[0])
    s1 = buff.fold(s0, report, v)
    assert int(s0.buffer_fill) == 0 and int(s0.accepted) == 0 and s0.staleness_histogram[0] == 0
    with pytest.raises(ValueError, match="buffer is full"):
        buff.fold(s1, report, v)
    with pytest.raises(ValueError, match=r"version in \[0, 0\]"):
        buff.fold(s0, report, 1)
    with pytest.raises(ValueError, match="an int"):
        buff.fold(s0, report, "0")
    bad = {**report, "update_weight": np.float64(1.0)}
    with pytest.raises(TypeError, match="report leaf"):
        buff.fold(s0, bad, v)
    with pytest.raises(TypeError, match="Expected a report of type"):
        buff.fold(s0, {"update": report["update"]}, v)
    with pytest.raises(ValueError, match="full buffer"):
        buff.apply(s0)
    nan_weight = fed_buff(buffer_size=1, staleness_weight=lambda tau: float("nan"))
    with pytest.raises(ValueError, match="finite number"):
        nan_weight.fold(nan_weight.initialize(), report, 0)


@pytest.mark.parametrize("kwargs, error, match", [
    ({"buffer_size": 0}, ValueError, "buffer_size to be an int >= 1"),
    ({"max_staleness": -1}, ValueError, "max_staleness to be an int >= 0"),
    ({"max_staleness": 10**6}, ValueError, "max_staleness <= 10000"),
    ({"staleness_weight": 0.5}, ValueError, "function of the staleness"),
    ({"model_aggregator": "mean"}, TypeError, "aggregation factory"),
    ({"model_aggregator": model_update_aggregator.secure_aggregator()}, ValueError,
     "cannot use a secure aggregator"),
])
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        fed_buff(**kwargs)


def test_dp_aggregator_applies_per_buffer():
    buff = fed_buff(buffer_size=2, model_aggregator=model_update_aggregator.dp_aggregator(
        0.0, 2, adaptive=False, clip=1e-3, seed=0))
    s = buff.initialize()
    w, v = buff.client_model(s)
    for ds in client_data(2):
        s = buff.fold(s, buff.train(w, ds), v)
    s, _ = buff.apply(s)
    assert int(s.version) == 1
    # every update clipped to norm 1e-3 before the mean: the model moved by at most that
    moved = flat(buff.get_model_weights(s)) - flat(models.ModelWeights(W0, ()))
    assert 0 < np.linalg.norm(moved) <= 0.7 * 1e-3 * 1.0001


def test_polynomial_staleness():
    assert buffered.polynomial_staleness(0.5)(3) == 0.5
    assert buffered.default_staleness_weight(0) == 1.0
    assert buffered.polynomial_staleness(0.0)(7) == 1.0
    with pytest.raises(ValueError, match="exponent >= 0"):
        buffered.polynomial_staleness(-1)


def test_reports_and_state_cross_the_wire_format():
    # A deployment ships `train` to a client and its report back as bytes, and
    # persists the state: both must survive the binary format and still fold.
    from fedlang.core import serialization

    buff = fed_buff(buffer_size=2)
    s0 = buff.initialize()
    w, v = buff.client_model(s0)
    remote_train = serialization.deserialize_computation(
        serialization.serialize_computation(buff.train))
    report = remote_train(w, client_data(1)[0])
    wire = serialization.deserialize_value(
        serialization.serialize_value(report, buff.report_type), expected_type=buff.report_type)
    s1 = buff.fold(s0, wire, v)
    restored = serialization.deserialize_value(serialization.serialize_value(s1))
    s2 = buff.fold(restored, buff.train(w, client_data(2)[1]), v)
    s2, _ = buff.apply(s2)
    direct = buff.fold(buff.fold(s0, buff.train(w, client_data(1)[0]), v),
                       buff.train(w, client_data(2)[1]), v)
    direct, _ = buff.apply(direct)
    np.testing.assert_allclose(flat(buff.get_model_weights(s2)),
                               flat(buff.get_model_weights(direct)), rtol=1e-6)


@pytest.mark.parametrize("make", [
    lambda: model_update_aggregator.robust_aggregator(),
    lambda: model_update_aggregator.robust_aggregator(weighted=False),
])
def test_robust_and_unweighted_aggregators_apply_per_buffer(make):
    buff = fed_buff(buffer_size=2, model_aggregator=make())
    s = buff.initialize()
    w, v = buff.client_model(s)
    for ds in client_data(2):
        s = buff.fold(s, buff.train(w, ds), v)
    s, metrics = buff.apply(s)
    assert int(s.version) == 1 and metrics["aggregator"]  # the adaptive norms' measurements
    assert np.all(np.isfinite(flat(buff.get_model_weights(s))))
    assert not np.allclose(flat(buff.get_model_weights(s)), flat(models.ModelWeights(W0, ())))
