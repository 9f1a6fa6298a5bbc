"""The server's whole state for one round, and its byte form (so a server survives restarts).

The state holds only what the server may see: public keys, encrypted shares it forwards,
the running sum of masked inputs (never an individual masked input), the shares revealed
in unmasking, and the result. It is written as one `wire` frame of kind SERVER_STATE; the
neighbour graph is not stored, since it is a function of the round id and the clients.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from fedlang.deploy.secagg import config, crypto, masks, messages, shamir, wire

_U64 = np.dtype("<u8")


@dataclasses.dataclass(frozen=True)
class Revealed:
    """One client's unmasking answer: self-mask seed shares of survivors, mask key shares of
    dropouts (in the order the server asked for them)."""

    survived: tuple[str, ...]
    seed_shares: tuple[int, ...]
    dropped: tuple[str, ...]
    key_shares: tuple[int, ...]


@dataclasses.dataclass
class ServerState:
    round_id: bytes
    segments: tuple[config.Segment, ...]
    threshold_option: int | None
    degree_option: int | None
    stage: config.Stage = config.Stage.ADVERTISE_KEYS
    keys: dict[str, tuple[bytes, bytes]] = dataclasses.field(default_factory=dict)  # (enc, mask)
    degree: int = 0
    threshold: int = 0
    shares: dict[str, bytes] = dataclasses.field(default_factory=dict)  # sender -> ciphertexts
    shared: tuple[str, ...] = ()  # clients whose shares went out (set when stage 2 closes)
    masked: list[str] = dataclasses.field(default_factory=list)
    sums: list[np.ndarray] = dataclasses.field(default_factory=list)
    revealed: dict[str, Revealed] = dataclasses.field(default_factory=dict)
    result: list[np.ndarray] | None = None
    failure: str = ""


def dump(s: ServerState) -> bytes:
    """The state as bytes (`load` reads them back)."""
    blobs: list[bytes] = [b"".join(enc + mask for enc, mask in s.keys.values())]
    blobs += list(s.shares.values())
    blobs += [v.astype(_U64, copy=False).tobytes() for v in s.sums]
    for r in s.revealed.values():
        blobs.append(b"".join(shamir.encode(y) for y in r.seed_shares + r.key_shares))
    blobs += [v.astype(_U64, copy=False).tobytes() for v in s.result or []]
    header: dict[str, Any] = {
        "round": s.round_id.hex(),
        "segments": [[g.length, str(g.modulus)] for g in s.segments],
        "threshold_option": s.threshold_option,
        "degree_option": s.degree_option,
        "stage": s.stage.name,
        "clients": list(s.keys),
        "degree": s.degree,
        "threshold": s.threshold,
        "share_senders": list(s.shares),
        "shared": list(s.shared),
        "masked": s.masked,
        "has_sums": bool(s.sums),
        "revealed": [[c, list(r.survived), list(r.dropped)] for c, r in s.revealed.items()],
        "has_result": s.result is not None,
        "failure": s.failure,
    }
    return wire.encode(wire.SERVER_STATE, header, blobs)


def load(data: bytes) -> ServerState:
    """Reads a state written by `dump`.

    Raises:
      SecAggError: if the bytes are not a valid server state.
    """
    msg = wire.decode(data, wire.SERVER_STATE)
    round_id, segments = messages.round_field(msg), messages.segments_field(msg)
    stage_name = msg.field("stage", str, "a stage name")
    if stage_name not in config.Stage.__members__:
        raise config.SecAggError(f"Expected a stage name, found {stage_name!r:.40}.")
    s = ServerState(
        round_id,
        segments,
        _optional_int(msg, "threshold_option"),
        _optional_int(msg, "degree_option"),
        config.Stage[stage_name],
    )
    s.degree = msg.field("degree", int, "an integer")
    s.threshold = msg.field("threshold", int, "an integer")
    s.failure = msg.field("failure", str, "a string")
    clients = msg.ids("clients")
    blobs = iter(range(len(msg.blobs)))
    keys = wire.split(
        msg.blob(_next(blobs), None, "public keys"), 2 * crypto.KEY_BYTES, len(clients), "keys"
    )
    s.keys = {c: (k[: crypto.KEY_BYTES], k[crypto.KEY_BYTES :]) for c, k in zip(clients, keys)}
    for c in msg.ids("share_senders"):
        s.shares[c] = msg.blob(_next(blobs), None, "ciphertexts")
    s.shared = tuple(msg.ids("shared"))
    s.masked = msg.ids("masked")
    if msg.field("has_sums", bool, "a boolean"):
        s.sums = [_vector(msg, _next(blobs), g) for g in segments]
    for item in msg.field("revealed", list, "a list of revealed shares"):
        if not (isinstance(item, list) and len(item) == 3):
            raise config.SecAggError(f"Expected [client, survived, dropped], found {item!r:.60}.")
        cid = wire.check_client_id(item[0], "the server state")
        lists = [wire.check_ids(x, "the server state") for x in item[1:]]
        raw = wire.split(
            msg.blob(_next(blobs), None, "shares"),
            shamir.SHARE_BYTES,
            len(lists[0]) + len(lists[1]),
            "shares",
        )
        try:
            ys = [shamir.decode(b) for b in raw]
        except ValueError as e:
            raise config.SecAggError(f"Expected valid shares in the server state: {e}") from e
        s.revealed[cid] = Revealed(
            tuple(lists[0]), tuple(ys[: len(lists[0])]), tuple(lists[1]), tuple(ys[len(lists[0]) :])
        )
    if msg.field("has_result", bool, "a boolean"):
        s.result = [_vector(msg, _next(blobs), g) for g in segments]
    if next(blobs, None) is not None:
        raise config.SecAggError("Expected no more blobs in the server state, found more.")
    return s


def _next(blobs: Any) -> int:
    i = next(blobs, None)
    if i is None:
        raise config.SecAggError("Expected more blobs in the server state, found the end.")
    return i


def _vector(msg: wire.Message, i: int, segment: config.Segment) -> np.ndarray:
    y = np.frombuffer(msg.blob(i, 8 * segment.length, "a vector"), _U64).astype(np.uint64)
    masks.check_residues(y, segment, "a stored sum")
    return y


def _optional_int(msg: wire.Message, key: str) -> int | None:
    value = msg.header.get(key)
    return None if value is None else msg.field(key, int, "an integer or null")
