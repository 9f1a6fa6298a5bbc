"""At an edge aggregator: which of its rounds mirrors which round of the root, and
whether its partial aggregate was forwarded (`edge/`).

A mirrored round is an ordinary round of the edge's store (its clients check in, report
and are folded exactly as at any server), opened with the root's plan and broadcast,
with the edge's share of the root round as its cohort; its row here is written in the
transaction that opens it, so a restarted edge finds every round it mirrors and
forwards each that ended and was not acknowledged. A secure root round (run by its
edges) is mirrored by a secure round of the edge's store (`open` with `prepare`): its
clients run SecAgg+ with the edge as with any server.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sql
from fedlang.deploy.store import store as store_lib


@dataclasses.dataclass(frozen=True)
class Mirror:
    """A root round (`upstream`) and the edge's round that mirrors it (`round`)."""

    upstream: int
    round: int
    forwarded: float | None
    outcome: str


class Upstream:
    """The mirrored rounds of an edge's store (see the module docstring)."""

    def __init__(self, rounds: rounds_lib.Rounds):
        self.rounds = rounds
        self.store: store_lib.Store = rounds.store

    def open(
        self,
        upstream: int,
        population: str,
        plan: str,
        broadcast: str,
        options: rounds_lib.CohortOptions,
        empty_aggregate: bytes,
        prepare: Callable[[sql.Tx, rounds_lib.Round], None] | None = None,
    ) -> rounds_lib.Round:
        """The edge's round mirroring root round `upstream`, opened now if new (with
        `plan`, the edge's signed copy of the root's, and `options`, its share). For a
        secure root round run by its edges, `prepare` (`SecureRounds.prepare`'s, for
        `options`) makes the edge's round a secure round of its own, its SecAgg+ state
        written in the transaction that opens it."""

        def record(tx: sql.Tx, r: rounds_lib.Round) -> None:
            if prepare is not None:
                prepare(tx, r)
            tx.run("INSERT INTO upstream_rounds (upstream, round) VALUES (?, ?)", (upstream, r.id))

        kind = rounds_lib.AGGREGATE if prepare is None else rounds_lib.SECURE
        return self.rounds.create(
            population, plan, broadcast, options, empty_aggregate,
            request_id=f"upstream-round-{upstream}", kind=kind, on_create=record,
        )

    def mirrors(self, pending: bool = False) -> list[Mirror]:
        """The mirrored rounds (`pending`: only those not forwarded yet), oldest first."""
        where = " WHERE forwarded IS NULL" if pending else ""
        with self.store.transaction() as tx:
            rows = tx.all("SELECT upstream, round, forwarded, outcome FROM upstream_rounds"
                          f"{where} ORDER BY upstream")
        return [Mirror(*row) for row in rows]

    def forwarded(self, upstream: int, outcome: str) -> None:
        """Records that root round `upstream` took the partial (or refused it: `outcome`)."""
        with self.store.transaction(write=True) as tx:
            tx.run("UPDATE upstream_rounds SET forwarded = ?, outcome = ? WHERE upstream = ?",
                   (self.store.clock(), outcome, upstream))
            tx.count(f"partials:{outcome}")

    def pinned_key(self, key: bytes) -> bytes:
        """The root's public key this edge pinned (`key`, on first contact)."""
        with self.store.transaction(write=True) as tx:
            tx.run("INSERT INTO meta (key, value) VALUES ('upstream_key', ?)"
                   " ON CONFLICT (key) DO NOTHING", (key,))
            return bytes(tx.one("SELECT value FROM meta WHERE key = 'upstream_key'")[0])
