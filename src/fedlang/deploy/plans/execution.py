"""What a client does with a task: run it on its own data and build its report.

The task is the round plan's federated computation over one client; it runs on the
simulation runtime, the same local execution as in simulations (so a client whose data
exceed memory streams it). The client then folds what it feeds each aggregation into
that aggregation's accumulator and reports the partials, so the server only ever merges
pre-aggregated values. A partial travels in its values' dtype (`Accumulator.report`: a
float32 model's update as float32, exactly what the accumulator widened); the server
widens it as it merges.

A task with client state (`plan.state`) also takes the client's state (its stored one,
or the plan's initial state for a client seen for the first time) and, when it writes
the state, gives the new one back in `ClientReport.state`, never in the report: the
caller keeps it (and decides when to commit it, see `fedlang.deploy.client.state`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fedlang.core import serialization, signing, structure
from fedlang.deploy.plans import round as plan_lib
from fedlang.runtime import chunks, simulation


def load_plan(signed_plan: bytes, public_key: Any) -> plan_lib.RoundPlan:
    """The plan in `signed_plan`, once its signature verifies against the pinned key.

    Raises:
      SignatureError: if the plan was not signed by `public_key`'s owner.
      SerializationError: if it is not a valid plan.
    """
    return plan_lib.RoundPlan.from_bytes(signing.verify(signed_plan, public_key))


@dataclasses.dataclass(frozen=True)
class ClientReport:
    """What one client sends for a round.

    Attributes:
      report: the serialized plain report (partials of the aggregations that are not
        secure).
      secure: the client's inputs to the secure aggregations, one flat array of integers
        per secure tensor, already reduced into the protocol's group (`secure_segments`
        order); empty when the round has no secure aggregation. They are only ever sent
        masked (`fedlang.deploy.secagg`).
      state: the client's new state (a Python value of `plan.state.state_type`) when
        the task writes client state, else None. It stays on the client.
    """

    report: bytes
    secure: list[np.ndarray]
    state: Any = None


def run_plan_parts(
    plan: plan_lib.RoundPlan,
    broadcast: bytes,
    data: Mapping[str, Any],
    context: simulation.SimulationContext | None = None,
    state: Any = None,
) -> ClientReport:
    """This client's contribution to a round (see `ClientReport`).

    Args:
      plan: the round's plan (verified).
      broadcast: the serialized broadcast value of the round.
      data: the client's own datasets by name (each an iterable of batches of the type
        the task expects, e.g. a `fedlang.simulation.Dataset`).
      context: the runtime to run the task on (default: a simulation context).
      state: for a plan with client state, this client's stored state (a Python value
        of `plan.state.state_type`), or None for a client without one: it starts from
        the plan's initial state. Ignored for plans without client state.

    Raises:
      KeyError: if the task reads a dataset the client does not have.
      SerializationError: if the broadcast value is not of the plan's type.
    """
    missing = [n for n in plan.data_names if n not in data]
    if missing:
        raise KeyError(
            f"The task reads client data {missing}, but this client has {sorted(data)}. Start "
            f"the client with --data {missing[0]}=PATH."
        )
    # the model as views of the broadcast's bytes (the client keeps those): not held twice
    value = serialization.deserialize_value(broadcast, expected_type=plan.broadcast_type,
                                            copy=False)
    own = {name: data[name] for name in plan.data_names}
    ctx = context or simulation.SimulationContext(chunk_size=1)
    new_state = None
    with ctx:
        if plan.state is None:
            (inputs,) = ctx.invoke(plan.task, ([own], value))
        else:
            if state is None:
                state = ctx.invoke(plan.state.initialize, None)
            (inputs,) = ctx.invoke(plan.task, ([own], value, [state]))
    outputs = structure.to_internal(inputs, _inputs_type(plan))
    if plan.state is not None and plan.state.writes:
        new_state = structure.to_python(outputs[-1], plan.state.state_type)
        outputs = outputs[:-1]
    partials, secure = [], []
    for agg, x in zip(plan.aggregations, outputs):
        acc = agg.make()
        if agg.is_secure:
            # Wrapped into the input group as the intrinsic defines; only masked from here.
            wraps = acc.wrap  # type: ignore[attr-defined]
            for leaf, wrap in zip(structure.flatten(x, agg.client_type), wraps):
                flat = np.mod(np.asarray(leaf).astype(object).reshape(-1), wrap)
                secure.append(flat.astype(np.uint64))
            continue
        acc.add(chunks.stack([x], agg.client_type), 1)
        partials.append(acc.report())  # in the values' dtype: exact for one client
    report_t = plan.report_type
    report = serialization.serialize_value(structure.to_python(tuple(partials), report_t), report_t)
    return ClientReport(report, secure, new_state)


def run_plan(
    plan: plan_lib.RoundPlan,
    broadcast: bytes,
    data: Mapping[str, Any],
    context: simulation.SimulationContext | None = None,
) -> bytes:
    """This client's plain report for a round without secure aggregations.

    Raises:
      ValueError: if the plan has secure aggregations (use `run_plan_parts` and the
        SecAgg+ protocol).
    """
    if plan.secure:
        raise ValueError(
            "This round has secure aggregations: its inputs must go through SecAgg+ "
            "(run_plan_parts gives them), never in a plain report."
        )
    if plan.state is not None:
        raise ValueError(
            "This round's task keeps client state: use run_plan_parts, which takes the "
            "client's state and gives its new one (to keep on the client)."
        )
    return run_plan_parts(plan, broadcast, data, context).report


def _inputs_type(plan: plan_lib.RoundPlan) -> Any:
    return plan.task.type_signature.result.member  # type: ignore[attr-defined]


def run_task(
    signed_plan: bytes,
    broadcast: bytes,
    data: Mapping[str, Any],
    public_key: Any,
    context: simulation.SimulationContext | None = None,
) -> bytes:
    """`run_plan` for a signed plan: verifies it against the server's pinned key first."""
    return run_plan(load_plan(signed_plan, public_key), broadcast, data, context)
