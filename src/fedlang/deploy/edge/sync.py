"""`Edge`: a task store server whose tasks are the root's (`fedlang serve --upstream`).

Clients talk to an edge exactly as to the root: they enroll with the edge's population
token, pin the **edge's** public key, check in, fetch plan and broadcast, and report.
At the root, the edge is a client that holds seats: it checks in for its clients
(`GET /v1/edge/tasks`), holds seats of each round it joins, and uploads what stands for
its clients' reports through the root's one intake. One loop (`Edge.sync`, on one
connection to the root) keeps the edge's store in step with the root's, over a table
`{TaskKind: Mirror}` (`MIRRORS`), each pass:

1. it lists the open tasks of its population at the root (a long poll that answers at
   once when a round is new to the edge), and checks the root's key;
2. it steps each task it mirrors (`Mirror.step`): follows the root (a session's newer
   versions; its end) and forwards what the local task owes the root;
3. it mirrors each new task (`Mirror.open`): joins it (a round: its seats, and the
   reports it should gather), copies its plan and broadcast, checks their hashes,
   verifies the plan against the root's key (pinned on first contact, or given), signs
   the same plan bytes with its own key, and opens a local task of them; the local task
   and its row in `store/mirrors.py` are written in one transaction.

**Rounds** (`RoundMirror`). A local round of the root's plan with the edge's seats as
cohort (quorum 1) is due `forward_margin` seconds before the root round's deadline. Its
clients report to it, folded there as at any server: an acknowledged report is in the
edge's store. Once it ended (its target met, or its deadline) the edge forwards
`<reports, dropped, aggregate>`, retrying until the root answers; a refusal no retry
changes (the root round closed: `late`; another partial: `conflict`) ends the mirror. A
secure root round (run by its edges: the root gives all its seats to edges) is mirrored
by a secure round here: the edge's clients run SecAgg+ against the edge exactly as
against a single server, and the partial forwarded when it ends is its aggregate, the
group's unmasked sum folded with the same clients' plain reports (`secure_partial`);
the edge learns only its group's sum, the root only each group's.

**Buffered sessions** (`SessionMirror`). A local session of the root's plan, current
version, buffer size K and staleness bound; it moves to every newer version the root
publishes and closes when the root's does. Its clients train and report exactly as at
the root (the edge's intake: bounds, staleness against the version the edge mirrors,
replays), and the edge forwards their reports in **batches** (`plans.buffered`): one
upload of at most the room the root's buffer shows (`buffer_size - pending`), recorded
before it is sent and sent again with the same bytes until the root answers (a resent
batch is a replay at the root), so each report reaches the root's buffer exactly once,
also across kill -9 of the edge. Why batches of reports, not one folded sum: a buffered
process's buffer holds each of its K reports, and its server step aggregates them as a
cohort of K clients (a weighted mean, DP clipping per report, robust aggregation, the
clients' metrics; `learning/buffered.py`), each weighted by its staleness against the
root's version when it enters the buffer. A sum folded at the edge would be the same
only for a plain mean, and only up to rounding, and an edge cannot know at which root
version its reports will arrive. So the root stores each report of a batch as if its
client had uploaded it straight to the root when the batch arrived, and the model is
exactly the one the same reports give sent straight to the root in that order. The
root takes a batch whole or not at all, and only when it fits the free room of its
buffer (else 503 `buffer_full`: the edge sends it again after the next version); the
edge holds at most K reports not forwarded (its clients are told to retry, 503).

A restarted edge (after kill -9) finds its tasks, reports and the upload it was sending
in its store and goes on (a secure round from the stage it was in, as a restarted
server's). An ephemeral edge (`fedlang serve --upstream ... --ephemeral`) keeps its
store in a temporary directory removed when it stops: what it held is lost with it; the
root counts its seats as dropouts when the round ends, and a session goes on with the
others.

A new mode served through edges adds one `Mirror` to `MIRRORS`: how a task of its kind
is opened here and what it forwards. A mode with none is not served by edges.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Mapping
from typing import Any, Protocol

from fedlang.core import signing, types
from fedlang.deploy import protocol
from fedlang.deploy.client import connection
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import serve
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import mirrors as mirrors_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import sql

log = logging.getLogger("fedlang.deploy.edge")
Kind = protocol.TaskKind
# The root's task as its listing shows it (`schemas.EdgeTaskOut`).
Task = dict[str, Any]


class KeyMismatch(RuntimeError):
    """The root's public key is not the one this edge pinned."""


