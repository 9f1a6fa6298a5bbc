"""Calling conventions and errors on bad input, the same on every runtime."""

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import context

pytestmark = pytest.mark.usefixtures("runtime")


C_F32 = fl.type_at_clients(np.float32)
S_F32 = fl.type_at_server(np.float32)
SEQ = fl.SequenceType(fl.TensorType(np.float32, [None]))


@fl.federated_computation(C_F32, C_F32)
def weighted(x, w):
    return fl.federated_mean(x, w)


def test_client_counts_must_agree():
    with pytest.raises(ValueError, match=r"different numbers of clients: \.x has 2, \.w has 3"):
        weighted([1.0, 2.0], [1.0, 1.0, 1.0])


def test_number_of_clients_unknown_is_reported_and_can_be_given(runtime):
    @fl.federated_computation(S_F32)
    def bcast_sum(x):
        return fl.federated_sum(fl.federated_broadcast(x))

    with pytest.raises(ValueError, match="number of clients is unknown"):
        bcast_sum(1.0)
    with context.with_context(runtime(num_clients=4)):
        assert bcast_sum(1.0) == 4.0


def test_wrong_argument_types_name_the_client():
    with pytest.raises(
        TypeError, match=r"Expected a value of type float32 at \.x\[client 1\], found str"
    ):
        weighted([1.0, "two"], [1.0, 1.0])
    with pytest.raises(TypeError, match="one entry per client"):
        weighted(1.0, [1.0])


def test_server_value_passed_as_a_single_value():
    @fl.federated_computation(fl.type_at_server(fl.TensorType(np.float32, [2])))
    def ident(x):
        return x

    np.testing.assert_array_equal(ident(np.array([1.0, 2.0], np.float32)), [1.0, 2.0])
    with pytest.raises(TypeError, match=r"Expected a value of type float32\[2\]"):
        ident([1.0, 2.0, 3.0])


@fl.jax_computation(SEQ)
def total(ds):
    return ds.reduce(jnp.float32(0), lambda s, b: s + jnp.sum(b))


@fl.federated_computation(fl.type_at_clients(SEQ))
def fed_total(ds):
    return fl.federated_map(total, ds)


def test_client_datasets_are_streams():
    pulled = []

    def gen(n):
        for i in range(n):
            pulled.append(i)
            yield np.ones(2, np.float32)

    out = fed_total([gen(3), gen(1), []])
    assert [float(v) for v in out] == [6.0, 2.0, 0.0]
    assert pulled == [0, 1, 2, 0]


def test_bad_client_dataset_names_the_client_and_element():
    with pytest.raises(TypeError, match=r"\[client 1\]<element 0>"):
        fed_total([[np.ones(2, np.float32)], [np.ones((2, 2), np.float32)]])
    with pytest.raises(TypeError, match=r"dataset \(any iterable"):
        fed_total([np.float32(1.0)])


def test_function_arguments_must_be_computations_of_the_right_type():
    @fl.jax_computation(np.float32)
    def inc(x):
        return x + 1.0

    @fl.federated_computation(fl.FunctionType(np.float32, np.float32), C_F32)
    def apply(fn, x):
        return fl.federated_map(fn, x)

    assert apply(inc, [1.0]) == [2.0]
    with pytest.raises(TypeError, match=r"Expected a computation of type \(float32 -> float32\)"):
        apply(lambda v: v, [1.0])


def test_an_empty_cohort_gives_each_aggregation_its_empty_value(runtime):
    point = {"a": np.float32, "n": np.int32}

    @fl.jax_computation(point)
    def double(p):
        return {"a": 2 * p["a"], "n": 2 * p["n"]}

    @fl.federated_computation(fl.type_at_clients(point))
    def everything(points):
        doubled = fl.federated_map(double, points)
        return {
            "sum": fl.federated_sum(doubled),
            "mean": fl.federated_mean(fl.federated_map(_float_of, doubled)),
            "min": fl.federated_min(doubled),
            "max": fl.federated_max(doubled),
        }

    out = everything([])
    assert out["sum"] == {"a": 0.0, "n": 0}
    assert np.isnan(out["mean"])
    assert out["min"]["n"] == np.iinfo(np.int32).max and out["max"]["n"] == np.iinfo(np.int32).min
    assert out["min"]["a"] == np.finfo(np.float32).max


@fl.jax_computation({"a": np.float32, "n": np.int32})
def _float_of(p):
    return p["a"]


def test_unbatched_examples_where_batches_are_expected_suggest_batching(runtime):
    # Issue 16 item 10: a dataset of single examples given where batches are declared.
    element = {"x": (np.float32, [None, 3])}

    @fl.jax_computation(fl.SequenceType(element))
    def rows(ds):
        return ds.reduce(np.int32(0), lambda n, b: n + b["x"].shape[0])

    @fl.federated_computation(fl.type_at_clients(fl.SequenceType(element)))
    def total_rows(data):
        return fl.federated_sum(fl.federated_map(rows, data))

    with pytest.raises(TypeError, match=r"found float32\[3\]\. It looks like one example .*dataset\.batch\(20\)"):
        total_rows([[{"x": np.ones(3, np.float32)}]])
