import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fedlang.simulation.formats import tf_example

int64s = st.lists(st.integers(-(2**63), 2**63 - 1), max_size=20)
floats = st.lists(st.floats(width=32, allow_nan=False), max_size=20)
blobs = st.lists(st.binary(max_size=10), min_size=1, max_size=5)


@settings(max_examples=60, deadline=None)
@given(ints=int64s, fs=floats, bs=blobs, packed=st.booleans())
def test_round_trip(ints, fs, bs, packed):
    blob = tf_example.encode_example(
        {"i": np.array(ints, np.int64), "f": np.array(fs, np.float32), "b": bs}, packed=packed)
    out = tf_example.decode_example(blob)
    assert out["i"].tolist() == ints if ints else len(out["i"]) == 0
    np.testing.assert_array_equal(out["f"], np.array(fs, np.float32))
    assert out["b"] == bs


def test_packed_varints_multi_byte():
    values = [0, 1, 127, 128, 300, 2**35, -1, -(2**63)]
    out = tf_example.decode_example(tf_example.encode_example({"v": np.array(values)}))
    assert out["v"].tolist() == values


def test_known_bytes_from_tensorflow():
    # The bytes TensorFlow writes for an Example with int64 feature 'a' = [1, 2, 3].
    blob = b"\n\x0e\n\x0c\n\x01a\x12\x07\x1a\x05\n\x03\x01\x02\x03"
    assert tf_example.decode_example(blob)["a"].tolist() == [1, 2, 3]


def test_truncated_blob_raises():
    blob = tf_example.encode_example({"x": np.arange(10.0)})
    with pytest.raises(ValueError, match="truncated"):
        tf_example.decode_example(blob[:-3])


def test_unknown_wire_type_raises():
    with pytest.raises(ValueError, match="wire type"):
        tf_example.decode_example(b"\x0b")


def test_encode_rejects_objects():
    with pytest.raises(TypeError, match="feature values"):
        tf_example.encode_example({"x": np.array([object()])})
