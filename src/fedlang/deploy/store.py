"""The task store: populations, clients, blobs, rounds, assignments, reports, aggregates.

State lives in SQL: SQLite by default (one file in WAL mode, nothing to install) and
PostgreSQL by URL (`postgresql://...`, psycopg 3) for servers that outgrow one process.
Both run one schema and one code path; `sql.Dialect` holds the few differences (parameter
style, column types, how a transaction takes its write lock).

Accepting a report is one transaction: it locks the round's row, checks that the client
holds an open assignment, records the report's digest and replaces the round's aggregate
with the report folded in. So a server killed at any moment has either accepted a report
(and its aggregate holds it) or not, and a replayed report changes nothing. SQLite runs
with `synchronous=NORMAL`, which is durable across crashes of the server process (a
`kill -9`); only an operating system crash or power loss may lose the last commits.

Rounds have a `kind`: "aggregate" (one stage, a report per client) or "secure" (the
four stages of SecAgg+, run by `secure_rounds.SecureRounds` on the `secure_rounds` and
`secure_requests` tables; reports carry the stage number of each client message).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import queue
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from fedlang.deploy import async_store, protocol, sql

SCHEMA_VERSION = b"1"
OPEN, CLOSED, FAILED = "open", "closed", "failed"

_SCHEMA = [
    "CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS populations (name TEXT PRIMARY KEY, token_hash TEXT NOT NULL,"
    " clients {int} NOT NULL DEFAULT 0, finished {int} NOT NULL DEFAULT 0, created {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS clients (id TEXT PRIMARY KEY, population TEXT NOT NULL,"
    " credential_hash TEXT NOT NULL UNIQUE, created {real} NOT NULL, expires {real} NOT NULL,"
    " last_seen {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS blobs (hash TEXT PRIMARY KEY, size {int} NOT NULL,"
    " data {blob} NOT NULL, created {real} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS rounds (id {int} PRIMARY KEY, population TEXT NOT NULL,"
    " kind TEXT NOT NULL, state TEXT NOT NULL, request_id TEXT UNIQUE, plan TEXT NOT NULL,"
    " broadcast TEXT NOT NULL, target {int} NOT NULL, capacity {int} NOT NULL,"
    " quorum {int} NOT NULL, deadline {real} NOT NULL, created {real} NOT NULL, closed {real},"
    " assigned {int} NOT NULL DEFAULT 0, reports {int} NOT NULL DEFAULT 0,"
    " late {int} NOT NULL DEFAULT 0, dropped {int} NOT NULL DEFAULT 0,"
    " refused {int} NOT NULL DEFAULT 0, failure TEXT NOT NULL DEFAULT '')",
    "CREATE INDEX IF NOT EXISTS rounds_by_state ON rounds (population, state)",
    "CREATE TABLE IF NOT EXISTS assignments (round {int} NOT NULL, client TEXT NOT NULL,"
    " state TEXT NOT NULL, assigned {real} NOT NULL, updated {real} NOT NULL,"
    " PRIMARY KEY (round, client))",
    "CREATE INDEX IF NOT EXISTS assignments_by_client ON assignments (client, state)",
    "CREATE TABLE IF NOT EXISTS reports (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL DEFAULT 0, digest TEXT NOT NULL, size {int} NOT NULL,"
    " accepted {real} NOT NULL, PRIMARY KEY (round, client, stage))",
    "CREATE TABLE IF NOT EXISTS aggregates (round {int} PRIMARY KEY, data {blob} NOT NULL,"
    " reports {int} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS counters (name TEXT PRIMARY KEY, value {int} NOT NULL)",
    # Secure rounds (secure_rounds.py): the SecAgg+ server state and each stage's requests.
    "CREATE TABLE IF NOT EXISTS secure_rounds (round {int} PRIMARY KEY, stage {int} NOT NULL,"
    " stage_timeout {real} NOT NULL, stage_deadline {real} NOT NULL,"
    " answered {int} NOT NULL DEFAULT 0, state {blob} NOT NULL)",
    "CREATE TABLE IF NOT EXISTS secure_requests (round {int} NOT NULL, client TEXT NOT NULL,"
    " stage {int} NOT NULL, data {blob} NOT NULL, PRIMARY KEY (round, client, stage))",
    # Buffered (asynchronous, FedBuff) sessions: async_store.py.
    *async_store.SCHEMA,
]
AGGREGATE, SECURE = "aggregate", "secure"

_ROUND_FIELDS = (
    "id, population, kind, state, plan, broadcast, target, capacity, quorum, deadline, created,"
    " closed, assigned, reports, late, dropped, refused, failure,"
    " COALESCE((SELECT s.stage FROM secure_rounds s WHERE s.round = rounds.id), 0)"
)


@dataclasses.dataclass(frozen=True)
class CohortOptions:
    """How a round picks and waits for its clients.

    Attributes:
      target: reports wanted; the round closes as soon as this many are accepted.
      over_selection: the fraction of extra clients assigned beyond `target`, so that
        dropouts do not starve the round (0.3: up to ceil(1.3 * target) clients).
      quorum: the fewest reports the round may close with at its deadline (default:
        `target`); below it, the round fails.
      deadline: seconds from the round's creation after which it closes (with at least
        `quorum` reports) or fails.
      stage_timeout: in a secure round, seconds each of stages 2-4 waits for its last
        participants; stage 1 (check-in, local training, keys) may last until three
        stage timeouts before the deadline (and at least one). Default: a quarter of
        the deadline.
    """

    target: int
    over_selection: float = 0.0
    quorum: int | None = None
    deadline: float = 600.0
    stage_timeout: float | None = None

    def __post_init__(self) -> None:
        if not (isinstance(self.target, int) and self.target >= 1):
            raise ValueError(f"Expected a target of at least 1 report, found {self.target!r}.")
        if not (math.isfinite(self.over_selection) and 0 <= self.over_selection <= 10):
            raise ValueError(
                f"Expected an over-selection between 0 and 10, found {self.over_selection!r}."
            )
        q = self.target if self.quorum is None else self.quorum
        if not (isinstance(q, int) and 1 <= q <= self.target):
            raise ValueError(
                f"Expected a quorum between 1 and the target ({self.target}), found {q!r}."
            )
        if not (math.isfinite(self.deadline) and 0 < self.deadline <= 30 * 86400):
            raise ValueError(
                f"Expected a deadline between 0 and 30 days (in seconds), found {self.deadline!r}."
            )
        t = self.stage_timeout
        if t is not None and not (math.isfinite(t) and 0 < t <= self.deadline):
            raise ValueError(
                f"Expected a stage timeout between 0 and the deadline ({self.deadline:g} s), "
                f"found {t!r}."
            )

    @property
    def minimum(self) -> int:
        return self.target if self.quorum is None else self.quorum

    @property
    def capacity(self) -> int:
        return math.ceil(self.target * (1 + self.over_selection) - 1e-9)

    @property
    def stage_seconds(self) -> float:
        """A secure round's stage timeout (`stage_timeout`, or a quarter of the deadline)."""
        return self.deadline / 4 if self.stage_timeout is None else self.stage_timeout


