"""Local JAX computations: typing by tracing, calls, and datasets consumed by reduce."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl

pytestmark = pytest.mark.usefixtures("runtime")


BATCH = fl.to_type({"x": (np.float32, [None, 2]), "y": (np.float32, [None])})


def test_result_type_comes_from_tracing_not_execution():
    ran = []

    @fl.jax_computation(fl.TensorType(np.float32, [None, 3]))
    def stats(x):
        ran.append(type(x))
        return {"mean": jnp.mean(x, axis=0), "n": x.shape[0], "first": x[0]}

    assert (
        str(stats.type_signature) == "(float32[?,3] -> <mean=float32[3],n=int32,first=float32[3]>)"
    )
    assert all(issubclass(t, jax.core.Tracer) for t in ran)
    out = stats(np.ones((4, 3), np.float32))
    assert list(out) == ["mean", "n", "first"]  # dict comes back in the traced order
    assert out["n"] == 4


def test_multiple_parameters_are_named_by_the_python_arguments():
    @fl.jax_computation(np.float32, fl.TensorType(np.int32, [2]))
    def f(scale, v):
        return v.astype(jnp.float32) * scale

    assert str(f.type_signature) == "(<scale=float32,v=int32[2]> -> float32[2])"
    np.testing.assert_allclose(f(2.0, np.array([1, 2], np.int32)), [2.0, 4.0])
    np.testing.assert_allclose(f(v=np.array([1, 2], np.int32), scale=0.5), [0.5, 1.0])


def test_declared_result_type_must_match():
    with pytest.raises(
        TypeError, match=r"declares the result type int32, but its JAX code returns float32"
    ):

        @fl.jax_computation(np.float32, result_type=np.int32)
        def f(x):
            return x * 2.0

    @fl.jax_computation(
        fl.TensorType(np.float32, [3]), result_type=fl.TensorType(np.float32, [None])
    )
    def g(x):
        return x

    assert str(g.type_signature) == "(float32[3] -> float32[?])"


def test_call_checks_argument_types():
    @fl.jax_computation(fl.TensorType(np.float32, [3]))
    def f(x):
        return x

    with pytest.raises(
        TypeError, match=r"Expected a value of type float32\[3\], found float32\[4\]"
    ):
        f(np.zeros(4, np.float32))
    with pytest.raises(TypeError, match="convert it explicitly"):
        fl.jax_computation(np.int32)(lambda x: x)(np.float32(1.5))


def test_64_bit_types_are_refused_without_x64():
    with pytest.raises(TypeError, match="64-bit"):
        fl.jax_computation(np.float64)(lambda x: x)


def test_dataset_reduce_runs_as_prologue_step_epilogue():
    @fl.jax_computation(np.float32, fl.SequenceType(BATCH))
    def weighted_sum(scale, ds):
        init = {"total": jnp.float32(0), "n": jnp.int32(0)}

        def step(state, batch):
            # `scale` is captured from the enclosing function, as FedProx captures its initial weights.
            return {
                "total": state["total"] + scale * jnp.sum(batch["y"]),
                "n": state["n"] + batch["y"].shape[0],
            }

        state = ds.reduce(init, step)
        return state["total"] / state["n"].astype(jnp.float32)

    assert (
        str(weighted_sum.type_signature)
        == "(<scale=float32,ds=sequence<<x=float32[?,2],y=float32[?]>>> -> float32)"
    )
    batches = [
        {"x": np.zeros((2, 2), np.float32), "y": np.array([1.0, 2.0], np.float32)},
        {"x": np.zeros((1, 2), np.float32), "y": np.array([3.0], np.float32)},
    ]
    assert weighted_sum(2.0, batches) == pytest.approx(4.0)
    assert weighted_sum(2.0, iter(batches)) == pytest.approx(4.0)  # a one-shot iterator works too
    assert weighted_sum.uses_reduce and str(weighted_sum.state_type) == "<total=float32,n=int32>"


def test_dataset_map_applies_before_the_step():
    @fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [None])))
    def sum_of_squares(ds):
        return ds.map(lambda b: b * b).reduce(jnp.float32(0), lambda s, b: s + jnp.sum(b))

    assert sum_of_squares([np.array([1.0, 2.0], np.float32), np.array([3.0], np.float32)]) == 14.0


def test_empty_dataset_gives_the_initial_state():
    @fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [None])))
    def count(ds):
        return ds.reduce(jnp.int32(0), lambda s, b: s + b.shape[0])

    assert count([]) == 0


def test_dataset_misuse_is_reported():
    seq = fl.SequenceType(fl.TensorType(np.float32, [None]))
    with pytest.raises(TypeError, match="reduce may be called once"):

        @fl.jax_computation(seq)
        def twice(ds):
            a = ds.reduce(jnp.float32(0), lambda s, b: s + jnp.sum(b))
            return a + ds.reduce(jnp.float32(0), lambda s, b: s)

    with pytest.raises(TypeError, match="cannot be iterated"):
        fl.jax_computation(seq)(lambda ds: sum(b for b in ds))
    with pytest.raises(TypeError, match="step_fn must return a state"):
        fl.jax_computation(seq)(lambda ds: ds.reduce(jnp.float32(0), lambda s, b: jnp.int32(1)))
    with pytest.raises(TypeError, match="at most one"):
        fl.jax_computation(seq, seq)(lambda a, b: 0.0)


def test_function_that_ignores_its_dataset():
    @fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [None])))
    def const(ds):
        return jnp.float32(3.0)

    assert not const.uses_reduce
    assert const([np.ones(2, np.float32)]) == 3.0


def test_element_type_mismatch_names_the_element():
    @fl.jax_computation(fl.SequenceType(fl.TensorType(np.float32, [None])))
    def total(ds):
        return ds.reduce(jnp.float32(0), lambda s, b: s + jnp.sum(b))

    with pytest.raises(TypeError, match=r"float32\[\?\] at <element 1>, found float32\[2,2\]"):
        total([np.ones(2, np.float32), np.ones((2, 2), np.float32)])


def test_sparse_tensors_flow_through_without_densifying():
    @fl.jax_computation(fl.SparseTensorType(np.float32, [1_000_000]))
    def total(st):
        return jnp.sum(st.values)

    assert str(total.type_signature) == "(sparse<float32[1000000]> -> float32)"
    assert total(fl.SparseTensor([[3], [999_999]], [1.5, 2.5], [1_000_000])) == 4.0


def test_dict_state_and_result_match_fields_by_name():
    # jax.tree.map and jax.grad return dicts with sorted keys; fields are matched by name.
    @fl.jax_computation(
        fl.to_type({"w": np.float32, "b": np.float32}),
        fl.SequenceType(fl.TensorType(np.float32, [None])),
    )
    def fit(params, ds):
        def step(p, batch):
            grads = jax.grad(lambda q: jnp.sum((q["w"] * batch + q["b"]) ** 2))(p)
            return jax.tree.map(lambda a, g: a - 0.01 * g, p, grads)

        return ds.reduce(params, step)

    assert str(fit.type_signature.result) == "<w=float32,b=float32>"
    out = fit({"w": 1.0, "b": 0.5}, [np.ones(2, np.float32)])
    assert list(out) == ["w", "b"]


@fl.jax_computation(fl.SequenceType(BATCH))
def masked_mean(ds):
    def step(state, batch, mask):
        total, n = state
        return total + jnp.sum(batch["y"] * mask), n + jnp.sum(mask)

    total, n = ds.reduce((jnp.float32(0), jnp.float32(0)), step, masked=True)
    return total / n


def test_masked_reduce_sees_a_mask_of_real_examples():
    batches = [
        {"x": np.zeros((4, 2), np.float32), "y": np.arange(4, dtype=np.float32)},
        {"x": np.zeros((3, 2), np.float32), "y": np.arange(3, dtype=np.float32) + 10},
    ]
    assert masked_mean.masked
    assert masked_mean(batches) == pytest.approx((0 + 1 + 2 + 3 + 10 + 11 + 12) / 7)


def test_a_masked_reduce_over_batches_of_a_fixed_size():
    # e.g. an element_spec taken from dataset.batch(20, drop_remainder=True)
    element = {"x": (np.float32, [4, 3])}

    @fl.jax_computation(fl.SequenceType(element))
    def total(ds):
        return ds.reduce(
            np.float32(0),
            lambda s, b, mask: s + jnp.sum(b["x"] * mask[:, None]),
            masked=True,
        )

    batches = [{"x": np.ones((4, 3), np.float32)}, {"x": 2 * np.ones((4, 3), np.float32)}]
    assert float(total(batches)) == 36.0
    restored = fl.Computation.from_bytes(total.to_bytes(), trusted=True)
    assert float(restored(batches)) == 36.0


def test_jax_errors_keep_their_type_and_gain_a_note_that_says_what_to_do():
    # Issue 16 item 3: they were re-raised as `type(e)(str(e))`, which garbled them.
    with pytest.raises(jax.errors.TracerArrayConversionError) as info:

        @fl.jax_computation(np.float32)
        def to_numpy(x):
            return np.asarray(x) + 1

    assert any("use jax.numpy operations only" in note for note in info.value.__notes__)
