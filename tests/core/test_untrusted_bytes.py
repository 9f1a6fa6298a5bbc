"""Untrusted bytes never crash, hang or lie: values, types and signed envelopes."""

import contextlib
import json
import struct
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedlang as fl
from fedlang.core import serialization, signing, wire


def _repack(header, blobs, kind=wire.KIND_VALUE):
    return wire.pack(kind, header, blobs)


def _sequence_of_shared_blob(n: int, size: int) -> bytes:
    """A value whose `n` sequence elements all reference one `size`-byte blob."""
    data = serialization.serialize_value(
        [np.zeros(size // 4, np.float32)], fl.SequenceType((np.float32, [size // 4]))
    )
    header, blobs = wire.unpack(data, wire.KIND_VALUE)
    element = header["value"]["elements"][0]
    header["value"]["elements"] = [dict(element) for _ in range(n)]
    return _repack(header, blobs)


def test_a_value_bomb_of_shared_references_is_refused():
    data = _sequence_of_shared_blob(1000, 1 << 20)  # 1.05 MB that would decode to 1,000 MiB
    assert len(data) < 1.2e6
    with pytest.raises(serialization.SerializationError, match="referenced twice"):
        serialization.deserialize_value(data)


def test_a_callers_limit_on_decoded_bytes_is_enforced():
    data = serialization.serialize_value(np.zeros(1000, np.float32))
    assert serialization.deserialize_value(data, max_bytes=4000).shape == (1000,)
    with pytest.raises(serialization.SerializationError, match="at most 3999 decoded bytes"):
        serialization.deserialize_value(data, max_bytes=3999)


def test_an_expected_type_is_checked_before_decoding():
    data = serialization.serialize_value(np.zeros((4, 5), np.float32))
    with pytest.raises(serialization.SerializationError, match=r"a value of type float32\[3\]"):
        serialization.deserialize_value(data, expected_type=(np.float32, [3]))
    assert serialization.deserialize_value(data, expected_type=(np.float32, [4, 5])).shape == (4, 5)


@fl.federated_computation(fl.type_at_clients(np.float32), fl.type_at_server(np.float32))
def _ir_only(x, y):
    z = fl.federated_broadcast(y)
    mean = fl.federated_mean(x)
    total = fl.federated_sum(fl.federated_zip((x, z))[0])
    return mean, total, fl.federated_value(np.int32(3), fl.SERVER)


def _valid_samples() -> list[tuple[object, bytes]]:
    values = [
        {"w": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.int32(7)},
        [np.float32(1.5), np.array([True, False])],
        fl.SparseTensor([[0, 1]], [2.0], (3, 3)),
    ]
    read_value = serialization.deserialize_value
    out = [(read_value, serialization.serialize_value(v)) for v in values]
    clients = fl.type_at_clients(fl.SequenceType(np.float32))
    out.append((read_value, serialization.serialize_value([[np.float32(1)], []], clients)))
    out.append(
        (
            serialization.deserialize_type,
            serialization.serialize_type(fl.type_at_clients({"x": (np.float32, [None, 3])})),
        )
    )
    out.append((serialization.deserialize_computation, _ir_only.to_bytes()))
    return out


_SAMPLES = _valid_samples()


def _fix_crc(body: bytes) -> bytes:
    return body + struct.pack("<I", zlib.crc32(body))


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    sample=st.sampled_from(range(len(_SAMPLES))),
    edits=st.lists(st.tuples(st.integers(0, 1 << 30), st.integers(0, 255)), min_size=1, max_size=4),
    cut=st.integers(0, 64),
)
def test_mutated_values_types_and_ir_raise_only_serialization_errors(sample, edits, cut):
    # CRC-valid mutations (the CRC is recomputed), so they reach every parser.
    read, original = _SAMPLES[sample]
    body = bytearray(original[:-4])
    for pos, byte in edits:
        body[pos % len(body)] = byte
    data = _fix_crc(bytes(body[: len(body) - cut] if cut < len(body) else body))
    with contextlib.suppress(serialization.SerializationError):
        read(data)


@settings(max_examples=150, deadline=None)
@given(st.recursive(st.none() | st.booleans() | st.integers() | st.text(max_size=4),
                    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                    max_leaves=12))
def test_arbitrary_json_headers_raise_only_serialization_errors(header_value):
    for kind in (wire.KIND_VALUE, wire.KIND_TYPE, wire.KIND_COMPUTATION):
        head = json.dumps(header_value).encode()
        body = struct.pack("<4sHBI", b"FEDL", 1, kind, len(head)) + head
        try:
            if kind == wire.KIND_VALUE:
                serialization.deserialize_value(_fix_crc(body))
            elif kind == wire.KIND_TYPE:
                serialization.deserialize_type(_fix_crc(body))
            else:
                serialization.deserialize_computation(_fix_crc(body))
        except serialization.SerializationError:
            pass


# ----------------------------------------------------------------------------
# Signed envelopes


@fl.federated_computation(fl.type_at_clients(np.float32))
def _mean(x):
    return fl.federated_mean(x)


def test_signed_computations_load_only_with_the_pinned_key():
    key, other = signing.generate_key(), signing.generate_key()
    signed = signing.sign(_mean.to_bytes(), key)
    back = fl.Computation.from_bytes(signed, public_key=signing.public_key_bytes(key))
    assert float(back([1.0, 3.0])) == 2.0
    with pytest.raises(signing.SignatureError, match="not by the pinned key"):
        fl.Computation.from_bytes(signed, public_key=other.public_key())
    tampered = bytearray(signed)
    tampered[-10] ^= 1
    with pytest.raises(signing.SignatureError, match="changed after signing"):
        fl.Computation.from_bytes(bytes(tampered), public_key=key.public_key())
    with pytest.raises(signing.SignatureError, match="found unsigned"):
        fl.Computation.from_bytes(_mean.to_bytes(), public_key=key.public_key())
    assert issubclass(signing.SignatureError, serialization.SerializationError)


def test_keys_round_trip_through_raw_bytes():
    key = signing.generate_key()
    again = signing.load_private_key(signing.private_key_bytes(key))
    assert signing.public_key_bytes(again) == signing.public_key_bytes(key)
    with pytest.raises(ValueError, match="32 raw bytes"):
        signing.load_private_key(b"short")
