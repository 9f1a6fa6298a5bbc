"""The intrinsic registry: a new intrinsic is one definition, and runs on every runtime."""

import numpy as np
import pytest

import fedlang as fl
from fedlang.core import (
    context,
    intrinsic_defs,
    intrinsics,
    serialization,
    structure,
    tracing,
    types,
)
from fedlang.runtime import reference


def _sum_of_squares_rule(t: types.Type) -> types.Type:
    member = intrinsics.expect_federated(t, "federated_sum_of_squares", types.CLIENTS).member
    intrinsics.expect_numeric(member, "federated_sum_of_squares", "f", "floating-point values")
    return types.FederatedType(member, types.SERVER)


def _sum_of_squares_impl(arg, t, rt):
    if not arg:
        return intrinsics.zeros(t.member)
    flat = [structure.flatten(v, t.member) for v in arg]
    sums = [np.sum(np.square(np.stack(column)), axis=0) for column in zip(*flat)]
    return structure.unflatten(
        [s.astype(lt.dtype) for s, lt in zip(sums, structure.leaf_types(t.member))], t.member
    )


# The whole addition: one definition, here in a test module (no runtime is edited).
SUM_OF_SQUARES = intrinsics.define(
    "federated_sum_of_squares",
    intrinsics.Kind.AGGREGATE,
    "({T}@CLIENTS -> T@SERVER)",
    _sum_of_squares_rule,
    _sum_of_squares_impl,
    empty=intrinsics.zeros,
    replace=True,  # the module may be imported twice by pytest's importlib mode
)


def federated_sum_of_squares(value):
    """The user-facing operator: validates by the rule and records the call."""
    return tracing.call_intrinsic(SUM_OF_SQUARES.uri, value)


POINT = fl.to_type({"a": np.float32, "b": (np.float32, [2])})


@fl.federated_computation(fl.type_at_clients(POINT))
def sum_of_squares(points):
    return federated_sum_of_squares(points)


@fl.jax_computation(POINT)
def double(p):
    return {"a": 2 * p["a"], "b": 2 * p["b"]}


@fl.federated_computation(fl.type_at_clients(POINT))
def doubled_sum_of_squares(points):
    # Client work feeding the new intrinsic, next to a standard aggregation in one wave.
    doubled = fl.federated_map(double, points)
    return federated_sum_of_squares(doubled), fl.federated_sum(doubled)


def _points(n):
    rng = np.random.default_rng(0)
    return [
        {"a": np.float32(rng.normal()), "b": rng.normal(size=2).astype(np.float32)}
        for _ in range(n)
    ]


def test_a_new_intrinsic_types_and_prints_like_the_standard_ones():
    assert str(sum_of_squares.type_signature) == (
        "({<a=float32,b=float32[2]>}@CLIENTS -> <a=float32,b=float32[2]>@SERVER)"
    )
    with pytest.raises(TypeError, match="federated_sum_of_squares expects a value placed at CLIENTS"):

        @fl.federated_computation(fl.type_at_server(np.float32))
        def wrong(x):
            return federated_sum_of_squares(x)


@pytest.mark.parametrize("n", [0, 1, 7])
def test_a_new_intrinsic_runs_on_every_runtime(runtime, n):
    points = _points(n)
    got = sum_of_squares(points)
    assert np.allclose(got["a"], sum(p["a"] ** 2 for p in points), atol=1e-5)
    assert np.allclose(got["b"], sum((p["b"] ** 2 for p in points), np.zeros(2)), atol=1e-5)
    squares, total = doubled_sum_of_squares(points)
    assert np.allclose(squares["a"], 4 * got["a"], atol=1e-4)
    assert np.allclose(total["b"], 2 * sum((p["b"] for p in points), np.zeros(2)), atol=1e-5)


def test_a_computation_using_a_new_intrinsic_serializes():
    back = fl.Computation.from_bytes(sum_of_squares.to_bytes())
    assert back.type_signature == sum_of_squares.type_signature
    points = _points(3)
    assert np.allclose(back(points)["a"], sum_of_squares(points)["a"])


def test_defining_an_existing_name_is_refused():
    with pytest.raises(ValueError, match="already defined"):
        intrinsics.define(
            "federated_sum",
            intrinsics.Kind.AGGREGATE,
            "({T}@CLIENTS -> T@SERVER)",
            _sum_of_squares_rule,
            _sum_of_squares_impl,
        )


def test_every_definition_has_a_kind_and_aggregations_say_their_empty_value():
    for d in intrinsics.TABLE.values():
        assert isinstance(d.kind, intrinsics.Kind)
    for d in (intrinsic_defs.FEDERATED_SUM, intrinsic_defs.FEDERATED_MEAN, intrinsic_defs.FEDERATED_MIN):
        assert d.kind is intrinsics.Kind.AGGREGATE and d.empty is not None
    assert intrinsic_defs.FEDERATED_SECURE_SUM_BITWIDTH.kind is intrinsics.Kind.SECURE_AGGREGATE
    assert intrinsic_defs.SEQUENCE_REDUCE.kind is intrinsics.Kind.SEQUENCE


class _NoServerSequences(reference.ReferenceContext):
    """A runtime that cannot run sequence intrinsics at the server (as a deployment)."""

    name = "test-deployment"

    @staticmethod
    def refuse(d, fn_type):
        if d.kind is intrinsics.Kind.SEQUENCE and not isinstance(
            fn_type.result, types.FederatedType
        ):
            return "sequences live on clients here; reduce them in a client computation."
        return None


class CountingLocal:
    """A minimal local computation (the `LocalComputation` contract) that counts its runs."""

    kind = "counting"

    def __init__(self):
        self.name = "count_calls"
        self.type_signature = types.FunctionType(np.float32, np.float32)
        self.calls = 0

    def invoke(self, arg):
        self.calls += 1
        return np.float32(arg)


def test_a_runtime_refuses_an_intrinsic_before_running_anything():
    counter = CountingLocal()

    @fl.federated_computation(fl.type_at_server(np.float32), fl.SequenceType(np.float32))
    def uses_a_server_sequence(x, data):
        fl.federated_map(counter, x)  # would run first if nothing were checked
        return fl.sequence_sum(data)

    with (
        context.with_context(_NoServerSequences()),
        pytest.raises(
            intrinsics.UnsupportedIntrinsicError,
            match="test-deployment runtime cannot run sequence_sum",
        ),
    ):
        uses_a_server_sequence(np.float32(1.0), [np.float32(2.0)])
    assert counter.calls == 0
    assert np.isclose(uses_a_server_sequence(np.float32(1.0), [np.float32(2.0)]), 2.0)


def test_unknown_intrinsics_in_serialized_bytes_are_refused():
    data = sum_of_squares.to_bytes()
    saved = intrinsics.TABLE.pop(SUM_OF_SQUARES.uri)
    try:
        with pytest.raises(serialization.SerializationError, match="federated_sum_of_squares"):
            fl.Computation.from_bytes(data)
    finally:
        intrinsics.TABLE[SUM_OF_SQUARES.uri] = saved
