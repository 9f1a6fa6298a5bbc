"""Strings as first-class values: types, values, intrinsics that move them, serialization."""

import collections

import numpy as np
import pytest

import fedlang as fl
from fedlang.core import types
from fedlang.simulation import ClientData, Dataset


def test_str_dtype_prints_as_in_tff():
    assert str(fl.TensorType(str)) == "str"
    assert str(fl.TensorType("str", [None])) == "str[?]"
    assert str(fl.to_type({"snippets": str, "n": np.int32})) == "<snippets=str,n=int32>"
    assert str(fl.type_at_clients(str)) == "{str}@CLIENTS"
    # NumPy's fixed-width unicode and StringDType are one type.
    assert fl.to_type(np.array(["a", "bcd"])) == fl.TensorType(str, [2])
    assert fl.TensorType(np.dtypes.StringDType()) == fl.TensorType(str)


def test_tff_greeting_cell():
    @fl.federated_computation
    def hello_world():
        return "Hello, World!"

    @fl.federated_computation
    def hello_at_server():
        return fl.federated_value("Hello, World!", fl.SERVER)

    assert str(hello_world.type_signature) == "( -> str)"
    assert str(hello_at_server.type_signature) == "( -> str@SERVER)"
    for make in (fl.runtime.reference_context, fl.runtime.simulation_context):
        with make():
            assert hello_world() == "Hello, World!"
            assert hello_at_server() == "Hello, World!"


def _movers():
    @fl.federated_computation(fl.type_at_server(str))
    def broadcast(s):
        return fl.federated_broadcast(s)

    @fl.federated_computation(fl.type_at_clients(str), fl.type_at_clients(np.float32))
    def zipped(names, scores):
        return fl.federated_zip({"name": names, "score": scores})

    @fl.federated_computation(fl.type_at_clients(str))
    def at_clients_value(names):
        return names, fl.federated_value("tag", fl.CLIENTS)

    return broadcast, zipped, at_clients_value


@pytest.mark.parametrize("make", ["reference", "simulation"])
def test_strings_move_through_value_broadcast_zip_and_structs(make):
    broadcast, zipped, at_clients = _movers()
    ctx = (
        fl.runtime.reference_context(num_clients=3)
        if make == "reference"
        else fl.runtime.simulation_context(num_clients=3, chunk_size=2, decision_cache=False)
    )
    with ctx:
        assert broadcast("hé") == "hé"
        out = zipped(["a", "bb", "ccc"], [1.0, 2.0, 3.0])
        assert [o["name"] for o in out] == ["a", "bb", "ccc"]
        assert all(type(o["name"]) is str for o in out)
        names, tags = at_clients(["x", "y"])
        assert names == ["x", "y"] and tags == "tag"


def test_strings_are_refused_by_numeric_intrinsics():
    with pytest.raises(TypeError, match="federated_sum"):

        @fl.federated_computation(fl.type_at_clients(str))
        def total(x):
            return fl.federated_sum(x)


def test_numbers_are_not_silently_made_text():
    @fl.federated_computation(fl.type_at_server(str))
    def ident(s):
        return s

    with fl.runtime.reference_context(), pytest.raises(TypeError, match="str"):
        ident(3)
    with fl.runtime.reference_context():
        assert ident(b"bytes are utf-8") == "bytes are utf-8"
        with pytest.raises(TypeError, match="not UTF-8"):
            ident(b"\xff\xfe")


def test_serialization_round_trip_of_strings():
    Row = collections.namedtuple("Row", ["word", "count"])
    value = {"greeting": "Hello, World!", "words": np.array([["é", ""], ["日本", "ab"]]),
             "row": Row("x", np.int32(2))}
    back = fl.deserialize_value(fl.serialize_value(value))
    assert back["greeting"] == "Hello, World!" and type(back["greeting"]) is str
    assert back["words"].tolist() == [["é", ""], ["日本", "ab"]]
    assert back["row"] == Row("x", 2)
    t = fl.to_type({"greeting": str, "words": (str, [2, 2]), "row": Row(str, np.int32)})
    assert fl.deserialize_value(fl.serialize_value(value, t), expected_type=t)["row"].word == "x"
    clients = fl.serialize_value(["a", "b"], fl.type_at_clients(str))
    assert fl.deserialize_value(clients) == ["a", "b"]


