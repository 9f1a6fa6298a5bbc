"""The task store: who is who, on the transaction engine (`engine.Engine`).

`Store` is the engine (connections, transactions, counters, task rows) with what every
mode shares about its callers and their data: the admin token, populations and their
enrolled clients (tokens, device tokens, enrollment, credentials), content-addressed
blobs (values in chunks, `values`: written as they arrive, read in ranges, deleted once
no task needs them), the admin audit log, and pace steering (`Pace`: how long an idle client waits).
Each mode keeps its own tables on top of it: `rounds.Rounds` (plain rounds, and the rows
of every round), `secure.SecureRounds` (the SecAgg+ stages of secure rounds) and
`sessions.Sessions` (buffered FedBuff sessions); `admission` holds the checks all three
make of an upload, and `edges.Edges` the credentials of edge aggregators.

Secrets (tokens, credentials) are kept only as hashes (`secret_hash`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import random
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import engine, sql, values


@dataclasses.dataclass(frozen=True)
class Pace:
    """Pace steering: how long clients with nothing to do wait before checking in again.

    A population of `n` clients is asked to come back after about
    `base = n / checkins_per_second` seconds (between `min_retry` and `max_retry`, with
    +-50% jitter), so the population checks in about `checkins_per_second` times a
    second however large it is (up to `checkins_per_second * max_retry` clients; past
    that, `n / max_retry` times a second), each client at times independent of the
    others' and of whether it was selected: every client is equally likely to be the
    next to check in, so selection is uniform over the population. A client selected
    for a round has the same wait, counted from its assignment (`rest`, drawn from the
    client and the round so that asking again does not shorten it): one that checks in
    at once after its task (as `Client.run` does) would otherwise be first in line for
    the next round (measured: over 60 rounds of 13 out of 1,000 clients, the counts of
    rounds per client had 1.15 times the binomial variance, 0.91 with the rest).

    The wait does not depend on the rounds: a client that finds every open round full
    is not asked back at the soonest deadline, which would bring back at once everyone
    who checked in during the round whenever a deadline is shorter than the wait
    (measured, bench/population.py: 2,000 clients, 10 check-ins a second wanted, a 30 s
    deadline: 80 a second on average and the whole population within one second).
    The check-in rate is the rounds' supply: set `checkins_per_second` to what the
    rounds need (about their clients over their duration) and the server can take.
    """

    checkins_per_second: float = 100.0
    min_retry: float = 1.0
    max_retry: float = 86400.0

    def __post_init__(self) -> None:
        ok = self.checkins_per_second > 0 and 0 < self.min_retry <= self.max_retry
        if not (ok and math.isfinite(self.checkins_per_second + self.max_retry)):
            raise ValueError(
                "Expected a positive check-in rate and 0 < min_retry <= max_retry, found "
                f"{self.checkins_per_second!r} a second, min_retry {self.min_retry!r}, "
                f"max_retry {self.max_retry!r}."
            )

    def base(self, population_size: int) -> float:
        """The mean wait of a population of `population_size` clients, in seconds."""
        return min(self.max_retry, max(self.min_retry, population_size / self.checkins_per_second))

    def rest(self, population_size: int, key: str) -> float:
        """The wait a client selected for a task has from its assignment to its next
        chance of one: drawn as `retry_after` is, but from `key` (the client and the
        round), so a client that checks in again and again gets the same end."""
        draw = int.from_bytes(hashlib.sha256(key.encode()).digest()[:8], "big") / 2.0**64
        return self.base(population_size) * (0.5 + draw)

    def retry_after(self, population_size: int, rng: random.Random) -> float:
        """Seconds to wait: `base(population_size)` +-50%, uniformly."""
        return round(self.base(population_size) * rng.uniform(0.5, 1.5), 3)


def secret_hash(secret: str) -> str:
    """What the store keeps of a secret (the admin token, an enrollment token, a
    credential): its SHA-256."""
    return hashlib.sha256(secret.encode()).hexdigest()


class Store(engine.Engine):
    """The task store on a database (see the module docstring).

    Args:
      url: `sqlite:///PATH`, a file path (SQLite), or `postgresql://...`.
      clock: the time in seconds since the epoch (tests pass their own).
      pace: pace steering for check-ins.
      max_connections: connections kept open for concurrent requests.
      rng: the pace's random draws (tests and benchmarks pass a seeded one).
    """

    def __init__(
        self,
        url: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.time,
        pace: Pace | None = None,
        max_connections: int = 16,
        rng: random.Random | None = None,
    ):
        self.pace = pace or Pace()
        self._rng = rng or random.Random()
        super().__init__(url, clock=clock, max_connections=max_connections)

    # -- the admin token

    def admin_token(self, token: str | None = None) -> tuple[str, str | None]:
        """The SHA-256 of the admin token, which is all the store keeps of it, and the
        token itself when it is new: `token` (kept from now on, replacing the one before),
        or, when the store has none yet, one made here. A token an older fedlang kept in
        the clear is hashed and its clear copy deleted."""
        made = None
        with self.transaction(write=True) as tx:
            legacy = tx.one("SELECT value FROM meta WHERE key = 'admin_token'" + tx.dialect.lock_row)
            if legacy is not None:  # zeroed on SQLite (secure_delete); see delete_meta
                sql.secure_delete(tx, True)
                tx.run("DELETE FROM meta WHERE key = 'admin_token'")
                sql.secure_delete(tx, False)
                tx.run(
                    "INSERT INTO meta (key, value) VALUES ('admin_token_sha256', ?)"
                    " ON CONFLICT (key) DO NOTHING",
                    (secret_hash(bytes(legacy[0]).decode()).encode(),),
                )
            row = tx.one("SELECT value FROM meta WHERE key = 'admin_token_sha256'")
            if token is None and row is None:
                token = made = secrets.token_urlsafe(24)
            if token is not None:
                tx.run(
                    "INSERT INTO meta (key, value) VALUES ('admin_token_sha256', ?)"
                    " ON CONFLICT (key) DO UPDATE SET value = excluded.value",
                    (secret_hash(token).encode(),),
                )
                return secret_hash(token), made
            return bytes(row[0]).decode(), None


    # -- populations and clients

    def create_population(self, name: str, max_enrollments: int | None = None) -> str:
        """Creates a population; returns its enrollment token (stored only as a hash),
        which enrolls at most `max_enrollments` clients (None: any number)."""
        token = secrets.token_urlsafe(24)
        with self.transaction(write=True) as tx:
            added = tx.run(
                "INSERT INTO populations (name, token_hash, created, max_enrollments)"
                " VALUES (?, ?, ?, ?) ON CONFLICT (name) DO NOTHING",
                (name, secret_hash(token), self.clock(), max_enrollments),
            )
        if not added:
            raise protocol.Conflict(
                f"Expected a new population name, found {name!r}, which exists; pick another "
                "name (its enrollment token was shown when it was created)."
            )
        return token

    def populations(self) -> list[dict[str, Any]]:
        with self.transaction() as tx:
            rows = tx.all(
                "SELECT name, clients, finished, created, token_enrollments, max_enrollments"
                " FROM populations ORDER BY name"
            )
        return [
            {"name": n, "clients": c, "finished": bool(f), "created": t,
             "token_enrollments": e, "max_enrollments": m}
            for n, c, f, t, e, m in rows
        ]

    def rotate_token(self, name: str, max_enrollments: int | None = None) -> str:
        """A new enrollment token for population `name` (the old one stops enrolling at
        once; clients it enrolled keep their credentials), enrolling at most
        `max_enrollments` clients (None: any number).

        Raises:
          NotFound: no such population.
        """
        token = secrets.token_urlsafe(24)
        with self.transaction(write=True) as tx:
            if not tx.run(
                "UPDATE populations SET token_hash = ?, token_enrollments = 0,"
                " max_enrollments = ? WHERE name = ?",
                (secret_hash(token), max_enrollments, name),
            ):
                raise protocol.NotFound(f"Expected an existing population, found {name!r}.")
        return token

    def revoke_client(self, client_id: str) -> str:
        """Deletes client `client_id` and its credential (its requests get 401 from now
        on); returns its population. A client that still holds its population's token
        can enroll again: rotate the token too (`rotate_token`).

        Raises:
          NotFound: no such client.
        """
        with self.transaction(write=True) as tx:
            row = tx.one("SELECT population FROM clients WHERE id = ?", (client_id,))
            if row is None:
                raise protocol.NotFound(f"Expected an enrolled client's id, found {client_id!r}.")
            tx.run("DELETE FROM clients WHERE id = ?", (client_id,))
            tx.run("UPDATE populations SET clients = clients - 1 WHERE name = ?", (row[0],))
            tx.count("revocations")
        return str(row[0])

    def finish_population(self, name: str) -> None:
        """Marks a population finished: its clients are told to stop at their next check-in."""
        with self.transaction(write=True) as tx:
            if not tx.run("UPDATE populations SET finished = 1 WHERE name = ?", (name,)):
                raise protocol.NotFound(f"Expected an existing population, found {name!r}.")

    def device_tokens(self, population: str, count: int) -> list[str]:
        """`count` new single-use enrollment tokens of `population`, one per device (kept
        as hashes; each enrolls one client, then never again).

        Raises:
          NotFound: no such population.
          ValueError: `count` outside 1..1000.
        """
        if not 1 <= count <= 1000:
            raise ValueError(f"Expected 1 to 1000 device tokens at a time, found {count}.")
        tokens = [secrets.token_urlsafe(24) for _ in range(count)]
        with self.transaction(write=True) as tx:
            if tx.one("SELECT 1 FROM populations WHERE name = ?", (population,)) is None:
                raise protocol.NotFound(f"Expected an existing population, found {population!r}.")
            now = self.clock()
            for token in tokens:
                tx.run(
                    "INSERT INTO device_tokens (hash, population, created) VALUES (?, ?, ?)",
                    (secret_hash(token), population, now),
                )
        return tokens

    def enroll(self, population: str, token: str, ttl: float) -> tuple[str, str, float]:
        """A new client of `population`: (client id, credential, expiry time), enrolled
        with the population's token (within its cap) or with one of its single-use device
        tokens. A refusal is counted (`refused:enrollment`, `refused:enrollment_cap`).

        Raises:
          Unauthorized: if the token is neither the population's nor an unused device token
            of it.
          Forbidden: if the population's token has enrolled as many clients as it may.
        """
        refusal: protocol.ProtocolError | None = None
        with self.transaction(write=True) as tx:
            row = tx.one(
                "SELECT token_hash, token_enrollments, max_enrollments FROM populations"
                " WHERE name = ?" + tx.dialect.lock_row,
                (population,),
            )
            shared = row is not None and secrets.compare_digest(row[0], secret_hash(token))
            device = row is not None and not shared and tx.run(
                "UPDATE device_tokens SET used = ? WHERE hash = ? AND population = ?"
                " AND used IS NULL",
                (self.clock(), secret_hash(token), population),
            ) == 1
            if row is None:  # the name is wrong, not the token: say so
                refusal = protocol.Unauthorized(
                    f"Expected an existing population, found no population named "
                    f"{population!r} on this server; check the name (`fedlang status "
                    "URL` lists the populations) or create it (`fedlang serve "
                    f"--population {population}`, or `Admin.create_population`)."
                )
                tx.count("refused:enrollment")
            elif not shared and not device:
                refusal = protocol.Unauthorized(
                    f"Expected an enrollment token of population {population!r} (its own, or "
                    "an unused device token), found a wrong or used one; ask the server's "
                    "operator for a token (`fedlang serve` printed the population's when it "
                    "made it)."
                )
                tx.count("refused:enrollment")
            elif shared and row[2] is not None and row[1] >= row[2]:
                refusal = protocol.Forbidden(
                    f"Expected an enrollment token with enrollments left, found one of "
                    f"population {population!r} that has enrolled its {row[2]} clients; ask "
                    "the server's operator for a new token.",
                    reason="enrollment_cap",
                )
                tx.count("refused:enrollment_cap")
            else:
                client_id = "c-" + secrets.token_hex(8)
                credential = secrets.token_urlsafe(32)
                now = self.clock()
                tx.run(
                    "INSERT INTO clients (id, population, credential_hash, created, expires,"
                    " last_seen) VALUES (?, ?, ?, ?, ?, ?)",
                    (client_id, population, secret_hash(credential), now, now + ttl, now),
                )
                tx.run(
                    "UPDATE populations SET clients = clients + 1,"
                    " token_enrollments = token_enrollments + ? WHERE name = ?",
                    (int(shared), population),
                )
                tx.count("enrollments")
        if refusal is not None:  # raised once the count is committed
            raise refusal
        return client_id, credential, now + ttl

    def authenticate(self, credential: str) -> tuple[str, str]:
        """(client id, population) of a credential.

        Raises:
          Unauthorized: if the credential is unknown or expired.
        """
        with self.transaction() as tx:
            row = tx.one(
                "SELECT id, population, expires FROM clients WHERE credential_hash = ?",
                (secret_hash(credential),),
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

    # -- blobs: content-addressed, their bytes a value in chunks (`values`)

    # Seconds a blob no task needs is kept after it was last uploaded (`sweep_values`):
    # the driver uploads a round's blobs just before it opens the round.
    blob_grace = 600.0
    # Seconds an upload may stall (nothing written) before its staged chunks are swept.
    staged_grace = 600.0

    def put_blob(self, data: bytes) -> str:
        """Stores `data` under its hash, in one transaction (content-addressed: storing
        it again only refreshes it, see `blob_grace`). For a small value; a large one
        that arrives in parts goes through `blob_writer`."""
        h = protocol.blob_hash(data)
        with self.transaction(write=True) as tx:
            if not _refresh_blob(tx, h, self.clock()):
                _insert_blob(tx, h, values.write(tx, [data]), self.clock())
        return h

    def blob_writer(self, size: int | None = None) -> BlobWriter:
        """A blob written as it arrives (an upload), `size` bytes if given (see
        `BlobWriter`)."""
        return BlobWriter(self, size)

    def put_blob_stream(self, parts: Iterable[bytes], size: int | None = None) -> tuple[str, int]:
        """Stores the bytes of `parts` as a blob, written as they come (one chunk held at
        a time, `BlobWriter`); its hash and size. Nothing is stored if `parts` raises.

        Raises:
          BadRequest: `size` given and the parts hold another number of bytes.
        """
        writer = BlobWriter(self, size)
        try:
            for part in parts:
                writer.write(part)
            return writer.commit(), writer.size
        except BaseException:
            writer.discard()
            raise

    def open_blob(self, h: str) -> values.Value:
        """The head of blob `h`'s value, to read it in chunks (`values.chunks(store,
        value, start, stop)`).

        Raises:
          NotFound: no such blob.
        """
        with self.transaction() as tx:
            return _blob_value(tx, h)

    def get_blob(self, h: str) -> bytes:
        """Blob `h` whole (a plan; a value a caller holds whole anyway), its SHA-256
        checked (`values.read`).

        Raises:
          NotFound: no such blob.
        """
        with self.transaction() as tx:
            return values.read(tx, _blob_value(tx, h))

    def has_blob(self, h: str) -> bool:
        with self.transaction() as tx:
            return tx.one("SELECT 1 FROM blobs WHERE hash = ?", (h,)) is not None

    def sweep_values(self) -> int:
        """Deletes the blobs no task needs (below) and the staged chunks of uploads cut
        off (`staged_grace`), each in a transaction of its own; returns how many.

        A blob is needed while a task that names it is open (a round's plan and
        broadcast, a buffered session's plan, weights and state), or while an edge has
        still to forward the round that names it (a pending mirror), and for
        `blob_grace` seconds after it was last uploaded. (A late report's plan is
        in the server's memory, `plans.cache`; a client still downloading a round's
        broadcast when it closes has no use for it.)
        """
        now = self.clock()
        cut = now - self.blob_grace
        with self.transaction() as tx:
            due = [str(row[0]) for row in tx.all(
                f"SELECT hash FROM blobs b WHERE created < ? AND {_UNNEEDED}", (cut,))]
        for h in due:
            with self.transaction(write=True) as tx:  # the rules again, the row locked
                row = tx.one(f"SELECT value FROM blobs b WHERE hash = ? AND created < ?"
                             f" AND {_UNNEEDED}" + tx.dialect.lock_row, (h, cut))
                if row is not None:
                    tx.run("DELETE FROM blobs WHERE hash = ?", (h,))
                    values.delete(tx, str(row[0]))
        return len(due) + values.sweep_staged(self, now - self.staged_grace)

    def names_blob(self, population: str, h: str) -> bool:
        """Whether a task of `population` names blob `h`: a round's signed plan or
        broadcast, a buffered session's signed plan or one of its versions' weights. A
        client may read only these (populations are isolated from each other)."""
        with self.transaction() as tx:
            return tx.one(
                "SELECT 1 FROM rounds WHERE population = ? AND (plan = ? OR broadcast = ?)"
                " UNION ALL SELECT 1 FROM buffered_sessions WHERE population = ?"
                " AND (plan = ? OR weights = ?)"
                " UNION ALL SELECT 1 FROM buffered_versions v JOIN buffered_sessions s"
                " ON s.id = v.session WHERE s.population = ? AND v.weights = ?",
                (population, h, h, population, h, h, population, h),
            ) is not None

    # -- pace steering

    def retry_after(self, population_size: int) -> float:
        """Seconds a client with nothing to do waits before checking in again (`Pace`)."""
        with self._lock:
            return self.pace.retry_after(population_size, self._rng)

    # -- the admin audit log

    def audit(self, method: str, path: str, status: int, remote: str) -> None:
        """Records one request made with the admin token that changes something."""
        with self.transaction(write=True) as tx:
            tx.dialect.lock_table(tx, "admin_audit")
            seq = int(tx.one("SELECT COALESCE(MAX(seq), 0) FROM admin_audit")[0]) + 1
            tx.run(
                "INSERT INTO admin_audit (seq, at, method, path, status, remote)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (seq, self.clock(), method, path, status, remote),
            )

    def audit_log(self, after: int = 0, limit: int = 100) -> list[dict[str, Any]]:
        """The audit entries after sequence number `after`, oldest first."""
        with self.transaction() as tx:
            rows = tx.all(
                "SELECT seq, at, method, path, status, remote FROM admin_audit WHERE seq > ?"
                " ORDER BY seq LIMIT ?",
                (after, limit),
            )
        keys = ("seq", "at", "method", "path", "status", "remote")
        return [dict(zip(keys, row)) for row in rows]



# Blob `b` named by no open task (`Store.sweep_values`).
_UNNEEDED = (
    "NOT EXISTS (SELECT 1 FROM rounds r WHERE (r.plan = b.hash OR r.broadcast = b.hash)"
    " AND (r.state = 'open' OR EXISTS (SELECT 1 FROM mirrors m WHERE m.local = r.id"
    " AND m.kind <> 'buffered' AND m.outcome = '')))"
    " AND NOT EXISTS (SELECT 1 FROM buffered_sessions s WHERE s.state = 'open'"
    " AND (s.plan = b.hash OR s.weights = b.hash OR s.server_state = b.hash))"
)


def _refresh_blob(tx: sql.Tx, h: str, now: float) -> bool:
    """Whether blob `h` is stored (then refreshed: uploaded again now)."""
    return tx.run("UPDATE blobs SET created = ? WHERE hash = ?", (now, h)) > 0


def _insert_blob(tx: sql.Tx, h: str, value: values.Value, now: float) -> None:
    """Stores blob `h` of `value`, unless a concurrent upload stored it first (then its
    value is deleted and the blob refreshed)."""
    if not tx.run("INSERT INTO blobs (hash, size, value, created) VALUES (?, ?, ?, ?)"
                  " ON CONFLICT (hash) DO NOTHING", (h, value.size, value.id, now)):
        values.delete(tx, value.id)
        _refresh_blob(tx, h, now)


def _blob_value(tx: sql.Tx, h: str) -> values.Value:
    row = tx.one("SELECT value FROM blobs WHERE hash = ?", (h,))
    value = None if row is None else values.head(tx, str(row[0]))
    if value is None:
        raise protocol.NotFound(f"Expected the hash of a stored blob, found {h!r}.")
    return value


class BlobWriter:
    """A blob written as it arrives (an upload): `write` its bytes in parts of any size
    (each full chunk is stored in a transaction of its own, staged: `values.Staging`),
    then `commit` (the blob appears whole, in one transaction) or `discard` (nothing of
    it is left; a process killed meanwhile leaves staged chunks that
    `Store.sweep_values` deletes).

    Args:
      store: the task store.
      size: the blob's size in bytes, if known (an upload's `Content-Length`).
    """

    def __init__(self, store: Store, size: int | None = None):
        self.store = store
        self.expected = size
        self._staging = values.Staging(store)

    @property
    def size(self) -> int:
        """The bytes written so far."""
        return self._staging.size

    def write(self, data: bytes | bytearray) -> None:
        """Adds `data` to the blob.

        Raises:
          BadRequest: more bytes than the size given.
          Timeout: what was written before was swept (nothing arrived for
            `Store.staged_grace` seconds).
        """
        if self.expected is not None and self.size + len(data) > self.expected:
            raise protocol.BadRequest(
                f"Expected a blob of {self.expected} bytes, found more.")
        with self._stalled():
            self._staging.write(data)

    def commit(self) -> str:
        """Stores the blob (or refreshes it, if it was stored before); its hash.

        Raises:
          BadRequest: fewer bytes than the size given.
          Timeout: as `write`.
        """
        if self.expected is not None and self.size != self.expected:
            raise protocol.BadRequest(
                f"Expected a blob of {self.expected} bytes, found {self.size}.")
        h, now = self._staging.sha256, self.store.clock()
        with self.store.transaction(write=True) as tx, self._stalled():
            if _refresh_blob(tx, h, now):
                values.delete(tx, self._staging.id)
            else:
                _insert_blob(tx, h, self._staging.finish(tx), now)
        return h

    @contextlib.contextmanager
    def _stalled(self) -> Iterator[None]:
        try:
            yield
        except values.Swept as e:
            raise protocol.Timeout(
                f"Expected a blob's bytes to go on arriving, found none for more than "
                f"{self.store.staged_grace:g} s (what had arrived was deleted); send it "
                "again.") from e

    def discard(self) -> None:
        """Deletes what was written of a blob never committed."""
        self._staging.discard()
