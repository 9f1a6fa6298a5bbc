"""The Python twin of fedlang.js reads and writes the binary value format as fedlang does."""

import collections
import json

import numpy as np
import pytest

from fedlang.core import serialization, structure, types
from fedlang.deploy.browser import runner

Report = collections.namedtuple("Report", ["total", "count"])


def _header(data):
    (length,) = np.frombuffer(data[7:11], "<u4")
    return json.loads(data[11 : 11 + int(length)])


def test_values_are_read_and_written_as_fedlang_serializes_them():
    value = ({"w": np.arange(6, dtype=np.float64).reshape(2, 3), "b": np.float64(1.5)},
             Report(np.array([1, 2], np.int64), np.int64(1)), np.bool_(True))
    data = serialization.serialize_value(value)
    leaves = runner.read_value(data)
    decoded = serialization.deserialize_value(data)
    t = types.infer_value_type(decoded)
    want = structure.flatten(structure.to_internal(decoded, t), t)
    assert len(leaves) == len(want) == 5
    for got, w in zip(leaves, want):
        assert got.dtype == np.asarray(w).dtype
        np.testing.assert_array_equal(got, w)
    assert runner.write_value(_header(data), leaves) == data


def test_a_corrupted_value_is_refused():
    data = bytearray(serialization.serialize_value(np.arange(3, dtype=np.float32)))
    data[-6] ^= 1
    with pytest.raises(ValueError, match="CRC-32"):
        runner.read_value(bytes(data))
