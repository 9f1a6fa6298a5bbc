import collections
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

import fedlang as fl
from fedlang.core import structure, types

F32 = fl.TensorType(np.float32)
I32 = fl.TensorType(np.int32)


@pytest.mark.parametrize(
    ("t", "expected"),
    [
        (fl.TensorType(np.float32), "float32"),
        (fl.TensorType(np.float32, [None, 784]), "float32[?,784]"),
        (fl.TensorType(np.bool_, [3]), "bool[3]"),
        (fl.StructType([("x", np.float32), ("y", np.int32)]), "<x=float32,y=int32>"),
        (fl.StructType([np.float32, np.int32]), "<float32,int32>"),
        (fl.StructType([]), "<>"),
        (fl.FederatedType(np.float32, fl.SERVER), "float32@SERVER"),
        (fl.FederatedType(np.float32, fl.CLIENTS), "{float32}@CLIENTS"),
        (fl.FederatedType(np.float32, fl.CLIENTS, all_equal=True), "float32@CLIENTS"),
        (fl.SequenceType(fl.TensorType(np.float32, [None, 784])), "sequence<float32[?,784]>"),
        (
            fl.FunctionType(fl.type_at_clients(np.float32), fl.type_at_server(np.float32)),
            "({float32}@CLIENTS -> float32@SERVER)",
        ),
        (fl.FunctionType(None, fl.type_at_server(np.float32)), "( -> float32@SERVER)"),
        (fl.SparseTensorType(np.float32, [1_000_000, 16]), "sparse<float32[1000000,16]>"),
        (
            fl.FederatedType(fl.StructType([("a", np.float32)]), fl.SERVER),
            "<a=float32>@SERVER",
        ),
        (
            fl.FunctionType(
                fl.StructType(
                    [
                        fl.type_at_server(np.float32),
                        fl.type_at_clients(fl.SequenceType(fl.TensorType(np.int32, [None]))),
                    ]
                ),
                fl.type_at_server(np.float32),
            ),
            "(<float32@SERVER,{sequence<int32[?]>}@CLIENTS> -> float32@SERVER)",
        ),
    ],
)
def test_str_is_tff_notation(t, expected):
    assert str(t) == expected


def test_federated_defaults_follow_tff():
    assert fl.FederatedType(np.float32, fl.SERVER).all_equal
    assert not fl.FederatedType(np.float32, fl.CLIENTS).all_equal
    assert fl.FederatedType(np.float32, "clients").placement is fl.CLIENTS


def test_federated_type_accepts_numpy_dtype_member():
    assert fl.FederatedType(np.float32, fl.CLIENTS).member == F32


@pytest.mark.parametrize(
    ("spec", "expected"),
    [
        (np.float32, "float32"),
        ("int32", "int32"),
        (jnp.float32, "float32"),
        (float, "float32"),
        (int, "int32"),
        (bool, "bool"),
        ((np.float32, [None, 784]), "float32[?,784]"),
        (jax.ShapeDtypeStruct((3, 4), np.float32), "float32[3,4]"),
        (np.zeros((2, 3), np.int64), "int64[2,3]"),
        (1.5, "float32"),
        (3, "int32"),
        (True, "bool"),
        (np.float16(1), "float16"),
        ({"x": np.float32, "y": (np.int32, [None])}, "<x=float32,y=int32[?]>"),
        ([np.float32, np.int32], "<float32,int32>"),
        (fl.SparseTensor([[0]], [1.0], [5]), "sparse<float32[5]>"),
    ],
)
def test_to_type(spec, expected):
    assert str(fl.to_type(spec)) == expected


def test_to_type_rejects_what_it_cannot_convert():
    with pytest.raises(TypeError, match="Cannot convert"):
        fl.to_type(object())
    with pytest.raises(TypeError, match="numeric, boolean or string dtype"):
        fl.TensorType("S5")  # bytes: decode to str first
    with pytest.raises(TypeError, match="numeric, boolean or string dtype"):
        fl.TensorType(object)
    with pytest.raises(TypeError, match="dimension"):
        fl.TensorType(np.float32, [-3])
    with pytest.raises(TypeError, match="unique"):
        fl.StructType([("a", np.float32), ("a", np.int32)])
    with pytest.raises(TypeError, match="placement"):
        fl.FederatedType(np.float32, "EVERYWHERE")
    with pytest.raises(TypeError, match="local types"):
        fl.FederatedType(fl.type_at_server(np.float32), fl.CLIENTS)


Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Pair:
    a: float
    b: int