@dataclasses.dataclass(frozen=True)
class Round:
    """A round's row: its options, its state and its counters."""

    id: int
    population: str
    kind: str
    state: str
    plan: str
    broadcast: str
    target: int
    capacity: int
    quorum: int
    deadline: float
    created: float
    closed: float | None
    assigned: int
    reports: int
    late: int
    dropped: int
    refused: int
    failure: str
    stage: int  # a secure round's SecAgg+ stage (secagg.Stage); 0 for other kinds

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Task:
    """What a client is asked to do: a round's signed plan and broadcast, by hash, and the
    round's kind (a report, or the stages of secure aggregation)."""

    round: int
    plan: str
    broadcast: str
    deadline: float
    kind: str = AGGREGATE


@dataclasses.dataclass(frozen=True)
class Pace:
    """Pace steering: how long clients with nothing to do wait before checking in again.

    A population of `n` clients is asked to come back after about
    `n / checkins_per_second` seconds (between `min_retry` and `max_retry`, with +-50%
    jitter), so check-ins stay spread out however large the population is.
    """

    checkins_per_second: float = 100.0
    min_retry: float = 1.0
    max_retry: float = 300.0

    def retry_after(self, population_size: int, rng: random.Random) -> float:
        base = min(self.max_retry, max(self.min_retry, population_size / self.checkins_per_second))
        return round(base * rng.uniform(0.5, 1.5), 3)


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


