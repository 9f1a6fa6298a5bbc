"""Rounds' uploads taken at network speed: folded in memory, committed in groups.

Every upload of a folded round (`rounds.Round.folded`) is taken here: a client's report,
and an edge aggregator's partial aggregate, which stands for the reports of the seats it
holds (its `count`; `folding.Folder.counts`). The guarantees are those of one report per
transaction, at a fraction of the cost:

* **a shard per process.** Each server process keeps, for each open round, the running
  aggregate of the reports it accepted in memory (its *shard*: accumulators, never
  decoded or re-encoded per report) and a row `aggregate_shards (round, shard, value,
  reports)` holding the shard (a value in chunks, `values`) as of its last commit. Processes never write each other's
  rows, so several processes on one PostgreSQL take one round's reports in parallel.
* **group commit.** Requests hand their checked reports to one writer thread per
  process, which takes all that are waiting in one transaction: it admits each
  (`admission`: replays, 409/403/410; an upload standing for more reports and dropouts
  than its holder's seats, 400), folds it into the
  shard (a report that would make the shard overflow is refused, 400 `overflow`),
  records its digest and its client's assignment, then writes each touched shard's row
  once, and commits. Each request is answered only after the commit that holds its
  report (it waits for `submit`'s future on the event loop, holding no thread): an
  acknowledged report is in the database (its digest, and the shard row its value is
  folded into), so `kill -9` of the process loses none; a report not yet committed was
  never acknowledged, and its client retries it.
* **the round's row** is read with a share lock (`Rounds.round_for_reports`: on
  PostgreSQL `FOR KEY SHARE`, which reports of one round take together, and which
  keeps only a close out) and never written by a report; its count is its row's plus
  its shards' (`rounds._ROUND_FIELDS`). When the count reaches the target (or the
  deadline passes) the writer closes the round after its commit (`Rounds.close_if_done`,
  the row locked `FOR UPDATE` only then), which merges every shard into the round's
  aggregate; before answering the group's reports, except for a round of a large
  model's stored reports (`Stored`), which closes right after: its close folds each
  stored report, longer than a client waits for its answer. Two processes committing at once each count without the other's reports,
  so a writer whose group took reports reads the count again once committed: the later
  one sees both. A restarted process starts new shards; the old ones are merged with the
  rest. A report the writer sees after the round reached its target is refused 410 as
  after its close. (Several processes may each commit a group just as the target is
  reached: the round then holds a few more reports than its target, each from a client
  assigned to it. One process never does.)
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import threading
from collections.abc import Callable
from concurrent import futures
from typing import Any

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.store import admission, sql, values
from fedlang.deploy.store import rounds as rounds_lib


@dataclasses.dataclass
class _Pending:
    """One upload waiting for the writer, and its answer once committed: the reports it
    stands for (`count`: 1 for a client's report) and the seats it says dropped out."""

    round: int
    client: str
    digest: str
    size: int
    checked: Any
    count: int = 1
    dropped: int = 0
    answer: futures.Future[bool] = dataclasses.field(default_factory=futures.Future)
    result: bool | BaseException | None = None


@dataclasses.dataclass(frozen=True)
class Stored:
    """A large model's report (`folding.Folder.streamable`), checked as it arrived
    (`report`) and written meanwhile to a staged value (`staging`): taken, it is stored
    (`stored_reports`, its value finished in the transaction) and folded when its round
    closes (`rounds.Rounds._merge_shards`), a slice at a time; never held whole."""

    staging: values.Staging
    report: folding.Scanned


@dataclasses.dataclass
class _Shard:
    """A round's shard in this process: its running aggregate (as its row holds it,
    plus the reports of the transaction under way)."""

    accumulators: list[Any]


@dataclasses.dataclass
class _Group:
    """A batch's uploads to one round: the round's row, its count, and what its
    uploaders hold there (`rounds.held`), kept up to date as the batch's uploads are
    taken."""

    round: rounds_lib.Round
    count: int
    held: dict[str, rounds_lib.Held]
    taken: list[_Pending] = dataclasses.field(default_factory=list)
    folded: bool = False  # whether an upload was folded into the shard in memory
    stored: float | None = None  # the sum of its stored reports' `max_abs`, once read

    def stored_bound(self, tx: sql.Tx) -> float:
        """The sum of the largest magnitudes of the round's stored reports (every
        process's), and of those this batch stored."""
        if self.stored is None:
            self.stored = float(tx.one("SELECT COALESCE(SUM(max_abs), 0) FROM stored_reports"
                                       " WHERE round = ?", (self.round.id,))[0])
        return self.stored

    @classmethod
    def read(cls, tx: sql.Tx, r: rounds_lib.Round, clients: list[str]) -> _Group:
        return cls(r, r.reports, rounds_lib.held(tx, r.id, clients))


class ReportShards:
    """Takes plain rounds' reports into this process's shards (see the module docstring).

    Args:
      rounds: the rounds of the store (`rounds.folders` set: each round's `Folder`).
      max_batch: the most reports committed in one transaction.
    """

    def __init__(self, rounds: rounds_lib.Rounds, max_batch: int = 256):
        if rounds.folders is None:
            raise ValueError("Expected Rounds made with its folders, found none; make it "
                             "Rounds(store, folders), as server.state does.")
        self.rounds = rounds
        self.store = rounds.store
        self.folders: Callable[[str], folding.Folder] = rounds.folders
        self.max_batch = max_batch
        self.shard = secrets.token_hex(8)  # this process's shards, until it stops
        self._shards: dict[int, _Shard] = {}
        self._waiting: list[_Pending] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False

    def accept(self, round_id: int, client_id: str, digest: str, size: int, checked: Any) -> bool:
        """Accepts a checked upload (`Folder.check`'s report, or `Folder.check_partial`'s
        partial aggregate) once it is committed; False for a replay of an accepted upload
        (nothing changes).

        Raises:
          Forbidden, Gone, Conflict: see `admission.admit` (`rounds.folded_only`).
          BadRequest: more reports and dropouts than the uploader's seats.
          ReportError: `overflow`: the upload would make the round's aggregate overflow.
        """
        return self.submit(round_id, client_id, digest, size, checked).result()

    def submit(self, round_id: int, client_id: str, digest: str, size: int,
               checked: Any) -> futures.Future[bool]:
        """`accept`'s answer to come: the report waits for the writer, and the future is
        resolved (or fails, as `accept` raises) once the transaction that holds it has
        committed. The caller waits without holding a thread (`intake.take` awaits it on
        the event loop), so the reports waiting for one commit are not capped by the
        thread pool. Cancelling the future does not withdraw the report."""
        count, dropped = folding.Folder.counts(checked)
        pending = _Pending(round_id, client_id, digest, size, checked, count, dropped)
        pending.answer.set_running_or_notify_cancel()  # from now on it cannot be cancelled
        with self._cond:
            if self._closed:
                raise RuntimeError("The server is stopping; send the report again.")
            self._waiting.append(pending)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, daemon=True,
                                                 name="fedlang-report-writer")
                self._thread.start()
            self._cond.notify()
        return pending.answer

    def close(self) -> None:
        """Commits what is waiting, then stops the writer."""
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout=60)

    # -- the writer

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._closed:
                    self._cond.wait()
                if not self._waiting:
                    return
                batch = self._waiting[: self.max_batch]
                del self._waiting[: self.max_batch]
            try:
                close, check = self._commit(batch)
            except BaseException as e:  # the transaction is undone: no report was taken
                self._shards.clear()  # rebuilt from their committed rows
                for p in batch:
                    p.result = e
                close, check = set(), set()
            # Before the answers: a client told its report closed the round finds it
            # closed. Not a round of stored reports (a large model's): its close folds
            # each of them, seconds a GB, longer than a client waits for its answer; it
            # closes right after them (reports that come meanwhile are refused 410 as
            # after its close: its target is reached).
            stored = {p.round for p in batch if isinstance(p.checked, Stored)}
            self._close_if_done(sorted((close | check) - stored), close)
            for p in batch:
                if isinstance(p.result, BaseException):
                    p.answer.set_exception(p.result)
                else:
                    p.answer.set_result(bool(p.result))
            self._close_if_done(sorted((close | check) & stored), close)

    def _close_if_done(self, rounds: list[int], due: set[int]) -> None:
        """Closes each of `rounds` that is `due`, or that reached its target."""
        for round_id in rounds:
            # (a close that fails now is made by the next report or the deadline tick)
            with contextlib.suppress(Exception):  # closed the round finds it closed
                if round_id in due or self._reached(round_id):
                    self.rounds.close_if_done(round_id)

    def _commit(self, batch: list[_Pending]) -> tuple[set[int], set[int]]:
        """Takes `batch` in one transaction (see the module docstring); sets each
        report's result; returns the rounds to close once it is committed, and those to
        close if they reached their target with others' reports (`_reached`). Its
        statements are per round, not per report (the writer is the one serial part)."""
        now = self.store.clock()
        due: set[int] = set()
        with self.store.transaction(write=True) as tx:
            groups: dict[int, _Group | protocol.ProtocolError] = {}
            for round_id in sorted({p.round for p in batch}):  # one lock order: no deadlock
                try:
                    r = self.rounds.round_for_reports(tx, round_id)
                except protocol.ProtocolError as e:
                    groups[round_id] = e
                    continue
                groups[round_id] = _Group.read(tx, r, [p.client for p in batch
                                                       if p.round == round_id])
            for p in batch:
                group = groups[p.round]
                try:
                    if isinstance(group, BaseException):
                        raise group
                    p.result = self._take(tx, group, p, due, now)
                except (protocol.ProtocolError, folding.ReportError) as e:
                    p.result = e
            taken = [(g, p) for g in groups.values() if isinstance(g, _Group) for p in g.taken]
            tx.many(
                "UPDATE assignments SET state = ?, updated = ? WHERE round = ? AND client = ?",
                [(admission.Assignment.REPORTED, now, g.round.id, p.client) for g, p in taken],
            )
            tx.many(
                "INSERT INTO reports (round, client, stage, digest, size, accepted, count,"
                " dropped) VALUES (?, ?, 0, ?, ?, ?, ?, ?)",
                [(g.round.id, p.client, p.digest, p.size, now, p.count, p.dropped)
                 for g, p in taken],
            )
            for g in groups.values():
                if isinstance(g, _Group) and g.taken:
                    self._write_shard(tx, g)
            if taken:
                tx.count("reports:accepted", sum(p.count for _, p in taken))
        for round_id, g in groups.items():
            if not (isinstance(g, _Group) and g.round.state == rounds_lib.OPEN):
                self._shards.pop(round_id, None)  # its shard was merged at its close
        took = {g.round.id for g in groups.values() if isinstance(g, _Group) and g.taken}
        return due, took - due

    def _reached(self, round_id: int) -> bool:
        """Whether a round's committed count reached its target. Another process's group
        may commit while this one's does, each seeing the other's count without its
        reports: each reads again once committed, and the later one sees both."""
        with self.store.transaction() as tx:
            r = self.rounds.round_in(tx, round_id)
        return r.state == rounds_lib.OPEN and r.reports >= r.target

    def _take(self, tx: sql.Tx, g: _Group, p: _Pending, due: set[int], now: float) -> bool:
        """Admits and folds one upload; True if taken, False for a replay."""
        r = g.round
        rounds_lib.folded_only(r)
        if r.state == rounds_lib.OPEN and (r.deadline <= now or g.count >= r.target):
            due.add(r.id)  # as if closed: it closes once this transaction commits
            r = dataclasses.replace(r, state=rounds_lib.CLOSED)
        held = g.held.get(p.client, rounds_lib.Held())
        if admission.admit(rounds_lib.slot(r, held), p.digest):
            return False
        if p.count + p.dropped > held.seats:
            raise protocol.BadRequest(
                f"Expected at most {held.seats} reports and dropouts (the seats held in round "
                f"{r.id}), found {p.count} and {p.dropped}."
            )
        folder = self.folders(r.plan)
        if isinstance(p.checked, Stored):
            self._store(tx, g, p.client, p.checked, folder)
        else:
            shard = self._shard(tx, r, folder)
            try:
                folder.fold_into(shard.accumulators, p.checked)
            except folding.ReportError:  # rebuilt without it: as committed, plus this batch's
                shard.accumulators = self._committed(tx, r, folder)
                for q in g.taken:
                    if not isinstance(q.checked, Stored):
                        folder.fold_into(shard.accumulators, q.checked)
                raise
            g.folded = True
        g.held[p.client] = dataclasses.replace(held, accepted=p.digest,
                                               assignment=admission.Assignment.REPORTED)
        g.taken.append(p)
        g.count += p.count
        if g.count >= r.target:
            due.add(r.id)
        return True

    @staticmethod
    def _store(tx: sql.Tx, g: _Group, client: str, stored: Stored,
               folder: folding.Folder) -> None:
        """Stores a large model's report: its staged value finished in `tx`, and named
        by its row of `stored_reports`.

        Raises:
          ReportError: `overflow`, if the round's stored reports and this one could sum
            beyond the aggregate's range (`Folder.overflow_limit`).
        """
        bound = g.stored_bound(tx) + stored.report.max_abs
        if not bound <= folder.overflow_limit():
            raise folding.ReportError(
                f"Expected a report the aggregate of round {g.round.id} stays finite with, "
                f"found one whose values (up to {stored.report.max_abs:g} in magnitude) could "
                "make it overflow; a client must clip its values before reporting.",
                reason="overflow")
        value = stored.staging.finish(tx)
        tx.run("INSERT INTO stored_reports (round, client, value, max_abs) VALUES (?, ?, ?, ?)",
               (g.round.id, client, value.id, stored.report.max_abs))
        g.stored = bound

    def _shard(self, tx: sql.Tx, r: rounds_lib.Round, folder: folding.Folder) -> _Shard:
        """This process's shard of round `r`, made (with its row) on its first report."""
        shard = self._shards.get(r.id)
        if shard is None:
            shard = _Shard(self._committed(tx, r, folder))
            self._shards[r.id] = shard
        return shard

    def _write_shard(self, tx: sql.Tx, g: _Group) -> None:
        """Replaces the shard's row's value by the shard as this batch left it (a new
        value, in chunks: no cell holds a model-sized aggregate), adding its reports."""
        count = sum(p.count for p in g.taken)
        row = tx.one("SELECT value FROM aggregate_shards WHERE round = ? AND shard = ?",
                     (g.round.id, self.shard))
        if row is None:  # only stored reports so far: the row counts them
            tx.run("INSERT INTO aggregate_shards (round, shard, value, reports)"
                   " VALUES (?, ?, '', ?)", (g.round.id, self.shard, count))
            return
        if not g.folded:  # its value is as it was
            tx.run("UPDATE aggregate_shards SET reports = reports + ? WHERE round = ?"
                   " AND shard = ?", (count, g.round.id, self.shard))
            return
        data = self.folders(g.round.plan).serialize(self._shards[g.round.id].accumulators)
        value = values.write(tx, [data])
        del data
        tx.run("UPDATE aggregate_shards SET value = ?, reports = reports + ?"
               " WHERE round = ? AND shard = ?", (value.id, count, g.round.id, self.shard))
        if row[0]:
            values.delete(tx, str(row[0]))

    def _committed(self, tx: sql.Tx, r: rounds_lib.Round, folder: folding.Folder) -> list[Any]:
        """The shard's accumulators as its row holds them (the row made if new: its
        value '' until a group folds an upload in memory)."""
        row = tx.one(
            "SELECT value FROM aggregate_shards WHERE round = ? AND shard = ?", (r.id, self.shard)
        )
        if row is not None:
            if not row[0]:  # none folded in memory yet
                return folder.accumulators()
            return folder.accumulators(values.read_id(tx, str(row[0])))
        tx.run("INSERT INTO aggregate_shards (round, shard, value, reports) VALUES (?, ?, '', 0)",
               (r.id, self.shard))
        return folder.accumulators()
