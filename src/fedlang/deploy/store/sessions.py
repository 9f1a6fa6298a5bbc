"""Buffered (asynchronous, FedBuff) sessions in the task store.

A session replaces rounds for a population: the driver publishes model **versions**
(`publish`), and a checking-in client gets the current version's task (the signed
`plans.buffered.BufferedPlan` and that version's weights, by hash). The client trains when
it can and uploads a report for the version it started from. In one transaction the
store then, with the session's row locked:

* returns "replay" for the same bytes again (uploads are idempotent), refuses another
  report for the same (client, version), and refuses a report for a version the client
  was not given;
* refuses a report whose staleness (current version - its version) exceeds the
  session's `max_staleness`, and counts it (the client is told, HTTP 410 `stale`);
* refuses, for now, a report while the current buffer already holds `buffer_size`
  accepted reports the driver has not applied yet (HTTP 503 `buffer_full`: the client
  retries, and its report is then one version staler);
* otherwise stores the report itself, with its sequence number, version and staleness,
  before the client is told it was accepted.

An edge aggregator forwards its clients' reports in **batches** (`accept_many`): batch `b`
of an uploader to session `s` is one upload of `n` reports, each with the version its
client trained, taken in one transaction as the same reports uploaded one by one now
would be, with these differences: a replay is recognized by the batch's digest (other
bytes for the same batch number: 409), batch numbers come in order; each report staler
than `max_staleness` versions **now** is counted as refused stale and not stored, while
the rest are; the batch is taken whole or not at all (503 `buffer_full` when its fresh
reports do not fit the buffer's free room), so the buffer never holds more than
`buffer_size` unapplied reports. Each stored report's client is `UPLOADER/BATCH.I` (an
edge's own client ids stay at the edge); the batch's row is kept in `buffered_batches`.
(`edge/sync.py` explains why an edge forwards the reports themselves, not their sum.)

The driver (`driver.buffered`) reads the accepted reports in sequence order, folds them
into the process's buffer and, when it is full, applies it and publishes the next
version together with the new server state and the last report it folded: reports up
to it are marked applied in the same transaction. So a driver (or server) killed at any
moment restarts from the last published state and folds again exactly the reports
accepted since: none is lost, none is counted twice.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import admission, sql
from fedlang.deploy.store import store as store_lib

OPEN, CLOSED = protocol.SessionState
ASSIGNED = admission.Assignment.ASSIGNED

_FIELDS = (
    "id, population, state, plan, version, weights, server_state, buffer_size, max_staleness,"
    " applied_through, reports, refused_stale, created, updated"
)


@dataclasses.dataclass(frozen=True)
class Session:
    """A buffered session's row."""

    id: int
    population: str
    state: protocol.SessionState
    plan: str  # the blob of the signed BufferedPlan
    version: int  # the current (latest published) model version
    weights: str  # the blob of the current version's weights
    server_state: str  # the blob of the driver's state at this version ('' before the first)
    buffer_size: int
    max_staleness: int
    applied_through: int  # the last report sequence number applied into a version
    reports: int  # reports accepted (the last sequence number)
    refused_stale: int
    created: float
    updated: float

    @property
    def pending(self) -> int:
        """Accepted reports not yet applied (the current buffer's fill)."""
        return self.reports - self.applied_through

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _session_of(row: Any) -> Session:
    return Session(row[0], row[1], protocol.SessionState(row[2]), *row[3:])


@dataclasses.dataclass(frozen=True)
class Report:
    """An accepted report, as the driver reads it."""

    seq: int
    client: str
    version: int
    staleness: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class Batch:
    """A batch of reports an uploader (an edge) forwarded: its fresh `reports` accepted,
    `stale` ones refused."""

    session: int
    client: str
    batch: int
    digest: str
    reports: int
    stale: int


@dataclasses.dataclass(frozen=True)
class BufferedTask:
    """A client's task in a buffered session: train `version` (weights by hash)."""

    session: int
    plan: str
    weights: str
    version: int
    kind: protocol.TaskKind = protocol.TaskKind.BUFFERED


