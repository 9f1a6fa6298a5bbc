"""The eight protocol messages: how each is written, and read back with every field checked.

Each `read_*` checks the frame, that the message is for this round and from (or for) the
expected client, and the types and sizes of its fields; anything else raises
`SecAggError`. Checks that need the server's state (is this client a neighbour?) are the
server's and the client's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from fedlang.deploy.secagg import config, crypto, masks, shamir, wire

CIPHERTEXT_BYTES = crypto.NONCE_BYTES + 2 * shamir.SHARE_BYTES + crypto.TAG_BYTES


@dataclasses.dataclass(frozen=True)
class NeighbourKeys:
    client_id: str
    index: int
    enc_public: bytes
    mask_public: bytes


@dataclasses.dataclass(frozen=True)
class ShareRequest:
    index: int
    threshold: int
    neighbours: tuple[NeighbourKeys, ...]


# ----------------------------------------------------------------------------
# Server -> client


def round_config(round_id: bytes, segments: Sequence[config.Segment]) -> bytes:
    return wire.encode(
        wire.CONFIG,
        {"round": round_id.hex(), "segments": [[s.length, str(s.modulus)] for s in segments]},
    )


def read_config(data: bytes) -> tuple[bytes, tuple[config.Segment, ...]]:
    msg = wire.decode(data, wire.CONFIG)
    return round_field(msg), segments_field(msg)


def segments_field(msg: wire.Message) -> tuple[config.Segment, ...]:
    """The `segments` field: [[length, "modulus"], ...]."""
    segments = []
    for item in msg.field("segments", list, "a list of [length, modulus] pairs"):
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[1], str)):
            raise config.SecAggError(
                f'Expected a segment as [length, "modulus"], found {item!r:.60}.'
            )
        try:
            segments.append(config.Segment(item[0], int(item[1])))
        except ValueError as e:
            raise config.SecAggError(f"Expected a valid segment, found {item!r:.60}: {e}") from e
    return tuple(segments)


def share_request(
    round_id: bytes, client: str, index: int, threshold: int, neighbours: Sequence[NeighbourKeys]
) -> bytes:
    header = {
        "round": round_id.hex(),
        "client": client,
        "index": index,
        "threshold": threshold,
        "neighbours": [[n.client_id, n.index] for n in neighbours],
    }
    keys = b"".join(n.enc_public + n.mask_public for n in neighbours)
    return wire.encode(wire.SHARE_REQUEST, header, [keys])


def read_share_request(data: bytes, round_id: bytes, client: str) -> ShareRequest:
    msg = _open(data, wire.SHARE_REQUEST, round_id, client)
    index = _positive(msg, "index")
    threshold = _positive(msg, "threshold")
    pairs = msg.field("neighbours", list, "a list of [client id, index] pairs")
    keys = wire.split(
        msg.blob(0, None, "public keys"), 2 * crypto.KEY_BYTES, len(pairs), "key pairs"
    )
    neighbours = []
    for pair, key in zip(pairs, keys):
        if not (isinstance(pair, list) and len(pair) == 2):
            raise config.SecAggError(f"Expected a [client id, index] pair, found {pair!r:.60}.")
        cid = wire.check_client_id(pair[0], "a share-keys request")
        idx = pair[1]
        if not isinstance(idx, int) or isinstance(idx, bool) or idx < 1:
            raise config.SecAggError(f"Expected an index >= 1 for {cid!r}, found {idx!r:.40}.")
        neighbours.append(NeighbourKeys(cid, idx, key[: crypto.KEY_BYTES], key[crypto.KEY_BYTES :]))
    ids = [n.client_id for n in neighbours]
    indices = [index] + [n.index for n in neighbours]
    if client in ids or len(set(ids)) != len(ids) or len(set(indices)) != len(indices):
        raise config.SecAggError(
            "Expected distinct neighbours other than this client, with distinct indices, found "
            "repeated ones."
        )
    if threshold > len(neighbours) + 1:
        raise config.SecAggError(
            f"Expected a threshold of at most {len(neighbours) + 1} (this client and its "
            f"neighbours), found {threshold}."
        )
    return ShareRequest(index, threshold, tuple(neighbours))


def mask_request(
    round_id: bytes, client: str, senders: Sequence[str], ciphertexts: Sequence[bytes]
) -> bytes:
    header = {"round": round_id.hex(), "client": client, "from": list(senders)}
    return wire.encode(wire.MASK_REQUEST, header, [b"".join(ciphertexts)])


def read_mask_request(data: bytes, round_id: bytes, client: str) -> tuple[list[str], list[bytes]]:
    msg = _open(data, wire.MASK_REQUEST, round_id, client)
    senders = msg.ids("from")
    blob = msg.blob(0, None, "ciphertexts")
    return senders, wire.split(blob, CIPHERTEXT_BYTES, len(senders), "encrypted shares")


def unmask_request(
    round_id: bytes, client: str, survived: Sequence[str], dropped: Sequence[str]
) -> bytes:
    header = {
        "round": round_id.hex(),
        "client": client,
        "survived": list(survived),
        "dropped": list(dropped),
    }
    return wire.encode(wire.UNMASK_REQUEST, header)


def read_unmask_request(data: bytes, round_id: bytes, client: str) -> tuple[list[str], list[str]]:
    msg = _open(data, wire.UNMASK_REQUEST, round_id, client)
    return msg.ids("survived"), msg.ids("dropped")


# ----------------------------------------------------------------------------
# Client -> server


def advertise(round_id: bytes, client: str, enc_public: bytes, mask_public: bytes) -> bytes:
    header = {"round": round_id.hex(), "client": client}
    return wire.encode(wire.ADVERTISE, header, [enc_public + mask_public])


def read_advertise(data: bytes, round_id: bytes, sender: str) -> tuple[bytes, bytes]:
    msg = _open(data, wire.ADVERTISE, round_id, sender)
    keys = msg.blob(0, 2 * crypto.KEY_BYTES, "two public keys")
    return keys[: crypto.KEY_BYTES], keys[crypto.KEY_BYTES :]


def shares(
    round_id: bytes, client: str, receivers: Sequence[str], ciphertexts: Sequence[bytes]
) -> bytes:
    header = {"round": round_id.hex(), "client": client, "to": list(receivers)}
    return wire.encode(wire.SHARES, header, [b"".join(ciphertexts)])


def read_shares(data: bytes, round_id: bytes, sender: str) -> tuple[list[str], bytes]:
    """The receivers and their ciphertexts, concatenated (CIPHERTEXT_BYTES each)."""
    msg = _open(data, wire.SHARES, round_id, sender)
    receivers = msg.ids("to")
    blob = msg.blob(0, len(receivers) * CIPHERTEXT_BYTES, "one ciphertext per receiver")
    return receivers, blob


def masked_input(
    round_id: bytes, client: str, vectors: Sequence[np.ndarray], segments: Sequence[config.Segment]
) -> bytes:
    header = {"round": round_id.hex(), "client": client}
    blobs = [v.astype(_element_dtype(s), copy=False).tobytes() for v, s in zip(vectors, segments)]
    return wire.encode(wire.MASKED_INPUT, header, blobs)


def read_masked_input(
    data: bytes, round_id: bytes, sender: str, segments: Sequence[config.Segment]
) -> list[np.ndarray]:
    msg = _open(data, wire.MASKED_INPUT, round_id, sender)
    if len(msg.blobs) != len(segments):
        raise config.SecAggError(
            f"Expected {len(segments)} masked segments, found {len(msg.blobs)}."
        )
    out = []
    for i, s in enumerate(segments):
        dtype = _element_dtype(s)
        what = f"segment {i} ({s.length} values of {dtype.itemsize} bytes)"
        blob = msg.blob(i, dtype.itemsize * s.length, what)
        y = np.frombuffer(blob, dtype).astype(np.uint64)
        masks.check_residues(y, s, f"masked segment {i}")
        out.append(y)
    return out


def element_bytes(segment: config.Segment) -> int:
    """Bytes per value of a segment on the wire: the smallest of 1, 2, 4, 8 that holds
    every residue (so a sum modulo 2**32 travels as 4-byte integers)."""
    return _element_dtype(segment).itemsize


def _element_dtype(segment: config.Segment) -> np.dtype:
    bits = (segment.modulus - 1).bit_length()
    return np.dtype(next(f"<u{w}" for w in (1, 2, 4, 8) if bits <= 8 * w))


def unmask(
    round_id: bytes,
    client: str,
    survived: Sequence[str],
    seed_shares: Sequence[int],
    dropped: Sequence[str],
    key_shares: Sequence[int],
) -> bytes:
    header = {
        "round": round_id.hex(),
        "client": client,
        "survived": list(survived),
        "dropped": list(dropped),
    }
    blobs = [
        b"".join(shamir.encode(y) for y in seed_shares),
        b"".join(shamir.encode(y) for y in key_shares),
    ]
    return wire.encode(wire.UNMASK, header, blobs)


def read_unmask(
    data: bytes, round_id: bytes, sender: str
) -> tuple[list[str], list[int], list[str], list[int]]:
    msg = _open(data, wire.UNMASK, round_id, sender)
    survived, dropped = msg.ids("survived"), msg.ids("dropped")
    seed = wire.split(
        msg.blob(0, None, "self-mask seed shares"), shamir.SHARE_BYTES, len(survived), "shares"
    )
    key = wire.split(
        msg.blob(1, None, "mask key shares"), shamir.SHARE_BYTES, len(dropped), "shares"
    )
    try:
        return survived, [shamir.decode(b) for b in seed], dropped, [shamir.decode(b) for b in key]
    except ValueError as e:
        raise config.SecAggError(f"Expected valid shares, found malformed ones: {e}") from e


# ----------------------------------------------------------------------------


def _open(data: bytes, kind: int, round_id: bytes, client: str) -> wire.Message:
    msg = wire.decode(data, kind)
    found = round_field(msg)
    if found != round_id:
        raise config.SecAggError(
            f"Expected a {wire.KINDS[kind]} message for round {round_id.hex()}, found one for "
            f"round {found.hex()} (a replay from another round?)."
        )
    cid = msg.field("client", str, "a client id")
    if cid != client:
        raise config.SecAggError(
            f"Expected a {wire.KINDS[kind]} message for client {client!r}, found one for {cid!r:.60}."
        )
    return msg


def round_field(msg: wire.Message) -> bytes:
    """The `round` field: the round id, in hex."""
    text = msg.field("round", str, "a round id (hex)")
    try:
        return bytes.fromhex(text)
    except ValueError:
        raise config.SecAggError(f"Expected a round id in hex, found {text!r:.60}.") from None


def _positive(msg: wire.Message, key: str) -> int:
    value = msg.field(key, int, "a positive integer")
    if value < 1:
        raise config.SecAggError(f"Expected a positive integer in field {key!r}, found {value}.")
    return value
