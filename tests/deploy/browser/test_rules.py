"""fedlang's conversion rules: each rewrite computes exactly what its primitive computes
(checked against JAX itself), and `check` names what cannot be exported."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

from fedlang.deploy.browser import rules

rng = np.random.default_rng(0)


def assert_rewrite_equals_jax(fn, *args, rewritten=()):
    """`rules.rewrite(fn)` equals `fn` on `args`, and rewrote the primitives `rewritten`."""
    want = fn(*args)
    got = jax.jit(rules.rewrite(fn))(*args)
    for w, g in zip(want, got, strict=True):
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6)
    assert rules.rules_used(jax.make_jaxpr(fn)(*args).jaxpr) == set(rewritten)
    assert rules.rules_used(jax.make_jaxpr(rules.rewrite(fn))(*args).jaxpr) == set()


def test_the_integer_label_cross_entropy_gradient_drops_labels_out_of_range():
    def grad(logits, y):
        def loss(z):
            picked = jnp.take_along_axis(jax.nn.log_softmax(z), y[:, None], axis=1)
            return -jnp.sum(jnp.nan_to_num(picked))
        return [jax.grad(loss)(logits)]

    y = np.array([0, 3, 9, 12, -1, 5, 5], np.int32)  # 12 and -1 are outside the 10 classes
    assert_rewrite_equals_jax(grad, rng.normal(size=(7, 10)).astype(np.float32), y,
                              rewritten={"scatter-add"})


def test_the_per_example_loss_gradient_of_a_masked_batch():
    def grad(logits, y, mask):
        def loss(z):
            per = jax.vmap(lambda p, t: -jnp.take_along_axis(
                jax.nn.log_softmax(p[None]), t[None][:, None], axis=1)[0, 0])(z, y)
            return jnp.sum(per * mask)
        return [jax.grad(loss)(logits)]

    assert_rewrite_equals_jax(
        grad, rng.normal(size=(6, 4)).astype(np.float32), np.array([0, 3, 1, 2, 1, 0], np.int32),
        np.array([1, 1, 1, 0, 1, 0], np.float32), rewritten={"scatter-add"},
    )


def test_the_weight_gradient_contracts_the_batch_axis_last():
    def grad(x, w):
        return [jax.grad(lambda w: jnp.sum(jnp.tanh(x @ w)))(w)]

    assert_rewrite_equals_jax(grad, rng.normal(size=(5, 4)).astype(np.float32),
                              rng.normal(size=(4, 3)).astype(np.float32), rewritten={"dot_general"})


@pytest.mark.parametrize("window,strides,padding,size", [
    ((1, 2, 2, 1), (1, 2, 2, 1), "VALID", 6),  # the FedAvg CNN's pooling
    ((1, 3, 3, 1), (1, 2, 2, 1), "SAME", 5),  # overlapping windows, padded
    ((1, 2, 2, 1), (1, 2, 2, 1), "VALID", 7),  # a row and a column no window covers
])
def test_max_pooling_and_its_gradient_pick_the_first_maximum(window, strides, padding, size):
    def f(x):
        return jnp.sum(jnp.sin(lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)))

    def pool(x):
        return [f(x), jax.grad(f)(x)]

    ties = rng.integers(0, 3, size=(2, size, size, 3)).astype(np.float32)  # many equal maxima
    assert_rewrite_equals_jax(pool, ties, rewritten={"reduce_window_max", "select_and_scatter_add"})


@pytest.mark.parametrize("strides", [(1, 1), (2, 2)])
def test_convolution_gradients_in_any_layout(strides):
    def f(w, x):
        return jnp.sum(jnp.sin(lax.conv_general_dilated(
            x, w, strides, "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))))

    def conv(w, x):
        return [f(w, x), *jax.grad(f, argnums=(0, 1))(w, x)]

    assert_rewrite_equals_jax(conv, rng.normal(size=(3, 3, 2, 4)).astype(np.float32),
                              rng.normal(size=(2, 8, 8, 2)).astype(np.float32),
                              rewritten={"conv_general_dilated"})


def test_rules_apply_inside_jit_and_custom_derivatives():
    @jax.jit
    def inner(x, w):
        return jax.grad(lambda w: jnp.sum(jax.nn.relu(x @ w)))(w)

    assert_rewrite_equals_jax(lambda x, w: [inner(x, w)], rng.normal(size=(5, 4)).astype(np.float32),
                              rng.normal(size=(4, 3)).astype(np.float32), rewritten={"dot_general"})


def test_check_names_a_primitive_without_a_rule():
    jaxpr = jax.make_jaxpr(lambda x: jnp.sin(x) * 2)(1.0).jaxpr
    rules.check(jaxpr, {"sin", "mul"})
    with pytest.raises(rules.UnsupportedPrimitive, match="primitive 'sin'") as e:
        rules.check(jaxpr, {"mul"})
    assert e.value.primitive == "sin"


def test_check_refuses_a_rewrite_inside_control_flow():
    def scanned(x, w):
        def body(carry, xi):
            return carry + jax.grad(lambda w: jnp.sum(jnp.outer(xi, xi) @ w))(w), None
        return lax.scan(body, jnp.zeros_like(w), x)[0]

    jaxpr = jax.make_jaxpr(scanned)(np.ones((3, 4), np.float32), np.ones((4, 2), np.float32)).jaxpr
    with pytest.raises(rules.UnsupportedPrimitive, match=r"dot_general inside lax\.scan"):
        rules.check(jaxpr, _primitives(jaxpr))


def _primitives(jaxpr):
    """Every primitive in `jaxpr` and the jaxprs inside it."""
    names = set()
    for eqn in jaxpr.eqns:
        names.add(eqn.primitive.name)
        for sub in jax.extend.core.jaxprs_in_params(eqn.params):
            names |= _primitives(sub)
    return names


def test_check_refuses_a_scatter_over_two_axes():
    def f(x, i, j):
        return x.at[i, j].add(1.0)

    jaxpr = jax.make_jaxpr(f)(np.zeros((3, 4), np.float32), np.array([0, 1]), np.array([2, 3])).jaxpr
    with pytest.raises(rules.UnsupportedPrimitive, match="indexes more than one axis"):
        rules.check(jaxpr, _primitives(jaxpr))
