"""Secure rounds in the task store: the stages of SecAgg+ as database transactions.

A round whose plan has secure aggregations (`RoundPlan.secure`) is of kind "secure": the
inputs of its secure aggregations reach the server only masked, through the four stages
of SecAgg+ (`fedlang.deploy.secagg`), and the server learns only their sum. The
protocol's server state (`SecAggServer.to_bytes()`) lives in the `secure_rounds` table and
is replaced in the transaction that accepts a client's message, with the round's row
locked as for reports: a server killed at any moment has either accepted a message (and
its stored state holds it) or not, and a restarted server continues the protocol.

Each stage's request for each participant is made when the stage opens and kept in
`secure_requests`; a client fetches its own (`request`) and posts its answer (`accept`).
A stage closes (`SecAggServer.advance`) as soon as every participant has answered, or
when its time is up (`close_due`, on the server's tick): stages 2-4 last at most
`CohortOptions.stage_timeout` each; stage 1, which includes check-in and local training,
may last until three stage timeouts before the round's deadline (at least one timeout).

1. **Advertise keys**: the clients assigned at check-in (up to the round's capacity)
   send their public keys. The stage waits for a full round (capacity assigned) whose
   clients all answered; once it closes no client is assigned any more (the round's
   capacity becomes the clients assigned).
2. **Share keys**: each client sends its neighbours' encrypted shares.
3. **Masked input**: each client sends its plain report (the partials of the round's
   aggregations that are not secure) with its masked input, in one body
   (`protocol.pack_masked_input`); both are accepted, or neither, in one transaction, so
   the plain and the secure parts count the same clients. The stage also closes when
   `target` masked inputs are in.
4. **Unmasking**: survivors reveal the shares that remove the masks. When the stage
   closes the protocol's sum is folded into the round's aggregate
   (`Folder.fold_secure`) and the round closes.

A client that has not answered when a stage closes is a dropout (its assignment is
marked dropped); the protocol removes its masks or leaves it out. When a stage closes
with fewer clients left than the round's quorum, or the protocol cannot go on (fewer
than its threshold), the round fails with a message saying why, before any share is
asked for. The groups the segments are summed in are those of the round's capacity
(`RoundPlan.secure_segments(capacity)`), as in simulation.

What the server stores of a secure round is the protocol state (public keys, encrypted
shares, the running sum of masked vectors, the revealed shares it may use), the requests
it hands out, the digests of the messages it accepted, and the final sum; it logs stage
changes and counts, never a payload.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable
from typing import Any

from fedlang.deploy import protocol, secagg
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.store import admission, sql
from fedlang.deploy.store import rounds as rounds_lib

log = logging.getLogger("fedlang.deploy.store.secure")
Stage = secagg.Stage
OPEN = protocol.RoundState.OPEN
EVERYONE = ""  # the client of a request that every participant fetches (stage 1)


def stage_name(stage: int) -> str:
    """`advertise keys`, `share keys`, ... for a stage number (`secagg.Stage`)."""
    return Stage(stage).name.lower().replace("_", " ")


class SecureRounds:
    """The secure rounds of a task store (see the module docstring).

    Args:
      rounds: the rounds of the task store (a secure round is a round of kind `secure`).
      folder: the `folding.Folder` of a round's signed plan, by the plan's blob hash.
    """

    def __init__(self, rounds: rounds_lib.Rounds, folder: Callable[[str], folding.Folder]):
        self.rounds = rounds
        self.store = rounds.store
        self.folder = folder
        self._rng = random.Random()

    # -- opening a round

    def prepare(
        self, round_plan: plan_lib.RoundPlan, options: rounds_lib.CohortOptions
    ) -> Callable[[sql.Tx, rounds_lib.Round], None]:
        """What `Store.create_round(on_create=...)` writes for a secure round: the protocol's
        initial state and the stage 1 request.

        Raises:
          BadRequest: the secure aggregations cannot be summed by SecAgg+ (a modulus too
            large for the cohort).
        """
        try:
            segments = [secagg.Segment(*s) for s in round_plan.secure_segments(options.capacity)]
        except ValueError as e:
            raise protocol.BadRequest(
                f"Expected secure aggregations that SecAgg+ can sum for a cohort of "
                f"{options.capacity}: {e}"
            ) from e
        timeout = options.stage_seconds

        def create(tx: sql.Tx, r: rounds_lib.Round) -> None:
            server = secagg.SecAggServer(segments)
            # Stage 1 (check-in, training, keys) may use what stages 2-4 do not need.
            first = max(r.created + timeout, r.deadline - 3 * timeout)
            tx.run(
                "INSERT INTO secure_rounds (round, stage, stage_timeout, stage_deadline, state)"
                " VALUES (?, ?, ?, ?, ?)",
                (r.id, int(Stage.ADVERTISE_KEYS), timeout, first, server.to_bytes()),
            )
            tx.run(
                "INSERT INTO secure_requests (round, client, stage, data) VALUES (?, ?, ?, ?)",
                (r.id, EVERYONE, int(Stage.ADVERTISE_KEYS), server.request_for(EVERYONE)),
            )

        return create

    # -- what a client fetches

    def request(self, round_id: int, client_id: str) -> dict[str, Any]:
        """The client's view of the round: `{round, state, stage, request, retry_after,
        finished}`; `request` is the current stage's request (bytes) if the client has yet
        to answer it, `retry_after` the seconds to wait when it has, `finished` whether
        the client has nothing more to do in this round.

        Raises:
          NotFound, Conflict, Forbidden: no such round, not a secure round, or a round the
            client was not assigned.
          Gone: the client dropped out of the round.
        """
        with self.store.transaction() as tx:
            r = self.rounds.round_in(tx, round_id)
            _check_kind(r)
            held = _assignment(tx, r, client_id)
            stage = int(tx.one("SELECT stage FROM secure_rounds WHERE round = ?", (r.id,))[0])
            out: dict[str, Any] = {
                "round": r.id, "state": r.state, "stage": stage, "request": None,
                "retry_after": None, "finished": False,
            }
            answered = {int(row[0]) for row in tx.all(
                "SELECT stage FROM reports WHERE round = ? AND client = ?", (r.id, client_id)
            )}
            if r.state != OPEN or int(Stage.UNMASKING) in answered:
                out["finished"] = True
                return out
            if stage in answered:
                out["retry_after"] = self._retry_after(r.assigned)
                return out
            request = _request_of(tx, r, stage, client_id, held)
        if request is None:
            raise _dropped(r, stage, client_id)
        out["request"] = request
        return out

    def _retry_after(self, cohort: int) -> float:
        """How long a client that answered waits before asking again: pace steering, as
        for check-ins (`cohort / checkins_per_second` seconds, at least the pace's shortest
        wait, at most 5 s so stages stay short), jittered; the waiting clients of a round
        then poll about `checkins_per_second` times a second together."""
        pace = self.store.pace
        base = min(max(pace.min_retry, cohort / pace.checkins_per_second), 5.0)
        return round(base * self._rng.uniform(0.5, 1.5), 3)

    # -- what a client sends

    def precheck(self, round_id: int, client_id: str, stage: int, digest: str) -> bool:
        """Whether this exact answer was accepted before (True: nothing to do); raises what
        `accept` would for an answer the round cannot take."""
        with self.store.transaction() as tx:
            r = self.rounds.round_in(tx, round_id)
            return self._admissible(tx, r, client_id, stage, digest)

    def accept(
        self,
        round_id: int,
        client_id: str,
        stage: int,
        digest: str,
        size: int,
        message: bytes,
        checked: Any = None,
    ) -> bool:
        """Takes a client's answer to a stage, in one transaction; returns False for a
        replay of an accepted answer (nothing changes). The stage closes when this was the
        last answer it waited for.

        Args:
          digest, size: the answer body's hash and size.
          message: the SecAgg+ message it holds.
          checked: in stage 3, the client's plain report, checked
            (`folding.Folder.check`): folded with its masked input, or neither.

        Raises:
          BadRequest: a message the protocol rejects (reason `secagg`).
          Forbidden: a round the client was not assigned.
          Conflict: not a secure round, a stage that has not opened, or a second, different
            answer to a stage.
          Gone: a stage that has closed, a round that is over, or a client that dropped out.
        """
        now = self.store.clock()
        with self.store.transaction(write=True) as tx:
            r = self.rounds.round_in(tx, round_id, lock=True)
            if self._admissible(tx, r, client_id, stage, digest):
                return False
            answered, state = tx.one(
                "SELECT answered, state FROM secure_rounds WHERE round = ?", (r.id,)
            )
            server = secagg.SecAggServer.from_bytes(bytes(state))
            try:
                server.receive(client_id, message)
            except secagg.SecAggError as e:
                raise protocol.BadRequest(
                    f"Expected a valid {stage_name(stage)} message: {e}", reason="secagg"
                ) from e
            folder = self.folder(r.plan)
            if checked is not None:
                rounds_lib.fold_report(
                    tx, r.id, client_id, lambda aggregate: folder.fold(aggregate, checked), now
                )
            rounds_lib.record_upload(tx, r.id, client_id, stage, digest, size, now)
            answered = int(answered) + 1
            r = self.rounds.round_in(tx, r.id)
            if _complete(r, server, answered):
                self._advance(tx, r, server, folder, now)
            else:
                tx.run(
                    "UPDATE secure_rounds SET answered = ?, state = ? WHERE round = ?",
                    (answered, server.to_bytes(), r.id),
                )
        return True

    def _admissible(
        self, tx: sql.Tx, r: rounds_lib.Round, client_id: str, stage: int, digest: str
    ) -> bool:
        """True for a replay; raises what a message the round cannot take gets."""
        _check_kind(r)
        part = f"stage {stage} ({stage_name(stage)})"
        h = rounds_lib.held(tx, r.id, [client_id], stage).get(client_id, rounds_lib.Held())
        slot = rounds_lib.slot(r, h, part, upload="message")
        if admission.admit(slot, digest):
            return True
        current = int(tx.one("SELECT stage FROM secure_rounds WHERE round = ?", (r.id,))[0])
        if stage < current:
            raise protocol.Gone(
                f"Expected a message for stage {current} ({stage_name(current)}) of round {r.id}, "
                f"found one for stage {stage}, which has closed: it came too late and is not "
                "counted."
            )
        if stage > current:
            raise protocol.Conflict(
                f"Expected a message for stage {current} ({stage_name(current)}) of round {r.id}, "
                f"found one for stage {stage}, which has not opened; fetch the current request "
                f"first (GET /v1/rounds/{r.id}/secagg)."
            )
        if _request_of(tx, r, stage, client_id, slot.assignment or "") is None:
            raise _dropped(r, stage, client_id)
        return False

    # -- closing stages

    def stop(self, round_id: int, failure: str) -> None:
        """Ends secure round `round_id` now as failed with `failure` (the operator stopped
        it), if it is open: nothing of its protocol is kept.

        Raises:
          NotFound: no such round.
        """
        with self.store.transaction(write=True) as tx:
            r = self.rounds.round_in(tx, round_id, lock=True)
            if r.state == OPEN:
                self._fail(tx, r, Stage(r.stage), failure, self.store.clock())

    def close_due(self) -> int:
        """Closes the stages whose timeout passed, and fails or finishes the rounds whose
        deadline passed; returns how many rounds it looked at."""
        now = self.store.clock()
        with self.store.transaction() as tx:
            due = tx.all(
                "SELECT r.id, r.plan FROM rounds r JOIN secure_rounds s ON s.round = r.id"
                " WHERE r.state = ? AND (s.stage_deadline <= ? OR r.deadline <= ?)",
                (OPEN, now, now),
            )
        for round_id, plan_hash in due:
            folder = self.folder(plan_hash)
            with self.store.transaction(write=True) as tx:
                r = self.rounds.round_in(tx, round_id, lock=True)
                stage_deadline, state = tx.one(
                    "SELECT stage_deadline, state FROM secure_rounds WHERE round = ?", (r.id,)
                )
                if r.state != OPEN or (stage_deadline > now and r.deadline > now):
                    continue
                server = secagg.SecAggServer.from_bytes(bytes(state))
                if r.deadline <= now and server.stage != Stage.UNMASKING:
                    self._fail(
                        tx, r, server.stage,
                        f"Expected the round to finish within its deadline "
                        f"({r.deadline - r.created:g} s), found it still in stage "
                        f"{int(server.stage)} ({stage_name(server.stage)}). Give a later deadline "
                        "or shorter stage timeouts.",
                        now,
                    )
                else:
                    self._advance(tx, r, server, folder, now)
        return len(due)

    def _advance(
        self,
        tx: sql.Tx,
        r: rounds_lib.Round,
        server: secagg.SecAggServer,
        folder: folding.Folder,
        now: float,
    ) -> None:
        old = server.stage
        answered = server.unmasked_by()  # before the protocol forgets the shares
        try:
            new = server.advance()
        except secagg.SecAggError:
            self._fail(tx, r, old, server.failure.removeprefix(_PROTOCOL_FAILED), now)
            return
        if new == Stage.DONE:
            self._finish(tx, r, server, folder, now, answered)
            return
        participants = server.participants()
        if len(participants) < r.quorum:
            self._fail(
                tx, r, old,
                f"Expected at least {r.quorum} clients (the round's quorum) to go on to stage "
                f"{int(new)} ({stage_name(new)}), found {len(participants)}. No shares were "
                "requested; nothing is revealed. Over-select more clients or lower the quorum.",
                now,
            )
            return
        dropped = self._drop_all_but(tx, r, set(participants), now)
        if old == Stage.ADVERTISE_KEYS:  # nobody joins after the keys are known
            tx.run("UPDATE rounds SET capacity = assigned WHERE id = ?", (r.id,))
        tx.run("DELETE FROM secure_requests WHERE round = ?", (r.id,))
        for client_id in participants:
            tx.run(
                "INSERT INTO secure_requests (round, client, stage, data) VALUES (?, ?, ?, ?)",
                (r.id, client_id, int(new), server.request_for(client_id)),
            )
        timeout = float(tx.one("SELECT stage_timeout FROM secure_rounds WHERE round = ?",
                               (r.id,))[0])
        tx.run(
            "UPDATE secure_rounds SET stage = ?, stage_deadline = ?, answered = 0, state = ?"
            " WHERE round = ?",
            (int(new), now + timeout, server.to_bytes(), r.id),
        )
        log.info("round %d: stage %s closed; %d clients go on to stage %s, %d dropped out",
                 r.id, old.name, len(participants), new.name, dropped)

    def _drop_all_but(
        self, tx: sql.Tx, r: rounds_lib.Round, keep: set[str], now: float
    ) -> int:
        """Marks the assigned clients outside `keep` as dropouts; returns how many."""
        waiting = [row[0] for row in tx.all(
            "SELECT client FROM assignments WHERE round = ? AND state = ?",
            (r.id, admission.Assignment.ASSIGNED),
        )]
        gone = [c for c in waiting if c not in keep]
        for client_id in gone:
            tx.run(
                "UPDATE assignments SET state = ?, updated = ? WHERE round = ? AND client = ?",
                (admission.Assignment.DROPPED, now, r.id, client_id),
            )
        if gone:
            tx.run("UPDATE rounds SET dropped = dropped + ? WHERE id = ?", (len(gone), r.id))
            tx.count("dropouts", len(gone))
        return len(gone)

    def _finish(
        self,
        tx: sql.Tx,
        r: rounds_lib.Round,
        server: secagg.SecAggServer,
        folder: folding.Folder,
        now: float,
        answered: tuple[str, ...],
    ) -> None:
        survivors = server.participants()
        aggregate = rounds_lib.read_aggregate(tx, r.id)
        rounds_lib.write_aggregate(
            tx, r.id, folder.fold_secure(aggregate, server.result(), len(survivors)))
        self._drop_all_but(tx, r, set(survivors), now)
        # A client whose masked input arrived but who never answered the last stage is in
        # the sum (the others revealed its masks) and still dropped out of the protocol.
        silent = len(set(survivors) - set(answered))
        if silent:
            tx.run("UPDATE rounds SET dropped = dropped + ? WHERE id = ?", (silent, r.id))
            tx.count("dropouts", silent)
        tx.run(
            "UPDATE rounds SET state = ?, closed = ? WHERE id = ?", (rounds_lib.CLOSED, now, r.id)
        )
        tx.count(f"rounds:{rounds_lib.CLOSED}")
        tx.run("DELETE FROM secure_requests WHERE round = ?", (r.id,))
        tx.run(
            "UPDATE secure_rounds SET stage = ?, answered = 0, state = ? WHERE round = ?",
            (int(Stage.DONE), server.to_bytes(), r.id),
        )
        log.info("round %d: secure aggregation done with %d clients", r.id, len(survivors))

    def _fail(
        self, tx: sql.Tx, r: rounds_lib.Round, stage: Stage, reason: str, now: float
    ) -> None:
        failure = (
            f"Secure round {r.id} failed when stage {int(stage)} ({stage_name(stage)}) closed: "
            f"{reason}"
        )
        rounds_lib.end_round(tx, r.id, rounds_lib.FAILED, failure, now)
        # Nothing of the protocol is kept: no share is asked for or revealed any more.
        tx.run("DELETE FROM secure_requests WHERE round = ?", (r.id,))
        tx.run(
            "UPDATE secure_rounds SET stage = ?, answered = 0, state = ? WHERE round = ?",
            (int(Stage.FAILED), b"", r.id),
        )
        log.warning("%s", failure)


_PROTOCOL_FAILED = "Secure aggregation round failed: "


def _check_kind(r: rounds_lib.Round) -> None:
    if r.kind != rounds_lib.SECURE:
        raise protocol.Conflict(
            f"Expected a secure round, found round {r.id} of kind '{r.kind}'; upload its "
            f"report with PUT /v1/rounds/{r.id}/report."
        )


def _assignment(tx: sql.Tx, r: rounds_lib.Round, client_id: str) -> str:
    row = tx.one("SELECT state FROM assignments WHERE round = ? AND client = ?", (r.id, client_id))
    if row is None:
        raise protocol.Forbidden(
            f"Expected a message for a round this client was assigned, found one for round "
            f"{r.id}, which it was not assigned; check in to get a task."
        )
    return str(row[0])


def _request_of(
    tx: sql.Tx, r: rounds_lib.Round, stage: int, client_id: str, assignment: str
) -> bytes | None:
    """The client's request in `stage`, or None if it takes no part in it. Stage 1's
    request is everyone's (for the clients still assigned); the others are each client's
    own, made for the stage's participants only."""
    if stage == Stage.ADVERTISE_KEYS and assignment != admission.Assignment.ASSIGNED:
        return None
    row = tx.one(
        "SELECT data FROM secure_requests WHERE round = ? AND client = ? AND stage = ?",
        (r.id, EVERYONE if stage == Stage.ADVERTISE_KEYS else client_id, stage),
    )
    return None if row is None else bytes(row[0])


def _dropped(r: rounds_lib.Round, stage: int, client_id: str) -> protocol.Gone:
    return protocol.Gone(
        f"Expected a client taking part in stage {stage} ({stage_name(stage)}) of round {r.id}, "
        f"found {client_id}, which dropped out (it did not answer an earlier stage in time, or "
        "the protocol left it out); it has nothing more to do in this round.",
        reason="dropped",
    )


def _complete(r: rounds_lib.Round, server: secagg.SecAggServer, answered: int) -> bool:
    """Whether the current stage has every answer it waits for."""
    if server.stage == Stage.ADVERTISE_KEYS:
        return r.assigned >= r.capacity and answered >= r.assigned
    if server.stage == Stage.MASKED_INPUT and r.reports >= r.target:
        return True
    return answered >= len(server.participants())
