"""Long types, readable: TFF's formatted_representation, types in errors, what differs."""

import numpy as np
import pytest

import fedlang as fl
from fedlang.core import type_format, types


def _state_type():
    return types.to_type({
        "weights": {"trainable": {"w": (np.float32, [4, 2])}, "non_trainable": ()},
        "round_num": np.int32,
    })


def test_formatted_representation_is_tffs_layout():
    signature = types.FunctionType(
        types.StructType([("state", types.type_at_server(_state_type())),
                          ("client_data", types.type_at_clients(types.SequenceType(np.float32)))]),
        types.type_at_server(np.float32),
    )
    assert signature.formatted_representation() == """\
(<
  state=<
    weights=<
      trainable=<
        w=float32[4,2]
      >,
      non_trainable=<>
    >,
    round_num=int32
  >@SERVER,
  client_data={sequence<float32>}@CLIENTS
> -> float32@SERVER)"""
    assert types.TensorType(np.int32, [2]).formatted_representation() == "int32[2]"
    assert types.StructType([]).formatted_representation() == "<>"
    assert types.to_type([np.int32, np.float32]).formatted_representation() == "<\n  int32,\n  float32\n>"


def test_a_computations_type_signature_has_it():
    @fl.federated_computation(fl.type_at_server(_state_type()))
    def identity(state):
        return state

    text = identity.type_signature.formatted_representation()
    assert text.startswith("(<\n  weights=<\n") and text.endswith(">@SERVER)")
    assert "\n".join(line.strip() for line in text.splitlines()).replace("\n", "") == str(
        identity.type_signature)


def test_for_message_keeps_short_types_on_one_line():
    assert type_format.for_message(types.TensorType(np.float32, [3])) == "float32[3]"
    long = types.to_type({f"field_{i}": (np.float32, [10, 10]) for i in range(10)})
    assert len(str(long)) > type_format.SHORT
    assert type_format.for_message(long) == "\n" + "\n".join(
        "    " + line for line in long.formatted_representation().splitlines())


def test_difference_names_the_first_place_types_part():
    a = types.type_at_server(_state_type())
    b = types.type_at_server(types.to_type({
        "weights": {"trainable": {"w": (np.float32, [4, 3])}, "non_trainable": ()},
        "round_num": np.int32,
    }))
    assert type_format.difference(a, b) == "at .weights.trainable.w: expected float32[4,2], found float32[4,3]"
    assert type_format.difference(a, a) is None
    assert type_format.difference(
        types.to_type({"a": np.int32}), types.to_type({"b": np.int32})
    ) == "at [0]: expected a field named 'a', found 'b'"
    assert type_format.difference(
        types.to_type({"a": np.int32}), types.to_type({"a": np.int32, "b": np.int32})
    ) == "at the top: expected 1 fields ['a'], found 2 ['a', 'b']"


def test_a_long_argument_type_error_is_multi_line_and_says_what_differs():
    # One line of over 1,000 characters before.
    wide = {f"layer_{i}": {"kernel": (np.float32, [64, 64]), "bias": (np.float32, [64])}
            for i in range(24)}

    @fl.federated_computation(fl.type_at_server(types.to_type(wide)))
    def consume(weights):
        return weights

    wrong = dict(wide, layer_7={"kernel": (np.float32, [64, 32]), "bias": (np.float32, [64])})

    with pytest.raises(TypeError) as raised:
        @fl.federated_computation(fl.type_at_server(types.to_type(wrong)))
        def caller(weights):
            return consume(weights)

    message = str(raised.value)
    assert len(str(types.to_type(wide))) > 1000
    assert max(len(line) for line in message.splitlines()) < 120
    assert "at .layer_7.kernel: expected float32[64,64], found float32[64,32]" in message


def test_a_type_string_is_answered_with_the_spec_to_write():
    with pytest.raises(TypeError, match=r"SequenceType\(np.float32\) for sequence<float32> \(TFF's float32\*\)"):
        fl.to_type("float32*")
    with pytest.raises(TypeError, match=r"\(np.float32, \[None, 784\]\) for float32\[\?,784\]"):
        fl.to_type("float32[?,784]")
