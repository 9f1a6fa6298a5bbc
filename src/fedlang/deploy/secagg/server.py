"""The server side of SecAgg+: it relays keys and shares, folds masked inputs into a running
sum, and removes the masks at the end; it never holds an individual input.

The server moves through four stages (`Stage`). In each, `request_for(client)` is what a
client fetches, `receive(client, message)` takes its answer, and `advance()` closes the
stage (the deployment decides when: a quorum, a deadline). A client that has not
answered when a stage closes is a dropout from then on. A rejected message raises
`SecAggError` and changes nothing: its sender is simply a dropout unless it sends a
valid one before the stage closes. When too few clients remain for the masks to be
removed, `advance()` fails the round (`Stage.FAILED`) before asking anyone for a share.

`to_bytes()` / `from_bytes()` save and restore the whole state at any point.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from typing import NoReturn

import numpy as np

from fedlang.deploy.secagg import config, crypto, graph, masks, messages, shamir, state

Stage = config.Stage


class SecAggServer:
    """The server of one secure aggregation round.

    Args:
      segments: what each client sums: `Segment(length, modulus)`s (or `(length,
        modulus)` pairs), one per tensor leaf.
      threshold: shares needed to rebuild a client's secrets, among the client and its
        neighbours; default: a strict majority of them (`default_threshold`).
      degree: neighbours per client, even; default `default_degree(n)` (O(log n)); a
        degree >= n - 1 gives the complete graph of the original SecAgg.
      round_id: public, unique per round (default: 16 random bytes); it seeds the
        neighbour graph and is bound into every key and message.

    Raises:
      ValueError: invalid segments, threshold or degree.
    """

    def __init__(
        self,
        segments: Sequence[config.Segment | tuple[int, int]],
        *,
        threshold: int | None = None,
        degree: int | None = None,
        round_id: bytes | None = None,
    ):
        segs = tuple(s if isinstance(s, config.Segment) else config.Segment(*s) for s in segments)
        if threshold is not None and (not isinstance(threshold, int) or threshold < 1):
            raise ValueError(f"Expected a threshold >= 1 (or None), found {threshold!r}.")
        if degree is not None and (not isinstance(degree, int) or degree < 2 or degree % 2):
            raise ValueError(
                f"Expected an even degree >= 2 (or None), found {degree!r}. The neighbour graph "
                "is a Harary graph; use an even number (any degree >= n - 1 is the complete graph)."
            )
        round_id = os.urandom(16) if round_id is None else round_id
        if not isinstance(round_id, bytes) or not 1 <= len(round_id) <= 64:
            raise ValueError(f"Expected a round id of 1 to 64 bytes, found {round_id!r:.40}.")
        self._s = state.ServerState(round_id, segs, threshold, degree)
        self._graph: dict[str, tuple[str, ...]] | None = None
        self._index: dict[str, int] = {}
        self._cache_shared: frozenset[str] | None = None
        self._masked_members: set[str] = set()  # mirrors the state's list, for lookups

    # ------------------------------------------------------------------
    # Saving and restoring

    def to_bytes(self) -> bytes:
        """The whole state (keys, forwarded shares, running sum, revealed shares)."""
        return state.dump(self._s)

    @classmethod
    def from_bytes(cls, data: bytes) -> SecAggServer:
        """A server in the state `to_bytes` saved.

        Raises:
          SecAggError: the bytes are not a valid, consistent server state.
        """
        s = state.load(data)
        clients = set(s.keys)
        if not (
            set(s.shares) <= clients
            and set(s.shared) <= clients
            and set(s.masked) <= set(s.shared)
            and set(s.revealed) <= set(s.masked)
        ):
            raise config.SecAggError(
                "Expected each stage's clients to be among the previous stage's, found a server "
                "state that breaks this (corrupted?)."
            )
        try:
            server = cls(
                s.segments,
                threshold=s.threshold_option,
                degree=s.degree_option,
                round_id=s.round_id,
            )
        except ValueError as e:
            raise config.SecAggError(
                f"Expected a valid server state, found invalid options: {e}"
            ) from e
        server._s = s
        return server

    # ------------------------------------------------------------------
    # What the round is

    @property
    def stage(self) -> Stage:
        return self._s.stage

    @property
    def round_id(self) -> bytes:
        return self._s.round_id

    @property
    def segments(self) -> tuple[config.Segment, ...]:
        return self._s.segments

    @property
    def degree(self) -> int:
        """Neighbours per client (known once stage 1 closes; n - 1 for a complete graph)."""
        return self._s.degree

    @property
    def threshold(self) -> int:
        """Shares needed per secret (known once stage 1 closes)."""
        return self._s.threshold

    @property
    def failure(self) -> str:
        """Why the round failed ("" unless `stage` is FAILED)."""
        return self._s.failure

    def participants(self) -> tuple[str, ...]:
        """The clients that may answer the current stage (in stage 1: those joined so far)."""
        s = self._s
        if s.stage == Stage.ADVERTISE_KEYS:
            return tuple(s.keys)
        if s.stage == Stage.SHARE_KEYS:
            return self._sorted(s.keys)
        if s.stage == Stage.MASKED_INPUT:
            return s.shared
        if s.stage in (Stage.UNMASKING, Stage.DONE):
            return self._sorted(s.masked)
        return ()

    def unmasked_by(self) -> tuple[str, ...]:
        """The clients whose unmasking answers (their shares) arrived."""
        return self._sorted(self._s.revealed)

    def neighbours(self, client_id: str) -> tuple[str, ...]:
        """A client's neighbours (once stage 1 has closed)."""
        return self._neighbours()[client_id]

    # ------------------------------------------------------------------
    # The protocol

    def request_for(self, client_id: str) -> bytes:
        """What `client_id` fetches in the current stage.

        Raises:
          SecAggError: the client is not part of this stage (it dropped out, or joined
            late), or the round is over.
        """
        s = self._s
        if s.stage == Stage.ADVERTISE_KEYS:
            return messages.round_config(s.round_id, s.segments)
        if s.stage in (Stage.DONE, Stage.FAILED) or not self._takes_part(client_id):
            raise config.SecAggError(
                f"Expected a client taking part in stage {s.stage.name}, found {client_id!r:.60}, "
                "which is not (it dropped out, joined late, or the round is over)."
            )
        if s.stage == Stage.SHARE_KEYS:
            keys = [
                messages.NeighbourKeys(v, self._position(v), *s.keys[v])
                for v in self.neighbours(client_id)
            ]
            index = self._position(client_id)
            return messages.share_request(s.round_id, client_id, index, s.threshold, keys)
        if s.stage == Stage.MASKED_INPUT:
            shared = set(s.shared)
            senders = [v for v in self.neighbours(client_id) if v in shared]
            sealed = [self._ciphertext(v, client_id) for v in senders]
            return messages.mask_request(s.round_id, client_id, senders, sealed)
        survived, dropped = self._unmask_lists(client_id)
        return messages.unmask_request(s.round_id, client_id, survived, dropped)

    def receive(self, client_id: str, message: bytes) -> None:
        """Takes a client's answer to the current stage.

        Args:
          client_id: the sender, as the deployment authenticated it; the message must say
            the same.
          message: the bytes the client sent.

        Raises:
          SecAggError: the message is malformed, for another round or client, from a
            client not in this stage, a second answer, or invalid for the stage (a
            reused key, shares for the wrong clients, a vector of the wrong size). The
            state is unchanged.
        """
        s = self._s
        if s.stage in (Stage.DONE, Stage.FAILED):
            raise config.SecAggError(
                f"Expected a round in progress, found it {s.stage.name}; no more messages are taken."
            )
        if s.stage == Stage.ADVERTISE_KEYS:
            self._receive_keys(client_id, message)
            return
        if not self._takes_part(client_id):
            raise config.SecAggError(
                f"Expected a message from a client taking part in stage {s.stage.name}, found one "
                f"from {client_id!r:.60} (it dropped out earlier or never joined)."
            )
        answered = {
            Stage.SHARE_KEYS: s.shares,
            Stage.MASKED_INPUT: self._masked_set(),
            Stage.UNMASKING: s.revealed,
        }[s.stage]
        if client_id in answered:
            raise config.SecAggError(
                f"Expected one answer per client in stage {s.stage.name}, found a second one "
                f"from {client_id!r}; the first one stands."
            )
        if s.stage == Stage.SHARE_KEYS:
            self._receive_shares(client_id, message)
        elif s.stage == Stage.MASKED_INPUT:
            vectors = messages.read_masked_input(message, s.round_id, client_id, s.segments)
            for acc, y, segment in zip(s.sums, vectors, s.segments):
                masks.add_into(acc, y, segment)
            self._masked_set().add(client_id)
            s.masked.append(client_id)
        else:
            survived, seeds, dropped, keys = messages.read_unmask(message, s.round_id, client_id)
            want_survived, want_dropped = self._unmask_lists(client_id)
            if survived != want_survived or dropped != want_dropped:
                raise config.SecAggError(
                    f"Expected shares for exactly the clients asked of {client_id!r} "
                    f"({len(want_survived)} survived, {len(want_dropped)} dropped), found others."
                )
            s.revealed[client_id] = state.Revealed(
                tuple(survived), tuple(seeds), tuple(dropped), tuple(keys)
            )

    def advance(self) -> Stage:
        """Closes the current stage; returns the new one.

        Raises:
          SecAggError: the round fails (too few clients left for the threshold, or
            inconsistent shares); the stage becomes FAILED and nothing more is revealed.
        """
        s = self._s
        if s.stage == Stage.ADVERTISE_KEYS:
            self._close_advertise()
        elif s.stage == Stage.SHARE_KEYS:
            self._close_share_keys()
        elif s.stage == Stage.MASKED_INPUT:
            self._close_masked_input()
        elif s.stage == Stage.UNMASKING:
            self._finish()
        else:
            raise config.SecAggError(f"Expected a round in progress, found it {s.stage.name}.")
        return s.stage

    def result(self) -> list[np.ndarray]:
        """The sum of the surviving clients' inputs, one uint64 array per segment, each value
        in [0, modulus).

        Raises:
          SecAggError: the round has not finished (or failed).
        """
        if self._s.result is None:
            raise config.SecAggError(
                f"Expected a finished round, found it {self._s.stage.name}"
                + (f": {self._s.failure}" if self._s.failure else "; call advance() until DONE.")
            )
        return [v.copy() for v in self._s.result]

    # ------------------------------------------------------------------
    # Stages

    def _receive_keys(self, client_id: str, message: bytes) -> None:
        s = self._s
        enc, mask = messages.read_advertise(message, s.round_id, client_id)
        if client_id in s.keys:
            raise config.SecAggError(
                f"Expected one answer per client in stage ADVERTISE_KEYS, found a second one from "
                f"{client_id!r}; the first one stands."
            )
        crypto.check_public_key(enc, f"{client_id!r}'s encryption key")
        crypto.check_public_key(mask, f"{client_id!r}'s masking key")
        if enc == mask:
            raise config.SecAggError(
                f"Expected two different public keys from {client_id!r}, found the same key twice."
            )
        for other, pair in s.keys.items():
            if enc in pair or mask in pair:
                raise config.SecAggError(
                    f"Expected fresh public keys from {client_id!r}, found a key that {other!r} "
                    "already advertised (a reused key). Rejected."
                )
        s.keys[client_id] = (enc, mask)

    def _close_advertise(self) -> None:
        s = self._s
        n = len(s.keys)
        degree = min(s.degree_option or config.default_degree(n), max(n - 1, 0))
        threshold = s.threshold_option or config.default_threshold(degree)
        if n < threshold:
            self._fail(f"Expected at least {threshold} clients to advertise keys, found {n}.")
        if threshold > degree + 1:
            self._fail(
                f"Expected a threshold of at most {degree + 1} (a client and its {degree} "
                f"neighbours), found {threshold}. Lower the threshold or raise the degree."
            )
        s.degree, s.threshold = degree, threshold
        s.stage = Stage.SHARE_KEYS

    def _receive_shares(self, client_id: str, message: bytes) -> None:
        s = self._s
        receivers, blob = messages.read_shares(message, s.round_id, client_id)
        neighbours = self.neighbours(client_id)
        if sorted(receivers) != sorted(neighbours):
            extra = sorted(set(receivers) - set(neighbours))[:3]
            missing = sorted(set(neighbours) - set(receivers))[:3]
            raise config.SecAggError(
                f"Expected one share for each of {client_id!r}'s {len(neighbours)} neighbours, "
                f"found shares for non-neighbours {extra} and none for {missing}."
            )
        size = messages.CIPHERTEXT_BYTES
        by_receiver = {r: blob[i * size : (i + 1) * size] for i, r in enumerate(receivers)}
        s.shares[client_id] = b"".join(by_receiver[r] for r in neighbours)

    def _close_share_keys(self) -> None:
        s = self._s
        alive = set(s.shares)
        # A client whose shares reached fewer than `threshold` holders could never be
        # unmasked: it is dropped now (its shares are not forwarded), and so on until stable.
        changed = True
        while changed:
            weak = {
                u for u in alive if 1 + sum(v in alive for v in self.neighbours(u)) < s.threshold
            }
            alive -= weak
            changed = bool(weak)
        if len(alive) < s.threshold:
            self._fail(
                f"Expected at least {s.threshold} clients to share their keys (with enough of "
                f"their neighbours doing so too), found {len(alive)}."
            )
        for u in set(s.shares) - alive:
            del s.shares[u]
        s.shared = self._sorted(alive)
        s.sums = masks.zeros(s.segments)
        s.stage = Stage.MASKED_INPUT

    def _close_masked_input(self) -> None:
        s = self._s
        survivors, shared = set(s.masked), set(s.shared)
        if len(survivors) < s.threshold:
            self._fail(
                f"Expected at least {s.threshold} clients to send masked inputs, found "
                f"{len(survivors)}. No shares were requested; nothing is revealed."
            )
        for u in shared:
            holders = sum(v in survivors for v in (u, *self.neighbours(u)))
            needed = u in survivors or any(v in survivors for v in self.neighbours(u))
            if needed and holders < s.threshold:
                what = "self mask" if u in survivors else "pairwise masks (it dropped out)"
                self._fail(
                    f"Expected at least {s.threshold} surviving holders of client {u!r}'s shares "
                    f"to remove its {what}, found {holders}. No shares were requested; nothing is "
                    "revealed."
                )
        s.shares = {}  # forwarded; no longer needed
        s.stage = Stage.UNMASKING

    def _finish(self) -> None:
        s = self._s
        survivors = set(s.masked)
        dropped = [u for u in s.shared if u not in survivors]
        # Who revealed what, per owner: owner -> [(holder index, share)].
        seed_points: dict[str, list[tuple[int, int]]] = {u: [] for u in survivors}
        key_points: dict[str, list[tuple[int, int]]] = {u: [] for u in dropped}
        for holder, r in s.revealed.items():
            x = self._position(holder)
            for owner, y in zip(r.survived, r.seed_shares):
                seed_points[owner].append((x, y))
            for owner, y in zip(r.dropped, r.key_shares):
                key_points[owner].append((x, y))
        needed_keys = {
            v: p for v, p in key_points.items() if any(u in survivors for u in self.neighbours(v))
        }
        for owner, points in [*seed_points.items(), *needed_keys.items()]:
            if len(points) < s.threshold:
                self._fail(
                    f"Expected at least {s.threshold} shares to remove client {owner!r}'s masks, "
                    f"found {len(points)} (too many clients dropped out during unmasking)."
                )
        sums = [masks.Accumulator(v, segment) for v, segment in zip(s.sums, s.segments)]
        for owner in self._sorted(survivors):
            seed = self._rebuild(owner, seed_points[owner])
            for i, acc in enumerate(sums):
                acc.add(seed, i, -1)
        for owner in self._sorted(needed_keys):
            key_bytes = self._rebuild(owner, needed_keys[owner])
            try:
                key = crypto.private_from_bytes(key_bytes)
            except ValueError:
                key = None
            if key is None or crypto.public_bytes(key) != s.keys[owner][1]:
                self._fail(
                    f"Expected shares that rebuild client {owner!r}'s mask key, found a key that "
                    "does not match its public key (a holder sent a wrong share)."
                )
            assert key is not None
            for u in self.neighbours(owner):
                if u not in survivors:
                    continue
                seed = crypto.agree(key, s.keys[u][1], crypto.PAIR_SEED_INFO, s.round_id)
                # u added the mask if its index is lower than the owner's, else subtracted it.
                sign = -1 if self._position(u) < self._position(owner) else 1
                for i, acc in enumerate(sums):
                    acc.add(seed, i, sign)
        s.result, s.sums, s.revealed = [acc.result() for acc in sums], [], {}
        s.stage = Stage.DONE

    # ------------------------------------------------------------------
    # Helpers

    def _rebuild(self, owner: str, points: list[tuple[int, int]]) -> bytes:
        try:
            secret = shamir.reconstruct(points, self._s.threshold)
        except ValueError as e:
            self._fail(f"Expected consistent shares of client {owner!r}'s secrets: {e}")
        if secret >= 1 << (8 * shamir.SECRET_BYTES):
            self._fail(
                f"Expected client {owner!r}'s shares to rebuild a 32-byte secret, found a larger value."
            )
        return secret.to_bytes(shamir.SECRET_BYTES, "big")

    def _fail(self, message: str) -> NoReturn:
        s = self._s
        s.stage, s.failure = Stage.FAILED, f"Secure aggregation round failed: {message}"
        s.shares, s.sums, s.revealed = {}, [], {}
        raise config.SecAggError(s.failure)

    def _neighbours(self) -> dict[str, tuple[str, ...]]:
        if self._graph is None:
            if self._s.stage == Stage.ADVERTISE_KEYS:
                raise config.SecAggError("Expected stage 1 to be closed before neighbours exist.")
            ids = list(self._s.keys)
            self._graph = graph.neighbours(ids, self._s.degree, self._s.round_id)
            self._index = {c: i + 1 for i, c in enumerate(self._sorted(ids))}
        return self._graph

    def _position(self, client_id: str) -> int:
        """The client's Shamir index: 1 + its rank among the round's clients."""
        self._neighbours()
        return self._index[client_id]

    def _takes_part(self, client_id: str) -> bool:
        s = self._s
        if s.stage == Stage.SHARE_KEYS:
            return client_id in s.keys
        if s.stage == Stage.MASKED_INPUT:
            return client_id in self._shared_set()
        if s.stage == Stage.UNMASKING:
            return client_id in self._masked_set()
        return False

    def _shared_set(self) -> frozenset[str]:
        if self._cache_shared is None or len(self._cache_shared) != len(self._s.shared):
            self._cache_shared = frozenset(self._s.shared)
        return self._cache_shared

    def _masked_set(self) -> set[str]:
        if len(self._masked_members) != len(self._s.masked):  # a restored state
            self._masked_members = set(self._s.masked)
        return self._masked_members

    def _ciphertext(self, sender: str, receiver: str) -> bytes:
        i = self.neighbours(sender).index(receiver)
        size = messages.CIPHERTEXT_BYTES
        return self._s.shares[sender][i * size : (i + 1) * size]

    def _unmask_lists(self, client_id: str) -> tuple[list[str], list[str]]:
        survivors, shared = self._masked_set(), self._shared_set()
        near = self._sorted((client_id, *self.neighbours(client_id)))
        survived = [v for v in near if v in survivors]
        dropped = [v for v in near if v in shared and v not in survivors]
        return survived, dropped

    @staticmethod
    def _sorted(ids: Iterable[str]) -> tuple[str, ...]:
        return tuple(sorted(ids, key=lambda c: c.encode()))
