"""Edge aggregators, at the root: their credentials, and how a round's seats are split
among them.

An edge is a server of its own (`fedlang serve --upstream`) that serves some of a
population's clients and speaks to the root for them. The root's admin makes its
credential (`create`: a bearer token, kept as a hash, revocable). At the root **an edge
is a client that holds seats**: joining an open round (`join`) gives it an assignment of
several seats (`rounds.assign`, `holder(name)`: `edge:NAME`), taken from the round's like
a client's one seat, so the round's capacity is never exceeded; its one upload, a
partial aggregate of its clients' reports, is admitted, folded and counted by the same
intake and shards as any report (`shards.ReportShards`), standing for the reports it
folded; the seats of an edge that has not forwarded when the round ends are dropouts
(`rounds.end_round`). This module only says who the edges are and how many seats each
gets, and how many of the round's reports it gathers (a plain round's: the round's divided by
the population's edges, rounded up).

**Secure rounds** (a plan with secure aggregations) of a population that has edges
(made, not revoked, when the round opens) are run by its edges, as in Bonawitz et al.,
MLSys 2019: every seat goes to an edge (no client is assigned one at the root), the
seats split evenly among the edges (`secure_share`), and each edge runs SecAgg+ over its
own clients and forwards its group's sum folded with their plain reports, which the root
folds like any partial. The merge is exact: a group of n seats sums its clients' inputs
(wrapped to b bits) modulo 2^(b + ceil(log2 n)) (or modulo M), so its sum is their exact
integer sum; the root adds the groups' sums in the round's accumulators (modulo 2^64, or
M) and reduces modulo the total count's modulus at the end (`ModularSum`), as one server
and the simulation runtime do. The root has no SecAgg+ state for such a round
(`rounds.Round.folded`) and learns only each group's sum; an edge learns only its
group's. A group needs at least `MIN_SECURE_GROUP` clients (fewer would reveal a
client's input to its edge): a round whose seats cannot give each edge that many is
refused when it is opened (`check_secure`).
"""

from __future__ import annotations

import dataclasses
import math
import secrets
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib

# The fewest clients an edge runs SecAgg+ over: the sum of one client is its input.
MIN_SECURE_GROUP = 2
# An edge's name as the holder of its seats (`assignments.client`, `reports.client`):
# never a client's id (`c-...`).
HOLDER = "edge:"


def holder(name: str) -> str:
    """The holder of edge `name`'s seats and uploads."""
    return HOLDER + name


def secure_share(total: int, edges: int, joined: int) -> int:
    """The `joined`-th edge's part (0-based) of `total` seats (or reports) of a secure round split
    evenly among `edges` edges: the parts differ by at most one, so the smallest group is
    as large as it can be."""
    return total // edges + (1 if joined < total % edges else 0)


