"""The routes of secure rounds: a client fetches its current SecAgg+ request and posts
its answer, through the intake (`AnswerUploads`; see `store.secure` for the stages, and
docs/deploy.md, "Secure rounds over HTTP").

* `GET /v1/rounds/{round}/secagg`: `{round, state, stage, request, retry_after,
  finished}`; `request` is the current stage's request (base64 of a SecAgg+ frame) while
  the client has yet to answer it; otherwise `retry_after` says when to ask again, or
  `finished` that the client has nothing more to do in the round.
* `PUT /v1/rounds/{round}/secagg/{stage}`: the client's answer to stage 1-4 (the SecAgg+
  frame; for stage 3, `protocol.pack_masked_input` of the plain report and the masked
  input). Idempotent: the same bytes again change nothing.
"""

from __future__ import annotations

import base64
from typing import Annotated, Any

import fastapi

from fedlang.deploy import protocol, secagg
from fedlang.deploy.server import auth as auth_lib
from fedlang.deploy.server import intake, rounds, routing, schemas
from fedlang.deploy.server.routing import State
from fedlang.deploy.store import rounds as rounds_lib

StagePath = Annotated[int, fastapi.Path(ge=1, le=4, description="The stage answered (1-4).")]
router = fastapi.APIRouter(prefix=protocol.API)


class AnswerUploads(rounds.RoundUploads):
    """A secure round's answers, as the intake takes them: one per participant and
    stage; stage 3's carries the plain report, checked by the round's folder and folded
    with the masked input, or neither."""

    def limit(self, target: rounds_lib.Round, upload: intake.Upload) -> int:
        folder = self.server.verified.folder(target.plan)
        capacity = target.capacity
        elements = sum(length for length, _ in folder.plan.secure_segments(max(capacity, 1)))
        return folder.max_report_bytes + 8 * elements + 512 * capacity + (1 << 20)

    def precheck(self, target: rounds_lib.Round, upload: intake.Upload) -> bool:
        return self.server.secure.precheck(target.id, upload.client, upload.slot, upload.digest)

    def check(self, target: rounds_lib.Round, upload: intake.Upload) -> Any:
        """(the SecAgg+ message, the checked plain report or None)."""
        if upload.slot != secagg.Stage.MASKED_INPUT:
            return upload.body, None
        report, message = protocol.unpack_masked_input(upload.body)
        return message, self.server.verified.folder(target.plan).check(report)

    def bounded(self, target: rounds_lib.Round, upload: intake.Upload) -> Any:
        """Stage 3's plain report's bounds (the masked input is bounded by its modulus)."""
        _, report = upload.checked
        if report is None:
            return None
        folder = self.server.verified.folder(target.plan)
        return folder.bounds, folder.leaves(report)

    def accept(self, target: rounds_lib.Round, upload: intake.Upload) -> bool:
        message, report = upload.checked
        return self.server.secure.accept(
            target.id, upload.client, upload.slot, upload.digest, upload.size, message,
            report,
        )



@router.get("/rounds/{round_id}/secagg", tags=["client"])
def secagg_request(
    round_id: routing.RoundId, auth: auth_lib.Bearer, server: State
) -> schemas.SecAggStepOut:
    """This client's part of a secure round now: the current stage's request while it
    has yet to answer it, else when to ask again, or `finished`."""
    client_id, _ = auth_lib.client(server, auth)
    step = server.secure.request(round_id, client_id)
    if step["request"] is not None:
        step["request"] = base64.b64encode(step["request"]).decode()
    return schemas.SecAggStepOut(**step)


@router.put("/rounds/{round_id}/secagg/{stage}", tags=["client"],
            openapi_extra=routing.BINARY_BODY)
async def secagg_answer(
    round_id: routing.RoundId, stage: StagePath, request: fastapi.Request,
    auth: auth_lib.Bearer, server: State, task: intake.TaskHeader = None,
) -> schemas.SecAggAnswerOut:
    """This client's answer to stage 1-4 of a secure round (a SecAgg+ frame; stage 3:
    the plain report and the masked input, `pack_masked_input`). Idempotent."""
    new = await intake.take(server, request, auth, AnswerUploads(server), round_id, stage,
                            task=task)
    return schemas.SecAggAnswerOut(round=round_id, stage=stage, accepted=True, replay=not new)
