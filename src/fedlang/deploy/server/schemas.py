"""The JSON bodies of the task store's protocol (pydantic models; they make the OpenAPI
schema). Binary bodies (blobs, reports, aggregates) are raw bytes, not JSON.

A model's class name is its name in the OpenAPI schema, part of the published contract:
`AsyncReportOut` keeps the name it was published with, though the mode is called
"buffered" everywhere else."""

from __future__ import annotations

from typing import Annotated, Any

import pydantic

from fedlang.deploy import protocol
from fedlang.deploy.store import bulk as bulk_lib

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
Hash = Annotated[str, pydantic.Field(pattern=protocol.BLOB_HASH, description="SHA-256, hex.")]


class ErrorOut(pydantic.BaseModel):
    detail: str = pydantic.Field(description="What was expected, what was found, and the fix.")
    reason: str = pydantic.Field(description="The kind of refusal, as counted in /v1/status.")


MaxEnrollments = Annotated[int | None, pydantic.Field(
    default=None, ge=1, le=10**9,
    description="How many clients the enrollment token may enroll (null: any number).",
)]


class PopulationIn(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(pattern=NAME, description="1-64 of A-Z a-z 0-9 _ . -")]
    max_enrollments: MaxEnrollments = None


class TokenIn(pydantic.BaseModel):
    max_enrollments: MaxEnrollments = None


class AuditEntry(pydantic.BaseModel):
    seq: int = pydantic.Field(description="Its place in the log, from 1.")
    at: float = pydantic.Field(description="When, in seconds since the epoch.")
    method: str
    path: str
    status: int = pydantic.Field(description="The answer's status.")
    remote: str = pydantic.Field(description="The caller's address and port.")


class DeviceTokensIn(pydantic.BaseModel):
    count: int = pydantic.Field(ge=1, le=1000, description="How many tokens to make.")


class DeviceTokensOut(pydantic.BaseModel):
    population: str
    tokens: list[str] = pydantic.Field(description="Single-use enrollment tokens, shown once.")


class RevokedOut(pydantic.BaseModel):
    client_id: str
    population: str


class PopulationOut(pydantic.BaseModel):
    name: str
    token: str = pydantic.Field(description="The enrollment token clients enroll with.")


class PopulationInfo(pydantic.BaseModel):
    name: str
    clients: int = pydantic.Field(description="Clients enrolled so far.")
    finished: bool
    created: float
    token_enrollments: int = pydantic.Field(
        default=0, description="Clients the current enrollment token has enrolled."
    )
    max_enrollments: int | None = pydantic.Field(
        default=None, description="How many it may enroll (null: any number)."
    )


class BlobOut(pydantic.BaseModel):
    hash: str = pydantic.Field(description="The blob's name: the SHA-256 of its bytes, in hex.")
    size: int


class RoundIn(pydantic.BaseModel):
    population: Annotated[str, pydantic.Field(pattern=NAME)]
    plan: Hash = pydantic.Field(description="The blob of the unsigned plan (RoundPlan.to_bytes).")
    broadcast: Hash = pydantic.Field(description="The blob of the broadcast value.")
    target: int = pydantic.Field(ge=1, le=10**7, description="Reports wanted; closes the round.")
    over_selection: float = pydantic.Field(
        default=0.0, ge=0, le=10, description="Extra clients assigned, as a fraction of the target."
    )
    quorum: int | None = pydantic.Field(
        default=None, ge=1, le=10**7, description="Fewest reports to close with at the deadline."
    )
    deadline: float = pydantic.Field(
        default=600.0, gt=0, le=30 * 86400, description="Seconds from now until the round closes or fails."
    )
    request_id: str | None = pydantic.Field(
        default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="Makes the request idempotent: a retry returns the same round.",
    )
    stage_timeout: float | None = pydantic.Field(
        default=None, gt=0, le=30 * 86400,
        description="A secure round's seconds for each of stages 2-4 (stage 1 may use the rest "
        "of the deadline); default: a quarter of the deadline.",
    )


