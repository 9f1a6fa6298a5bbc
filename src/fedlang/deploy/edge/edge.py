"""`Edge`: a task store server whose rounds are the root's (`fedlang serve --upstream`).

Clients talk to an edge exactly as to the root: they enroll with the edge's population
token, pin the **edge's** public key, check in, fetch plan and broadcast, and report.
A thread (`sync`) keeps the edge's store in step with the root:

1. it lists the open plain rounds of its population at the root (and secure rounds run
   by edges; a long poll), and
   joins each new one: its share is seats (`capacity`) and a `target`;
2. it copies the round's plan and broadcast, checks their hashes, verifies the plan
   against the root's key (pinned by the edge on first contact, or given), signs the
   same plan bytes with its own key, and opens a local round of them with its share
   as cohort (quorum 1), due `forward_margin` seconds before the root round's deadline
   (`store/upstream.py`: the local round and its row there are written in one
   transaction);
3. its clients report to the local round, folded there as at any server (the one
   intake): an acknowledged report is in the edge's store;
4. once the local round ended (its target met, or its deadline passed), it forwards
   `<reports, dropped, aggregate>` to the root, retrying until the root answers; a
   refusal that no retry changes (the root round closed: `late`; another partial:
   `conflict`) is recorded and not retried.

A secure round of the root (its plan has secure aggregations; the root gives all its
seats to edges) is mirrored by a secure round here (`_mirror_secure`): the edge's
clients run SecAgg+ against the edge exactly as against a single server, and the
partial forwarded when it ends is its aggregate, the group's unmasked sum folded with
the same clients' plain reports (`_secure_partial`); the edge learns only its group's
sum, the root only each group's.

A restarted edge (after kill -9) finds its rounds and reports in its store and goes on
from step 3 (a secure round goes on from the stage it was in, as a restarted server's). An ephemeral edge (`fedlang serve --upstream ... --ephemeral`) keeps its
store in a temporary directory removed when it stops: what it held is lost with it,
and the root counts its seats as dropouts when the round ends.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from fedlang.core import signing
from fedlang.deploy import protocol
from fedlang.deploy.client import connection
from fedlang.deploy.edge import link as link_lib
from fedlang.deploy.edge import sessions as sessions_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import serve
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import upstream as upstream_lib

log = logging.getLogger("fedlang.deploy.edge")


class KeyMismatch(RuntimeError):
    """The root's public key is not the one this edge pinned."""