@dataclasses.dataclass(frozen=True)
class Share:
    """An edge's part in a round: its seats (`capacity`), the reports it should gather
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


def _shares(tx: sql.Tx, r: rounds_lib.Round, edge: str | None = None) -> list[Share]:
    """The edges' shares of round `r` (or only edge `edge`'s), read in `tx`."""
    only = "" if edge is None else " AND e.name = ?"
    rows = tx.all(
        "SELECT e.name, a.state, a.target, a.seats, u.digest, COALESCE(u.count, 0),"
        " COALESCE(u.dropped, 0) FROM assignments a JOIN edges e ON a.client = ? || e.name"
        " LEFT JOIN reports u ON u.round = a.round AND u.client = a.client AND u.stage = 0"
        f" WHERE a.round = ?{only} ORDER BY e.name",
        (HOLDER, r.id) + (() if edge is None else (edge,)),
    )
    return [Share(r.id, str(name), str(state), int(target), int(seats),
                  None if digest is None else str(digest), int(n), int(dropped))
            for name, state, target, seats, digest, n, dropped in rows]


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
        """(edge name, population) of an edge's token.

        Raises:
          Unauthorized: an unknown or revoked token.
        """
        with self.store.transaction() as tx:
            row = tx.one(
                "SELECT name, population, revoked FROM edges WHERE token_hash = ?",
                (store_lib.secret_hash(token),),
            )
        if row is None or row[2] is not None:
            raise protocol.Unauthorized(
                "Expected an edge token made by the root's admin (POST /v1/admin/edges), "
                f"found {'a revoked' if row is not None else 'an unknown'} one; ask the "
                "root's admin for a token."
            )
        return str(row[0]), str(row[1])

    def active(self, population: str) -> int:
        """How many edges `population` has (not revoked)."""
        with self.store.transaction() as tx:
            return self._active(tx, population)

    @staticmethod
    def _active(tx: sql.Tx, population: str) -> int:
        return int(tx.one(
            "SELECT COUNT(*) FROM edges WHERE population = ? AND revoked IS NULL", (population,)
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

    # -- seats (the edge)

    def open_rounds(self, edge: str, population: str) -> list[tuple[rounds_lib.Round, Share | None]]:
        """The open folded rounds of `population` before their deadline (plain rounds,
        and secure rounds run by edges), with this edge's share of each it joined."""
        self.rounds.close_due()
        now = self.store.clock()
        with self.store.transaction() as tx:
            ids = [row[0] for row in tx.all(
                f"SELECT id FROM rounds WHERE population = ? AND state = ? AND {rounds_lib.FOLDED}"
                " AND deadline > ? ORDER BY id",
                (population, rounds_lib.OPEN, now),
            )]
            out = []
            for i in ids:
                r = self.rounds.round_in(tx, i)
                out.append((r, next(iter(_shares(tx, r, edge)), None)))
            return out

    def join(self, edge: str, population: str, round_id: int) -> tuple[rounds_lib.Round, Share]:
        """The round and this edge's share of it, its seats assigned now if it has none:
        the round's seats divided by the population's edges (rounded up; a secure round's
        split evenly), taken from those the round has left (as a client's seat is).

        Raises:
          NotFound: no such round in the edge's population.
          Conflict: a secure round run by the root, or no seat left.
          Gone: the round is no longer open.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            r = self.rounds.round_in(tx, round_id, lock=True)
            if r.population != population:  # as if it did not exist: populations are isolated
                raise protocol.NotFound(f"Expected a round of population {population!r}, "
                                        f"found none numbered {round_id}.")
            shares = _shares(tx, r, edge)
            if shares:
                return r, shares[0]
            if not r.folded:
                raise protocol.Conflict(
                    f"Expected a plain round, or a secure round run by edges, for an edge to "
                    f"join, found round {r.id} of kind '{r.kind}' run by the root (it was opened "
                    "before the population had edges)."
                )
            if r.state != rounds_lib.OPEN or r.deadline <= now:
                raise protocol.Gone(f"Expected an open round, found round {r.id} {r.state}.")
            edges = max(1, self._active(tx, population))
            if r.kind == rounds_lib.SECURE:
                seats, target = self._secure_share(tx, r, edges)
            else:
                seats = min(math.ceil(r.capacity / edges), r.capacity - r.assigned)
                target = min(math.ceil(r.target / edges), seats)
            if seats <= 0:
                raise protocol.Conflict(
                    f"Expected a seat left in round {r.id}, found all {r.capacity} taken; the "
                    "edge waits for the next round.", reason="full",
                )
            rounds_lib.assign(tx, r, holder(edge), now, seats, target)
            r = self.rounds.round_in(tx, round_id)
            return r, _shares(tx, r, edge)[0]

    def _secure_share(self, tx: sql.Tx, r: rounds_lib.Round, edges: int) -> tuple[int, int]:
        """(seats, target) of the next edge joining secure round `r` (split evenly).

        Raises:
          Conflict: fewer than `MIN_SECURE_GROUP` seats for it (edges were made after the
            round opened, or its seats are gone).
        """
        joined = int(tx.one("SELECT COUNT(*) FROM assignments WHERE round = ?", (r.id,))[0])
        seats = min(secure_share(r.capacity, edges, joined), r.capacity - r.assigned)
        if 0 < seats < MIN_SECURE_GROUP:
            raise protocol.Conflict(
                f"Expected at least {MIN_SECURE_GROUP} seats for an edge's group in secure round "
                f"{r.id}, found {seats} left (its {r.capacity} seats split among {edges} "
                "edges); the edge waits for the next round. Open rounds with more seats, or "
                "revoke edges.", reason="full",
            )
        return seats, min(max(1, secure_share(r.target, edges, joined)), seats)

    def shares(self, round_id: int) -> list[Share]:
        """The edges' shares of a round.

        Raises:
          NotFound: no such round.
        """
        with self.store.transaction() as tx:
            return _shares(tx, self.rounds.round_in(tx, round_id))