class Sessions:
    """The buffered sessions of a task store (see the module docstring)."""

    def __init__(self, store: store_lib.Store):
        self.store = store

    def _session(self, tx: sql.Tx, session_id: int, lock: bool = False) -> Session:
        row = self.store.task_row(tx, "buffered_sessions", _FIELDS, session_id, "session", lock)
        return _session_of(row)

    def session_in(self, tx: sql.Tx, session_id: int, lock: bool = False) -> Session:
        """A session's row read in `tx` (`lock`: locked until `tx` ends, as its writers
        lock it). Raises NotFound."""
        return self._session(tx, session_id, lock)

    def session(self, session_id: int) -> Session:
        """A session's current row.

        Raises:
          NotFound: no such session.
        """
        with self.store.transaction() as tx:
            return self._session(tx, session_id)

    def sessions(self, limit: int = 5) -> list[Session]:
        """The latest sessions, newest first."""
        with self.store.transaction() as tx:
            rows = tx.all(
                f"SELECT {_FIELDS} FROM buffered_sessions ORDER BY id DESC LIMIT ?", (limit,)
            )
        return [_session_of(row) for row in rows]

    # -- the driver

    def create(
        self,
        population: str,
        plan: str,
        weights: str,
        *,
        version: int,
        buffer_size: int,
        max_staleness: int,
        request_id: str | None = None,
        on_create: Callable[[sql.Tx, Session], None] | None = None,
    ) -> Session:
        """Opens a session of `population` at model `version` with `weights` (a blob), or
        returns the session made for `request_id`. `on_create(tx, session)` writes, in
        the same transaction, what else the new session needs (an edge's mirror row).

        Raises:
          NotFound: no such population.
          Conflict: the population has an open session already (close it first).
          BadRequest: a buffer size below 1 or a negative staleness bound.
        """
        if not (isinstance(buffer_size, int) and buffer_size >= 1):
            raise protocol.BadRequest(
                f"Expected a buffer size of at least 1 report, found {buffer_size!r}."
            )
        if not (isinstance(max_staleness, int) and max_staleness >= 0):
            raise protocol.BadRequest(
                f"Expected a maximum staleness of at least 0 versions, found {max_staleness!r}."
            )
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            session_id, new = self.store.new_id(tx, "buffered_sessions", population, request_id)
            if not new:
                return self._session(tx, session_id)
            open_id = tx.one(
                "SELECT id FROM buffered_sessions WHERE population = ? AND state = ?",
                (population, OPEN),
            )
            if open_id is not None:
                raise protocol.Conflict(
                    f"Expected no open session for population {population!r}, found session "
                    f"{open_id[0]}; resume it, or close it (POST /v1/admin/sessions/"
                    f"{open_id[0]}/close) first."
                )
            tx.run(
                "INSERT INTO buffered_sessions (id, population, state, plan, version, weights,"
                " buffer_size, max_staleness, request_id, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, population, OPEN, plan, version, weights, buffer_size,
                 max_staleness, request_id, now, now),
            )
            tx.run(
                "INSERT INTO buffered_versions (session, version, weights, server_state, through,"
                " published) VALUES (?, ?, ?, '', 0, ?)",
                (session_id, version, weights, now),
            )
            tx.count("sessions:opened")
            if on_create is not None:
                on_create(tx, self._session(tx, session_id))
            return self._session(tx, session_id)

    def reports(self, session_id: int, after: int, limit: int = 1000) -> list[Report]:
        """The accepted reports with sequence numbers above `after`, in order."""
        with self.store.transaction() as tx:
            rows = tx.all(
                "SELECT seq, client, version, staleness, data FROM buffered_reports"
                " WHERE session = ? AND seq > ? ORDER BY seq LIMIT ?",
                (session_id, after, limit),
            )
        return [Report(s, c, v, t, bytes(d)) for s, c, v, t, d in rows]

    def publish(
        self, session_id: int, version: int, weights: str, server_state: str, through: int
    ) -> Session:
        """Publishes model `version` (its weights and the driver's state, by hash), the
        buffer of the reports up to sequence number `through` applied. Idempotent: a
        version already published returns the session unchanged.

        Raises:
          Conflict: `version` is not the next version, or `through` is not a report
            accepted after the last applied one.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self._session(tx, session_id, lock=True)
            done = tx.one(
                "SELECT through FROM buffered_versions WHERE session = ? AND version = ?",
                (session_id, version),
            )
            if done is not None and done[0] == through:
                return s
            if version != s.version + 1:
                raise protocol.Conflict(
                    f"Expected version {s.version + 1} (the next of session {session_id}), found "
                    f"{version}; a driver resumes from the session's published state."
                )
            if not s.applied_through <= through <= s.reports:
                raise protocol.Conflict(
                    f"Expected the buffer to end at a report accepted since the last version "
                    f"(sequence {s.applied_through} to {s.reports}), found {through}."
                )
            tx.run(
                "UPDATE buffered_reports SET applied = ? WHERE session = ? AND seq > ? AND seq <= ?",
                (version, session_id, s.applied_through, through),
            )
            tx.run(
                "UPDATE buffered_sessions SET version = ?, weights = ?, server_state = ?,"
                " applied_through = ?, updated = ? WHERE id = ?",
                (version, weights, server_state, through, now, session_id),
            )
            tx.run(
                "INSERT INTO buffered_versions (session, version, weights, server_state, through,"
                " published) VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, version, weights, server_state, through, now),
            )
            tx.count("sessions:versions")
            return self._session(tx, session_id)

    def close(self, session_id: int) -> Session:
        """Closes a session: its clients get no more tasks, its reports are refused."""
        with self.store.transaction(write=True) as tx:
            self._session(tx, session_id, lock=True)
            tx.run("UPDATE buffered_sessions SET state = ?, updated = ? WHERE id = ?",
                   (CLOSED, self.store.clock(), session_id))
            return self._session(tx, session_id)

    # -- clients

    def checkin(self, client_id: str, population: str) -> BufferedTask | None:
        """The current version's task for the client, or None (no open session, or the
        client already reported for the current version: it waits for the next)."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            row = tx.one(
                "SELECT id FROM buffered_sessions WHERE population = ? AND state = ?"
                " ORDER BY id DESC LIMIT 1",
                (population, OPEN),
            )
            if row is None:
                return None
            s = self._session(tx, row[0])
            held = tx.one(
                "SELECT state FROM buffered_tasks WHERE session = ? AND client = ? AND version = ?",
                (s.id, client_id, s.version),
            )
            if held is not None and held[0] != ASSIGNED:
                return None
            # (a concurrent check-in of the same client inserts nothing)
            if held is None and tx.run(
                "INSERT INTO buffered_tasks (session, client, version, state, assigned)"
                " VALUES (?, ?, ?, ?, ?) ON CONFLICT DO NOTHING",
                (s.id, client_id, s.version, ASSIGNED, now),
            ):
                tx.count("assignments")
            return BufferedTask(s.id, s.plan, s.weights, s.version)

    def precheck(self, session_id: int, client_id: str, version: int, digest: str) -> bool:
        """Whether this exact report was accepted before (True: nothing to do); raises
        what `accept` would for a report the session cannot take."""
        with self.store.transaction() as tx:
            return self._admissible(tx, self._session(tx, session_id), client_id, version, digest)

    def _admissible(
        self, tx: sql.Tx, s: Session, client_id: str, version: int, digest: str
    ) -> bool:
        done = tx.one(
            "SELECT digest FROM buffered_reports WHERE session = ? AND client = ? AND version = ?",
            (s.id, client_id, version),
        )
        held = tx.one(
            "SELECT state FROM buffered_tasks WHERE session = ? AND client = ? AND version = ?",
            (s.id, client_id, version),
        )
        slot = admission.Slot(
            owner=f"session {s.id}", part=f"version {version}", upload="report",
            accepted=None if done is None else str(done[0]),
            assignment=None if held is None else str(held[0]), open=s.state == OPEN,
            state=s.state, reason="closed",
        )
        if admission.admit(slot, digest):
            return True
        staleness = s.version - version
        if staleness > s.max_staleness:
            raise protocol.Gone(
                f"Expected a report at most {s.max_staleness} versions old, found one for "
                f"version {version} while the model is at version {s.version} (staleness "
                f"{staleness}): it is refused and counted; check in for the current version.",
                reason="stale",
            )
        if s.pending >= s.buffer_size:
            raise protocol.BufferFull(
                f"Expected room in the buffer of session {s.id}, found its {s.buffer_size} "
                f"reports waiting to be applied to version {s.version}; retry in a moment."
            )
        return False

    def accept(
        self, session_id: int, client_id: str, version: int, digest: str, data: bytes
    ) -> bool:
        """Stores a checked report (see the module docstring). Returns False for a replay
        of an accepted report (nothing changes).

        Raises:
          Forbidden, Gone, Conflict, BufferFull: see `precheck`.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self._session(tx, session_id, lock=True)
            if self._admissible(tx, s, client_id, version, digest):
                return False
            _store_reports(tx, s, [(client_id, version, digest, data)], now)
            tx.run(
                "UPDATE buffered_tasks SET state = ? WHERE session = ? AND client = ?"
                " AND version = ?",
                (admission.Assignment.REPORTED, s.id, client_id, version),
            )
            tx.run("UPDATE buffered_sessions SET reports = reports + 1, updated = ? WHERE id = ?",
                   (now, s.id))
            tx.count("reports:accepted")
        return True

    # -- batches (edges)

    def open_sessions(self, population: str) -> list[Session]:
        """The open sessions of `population`, oldest first."""
        with self.store.transaction() as tx:
            ids = [row[0] for row in tx.all(
                "SELECT id FROM buffered_sessions WHERE population = ? AND state = ?"
                " ORDER BY id", (population, OPEN),
            )]
            return [self._session(tx, i) for i in ids]

    def _admit_batch(self, tx: sql.Tx, s: Session, client_id: str, batch: int,
                     digest: str) -> bool:
        row = tx.one("SELECT digest FROM buffered_batches WHERE session = ? AND client = ?"
                     " AND batch = ?", (s.id, client_id, batch))
        slot = admission.Slot(
            owner=f"session {s.id}", part=f"batch {batch}", upload="batch",
            accepted=None if row is None else str(row[0]),
            assignment=ASSIGNED,  # any edge of the population forwards to its sessions
            open=s.state == OPEN, state=s.state, reason="closed",
        )
        if admission.admit(slot, digest):
            return True
        last = tx.one("SELECT MAX(batch) FROM buffered_batches WHERE session = ? AND client = ?",
                      (s.id, client_id))[0]
        want = 1 if last is None else int(last) + 1
        if batch != want:
            raise protocol.Conflict(
                f"Expected batch {want} of session {s.id} (batches come in order), found "
                f"batch {batch}."
            )
        return False

    def precheck_many(self, session_id: int, client_id: str, batch: int, digest: str) -> bool:
        """Whether this exact batch was accepted before (True: nothing to do); raises
        what `accept_many` would for a batch the session cannot take."""
        with self.store.transaction() as tx:
            return self._admit_batch(tx, self._session(tx, session_id), client_id, batch, digest)

    def accept_many(
        self,
        session_id: int,
        client_id: str,
        batch: int,
        digest: str,
        size: int,
        items: Sequence[tuple[int, str, bytes]],
    ) -> bool:
        """Stores the checked reports of batch `batch`, `items` of (version, digest,
        bytes), in one transaction (see the module docstring); False for a replay.

        Raises:
          Conflict, Gone: see `admission.admit`, and a batch out of order.
          BadRequest: a report for a version the session has not published.
          BufferFull: the batch's fresh reports do not fit the buffer's free room.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self._session(tx, session_id, lock=True)
            if self._admit_batch(tx, s, client_id, batch, digest):
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
            _store_reports(tx, s, [(f"{client_id}/{batch}.{i}", version, report_digest, data)
                                   for i, (version, report_digest, data) in fresh], now)
            tx.run(
                "UPDATE buffered_sessions SET reports = reports + ?,"
                " refused_stale = refused_stale + ?, updated = ? WHERE id = ?",
                (len(fresh), stale, now, s.id),
            )
            tx.run(
                "INSERT INTO buffered_batches (session, client, batch, digest, size, reports,"
                " stale, accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (s.id, client_id, batch, digest, size, len(fresh), stale, now),
            )
            tx.count("reports:accepted", len(fresh))
            tx.count("batches:accepted")
            if stale:
                tx.count("refused:stale", stale)
        return True

    def batches(self, session_id: int, client_id: str | None = None,
                batch: int | None = None) -> list[Batch]:
        """The batches forwarded to a session (only `client_id`'s batch `batch`, when
        given), by uploader and number."""
        only = "" if client_id is None else " AND client = ? AND batch = ?"
        with self.store.transaction() as tx:
            rows = tx.all(
                "SELECT client, batch, digest, reports, stale FROM buffered_batches"
                f" WHERE session = ?{only} ORDER BY client, batch",
                (session_id,) + (() if client_id is None else (client_id, batch)),
            )
        return [Batch(session_id, str(c), int(b), str(d), int(n), int(t))
                for c, b, d, n, t in rows]

    # -- a session mirrored at an edge (`edge/sync.py`)

    def advance(self, session_id: int, version: int, weights: str) -> None:
        """Moves a mirrored session to the root's `version` (its weights by hash): its
        clients' next check-ins get it. Versions may be skipped (the root stepped twice
        between two looks)."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            s = self._session(tx, session_id, lock=True)
            if version <= s.version:
                return
            tx.run("UPDATE buffered_sessions SET version = ?, weights = ?, updated = ?"
                   " WHERE id = ?", (version, weights, now, session_id))
            tx.run("INSERT INTO buffered_versions (session, version, weights, server_state,"
                   " through, published) VALUES (?, ?, ?, '', ?, ?)",
                   (session_id, version, weights, s.applied_through, now))

    def release(self, tx: sql.Tx, session_id: int, through: int) -> None:
        """In `tx`: the reports of a mirrored session up to sequence number `through` were
        forwarded to the root, and leave its buffer (its clients' reports fit again)."""
        tx.run("UPDATE buffered_sessions SET applied_through = ?, updated = ? WHERE id = ?",
               (through, self.store.clock(), session_id))

    def count_refusal(self, reason: str, session_id: int) -> None:
        """Counts a refused upload (`refused:REASON`; a stale one also in its session)."""
        update = None
        if reason == "stale":
            update = (
                "UPDATE buffered_sessions SET refused_stale = refused_stale + 1 WHERE id = ?",
                (session_id,),
            )
        self.store.count_refusal(reason, update, task=f"session:{session_id}")

    # -- status

    def status(self, s: Session) -> dict[str, Any]:
        """What `GET /v1/status` shows of a session: its version, buffer fill (n/K), the
        staleness histogram of accepted reports, refused stale reports."""
        with self.store.transaction() as tx:
            rows = tx.all(
                "SELECT staleness, COUNT(*) FROM buffered_reports WHERE session = ?"
                " GROUP BY staleness ORDER BY staleness",
                (s.id,),
            )
        return {
            "id": s.id,
            "population": s.population,
            "state": s.state,
            "version": s.version,
            "buffer_fill": s.pending,
            "buffer_size": s.buffer_size,
            "max_staleness": s.max_staleness,
            "accepted": s.reports,
            "refused_stale": s.refused_stale,
            "staleness_histogram": {str(int(t)): int(n) for t, n in rows},
        }


def _store_reports(tx: sql.Tx, s: Session, reports: Sequence[tuple[str, int, str, bytes]],
                   now: float) -> None:
    """Stores accepted `reports` of session `s` (its row read locked in `tx`), each
    (client, version, digest, bytes), numbered after its last and with their staleness
    against its version now."""
    tx.many(
        "INSERT INTO buffered_reports (session, seq, client, version, staleness, digest,"
        " size, data, accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
        [(s.id, seq, client, version, s.version - version, digest, len(data), data, now)
         for seq, (client, version, digest, data) in enumerate(reports, s.reports + 1)],
    )
