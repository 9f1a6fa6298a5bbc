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

A large model passes through a client at most three times over: the model, the update,
and the report being written. A client reads the broadcast as it downloads it
(`BroadcastScan`: each tensor in a buffer of its own, aligned so that XLA:CPU computes
on it in place instead of copying it), and writes the report of a round whose large
aggregations are sums (`federated_sum`, `_mean`, `_weighted_mean`: each element of the
report depends on that element of the update only) a slice at a time: each slice of
each tensor fed to an accumulator of its own, its report written into the report's
bytes, so no model-sized total (widened to float64), check or serialization is ever
held. The bytes are those of the whole accumulator's report, serialized.
"""

from __future__ import annotations

import dataclasses
import gc
import math
import sys
from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from fedlang.core import intrinsic_defs, serialization, signing, structure, types
from fedlang.deploy.plans import round as plan_lib
from fedlang.runtime import accumulate, chunks, simulation

# Aggregations whose report is, element by element, a function of that element of one
# client's value (and its weight): reported a slice at a time.
_ELEMENTWISE = frozenset(d.uri for d in (
    intrinsic_defs.FEDERATED_SUM, intrinsic_defs.FEDERATED_MEAN,
    intrinsic_defs.FEDERATED_WEIGHTED_MEAN))
SLICE = 1 << 18  # elements of a tensor reported at a time (1 MiB of float32)
SMALL = 1 << 20  # bytes of an aggregation's report below which it is made whole


def load_plan(signed_plan: bytes, public_key: Any) -> plan_lib.RoundPlan:
    """The plan in `signed_plan`, once its signature verifies against the pinned key.

    Raises:
      SignatureError: if the plan was not signed by `public_key`'s owner.
      SerializationError: if it is not a valid plan.
    """
    return plan_lib.RoundPlan.from_bytes(signing.verify(signed_plan, public_key))


class BroadcastScan(serialization.LayoutScan):
    """A round's broadcast read as its bytes arrive (`feed`; `value()` once they all
    have): each tensor into a 64-byte aligned buffer of its own, which XLA:CPU reads in
    place (a view of the downloaded bytes it would copy), so the model is held once.
    The frame is checked as `serialization.LayoutScan` checks it.

    Raises (`feed`, `value`):
      SerializationError: the bytes are not a value of the plan's broadcast type.
    """

    def __init__(self, layout: serialization.DenseLayout):
        super().__init__(layout)
        self._buffers: list[np.ndarray] = []
        self._at = 0

    def blob_start(self, index: int, length: int) -> None:
        super().blob_start(index, length)
        self._buffers.append(chunks.aligned_empty((length,), np.uint8))
        self._at = 0

    def blob_data(self, index: int, data: memoryview) -> None:
        self._buffers[index][self._at:self._at + len(data)] = data
        self._at += len(data)

    def value(self) -> Any:
        """The broadcast value, as `deserialize_value` gives it."""
        self.finish()
        leaves = []
        for raw, lt, shape in zip(self._buffers, self.layout.leaves, self.layout.shapes):
            dtype = np.dtype(lt.dtype)
            x = (raw != 0) if dtype == np.bool_ else raw.view(dtype)
            leaves.append((x.byteswap() if sys.byteorder == "big" else x).reshape(shape))
        t = self.layout.type
        return structure.to_python(structure.unflatten(leaves, t), t)


def broadcast_layout(plan: plan_lib.RoundPlan) -> serialization.DenseLayout | None:
    """The layout of `plan`'s broadcast, which `BroadcastScan` reads; None when its type
    has a leaf of no fixed size (its bytes are read whole, by `run_plan_parts`)."""
    try:
        return serialization.dense_layout(plan.broadcast_type)
    except TypeError:
        return None


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

    report: bytes  # (a bytearray when written a slice at a time: not copied again)
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
      broadcast: the serialized broadcast value of the round, or a `BroadcastScan` of
        the plan fed its bytes.
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
    size = broadcast.layout.size if isinstance(broadcast, BroadcastScan) else len(broadcast)
    if isinstance(broadcast, BroadcastScan):
        value = broadcast.value()
    else:  # the model as views of the broadcast's bytes (the caller's): not held twice
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
    # The lazy evaluation leaves the task's intermediate values (the trained weights, a
    # model-sized each) in reference cycles: for a large model freed now, not at a later
    # collection, after the report or in the next round (a collection costs ~50 ms with
    # JAX loaded: not for a small model's task).
    del value
    if size > SMALL:
        gc.collect()
    outputs = structure.to_internal(inputs, _inputs_type(plan))
    if plan.state is not None and plan.state.writes:
        new_state = structure.to_python(outputs[-1], plan.state.state_type)
        outputs = outputs[:-1]
    plain, secure = [], []
    for agg, x in zip(plan.aggregations, outputs):
        if agg.is_secure:
            acc = agg.make()
            # Wrapped into the input group as the intrinsic defines; only masked from here.
            wraps = acc.wrap  # type: ignore[attr-defined]
            for leaf, wrap in zip(structure.flatten(x, agg.client_type), wraps):
                flat = np.mod(np.asarray(leaf).astype(object).reshape(-1), wrap)
                secure.append(flat.astype(np.uint64))
            continue
        plain.append((agg, x))
    del inputs, outputs  # the update is held by `plain` alone, and let go as it is reported
    return ClientReport(_report(plan, plain), secure, new_state)


def _report(plan: plan_lib.RoundPlan, plain: list[tuple[plan_lib.AggregationPlan, Any]]) -> bytes:
    """The serialized report: the partial of one client's value for each aggregation
    that is not secure (`Accumulator.report`: in the values' dtype, exact for one
    client), a slice at a time where it can be (see the module docstring)."""
    report_t = plan.report_type
    try:
        layout = serialization.dense_layout(report_t)
    except TypeError:
        layout = None
    if layout is None or not any(_sliced(agg, t) for (agg, _), t in zip(plain, report_t.types)):
        partials = [_whole(agg, x) for agg, x in plain]
        return serialization.serialize_value(structure.to_python(tuple(partials), report_t),
                                             report_t)
    pieces: list[Any] = []  # per tensor of the report, its bytes in pieces (made as read)
    for (agg, x), t in zip(plain, report_t.types):
        if _sliced(agg, t):
            pieces += _sliced_pieces(agg, x)
        else:
            pieces += [[serialization.tensor_bytes(leaf, lt.dtype)] for leaf, lt in zip(
                structure.flatten(_whole(agg, x), t), structure.leaf_types(t))]
    plain.clear()  # each update is held by its pieces alone from here
    out = bytearray(layout.size)
    at = 0
    for part in layout.parts(pieces):
        view = memoryview(part).cast("B")
        out[at:at + len(view)] = view
        at += len(view)
    return out  # type: ignore[return-value]  # bytes-like, the report's only copy


def _whole(agg: plan_lib.AggregationPlan, x: Any) -> Any:
    acc = agg.make()
    acc.add(chunks.stack([x], agg.client_type), 1)
    return acc.report()  # in the values' dtype: exact for one client


def _sliced(agg: plan_lib.AggregationPlan, report_t: types.Type) -> bool:
    """Whether `agg`'s report is made a slice at a time: an elementwise aggregation of
    a large value."""
    return agg.uri in _ELEMENTWISE and sum(
        np.dtype(lt.dtype).itemsize * math.prod(d or 0 for d in lt.shape)
        for lt in structure.leaf_types(report_t)) > SMALL


def _sliced_pieces(agg: plan_lib.AggregationPlan, x: Any) -> list[Any]:
    """The bytes of `agg`'s report of one client's value `x`, per tensor, made a slice
    at a time: each slice of each of the value's tensors fed to an accumulator of the
    same aggregation over that slice; their reports' totals are the slices of the
    report's, the rest (a mean's count, a weighted mean's weight) is every slice's."""
    accumulation = agg.accumulation
    zipped = accumulation.clients == accumulate.ZIPPED
    values, rest = (x[0], tuple(x[1:])) if zipped else (x, ())
    member_t = (agg.client_type.types[0] if zipped  # type: ignore[attr-defined]
                else agg.client_type)
    extras: list[Any] = []

    def leaf_pieces(leaf: Any, lt: types.TensorType) -> Iterator[Any]:
        flat = np.asarray(leaf).reshape(-1)
        for start in range(0, flat.size, SLICE):
            part = flat[start:start + SLICE]
            member = types.FederatedType(types.TensorType(lt.dtype, [part.size]), types.CLIENTS)
            param = (types.StructType([member, *agg.parameter_type.types[1:]])  # type: ignore[attr-defined]
                     if zipped else member)
            acc = accumulation.make(agg.definition, param, (), _no_call)
            acc.add(chunks.stack([(part, *rest) if zipped else part],
                                 accumulation.client_type(param)), 1)
            total, *more = structure.flatten(acc.report(), acc.report_type)
            extras[:] = more  # the same for every slice
            yield serialization.tensor_bytes(total, lt.dtype)

    leaves = structure.flatten(values, member_t)
    pieces: list[Any] = [leaf_pieces(leaf, lt)
                         for leaf, lt in zip(leaves, structure.leaf_types(member_t))]
    report_leaves = structure.leaf_types(agg.make().report_type)
    for k, lt in enumerate(report_leaves[len(pieces):]):
        pieces.append(_extra_piece(extras, k, lt))
    return pieces


def _no_call(fn: Any, arg: Any) -> Any:
    raise TypeError(f"Expected an elementwise aggregation to call no function, found {fn}.")


def _extra_piece(extras: list[Any], k: int, lt: types.TensorType) -> Iterator[Any]:
    # read when the frame reaches it, after every slice was reported
    yield serialization.tensor_bytes(extras[k], lt.dtype)


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
