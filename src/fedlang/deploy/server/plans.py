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
from fedlang.deploy.plans import round as plan_lib
from fedlang.deploy.server import state as state_lib

# What a plan blob must be, by the kind of task it opens: how to read it, and its name.
_PLANS: dict[str, tuple[Callable[[bytes], Any], str]] = {
    protocol.TaskKind.AGGREGATE: (plan_lib.RoundPlan.from_bytes,
                                  "a round plan (RoundPlan.to_bytes())"),
    protocol.TaskKind.BUFFERED: (buffered_plan.BufferedPlan.from_bytes,
                                 "a buffered plan (BufferedPlan.to_bytes())"),
}


def read_plan(
    server: state_lib.ServerState, kind: protocol.TaskKind, plan: str, value: str, what: str
) -> tuple[Any, bytes]:
    """(the plan, its bytes) for a new task of `kind` (a round's plans are of kind
    `aggregate`, secure or not): the plan in blob `plan`, once the value in blob `value`
    (`what`: "broadcast value", "model weights") is of its broadcast type.

    Raises:
      NotFound: a blob that is not stored.
      BadRequest: a blob that is not a plan of this kind, or a value of another type.
    """
    read, name = _PLANS[kind]
    data = server.store.get_blob(plan)
    try:
        parsed = read(data)
    except serialization.SerializationError as e:
        raise protocol.BadRequest(f"Expected blob {plan} to be {name}: {e}") from e
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
        serialization.deserialize_value(
            server.store.get_blob(h), expected_type=plan.broadcast_type
        )
    except serialization.SerializationError as e:
        raise protocol.BadRequest(f"Expected blob {h} to be the plan's {what}: {e}") from e
