"""Tests of fedlang.core.serialization: round trips, validation and malformed input."""

import collections
import dataclasses
import json
import struct
import sys
import zlib

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import fedlang as fl
from fedlang.core import computation, ir, serialization, types, wire

Point = collections.namedtuple("Point", ["x", "y"])


@dataclasses.dataclass
class Pair:
    a: object
    b: object


# ----------------------------------------------------------------------------
# Strategies

_DTYPES = ["bool", "int8", "uint8", "int16", "int32", "int64", "float16", "float32", "float64"]
_NAMES = st.sampled_from(["a", "b", "x", "w_1", "long_name"])
_dims = st.lists(st.one_of(st.none(), st.integers(0, 5)), max_size=3)


def _tensor_types() -> st.SearchStrategy:
    dtypes = st.sampled_from([*_DTYPES, "bfloat16"]).map(
        lambda d: ml_dtypes.bfloat16 if d == "bfloat16" else np.dtype(d)
    )
    tensor = st.builds(types.TensorType, dtypes, _dims)
    sparse = st.builds(types.SparseTensorType, dtypes, _dims)
    return st.one_of(tensor, sparse)


def _structs(children: st.SearchStrategy) -> st.SearchStrategy:
    named = st.dictionaries(_NAMES, children, max_size=3).map(types.StructType)
    unnamed = st.lists(children, max_size=3).map(
        lambda ts: types.StructType(ts, container=types.ContainerSpec("list"))
    )
    point = st.tuples(children, children).map(
        lambda ts: types.StructType(
            [("x", ts[0]), ("y", ts[1])],
            container=types.ContainerSpec("namedtuple", Point, "Point"),
        )
    )
    return st.one_of(named, unnamed, point)


_local_types = st.recursive(_tensor_types(), _structs, max_leaves=6)
_all_types = st.one_of(
    _local_types,
    _local_types.map(types.SequenceType),
    st.builds(types.FederatedType, _local_types, st.sampled_from([fl.CLIENTS, fl.SERVER])),
    st.builds(types.FunctionType, st.one_of(st.none(), _local_types), _local_types),
    st.just(types.PlacementType()),
)


def _arrays(dtype: str, shape: tuple[int, ...]) -> st.SearchStrategy:
    if dtype == "bfloat16":
        return hnp.arrays(np.float32, shape, elements=st.floats(-4, 4, width=32)).map(
            lambda a: a.astype(ml_dtypes.bfloat16)
        )
    return hnp.arrays(np.dtype(dtype), shape)


_shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=4)
_tensors = st.tuples(st.sampled_from([*_DTYPES, "bfloat16"]), _shapes).flatmap(
    lambda a: _arrays(*a)
)


@st.composite
def _sparse_tensors(draw: st.DrawFn) -> fl.SparseTensor:
    dense_shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=5))
    nnz = draw(st.integers(0, 4))
    indices = [[draw(st.integers(0, d - 1)) for d in dense_shape] for _ in range(nnz)]
    values = draw(hnp.arrays(np.float32, (nnz,), elements=st.floats(-9, 9, width=32)))
    return fl.SparseTensor(
        np.array(indices, np.int64).reshape(nnz, len(dense_shape)), values, dense_shape
    )


