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

**Secure rounds** (a plan with secure aggregations) of a population that has edges
(made, not revoked, when the round opens) are run by its edges, as in Bonawitz et al.,
MLSys 2019: every seat goes to an edge (no client is assigned one at the root), the
seats split evenly among the edges (`secure_share`), and each edge runs SecAgg+ over its
own clients and forwards its group's sum folded with their plain reports, which the root
merges like any partial. The merge is exact: a group of n seats sums its clients'
inputs (wrapped to b bits) modulo 2^(b + ceil(log2 n)) (or modulo M), so its sum is their
exact integer sum; the root adds the groups' sums in the round's accumulators (modulo
2^64, or M) and reduces modulo the total count's modulus at the end (`ModularSum`), as
one server and the simulation runtime do. The root has no SecAgg+ state for such a round
(`rounds.RUN_BY_EDGES`) and learns only each group's sum; an edge learns only its
group's. A group needs at least `MIN_SECURE_GROUP` clients (fewer would reveal a
client's input to its edge): a round whose seats cannot give each edge that many is
refused when it is opened (`check_secure`).
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
# The fewest clients an edge runs SecAgg+ over: the sum of one client is its input.
MIN_SECURE_GROUP = 2


def secure_share(total: int, edges: int, joined: int) -> int:
    """The `joined`-th edge's part (0-based) of `total` seats (or reports) of a secure
    round split evenly among `edges` edges: the parts differ by at most one, so the
    smallest group is as large as it can be."""
    return total // edges + (1 if joined < total % edges else 0)


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


def _run_by_edges(tx: sql.Tx, round_id: int) -> bool:
    """Whether secure round `round_id` is run by edges (no SecAgg+ state at the root)."""
    return tx.one("SELECT 1 FROM secure_rounds WHERE round = ?", (round_id,)) is None


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

    def active(self, population: str) -> int:
        """How many edges `population` has (not revoked)."""
        with self.store.transaction() as tx:
            return int(tx.one(
                "SELECT COUNT(*) FROM edges WHERE population = ? AND revoked IS NULL",
                (population,),
            )[0])

    def check_secure(self, population: str, options: rounds_lib.CohortOptions) -> bool:
        """Whether a secure round of `population` opened now is run by its edges (it has
        some); raises if its seats are too few for each edge's group.

        Raises:
          BadRequest: fewer than `MIN_SECURE_GROUP` seats for some edge.
        """
        edges = self.active(population)
        if not edges:
            return False
        if options.capacity // edges < MIN_SECURE_GROUP:
            raise protocol.BadRequest(
                f"Expected at least {MIN_SECURE_GROUP} seats for each edge of population "
                f"{population!r} ({edges} edges) in a secure round (each edge runs SecAgg+ over "
                f"its own clients, and a group of one would show its client's input to the "
                f"edge), found {options.capacity} seats in all; raise the target or the "
                f"over-selection to at least {MIN_SECURE_GROUP * edges} seats, or revoke edges."
            )
        return True

    # -- rounds (the edge)

    def open_rounds(self, edge: str, population: str) -> list[tuple[rounds_lib.Round, Share | None]]:
        """The open plain rounds of `population` (before their deadline), and its secure
        rounds run by edges, with this edge's share of each it joined."""
        self.rounds.close_due()
        now = self.store.clock()
        with self.store.transaction() as tx:
            ids = [row[0] for row in tx.all(
                "SELECT id FROM rounds WHERE population = ? AND state = ?"
                f" AND (kind = ? OR {rounds_lib.RUN_BY_EDGES}) AND deadline > ? ORDER BY id",
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
            secure = r.kind == rounds_lib.SECURE and _run_by_edges(tx, r.id)
            if r.kind != rounds_lib.AGGREGATE and not secure:
                raise protocol.Conflict(
                    f"Expected a plain round, or a secure round run by edges, for an edge to "
                    f"join, found round {r.id} of kind '{r.kind}' run by the root (it was opened "
                    "before the population had edges)."
                )
            if r.state != rounds_lib.OPEN or r.deadline <= now:
                raise protocol.Gone(f"Expected an open round, found round {r.id} {r.state}.")
            edges = tx.one(
                "SELECT COUNT(*) FROM edges WHERE population = ? AND revoked IS NULL",
                (population,),
            )[0]
            if secure:
                capacity, target = self._secure_share(tx, r, max(1, edges))
            else:
                capacity = min(math.ceil(r.capacity / max(1, edges)), r.capacity - r.assigned)
            if capacity <= 0:
                raise protocol.Conflict(
                    f"Expected a seat left in round {r.id}, found all {r.capacity} taken; the "
                    "edge waits for the next round.", reason="full",
                )
            if not secure:
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

    def _secure_share(self, tx: sql.Tx, r: rounds_lib.Round, edges: int) -> tuple[int, int]:
        """(seats, target) of the next edge joining secure round `r` (split evenly).

        Raises:
          Conflict: fewer than `MIN_SECURE_GROUP` seats for it (edges were made after the
            round opened, or its seats are gone).
        """
        joined = int(tx.one("SELECT COUNT(*) FROM edge_shares WHERE round = ?", (r.id,))[0])
        capacity = min(secure_share(r.capacity, edges, joined), r.capacity - r.assigned)
        if 0 < capacity < MIN_SECURE_GROUP:
            raise protocol.Conflict(
                f"Expected at least {MIN_SECURE_GROUP} seats for an edge's group in secure round "
                f"{r.id}, found {capacity} left (its {r.capacity} seats split among {edges} "
                "edges); the edge waits for the next round. Open rounds with more seats, or "
                "revoke edges.", reason="full",
            )
        target = min(max(1, secure_share(r.target, edges, joined)), capacity)
        return capacity, target

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
