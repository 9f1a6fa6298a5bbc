"""Edge aggregators, at the root: their credentials, their shares of rounds, and the
partial aggregates they forward.

An edge is a server of its own (`fedlang serve --upstream`) that serves some of a
population's clients and speaks to the root for them. The root's admin makes its
credential (`create`: a bearer token, kept as a hash, revocable). An edge sees the open
plain rounds of its population; joining one (`join`) gives it a **share**: seats for
its clients (`capacity`, taken from the round's like assignments of clients, so the
round's capacity is never exceeded) and the reports it should gather (`target`), each
the round's divided by the population's edges. The edge forwards one partial aggregate
per round (`accept`): its reports folded together, which the root merges into the
round's aggregate counting its N reports, in one transaction, admitted as any upload
(`admission`: a replay of the same bytes changes nothing; other bytes are refused, 409).
An edge that has not forwarded when the round ends is dropped, its seats counted as
dropouts (`rounds.drop_edge_shares`).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from collections.abc import Callable
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import admission, sql
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import store as store_lib

JOINED, FORWARDED, DROPPED = (admission.Assignment.ASSIGNED, admission.Assignment.REPORTED,
                              admission.Assignment.DROPPED)


@dataclasses.dataclass(frozen=True)
class Share:
    """An edge's part in a round: its seats (`capacity`), the reports it gathers
    (`target`), and what it forwarded (`digest`, `reports`, `dropped`)."""

    round: int
    edge: str
    state: str
    target: int
    capacity: int
    digest: str | None
    reports: int
    dropped: int

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


_SHARE_FIELDS = "round, edge, state, target, capacity, digest, reports, dropped"


def _share(tx: sql.Tx, round_id: int, edge: str) -> Share | None:
    row = tx.one(
        f"SELECT {_SHARE_FIELDS} FROM edge_shares WHERE round = ? AND edge = ?", (round_id, edge)
    )
    return None if row is None else Share(*row)


class Edges:
    """The edges of a task store (see the module docstring)."""

    def __init__(self, rounds: rounds_lib.Rounds):
        self.rounds = rounds
        self.store: store_lib.Store = rounds.store

    # -- credentials (admin)

    def create(self, name: str, population: str) -> str:
        """Makes edge `name` of `population`; returns its token (kept only as a hash).

        Raises:
          NotFound: no such population.
          Conflict: an edge of that name exists.
        """
        token = secrets.token_urlsafe(24)
        with self.store.transaction(write=True) as tx:
            if tx.one("SELECT 1 FROM populations WHERE name = ?", (population,)) is None:
                raise protocol.NotFound(
                    f"Expected an existing population, found {population!r}; create it first."
                )
            added = tx.run(
                "INSERT INTO edges (name, population, token_hash, created) VALUES (?, ?, ?, ?)"
                " ON CONFLICT (name) DO NOTHING",
                (name, population, store_lib.secret_hash(token), self.store.clock()),
            )
        if not added:
            raise protocol.Conflict(
                f"Expected a new edge name, found {name!r}, which exists; pick another name "
                "(or revoke that edge)."
            )
        return token

    def revoke(self, name: str) -> str:
        """Revokes edge `name` (its token gets 401 from now on); returns its population.

        Raises:
          NotFound: no such edge.
        """
        with self.store.transaction(write=True) as tx:
            row = tx.one("SELECT population FROM edges WHERE name = ?", (name,))
            if row is None:
                raise protocol.NotFound(f"Expected an existing edge, found {name!r}.")
            tx.run("UPDATE edges SET revoked = ? WHERE name = ? AND revoked IS NULL",
                   (self.store.clock(), name))
        return str(row[0])

    def edges(self) -> list[dict[str, Any]]:
        with self.store.transaction() as tx:
            rows = tx.all("SELECT name, population, created, revoked FROM edges ORDER BY name")
        return [{"name": n, "population": p, "created": c, "revoked": r} for n, p, c, r in rows]

    def authenticate(self, token: str) -> tuple[str, str]:
        """(edge name, population) of an edge's token; a refusal is counted.

        Raises:
          Unauthorized: an unknown or revoked token.
        """
        with self.store.transaction() as tx:
            row = tx.one(
                "SELECT name, population, revoked FROM edges WHERE token_hash = ?",
                (store_lib.secret_hash(token),),
            )
        if row is None or row[2] is not None:
            self.store.count_refusal("unauthorized")
            raise protocol.Unauthorized(
                "Expected an edge token made by the root's admin (POST /v1/admin/edges), "
                f"found {'a revoked' if row is not None else 'an unknown'} one; ask the "
                "root's admin for a token."
            )
        return str(row[0]), str(row[1])

    # -- rounds (the edge)

    def open_rounds(self, edge: str, population: str) -> list[tuple[rounds_lib.Round, Share | None]]:
        """The open plain rounds of `population` (before their deadline), with this edge's
        share of each it joined."""
        self.rounds.close_due()
        now = self.store.clock()
        with self.store.transaction() as tx:
            ids = [row[0] for row in tx.all(
                "SELECT id FROM rounds WHERE population = ? AND state = ? AND kind = ?"
                " AND deadline > ? ORDER BY id",
                (population, rounds_lib.OPEN, rounds_lib.AGGREGATE, now),
            )]
            return [(self.rounds.round_in(tx, i), _share(tx, i, edge)) for i in ids]

    def join(self, edge: str, population: str, round_id: int) -> tuple[rounds_lib.Round, Share]:
        """The round and this edge's share of it, made now if it has none: seats and a
        target, each the round's divided by the population's edges (rounded up), the seats
        taken from those the round has left (as assignments are).

        Raises:
          NotFound: no such round in the edge's population.
          Conflict: not a plain round, or no seat left.
          Gone: the round is no longer open.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            r = self._round(tx, round_id, population)
            share = _share(tx, round_id, edge)
            if share is not None:
                return r, share
            if r.kind != rounds_lib.AGGREGATE:
                raise protocol.Conflict(
                    f"Expected a plain round for an edge to join, found round {r.id} of kind "
                    f"'{r.kind}'; edges serve plain rounds only."
                )
            if r.state != rounds_lib.OPEN or r.deadline <= now:
                raise protocol.Gone(f"Expected an open round, found round {r.id} {r.state}.")
            edges = tx.one(
                "SELECT COUNT(*) FROM edges WHERE population = ? AND revoked IS NULL",
                (population,),
            )[0]
            capacity = min(math.ceil(r.capacity / max(1, edges)), r.capacity - r.assigned)
            if capacity <= 0:
                raise protocol.Conflict(
                    f"Expected a seat left in round {r.id}, found all {r.capacity} taken; the "
                    "edge waits for the next round.", reason="full",
                )
            target = min(math.ceil(r.target / max(1, edges)), capacity)
            tx.run(
                "INSERT INTO edge_shares (round, edge, state, target, capacity, joined)"
                " VALUES (?, ?, ?, ?, ?, ?)",
                (r.id, edge, JOINED, target, capacity, now),
            )
            tx.run("UPDATE rounds SET assigned = assigned + ? WHERE id = ?", (capacity, r.id))
            tx.count("edge_joins")
            share = _share(tx, round_id, edge)
            assert share is not None
            return self.rounds.round_in(tx, round_id), share

    def _round(self, tx: sql.Tx, round_id: int, population: str,
               lock: bool = True) -> rounds_lib.Round:
        r = self.rounds.round_in(tx, round_id, lock=lock)
        if r.population != population:  # as if it did not exist: populations are isolated
            raise protocol.NotFound(f"Expected a round of population {population!r}, found none "
                                    f"numbered {round_id}.")
        return r

    # -- partial aggregates

    def _slot(self, tx: sql.Tx, r: rounds_lib.Round, edge: str) -> admission.Slot:
        share = _share(tx, r.id, edge)
        return admission.Slot(
            owner=f"round {r.id}", part=f"edge {edge}'s share", upload="partial aggregate",
            accepted=None if share is None else share.digest,
            assignment=None if share is None else share.state,
            open=r.state == rounds_lib.OPEN and share is not None and share.state == JOINED,
            state=r.state,
        )

    def precheck(self, round_id: int, edge: str, population: str, digest: str) -> bool:
        """Whether this exact partial was already accepted (True: nothing to do); raises
        what `accept` would for a partial the round cannot take."""
        with self.store.transaction() as tx:
            r = self._round(tx, round_id, population, lock=False)
            return admission.admit(self._slot(tx, r, edge), digest)

    def accept(
        self,
        round_id: int,
        edge: str,
        population: str,
        digest: str,
        size: int,
        reports: int,
        dropped: int,
        merge: Callable[[bytes], bytes],
    ) -> bool:
        """Merges an edge's checked partial aggregate of `reports` reports into the
        round's aggregate, counts them (and its `dropped` clients), and closes the round
        at its target, in one transaction. False for a replay (nothing changes).

        Raises:
          Forbidden, Gone, Conflict: see `admission.admit`.
          BadRequest: more reports and dropouts than the edge's seats.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            r = self._round(tx, round_id, population)
            if r.state == rounds_lib.OPEN and r.deadline <= now:
                self.rounds.close_in(tx, r, now)
                r = self.rounds.round_in(tx, round_id)
            slot = self._slot(tx, r, edge)
            if admission.admit(slot, digest):
                return False
            share = _share(tx, round_id, edge)
            assert share is not None
            if reports + dropped > share.capacity:
                raise protocol.BadRequest(
                    f"Expected at most {share.capacity} reports and dropouts (the edge's seats "
                    f"in round {r.id}), found {reports} and {dropped}."
                )
            aggregate = bytes(tx.one("SELECT data FROM aggregates WHERE round = ?", (r.id,))[0])
            tx.run(
                "UPDATE aggregates SET data = ?, reports = reports + ? WHERE round = ?",
                (merge(aggregate), reports, r.id),
            )
            tx.run(
                "UPDATE rounds SET reports = reports + ?, dropped = dropped + ? WHERE id = ?",
                (reports, dropped, r.id),
            )
            tx.run(
                "UPDATE edge_shares SET state = ?, digest = ?, size = ?, reports = ?, dropped = ?,"
                " accepted = ? WHERE round = ? AND edge = ?",
                (FORWARDED, digest, size, reports, dropped, now, r.id, edge),
            )
            tx.count("reports:accepted", reports)
            tx.count("dropouts", dropped)
            tx.count("partials:accepted")
            if r.reports + reports >= r.target:
                self.rounds.close_in(tx, self.rounds.round_in(tx, r.id), now)
        return True

    def shares(self, round_id: int) -> list[Share]:
        """The edges' shares of a round."""
        with self.store.transaction() as tx:
            rows = tx.all(f"SELECT {_SHARE_FIELDS} FROM edge_shares WHERE round = ?"
                          " ORDER BY edge", (round_id,))
        return [Share(*row) for row in rows]

    def count_refusal(self, reason: str, round_id: int) -> None:
        """Counts a refused partial (`refused:REASON`, and in its round)."""
        self.rounds.count_refusal(reason, round_id)
