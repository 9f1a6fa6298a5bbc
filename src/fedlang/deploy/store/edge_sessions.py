"""Buffered sessions through edge aggregators, at the root: the sessions an edge sees,
and the batches of reports it forwards (`edge/sessions.py` is the edge's side).

An edge lists the open buffered sessions of its population (`open_sessions`), joins
one (`join`: it must be open and of the edge's population), mirrors it for its own
clients, and forwards their reports in **batches** (`accept`): batch `b` of edge `e`
to session `s` is one upload of `n` reports, each with the version its client trained.
In one transaction, the session's row locked, the root:

* recognizes a replay by the batch's digest (`admission`: the same bytes again change
  nothing; other bytes for the same batch number are refused, 409), and takes batch
  numbers in order (batch `b` only after `b - 1`);
* refuses a report for a version the session has not published (400) and counts, as
  refused stale (`refused_stale`, `refused:stale`), each report more than
  `max_staleness` versions behind the session's version **now**: exactly what a client
  uploading it straight to the root at this moment would get (410 `stale`);
* takes the batch whole or not at all: when its fresh reports do not fit the free room
  of the buffer (`buffer_size - pending`), it is refused (503 `buffer_full`, nothing
  kept) and the edge sends it again after the driver's next step. So the buffer never
  holds more than `buffer_size` unapplied reports, and every report the root accepts is
  one the driver folds into the current buffer, as for reports straight from clients
  (`store/sessions.py`); an edge asks for at most the room the root shows it;
* otherwise stores each fresh report as its own row of `buffered_reports`, with its
  sequence number, version and staleness (against the session's version now), under
  the client name `edge:EDGE/BATCH.I` (the edge's own client ids stay at the edge), and
  the batch's row in `edge_batches`.

The driver reads the reports one by one as it always does: a report through an edge is
folded exactly as the same report uploaded straight to the root when its batch arrived.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import admission, sql
from fedlang.deploy.store import sessions as sessions_lib
from fedlang.deploy.store import store as store_lib


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch an edge forwarded: its fresh `reports` accepted, `stale` ones refused."""

    session: int
    edge: str
    batch: int
    digest: str
    reports: int
    stale: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def client_name(edge: str, batch: int, index: int) -> str:
    """The client name at the root of report `index` of an edge's batch."""
    return f"edge:{edge}/{batch}.{index}"