@pytest.mark.parametrize(
    "value",
    [
        {"x": 1.0, "y": 2},
        [1.0, 2],
        (1.0, 2),
        Point(1.0, 2),
        Pair(1.0, 2),
        {"outer": {"inner": [1.0, (2, 3)]}},
    ],
)
def test_containers_come_back_as_the_same_container(value):
    t = fl.to_type(value)
    back = structure.to_python(structure.to_internal(value, t), t)
    assert type(back) is type(value)
    assert (
        back == value
        if not dataclasses.is_dataclass(value)
        else back == Pair(np.float32(1.0), np.int32(2))
    )


def test_dict_keeps_insertion_order():
    assert str(fl.to_type({"b": np.int32, "a": np.float32})) == "<b=int32,a=float32>"


@pytest.mark.parametrize(
    ("target", "source", "ok"),
    [
        (fl.TensorType(np.float32, [None, 3]), fl.TensorType(np.float32, [7, 3]), True),
        (fl.TensorType(np.float32, [7, 3]), fl.TensorType(np.float32, [None, 3]), False),
        (F32, I32, False),
        (fl.TensorType(np.float32, [2]), fl.TensorType(np.float32, [2, 1]), False),
        (fl.StructType([("a", F32)]), fl.StructType([("a", F32)]), True),
        (fl.StructType([("a", F32)]), fl.StructType([("b", F32)]), False),
        (fl.StructType([F32]), fl.StructType([("b", F32)]), True),
        (fl.type_at_clients(F32), fl.type_at_clients(F32, all_equal=True), True),
        (fl.type_at_clients(F32, all_equal=True), fl.type_at_clients(F32), False),
        (fl.type_at_server(F32), fl.type_at_clients(F32, all_equal=True), False),
        (
            fl.SequenceType(fl.TensorType(np.float32, [None])),
            fl.SequenceType(fl.TensorType(np.float32, [4])),
            True,
        ),
        (
            fl.FunctionType(fl.TensorType(np.float32, [4]), F32),
            fl.FunctionType(fl.TensorType(np.float32, [None]), F32),
            True,
        ),
        (
            fl.FunctionType(fl.TensorType(np.float32, [None]), F32),
            fl.FunctionType(fl.TensorType(np.float32, [4]), F32),
            False,
        ),
        (fl.FunctionType(None, F32), fl.FunctionType(F32, F32), False),
        (fl.SparseTensorType(np.float32, [None, 4]), fl.SparseTensorType(np.float32, [9, 4]), True),
    ],
)
def test_assignability(target, source, ok):
    assert target.is_assignable_from(source) is ok


def test_helpers():
    assert fl.type_at_clients(np.float32) == fl.FederatedType(np.float32, fl.CLIENTS)
    assert fl.type_at_server(np.float32) == fl.FederatedType(np.float32, fl.SERVER)
    assert str(fl.type_at_clients(np.float32, all_equal=True)) == "float32@CLIENTS"


def test_types_are_immutable_and_hashable():
    t = fl.TensorType(np.float32, [2])
    with pytest.raises(AttributeError, match=r"^TensorType is immutable$"):
        t.shape = (3,)
    assert len({t, fl.TensorType(np.float32, [2]), F32}) == 2


def test_container_does_not_take_part_in_equality():
    assert fl.to_type({"a": np.float32}) == fl.StructType([("a", np.float32)])


# -- property tests --------------------------------------------------------------

dtypes = st.sampled_from([np.float32, np.int32, np.bool_, np.uint8, np.float16, np.int64])
shapes = st.lists(st.one_of(st.none(), st.integers(0, 5)), max_size=3)
tensor_types = st.builds(fl.TensorType, dtypes, shapes)
names = st.one_of(st.none(), st.text("abcxyz", min_size=1, max_size=3))


def struct_of(children):
    return (
        st.lists(st.tuples(names, children), max_size=3)
        .filter(lambda items: len({n for n, _ in items if n}) == len([n for n, _ in items if n]))
        .map(fl.StructType)
    )


local_types = st.recursive(tensor_types, struct_of, max_leaves=6)


@given(local_types)
def test_str_round_trips_through_equality(t):
    # Two structurally equal types print the same and hash the same.
    clone = (
        types.StructType(t.elements)
        if isinstance(t, fl.StructType)
        else fl.TensorType(t.dtype, t.shape)
    )
    assert clone == t and hash(clone) == hash(t) and str(clone) == str(t)
    assert t.is_assignable_from(clone)


def concrete(t):
    if isinstance(t, fl.StructType):
        return (
            {n: concrete(et) for n, et in t.elements}
            if t.names and all(t.names)
            else [concrete(et) for et in t.types]
        )
    return np.zeros([3 if d is None else d for d in t.shape], t.dtype)


@given(local_types)
def test_values_of_a_type_convert_and_come_back(t):
    value = concrete(t)
    inferred = fl.to_type(value)
    assert t.is_assignable_from(inferred)
    back = structure.to_python(structure.to_internal(value, t), t)
    assert fl.to_type(back) == inferred
