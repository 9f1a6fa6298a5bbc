"""The CPU rewrites give exactly what the primitives they replace give."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import fedlang as fl
from fedlang.backends.jax import export, rewrite

# The rules are XLA:CPU's: elsewhere `tuned` binds programs as written.
pytestmark = pytest.mark.skipif("jax.default_backend() != 'cpu'", reason="CPU rewrite rules")


def pool(x, window, strides, op=lax.max, init=-jnp.inf):
    return lax.reduce_window(x, init, op, window, strides, "VALID")


def pool_grad(window, strides, op=lax.max, init=-jnp.inf):
    """The gradient of a pooled weighted sum: a `select_and_scatter_add` in its jaxpr."""

    def fn(x, w):
        return [jax.grad(lambda x: jnp.sum(pool(x, window, strides, op, init) * w))(x)]

    return fn


def primitives(fn, *args):
    names = set()

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            if eqn.primitive.name in rewrite.INLINED:
                walk(rewrite.body(eqn)[0])
            else:
                names.add(eqn.primitive.name)

    walk(jax.make_jaxpr(fn)(*args).jaxpr)
    return names


CASES = [
    # shape, window, strides (NHWC max-pools; odd sizes drop a row and column)
    ((3, 8, 8, 4), (1, 2, 2, 1), (1, 2, 2, 1)),
    ((2, 9, 7, 3), (1, 3, 3, 1), (1, 3, 3, 1)),
    ((2, 7, 7, 5), (1, 2, 2, 1), (1, 2, 2, 1)),
    ((4, 6, 10), (1, 2, 5), (1, 2, 5)),
]


@pytest.mark.parametrize(("shape", "window", "strides"), CASES)
def test_pool_gradient_equals_select_and_scatter(shape, window, strides):
    rng = np.random.default_rng(0)
    x = rng.normal(size=shape).astype(np.float32)
    fn = pool_grad(window, strides)
    w = rng.normal(size=jax.eval_shape(lambda x: pool(x, window, strides), x).shape).astype(np.float32)
    assert "select_and_scatter_add" in primitives(fn, x, w)
    tuned = rewrite.tuned(fn)
    assert "select_and_scatter_add" not in primitives(tuned, x, w)
    np.testing.assert_array_equal(jax.jit(tuned)(x, w)[0], jax.jit(fn)(x, w)[0])


@pytest.mark.parametrize("values", ["zeros", "few"])
def test_ties_go_to_the_first_maximum_of_each_window(values):
    # After a ReLU many windows are all zeros: the cotangent goes to the first element.
    rng = np.random.default_rng(1)
    shape = (2, 6, 6, 3)
    x = np.zeros(shape, np.float32) if values == "zeros" else rng.integers(0, 2, shape).astype(np.float32)
    fn = pool_grad((1, 2, 2, 1), (1, 2, 2, 1))
    w = rng.normal(size=(2, 3, 3, 3)).astype(np.float32)
    np.testing.assert_array_equal(jax.jit(rewrite.tuned(fn))(x, w)[0], jax.jit(fn)(x, w)[0])


def test_min_pool_gradient_and_overlapping_windows():
    rng = np.random.default_rng(2)
    x = rng.normal(size=(2, 8, 8, 3)).astype(np.float32)
    w = rng.normal(size=(2, 4, 4, 3)).astype(np.float32)
    min_grad = pool_grad((1, 2, 2, 1), (1, 2, 2, 1), lax.min, jnp.inf)
    np.testing.assert_array_equal(jax.jit(rewrite.tuned(min_grad))(x, w)[0], jax.jit(min_grad)(x, w)[0])
    # Overlapping windows (3x3, stride 2) are not rewritten and still agree.
    overlap = pool_grad((1, 3, 3, 1), (1, 2, 2, 1))
    w3 = rng.normal(size=(2, 3, 3, 3)).astype(np.float32)
    assert "select_and_scatter_add" in primitives(rewrite.tuned(overlap), x, w3)
    np.testing.assert_array_equal(jax.jit(rewrite.tuned(overlap))(x, w3)[0], jax.jit(overlap)(x, w3)[0])


def test_rewrite_applies_inside_jit_and_custom_jvp_calls_and_under_vmap():
    @jax.jit
    def inner(x, w):
        return pool_grad((1, 2, 2, 1), (1, 2, 2, 1))(jax.nn.relu(x), w)[0]

    def fn(x, w):
        return [inner(x, w) * 2.0]

    rng = np.random.default_rng(3)
    x = rng.normal(size=(5, 2, 4, 4, 2)).astype(np.float32)
    w = rng.normal(size=(5, 2, 2, 2, 2)).astype(np.float32)
    tuned = rewrite.tuned(fn)
    assert "select_and_scatter_add" not in primitives(tuned, x[0], w[0])
    got = jax.jit(jax.vmap(tuned))(x, w)[0]
    want = jax.jit(jax.vmap(fn))(x, w)[0]
    np.testing.assert_array_equal(got, want)


def test_a_function_without_a_rule_is_bound_unchanged():
    def fn(x):
        return [jnp.sin(x) @ x.T]

    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    assert primitives(rewrite.tuned(fn), x) == primitives(fn, x)
    np.testing.assert_array_equal(jax.jit(rewrite.tuned(fn))(x)[0], jax.jit(fn)(x)[0])


def test_a_cnn_step_runs_rewritten_and_exports_unchanged():
    batch = fl.to_type({"x": (np.float32, [None, 8, 8, 1]), "y": (np.int32, [None])})
    w_type = fl.to_type({"k": (np.float32, [3, 3, 1, 4]), "d": (np.float32, [16 * 4, 3])})

    @fl.jax_computation(w_type, fl.SequenceType(batch))
    def train(w, ds):
        def loss(w, b):
            h = lax.conv_general_dilated(b["x"], w["k"], (1, 1), "SAME",
                                         dimension_numbers=("NHWC", "HWIO", "NHWC"))
            h = pool(jax.nn.relu(h), (1, 2, 2, 1), (1, 2, 2, 1)).reshape(b["x"].shape[0], -1)
            logits = h @ w["d"]
            return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), b["y"][:, None], 1))

        return ds.reduce(w, lambda w, b: jax.tree.map(lambda a, g: a - 0.1 * g, w, jax.grad(loss)(w, b)))

    rng = np.random.default_rng(4)
    w = {"k": rng.normal(size=(3, 3, 1, 4)).astype(np.float32),
         "d": rng.normal(size=(64, 3)).astype(np.float32) * 0.1}
    data = [{"x": rng.normal(size=(5, 8, 8, 1)).astype(np.float32),
             "y": rng.integers(0, 3, 5).astype(np.int32)} for _ in range(3)]
    w_leaves = [w[n] for n in w_type.names]
    b = data[0]
    args = [*w_leaves, *w_leaves, *[b[n] for n in batch.names], np.ones(5, np.float32)]
    step_part, step_tuned = train.part("step"), train.tuned_part("step")
    assert "select_and_scatter_add" in primitives(step_part, *args)
    assert "select_and_scatter_add" not in primitives(step_tuned, *args)
    for a, b in zip(jax.jit(step_tuned)(*args), jax.jit(step_part)(*args)):
        np.testing.assert_array_equal(a, b)
    # What is serialized is the program as written, the same on every machine.
    assert "select_and_scatter" in export.export_programs(train)["step"].mlir_module()
    # The computation's results are the untuned program's, on every runtime.
    with fl.runtime.reference_context():
        want = train(w, data)
    with fl.runtime.simulation_context(strategy="loop", decision_cache=False):
        got = train(w, data)
    for k in w:
        np.testing.assert_array_equal(got[k], want[k])


def test_callbacks_prints_and_control_flow_pass_through_a_rewritten_step(capfd):
    def fn(x, w):
        g = pool_grad((1, 2, 2, 1), (1, 2, 2, 1))(x, w)[0]
        jax.debug.print("total {s}", s=jnp.sum(g))
        doubled = jax.pure_callback(
            lambda a: np.asarray(a) * 2, jax.ShapeDtypeStruct(g.shape, g.dtype), g
        )
        count, _ = lax.scan(lambda c, _: (c + 1.0, None), 0.0, None, length=3)
        return [doubled + count]

    x = np.random.default_rng(5).normal(size=(2, 4, 4, 3)).astype(np.float32)
    w = np.ones((2, 2, 2, 3), np.float32)
    tuned = rewrite.tuned(fn)
    assert "select_and_scatter_add" not in primitives(tuned, x, w)
    np.testing.assert_array_equal(jax.jit(tuned)(x, w)[0], jax.jit(fn)(x, w)[0])
    assert capfd.readouterr().out.count("total 24.0") == 2