class RoundOut(pydantic.BaseModel):
    id: int
    population: str
    kind: str = pydantic.Field(
        description="'aggregate': one report per client; 'secure': the stages of SecAgg+."
    )
    state: str = pydantic.Field(description="open, closed or failed.")
    plan: str | None = pydantic.Field(
        description="The blob of the signed plan clients download (null in the status "
        "without the admin token)."
    )
    broadcast: str | None = pydantic.Field(
        description="The blob of the broadcast value (null as `plan`)."
    )
    target: int
    capacity: int = pydantic.Field(description="Clients that may be assigned (over-selection).")
    quorum: int
    deadline: float = pydantic.Field(description="Seconds since the epoch.")
    created: float
    closed: float | None
    assigned: int
    reports: int
    late: int
    dropped: int = pydantic.Field(description="Assigned clients that had not reported at close.")
    refused: int
    failure: str
    stage: int = pydantic.Field(
        default=0,
        description="A secure round's stage: 1 advertise keys, 2 share keys, 3 masked input, "
        "4 unmasking, 5 done, 6 failed; 0 for an aggregate round.",
    )


class EnrollOut(pydantic.BaseModel):
    client_id: str
    credential: str = pydantic.Field(description="The client's bearer credential.")
    expires: float = pydantic.Field(description="When the credential expires (epoch seconds).")
    public_key: str = pydantic.Field(
        description="The server's Ed25519 public key (32 bytes, base64): pin it."
    )


class TaskOut(pydantic.BaseModel):
    round: int | None = pydantic.Field(default=None, description="A round's task: the round.")
    session: int | None = pydantic.Field(
        default=None, description="A buffered task: the session.")
    plan: str = pydantic.Field(description="Blob of the signed plan (verify with the pinned key).")
    broadcast: str = pydantic.Field(description="Blob of the broadcast value.")
    deadline: float
    seconds_left: float
    kind: str = pydantic.Field(
        default="aggregate",
        description="'aggregate': upload one report; 'secure': take part in the stages of "
        "GET /v1/rounds/{round}/secagg; 'buffered': train `version` of session `session` and "
        "upload with PUT /v1/sessions/{session}/reports/{version} (no deadline: 0).",
    )
    version: int | None = pydantic.Field(
        default=None, description="A buffered task's model version (the weights are `broadcast`)."
    )
    ticket: str = pydantic.Field(
        default="", description="The server's signature over the task (base64 signed envelope of "
        "protocol.ticket_payload: round, session, kind, plan, broadcast, version): verify it "
        "with the pinned key before downloading the plan or the broadcast."
    )


class CheckinOut(pydantic.BaseModel):
    task: TaskOut | None = None
    retry_after: float | None = pydantic.Field(
        default=None, description="Seconds to wait before checking in again (no task now)."
    )
    finished: bool = pydantic.Field(default=False, description="The population has no more work.")


class ReportOut(pydantic.BaseModel):
    round: int
    accepted: bool
    replay: bool = pydantic.Field(description="This report had been accepted before.")


class ReportCounts(pydantic.BaseModel):
    accepted: int
    refused: dict[str, int] = pydantic.Field(
        description="Refused uploads and client requests by reason (admin requests: "
        "`admin_refused`).")
    late: int


class SessionStatus(pydantic.BaseModel):
    id: int
    population: str
    state: str
    version: int = pydantic.Field(description="The current model version.")
    buffer_fill: int = pydantic.Field(description="Accepted reports waiting in the buffer (n).")
    buffer_size: int = pydantic.Field(description="K: reports per server step.")
    max_staleness: int
    accepted: int
    refused_stale: int
    staleness_histogram: dict[str, int] = pydantic.Field(
        description="Accepted reports by staleness (versions behind when accepted)."
    )


class ServerInfo(pydantic.BaseModel):
    version: str
    public_key: str


class StatusOut(pydantic.BaseModel):
    server: ServerInfo
    populations: list[PopulationInfo]
    rounds: list[RoundOut] = pydantic.Field(description="The latest rounds, newest first.")
    enrollments: int
    checkins: int
    assignments: int
    reports: ReportCounts
    dropouts: int
    rounds_closed: int
    rounds_failed: int
    admin_refused: dict[str, int] = pydantic.Field(
        default_factory=dict, description="Requests for admin routes refused, by reason "
        "(`unauthorized`: without the admin token); not counted in `reports`.")
    connections_refused: dict[str, int] = pydantic.Field(
        default_factory=dict, description="Connections closed and requests cut by a "
        "connection budget, by limit (`connections_per_address`, `unfinished_per_address`, "
        "`header_timeout`, `body_stall`, `body_rate`, `body_not_allowed`; within a second).")
    sessions: list[SessionStatus] = pydantic.Field(
        default_factory=list, description="The latest buffered (FedBuff) sessions, newest first."
    )