class Link:
    """HTTP to the root, as an edge (by its token): one connection for the loop.

    Args:
      url: the root's URL.
      token: the edge's token (`POST /v1/admin/edges` on the root).
      patience: seconds one call retries an unreachable root before it raises
        `ServerUnavailable` (the edge then tries again on its next pass).
      verify: TLS verification (True, False, or a CA bundle path).
    """

    PATHS = {Kind.AGGREGATE: "rounds", Kind.SECURE: "rounds", Kind.BUFFERED: "sessions"}

    def __init__(self, url: str, token: str, *, patience: float = 10.0, verify: Any = True):
        self.token = token
        self.conn = connection.Connection(url, patience=patience, verify=verify,
                                          backoff=(0.1, 2.0))
        self.url = self.conn.url

    def tasks(self, wait: float = 0.0) -> dict[str, Any]:
        """The edge's population, whether it is finished, the root's public key, and its
        open tasks (`wait`: long poll until a round is new to the edge)."""
        result: dict[str, Any] = self.conn.json(
            "GET", "/v1/edge/tasks", token=self.token, params={"wait": wait}, timeout=60 + wait)
        return result

    def join(self, kind: Kind, task_id: int) -> Task:
        """The root's task as the edge holds it (a round: its seats, made on the first call)."""
        result: Task = self.conn.json(
            "POST", f"/v1/edge/{self.PATHS[kind]}/{task_id}/join", token=self.token)
        return result

    def blob(self, h: str) -> bytes:
        """A blob of a root task, streamed and checked against its hash."""
        return self.conn.download(
            f"/v1/edge/blobs/{h}", token=self.token, expected_hash=h)

    def upload(self, path: str, body: bytes, task: Mapping[str, Any], *, retry: bool = True
               ) -> dict[str, Any]:
        """Uploads `body` to `/v1/edge/PATH` (idempotent at the root), bound to the root's
        `task` (`protocol.task_header`: its round, or its session; the mirror's
        `upstream`, kept across restarts)."""
        result: dict[str, Any] = self.conn.json(
            "PUT", f"/v1/edge/{path}", token=self.token, content=body,
            headers={"Content-Type": protocol.BINARY, **protocol.task_header(task)},
            retry=retry,
        )
        return result

    def close(self) -> None:
        self.conn.close()


class Mirror(Protocol):
    """How an edge mirrors the root's tasks of one kind (see the module docstring)."""

    def open(self, edge: Edge, task: Task, key: bytes) -> None:
        """Joins root task `task` and opens the local task mirroring it (with its row in
        `mirrors`, in one transaction); says why and opens nothing when it cannot."""

    def step(self, edge: Edge, m: mirrors_lib.Mirror, task: Task | None) -> int:
        """Follows the root task (`task`, None when the root no longer lists it) and
        forwards what the local task owes the root; returns the reports the root took."""


def _sign_here(edge: Edge, signed: bytes, key: bytes) -> tuple[bytes, str]:
    """(the plan, its blob here): verified against the root's key (SignatureError:
    nothing is opened), signed with the edge's own."""
    plan = signing.verify(signed, key)
    return plan, edge.state.store.put_blob(signing.sign(plan, edge.state.key))


def _copy_value(edge: Edge, h: str, t: types.Type, what: str) -> str:
    """The root's blob `h` (a broadcast, a version's weights), checked to be a value of
    type `t` (`what` it should be) and stored here; its hash."""
    data = edge.link.blob(h)
    folding.decode(data, t, None, what)
    return edge.state.store.put_blob(data)


