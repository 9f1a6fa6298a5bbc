import struct

import numpy as np
import pytest

from fedlang.deploy.secagg import SecAggError, Segment, messages, wire


def test_a_frame_round_trips_with_its_header_and_blobs():
    data = wire.encode(wire.SHARES, {"round": "ab", "client": "c", "to": ["x"]}, [b"\x01" * 94])
    msg = wire.decode(data, wire.SHARES)
    assert msg.header == {"round": "ab", "client": "c", "to": ["x"], "blobs": 1}
    assert msg.blobs == (b"\x01" * 94,)
    assert data[:4] == b"FLSA" and data[4] == wire.WIRE_VERSION and data[5] == wire.SHARES


def test_the_frame_layout_is_the_documented_one():
    data = wire.encode(wire.CONFIG, {}, [b"xyz"])
    head = b'{"blobs":1}'
    assert (
        data
        == b"FLSA"
        + bytes([1, 1])
        + struct.pack("<I", len(head))
        + head
        + struct.pack("<Q", 3)
        + b"xyz"
    )


def test_a_config_message_keeps_large_moduli_exact():
    segments = (Segment(3, 2**64), Segment(0, 2**63 - 25))
    assert messages.read_config(messages.round_config(b"\x07" * 16, segments)) == (
        b"\x07" * 16,
        segments,
    )


def test_masked_vectors_travel_as_the_narrowest_little_endian_integers():
    y = np.array([0, 1, 2**64 - 1], np.uint64)
    data = messages.masked_input(b"r", "c", [y], [Segment(3, 2**64)])
    assert y.astype("<u8").tobytes() in data
    (back,) = messages.read_masked_input(data, b"r", "c", [Segment(3, 2**64)])
    assert back.dtype == np.uint64 and back.tolist() == y.tolist()
    for modulus, width in [(1, 1), (3, 1), (256, 1), (257, 2), (2**32, 4), (2**32 + 1, 8)]:
        assert messages.element_bytes(Segment(1, modulus)) == width
    small = np.array([7, 2**32 - 1], np.uint64)
    data = messages.masked_input(b"r", "c", [small], [Segment(2, 2**32)])
    assert small.astype("<u4").tobytes() in data
    assert (
        messages.read_masked_input(data, b"r", "c", [Segment(2, 2**32)])[0].tolist()
        == small.tolist()
    )


@pytest.mark.parametrize(
    ("mutate", "match"),
    [
        (lambda d: d[:-1], "truncated"),
        (lambda d: d + b"\x00", "1 more bytes"),
        (lambda d: d[:3], "at least 10 bytes"),
        (lambda d: b"XXXX" + d[4:], "starting with b'FLSA'"),
        (lambda d: d[:4] + b"\x02" + d[5:], "wire version 1, found 2"),
        (
            lambda d: d[:5] + bytes([wire.UNMASK]) + d[6:],
            "Expected a shares message, found unmasking",
        ),
        (lambda d: d[:10] + b"[" + d[11:], "JSON"),
        (lambda d: "not bytes", "as bytes, found str"),
    ],
)
def test_malformed_frames_are_rejected_with_clear_errors(mutate, match):
    data = wire.encode(wire.SHARES, {"round": "ab", "client": "c", "to": []}, [b""])
    with pytest.raises(SecAggError, match=match):
        wire.decode(mutate(data), wire.SHARES)


def test_fields_are_checked_by_type_and_messages_by_round_and_client():
    data = messages.shares(b"\x01", "alice", ["bob"], [b"\x00" * messages.CIPHERTEXT_BYTES])
    with pytest.raises(SecAggError, match="for round 02, found one for round 01"):
        messages.read_shares(data, b"\x02", "alice")
    with pytest.raises(SecAggError, match="for client 'mallory', found one for 'alice'"):
        messages.read_shares(data, b"\x01", "mallory")
    bad = wire.encode(wire.SHARES, {"round": "01", "client": "alice", "to": ["bob", "bob"]}, [b""])
    with pytest.raises(SecAggError, match="distinct client ids"):
        messages.read_shares(bad, b"\x01", "alice")
    bad = wire.encode(wire.SHARES, {"round": "01", "client": "alice", "to": [7]}, [b""])
    with pytest.raises(SecAggError, match="Expected a client id"):
        messages.read_shares(bad, b"\x01", "alice")
    bad = wire.encode(wire.SHARES, {"round": "01", "client": "alice", "to": ["bob"]}, [b"\x00" * 5])
    with pytest.raises(SecAggError, match="of 94 bytes in a shares message, found 5 bytes"):
        messages.read_shares(bad, b"\x01", "alice")
