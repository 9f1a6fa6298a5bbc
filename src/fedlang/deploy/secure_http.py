"""The endpoints of secure rounds: a client fetches its current SecAgg+ request and posts
its answer (see `secure_rounds` for the stages, and docs/deploy.md, "Secure rounds over
HTTP").

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
from typing import Annotated

import fastapi
import pydantic
from starlette import concurrency

from fedlang.deploy import protocol
from fedlang.deploy import server as server_lib

StagePath = Annotated[int, fastapi.Path(ge=1, le=4, description="The stage answered (1-4).")]


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


async def _answer(
    app: server_lib.App, request: fastapi.Request, round_id: int, client_id: str, stage: int
) -> bool:
    r = await concurrency.run_in_threadpool(app.store.round, round_id)
    try:
        limit = await concurrency.run_in_threadpool(app.secure.limit, r)
        data = await server_lib._read_limited(request, limit)
        return await concurrency.run_in_threadpool(
            app.secure.accept, round_id, client_id, stage, data
        )
    except protocol.ProtocolError as e:
        await concurrency.run_in_threadpool(app.store.count_refusal, e.reason, round_id)
        raise


def add_routes(router: fastapi.APIRouter, app: server_lib.App) -> None:
    """Adds the secure rounds' endpoints to the `/v1` router."""

    @router.get("/rounds/{round_id}/secagg", tags=["client"])
    def secagg_request(round_id: server_lib.RoundId, auth: server_lib.Bearer) -> SecAggStepOut:
        """This client's part of a secure round now: the current stage's request while it
        has yet to answer it, else when to ask again, or `finished`."""
        client_id, _ = app.client(auth)
        step = app.secure.request(round_id, client_id)
        if step["request"] is not None:
            step["request"] = base64.b64encode(step["request"]).decode()
        return SecAggStepOut(**step)

    @router.put("/rounds/{round_id}/secagg/{stage}", tags=["client"],
                openapi_extra=server_lib.BINARY_BODY)
    async def secagg_answer(
        round_id: server_lib.RoundId, stage: StagePath, request: fastapi.Request,
        auth: server_lib.Bearer,
    ) -> SecAggAnswerOut:
        """This client's answer to stage 1-4 of a secure round (a SecAgg+ frame; stage 3:
        the plain report and the masked input, `pack_masked_input`). Idempotent."""
        client_id, _ = await concurrency.run_in_threadpool(app.client, auth)
        new = await _answer(app, request, round_id, client_id, stage)
        return SecAggAnswerOut(round=round_id, stage=stage, accepted=True, replay=not new)