# ----------------------------------------------------------------------------
# The store


def end_round(tx: sql.Tx, round_id: int, state: str, failure: str, now: float) -> None:
    """Ends a round in `state` (CLOSED or FAILED): its clients still assigned count as
    dropped, and the store's counters record the dropouts and the outcome."""
    dropped = tx.run(
        "UPDATE assignments SET state = 'dropped', updated = ? WHERE round = ?"
        " AND state = 'assigned'",
        (now, round_id),
    )
    tx.run(
        "UPDATE rounds SET state = ?, closed = ?, dropped = dropped + ?, failure = ?"
        " WHERE id = ?",
        (state, now, dropped, failure, round_id),
    )
    tx.count("dropouts", dropped)
    tx.count(f"rounds:{state}")



def fold_report(
    tx: sql.Tx, round_id: int, client_id: str, fold: Callable[[bytes], bytes], now: float
) -> None:
    """Folds an accepted report into its round's stored aggregate (`fold(aggregate)`),
    marks the client's assignment reported, and counts the report, in `tx`."""
    aggregate = bytes(tx.one("SELECT data FROM aggregates WHERE round = ?", (round_id,))[0])
    tx.run(
        "UPDATE aggregates SET data = ?, reports = reports + 1 WHERE round = ?",
        (fold(aggregate), round_id),
    )
    tx.run(
        "UPDATE assignments SET state = 'reported', updated = ? WHERE round = ?"
        " AND client = ?",
        (now, round_id, client_id),
    )
    tx.run("UPDATE rounds SET reports = reports + 1 WHERE id = ?", (round_id,))
    tx.count("reports:accepted")

