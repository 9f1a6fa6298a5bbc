"""Runs a whole SecAgg+ round in one process: a server, its clients, and the bytes between.

It is how tests and the benchmark exercise the protocol; a deployment runs the same
`SecAggServer` and `SecAggClient` on different machines and moves the same bytes over
HTTP. Hooks drop clients before any stage, see (or alter) every message a client sends,
and replace the server between stages (e.g. by a copy saved and restored from bytes).

Example:
  >>> import numpy as np
  >>> inputs = {c: [np.array([i, 1])] for i, c in enumerate(["a", "b", "c"])}
  >>> report = run_round(inputs, [config.Segment(2, 16)])
  >>> report.sum[0].tolist(), report.survivors
  ([3, 3], ('a', 'b', 'c'))
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Collection, Mapping, Sequence

import numpy as np

from fedlang.deploy.secagg import client as client_lib
from fedlang.deploy.secagg import config, server

Stage = config.Stage
Inputs = Mapping[str, Sequence[object]] | Callable[[str], Sequence[object]]


@dataclasses.dataclass
class RoundReport:
    """What a round gave, and what it cost.

    Attributes:
      sum: the survivors' sum, one uint64 array per segment.
      survivors: the clients whose inputs are in the sum.
      rejected: client -> why it left the round early (a rejected message, or a request
        the client refused); dropped clients (the `drop` hook) are not listed.
      client_seconds: client -> CPU seconds spent in its protocol calls.
      client_bytes: client -> bytes it sent.
      server_seconds: CPU seconds spent in server calls.
      degree, threshold: the neighbour degree and threshold the round used.
    """

    sum: list[np.ndarray]
    survivors: tuple[str, ...]
    rejected: dict[str, str]
    client_seconds: dict[str, float]
    client_bytes: dict[str, int]
    server_seconds: float
    degree: int
    threshold: int


def run_round(
    inputs: Inputs,
    segments: Sequence[config.Segment | tuple[int, int]],
    *,
    client_ids: Sequence[str] | None = None,
    threshold: int | None = None,
    degree: int | None = None,
    round_id: bytes | None = None,
    drop: Mapping[Stage, Collection[str]] | None = None,
    on_send: Callable[[Stage, str, bytes], bytes] | None = None,
    between_stages: Callable[[server.SecAggServer], server.SecAggServer] | None = None,
) -> RoundReport:
    """Runs one round for a cohort, in process.

    Args:
      inputs: client id -> one integer array per segment; or a function of the client id
        (called when the client needs its input, so a large cohort's inputs need not all be
        in memory at once; then pass `client_ids`).
      segments: `Segment`s (or `(length, modulus)` pairs).
      client_ids: the cohort (default: the keys of `inputs`).
      threshold, degree, round_id: as for `SecAggServer`.
      drop: stage -> clients that vanish just before sending their message of that stage
        (`SHARE_KEYS`: after advertising keys; `MASKED_INPUT`: after sharing keys;
        `UNMASKING`: after sending the masked input).
      on_send: sees each client message `(stage, client id, bytes)` and returns the bytes
        the server receives (to record, corrupt or replace them).
      between_stages: called with the server after each stage closes; returns the server
        to go on with.

    Returns:
      A `RoundReport`.

    Raises:
      SecAggError: the round failed (too few survivors, inconsistent shares).
    """
    ids = list(client_ids) if client_ids is not None else list(_as_mapping(inputs))
    get = inputs if callable(inputs) else inputs.__getitem__
    srv = server.SecAggServer(segments, threshold=threshold, degree=degree, round_id=round_id)
    drop = drop or {}
    rejected: dict[str, str] = {}
    seconds = dict.fromkeys(ids, 0.0)
    sent = dict.fromkeys(ids, 0)
    server_seconds = 0.0
    clients: dict[str, client_lib.SecAggClient] = {}

    def serve(fn: Callable[[], object]) -> object:
        nonlocal server_seconds
        t = time.process_time()
        try:
            return fn()
        finally:
            server_seconds += time.process_time() - t

    def step(stage: Stage, cid: str, answer: Callable[[bytes], bytes]) -> None:
        request = serve(lambda: srv.request_for(cid))
        assert isinstance(request, bytes)
        t = time.process_time()
        try:
            message = answer(request)
        except config.SecAggError as e:
            rejected[cid] = f"{stage.name}: client refused: {e}"
            return
        finally:
            seconds[cid] += time.process_time() - t
        if on_send is not None:
            message = on_send(stage, cid, message)
        sent[cid] += len(message)
        try:
            serve(lambda: srv.receive(cid, message))
        except config.SecAggError as e:
            rejected[cid] = f"{stage.name}: server rejected: {e}"

    def make_client(cid: str) -> Callable[[bytes], bytes]:
        def answer(request: bytes) -> bytes:
            clients[cid] = client_lib.SecAggClient(cid, request)
            return clients[cid].advertise_keys()

        return answer

    def masked_input(cid: str) -> Callable[[bytes], bytes]:
        values = get(cid)  # fetched outside the timed call: it is the client's data, not cost

        def answer(request: bytes) -> bytes:
            return clients[cid].masked_input(request, values)

        return answer

    answers: dict[Stage, Callable[[str], Callable[[bytes], bytes]]] = {
        Stage.ADVERTISE_KEYS: make_client,
        Stage.SHARE_KEYS: lambda cid: clients[cid].share_keys,
        Stage.MASKED_INPUT: masked_input,
        Stage.UNMASKING: lambda cid: clients[cid].unmask,
    }
    for stage in (Stage.ADVERTISE_KEYS, Stage.SHARE_KEYS, Stage.MASKED_INPUT, Stage.UNMASKING):
        active = ids if stage == Stage.ADVERTISE_KEYS else srv.participants()
        gone = set(drop.get(stage, ())) | set(rejected)
        for cid in active:
            if cid not in gone:
                step(stage, cid, answers[stage](cid))
        serve(srv.advance)
        if between_stages is not None:
            srv = between_stages(srv)
    return RoundReport(
        sum=srv.result(),
        survivors=srv.participants(),
        rejected=rejected,
        client_seconds=seconds,
        client_bytes=sent,
        server_seconds=server_seconds,
        degree=srv.degree,
        threshold=srv.threshold,
    )


def _as_mapping(inputs: Inputs) -> Mapping[str, Sequence[object]]:
    if callable(inputs):
        raise TypeError("Expected client_ids when inputs is a function, found none.")
    return inputs
