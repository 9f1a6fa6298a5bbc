"""Buffered (asynchronous, FedBuff) sessions in the task store.

A session replaces rounds for a population: the driver publishes model **versions**
(`publish`), and a checking-in client gets the current version's task (the signed
`async_plan.BufferedPlan` and that version's weights, by hash). The client trains when
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

The driver (`async_driver`) reads the accepted reports in sequence order, folds them
into the process's buffer and, when it is full, applies it and publishes the next
version together with the new server state and the last report it folded: reports up
to it are marked applied in the same transaction. So a driver (or server) killed at any
moment restarts from the last published state and folds again exactly the reports
accepted since: none is lost, none is counted twice.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from fedlang.deploy import protocol, sql

if TYPE_CHECKING:  # store.py makes these tables from SCHEMA below
    from fedlang.deploy import store as store_lib

OPEN, CLOSED = "open", "closed"  # as store.OPEN, store.CLOSED
KIND = "buffered"

SCHEMA = [
    "CREATE TABLE IF NOT EXISTS async_sessions (id {int} PRIMARY KEY, population TEXT NOT NULL,"
    " state TEXT NOT NULL, request_id TEXT UNIQUE, plan TEXT NOT NULL, version {int} NOT NULL,"
    " weights TEXT NOT NULL, server_state TEXT NOT NULL DEFAULT '', buffer_size {int} NOT NULL,"
    " max_staleness {int} NOT NULL, applied_through {int} NOT NULL DEFAULT 0,"
    " reports {int} NOT NULL DEFAULT 0, refused_stale {int} NOT NULL DEFAULT 0,"
    " created {real} NOT NULL, updated {real} NOT NULL)",
    "CREATE INDEX IF NOT EXISTS async_sessions_by_state ON async_sessions (population, state)",
    "CREATE TABLE IF NOT EXISTS async_versions (session {int} NOT NULL, version {int} NOT NULL,"
    " weights TEXT NOT NULL, server_state TEXT NOT NULL, through {int} NOT NULL,"
    " published {real} NOT NULL, PRIMARY KEY (session, version))",
    "CREATE TABLE IF NOT EXISTS async_tasks (session {int} NOT NULL, client TEXT NOT NULL,"
    " version {int} NOT NULL, state TEXT NOT NULL, assigned {real} NOT NULL,"
    " PRIMARY KEY (session, client, version))",
    "CREATE TABLE IF NOT EXISTS async_reports (session {int} NOT NULL, seq {int} NOT NULL,"
    " client TEXT NOT NULL, version {int} NOT NULL, staleness {int} NOT NULL,"
    " digest TEXT NOT NULL, size {int} NOT NULL, data {blob} NOT NULL, accepted {real} NOT NULL,"
    " applied {int}, PRIMARY KEY (session, seq), UNIQUE (session, client, version))",
]

_FIELDS = (
    "id, population, state, plan, version, weights, server_state, buffer_size, max_staleness,"
    " applied_through, reports, refused_stale, created, updated"
)


class BufferFull(protocol.ProtocolError):
    """The current buffer holds its K reports and the driver has not applied it yet:
    retry shortly (HTTP clients retry a 503 by themselves)."""

    status = 503
    reason = "buffer_full"


@dataclasses.dataclass(frozen=True)
class Session:
    """A buffered session's row."""

    id: int
    population: str
    state: str
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


@dataclasses.dataclass(frozen=True)
class Report:
    """An accepted report, as the driver reads it."""

    seq: int
    client: str
    version: int
    staleness: int
    data: bytes


@dataclasses.dataclass(frozen=True)
class AsyncTask:
    """A client's task in a buffered session: train `version` (weights by hash)."""

    session: int
    plan: str
    weights: str
    version: int