class Edge:
    """An edge aggregator (see the module docstring).

    Args:
      server: the edge's own server (its store, key and port); not started yet.
      upstream: the root's URL.
      token: the edge's token, made by the root's admin (`POST /v1/admin/edges`).
      upstream_key: the root's public key (raw 32 bytes) to pin; by default the one the
        root shows on first contact, kept in the edge's store.
      poll: seconds of each long poll of the root's rounds (also the longest wait before
        an ended round's partial is forwarded).
      forward_margin: seconds before the root round's deadline at which the edge's round
        ends and forwards; by default a tenth of the time left, between 1 and 30 s.
      patience: seconds one call retries an unreachable root.
      verify: TLS verification of the root.
    """

    def __init__(
        self,
        server: serve.Server,
        upstream: str,
        token: str,
        *,
        upstream_key: bytes | None = None,
        poll: float = 1.0,
        forward_margin: float | None = None,
        patience: float = 10.0,
        verify: Any = True,
    ):
        self.server = server
        self.link = link_lib.Link(upstream, token, patience=patience, verify=verify)
        self.state = server.app_state
        self.upstream = upstream_lib.Upstream(self.state.rounds)
        self.upstream_key = upstream_key
        self.poll = poll
        self.forward_margin = forward_margin
        self.population: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        # buffered sessions: mirrored and forwarded in batches on a thread of their own
        self.sessions = sessions_lib.Sessions(
            link_lib.Link(upstream, token, patience=patience, verify=verify), self.state,
            self._check_key, lambda: self.population, poll)

    # -- life

    def connect(self) -> str:
        """First contact: pins the root's key, makes the local population if new; returns
        the population's name and, when made now, its enrollment token (else None).

        Raises:
          KeyMismatch: the root shows another key than the one pinned.
          ServerUnavailable, ProtocolError: the root cannot be reached, or refuses the token.
        """
        listing = self.link.rounds()
        self._check_key(listing)
        self.population = str(listing["population"])
        return self.population

    def create_population(self) -> str | None:
        """The local population's enrollment token when made now (None: it existed)."""
        assert self.population is not None, "connect() first"
        try:
            return self.state.store.create_population(self.population)
        except protocol.Conflict:
            return None

    def start(self) -> Edge:
        """Serves on a background thread and starts syncing with the root."""
        if self.population is None:
            self.connect()
        self.server.start()
        self._start_sync()
        return self

    def serve(self) -> None:
        """Serves until interrupted, syncing with the root meanwhile."""
        if self.population is None:
            self.connect()
        self._start_sync()
        try:
            self.server.serve()
        finally:
            self._stop_sync()

    def request_stop(self) -> None:
        self._stop.set()
        self.server.request_stop()

    def stop(self) -> None:
        self._stop_sync()
        self.server.stop()
        self.link.close()

    def __enter__(self) -> Edge:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def _start_sync(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True, name="fedlang-edge")
        self._thread.start()
        self.sessions.start()

    def _stop_sync(self) -> None:
        self.sessions.stop()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except KeyMismatch as e:  # nothing to do until an operator acts
                log.error("%s", e)
                self._stop.wait(self.poll * 10)
            except (connection.ServerUnavailable, connection.ServerError,
                    protocol.ProtocolError, OSError) as e:
                log.warning("edge: the root did not answer (%s); trying again", e)
                self._stop.wait(self.poll)
            except Exception:  # a plan whose signature fails, a broken database: said, retried
                log.exception("edge: a pass with the root failed; trying again")
                self._stop.wait(self.poll)

    # -- one pass

    def sync(self) -> None:
        """One pass: forwards the partials of ended rounds, mirrors new root rounds
        (waiting up to `poll` seconds for one), and forwards again."""
        self.forward()
        listing = self.link.rounds(wait=self.poll)
        key = self._check_key(listing)
        if listing["finished"] and self.population is not None:
            self.state.store.finish_population(self.population)
        known = {m.upstream for m in self.upstream.mirrors()}
        for r in listing["rounds"]:
            if r["id"] not in known:
                self._mirror(r, key)
        self.forward()

    def _check_key(self, listing: dict[str, Any]) -> bytes:
        shown = plan_lib.unb64(listing["public_key"])
        pinned = self.upstream.pinned_key(self.upstream_key or shown)
        if shown != pinned:
            raise KeyMismatch(
                f"Expected the root at {self.link.url} to sign with the key this edge pinned "
                f"({plan_lib.b64(pinned)}), found {listing['public_key']}; if the root's key "
                "was changed on purpose, start the edge on a new database."
            )
        return pinned

    def _mirror(self, r: dict[str, Any], key: bytes) -> None:
        """Joins root round `r` and opens the local round mirroring it."""
        try:
            joined = self.link.join(r["id"])
        except (protocol.Gone, protocol.Conflict) as e:  # closed, or no seat: the next one
            log.info("edge: not joining round %s: %s", r["id"], e)
            return
        share = joined["share"]
        signed = self.link.blob(joined["plan"])
        plan = signing.verify(signed, key)  # raises SignatureError: nothing is opened
        folder = folding.Folder(plan)
        broadcast = self.link.blob(joined["broadcast"])
        folding.decode(broadcast, folder.plan.broadcast_type, None, "the round's broadcast")
        store = self.state.store
        local_plan = store.put_blob(signing.sign(plan, self.state.key))
        local_broadcast = store.put_blob(broadcast)
        left = float(joined["seconds_left"])
        margin = self.forward_margin
        if margin is None:
            margin = min(30.0, max(1.0, left / 10))
        target, capacity = int(share["target"]), int(share["capacity"])
        if folder.plan.secure:
            self._mirror_secure(r["id"], folder, local_plan, local_broadcast, target, capacity,
                                max(0.5, left - margin))
            return
        options = rounds_lib.CohortOptions(
            target, over_selection=(capacity - target) / target, quorum=1,
            deadline=max(0.5, left - margin),
        )
        assert self.population is not None
        local = self.upstream.open(r["id"], self.population, local_plan, local_broadcast,
                                   options, folder.empty())
        log.info("edge: round %s of the root is round %s here (target %s, %s seats)",
                 r["id"], local.id, target, capacity)

    def _mirror_secure(self, upstream: int, folder: folding.Folder, plan: str, broadcast: str,
                       target: int, capacity: int, deadline: float) -> None:
        """Opens the secure round mirroring secure root round `upstream` (run by its edges):
        SecAgg+ over this edge's clients, its share as cohort, at least `MIN_SECURE_GROUP`
        of them (its quorum), stages timed as a single server's (a quarter of its time).
        A share too small for a group, or moduli SecAgg+ cannot sum over it, is said and
        not opened: the root counts its seats as dropouts."""
        least = edges_lib.MIN_SECURE_GROUP
        if capacity < least:
            log.error("edge: not running secure round %s of the root: expected at least %d "
                      "seats for this edge's SecAgg+ group, found %d; open rounds with more "
                      "seats at the root, or revoke edges.", upstream, least, capacity)
            return
        goal = min(max(target, least), capacity)
        options = rounds_lib.CohortOptions(
            goal, over_selection=(capacity - goal) / goal, quorum=least, deadline=deadline,
        )
        try:
            prepare = self.state.secure.prepare(folder.plan, options)
        except protocol.BadRequest as e:
            log.error("edge: not running secure round %s of the root: %s", upstream, e)
            return
        assert self.population is not None
        local = self.upstream.open(upstream, self.population, plan, broadcast, options,
                                   folder.empty(), prepare)
        log.info("edge: secure round %s of the root is secure round %s here (target %s, %s "
                 "seats)", upstream, local.id, goal, capacity)

    @staticmethod
    def _secure_partial(r: rounds_lib.Round, aggregate: bytes, folder: folding.Folder) -> bytes:
        """The partial of an ended local secure round. Closed: its aggregate, the group's
        SecAgg+ sum folded with the same clients' plain reports (what a single server's
        round holds), its clients that did not report counted as dropouts (a client in
        the sum that missed the last stage is a report, not also a dropout). Failed: no
        report at all (its plain reports arrived with masked inputs that were never
        summed), its assigned clients counted as dropouts."""
        if r.state == rounds_lib.FAILED:
            return folder.encode_partial(folder.empty(), 0, r.assigned)
        return folder.encode_partial(aggregate, r.reports, min(r.dropped, r.assigned - r.reports))

    def forward(self) -> int:
        """Forwards the partial of every mirrored round that ended and was not
        acknowledged; returns how many the root took."""
        taken = 0
        for m in self.upstream.mirrors(pending=True):
            if self.state.rounds.round(m.round).state == rounds_lib.OPEN:  # closes it when due
                continue
            r, aggregate = self.state.rounds.aggregate(m.round)
            folder = self.state.verified.folder(r.plan)
            if r.kind == rounds_lib.SECURE:
                body = self._secure_partial(r, aggregate, folder)
            else:
                body = folder.encode_partial(aggregate, r.reports, r.dropped)
            try:
                self.link.forward(m.upstream, body)
            except protocol.Gone:
                self.upstream.forwarded(m.upstream, "late")
                continue
            except protocol.Conflict:
                self.upstream.forwarded(m.upstream, "conflict")
                continue
            self.upstream.forwarded(m.upstream, "accepted")
            taken += 1
        return taken
