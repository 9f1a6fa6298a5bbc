"""The task store: who is who, on the transaction engine (`engine.Engine`).

`Store` is the engine (connections, transactions, counters, task rows) with what every
mode shares about its callers and their data: the admin token, populations and their
enrolled clients (tokens, device tokens, enrollment, credentials), content-addressed
blobs, the admin audit log, and pace steering (`Pace`: how long an idle client waits).
Each mode keeps its own tables on top of it: `rounds.Rounds` (plain rounds, and the rows
of every round), `secure.SecureRounds` (the SecAgg+ stages of secure rounds) and
`sessions.Sessions` (buffered FedBuff sessions); `admission` holds the checks all three
make of an upload, and `edges.Edges` the credentials of edge aggregators.

Secrets (tokens, credentials) are kept only as hashes (`secret_hash`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import os
import random
import secrets
import time
from collections.abc import Callable
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import engine, sql


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