def _containers(children: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(
        st.dictionaries(_NAMES, children, min_size=1, max_size=3),
        st.lists(children, max_size=3),
        st.lists(children, min_size=1, max_size=3).map(tuple),
        st.tuples(children, children).map(lambda xs: Point(*xs)),
        st.tuples(children, children).map(lambda xs: Pair(*xs)),
    )


_values = st.recursive(st.one_of(_tensors, _sparse_tensors()), _containers, max_leaves=6)


def assert_same(actual: object, expected: object) -> None:
    """Equal values in the same containers, with equal dtypes (NaNs compare equal)."""
    assert type(actual) is type(expected), (type(actual), type(expected))
    if isinstance(expected, fl.SparseTensor):
        assert actual.dense_shape == expected.dense_shape
        assert_same(actual.indices, expected.indices)
        assert_same(actual.values, expected.values)
    elif isinstance(expected, dict):
        assert list(actual) == list(expected)
        for k in expected:
            assert_same(actual[k], expected[k])
    elif isinstance(expected, list | tuple):
        assert len(actual) == len(expected)
        for a, e in zip(actual, expected):
            assert_same(a, e)
    elif dataclasses.is_dataclass(expected):
        assert_same(dataclasses.astuple(actual), dataclasses.astuple(expected))
    else:
        assert np.asarray(actual).dtype == np.asarray(expected).dtype
        assert np.asarray(actual).tobytes() == np.asarray(expected).tobytes()


def _expected(value: object) -> object:
    """What a value comes back as: NumPy scalars for 0-d arrays."""
    if isinstance(value, np.ndarray):
        return value[()] if value.ndim == 0 else value
    if isinstance(value, dict):
        return {k: _expected(v) for k, v in value.items()}
    if isinstance(value, Point):
        return Point(*map(_expected, value))
    if isinstance(value, Pair):
        return Pair(_expected(value.a), _expected(value.b))
    if isinstance(value, list | tuple):
        return type(value)(map(_expected, value))
    return value


# ----------------------------------------------------------------------------
# Types


@settings(max_examples=150, deadline=None)
@given(_all_types)
def test_type_round_trip(t):
    back = serialization.deserialize_type(serialization.serialize_type(t))
    assert back == t
    assert str(back) == str(t)
    assert serialization.serialize_type(back) == serialization.serialize_type(t)


def test_type_round_trip_keeps_containers():
    t = types.to_type({"p": Point(np.float32, np.int32), "q": Pair(np.float32, [np.int8])})
    back = serialization.deserialize_type(serialization.serialize_type(t))
    assert back["p"].container == types.ContainerSpec("namedtuple", Point, "Point")
    assert back["q"].container.cls is Pair
    assert back["q"]["b"].container.kind == "list"


# ----------------------------------------------------------------------------
# Values


@settings(max_examples=150, deadline=None)
@given(_values)
def test_value_round_trip(value):
    back = serialization.deserialize_value(serialization.serialize_value(value))
    assert_same(back, _expected(value))


@settings(max_examples=50, deadline=None)
@given(st.lists(hnp.arrays(np.float32, (2,)), max_size=4))
def test_federated_clients_value_round_trip(client_values):
    t = fl.type_at_clients(fl.TensorType(np.float32, [2]))
    back = serialization.deserialize_value(serialization.serialize_value(client_values, t))
    assert isinstance(back, list)
    assert_same(back, client_values)


def test_struct_of_federated_values_round_trip():
    t = types.StructType(
        [
            ("server", fl.type_at_server(np.int32)),
            ("clients", fl.type_at_clients(Point(np.float32, np.bool_))),
        ]
    )
    value = {"server": 3, "clients": [Point(1.0, True), Point(2.5, False)]}
    back = serialization.deserialize_value(serialization.serialize_value(value, t))
    assert_same(
        back,
        {
            "server": np.int32(3),
            "clients": [Point(np.float32(1.0), np.True_), Point(np.float32(2.5), np.False_)],
        },
    )


def test_sequence_value_round_trip_is_a_list():
    t = fl.SequenceType(fl.TensorType(np.int32, [None]))
    back = serialization.deserialize_value(serialization.serialize_value(iter([[1, 2], [3]]), t))
    assert_same(back, [np.array([1, 2], np.int32), np.array([3], np.int32)])


def test_serialize_value_checks_the_type():
    with pytest.raises(TypeError, match=r"Expected a value of type float32\[3\]"):
        serialization.serialize_value(np.ones(2, np.float32), fl.TensorType(np.float32, [3]))
    with pytest.raises(TypeError, match="one entry per client"):
        serialization.serialize_value(np.ones(2, np.float32), fl.type_at_clients(np.float32))
    with pytest.raises(TypeError, match="serialize the computation"):
        serialization.serialize_value(None, fl.FunctionType(None, np.float32))


def test_class_defined_in_a_function_comes_back_as_a_surrogate_namedtuple():
    Local = collections.namedtuple("Local", ["u", "v"])
    back = serialization.deserialize_value(
        serialization.serialize_value(Local(np.int8(1), np.int8(2)))
    )
    assert type(back) is not Local and type(back).__name__ == "Local"
    assert back._fields == ("u", "v") and back.u == 1


def _header_of(data: bytes, kind: int) -> tuple[dict, list[bytes]]:
    return wire.unpack(data, kind)


def test_class_from_a_module_that_is_not_imported_is_never_imported():
    data = serialization.serialize_value(Point(np.int8(1), np.int8(2)))
    header, blobs = _header_of(data, wire.KIND_VALUE)
    header["types"][0]["container"].update(module="this", qualname="Point")
    assert "this" not in sys.modules  # importing `this` would print the Zen of Python
    back = serialization.deserialize_value(
        wire.pack(wire.KIND_VALUE, header, blobs)
    )
    assert "this" not in sys.modules
    assert type(back) is not Point and back._fields == ("x", "y")


def test_container_with_fields_a_namedtuple_cannot_have_falls_back_to_a_dict():
    data = serialization.serialize_value(Point(np.int8(1), np.int8(2)))
    header, blobs = _header_of(data, wire.KIND_VALUE)
    header["types"][0]["container"].update(module="nowhere", name="class")
    back = serialization.deserialize_value(
        wire.pack(wire.KIND_VALUE, header, blobs)
    )
    assert back == {"x": 1, "y": 2}


# ----------------------------------------------------------------------------
# IR and computations


class Scale:
    """A minimal local computation for a test codec: multiplies a float32 by `factor`."""

    kind = "test_scale"

    def __init__(self, factor: float):
        self.factor = factor
        self.name = f"scale{factor}"
        self.type_signature = types.FunctionType(np.float32, np.float32)

    def invoke(self, arg):
        return np.float32(arg * self.factor)


@pytest.fixture
def scale_codec(monkeypatch):
    codecs = dict(wire._CODECS)
    monkeypatch.setattr(wire, "_CODECS", codecs)
    wire.register_local_codec(
        "test_scale",
        lambda c, ctx: {"factor": c.factor, "blob": ctx.add_blob(b"opaque")},
        lambda meta, ctx: Scale(meta["factor"]) if ctx.blob(meta["blob"]) == b"opaque" else None,
    )


def _every_node_kind() -> ir.Lambda:
    f32 = types.TensorType(np.float32)
    param_t = types.StructType([("x", fl.type_at_clients(np.float32)), ("y", f32)])
    arg = ir.Reference("arg", param_t)
    sum_t = types.FunctionType(fl.type_at_clients(np.float32), fl.type_at_server(np.float32))
    value_t = types.FunctionType(f32, fl.type_at_server(np.float32))
    scale = ir.Local(Scale(2.0))
    map_arg_t = types.StructType([scale.type_signature, fl.type_at_clients(np.float32)])
    map_t = types.FunctionType(map_arg_t, fl.type_at_clients(np.float32))
    const = ir.Lambda(None, None, ir.Literal(np.float32(1.5), f32))
    locals_ = [
        ("x", ir.Selection(arg, "x")),
        (
            "scaled",
            ir.Call(
                ir.Intrinsic("federated_map", map_t),
                ir.Struct(
                    [(None, scale), (None, ir.Reference("x", fl.type_at_clients(np.float32)))]
                ),
            ),
        ),
        (
            "total",
            ir.Call(
                ir.Intrinsic("federated_sum", sum_t),
                ir.Reference("scaled", fl.type_at_clients(np.float32)),
            ),
        ),
        (
            "y_at_server",
            ir.Call(ir.Intrinsic("federated_value_at_server", value_t), ir.Selection(arg, 1)),
        ),
        ("c", ir.Call(const)),
        ("p", ir.PlacementLiteral(fl.CLIENTS)),
        # A lambda, so the reference runtime never resolves the data.
        ("d", ir.Lambda(None, None, ir.Data("store://round/7", types.SequenceType(f32)))),
        (
            "lit",
            ir.Literal(
                np.arange(6, dtype=np.int32).reshape(2, 3), types.TensorType(np.int32, [2, 3])
            ),
        ),
    ]
    result = ir.Struct(
        [
            ("total", ir.Reference("total", fl.type_at_server(np.float32))),
            ("y", ir.Reference("y_at_server", fl.type_at_server(np.float32))),
            ("c", ir.Reference("c", f32)),
        ]
    )
    return ir.Lambda("arg", param_t, ir.Block(locals_, result))


def test_every_ir_node_kind_round_trips(scale_codec):
    lam = _every_node_kind()
    comp = fl.Computation.from_bytes(serialization.serialize_computation(_IR(lam)))
    kinds = {type(n).__name__ for n in ir.walk(comp.ir)}
    assert kinds == {
        "Lambda",
        "Block",
        "Reference",
        "Selection",
        "Call",
        "Struct",
        "Intrinsic",
        "Local",
        "Literal",
        "PlacementLiteral",
        "Data",
    }
    assert str(comp.ir) == str(lam)
    assert comp.type_signature == lam.type_signature
    assert comp.name == "every_node" and comp.parameter_names == ("x", "y")
    result = comp([1.0, 2.0], 3.0)
    assert result == {"total": np.float32(6.0), "y": np.float32(3.0), "c": np.float32(1.5)}


def _IR(lam):
    return computation.IRComputation(lam, "every_node", ("x", "y"))


def test_traced_computation_round_trips_and_runs():
    @fl.federated_computation(fl.type_at_clients(np.float32), fl.type_at_server(np.float32))
    def weighted(values, w):
        return (
            fl.federated_mean(values),
            fl.federated_broadcast(w),
            fl.federated_value(np.int32(3), fl.SERVER),
        )

    back = fl.Computation.from_bytes(weighted.to_bytes())
    assert back.compact_str() == weighted.compact_str()
    assert back.type_signature == weighted.type_signature
    assert_same(back([1.0, 2.0], 4.0), weighted([1.0, 2.0], 4.0))


def _repack(data: bytes, edit) -> bytes:
    header, blobs = _header_of(data, wire.KIND_COMPUTATION)
    edit(header)
    return wire.pack(wire.KIND_COMPUTATION, header, blobs)


def _traced() -> bytes:
    @fl.federated_computation(fl.type_at_clients(np.float32))
    def mean(values):
        return fl.federated_mean(values)

    return mean.to_bytes()


def _intrinsic_nodes(node: object) -> list[dict]:
    found = []
    if isinstance(node, dict):
        if node.get("node") == "intrinsic":
            found.append(node)
        for v in node.values():
            found += _intrinsic_nodes(v)
    elif isinstance(node, list):
        for v in node:
            found += _intrinsic_nodes(v)
    return found


def test_unknown_intrinsic_uri_is_rejected():
    def edit(header):
        _intrinsic_nodes(header["ir"])[0]["uri"] = "federated_exfiltrate"

    with pytest.raises(
        serialization.SerializationError, match=r"an intrinsic in .*found 'federated_exfiltrate'"
    ):
        fl.Computation.from_bytes(_repack(_traced(), edit))


def test_intrinsic_with_a_wrong_type_is_rejected():
    def edit(header):
        _intrinsic_nodes(header["ir"])[0]["uri"] = "federated_sum"  # mean -> sum: same type
        _intrinsic_nodes(header["ir"])[0]["uri"] = "federated_broadcast"

    with pytest.raises(serialization.SerializationError, match="federated_broadcast expects"):
        fl.Computation.from_bytes(_repack(_traced(), edit))


def test_unbound_reference_is_rejected():
    def edit(header):
        header["ir"]["parameter"] = "renamed"

    with pytest.raises(
        serialization.SerializationError, match=r"reference 'arg' .* to be bound, found unbound"
    ):
        fl.Computation.from_bytes(_repack(_traced(), edit))


def test_ill_typed_ir_is_rejected():
    def edit(header):  # the parameter becomes int32; federated_mean cannot take it
        int32 = {"t": "tensor", "dtype": "int32", "shape": []}
        header["types"][header["ir"]["parameter_type"]] = int32

    with pytest.raises(serialization.SerializationError, match="IR that type-checks"):
        fl.Computation.from_bytes(_repack(_traced(), edit))


def test_unknown_local_codec_kind_is_rejected(scale_codec):
    data = serialization.serialize_computation(_IR(_every_node_kind()))

    def edit(header):
        header["locals"][0]["kind"] = "torch"

    with pytest.raises(
        serialization.SerializationError, match=r"found 'torch'. Import the backend"
    ):
        fl.Computation.from_bytes(_repack(data, edit))


def test_serializing_a_local_computation_without_a_codec_fails():
    with pytest.raises(serialization.SerializationError, match="register_local_codec"):
        serialization.serialize_computation(_IR(_every_node_kind()))


# ----------------------------------------------------------------------------
# Malformed bytes


def _value_bytes() -> bytes:
    return serialization.serialize_value({"w": np.arange(4, dtype=np.float32), "n": np.int32(2)})


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_truncation_is_rejected(data):
    full = _value_bytes()
    cut = data.draw(st.integers(0, len(full) - 1))
    with pytest.raises(serialization.SerializationError, match="Expected"):
        serialization.deserialize_value(full[:cut])


def test_corrupted_bytes_fail_the_checksum():
    full = bytearray(_value_bytes())
    full[-10] ^= 0xFF
    with pytest.raises(serialization.SerializationError, match="truncated or corrupted data"):
        serialization.deserialize_value(bytes(full))


def test_future_version_is_rejected_with_a_fix():
    full = bytearray(_value_bytes())
    struct.pack_into("<H", full, 4, wire.FORMAT_VERSION + 1)
    with pytest.raises(
        serialization.SerializationError, match=r"format version .* upgrade fedlang"
    ):
        serialization.deserialize_value(bytes(full))


def test_wrong_magic_and_wrong_kind_are_rejected():
    with pytest.raises(serialization.SerializationError, match="starting with b'FEDL', found b'PK"):
        serialization.deserialize_value(b"PK\x03\x04" + _value_bytes()[4:])
    with pytest.raises(
        serialization.SerializationError, match=r"a type \(kind 1\), found a value \(kind 2\)"
    ):
        serialization.deserialize_type(_value_bytes())
    with pytest.raises(TypeError, match="Expected bytes"):
        serialization.deserialize_value("FEDL")


def _with_header(header: dict, blobs: list[bytes], kind: int = wire.KIND_VALUE) -> bytes:
    head = json.dumps({**header, "blobs": len(blobs)}).encode()
    body = wire.PREFIX.pack(b"FEDL", 1, kind, len(head)) + head
    body += b"".join(struct.pack("<Q", len(b)) + b for b in blobs)
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("header", "blobs", "message"),
    [
        ({"types": [{"t": "tensor", "dtype": "object", "shape": []}], "type": 0}, [], "a dtype in"),
        (
            {"types": [{"t": "tensor", "dtype": "int32", "shape": []}], "type": 3},
            [],
            "a type index",
        ),
        ({"types": [{"t": "code", "src": "import os"}], "type": 0}, [], "a type tag"),
        (
            {
                "types": [{"t": "tensor", "dtype": "int32", "shape": [2]}],
                "type": 0,
                "value": {"dtype": "int32", "shape": [2], "blob": 0},
            },
            [b"1234"],
            "8 bytes for a int32",
        ),
        (
            {
                "types": [{"t": "tensor", "dtype": "int32", "shape": [2]}],
                "type": 0,
                "value": {"dtype": "float32", "shape": [2], "blob": 0},
            },
            [b"12345678"],
            r"a tensor of type int32\[2\], found float32\[2\]",
        ),
        (
            {
                "types": [{"t": "tensor", "dtype": "int32", "shape": []}],
                "type": 0,
                "value": {"dtype": "int32", "shape": [], "blob": 1},
            },
            [b"1234"],
            "a blob index",
        ),
        (
            {
                "types": [
                    {
                        "t": "struct",
                        "fields": [
                            ["a", {"t": "tensor", "dtype": "int8", "shape": []}],
                            ["a", {"t": "tensor", "dtype": "int8", "shape": []}],
                        ],
                    }
                ],
                "type": 0,
            },
            [],
            "unique",
        ),
        ({"types": [], "type": 0, "blobs": 1}, [], "blob"),
        ([1, 2], [], "a JSON object as the header"),
    ],
)
def test_malformed_headers_are_rejected(header, blobs, message):
    if isinstance(header, list):
        head = json.dumps(header).encode()
        body = wire.PREFIX.pack(b"FEDL", 1, 2, len(head)) + head
        data = body + struct.pack("<I", zlib.crc32(body))
    elif "blobs" in header:
        head = json.dumps({**header, "blobs": 1}).encode()
        body = wire.PREFIX.pack(b"FEDL", 1, 2, len(head)) + head
        data = body + struct.pack("<I", zlib.crc32(body))
    else:
        data = _with_header(header, blobs)
    with pytest.raises(serialization.SerializationError, match=message):
        serialization.deserialize_value(data)