# -- secure rounds (routes in secure.py)


class SecAggStepOut(pydantic.BaseModel):
    round: int
    state: str = pydantic.Field(description="The round's state: open, closed or failed.")
    stage: int = pydantic.Field(
        description="The round's stage: 1 advertise keys, 2 share keys, 3 masked input, "
        "4 unmasking, 5 done, 6 failed."
    )
    request: str | None = pydantic.Field(
        default=None, description="The stage's request for this client (a SecAgg+ frame, base64)."
    )
    retry_after: float | None = pydantic.Field(
        default=None, description="Seconds to wait before asking again (answered; stage open)."
    )
    finished: bool = pydantic.Field(
        default=False, description="This client has nothing more to do in this round."
    )


class SecAggAnswerOut(pydantic.BaseModel):
    round: int
    stage: int
    accepted: bool
    replay: bool = pydantic.Field(description="This answer had been accepted before.")


# -- buffered sessions (routes in sessions.py)


class SessionIn(pydantic.BaseModel):
    population: Annotated[str, pydantic.Field(pattern=NAME)]
    plan: Hash = pydantic.Field(
        description="The blob of the unsigned plan (BufferedPlan.to_bytes)."
    )
    weights: Hash = pydantic.Field(description="The blob of the first version's weights.")
    version: int = pydantic.Field(default=0, ge=0, le=2**62, description="The first version.")
    buffer_size: int = pydantic.Field(ge=1, le=10**6, description="K: reports per server step.")
    max_staleness: int = pydantic.Field(
        ge=0, le=2**31, description="Reports staler than this many versions are refused."
    )
    request_id: str | None = pydantic.Field(
        default=None, pattern=r"^[A-Za-z0-9_.:-]{1,128}$",
        description="Makes the request idempotent: a retry returns the same session.",
    )


class SessionOut(pydantic.BaseModel):
    id: int
    population: str
    state: str = pydantic.Field(description="open or closed.")
    plan: str = pydantic.Field(description="The blob of the signed plan clients download.")
    version: int = pydantic.Field(description="The current model version.")
    weights: str = pydantic.Field(description="The blob of the current version's weights.")
    server_state: str = pydantic.Field(
        description="The blob of the driver's state at this version ('' before the first step)."
    )
    buffer_size: int
    max_staleness: int
    applied_through: int = pydantic.Field(
        description="The last report (sequence number) applied into a published version."
    )
    reports: int = pydantic.Field(description="Reports accepted (the last sequence number).")
    refused_stale: int
    created: float
    updated: float


class ReportItem(pydantic.BaseModel):
    seq: int
    client: str
    version: int = pydantic.Field(description="The version the client trained.")
    staleness: int = pydantic.Field(description="Versions published since, when it was accepted.")
    data: str = pydantic.Field(description="The report (the binary value format, base64).")


class VersionIn(pydantic.BaseModel):
    version: int = pydantic.Field(ge=1, le=2**62, description="The next version.")
    weights: Hash = pydantic.Field(description="The blob of its weights.")
    server_state: Hash = pydantic.Field(description="The blob of the driver's state.")
    through: int = pydantic.Field(
        ge=0, le=2**62, description="The last report sequence number this version applied."
    )


class AsyncReportOut(pydantic.BaseModel):
    session: int
    version: int
    accepted: bool
    replay: bool = pydantic.Field(description="This report had been accepted before.")


# -- edge aggregators (at the root)


class EdgeIn(pydantic.BaseModel):
    name: Annotated[str, pydantic.Field(pattern=NAME, description="1-64 of A-Z a-z 0-9 _ . -")]
    population: Annotated[str, pydantic.Field(pattern=NAME)]


class EdgeOut(pydantic.BaseModel):
    name: str
    population: str
    token: str = pydantic.Field(description="The edge's token (shown only here).")
    public_key: str = pydantic.Field(description="The root's plan-signing key (base64).")


class EdgeInfo(pydantic.BaseModel):
    name: str
    population: str
    created: float
    revoked: float | None


