"""The client-state algorithms' builders: their state declarations and refusals."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import algorithms, models
from fedlang.learning.algorithms import fed_per

SPEC = {"x": (np.float32, [None, 3]), "y": (np.float32, [None])}


def model_fn():
    return models.FunctionalModel(
        init_fn=lambda rng: {"body": {"w": jnp.ones([3, 2])}, "head": {"w": jnp.ones([2])}},
        apply_fn=lambda p, x: (x @ p["body"]["w"]) @ p["head"]["w"],
        loss_fn=lambda pred, y: jnp.mean((pred - y) ** 2), input_spec=SPEC)


def test_each_process_declares_its_client_state():
    scaffold = algorithms.build_scaffold(model_fn, 0.1, total_clients=10)
    assert str(scaffold.client_state.state_type) == "<body=<w=float32[3,2]>,head=<w=float32[2]>>"
    ditto = algorithms.build_ditto(model_fn, optax.sgd(0.1), lam=1.0)
    assert str(ditto.client_state.state_type).startswith("<trainable=<body=")
    per = algorithms.build_fed_per(model_fn, optax.sgd(0.1), local_layers=["head"])
    assert str(per.client_state.state_type) == "<float32[2]>"
    np.testing.assert_array_equal(per.client_state.initial_state()[0], np.ones(2))
    assert algorithms.build_weighted_fed_avg(model_fn, optax.sgd(0.1)).client_state is None


def test_bad_settings_are_refused_with_the_fix():
    with pytest.raises(ValueError, match="client_learning_rate > 0"):
        algorithms.build_scaffold(model_fn, 0.0, total_clients=10)
    with pytest.raises(ValueError, match="population size N"):
        algorithms.build_scaffold(model_fn, 0.1, total_clients=0)
    with pytest.raises(ValueError, match="lam >= 0"):
        algorithms.build_ditto(model_fn, optax.sgd(0.1), lam=-1.0)
    with pytest.raises(ValueError, match=r"found \['neck'\]; its trainable weights are \['body/w', 'head/w'\]"):
        algorithms.build_fed_per(model_fn, optax.sgd(0.1), local_layers=["neck"])
    with pytest.raises(ValueError, match="found every weight local"):
        algorithms.build_fed_per(model_fn, optax.sgd(0.1), local_layers=["body", "head"])


def test_local_layers_by_name_prefix_or_predicate():
    t = models.FunctionalModel(
        init_fn=lambda rng: {"a": {"k": jnp.ones(1), "b": jnp.ones(1)}, "ab": jnp.ones(1)},
        apply_fn=lambda p, x: x, loss_fn=lambda p, y: 0.0, input_spec=SPEC,
    ).weights_type()["trainable"]
    assert fed_per.Partition(t, "a").is_local == [True, True, False]  # 'ab' is not under 'a'
    assert fed_per.Partition(t, lambda path: path.endswith("/k")).is_local == [False, True, False]
    part = fed_per.Partition(t, ["ab"])
    shared, local = part.split({"a": {"b": 1, "k": 2}, "ab": 3})
    assert (shared, local) == ([1, 2], [3])
    assert part.join(shared, local) == {"a": {"b": 1, "k": 2}, "ab": 3}
