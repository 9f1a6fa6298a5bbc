"""Opening a task: the admin's unsigned plan is read and checked with the value it starts
from (`read_plan`), then signed (`sign`), for every kind of task; and what an update of
that value must be (`check_value`).

A plan blob that is not a plan of the kind asked for, or a broadcast (a model version's
weights) that is not of the plan's type, is refused (400) before anything is stored;
the signed plan is stored as a blob of its own, which clients verify against the
server's public key.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from fedlang.core import serialization, signing
from fedlang.deploy import protocol
from fedlang.deploy.plans import buffered as buffered_plan
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import state as state_lib
from fedlang.deploy.store import values

# What a plan blob must be, by the kind of task it opens: how to read it, its name, and
# the largest report it lets a client upload.
_PLANS: dict[str, tuple[Callable[[bytes], Any], str, Callable[[Any], int]]] = {
    protocol.TaskKind.AGGREGATE: (plan_lib.RoundPlan.from_bytes,
                                  "a round plan (RoundPlan.to_bytes())",
                                  lambda p: folding.Folder(p).max_report_bytes),
    protocol.TaskKind.BUFFERED: (buffered_plan.BufferedPlan.from_bytes,
                                 "a buffered plan (BufferedPlan.to_bytes())",
                                 lambda p: p.max_report_bytes),
}


def read_plan(
    server: state_lib.ServerState, kind: protocol.TaskKind, plan: str, value: str, what: str
) -> tuple[Any, bytes]:
    """(the plan, its bytes) for a new task of `kind` (a round's plans are of kind
    `aggregate`, secure or not): the plan in blob `plan`, once the value in blob `value`
    (`what`: "broadcast value", "model weights") is of its broadcast type.

    Raises:
      NotFound: a blob that is not stored.
      BadRequest: a blob that is not a plan of this kind, a value of another type, or a
        plan whose clients' reports could exceed the server's limit on every upload
        (`too_large`: refused now, not after its clients trained).
    """
    read, name, max_report = _PLANS[kind]
    data = server.store.get_blob(plan)
    try:
        parsed = read(data)
    except serialization.SerializationError as e:
        raise protocol.BadRequest(f"Expected blob {plan} to be {name}: {e}") from e
    if (most := max_report(parsed)) > server.max_report_bytes:
        raise protocol.BadRequest(
            f"Expected a plan whose reports fit the server's limit of {server.max_report_bytes} "
            f"bytes per upload, found one whose reports may hold {most} bytes; start the "
            f"server with a larger fedlang serve --max-report-bytes.", reason="too_large")
    check_value(server, parsed, value, what)
    return parsed, data


def sign(server: state_lib.ServerState, plan: bytes) -> str:
    """Signs a checked plan's bytes with the server's key; returns the signed blob's hash."""
    return server.store.put_blob(signing.sign(plan, server.key))


def check_value(server: state_lib.ServerState, plan: Any, h: str, what: str) -> None:
    """Checks that blob `h` holds a value of `plan.broadcast_type` (`what` names it).

    Raises:
      NotFound: no such blob.
      BadRequest: a value of another type.
    """
    try:
        layout = serialization.dense_layout(plan.broadcast_type)
    except TypeError:
        layout = None
    try:
        if layout is None:
            serialization.deserialize_value(  # read, not kept: no copy of its tensors
                server.store.get_blob(h), expected_type=plan.broadcast_type, copy=False
            )
        else:  # a model's weights: checked a chunk at a time, never held
            scan = serialization.LayoutScan(layout)
            for chunk in values.chunks(server.store, server.store.open_blob(h)):
                scan.feed(chunk)
            scan.finish()
    except serialization.SerializationError as e:
        raise protocol.BadRequest(f"Expected blob {h} to be the plan's {what}: {e}") from e