class Sessions:
    """The buffered sessions of a task store (see the module docstring)."""

    def __init__(self, store: store_lib.Store):
        self.store = store

    def _session(self, tx: sql.Tx, session_id: int, lock: bool = False) -> Session:
        row = tx.one(
            f"SELECT {_FIELDS} FROM async_sessions WHERE id = ?"
            + (self.store.dialect.lock_row if lock else ""),
            (session_id,),
        )
        if row is None:
            raise protocol.NotFound(f"Expected an existing session id, found {session_id}.")
        return Session(*row)

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
                f"SELECT {_FIELDS} FROM async_sessions ORDER BY id DESC LIMIT ?", (limit,)
            )
        return [Session(*row) for row in rows]

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
    ) -> Session:
        """Opens a session of `population` at model `version` with `weights` (a blob), or
        returns the session made for `request_id`.

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
            if request_id is not None:
                row = tx.one("SELECT id FROM async_sessions WHERE request_id = ?", (request_id,))
                if row is not None:
                    return self._session(tx, row[0])
            if tx.one("SELECT 1 FROM populations WHERE name = ?", (population,)) is None:
                raise protocol.NotFound(
                    f"Expected an existing population, found {population!r}; create it first."
                )
            self.store.dialect.lock_table(tx, "async_sessions")
            open_id = tx.one(
                "SELECT id FROM async_sessions WHERE population = ? AND state = ?",
                (population, OPEN),
            )
            if open_id is not None:
                raise protocol.Conflict(
                    f"Expected no open session for population {population!r}, found session "
                    f"{open_id[0]}; resume it, or close it (POST /v1/admin/sessions/"
                    f"{open_id[0]}/close) first."
                )
            session_id = int(tx.one("SELECT COALESCE(MAX(id), 0) + 1 FROM async_sessions")[0])
            tx.run(
                "INSERT INTO async_sessions (id, population, state, plan, version, weights,"
                " buffer_size, max_staleness, request_id, created, updated)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (session_id, population, OPEN, plan, version, weights, buffer_size,
                 max_staleness, request_id, now, now),
            )
            tx.run(
                "INSERT INTO async_versions (session, version, weights, server_state, through,"
                " published) VALUES (?, ?, ?, '', 0, ?)",
                (session_id, version, weights, now),
            )
            tx.count("sessions:opened")
            return self._session(tx, session_id)

    def reports(self, session_id: int, after: int, limit: int = 1000) -> list[Report]:
        """The accepted reports with sequence numbers above `after`, in order."""
        with self.store.transaction() as tx:
            rows = tx.all(
                "SELECT seq, client, version, staleness, data FROM async_reports"
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
                "SELECT through FROM async_versions WHERE session = ? AND version = ?",
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
                "UPDATE async_reports SET applied = ? WHERE session = ? AND seq > ? AND seq <= ?",
                (version, session_id, s.applied_through, through),
            )
            tx.run(
                "UPDATE async_sessions SET version = ?, weights = ?, server_state = ?,"
                " applied_through = ?, updated = ? WHERE id = ?",
                (version, weights, server_state, through, now, session_id),
            )
            tx.run(
                "INSERT INTO async_versions (session, version, weights, server_state, through,"
                " published) VALUES (?, ?, ?, ?, ?, ?)",
                (session_id, version, weights, server_state, through, now),
            )
            tx.count("sessions:versions")
            return self._session(tx, session_id)

    def close(self, session_id: int) -> Session:
        """Closes a session: its clients get no more tasks, its reports are refused."""
        with self.store.transaction(write=True) as tx:
            self._session(tx, session_id, lock=True)
            tx.run("UPDATE async_sessions SET state = ?, updated = ? WHERE id = ?",
                   (CLOSED, self.store.clock(), session_id))
            return self._session(tx, session_id)

    # -- clients

    def checkin(self, client_id: str, population: str) -> AsyncTask | None:
        """The current version's task for the client, or None (no open session, or the
        client already reported for the current version: it waits for the next)."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            row = tx.one(
                "SELECT id FROM async_sessions WHERE population = ? AND state = ?"
                " ORDER BY id DESC LIMIT 1",
                (population, OPEN),
            )
            if row is None:
                return None
            s = self._session(tx, row[0])
            held = tx.one(
                "SELECT state FROM async_tasks WHERE session = ? AND client = ? AND version = ?",
                (s.id, client_id, s.version),
            )
            if held is not None and held[0] != "assigned":
                return None
            # (a concurrent check-in of the same client inserts nothing)
            if held is None and tx.run(
                "INSERT INTO async_tasks (session, client, version, state, assigned)"
                " VALUES (?, ?, ?, 'assigned', ?) ON CONFLICT DO NOTHING",
                (s.id, client_id, s.version, now),
            ):
                tx.count("assignments")
            return AsyncTask(s.id, s.plan, s.weights, s.version)

    def precheck(self, session_id: int, client_id: str, version: int, digest: str) -> bool:
        """Whether this exact report was accepted before (True: nothing to do); raises
        what `accept` would for a report the session cannot take."""
        with self.store.transaction() as tx:
            return self._admissible(tx, self._session(tx, session_id), client_id, version, digest)

    def _admissible(
        self, tx: sql.Tx, s: Session, client_id: str, version: int, digest: str
    ) -> bool:
        done = tx.one(
            "SELECT digest FROM async_reports WHERE session = ? AND client = ? AND version = ?",
            (s.id, client_id, version),
        )
        if done is not None:
            if done[0] == digest:
                return True
            raise protocol.Conflict(
                f"Expected the report this client already gave for version {version} of "
                f"session {s.id} (a replay changes nothing), found a different one; a version "
                "takes one report per client."
            )
        if tx.one(
            "SELECT 1 FROM async_tasks WHERE session = ? AND client = ? AND version = ?",
            (s.id, client_id, version),
        ) is None:
            raise protocol.Forbidden(
                f"Expected a report for a version this client was given, found one for version "
                f"{version} of session {s.id}; check in to get a task."
            )
        if s.state != OPEN:
            raise protocol.Gone(
                f"Expected a report while session {s.id} is open, found it {s.state}: the "
                "report is not counted.", reason="closed",
            )
        staleness = s.version - version
        if staleness > s.max_staleness:
            raise protocol.Gone(
                f"Expected a report at most {s.max_staleness} versions old, found one for "
                f"version {version} while the model is at version {s.version} (staleness "
                f"{staleness}): it is refused and counted; check in for the current version.",
                reason="stale",
            )
        if s.pending >= s.buffer_size:
            raise BufferFull(
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
            tx.run(
                "INSERT INTO async_reports (session, seq, client, version, staleness, digest,"
                " size, data, accepted) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (s.id, s.reports + 1, client_id, version, s.version - version, digest,
                 len(data), data, now),
            )
            tx.run(
                "UPDATE async_tasks SET state = 'reported' WHERE session = ? AND client = ?"
                " AND version = ?",
                (s.id, client_id, version),
            )
            tx.run("UPDATE async_sessions SET reports = reports + 1, updated = ? WHERE id = ?",
                   (now, s.id))
            tx.count("reports:accepted")
        return True

    def count_refusal(self, reason: str, session_id: int | None) -> None:
        """Counts a refused upload (`refused:REASON`; a stale one also in its session)."""
        with self.store.transaction(write=True) as tx:
            tx.count(f"refused:{reason}")
            if session_id is not None and reason == "stale":
                tx.run("UPDATE async_sessions SET refused_stale = refused_stale + 1 WHERE id = ?",
                       (session_id,))

    # -- status

    def status(self, s: Session) -> dict[str, Any]:
        """What `GET /v1/status` shows of a session: its version, buffer fill (n/K), the
        staleness histogram of accepted reports, refused stale reports."""
        with self.store.transaction() as tx:
            rows = tx.all(
                "SELECT staleness, COUNT(*) FROM async_reports WHERE session = ?"
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
