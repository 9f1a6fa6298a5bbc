"""The routes of rounds: the driver opens a round (plain, or secure when its plan has
secure aggregations), waits for it and reads its aggregate; a client uploads its report
to a plain round, and an edge aggregator, which holds seats of the round for its own
clients (`POST /v1/edge/rounds/{round}/join`), its partial aggregate, standing for their
reports: both through the intake (`ReportUploads`). A secure round's stages have their
own routes (`secure.py`)."""

from __future__ import annotations

from concurrent import futures
from typing import Any

import fastapi
from fastapi import responses

from fedlang.deploy import protocol
from fedlang.deploy.plans import folding
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, plans, routing, schemas
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import edges as edges_lib
from fedlang.deploy.store import rounds as rounds_lib
from fedlang.deploy.store import shards as shards_lib

router = fastapi.APIRouter(prefix=protocol.API)


class RoundUploads:
    """What the uploads to a round share: the round, found in the uploader's population,
    and where a refusal is counted (the round's `late` or `refused`)."""

    def __init__(self, server: state_lib.ServerState):
        self.server = server

    def target(self, task_id: int, uploader: auth_lib.Uploader) -> rounds_lib.Round:
        return intake.visible(self.server.rounds.round(task_id), uploader, "round")

    def task(self, target: rounds_lib.Round, upload: intake.Upload) -> dict[str, int | None]:
        """The round: a client's report, a secure round's answers, an edge's partial."""
        return protocol.task_of({"round": target.id})

    def count_refusal(self, reason: str, target: rounds_lib.Round) -> None:
        self.server.rounds.count_refusal(reason, target.id)

    def scan(self, target: rounds_lib.Round, upload: intake.Upload) -> folding.ReportScan | None:
        return None  # read whole


class ReportUploads(RoundUploads):
    """A folded round's uploads, as the intake takes them: one per holder of seats, checked
    by the round's `folding.Folder` and folded with the others waiting
    (`shards.ReportShards`): a client's report (one seat), or an edge's partial aggregate
    (`Folder.check_partial`: its clients' reports folded together, standing for them)."""

    def limit(self, target: rounds_lib.Round, upload: intake.Upload) -> int:
        folder = self.server.verified.folder(target.plan)
        most = folder.max_partial_bytes if upload.uploader.holds_seats else folder.max_report_bytes
        return most + (1 << 20)

    def precheck(self, target: rounds_lib.Round, upload: intake.Upload) -> bool:
        return self.server.rounds.precheck(target, upload.client, upload.digest)

    def scan(self, target: rounds_lib.Round, upload: intake.Upload) -> folding.ReportScan | None:
        """A client's report of a large model (`Folder.streamable`, reports that may
        hold more than `--stream-report-bytes`): checked as it arrives and stored, never
        held; the others whole."""
        folder = self.server.verified.folder(target.plan)
        if (upload.uploader.holds_seats or not folder.streamable
                or folder.max_report_bytes <= self.server.stream_report_bytes):
            return None
        return folder.scan()

    def check(self, target: rounds_lib.Round, upload: intake.Upload) -> Any:
        folder = self.server.verified.folder(target.plan)
        if upload.scan is not None and upload.staging is not None:
            return shards_lib.Stored(upload.staging, upload.scan.result())
        if upload.uploader.holds_seats:
            return folder.check_partial(upload.body)
        return folder.check(upload.body)

    def bounded(self, target: rounds_lib.Round, upload: intake.Upload) -> Any:
        """A client's report's bounds; None for a partial aggregate, which is no one
        client's report: its edge bounded each of its clients' reports (its intake is
        this one, against the same signed plan), and it was checked for finite values
        and counts that agree (`check_partial`), from an edge the root's admin made."""
        if upload.uploader.holds_seats:
            return None
        folder = self.server.verified.folder(target.plan)
        checked = upload.checked
        return folder.bounds, folder.leaves(
            checked.report.value if isinstance(checked, shards_lib.Stored) else checked)

    def accept(self, target: rounds_lib.Round, upload: intake.Upload) -> futures.Future[bool]:
        # folded in this process's shard of the round, committed with others waiting
        return self.server.shards.submit(
            target.id, upload.client, upload.digest, upload.size, upload.checked
        )


def create(server: state_lib.ServerState, body: schemas.RoundIn) -> rounds_lib.Round:
    """Opens the round `body` asks for (or returns the one made for its `request_id`)."""
    try:
        options = rounds_lib.CohortOptions(
            body.target, body.over_selection, body.quorum, body.deadline, body.stage_timeout
        )
    except ValueError as e:
        raise protocol.BadRequest(str(e)) from e
    round_plan, data = plans.read_plan(
        server, protocol.TaskKind.AGGREGATE, body.plan, body.broadcast, "broadcast value"
    )
    kind, on_create = rounds_lib.AGGREGATE, None
    if round_plan.secure:  # its secure inputs go only through SecAgg+
        kind, on_create = rounds_lib.SECURE, server.secure.prepare(round_plan, options)
        if server.edges.check_secure(body.population, options):
            on_create = None  # each edge runs SecAgg+ over its own clients (`store/edges.py`)
    signed = plans.sign(server, data)
    folder = folding.Folder(round_plan)
    # a large model's zero aggregate made as it is written, a slice at a time
    empty = folder.empty_parts() if folder.streamable else folder.empty()
    return server.rounds.create(
        body.population, signed, body.broadcast, options, empty, body.request_id, kind,
        on_create,
    )


# -- admin: the driver