class EdgeSessions:
    """Buffered sessions as edges see them (see the module docstring)."""

    def __init__(self, sessions: sessions_lib.Sessions):
        self.sessions = sessions
        self.store: store_lib.Store = sessions.store

    def open_sessions(self, population: str) -> list[sessions_lib.Session]:
        """The open buffered sessions of `population`, oldest first."""
        with self.store.transaction() as tx:
            ids = [row[0] for row in tx.all(
                "SELECT id FROM buffered_sessions WHERE population = ? AND state = ?"
                " ORDER BY id", (population, sessions_lib.OPEN),
            )]
            return [self.sessions.session_in(tx, i) for i in ids]

    def _session(self, tx: sql.Tx, session_id: int, population: str,
                 lock: bool = False) -> sessions_lib.Session:
        s = self.sessions.session_in(tx, session_id, lock)
        if s.population != population:  # as if it did not exist: populations are isolated
            raise protocol.NotFound(f"Expected a session of population {population!r}, found "
                                    f"none numbered {session_id}.")
        return s

    def join(self, edge: str, population: str, session_id: int) -> sessions_lib.Session:
        """The session an edge mirrors for its clients.

        Raises:
          NotFound: no such session in the edge's population.
          Gone: the session is closed.
        """
        with self.store.transaction() as tx:
            s = self._session(tx, session_id, population)
        if s.state != sessions_lib.OPEN:
            raise protocol.Gone(f"Expected an open session, found session {s.id} {s.state}.",
                                reason="closed")
        return s

    def batch(self, session_id: int, edge: str, batch: int) -> Batch | None:
        """A batch the root accepted, or None."""
        with self.store.transaction() as tx:
            row = tx.one("SELECT digest, reports, stale FROM edge_batches"
                         " WHERE session = ? AND edge = ? AND batch = ?", (session_id, edge, batch))
        return None if row is None else Batch(session_id, edge, batch, str(row[0]), *row[1:])

    def _admit(self, tx: sql.Tx, s: sessions_lib.Session, edge: str, batch: int,
               digest: str) -> bool:
        row = tx.one("SELECT digest FROM edge_batches WHERE session = ? AND edge = ? AND batch = ?",
                     (s.id, edge, batch))
        slot = admission.Slot(
            owner=f"session {s.id}", part=f"edge {edge}'s batch {batch}", upload="batch",
            accepted=None if row is None else str(row[0]),
            assignment=admission.Assignment.ASSIGNED,  # an edge of the population (its token)
            open=s.state == sessions_lib.OPEN, state=s.state, reason="closed",
        )
        if admission.admit(slot, digest):
            return True
        last = tx.one("SELECT MAX(batch) FROM edge_batches WHERE session = ? AND edge = ?",
                      (s.id, edge))[0]
        want = 1 if last is None else int(last) + 1
        if batch != want:
            raise protocol.Conflict(
                f"Expected edge {edge}'s batch {want} of session {s.id} (batches come in order), "
                f"found batch {batch}."
            )
        return False

    def precheck(self, session_id: int, edge: str, population: str, batch: int,
                 digest: str) -> bool:
        """Whether this exact batch was accepted before (True: nothing to do); raises
        what `accept` would for a batch the session cannot take."""
        with self.store.transaction() as tx:
            return self._admit(tx, self._session(tx, session_id, population), edge, batch, digest)

    def accept(
        self,
        session_id: int,
        edge: str,
        population: str,
        batch: int,
        digest: str,
        size: int,
        items: Sequence[tuple[int, str, bytes]],
    ) -> bool:
        """Stores the checked reports of a batch, `items` of (version, digest, bytes),
        in one transaction (see the module docstring); False for a replay.

        Raises:
          Conflict, Gone: see `admission.admit`, and a batch out of order.
          BadRequest: a report for a version the session has not published.
          BufferFull: the batch's fresh reports do not fit the buffer's free room.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self._session(tx, session_id, population, lock=True)
            if self._admit(tx, s, edge, batch, digest):
                return False
            for version, _, _ in items:
                if version > s.version:
                    raise protocol.BadRequest(
                        f"Expected reports for versions up to {s.version} (the session's), "
                        f"found one for version {version}."
                    )
            fresh = [(i, item) for i, item in enumerate(items)
                     if s.version - item[0] <= s.max_staleness]
            stale = len(items) - len(fresh)
            if s.pending + len(fresh) > s.buffer_size:
                raise protocol.BufferFull(
                    f"Expected room for {len(fresh)} reports in the buffer of session {s.id}, "
                    f"found {s.buffer_size - s.pending} of {s.buffer_size}; send the batch "
                    "again after the next version."
                )
            for seq, (i, (version, report_digest, data)) in enumerate(fresh, s.reports + 1):
                tx.run(
                    "INSERT INTO buffered_reports (session, seq, client, version, staleness,"
                    " digest, size, data, accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                    (s.id, seq, client_name(edge, batch, i), version, s.version - version,
                     report_digest, len(data), data, now),
                )
            tx.run(
                "UPDATE buffered_sessions SET reports = reports + ?,"
                " refused_stale = refused_stale + ?, updated = ? WHERE id = ?",
                (len(fresh), stale, now, s.id),
            )
            tx.run(
                "INSERT INTO edge_batches (session, edge, batch, digest, size, reports, stale,"
                " accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (s.id, edge, batch, digest, size, len(fresh), stale, now),
            )
            tx.count("reports:accepted", len(fresh))
            tx.count("batches:accepted")
            if stale:
                tx.count("refused:stale", stale)
        return True

    def batches(self, session_id: int) -> list[Batch]:
        """The batches edges forwarded to a session, by edge and number."""
        with self.store.transaction() as tx:
            rows = tx.all("SELECT edge, batch, digest, reports, stale FROM edge_batches"
                          " WHERE session = ? ORDER BY edge, batch", (session_id,))
        return [Batch(session_id, e, b, d, n, t) for e, b, d, n, t in rows]

    def count_refusal(self, reason: str, session_id: int) -> None:
        """Counts a refused batch (`refused:REASON`, and in its session)."""
        self.sessions.count_refusal(reason, session_id)
