"""Buffered (asynchronous, FedBuff) sessions through an edge aggregator.

A thread of the edge (`Sessions.run`, started with the edge's round sync) keeps the
edge's buffered sessions in step with the root's:

1. it lists the open buffered sessions of its population at the root, joins each new
   one, copies its plan (verified against the root's pinned key, signed again by the
   edge) and its current version's weights, and opens a local session of them with the
   root's version, buffer size and staleness bound (`store/upstream_sessions.py`);
2. it moves each local session to every newer version the root publishes as the
   root's driver steps (checked weights, copied), and closes it when the root's closes;
3. its clients check in, train and report to the local session exactly as at the root:
   the edge's intake admits each report (authentication, limits, the plan's type and
   bounds, replay, the staleness bound against the version the edge mirrors), and an
   acknowledged report is in the edge's store;
4. it forwards the reports not forwarded yet to the root in **batches**: one upload of
   at most the room the root's buffer shows (`buffer_size - pending`), recorded before
   it is sent and sent again with the same bytes until the root answers (a resent batch
   is a replay at the root, recognized by its digest): each report reaches the root's
   buffer exactly once, also across kill -9 of the edge.

**Why batches of reports, not one folded sum.** A buffered process's buffer holds each
of its K reports, and its server step aggregates them as a cohort of K clients (the
model aggregator: a weighted mean, DP clipping per report, robust aggregation, the
clients' training metrics; `learning/buffered.py`), with each report's update weighted
by its staleness against the root's version when the report enters the buffer. A sum
folded at the edge would be the same only for a plain mean, and only up to rounding; an
edge cannot know at which root version its reports will arrive either. So the edge's
fold of n reports is their batch: one upload and one transaction at the root for n
reports, each kept as it was reported, with the version it trained. The root stores
each as if its client had uploaded it straight to the root when the batch arrived (its
staleness against the root's version then; too stale: refused and counted), and the
root's driver folds them one by one as always: the model is exactly the one the same
reports give sent straight to the root in that order.

**Overfill.** The root takes a batch whole or not at all, and only when its reports fit
the free room of the buffer (else 503 `buffer_full`, nothing kept; the edge sends the
same batch again after the next version): the root never holds more than K unapplied
reports, and the driver's step semantics are unchanged. The edge sends at most the room
the root showed it, and holds at most K reports not forwarded (its own buffer: its
clients are told to retry, 503, as the root's are).

**Durability.** An acknowledged report is in the edge's store; a restarted edge (after
kill -9) resends the batch it was sending, then forwards the rest. An ephemeral edge
(`--ephemeral`) loses its store when it stops: the reports it acknowledged and had not
forwarded are lost (its clients are not told; the session goes on with the others).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from fedlang.core import signing
from fedlang.deploy import protocol
from fedlang.deploy.client import connection
from fedlang.deploy.edge import link as link_lib
from fedlang.deploy.plans import batch as batch_lib
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import upstream_sessions as upstream_lib

log = logging.getLogger("fedlang.deploy.edge")


class Sessions:
    """An edge's buffered sessions (see the module docstring).

    Args:
      link: HTTP to the root, its own (this thread's); closed by `stop`.
      state: the edge's server state (its store, key, verified plans).
      check_key: the root's pinned key, given a listing (raises `KeyMismatch`).
      population: the edge's population (known once the edge connected).
      poll: seconds between two looks at the root's sessions.
    """

    def __init__(self, link: link_lib.Link, state: state_lib.ServerState,
                 check_key: Callable[[dict[str, Any]], bytes],
                 population: Callable[[], str | None], poll: float):
        self.link = link
        self.state = state
        self.check_key = check_key
        self.population = population
        self.upstream = upstream_lib.UpstreamSessions(self.state.sessions)
        self.poll = poll
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, daemon=True,
                                        name="fedlang-edge-sessions")
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None
        self.link.close()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync()
            except (connection.ServerUnavailable, connection.ServerError,
                    protocol.ProtocolError, OSError) as e:
                log.warning("edge: the root's sessions did not answer (%s); trying again", e)
            except Exception:  # a plan whose signature fails, a broken database: said, retried
                log.exception("edge: a pass over the root's sessions failed; trying again")
            self._stop.wait(self.poll)

    # -- one pass

    def sync(self) -> int:
        """One pass: mirrors new root sessions, follows their versions, closes ended
        ones, and forwards one batch per session; returns how many reports the root
        took."""
        listing = self.link.sessions()
        key = self.check_key(listing)
        listed = {int(s["id"]): s for s in listing["sessions"]}
        for m in self.upstream.mirrors(pending=True):
            if m.upstream not in listed:  # closed at the root
                self.upstream.end(m.upstream, "closed")
        known = {m.upstream for m in self.upstream.mirrors()}
        for sid, s in listed.items():
            if sid not in known:
                self._mirror(s, key)
        taken = 0
        for m in self.upstream.mirrors(pending=True):
            if m.upstream in listed:
                self._follow(m, listed[m.upstream])
                taken += self.forward(m.upstream, listed[m.upstream])
        return taken

    def _mirror(self, s: dict[str, Any], key: bytes) -> None:
        """Joins root session `s` and opens the local session mirroring it."""
        try:
            joined = self.link.join_session(int(s["id"]))
        except (protocol.Gone, protocol.NotFound) as e:
            log.info("edge: not joining session %s: %s", s["id"], e)
            return
        plan = signing.verify(self.link.blob(joined["plan"]), key)  # SignatureError: no session
        parsed = buffered_plan.BufferedPlan.from_bytes(plan)
        weights = self._weights(joined["weights"], parsed)
        store = self.state.store
        population = self.population()
        assert population is not None, "the edge connects first"
        local = self.upstream.open(
            int(joined["id"]), population, store.put_blob(signing.sign(plan, self.state.key)),
            store.put_blob(weights), version=int(joined["version"]),
            buffer_size=int(joined["buffer_size"]), max_staleness=int(joined["max_staleness"]),
        )
        log.info("edge: session %s of the root is session %s here (version %s)",
                 joined["id"], local.id, joined["version"])

    def _weights(self, h: str, plan: buffered_plan.BufferedPlan) -> bytes:
        data = self.link.blob(h)
        folding.decode(data, plan.weights_type, None, "the session's model weights")
        return data

    def _follow(self, m: upstream_lib.SessionMirror, s: dict[str, Any]) -> None:
        """Moves the local session to the root's version, if newer."""
        local = self.state.sessions.session(m.session)
        if int(s["version"]) > local.version:
            plan = self.state.verified.buffered(local.plan)
            weights = self.state.store.put_blob(self._weights(s["weights"], plan))
            self.upstream.advance(m.session, int(s["version"]), weights)

    def forward(self, upstream: int, s: dict[str, Any]) -> int:
        """Sends the batch being sent, or a new one of at most the root buffer's free
        room; returns the reports the root took (0: none, or nothing to send)."""
        m = self.upstream.next_batch(upstream, int(s["buffer_size"]) - int(s["pending"]))
        if m.sending_through is None:
            return 0
        reports = self.state.sessions.reports(m.session, m.forwarded_through,
                                               m.sending_through - m.forwarded_through)
        body = batch_lib.encode([(r.version, r.data) for r in reports])
        number = m.batches + 1
        try:
            answer = self.link.forward_batch(upstream, number, body)
        except (protocol.Gone, protocol.Conflict, protocol.BadRequest, protocol.Forbidden) as e:
            log.error("edge: the root refused batch %s of session %s for good: %s",
                      number, upstream, e)
            self.upstream.forwarded(upstream, e.reason)
            return 0
        self.upstream.forwarded(upstream)
        return int(answer["accepted"])
