"""Rounds in the task store: every round's row, and the plain rounds' reports.

A round of a population has a signed plan and a broadcast value (blobs, by hash), cohort
options (`CohortOptions`: target, over-selection, quorum, deadline) and counters. Its
`kind` is `aggregate` (a plain round: one report per client) or `secure` (the four
stages of SecAgg+, run by `secure.SecureRounds` on top of these rows; its reports carry
the stage number of each client message). A checking-in client is assigned to an open
round with room (`checkin`), or told when to come back (pace steering, `store.Pace`:
a client selected lately waits out its rest first, so that selection stays uniform).

A client holds one **seat** of a round (its assignment); an edge aggregator holds several
for its own clients (`edges.py` splits a round's seats among its edges), and its one
upload, a partial aggregate, stands for the reports of its clients (`count`) and says
how many of them dropped out. Every upload is admitted the same way (`admission`: a
replay, a second upload, a holder of no seat, a round closed) and taken by the shards
(`shards.ReportShards`): each server process folds reports in memory into its own
*shard* of the round's aggregate, many to a transaction, and commits the shard's row
(`aggregate_shards`) with their digests; a round's `reports` is its row's count plus
its shards'. A round closes at its target, or at its deadline with at least its quorum
of reports (below it, it fails): the close merges its shards into its aggregate, and
counts as dropouts the seats still held without an upload and those its uploads said
dropped out (`end_round`). A round's aggregate is a value in chunks (`values`), deleted
once `KEPT_AGGREGATES` later rounds of its population closed (`Rounds.sweep`, on the
server's tick, with the blobs no task needs).

A secure round whose SecAgg+ stages run here (`secure.SecureRounds`: a `secure_rounds`
row) takes its clients' messages stage by stage; one without (its seats held by edges,
each running SecAgg+ over its own clients) takes partial aggregates through the shards
and closes by count or deadline, as a plain round (`Round.folded`, `FOLDED`).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import admission, sql, values
from fedlang.deploy.store import store as store_lib

OPEN, CLOSED, FAILED = protocol.RoundState
AGGREGATE, SECURE = protocol.TaskKind.AGGREGATE, protocol.TaskKind.SECURE
ASSIGNED = admission.Assignment.ASSIGNED
# A round whose uploads are folded by the shards and that closes by its count or deadline
# (`Round.folded`): a plain round, or a secure round with no SecAgg+ stages here.
FOLDED = "NOT EXISTS (SELECT 1 FROM secure_rounds s WHERE s.round = rounds.id)"

# A population's latest closed rounds whose aggregates are kept (and a failed round's,
# until as many later rounds ended; older ones are deleted: `Rounds.sweep_aggregates`):
# the driver reads a round's aggregate as soon as it closes, before the next round.
KEPT_AGGREGATES = 2
# Seconds between the sweeps of values no task needs any more (`Rounds.sweep`).
SWEEP_SECONDS = 10.0

_ROUND_FIELDS = (
    "id, population, kind, state, plan, broadcast, target, capacity, quorum, deadline, created,"
    " closed, assigned, CAST(reports + COALESCE((SELECT SUM(a.reports) FROM aggregate_shards a"
    " WHERE a.round = rounds.id), 0) AS BIGINT), late, dropped, refused, failure,"
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
    kind: protocol.TaskKind
    state: protocol.RoundState
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
    stage: int  # a secure round's SecAgg+ stage (secagg.Stage); 0 when none runs here

    @property
    def folded(self) -> bool:
        """Whether its uploads are folded by the shards and it closes by count or deadline
        (`FOLDED`): a plain round, or a secure round whose SecAgg+ runs elsewhere (its
        seats held by edges, which forward their groups' sums)."""
        return self.stage == 0

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
    kind: protocol.TaskKind = protocol.TaskKind.AGGREGATE


def _round_of(row: Any) -> Round:
    return Round(row[0], row[1], protocol.TaskKind(row[2]), protocol.RoundState(row[3]), *row[4:])


def end_round(
    tx: sql.Tx, round_id: int, state: protocol.RoundState, failure: str, now: float
) -> None:
    """Ends a round in `state` (CLOSED or FAILED): the seats still held without an upload
    count as dropped (an edge that did not forward took its clients with it), and so do
    those its uploads said dropped out; the store's counters record the dropouts and the
    outcome."""
    seats = int(tx.one(
        "SELECT COALESCE(SUM(seats), 0) FROM assignments WHERE round = ? AND state = ?",
        (round_id, ASSIGNED),
    )[0])
    tx.run(
        "UPDATE assignments SET state = ?, updated = ? WHERE round = ? AND state = ?",
        (admission.Assignment.DROPPED, now, round_id, ASSIGNED),
    )
    dropped = seats + int(tx.one(
        "SELECT COALESCE(SUM(dropped), 0) FROM reports WHERE round = ?", (round_id,))[0])
    tx.run(
        "UPDATE rounds SET state = ?, closed = ?, dropped = dropped + ?, failure = ?"
        " WHERE id = ?",
        (state, now, dropped, failure, round_id),
    )
    tx.count("dropouts", dropped)
    tx.count(f"rounds:{state}")


def aggregate_value(tx: sql.Tx, round_id: int) -> values.Value | None:
    """The head of round `round_id`'s aggregate (None: none, or deleted: `KEPT_AGGREGATES`)."""
    row = tx.one("SELECT value FROM aggregates WHERE round = ?", (round_id,))
    return None if row is None else values.head(tx, str(row[0]))


def read_aggregate(tx: sql.Tx, round_id: int) -> bytes:
    """Round `round_id`'s aggregate, whole (`values.read`: its SHA-256 checked).

    Raises:
      Gone: its aggregate was deleted (`KEPT_AGGREGATES`).
    """
    value = aggregate_value(tx, round_id)
    if value is None:
        raise aggregate_deleted(round_id)
    return values.read(tx, value)


def aggregate_deleted(round_id: int) -> protocol.Gone:
    """The refusal of a read of round `round_id`'s aggregate, deleted (`KEPT_AGGREGATES`)."""
    return protocol.Gone(
        f"Expected the aggregate of one of the latest {KEPT_AGGREGATES} closed rounds of a "
        f"population, found round {round_id}'s deleted; read an aggregate as soon as its "
        "round closes.", reason="deleted")


@dataclasses.dataclass(frozen=True)
class _FoldedAhead:
    """A round's aggregate folded before its close (`Rounds._fold_ahead`): what it was
    folded from (`_fold_inputs`) and the staged value it was written to."""

    inputs: tuple[str, list[str], list[str]]
    staging: values.Staging


def _fold_inputs(tx: sql.Tx, round_id: int, shards: list[Any],
                 stored: list[str]) -> tuple[str, list[str], list[str]]:
    """What a round's fold takes: its aggregate's value, its shards' (those that hold
    one) and its stored reports', by id: every write makes a new id, so the same ids
    are the same bytes."""
    aggregate = tx.one("SELECT value FROM aggregates WHERE round = ?", (round_id,))
    return (str(aggregate[0]) if aggregate else "",
            sorted(str(row[0]) for row in shards if row[0]), stored)


def write_aggregate(tx: sql.Tx, round_id: int, data: bytes | Iterable[bytes] | values.Value,
                    reports: int = 0) -> None:
    """Replaces round `round_id`'s aggregate by `data` (its bytes, or their parts as
    made, written as a new value; or a value written already) and adds `reports` to its
    count, in `tx`; the old value is deleted."""
    old = tx.one("SELECT value FROM aggregates WHERE round = ?", (round_id,))[0]
    if isinstance(data, values.Value):
        value = data
    else:
        value = values.write(tx, [data] if isinstance(data, bytes | bytearray) else data)
    tx.run("UPDATE aggregates SET value = ?, reports = reports + ? WHERE round = ?",
           (value.id, reports, round_id))
    values.delete(tx, str(old))


def fold_report(
    tx: sql.Tx, round_id: int, client_id: str, fold: Callable[[bytes], bytes], now: float
) -> None:
    """Folds an accepted report into its round's stored aggregate (`fold(aggregate)`),
    marks the client's assignment reported, and counts the report, in `tx` (a secure
    round's plain report, taken with its client's masked input)."""
    write_aggregate(tx, round_id, fold(read_aggregate(tx, round_id)), reports=1)
    tx.run(
        "UPDATE assignments SET state = ?, updated = ? WHERE round = ? AND client = ?",
        (admission.Assignment.REPORTED, now, round_id, client_id),
    )
    tx.run("UPDATE rounds SET reports = reports + 1 WHERE id = ?", (round_id,))
    tx.count("reports:accepted")


def record_upload(
    tx: sql.Tx, round_id: int, client_id: str, stage: int, digest: str, size: int, now: float
) -> None:
    """Records the digest of an accepted upload (a report: stage 0; a secure round's
    answer: its stage), by which its replays are admitted and another one refused."""
    tx.run(
        "INSERT INTO reports (round, client, stage, digest, size, accepted)"
        " VALUES (?, ?, ?, ?, ?, ?)",
        (round_id, client_id, stage, digest, size, now),
    )


@dataclasses.dataclass(frozen=True)
class Held:
    """What one holder has in a round, as admission reads it: the digest of its upload
    accepted there (None: none yet), its assignment's state (None: it holds no seat),
    and its seats."""

    accepted: str | None = None
    assignment: str | None = None
    seats: int = 0


def held(tx: sql.Tx, round_id: int, clients: Sequence[str], stage: int = 0) -> dict[str, Held]:
    """What each of `clients` holds in round `round_id` (its upload of `stage`, its
    seats), read in two statements whatever their number; a client with neither is
    left out."""
    marks = ", ".join("?" for _ in clients)
    accepted = dict(tx.all(
        f"SELECT client, digest FROM reports WHERE round = ? AND stage = ? AND client IN ({marks})",
        (round_id, stage, *clients),
    ))
    seats = {str(c): (str(st), int(n)) for c, st, n in tx.all(
        f"SELECT client, state, seats FROM assignments WHERE round = ? AND client IN ({marks})",
        (round_id, *clients),
    )}
    return {
        str(c): Held(None if c not in accepted else str(accepted[c]),
                     *(seats.get(str(c)) or (None, 0)))
        for c in {*accepted, *seats}
    }


def slot(
    r: Round, h: Held, part: str = "", upload: str = "report"
) -> admission.Slot:
    """A holder's slot for an upload to round `r` (see `admission`), from what it holds
    there (`held`): open while the round is; a folded round's upload also needs its
    seats still held (not dropped)."""
    still = not r.folded or h.assignment == ASSIGNED
    return admission.Slot(
        owner=f"round {r.id}", part=part, upload=upload, accepted=h.accepted,
        assignment=h.assignment, open=r.state == OPEN and still, state=r.state,
    )


def folded_only(r: Round) -> None:
    """Raises Conflict unless `r` takes uploads folded by the shards (`Round.folded`)."""
    if not r.folded:
        raise protocol.Conflict(
            f"Expected a report for an aggregate round, found round {r.id} of kind "
            f"'{r.kind}'; take part in its stages instead (GET /v1/rounds/{r.id}/secagg)."
        )


def assign(tx: sql.Tx, r: Round, holder: str, now: float, seats: int = 1,
           target: int = 1) -> None:
    """Gives `holder` (a client, or an edge for its clients) `seats` seats of round `r`,
    read locked in `tx`, which has room for them, and `target` of its reports to gather."""
    tx.run(
        "INSERT INTO assignments (round, client, state, assigned, updated, seats, target)"
        " VALUES (?, ?, ?, ?, ?, ?, ?)",
        (r.id, holder, ASSIGNED, now, now, seats, target),
    )
    tx.run("UPDATE rounds SET assigned = assigned + ? WHERE id = ?", (seats, r.id))
    tx.count("assignments", seats)


class Rounds:
    """The rounds of a task store (see the module docstring).

    Args:
      store: the task store.
      folders: a round's `Folder` by its signed plan's hash, to merge its shards at close
        (needed once a round has shards: `shards.ReportShards` writes them).
    """

    def __init__(
        self, store: store_lib.Store, folders: Callable[[str], folding.Folder] | None = None
    ):
        self.store = store
        self.folders = folders
        self._next_sweep = -math.inf

    def create(
        self,
        population: str,
        plan: str,
        broadcast: str,
        options: CohortOptions,
        empty_aggregate: bytes | Iterable[bytes],
        request_id: str | None = None,
        kind: protocol.TaskKind = AGGREGATE,
        on_create: Callable[[sql.Tx, Round], None] | None = None,
    ) -> Round:
        """Opens a round of `population` (or returns the round made for `request_id`).

        `on_create(tx, round)` writes, in the same transaction, what a round of this kind
        needs besides its row (a secure round's protocol state).

        Raises:
          NotFound: no such population.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            round_id, new = self.store.new_id(tx, "rounds", population, request_id)
            if not new:
                return self.round_in(tx, round_id)
            tx.run(
                "INSERT INTO rounds (id, population, kind, state, request_id, plan, broadcast,"
                " target, capacity, quorum, deadline, created) VALUES"
                " (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (round_id, population, kind, OPEN, request_id, plan, broadcast, options.target,
                 options.capacity, options.minimum, now + options.deadline, now),
            )
            tx.run(
                "INSERT INTO aggregates (round, value, reports) VALUES (?, ?, 0)",
                (round_id, values.write(tx, [empty_aggregate] if isinstance(empty_aggregate, bytes)
                                        else empty_aggregate).id),
            )
            if on_create is not None:
                on_create(tx, self.round_in(tx, round_id))
            return self.round_in(tx, round_id)

    def round_in(self, tx: sql.Tx, round_id: int, *, lock: bool = False) -> Round:
        """A round's row, read in `tx` (`lock`: locked until `tx` ends, for a writer).

        Raises:
          NotFound: no such round.
        """
        return _round_of(self.store.task_row(tx, "rounds", _ROUND_FIELDS, round_id, "round", lock))

    def round(self, round_id: int) -> Round:
        """A round's current row (closing it first if its deadline passed).

        Raises:
          NotFound: no such round.
        """
        with self.store.transaction() as tx:
            r = self.round_in(tx, round_id)
        if r.state == OPEN and r.deadline <= self.store.clock():
            self.close_due(sweep=False)
            with self.store.transaction() as tx:
                r = self.round_in(tx, round_id)
        return r

    def rounds(self, limit: int = 20) -> list[Round]:
        """The latest rounds, newest first."""
        with self.store.transaction() as tx:
            rows = tx.all(f"SELECT {_ROUND_FIELDS} FROM rounds ORDER BY id DESC LIMIT ?", (limit,))
        return [_round_of(row) for row in rows]

    def aggregate(self, round_id: int) -> tuple[Round, bytes]:
        """A round's row and its current aggregate, whole.

        Raises:
          NotFound: no such round.
          Gone: its aggregate was deleted (`KEPT_AGGREGATES`).
        """
        with self.store.transaction() as tx:
            return self.round_in(tx, round_id), read_aggregate(tx, round_id)

    def aggregate_value(self, round_id: int) -> tuple[Round, values.Value | None]:
        """A round's row and the head of its current aggregate, to read it in chunks
        (`values.chunks`); None once deleted (`KEPT_AGGREGATES`). The aggregate of a
        round that ended is never written again.

        Raises:
          NotFound: no such round.
        """
        with self.store.transaction() as tx:
            return self.round_in(tx, round_id), aggregate_value(tx, round_id)

    def _close(self, tx: sql.Tx, r: Round, now: float, ahead: _FoldedAhead | None = None) -> None:
        """Closes (or fails) an open round whose target is met or whose deadline passed
        (its row locked in `tx`), merging its shards into its aggregate first (with
        `ahead`: as folded before `tx`, if nothing changed since)."""
        failure = self._merge_shards(tx, r, ahead)
        if failure:
            state = FAILED
        elif r.reports >= r.target or r.reports >= r.quorum:
            state = CLOSED
        else:
            state = FAILED
            failure = (
                f"Round {r.id} failed: {r.reports} of the {r.quorum} reports its quorum needs "
                f"arrived before its deadline ({r.deadline - r.created:g} s; {r.assigned} clients "
                "were assigned). Enroll more clients, lower the quorum or give a later deadline."
            )
        end_round(tx, r.id, state, failure, now)

    def stop(self, round_id: int, failure: str) -> Round:
        """Ends round `round_id` now as failed with `failure` (the operator stopped it),
        if it is open; returns its row.

        Raises:
          NotFound: no such round.
        """
        with self.store.transaction(write=True) as tx:
            r = self.round_in(tx, round_id, lock=True)
            if r.state == OPEN:
                self._merge_shards(tx, r)  # its processes' shards, so none is left behind
                end_round(tx, r.id, FAILED, failure, self.store.clock())
            return self.round_in(tx, round_id)

    def _merge_shards(self, tx: sql.Tx, r: Round, ahead: _FoldedAhead | None = None) -> str:
        """Folds the round's shards and stored reports into its aggregate and its count,
        and deletes them; returns why the round fails ('' if it does not: their sum
        overflowing fails it). With `ahead` (`_fold_ahead`), the fold made before `tx`
        is taken if it was made of what `tx` finds."""
        rows = tx.all("SELECT value, reports FROM aggregate_shards WHERE round = ?", (r.id,))
        stored = [str(v) for (v,) in tx.all(
            "SELECT value FROM stored_reports WHERE round = ? ORDER BY client", (r.id,))]
        if ahead is not None and ahead.inputs == _fold_inputs(tx, r.id, rows, stored):
            write_aggregate(tx, r.id, ahead.staging.finish(tx),
                            reports=sum(int(row[1]) for row in rows))
            self._delete_folded(tx, r, rows, stored)
            return ""
        if not rows and not stored:
            return ""
        if self.folders is None:
            raise RuntimeError(
                f"Expected the rounds' folders to merge round {r.id}'s shards, found none; "
                "make Rounds(store, folders) as the server does."
            )
        folder = self.folders(r.plan)
        count = sum(int(row[1]) for row in rows)
        shards = [str(row[0]) for row in rows if row[0]]  # '': a shard of stored reports only
        failure = ""
        try:
            if stored:  # a large model's: folded from storage, a slice at a time
                merged: bytes | Iterable[bytes] = self._fold_stored(tx, r, folder, shards, stored)
            else:
                merged = folder.merge([read_aggregate(tx, r.id),
                                       *(values.read_id(tx, value) for value in shards)])
            write_aggregate(tx, r.id, merged, reports=count)
        except folding.ReportError as e:
            tx.run("UPDATE aggregates SET reports = reports + ? WHERE round = ?", (count, r.id))
            failure = (f"Round {r.id} failed: the partial aggregates of its server processes "
                       f"overflow when merged ({e}); clients must clip their values further.")
        self._delete_folded(tx, r, rows, stored)
        return failure

    @staticmethod
    def _delete_folded(tx: sql.Tx, r: Round, shards: list[Any], stored: list[str]) -> None:
        """Adds the shards' counts to the round's row and deletes the shards and stored
        reports folded into its aggregate."""
        tx.run("UPDATE rounds SET reports = reports + ? WHERE id = ?",
               (sum(int(row[1]) for row in shards), r.id))
        tx.run("DELETE FROM aggregate_shards WHERE round = ?", (r.id,))
        tx.run("DELETE FROM stored_reports WHERE round = ?", (r.id,))
        for value in [str(row[0]) for row in shards if row[0]] + stored:
            values.delete(tx, value)

    def _fold_ahead(self, round_id: int) -> _FoldedAhead | None:
        """A round of stored reports folded before its close's write transaction: its
        new aggregate written as a staged value (`values.Staging`: a chunk per short
        transaction, the stored reports read in read transactions), so that the close
        holds the database's write lock (SQLite's, for every writer) only to swap it in.
        None for another round, or when folding fails (the close then folds in its
        transaction, and fails the round on an overflow)."""
        with self.store.transaction() as tx:
            r = self.round_in(tx, round_id)
            due = r.reports >= r.target or r.deadline <= self.store.clock()
            if not (r.folded and r.state == OPEN and due) or self.folders is None:
                return None
            rows = tx.all("SELECT value, reports FROM aggregate_shards WHERE round = ?", (r.id,))
            stored = [str(v) for (v,) in tx.all(
                "SELECT value FROM stored_reports WHERE round = ? ORDER BY client", (r.id,))]
            if not stored:
                return None
            inputs = _fold_inputs(tx, r.id, rows, stored)
            store = self.store

            def read(value: values.Value, start: int, stop: int) -> bytes:
                with store.transaction() as rtx:
                    return values.read_range(rtx, value, start, stop)

            try:  # (the heads read now; the bytes as the parts are made, below)
                parts = self._fold_stored(tx, r, self.folders(r.plan), inputs[1], inputs[2], read)
            except values.DamagedValue:
                return None
        staging = values.Staging(store)
        try:
            for part in parts:
                staging.write(part)
        except (folding.ReportError, values.DamagedValue):
            staging.discard()
            return None
        return _FoldedAhead(inputs, staging)

    @staticmethod
    def _fold_stored(tx: sql.Tx, r: Round, folder: folding.Folder, shards: list[str],
                     stored: list[str],
                     read: Callable[[values.Value, int, int], bytes] | None = None,
                     ) -> Iterable[bytes]:
        """The parts of round `r`'s aggregate with its shards and stored reports folded
        in, made a slice at a time as they are written (`Folder.fold_stored`); their
        heads read in `tx`, their bytes by `read` (by default in `tx` too).

        Raises:
          DamagedValue: one of them is missing.
        """
        aggregate = aggregate_value(tx, r.id)
        heads = [values.head(tx, v) for v in shards + stored]
        if aggregate is None or any(h is None for h in heads):
            raise values.DamagedValue(
                f"Expected round {r.id}'s aggregate, shards and stored reports, found one "
                "missing; the database was changed outside fedlang or damaged.")
        return folder.fold_stored(
            read or (lambda value, start, stop: values.read_range(tx, value, start, stop)),
            aggregate, heads[:len(shards)], heads[len(shards):])

    def close_if_done(self, round_id: int) -> None:
        """Closes an open folded round whose shards reached its target or whose deadline
        passed (its row locked only now, for the close; a round of stored reports folded
        before: `_fold_ahead`)."""
        now = self.store.clock()
        ahead = self._fold_ahead(round_id)
        try:
            with self.store.transaction(write=True) as tx:
                r = self.round_in(tx, round_id, lock=True)
                if r.folded and r.state == OPEN and (
                    r.reports >= r.target or r.deadline <= now
                ):
                    self._close(tx, r, now, ahead)
        finally:
            if ahead is not None:  # deletes it unless the close took it (then: nothing)
                ahead.staging.discard()

    def round_for_reports(self, tx: sql.Tx, round_id: int) -> Round:
        """A round's row, locked in `tx` only against its close (and deletion): on
        PostgreSQL, transactions taking reports of one round go on in parallel.

        Raises:
          NotFound: no such round.
        """
        row = tx.one(f"SELECT {_ROUND_FIELDS} FROM rounds WHERE id = ?" + tx.dialect.share_row,
                     (round_id,))
        if row is None:
            raise protocol.NotFound(f"Expected an existing round id, found {round_id}.")
        return _round_of(row)

    def close_due(self, sweep: bool = True) -> int:
        """Closes or fails the open folded rounds whose deadline passed; returns how many.
        (Secure rounds with stages here close by their stages:
        `secure.SecureRounds.close_due`.) The server's tick: with `sweep`, also deletes
        what no task needs any more, every `SWEEP_SECONDS` (`sweep`)."""
        now = self.store.clock()
        with self.store.transaction() as tx:
            due = [row[0] for row in tx.all(
                f"SELECT id FROM rounds WHERE state = ? AND deadline <= ? AND {FOLDED}",
                (OPEN, now),
            )]
        for round_id in due:
            with self.store.transaction(write=True) as tx:
                r = self.round_in(tx, round_id, lock=True)
                if r.state == OPEN:
                    self._close(tx, r, now)
        if sweep and now >= self._next_sweep:
            self._next_sweep = now + SWEEP_SECONDS
            self.sweep()
        return len(due)

    # -- space: the values no task needs any more

    def sweep(self) -> int:
        """Deletes the values no task needs any more (rounds' aggregates:
        `sweep_aggregates`; blobs and cut uploads: `Store.sweep_values`), each in a
        transaction of its own, and gives their space back (`Dialect.reclaim`); returns
        how many. The server runs it on its tick, every `SWEEP_SECONDS`."""
        deleted = self.sweep_aggregates() + self.store.sweep_values()
        self.store.dialect.reclaim()
        return deleted

    def sweep_aggregates(self) -> int:
        """Deletes the aggregates no one will read (`KEPT_AGGREGATES`): a closed round's
        once `KEPT_AGGREGATES` later rounds of its population closed, a failed round's
        (which only an edge reads, to forward) once as many later rounds ended; never
        one an edge has still to forward (a pending mirror). Returns how many."""
        with self.store.transaction() as tx:
            due = [int(row[0]) for row in tx.all(
                "SELECT a.round FROM aggregates a JOIN rounds r ON r.id = a.round"
                " WHERE r.state <> ? AND (SELECT COUNT(*) FROM rounds n WHERE"
                " n.population = r.population AND n.id > r.id AND (n.state = ?"
                " OR (r.state = ? AND n.state <> ?))) >= ?"
                " AND NOT EXISTS (SELECT 1 FROM mirrors m WHERE m.local = r.id"
                " AND m.kind <> 'buffered' AND m.outcome = '')",
                (OPEN, CLOSED, FAILED, OPEN, KEPT_AGGREGATES),
            )]
        for round_id in due:  # an ended round's aggregate is never written again
            with self.store.transaction(write=True) as tx:
                value = tx.one("SELECT value FROM aggregates WHERE round = ?", (round_id,))
                if value is not None:  # (unless another process deleted it just now)
                    tx.run("DELETE FROM aggregates WHERE round = ?", (round_id,))
                    values.delete(tx, str(value[0]))
        return len(due)

    # -- check-in

    def checkin(self, client_id: str, population: str) -> Task | float | None:
        """A round's task for the client, or seconds to wait before checking in again, or
        None when the population is finished."""
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            tx.run("UPDATE clients SET last_seen = ? WHERE id = ?", (now, client_id))
            tx.count("checkins")
            pop = tx.one("SELECT clients, finished FROM populations WHERE name = ?", (population,))
            if pop is None or pop[1]:
                return None
            held = tx.one(
                "SELECT r.id, r.plan, r.broadcast, r.deadline, r.kind FROM assignments a JOIN rounds r"
                " ON r.id = a.round WHERE a.client = ? AND a.state = ? AND r.state = ?"
                " AND r.deadline > ? ORDER BY r.id LIMIT 1",
                (client_id, ASSIGNED, OPEN, now),
            )
            if held is not None:  # a client that restarted gets its task again
                return Task(held[0], held[1], held[2], held[3], protocol.TaskKind(held[4]))
            last = tx.one(
                "SELECT round, assigned FROM assignments WHERE client = ?"
                " ORDER BY assigned DESC LIMIT 1",
                (client_id,),
            )
            if last is not None:  # selected lately: the wait it would have had (`Pace.rest`)
                rest = last[1] + self.store.pace.rest(int(pop[0]), f"{client_id}/{last[0]}") - now
                if round(rest, 3) > 0:  # (a wait rounded to 0 would be asked again at once)
                    return round(rest, 3)
            # a client takes a seat where it can give every aggregation here: not in a
            # secure round whose SecAgg+ runs elsewhere (its seats are its edges')
            candidates = tx.all(
                "SELECT id FROM rounds WHERE population = ? AND state = ? AND deadline > ?"
                " AND assigned < capacity AND NOT EXISTS (SELECT 1 FROM assignments a"
                f" WHERE a.round = rounds.id AND a.client = ?) AND (kind = ? OR NOT {FOLDED})"
                " ORDER BY id",
                (population, OPEN, now, client_id, AGGREGATE),
            )
            for (round_id,) in candidates:
                r = self.round_in(tx, round_id, lock=True)
                # the same client checking in at another process just now (PostgreSQL)
                # was assigned while this one waited for the lock
                mine = tx.one("SELECT state FROM assignments WHERE round = ? AND client = ?",
                              (r.id, client_id))
                if mine is not None:
                    if mine[0] == ASSIGNED and r.state == OPEN:
                        return Task(r.id, r.plan, r.broadcast, r.deadline, r.kind)
                    continue
                if r.state != OPEN or r.assigned >= r.capacity:
                    continue
                assign(tx, r, client_id, now)
                return Task(r.id, r.plan, r.broadcast, r.deadline, r.kind)
            # not sooner when a round is full: its deadline would gather a herd (`Pace`)
            return self.store.retry_after(int(pop[0]))

    # -- reports

    def precheck(self, r: Round, client_id: str, digest: str) -> bool:
        """Whether this exact upload to round `r` (its row as the caller read it) was
        already accepted (True: nothing to do); raises what the shards would for an
        upload the round cannot take (see `admission.admit`), before it is decoded."""
        folded_only(r)
        with self.store.transaction() as tx:
            h = held(tx, r.id, [client_id]).get(client_id, Held())
        return admission.admit(slot(r, h), digest)

    def count_refusal(self, reason: str, round_id: int) -> None:
        """Counts a refused upload (`refused:REASON`, and in its round: `late` or
        `refused`)."""
        column = "late" if reason == "late" else "refused"
        self.store.count_refusal(
            reason, (f"UPDATE rounds SET {column} = {column} + 1 WHERE id = ?", (round_id,)),
            task=f"round:{round_id}",
        )
