"""At an edge aggregator: what it mirrors of the root, one row per task (`edge/sync.py`).

A mirrored task is an ordinary task of the edge's store (its clients check in, report
and are folded or stored exactly as at any server), opened with the root's plan (signed
again by the edge) and the edge's seats of the root task; its row here (`kind`, the root
task's id `upstream`, the local task's id `local`) is written in the transaction that
opens it (`record`), so a restarted edge finds every task it mirrors and forwards what
it owes the root.

What the edge forwards is recorded before it is sent, and sent again with the same bytes
until the root answers (the root recognizes a resent upload by its digest):

* a round's partial aggregate is computed from the ended local round (the same bytes
  each time); the root's answer ends the mirror (`finish`: `accepted`, or the refusal
  no retry changes, `late`, `conflict`);
* a session's reports go in batches: `sending` records the last report the next batch
  carries (`sending_through`) before anything is sent; `sent` records that the root took
  it (the reports up to `sending_through` are forwarded, in the transaction that moves
  the local buffer on: `then`); the mirror ends when the root's session does (`finish`).

A mirror is pending while its `outcome` is '' (the root task goes on, or its upload is
not acknowledged yet).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fedlang.deploy import protocol
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib


@dataclasses.dataclass(frozen=True)
class Mirror:
    """A root task (`kind`, `upstream`) and the edge's task that mirrors it (`local`):
    the uploads the root took of it, the last report forwarded, the last of the upload
    being sent (None: none), and how it ended ('' while pending)."""

    kind: protocol.TaskKind
    upstream: int
    local: int
    uploads: int
    forwarded_through: int
    sending_through: int | None
    outcome: str


_FIELDS = "kind, upstream, local, uploads, forwarded_through, sending_through, outcome"


def _mirror_of(row: tuple) -> Mirror:  # type: ignore[type-arg]
    return Mirror(protocol.TaskKind(row[0]), *row[1:])


class Mirrors:
    """The mirrored tasks of an edge's store (see the module docstring)."""

    def __init__(self, store: store_lib.Store):
        self.store = store

    def record(self, tx: sql.Tx, kind: protocol.TaskKind, upstream: int, local: int) -> None:
        """Records, in `tx` (the one opening local task `local`), that it mirrors root
        task `upstream` of `kind`."""
        tx.run("INSERT INTO mirrors (kind, upstream, local, updated) VALUES (?, ?, ?, ?)",
               (kind, upstream, local, self.store.clock()))

    def all(self, pending: bool = False) -> list[Mirror]:
        """The mirrors (`pending`: only those not ended), oldest first."""
        where = " WHERE outcome = ''" if pending else ""
        with self.store.transaction() as tx:
            rows = tx.all(f"SELECT {_FIELDS} FROM mirrors{where} ORDER BY upstream, kind")
        return [_mirror_of(row) for row in rows]

    def get(self, kind: protocol.TaskKind, upstream: int) -> Mirror:
        with self.store.transaction() as tx:
            return self._get(tx, kind, upstream)

    @staticmethod
    def _get(tx: sql.Tx, kind: protocol.TaskKind, upstream: int) -> Mirror:
        return _mirror_of(tx.one(f"SELECT {_FIELDS} FROM mirrors WHERE kind = ? AND upstream = ?",
                                 (kind, upstream)))

    def sending(self, m: Mirror, available: int, most: int) -> Mirror:
        """The mirror with the upload to send: the one being sent, or else a new one of
        at most `most` of the reports up to `available` not forwarded yet (recorded
        before it is sent); its `sending_through` is None when there is nothing to send."""
        with self.store.transaction(write=True) as tx:
            m = self._get(tx, m.kind, m.upstream)
            if m.sending_through is not None or most <= 0:
                return m
            last = min(available, m.forwarded_through + most)
            if last <= m.forwarded_through:
                return m
            tx.run("UPDATE mirrors SET sending_through = ?, updated = ? WHERE kind = ?"
                   " AND upstream = ?", (last, self.store.clock(), m.kind, m.upstream))
            return dataclasses.replace(m, sending_through=last)

    def sent(self, m: Mirror, then: Callable[[sql.Tx, int], None] | None = None) -> None:
        """The upload being sent was taken by the root: the reports up to its
        `sending_through` are forwarded, and `then(tx, through)` runs in the same
        transaction (a session's local buffer moves on)."""
        with self.store.transaction(write=True) as tx:
            m = self._get(tx, m.kind, m.upstream)
            if m.sending_through is None:
                return
            tx.run("UPDATE mirrors SET uploads = uploads + 1, forwarded_through = ?,"
                   " sending_through = NULL, updated = ? WHERE kind = ? AND upstream = ?",
                   (m.sending_through, self.store.clock(), m.kind, m.upstream))
            if then is not None:
                then(tx, m.sending_through)
            tx.count(f"forwarded:{m.kind}")

    def finish(self, m: Mirror, outcome: str, uploads: int = 0) -> None:
        """The mirror ends with `outcome` (why: `accepted`, `late`, `conflict`,
        `closed`, ...), after `uploads` more uploads the root took; what it had not
        forwarded is not forwarded."""
        with self.store.transaction(write=True) as tx:
            tx.run("UPDATE mirrors SET outcome = ?, uploads = uploads + ?, sending_through = NULL,"
                   " updated = ? WHERE kind = ? AND upstream = ?",
                   (outcome, uploads, self.store.clock(), m.kind, m.upstream))
            tx.count(f"mirrors:{outcome}")

    def pinned_key(self, key: bytes) -> bytes:
        """The root's public key this edge pinned (`key`, on first contact)."""
        with self.store.transaction(write=True) as tx:
            tx.run("INSERT INTO meta (key, value) VALUES ('upstream_key', ?)"
                   " ON CONFLICT (key) DO NOTHING", (key,))
            return bytes(tx.one("SELECT value FROM meta WHERE key = 'upstream_key'")[0])