class Store:
    """The task store on a database (see the module docstring).

    Args:
      url: `sqlite:///PATH`, a file path (SQLite), or `postgresql://...`.
      clock: the time in seconds since the epoch (tests pass their own).
      pace: pace steering for check-ins.
      max_connections: connections kept open for concurrent requests.
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        pace: Pace | None = None,
        max_connections: int = 16,
    ):
        self.dialect = sql.dialect(url)
        self.clock = clock
        self.pace = pace or Pace()
        self._idle: queue.LifoQueue[Any] = queue.LifoQueue()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._all: list[Any] = []
        self._lock = threading.Lock()
        self._rng = random.Random()
        with self.transaction(write=True) as tx:
            for statement in _SCHEMA:
                tx.run(statement.format(**self.dialect.types))
            tx.run(
                "INSERT INTO meta (key, value) VALUES ('schema', ?) ON CONFLICT (key) DO NOTHING",
                (SCHEMA_VERSION,),
            )
            found = bytes(tx.one("SELECT value FROM meta WHERE key = 'schema'")[0])
        if found != SCHEMA_VERSION:
            self.close()
            raise ValueError(
                f"Expected a task store of schema version {SCHEMA_VERSION.decode()}, found "
                f"version {found.decode(errors='replace')}; use a fedlang of that version or a "
                "new database."
            )

    # -- connections and transactions

    @contextlib.contextmanager
    def transaction(self, write: bool = False) -> Iterator[sql.Tx]:
        """A transaction: committed if the block ends normally, rolled back otherwise."""
        self._slots.acquire()
        try:
            try:
                conn = self._idle.get_nowait()
            except queue.Empty:
                conn = self.dialect.connect()
                with self._lock:
                    self._all.append(conn)
            try:
                self.dialect.begin(conn, write)
                yield sql.Tx(conn, self.dialect)
                conn.execute("COMMIT")
            except BaseException:
                try:
                    conn.execute("ROLLBACK")
                except Exception:  # a broken connection is dropped, not reused
                    self._discard(conn)
                    raise
                self._idle.put(conn)
                raise
            self._idle.put(conn)
        finally:
            self._slots.release()

    def _discard(self, conn: Any) -> None:
        with self._lock:
            if conn in self._all:
                self._all.remove(conn)
        with contextlib.suppress(Exception):
            conn.close()

    def close(self) -> None:
        """Closes every connection."""
        with self._lock:
            for conn in self._all:
                with contextlib.suppress(Exception):
                    conn.close()
            self._all.clear()
        self._idle = queue.LifoQueue()

    # -- metadata (the server's key, its admin token)

    def setdefault_meta(self, key: str, value: bytes) -> bytes:
        """The stored value of `key`, storing `value` first if there is none."""
        with self.transaction(write=True) as tx:
            tx.run(
                "INSERT INTO meta (key, value) VALUES (?, ?) ON CONFLICT (key) DO NOTHING",
                (key, value),
            )
            return bytes(tx.one("SELECT value FROM meta WHERE key = ?", (key,))[0])

    # -- populations and clients

    def create_population(self, name: str) -> str:
        """Creates a population; returns its enrollment token (stored only as a hash)."""
        token = secrets.token_urlsafe(24)
        with self.transaction(write=True) as tx:
            added = tx.run(
                "INSERT INTO populations (name, token_hash, created) VALUES (?, ?, ?)"
                " ON CONFLICT (name) DO NOTHING",
                (name, _hash(token), self.clock()),
            )
        if not added:
            raise protocol.Conflict(
                f"Expected a new population name, found {name!r}, which exists; pick another "
                "name (its enrollment token was shown when it was created)."
            )
        return token

    def populations(self) -> list[dict[str, Any]]:
        with self.transaction() as tx:
            rows = tx.all("SELECT name, clients, finished, created FROM populations ORDER BY name")
        return [
            {"name": n, "clients": c, "finished": bool(f), "created": t} for n, c, f, t in rows
        ]

    def finish_population(self, name: str) -> None:
        """Marks a population finished: its clients are told to stop at their next check-in."""
        with self.transaction(write=True) as tx:
            if not tx.run("UPDATE populations SET finished = 1 WHERE name = ?", (name,)):
                raise protocol.NotFound(f"Expected an existing population, found {name!r}.")

    def enroll(self, population: str, token: str, ttl: float) -> tuple[str, str, float]:
        """A new client of `population`: (client id, credential, expiry time).

        Raises:
          Unauthorized: if the enrollment token is not the population's.
        """
        with self.transaction(write=True) as tx:
            row = tx.one("SELECT token_hash FROM populations WHERE name = ?", (population,))
            if row is None or not secrets.compare_digest(row[0], _hash(token)):
                tx.count("refused:enrollment")
                bad = "unknown population" if row is None else "wrong enrollment token"
                raise protocol.Unauthorized(
                    f"Expected the enrollment token of population {population!r}, found a "
                    f"{bad}; ask the server's operator for the token."
                )
            client_id = "c-" + secrets.token_hex(8)
            credential = secrets.token_urlsafe(32)
            now = self.clock()
            tx.run(
                "INSERT INTO clients (id, population, credential_hash, created, expires, last_seen)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (client_id, population, _hash(credential), now, now + ttl, now),
            )
            tx.run("UPDATE populations SET clients = clients + 1 WHERE name = ?", (population,))
            tx.count("enrollments")
        return client_id, credential, now + ttl

    def authenticate(self, credential: str) -> tuple[str, str]:
        """(client id, population) of a credential.

        Raises:
          Unauthorized: if the credential is unknown or expired.
        """
        with self.transaction() as tx:
            row = tx.one(
                "SELECT id, population, expires FROM clients WHERE credential_hash = ?",
                (_hash(credential),),
            )
        if row is None:
            raise protocol.Unauthorized(
                "Expected a client credential from enrollment, found an unknown one; enroll "
                "again with the population's token."
            )
        if row[2] <= self.clock():
            raise protocol.Unauthorized(
                f"Expected a valid client credential, found one that expired for client "
                f"{row[0]}; enroll again with the population's token.",
                reason="expired",
            )
        return row[0], row[1]

    # -- blobs

    def put_blob(self, data: bytes) -> str:
        """Stores `data` under its hash (content-addressed: storing it again changes nothing)."""
        h = protocol.blob_hash(data)
        with self.transaction(write=True) as tx:
            tx.run(
                "INSERT INTO blobs (hash, size, data, created) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (hash) DO NOTHING",
                (h, len(data), data, self.clock()),
            )
        return h

    def get_blob(self, h: str) -> bytes:
        with self.transaction() as tx:
            row = tx.one("SELECT data FROM blobs WHERE hash = ?", (h,))
        if row is None:
            raise protocol.NotFound(f"Expected the hash of a stored blob, found {h!r}.")
        return bytes(row[0])

    def has_blob(self, h: str) -> bool:
        with self.transaction() as tx:
            return tx.one("SELECT 1 FROM blobs WHERE hash = ?", (h,)) is not None

    # -- rounds

    def create_round(
        self,
        population: str,
        plan: str,
        broadcast: str,
        options: CohortOptions,
        empty_aggregate: bytes,
        request_id: str | None = None,
        kind: str = AGGREGATE,
        on_create: Callable[[sql.Tx, Round], None] | None = None,
    ) -> Round:
        """Opens a round of `population` (or returns the round made for `request_id`).

        `on_create(tx, round)` writes, in the same transaction, what a round of this kind
        needs besides its row (a secure round's protocol state)."""
        now = self.clock()
        with self.transaction(write=True) as tx:
            if request_id is not None:
                row = tx.one("SELECT id FROM rounds WHERE request_id = ?", (request_id,))
                if row is not None:
                    return self._round(tx, row[0])
            if tx.one("SELECT 1 FROM populations WHERE name = ?", (population,)) is None:
                raise protocol.NotFound(
                    f"Expected an existing population, found {population!r}; create it first."
                )
            self.dialect.lock_table(tx, "rounds")
            round_id = int(tx.one("SELECT COALESCE(MAX(id), 0) + 1 FROM rounds")[0])
            tx.run(
                "INSERT INTO rounds (id, population, kind, state, request_id, plan, broadcast,"
                " target, capacity, quorum, deadline, created) VALUES"
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (round_id, population, kind, OPEN, request_id, plan, broadcast, options.target,
                 options.capacity, options.minimum, now + options.deadline, now),
            )
            tx.run(
                "INSERT INTO aggregates (round, data, reports) VALUES (?, ?, 0)",
                (round_id, empty_aggregate),
            )
            if on_create is not None:
                on_create(tx, self._round(tx, round_id))
            return self._round(tx, round_id)

    def _round(self, tx: sql.Tx, round_id: int, lock: bool = False) -> Round:
        row = tx.one(
            f"SELECT {_ROUND_FIELDS} FROM rounds WHERE id = ?"
            + (self.dialect.lock_row if lock else ""),
            (round_id,),
        )
        if row is None:
            raise protocol.NotFound(f"Expected an existing round id, found {round_id}.")
        return Round(*row)

    def round_in(self, tx: sql.Tx, round_id: int, *, lock: bool = False) -> Round:
        """A round's row, read in `tx` (`lock`: locked until `tx` ends, for a writer).

        Raises:
          NotFound: no such round.
        """
        return self._round(tx, round_id, lock)

    def round(self, round_id: int) -> Round:
        """A round's current row (closing it first if its deadline passed)."""
        with self.transaction() as tx:
            r = self._round(tx, round_id)
        if r.state == OPEN and r.deadline <= self.clock():
            self.close_due_rounds()
            with self.transaction() as tx:
                r = self._round(tx, round_id)
        return r

    def rounds(self, limit: int = 20) -> list[Round]:
        with self.transaction() as tx:
            rows = tx.all(f"SELECT {_ROUND_FIELDS} FROM rounds ORDER BY id DESC LIMIT ?", (limit,))
        return [Round(*row) for row in rows]

    def aggregate(self, round_id: int) -> tuple[Round, bytes]:
        """A round's row and its current aggregate."""
        with self.transaction() as tx:
            r = self._round(tx, round_id)
            data = bytes(tx.one("SELECT data FROM aggregates WHERE round = ?", (round_id,))[0])
        return r, data

    def _close(self, tx: sql.Tx, r: Round, now: float) -> None:
        """Closes (or fails) an open round whose target is met or whose deadline passed."""
        if r.reports >= r.target or r.reports >= r.quorum:
            state, failure = CLOSED, ""
        else:
            state = FAILED
            failure = (
                f"Round {r.id} failed: {r.reports} of the {r.quorum} reports its quorum needs "
                f"arrived before its deadline ({r.deadline - r.created:g} s; {r.assigned} clients "
                "were assigned). Enroll more clients, lower the quorum or give a later deadline."
            )
        end_round(tx, r.id, state, failure, now)

    def close_due_rounds(self) -> int:
        """Closes or fails the open aggregate rounds whose deadline passed; returns how
        many. (Secure rounds close by their stages: `secure_rounds.SecureRounds.close_due`.)"""
        now = self.clock()
        with self.transaction() as tx:
            due = [row[0] for row in tx.all(
                "SELECT id FROM rounds WHERE state = ? AND deadline <= ? AND kind = ?",
                (OPEN, now, AGGREGATE),
            )]
        for round_id in due:
            with self.transaction(write=True) as tx:
                r = self._round(tx, round_id, lock=True)
                if r.state == OPEN:
                    self._close(tx, r, now)
        return len(due)

    # -- check-in

    def checkin(self, client_id: str, population: str) -> Task | float | None:
        """A task for the client, or seconds to wait before checking in again, or None
        when the population is finished."""
        now = self.clock()
        with self.transaction(write=True) as tx:
            tx.run("UPDATE clients SET last_seen = ? WHERE id = ?", (now, client_id))
            tx.count("checkins")
            pop = tx.one("SELECT clients, finished FROM populations WHERE name = ?", (population,))
            if pop is None or pop[1]:
                return None
            held = tx.one(
                "SELECT r.id, r.plan, r.broadcast, r.deadline, r.kind FROM assignments a JOIN rounds r"
                " ON r.id = a.round WHERE a.client = ? AND a.state = 'assigned' AND r.state = ?"
                " AND r.deadline > ? ORDER BY r.id LIMIT 1",
                (client_id, OPEN, now),
            )
            if held is not None:  # a client that restarted gets its task again
                return Task(*held)
            candidates = tx.all(
                "SELECT id FROM rounds WHERE population = ? AND state = ? AND deadline > ?"
                " AND assigned < capacity AND NOT EXISTS (SELECT 1 FROM assignments a"
                " WHERE a.round = rounds.id AND a.client = ?) ORDER BY id",
                (population, OPEN, now, client_id),
            )
            for (round_id,) in candidates:
                r = self._round(tx, round_id, lock=True)
                if r.state != OPEN or r.assigned >= r.capacity:
                    continue
                tx.run(
                    "INSERT INTO assignments (round, client, state, assigned, updated)"
                    " VALUES (?, ?, 'assigned', ?, ?)",
                    (r.id, client_id, now, now),
                )
                tx.run("UPDATE rounds SET assigned = assigned + 1 WHERE id = ?", (r.id,))
                tx.count("assignments")
                return Task(r.id, r.plan, r.broadcast, r.deadline, r.kind)
            with self._lock:
                wait = self.pace.retry_after(int(pop[0]), self._rng)
            soonest = tx.one(
                "SELECT MIN(deadline) FROM rounds WHERE population = ? AND state = ?",
                (population, OPEN),
            )[0]
            if soonest is not None:  # a full round: come back when it may have closed
                wait = min(wait, max(self.pace.min_retry, soonest - now))
            return wait

    # -- reports

    def precheck_report(self, round_id: int, client_id: str, digest: str) -> bool:
        """Whether this exact report was already accepted (True: nothing to do); raises
        what `accept_report` would for a report the round cannot take."""
        with self.transaction() as tx:
            r = self._round(tx, round_id)
            return self._admissible(tx, r, client_id, digest)

    def _admissible(self, tx: sql.Tx, r: Round, client_id: str, digest: str) -> bool:
        if r.kind != AGGREGATE:
            raise protocol.Conflict(
                f"Expected a report for an aggregate round, found round {r.id} of kind "
                f"{r.kind!r}; take part in its stages instead (GET /v1/rounds/{r.id}/secagg)."
            )
        done = tx.one(
            "SELECT digest FROM reports WHERE round = ? AND client = ? AND stage = 0",
            (r.id, client_id),
        )
        if done is not None:
            if done[0] == digest:
                return True
            raise protocol.Conflict(
                f"Expected the report this client already gave for round {r.id} (a replay "
                "changes nothing), found a different one; a task takes one report."
            )
        held = tx.one(
            "SELECT state FROM assignments WHERE round = ? AND client = ?", (r.id, client_id)
        )
        if held is None:
            raise protocol.Forbidden(
                f"Expected a report for a task this client was given, found one for round "
                f"{r.id}, which it was not assigned; check in to get a task."
            )
        if r.state != OPEN or held[0] != "assigned":
            raise protocol.Gone(
                f"Expected a report while round {r.id} is open, found it {r.state}: the report "
                "came too late and is not counted."
            )
        return False

    def count_refusal(self, reason: str, round_id: int | None = None) -> None:
        """Counts a refused request (`refused:REASON`; a late report also in its round)."""
        with self.transaction(write=True) as tx:
            tx.count(f"refused:{reason}")
            if round_id is not None:
                column = "late" if reason == "late" else "refused"
                tx.run(f"UPDATE rounds SET {column} = {column} + 1 WHERE id = ?", (round_id,))

    def accept_report(
        self,
        round_id: int,
        client_id: str,
        digest: str,
        size: int,
        fold: Callable[[bytes], bytes],
    ) -> bool:
        """Records a checked report and folds it into the round's aggregate, in one
        transaction. Returns False for a replay of an accepted report (nothing changes).

        Args:
          fold: the round's aggregate -> the aggregate with this report folded in.

        Raises:
          Forbidden, Gone, Conflict: see `precheck_report`.
        """
        now = self.clock()
        with self.transaction(write=True) as tx:
            r = self._round(tx, round_id, lock=True)
            if r.kind == AGGREGATE and r.state == OPEN and r.deadline <= now:
                self._close(tx, r, now)
                r = self._round(tx, round_id)
            if self._admissible(tx, r, client_id, digest):
                return False
            fold_report(tx, r.id, client_id, fold, now)
            tx.run(
                "INSERT INTO reports (round, client, stage, digest, size, accepted)"
                " VALUES (?, ?, 0, ?, ?, ?)",
                (r.id, client_id, digest, size, now),
            )
            if r.reports + 1 >= r.target:
                self._close(tx, self._round(tx, r.id), now)
        return True

    # -- status

    def counters(self) -> dict[str, int]:
        with self.transaction() as tx:
            return {name: int(value) for name, value in tx.all("SELECT name, value FROM counters")}
