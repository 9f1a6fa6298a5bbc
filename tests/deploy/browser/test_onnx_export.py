"""Exporting flat programs to ONNX: symbolic batches, names, constants, differences."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jax2onnx", reason="the browser extra is not installed")

from fedlang.deploy.browser import onnx_export


def test_a_program_runs_on_any_batch_size_with_the_names_given():
    def program(w, x):
        return [w, x @ w, x @ w, jnp.sum(x, axis=0)]  # an input passed through, an output twice

    avals = [jax.ShapeDtypeStruct((3, 2), np.float32),
             jax.ShapeDtypeStruct(jax.export.symbolic_shape("b, 3"), np.float32)]
    model = onnx_export.export(program, avals, ["w", "x"], ["w_out", "y1", "y2", "total"], "p")
    sess = onnx_export.session(model)
    assert [i.name for i in sess.get_inputs()] == ["w", "x"]
    rng = np.random.default_rng(0)
    w = rng.normal(size=(3, 2)).astype(np.float32)
    for batch in (1, 5):
        x = rng.normal(size=(batch, 3)).astype(np.float32)
        got = onnx_export.run(sess, ["w", "x"], [w, x])
        for g, want in zip(got, program(w, x), strict=True):
            assert onnx_export.difference(np.asarray(g), np.asarray(want)) < 1e-6


def test_constants_of_one_value_become_fills_not_copies():
    def program(w):
        return [jnp.where(jnp.all(jnp.isfinite(w)), w, jnp.zeros_like(w))]

    avals = [jax.ShapeDtypeStruct((512, 256), np.float32)]
    model = onnx_export.export(program, avals, ["w"], ["out"], "guard")
    assert len(model) < 10_000  # not a copy of the 512 KB of zeros
    w = np.ones((512, 256), np.float32)
    w[0, 0] = np.nan
    (got,) = onnx_export.run(onnx_export.session(model), ["w"], [w])
    assert not np.any(got)


def test_the_difference_is_relative_to_the_largest_value():
    want = np.array([1000.0, 1.0], np.float32)
    assert onnx_export.difference(np.array([1000.05, 1.0], np.float32), want) == pytest.approx(
        5e-5, rel=0.1)
    assert onnx_export.difference(np.array([np.nan, 1.0]), np.array([np.nan, 1.0])) == 0.0
    assert onnx_export.difference(np.array([np.nan, 1.0]), np.array([0.0, 1.0])) != 0.0
    assert onnx_export.difference(np.zeros(2), np.zeros(3)) == float("inf")


def test_a_conversion_failure_names_the_program():
    unknown = jax.extend.core.Primitive("fedlang_test_unknown")
    unknown.def_impl(lambda x: x)
    unknown.def_abstract_eval(lambda x: x)
    avals = [jax.ShapeDtypeStruct((2,), np.float32)]
    with pytest.raises(onnx_export.BrowserExportError, match=r"fedlang_test_unknown.*in the step"):
        onnx_export.check_program(lambda x: [unknown.bind(x)], avals, "the step")