def test_untrusted_string_bytes_are_checked():
    data = fl.serialize_value(np.array(["a" * 100, "b" * 100]))
    with pytest.raises(fl.SerializationError, match="at most 150 decoded bytes"):
        fl.deserialize_value(data, max_bytes=150)
    assert fl.deserialize_value(data, max_bytes=300).shape == (2,)
    with pytest.raises(fl.SerializationError, match="a value of type int32"):
        fl.deserialize_value(fl.serialize_value("abc"), expected_type=np.int32)
    with pytest.raises(fl.SerializationError, match="a value of type str"):
        fl.deserialize_value(fl.serialize_value(np.int32(1)), expected_type=str)


def _tamper(data: bytes, old: bytes, new: bytes) -> bytes:
    import struct
    import zlib

    body = data[:-4].replace(old, new)
    return body + struct.pack("<I", zlib.crc32(body))


def test_damaged_string_lengths_and_text_are_refused():
    data = fl.serialize_value("abc")
    # Lengths that do not add up to the text: replace the text blob's content.
    shorter = _tamper(data, b"\x03\x00\x00\x00\x00\x00\x00\x00abc", b"\x02\x00\x00\x00\x00\x00\x00\x00ab")
    with pytest.raises(fl.SerializationError, match="string lengths"):
        fl.deserialize_value(shorter)
    bad_utf8 = _tamper(data, b"abc", b"a\xffc")
    with pytest.raises(fl.SerializationError, match="UTF-8"):
        fl.deserialize_value(bad_utf8)


def test_string_literal_computation_round_trips():
    @fl.federated_computation
    def hello():
        return fl.federated_value("Hello, World!", fl.SERVER)

    from fedlang.core import serialization

    back = serialization.deserialize_computation(serialization.serialize_computation(hello))
    with fl.runtime.reference_context():
        assert back() == "Hello, World!"


def test_shakespeare_style_snippets_element_spec_and_preprocessing():
    # As a TFF user writes it: client datasets of {'snippets': text}, then a
    # preprocessing map to characters ids before the model (here: bytes + lengths).
    snippets = {
        "ROMEO": ["But soft, what light", "through yonder window breaks?"],
        "JULIET": ["O Romeo, Romeo!", "wherefore art thou Romeo?", "Deny thy father"],
    }
    data = ClientData.from_clients_and_fn(
        list(snippets), lambda cid: Dataset.from_tensor_slices({"snippets": snippets[cid]})
    )
    assert str(data.element_spec) == "<snippets=str>"
    ds = data.create_dataset_for_client("JULIET").batch(2)
    assert str(ds.element_spec) == "<snippets=str[?]>"
    assert str(types.SequenceType(ds.element_spec)) == "sequence<<snippets=str[?]>>"

    from fedlang.backends.jax import strings

    def to_ids(element):
        encoded = strings.encode(element["snippets"], max_len=16)
        return {"chars": encoded.bytes.astype(np.int32), "length": encoded.lengths}

    batches = list(ds.map(to_ids))
    assert batches[0]["chars"].shape == (2, 16)
    assert strings.decode(batches[0]["chars"].astype(np.uint8), batches[0]["length"]).tolist() == [
        "O Romeo, Romeo!", "wherefore art th"]

    @fl.jax_computation(types.SequenceType({"chars": (np.int32, [None, 16]), "length": (np.int32, [None])}))
    def count_chars(dataset):
        return dataset.reduce(np.int32(0), lambda total, b: total + b["length"].sum())

    @fl.federated_computation(fl.type_at_clients(count_chars.type_signature.parameter))
    def total_chars(datasets):
        return fl.federated_sum(fl.federated_map(count_chars, datasets))

    clients = [list(data.create_dataset_for_client(c).batch(2).map(to_ids)) for c in snippets]
    expected = sum(min(len(s.encode()), 16) for c in snippets for s in snippets[c])
    for make in (fl.runtime.reference_context, fl.runtime.simulation_context):
        with make():
            assert total_chars(clients) == expected


def test_string_datasets_move_through_computations():
    @fl.federated_computation(fl.type_at_clients(types.SequenceType(str)))
    def ident(datasets):
        return datasets

    with fl.runtime.reference_context():
        out = ident([["a", "b"], ["c"]])
    assert [list(d) for d in out] == [["a", "b"], ["c"]]