class RoundMirror:
    """A root round (plain, or secure run by its edges) mirrored by a local round."""

    def open(self, edge: Edge, task: Task, key: bytes) -> None:
        kind, upstream = Kind(task["kind"]), int(task["id"])
        try:
            joined = edge.link.join(kind, upstream)
        except (protocol.Gone, protocol.Conflict) as e:  # closed, or no seat: the next one
            log.info("edge: not joining round %s: %s", upstream, e)
            edge.passed.add((kind, upstream))
            return
        plan, local_plan = _sign_here(edge, edge.link.blob(joined["plan"]), key)
        folder = folding.Folder(plan)
        local_broadcast = _copy_value(edge, joined["broadcast"], folder.plan.broadcast_type,
                                      "the round's broadcast")
        left = float(joined["seconds_left"])
        margin = edge.forward_margin
        if margin is None:
            margin = min(30.0, max(1.0, left / 10))
        deadline = max(0.5, left - margin)
        target, seats = int(joined["share"]["target"]), int(joined["share"]["capacity"])
        prepare = None
        if folder.plan.secure:
            # SecAgg+ over this edge's clients: at least `MIN_SECURE_GROUP` of them (its
            # quorum), stages timed as a single server's (a quarter of its time)
            least = edges_lib.MIN_SECURE_GROUP
            if seats < least:
                log.error("edge: not running secure round %s of the root: expected at least %d "
                          "seats for this edge's SecAgg+ group, found %d; open rounds with "
                          "more seats at the root, or revoke edges.", upstream, least, seats)
                edge.passed.add((kind, upstream))
                return
            target = min(max(target, least), seats)
            options = rounds_lib.CohortOptions(
                target, over_selection=(seats - target) / target, quorum=least,
                deadline=deadline)
            try:
                prepare = edge.state.secure.prepare(folder.plan, options)
            except protocol.BadRequest as e:
                log.error("edge: not running secure round %s of the root: %s", upstream, e)
                edge.passed.add((kind, upstream))
                return
        else:
            options = rounds_lib.CohortOptions(
                target, over_selection=(seats - target) / target, quorum=1, deadline=deadline)

        def record(tx: sql.Tx, r: rounds_lib.Round) -> None:
            if prepare is not None:
                prepare(tx, r)
            edge.mirrors.record(tx, kind, upstream, r.id)

        local = edge.state.rounds.create(
            edge.population or "", local_plan, local_broadcast, options, folder.empty(),
            request_id=f"upstream-round-{upstream}", kind=kind, on_create=record)
        log.info("edge: %s round %s of the root is round %s here (target %s, %s seats)",
                 kind, upstream, local.id, target, seats)

    def step(self, edge: Edge, m: mirrors_lib.Mirror, task: Task | None) -> int:
        """Forwards the partial aggregate of the local round once it ended."""
        rounds = edge.state.rounds
        if rounds.round(m.local).state == rounds_lib.OPEN:  # (closes it when due)
            return 0
        r, aggregate = rounds.aggregate(m.local)
        folder = edge.state.verified.folder(r.plan)
        if r.kind == rounds_lib.SECURE:
            body = secure_partial(r, aggregate, folder)
        else:
            body = folder.encode_partial(aggregate, r.reports, r.dropped)
        try:
            edge.link.upload(f"rounds/{m.upstream}/partial", body, {"round": m.upstream})
        except (protocol.Gone, protocol.Conflict) as e:  # closed without it; another partial
            log.error("edge: the root refused the partial of round %s: %s", m.upstream, e)
            edge.mirrors.finish(m, e.reason)
            return 0
        edge.mirrors.finish(m, "accepted", uploads=1)
        return r.reports


def secure_partial(r: rounds_lib.Round, aggregate: bytes, folder: folding.Folder) -> bytes:
    """The partial of an ended local secure round. Closed: its aggregate, the group's
    SecAgg+ sum folded with the same clients' plain reports (what a single server's
    round holds), its clients that did not report counted as dropouts (a client in the
    sum that missed the last stage is a report, not also a dropout). Failed: no report at
    all (its plain reports arrived with masked inputs that were never summed), its
    assigned clients counted as dropouts."""
    if r.state == rounds_lib.FAILED:
        return folder.encode_partial(folder.empty(), 0, r.assigned)
    return folder.encode_partial(aggregate, r.reports, min(r.dropped, r.assigned - r.reports))


class SessionMirror:
    """A root buffered session mirrored by a local session (see the module docstring)."""

    def open(self, edge: Edge, task: Task, key: bytes) -> None:
        upstream = int(task["id"])
        try:
            joined = edge.link.join(Kind.BUFFERED, upstream)
        except (protocol.Gone, protocol.NotFound) as e:
            log.info("edge: not joining session %s: %s", upstream, e)
            edge.passed.add((Kind.BUFFERED, upstream))
            return
        plan, local_plan = _sign_here(edge, edge.link.blob(joined["plan"]), key)
        weights = _copy_value(edge, joined["broadcast"],
                              buffered_plan.BufferedPlan.from_bytes(plan).weights_type,
                              "the session's model weights")
        local = edge.state.sessions.create(
            edge.population or "", local_plan, weights, version=int(joined["version"]),
            buffer_size=int(joined["buffer_size"]), max_staleness=int(joined["max_staleness"]),
            request_id=f"upstream-session-{upstream}",
            on_create=lambda tx, s: edge.mirrors.record(tx, Kind.BUFFERED, upstream, s.id))
        log.info("edge: session %s of the root is session %s here (version %s)",
                 upstream, local.id, joined["version"])

    def step(self, edge: Edge, m: mirrors_lib.Mirror, task: Task | None) -> int:
        """Ends the local session with the root's; moves it to the root's version, if
        newer; sends the batch being sent, or a new one of at most the root buffer's free
        room."""
        sessions = edge.state.sessions
        if task is None:  # closed at the root: what it held and had not forwarded stays here
            edge.mirrors.finish(m, "closed")
            sessions.close(m.local)
            return 0
        local = sessions.session(m.local)
        if int(task["version"]) > local.version:
            plan = edge.state.verified.buffered(local.plan)
            weights = _copy_value(edge, task["broadcast"], plan.weights_type,
                                  "the session's model weights")
            sessions.advance(m.local, int(task["version"]), weights)
        m = edge.mirrors.sending(m, local.reports, int(task["buffer_size"]) - int(task["pending"]))
        if m.sending_through is None:
            return 0
        reports = sessions.reports(m.local, m.forwarded_through,
                                   m.sending_through - m.forwarded_through)
        body = buffered_plan.encode_batch([(r.version, r.data) for r in reports])
        number = m.uploads + 1
        try:  # once: the same bytes go again on the next pass
            answer = edge.link.upload(f"sessions/{m.upstream}/batches/{number}", body,
                                      {"session": m.upstream}, retry=False)
        except (protocol.Gone, protocol.Conflict, protocol.BadRequest, protocol.Forbidden) as e:
            log.error("edge: the root refused batch %s of session %s for good: %s",
                      number, m.upstream, e)
            edge.mirrors.finish(m, e.reason)
            sessions.close(m.local)
            return 0
        edge.mirrors.sent(m, lambda tx, through: sessions.release(tx, m.local, through))
        return int(answer["accepted"])