@router.post("/admin/rounds", status_code=201, tags=["admin"])
def create_round(body: schemas.RoundIn, auth: auth_lib.Bearer, server: State) -> schemas.RoundOut:
    """Opens a round: the server signs the plan, clients can be assigned at once.
    A repeated `request_id` returns the round it made (safe to retry)."""
    auth_lib.admin(server, auth)
    return schemas.RoundOut(**create(server, body).to_json())


@router.get("/admin/rounds/{round_id}", tags=["admin"])
async def round_status(
    round_id: routing.RoundId,
    auth: auth_lib.Bearer,
    server: State,
    wait: routing.Wait = 0.0,
    seen: routing.Seen = -1,
) -> schemas.RoundOut:
    """A round's state; with `wait`, answers when the round is no longer open, when
    its report count differs from `seen`, when a secure round's stage changes, or after
    `wait` seconds (long polling)."""
    auth_lib.admin(server, auth)

    def changed(first: rounds_lib.Round, r: rounds_lib.Round) -> bool:
        return r.state != rounds_lib.OPEN or r.reports != seen or r.stage != first.stage

    r = await routing.long_poll(lambda: server.rounds.round(round_id), changed, wait, 0.1)
    return schemas.RoundOut(**r.to_json())


@router.get("/admin/rounds/{round_id}/aggregate", tags=["admin"],
            responses=routing.BINARY_RESPONSE, response_class=responses.Response)
def round_aggregate(
    round_id: routing.RoundId, auth: auth_lib.Bearer, server: State,
    byte_range: routing.Range = None, if_range: routing.IfRange = None,
) -> responses.Response:
    """The aggregate of a closed round (the binary value format, of the plan's
    report type): every accepted report folded in; streamed (a `Range`: a part of it,
    206). Kept for the latest closed rounds of each population (410 after)."""
    auth_lib.admin(server, auth)
    r, value = server.rounds.aggregate_value(round_id)
    if r.state == rounds_lib.FAILED:
        raise protocol.Conflict(r.failure, reason="failed")
    if r.state != rounds_lib.CLOSED:
        raise protocol.Conflict(
            f"Expected a closed round, found round {round_id} open ({r.reports} of "
            f"{r.target} reports); wait for it with GET /v1/admin/rounds/{round_id}?wait=30."
        )
    if value is None:
        raise rounds_lib.aggregate_deleted(round_id)
    return routing.binary(server.store, value, byte_range, if_range)


# -- clients


@router.put("/rounds/{round_id}/report", tags=["client"], openapi_extra=routing.BINARY_BODY)
async def upload_report(
    round_id: routing.RoundId, request: fastapi.Request, auth: auth_lib.Bearer, server: State,
    task: intake.TaskHeader = None,
) -> schemas.ReportOut:
    """Uploads this client's report for its task (the binary value format, of the
    plan's report type), naming the round (`Fedlang-Task`). Idempotent: the same bytes
    again change nothing."""
    new = await intake.take(server, request, auth, ReportUploads(server), round_id, task=task)
    return schemas.ReportOut(round=round_id, accepted=True, replay=not new)


# -- edges: seats held for their clients


def edge_task(server: state_lib.ServerState, r: rounds_lib.Round,
              share: edges_lib.Share | None) -> schemas.EdgeTaskOut:
    """A round as an edge sees it (and its share, once it joined)."""
    return schemas.EdgeTaskOut(
        kind=r.kind, id=r.id, state=r.state, plan=r.plan, broadcast=r.broadcast,
        seconds_left=max(0.0, r.deadline - server.store.clock()), target=r.target,
        capacity=r.capacity, quorum=r.quorum,
        share=None if share is None else schemas.ShareOut(**share.to_json()),
    )


@router.post("/edge/rounds/{round_id}/join", tags=["edge"])
def join_round(round_id: routing.RoundId, auth: auth_lib.Bearer, server: State
               ) -> schemas.EdgeTaskOut:
    """The edge's share of an open plain round of its population (its seats assigned on
    the first call: the round's divided by the population's edges), or of a secure round
    its edges run (split evenly, at least 2 seats)."""
    who = auth_lib.edge(server, auth)
    r, share = server.edges.join(auth_lib.edge_name(who), who.population, round_id)
    return edge_task(server, r, share)


@router.put("/edge/rounds/{round_id}/partial", tags=["edge"], openapi_extra=routing.BINARY_BODY)
async def upload_partial(
    round_id: routing.RoundId, request: fastapi.Request, auth: auth_lib.Bearer, server: State,
    task: intake.TaskHeader = None,
) -> schemas.ReportOut:
    """Uploads the edge's partial aggregate of a round it holds seats in (the binary value
    format, of type `<reports=int64,dropped=int64,aggregate=A>`, A the plan's aggregate
    type): one upload standing for its clients' reports. Idempotent: the same bytes again
    change nothing; other bytes get 409."""
    new = await intake.take(server, request, auth, ReportUploads(server), round_id,
                            authenticate=auth_lib.edge, task=task)
    return schemas.ReportOut(round=round_id, accepted=True, replay=not new)


@router.get("/admin/rounds/{round_id}/edges", tags=["admin"])
def round_shares(round_id: routing.RoundId, auth: auth_lib.Bearer, server: State
                 ) -> list[schemas.ShareOut]:
    """The edges' shares of a round: seats, target, and what each forwarded."""
    auth_lib.admin(server, auth)
    return [schemas.ShareOut(**s.to_json()) for s in server.edges.shares(round_id)]