class ShareOut(pydantic.BaseModel):
    """An edge's seats in a round, and what it forwarded."""

    round: int
    edge: str
    state: str = pydantic.Field(description="assigned, reported (its partial taken) or dropped.")
    target: int = pydantic.Field(description="Reports it gathers: the round's, in proportion.")
    capacity: int = pydantic.Field(description="Its seats.")
    digest: str | None
    reports: int
    dropped: int


class EdgeTaskOut(pydantic.BaseModel):
    """An open task of the edge's population as the edge sees it: a round it may hold
    seats in (its `share`, once it joined), or a buffered session (its current version).
    The fields of the other kind are null."""

    kind: str = pydantic.Field(description="'aggregate', 'secure' (run by edges) or 'buffered'.")
    id: int = pydantic.Field(description="The round's or the session's id.")
    state: str
    plan: str = pydantic.Field(description="The root-signed plan's blob.")
    broadcast: str = pydantic.Field(
        description="A round's broadcast blob; a session's current weights blob.")
    seconds_left: float | None = None
    target: int | None = None
    capacity: int | None = None
    quorum: int | None = None
    share: ShareOut | None = None
    version: int | None = pydantic.Field(default=None, description="A session's current version.")
    buffer_size: int | None = None
    max_staleness: int | None = None
    pending: int | None = pydantic.Field(
        default=None, description="A session's reports in the buffer, not applied yet.")


class EdgeTasksOut(pydantic.BaseModel):
    population: str
    finished: bool
    public_key: str = pydantic.Field(description="The root's plan-signing key (base64).")
    tasks: list[EdgeTaskOut]


class BatchInfo(pydantic.BaseModel):
    session: int
    edge: str
    batch: int
    digest: str
    reports: int
    stale: int


class BatchOut(pydantic.BaseModel):
    session: int
    batch: int
    accepted: int = pydantic.Field(description="Reports of the batch stored for the driver.")
    stale: int = pydantic.Field(description="Reports refused as staler than max_staleness.")
    replay: bool = pydantic.Field(description="This batch had been accepted before.")


# -- the operator: released metrics, the overview; bulk enrollment


class MetricsIn(pydantic.BaseModel):
    round: Annotated[int, pydantic.Field(ge=0, le=2**62, description="The round (or a buffered session's version).")]
    metrics: Annotated[dict[str, Any], pydantic.Field(
        description="{kind: {name: number}} (kinds: train, eval, or any); deeper mappings "
        "are flattened into 'a/b' names. Finite numbers only.")]


class MetricsStored(pydantic.BaseModel):
    stored: int


class ReleasedMetric(pydantic.BaseModel):
    round: int
    kind: str
    name: str
    value: float
    released: float  # when (epoch seconds); pass the latest as `since` to get only newer


class ReleasedMetrics(pydantic.BaseModel):
    population: str
    metrics: list[ReleasedMetric]


class OverviewPopulation(pydantic.BaseModel):
    name: str
    enrolled: int
    seen_last_hour: int  # enrolled clients that checked in during the last hour
    finished: bool
    created: float


class OverviewRound(pydantic.BaseModel):
    id: int
    population: str
    kind: str
    state: str
    stage: int  # a secure round's SecAgg+ stage; 0 for plain rounds
    reports: int
    target: int
    quorum: int
    assigned: int
    dropouts: int
    late: int
    refused: int
    refused_by_reason: dict[str, int]
    created: float
    closed: float | None
    duration: float  # seconds from creation to its end, or to now while open
    failure: str


class OverviewSession(pydantic.BaseModel):
    id: int
    population: str
    state: str
    version: int
    buffer_fill: int
    buffer_size: int
    max_staleness: int
    accepted: int
    refused_stale: int
    refused_by_reason: dict[str, int]
    staleness_histogram: dict[str, int]
    created: float
    updated: float
    duration: float


class Rates(pydantic.BaseModel):
    checkins: list[list[float]]  # [[minute start (epoch seconds), check-ins in it], ...]
    reports: list[list[float]]  # [[minute start, reports accepted in it], ...]


class Overview(pydantic.BaseModel):
    now: float
    populations: list[OverviewPopulation]
    rounds: list[OverviewRound]
    sessions: list[OverviewSession]
    totals: dict[str, Any]  # the counters of GET /v1/status (check-ins, reports, ...)
    rates: Rates


class BulkIn(pydantic.BaseModel):
    count: Annotated[int, pydantic.Field(
        ge=1, le=bulk_lib.MAX_BULK, description="How many clients to enroll in this call.")]
