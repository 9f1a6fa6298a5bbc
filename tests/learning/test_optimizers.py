"""Optimizer arguments in the forms TFF users write them, and TFF's optimizers' formulas."""

import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fedlang.learning import optimizers

GRADS = [np.array([0.5, -1.0], np.float32), np.array([0.1, 0.3], np.float32),
         np.array([-0.2, 0.05], np.float32)]


def _run(opt, steps=GRADS):
    w = jnp.array([1.0, -2.0])
    state = opt.init(w)
    for g in steps:
        updates, state = opt.update(jnp.asarray(g), state, w)
        w = optax.apply_updates(w, updates)
    return np.asarray(w)


def test_a_zero_argument_optimizer_factory_is_accepted():
    fn = optimizers.as_optimizer_fn(lambda: optax.sgd(0.1), "client_optimizer")
    assert isinstance(fn(jnp.int32(3)), optax.GradientTransformation)
    by_round = optimizers.as_optimizer_fn(lambda r: optax.sgd(0.1), "client_optimizer")
    assert isinstance(by_round(jnp.int32(3)), optax.GradientTransformation)
    with pytest.raises(TypeError, match=r"lambda: optax.sgd\(0.1\).*lambda round_num"):
        optimizers.as_optimizer_fn(lambda a, b: None, "client_optimizer")
    with pytest.raises(TypeError, match=r"Expected client_optimizer\(\) to return"):
        optimizers.as_optimizer_fn(lambda: 0.1, "client_optimizer")


def test_tff_adam_folds_bias_correction_into_the_step_size():
    # arrange: TFF 0.87's build_adam, step by step (lr 0.1, b1 0.9, b2 0.999, eps 1e-7)
    lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-7
    w, m, v = np.array([1.0, -2.0]), np.zeros(2), np.zeros(2)
    for t, g in enumerate(GRADS, start=1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g**2
        w = w - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    # act / assert
    np.testing.assert_allclose(_run(optimizers.build_adam(lr)), w, rtol=1e-6)
    # by hand: the first step is -lr * g / (|g| + eps)
    np.testing.assert_allclose(_run(optimizers.build_adam(lr), GRADS[:1]),
                               [1.0 - 0.1 * 0.5 / (0.5 + 1e-7), -2.0 + 0.1 * 1.0 / (1.0 + 1e-7)],
                               rtol=1e-6)


def test_tff_adam_and_optax_adam_differ_where_epsilon_matters():
    # Optax adds eps to the bias-corrected root: with eps=1e-3 (FedAdam's tuning) the
    # weights part after three steps (docs/from-tff.md).
    import jax

    with jax.numpy_dtype_promotion("standard"):  # Optax mixes int32 counts and floats
        ours = _run(optimizers.build_adam(0.1, epsilon=1e-3))
        theirs = _run(optax.adam(0.1, eps=1e-3))
    assert np.abs(ours - theirs).max() > 1e-3


def test_tff_yogi_adagrad_and_sgdm_formulas():
    lr, b1, b2, eps, v0 = 0.1, 0.9, 0.999, 1e-3, 1e-6
    w, m, v = np.array([1.0, -2.0]), np.zeros(2), np.full(2, v0)
    for t, g in enumerate(GRADS, start=1):
        m = b1 * m + (1 - b1) * g
        v = v + (1 - b2) * np.sign(g**2 - v) * g**2
        w = w - lr * np.sqrt(1 - b2**t) / (1 - b1**t) * m / (np.sqrt(v) + eps)
    np.testing.assert_allclose(_run(optimizers.build_yogi(lr)), w, rtol=1e-6)

    w, s = np.array([1.0, -2.0]), np.full(2, 0.1)
    for g in GRADS:
        s = s + g**2
        w = w - lr * g / np.sqrt(s + 1e-7)
    np.testing.assert_allclose(_run(optimizers.build_adagrad(lr)), w, rtol=1e-6)

    for nesterov in (False, True):
        w, vel = np.array([1.0, -2.0]), np.zeros(2)
        for g in GRADS:
            vel = 0.9 * vel + g
            w = w - lr * ((g + 0.9 * vel) if nesterov else vel)
        np.testing.assert_allclose(_run(optimizers.build_sgdm(lr, 0.9, nesterov)), w, rtol=1e-6)
    np.testing.assert_allclose(_run(optimizers.build_sgdm(lr)),
                               np.array([1.0, -2.0]) - lr * sum(GRADS), rtol=1e-6)


def test_tff_optimizers_expose_tff_hyperparameter_names():
    state = optimizers.build_adam(0.01).init(jnp.zeros(2))
    assert sorted(optimizers.injected_hparams(state)) == ["beta_1", "beta_2", "epsilon",
                                                          "learning_rate"]
    with pytest.raises(ValueError, match=r"Expected beta_1 in \[0.0, 1.0\)"):
        optimizers.build_adam(0.01, beta_1=1.0)
