"""Tracing federated computations, and the trace-time errors users get."""

import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.core import ir

pytestmark = pytest.mark.usefixtures("runtime")

C_F32 = fl.type_at_clients(np.float32)
S_F32 = fl.type_at_server(np.float32)


def test_traced_once_into_ir_with_a_compact_form():
    calls = []

    @fl.federated_computation(C_F32)
    def mean(x):
        calls.append(x)
        return fl.federated_mean(x)

    assert len(calls) == 1
    assert isinstance(mean.ir, ir.Lambda)
    assert mean.compact_str() == "(arg -> (let v0=federated_mean(arg) in v0))"
    assert str(mean) == "mean: ({float32}@CLIENTS -> float32@SERVER)"
    mean([1.0]), mean([2.0])
    assert len(calls) == 1


def test_polymorphic_computation_is_traced_once_per_argument_type():
    traced = []

    @fl.federated_computation
    def identity(x):
        traced.append(x.type_signature)
        return x

    assert identity(1.0) == 1.0
    assert identity(2.0) == 2.0
    assert identity(3) == 3
    assert [str(t) for t in traced] == ["float32", "int32"]
    assert str(identity.concretize(np.float32).type_signature) == "(float32 -> float32)"
    with pytest.raises(TypeError, match="polymorphic"):
        identity.type_signature  # noqa: B018


def test_polymorphic_helper_inside_another_computation():
    @fl.federated_computation
    def mean_of(x):
        return fl.federated_mean(x)

    @fl.federated_computation(C_F32)
    def outer(x):
        return mean_of(x)

    assert str(outer.type_signature) == "({float32}@CLIENTS -> float32@SERVER)"
    assert outer([1.0, 3.0]) == 2.0


def test_nested_computation_call_and_struct_selection():
    @fl.federated_computation(fl.type_at_server(fl.to_type({"a": np.float32, "b": np.int32})))
    def pick(state):
        return state.a, state["b"], state[0]

    assert str(pick.type_signature) == (
        "(<a=float32,b=int32>@SERVER -> <float32@SERVER,int32@SERVER,float32@SERVER>)"
    )
    assert pick({"a": 1.0, "b": 2}) == (1.0, 2, 1.0)

    @fl.federated_computation(fl.to_type({"a": S_F32, "b": C_F32}))
    def unpack(s):
        a, b = s
        return {"sum": fl.federated_sum(b), "a": a}

    assert (
        str(unpack.type_signature)
        == "(<a=float32@SERVER,b={float32}@CLIENTS> -> <sum=float32@SERVER,a=float32@SERVER>)"
    )
    assert unpack({"a": 1.0, "b": [2.0, 3.0]}) == {"sum": 5.0, "a": 1.0}


def test_calling_a_computation_with_keywords():
    @fl.federated_computation(C_F32, S_F32)
    def f(x, y):
        return fl.federated_sum(x), y

    assert f(y=1.0, x=[2.0]) == (2.0, 1.0)
    with pytest.raises(TypeError, match="no parameter 'z'"):
        f([1.0], z=1.0)
    with pytest.raises(TypeError, match="takes 2 arguments"):
        f([1.0])


# -- misuse fails at trace time ---------------------------------------------------


def test_adding_server_and_clients_values_says_broadcast_or_aggregate():
    with pytest.raises(
        TypeError, match=r"cannot add \{float32\}@CLIENTS and float32@SERVER.*broadcast"
    ):

        @fl.federated_computation(C_F32, S_F32)
        def bad(x, y):
            return x + y


def test_arithmetic_on_client_values_says_use_jax_computation():
    with pytest.raises(
        TypeError, match=r"cannot multiply \{float32\}@CLIENTS.*jax_computation.*federated_map"
    ):
        fl.federated_computation(C_F32)(lambda x: x * 2.0)


def test_jax_op_on_a_federated_value_fails_with_a_fix():
    with pytest.raises(TypeError, match=r"Cannot use NumPy or JAX on a traced federated value"):
        fl.federated_computation(C_F32)(lambda x: jnp.sin(x))
    with pytest.raises(TypeError, match="NumPy or JAX"):
        fl.federated_computation(C_F32)(lambda x: np.asarray(x))


def test_python_control_flow_on_a_traced_value_fails():
    def body(x):
        if x:
            return x
        return x

    with pytest.raises(TypeError, match="control flow"):
        fl.federated_computation(C_F32)(body)


def test_intrinsic_outside_a_computation():
    with pytest.raises(RuntimeError, match=r"inside a @fedlang\.federated_computation"):
        fl.federated_sum([1.0, 2.0])


def test_wrong_placement_for_an_intrinsic():
    with pytest.raises(
        TypeError,
        match=r"federated_broadcast expects a value placed at SERVER, found \{float32\}@CLIENTS",
    ):
        fl.federated_computation(C_F32)(lambda x: fl.federated_broadcast(x))
    with pytest.raises(
        TypeError, match=r"federated_sum expects a value placed at CLIENTS, found float32@SERVER"
    ):
        fl.federated_computation(S_F32)(lambda x: fl.federated_sum(x))


def test_calling_a_local_computation_on_a_federated_value_suggests_federated_map():
    @fl.jax_computation(np.float32)
    def inc(x):
        return x + 1.0

    with pytest.raises(TypeError, match="federated_map"):
        fl.federated_computation(C_F32)(lambda x: inc(x))


def test_federated_map_with_a_wrong_member_type():
    @fl.jax_computation(np.int32)
    def inc(x):
        return x + 1

    with pytest.raises(TypeError, match=r"cannot take an argument of type float32"):
        fl.federated_computation(C_F32)(lambda x: fl.federated_map(inc, x))


def test_non_traceable_python_values():
    # Strings are values now (issue 14); an arbitrary object is not.
    with pytest.raises(TypeError, match="Cannot use object"):
        fl.federated_computation(C_F32)(lambda x: fl.federated_value(object(), fl.SERVER))
    with pytest.raises(TypeError, match="Python function"):
        fl.federated_computation(C_F32)(lambda x: fl.federated_map(lambda v: v, x))
    with pytest.raises(TypeError, match="returned None"):
        fl.federated_computation(C_F32)(lambda x: None)


def test_captured_value_from_an_enclosing_trace():
    def outer(x):
        @fl.federated_computation()
        def inner():
            return fl.federated_sum(x)

        return inner()

    with pytest.raises(TypeError, match="captured"):
        fl.federated_computation(C_F32)(outer)


def test_wrong_number_of_types_for_the_parameters():
    with pytest.raises(TypeError, match=r"has 2 parameter\(s\)"):
        fl.federated_computation(C_F32)(lambda x, y: x)


def test_hint_when_the_argument_contains_a_federated_value():
    @fl.jax_computation(np.float32, np.float32)
    def exceeds(x, t):
        return x > t

    with pytest.raises(TypeError, match="federated_map"):
        fl.federated_computation(C_F32)(lambda x: exceeds(x, 70.0))


def test_polymorphic_computation_called_with_client_lists_explains_placements():
    @fl.federated_computation
    def mean(x):
        return fl.federated_mean(x)

    with pytest.raises(TypeError, match=r"placements .* cannot be inferred"):
        mean([1.0, 2.0])


def test_numpy_reductions_on_traced_values_fail_helpfully():
    with pytest.raises(TypeError, match="NumPy or JAX"):
        fl.federated_computation(C_F32)(lambda x: np.sum(x))