# What an edge mirrors of each kind of the root's tasks.
MIRRORS: dict[Kind, Mirror] = {
    Kind.AGGREGATE: RoundMirror(),
    Kind.SECURE: RoundMirror(),
    Kind.BUFFERED: SessionMirror(),
}


class Edge:
    """An edge aggregator (see the module docstring).

    Args:
      server: the edge's own server (its store, key and port); not started yet.
      upstream: the root's URL.
      token: the edge's token, made by the root's admin (`POST /v1/admin/edges`).
      upstream_key: the root's public key (raw 32 bytes) to pin; by default the one the
        root shows on first contact, kept in the edge's store.
      poll: seconds of each long poll of the root's tasks (also the longest wait before
        an ended round's partial is forwarded, and between two looks at a session).
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
        self.link = Link(upstream, token, patience=patience, verify=verify)
        self.state = server.app_state
        self.mirrors = mirrors_lib.Mirrors(self.state.store)
        self.upstream_key = upstream_key
        self.poll = poll
        self.forward_margin = forward_margin
        self.population: str | None = None
        # root tasks this edge did not mirror (no seat, too few for a group), until it restarts
        self.passed: set[tuple[Kind, int]] = set()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- life

    def connect(self) -> str:
        """First contact: pins the root's key; returns the population's name.

        Raises:
          KeyMismatch: the root shows another key than the one pinned.
          ServerUnavailable, ProtocolError: the root cannot be reached, or refuses the token.
        """
        listing = self.link.tasks()
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

    def _stop_sync(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=60)
            self._thread = None

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                # a pass lasts `poll` seconds at least: the root's listing answers at once
                # while it shows a round the edge did not join (no seat left for it)
                start = time.monotonic()
                self.sync()
                self._stop.wait(self.poll - (time.monotonic() - start))
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

    def sync(self) -> int:
        """One pass (see the module docstring): checks in with the root (waiting up to
        `poll` seconds for a new round), steps every task it mirrors, and mirrors the
        new ones; returns how many reports the root took."""
        listing = self.link.tasks(wait=self.poll)
        key = self._check_key(listing)
        if listing["finished"] and self.population is not None:
            self.state.store.finish_population(self.population)
        kinds = {k.value: k for k in MIRRORS}  # (a kind this edge does not know: not served)
        listed = {(kinds[t["kind"]], int(t["id"])): t for t in listing["tasks"]
                  if t["kind"] in kinds}
        taken = 0
        for m in self.mirrors.all(pending=True):
            taken += MIRRORS[m.kind].step(self, m, listed.get((m.kind, m.upstream)))
        known = {(m.kind, m.upstream) for m in self.mirrors.all()} | self.passed
        for (kind, task_id), task in listed.items():
            if (kind, task_id) not in known:
                MIRRORS[kind].open(self, task, key)
        return taken

    def _check_key(self, listing: dict[str, Any]) -> bytes:
        shown = plan_lib.unb64(listing["public_key"])
        pinned = self.mirrors.pinned_key(self.upstream_key or shown)
        if shown != pinned:
            raise KeyMismatch(
                f"Expected the root at {self.link.url} to sign with the key this edge pinned "
                f"({plan_lib.b64(pinned)}), found {listing['public_key']}; if the root's key "
                "was changed on purpose, start the edge on a new database."
            )
        return pinned
