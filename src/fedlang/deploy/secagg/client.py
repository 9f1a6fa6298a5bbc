"""The client side of SecAgg+: four answers to the server's four requests.

A client lives for one round and keeps its state in memory; a client that dies is a
dropout. Each method takes the server's request (bytes) and returns the client's reply
(bytes); every request is checked, and a request that would make the client reveal more
than the protocol allows (both shares for one neighbour, a second unmasking) is refused
with `SecAggError`.

Example:
  >>> from fedlang.deploy.secagg import server
  >>> srv = server.SecAggServer([config.Segment(3, 256)], threshold=1)
  >>> alice = SecAggClient("alice", srv.request_for("alice"))
  >>> srv.receive("alice", alice.advertise_keys())
  >>> _ = srv.advance()
  >>> srv.receive("alice", alice.share_keys(srv.request_for("alice")))
  >>> _ = srv.advance()
  >>> srv.receive("alice", alice.masked_input(srv.request_for("alice"), [[1, 2, 300]]))
  >>> _ = srv.advance()
  >>> srv.receive("alice", alice.unmask(srv.request_for("alice")))
  >>> _ = srv.advance()
  >>> [v.tolist() for v in srv.result()]
  [[1, 2, 44]]
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence

from fedlang.deploy.secagg import config, crypto, masks, messages, shamir


@dataclasses.dataclass
class _Neighbour:
    index: int
    mask_public: bytes
    share_key: bytes


class SecAggClient:
    """One client's side of one round.

    Args:
      client_id: this client's id (the one the deployment authenticates it as).
      config_message: the server's round configuration (`request_for` in the first stage).

    Raises:
      SecAggError: if the configuration is malformed.
    """

    def __init__(self, client_id: str, config_message: bytes):
        self.client_id = client_id
        self.round_id, self.segments = messages.read_config(config_message)
        self._enc_key = crypto.generate_private_key()
        self._mask_key = crypto.generate_private_key()
        self._self_seed = os.urandom(shamir.SECRET_BYTES)
        self._stage = config.Stage.ADVERTISE_KEYS
        self._index = 0
        self._threshold = 0
        self._neighbours: dict[str, _Neighbour] = {}
        self._own_shares: tuple[int, int] = (0, 0)  # this client's shares of its own secrets
        self._held: dict[str, tuple[int, int]] = {}  # neighbour -> (self-seed, mask-key) share

    def advertise_keys(self) -> bytes:
        """Stage 1: the two public keys."""
        self._expect(config.Stage.ADVERTISE_KEYS, "advertise its keys")
        self._stage = config.Stage.SHARE_KEYS
        return messages.advertise(
            self.round_id,
            self.client_id,
            crypto.public_bytes(self._enc_key),
            crypto.public_bytes(self._mask_key),
        )

    def share_keys(self, request: bytes) -> bytes:
        """Stage 2: Shamir shares of the self-mask seed and the mask key, one per neighbour,
        each encrypted for that neighbour alone."""
        self._expect(config.Stage.SHARE_KEYS, "share its keys")
        req = messages.read_share_request(request, self.round_id, self.client_id)
        own_keys = {crypto.public_bytes(self._enc_key), crypto.public_bytes(self._mask_key)}
        for n in req.neighbours:
            # An invalid key (a low-order point) makes `agree` raise SecAggError when used.
            if {n.enc_public, n.mask_public} & own_keys:
                raise config.SecAggError(
                    f"Expected neighbour {n.client_id!r} to have its own keys, found this "
                    "client's keys (a reused key). Refusing to share."
                )
        xs = [req.index] + [n.index for n in req.neighbours]
        seed_shares = shamir.share(int.from_bytes(self._self_seed, "big"), xs, req.threshold)
        key_shares = shamir.share(
            int.from_bytes(crypto.private_bytes(self._mask_key), "big"), xs, req.threshold
        )
        self._own_shares = (seed_shares[0], key_shares[0])
        ciphertexts = []
        for i, n in enumerate(req.neighbours, start=1):
            key = crypto.agree(self._enc_key, n.enc_public, crypto.SHARE_KEY_INFO, self.round_id)
            self._neighbours[n.client_id] = _Neighbour(n.index, n.mask_public, key)
            plain = shamir.encode(seed_shares[i]) + shamir.encode(key_shares[i])
            ad = crypto.share_associated_data(self.round_id, self.client_id, n.client_id, n.index)
            ciphertexts.append(crypto.encrypt(key, plain, ad))
        self._index, self._threshold = req.index, req.threshold
        self._stage = config.Stage.MASKED_INPUT
        return messages.shares(
            self.round_id, self.client_id, [n.client_id for n in req.neighbours], ciphertexts
        )

    def masked_input(self, request: bytes, values: Sequence[object]) -> bytes:
        """Stage 3: the input, one integer array per segment, under its masks.

        Args:
          request: the server's masked-input request (the shares neighbours sent us).
          values: one integer array per segment, `segment.length` elements each; they are
            reduced modulo the segment's modulus.

        Raises:
          SecAggError: a bad request (then nothing is sent; the client drops out).
          TypeError, ValueError: `values` does not match the segments.
        """
        self._expect(config.Stage.MASKED_INPUT, "send its masked input")
        if len(values) != len(self.segments):
            raise ValueError(
                f"Expected one array per segment ({len(self.segments)}), found {len(values)}."
            )
        inputs = [
            masks.reduce(v, s, f"segment {i}")
            for i, (v, s) in enumerate(zip(values, self.segments))
        ]
        senders, ciphertexts = messages.read_mask_request(request, self.round_id, self.client_id)
        held = {}
        for sender, sealed in zip(senders, ciphertexts):
            n = self._neighbours.get(sender)
            if n is None:
                raise config.SecAggError(
                    f"Expected shares from this client's neighbours only, found one from {sender!r}."
                )
            ad = crypto.share_associated_data(self.round_id, sender, self.client_id, self._index)
            plain = crypto.decrypt(n.share_key, sealed, ad, f"the share from {sender!r}")
            if len(plain) != 2 * shamir.SHARE_BYTES:
                raise config.SecAggError(
                    f"Expected two shares from {sender!r}, found {len(plain)} bytes."
                )
            held[sender] = (
                shamir.decode(plain[: shamir.SHARE_BYTES]),
                shamir.decode(plain[shamir.SHARE_BYTES :]),
            )
        if len(held) + 1 < self._threshold:
            raise config.SecAggError(
                f"Expected at least {self._threshold - 1} neighbours still in the round, found "
                f"{len(held)}; the round cannot finish, so this client sends nothing."
            )
        self._held = held
        sums = [masks.Accumulator(y, segment) for y, segment in zip(inputs, self.segments)]
        for i, acc in enumerate(sums):
            acc.add(self._self_seed, i)
        for sender in senders:
            n = self._neighbours[sender]
            seed = crypto.agree(self._mask_key, n.mask_public, crypto.PAIR_SEED_INFO, self.round_id)
            sign = 1 if self._index < n.index else -1  # the lower index adds, the higher subtracts
            for i, acc in enumerate(sums):
                acc.add(seed, i, sign)
        self._stage = config.Stage.UNMASKING
        vectors = [acc.result() for acc in sums]
        return messages.masked_input(self.round_id, self.client_id, vectors, self.segments)

    def unmask(self, request: bytes) -> bytes:
        """Stage 4: for each neighbour, the share of its self-mask seed (it survived) or of
        its mask key (it dropped), never both; answered once.

        Raises:
          SecAggError: a neighbour listed as both survived and dropped, this client listed
            as dropped, an unknown neighbour, too few survivors, or a second request.
        """
        self._expect(config.Stage.UNMASKING, "reveal shares")
        survived, dropped = messages.read_unmask_request(request, self.round_id, self.client_id)
        both = set(survived) & set(dropped)
        if both:
            raise config.SecAggError(
                f"Expected each neighbour listed as survived or dropped, found {sorted(both)[:5]} "
                "as both. Revealing both shares would unmask their inputs; refusing."
            )
        if self.client_id in dropped or self.client_id not in survived:
            raise config.SecAggError(
                "Expected this client among the survivors (it sent its masked input), found "
                "it missing or listed as dropped. Refusing to reveal its mask key."
            )
        unknown = (set(survived) | set(dropped)) - set(self._held) - {self.client_id}
        if unknown:
            raise config.SecAggError(
                f"Expected only neighbours whose shares this client holds, found {sorted(unknown)[:5]}."
            )
        if len(survived) < self._threshold:
            raise config.SecAggError(
                f"Expected at least {self._threshold} survivors among this client and its "
                f"neighbours, found {len(survived)}; refusing to reveal shares."
            )
        held = {**self._held, self.client_id: self._own_shares}
        self._stage = config.Stage.DONE  # answered once, whatever happens next
        self._held, self._own_shares, self._self_seed = {}, (0, 0), b""
        return messages.unmask(
            self.round_id,
            self.client_id,
            survived,
            [held[c][0] for c in survived],
            dropped,
            [held[c][1] for c in dropped],
        )

    def _expect(self, stage: config.Stage, action: str) -> None:
        if self._stage != stage:
            raise config.SecAggError(
                f"Expected a request for stage {stage.name} before this client can {action}, "
                f"found it at stage {self._stage.name} (each stage is answered once, in order)."
            )