def test_deeply_nested_header_is_rejected_cleanly():
    deep = '{"t":"sequence","element":' * 100_000 + '{"t":"placement"}' + "}" * 100_000
    head = ('{"blobs":0,"type":0,"types":[' + deep + "]}").encode()
    body = wire.PREFIX.pack(b"FEDL", 1, wire.KIND_TYPE, len(head)) + head
    data = body + struct.pack("<I", zlib.crc32(body))
    with pytest.raises(serialization.SerializationError, match="Expected"):
        serialization.deserialize_type(data)


def test_a_value_is_written_and_read_without_copying_its_tensors_when_asked():
    x = np.arange(1000, dtype=np.float32).reshape(10, 100)
    t = fl.to_type(fl.TensorType(np.float32, [10, 100]))
    data = serialization.serialize_value(x, t)
    viewed = serialization.deserialize_value(data, expected_type=t, copy=False)
    copied = serialization.deserialize_value(data, expected_type=t)
    np.testing.assert_array_equal(viewed, x)
    np.testing.assert_array_equal(copied, x)
    frame = np.frombuffer(data, np.uint8)
    assert np.shares_memory(viewed, frame) and not viewed.flags.writeable  # a view of bytes
    assert not np.shares_memory(copied, frame) and copied.flags.writeable
    parts = wire.pack_parts(wire.KIND_VALUE, {"types": [], "type": 0}, [memoryview(x).cast("B")])
    assert any(isinstance(p, memoryview) and np.shares_memory(np.asarray(p), x) for p in parts)
