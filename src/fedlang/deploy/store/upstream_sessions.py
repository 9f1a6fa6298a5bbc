"""At an edge aggregator: which of its buffered sessions mirrors which session of the
root, which of its reports were forwarded, and the batch being sent (`edge/sessions.py`).

A mirrored session is an ordinary buffered session of the edge's store (its clients
check in, train and report exactly as at the root, through the same intake), opened
with the root's plan (signed again by the edge) and the root's current version, and
moved to each newer version the root publishes (`advance`). Its `applied_through` is
the last report forwarded to the root, so its buffer (`buffer_size`, the root's) holds
the reports not forwarded yet, and a client is told to retry (503) when it is full.

Forwarding is exactly once:

1. `next_batch` records the reports the next batch carries (`sending_through`, the last
   of them) before anything is sent;
2. the edge sends that batch (its number: `batches + 1`), again after a restart, with
   the same bytes: the root recognizes a resent batch by its digest;
3. `forwarded` records the root's answer: the reports up to `sending_through` are
   forwarded, in the transaction that moves the local buffer on.
"""

from __future__ import annotations

import dataclasses

from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib


@dataclasses.dataclass(frozen=True)
class SessionMirror:
    """A root session (`upstream`), the edge's session that mirrors it (`session`), the
    batches the root took, the last report forwarded, and the last of the batch being
    sent (None: none)."""

    upstream: int
    session: int
    batches: int
    forwarded_through: int
    sending_through: int | None
    outcome: str


_FIELDS = "upstream, session, batches, forwarded_through, sending_through, outcome"


class UpstreamSessions:
    """The mirrored sessions of an edge's store (see the module docstring)."""

    def __init__(self, sessions: sessions_lib.Sessions):
        self.sessions = sessions
        self.store: store_lib.Store = sessions.store

    def open(self, upstream: int, population: str, plan: str, weights: str, *, version: int,
             buffer_size: int, max_staleness: int) -> sessions_lib.Session:
        """The edge's session mirroring root session `upstream`, opened now if new.
        Idempotent (by request id): a restart between the two steps opens nothing twice."""
        s = self.sessions.create(
            population, plan, weights, version=version, buffer_size=buffer_size,
            max_staleness=max_staleness, request_id=f"upstream-session-{upstream}",
        )
        with self.store.transaction(write=True) as tx:
            tx.run("INSERT INTO upstream_sessions (upstream, session) VALUES (?, ?)"
                   " ON CONFLICT (upstream) DO NOTHING", (upstream, s.id))
        return s

    def mirrors(self, pending: bool = False) -> list[SessionMirror]:
        """The mirrored sessions (`pending`: only those still forwarded), oldest first."""
        where = " WHERE outcome = ''" if pending else ""
        with self.store.transaction() as tx:
            rows = tx.all(f"SELECT {_FIELDS} FROM upstream_sessions{where} ORDER BY upstream")
        return [SessionMirror(*row) for row in rows]

    def mirror(self, upstream: int) -> SessionMirror:
        with self.store.transaction() as tx:
            return _mirror_in(tx, upstream)

    def advance(self, session_id: int, version: int, weights: str) -> None:
        """Moves the edge's session to the root's `version` (its weights by hash): its
        clients' next check-ins get it. Versions may be skipped (the root stepped twice
        between two looks)."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self.sessions.session_in(tx, session_id, lock=True)
            if version <= s.version:
                return
            tx.run("UPDATE buffered_sessions SET version = ?, weights = ?, updated = ?"
                   " WHERE id = ?", (version, weights, now, session_id))
            tx.run("INSERT INTO buffered_versions (session, version, weights, server_state,"
                   " through, published) VALUES (?, ?, ?, '', ?, ?)",
                   (session_id, version, weights, s.applied_through, now))

    def next_batch(self, upstream: int, most: int) -> SessionMirror:
        """The mirror with the batch to send: the one being sent, or else a new one of
        at most `most` reports not forwarded yet (recorded before it is sent); its
        `sending_through` is None when there is nothing to send."""
        with self.store.transaction(write=True) as tx:
            m = _mirror_in(tx, upstream)
            if m.sending_through is not None or most <= 0:
                return m
            s = self.sessions.session_in(tx, m.session, lock=True)
            last = min(s.reports, m.forwarded_through + most)
            if last <= m.forwarded_through:
                return m
            tx.run("UPDATE upstream_sessions SET sending_through = ? WHERE upstream = ?",
                   (last, upstream))
            return dataclasses.replace(m, sending_through=last)

    def forwarded(self, upstream: int, outcome: str = "") -> None:
        """The batch being sent is done: the root took it (`outcome` '') or refused it
        for good (`outcome` names why; the mirror forwards no more). Its reports leave
        the edge's buffer in the same transaction."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            m = _mirror_in(tx, upstream)
            if m.sending_through is None:
                return
            tx.run("UPDATE upstream_sessions SET batches = batches + 1, forwarded_through = ?,"
                   " sending_through = NULL, outcome = ? WHERE upstream = ?",
                   (m.sending_through, outcome, upstream))
            tx.run("UPDATE buffered_sessions SET applied_through = ?, updated = ? WHERE id = ?",
                   (m.sending_through, now, m.session))
            tx.count(f"batches:{outcome or 'accepted'}")

    def end(self, upstream: int, outcome: str) -> None:
        """The root session ended (`outcome`: why): the edge's session closes, and what
        it held and had not forwarded is not forwarded."""
        with self.store.transaction(write=True) as tx:
            row = tx.one("SELECT session FROM upstream_sessions WHERE upstream = ?", (upstream,))
            tx.run("UPDATE upstream_sessions SET outcome = ?, sending_through = NULL"
                   " WHERE upstream = ?", (outcome, upstream))
        if row is not None:
            self.sessions.close(int(row[0]))


def _mirror_in(tx: sql.Tx, upstream: int) -> SessionMirror:
    """The mirror of root session `upstream`, read in `tx`."""
    return SessionMirror(*tx.one(
        f"SELECT {_FIELDS} FROM upstream_sessions WHERE upstream = ?", (upstream,)))
