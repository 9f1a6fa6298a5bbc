"""The task of a buffered (asynchronous, FedBuff) session: one client trains one model
version.

A synchronous round's plan (`plans.round.RoundPlan`) ends in aggregations, and a client
reports pre-aggregated partials. A buffered session (FedBuff) has no round: each client
trains the model version it downloaded and reports its raw result, which the server's
driver folds into a buffer of K reports (`driver.buffered`). So its task is a separate
kind, a one-client "collect":

* `task`: a federated computation over one client,
  `(<D@CLIENTS, W@SERVER> -> {R}@CLIENTS)`: the process's `train` local computation
  `(model_weights W, dataset D) -> report R`, mapped over the client's own dataset with
  the broadcast weights. It serializes like a round's task (StableHLO for its JAX
  programs) and is signed by the server like a round plan.
* `data_name`: the client dataset it reads (e.g. `train`);
* `weights_type`, `report_type`: the types of what the client downloads (a model
  version's weights) and uploads;
* `bounds` (optional, `plans.bounds.Bounds`): what one report may hold, checked by the
  server for every upload (`BufferedPlan.build(..., bounds=ReportBounds())`).

Clients run it with the simulation runtime's local execution (`run`); the server checks
every upload with explicit limits before storing it (`check`): the exact report type,
at most the bytes that type can take, finite floats.

An edge aggregator forwards its clients' reports in a **batch** (`encode_batch`): one
upload carrying `n` reports of one session, each with the model version its client
trained (`edge/sync.py` explains why an edge forwards the reports themselves rather than
their sum). The bytes are

    b"FLB1"  n: uint32  then n times:  version: int64  length: uint64  report bytes

little-endian, each report exactly as its client uploaded it. `encode_batch` is
deterministic: the same reports in the same order give the same bytes, so a resent batch
has the same digest (a replay). `decode_batch` reads untrusted bytes with explicit limits
and decodes nothing inside the reports (the session's plan checks each one).
"""

from __future__ import annotations

import dataclasses
import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any, cast

from fedlang.core import computation, serialization, signing, structure, tracing, types
from fedlang.core import operators as ops
from fedlang.deploy import protocol
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import folding
from fedlang.deploy.plans import round as plan
from fedlang.runtime import simulation

PLAN_KIND = protocol.TaskKind.BUFFERED
PLAN_VERSION = 1
BATCH_MAGIC = b"FLB1"
_BATCH_COUNT = struct.Struct("<I")
_BATCH_ITEM = struct.Struct("<qQ")


def _function_type(train: Any) -> types.FunctionType:
    t = getattr(train, "type_signature", None)
    if not isinstance(t, types.FunctionType):
        raise TypeError(
            f"Expected `train` to be a local computation (model_weights, dataset) -> report, "
            f"found {type(train).__name__}; pass the process's `train`."
        )
    p = t.parameter
    if not (isinstance(p, types.StructType) and len(p.types) == 2):
        raise TypeError(
            f"Expected `train` to take two arguments (model_weights, dataset), found a "
            f"parameter of type {p}."
        )
    for member in (*p.types, t.result):
        if isinstance(member, types.FederatedType):
            raise TypeError(
                f"Expected `train` to be a local computation (no placements), found type {t}; "
                "a buffered session ships it to one client at a time."
            )
    if not isinstance(p.types[1], types.SequenceType):
        raise TypeError(
            f"Expected `train`'s second argument to be the client's dataset (a sequence), "
            f"found {p.types[1]}."
        )
    return t


@dataclasses.dataclass(frozen=True)
class BufferedPlan:
    """What a client of a buffered session runs (see the module docstring)."""

    task: computation.Computation
    data_name: str
    weights_type: types.Type
    report_type: types.Type
    bounds: bounds_lib.Bounds | None = None

    @staticmethod
    def build(train: Any, data_name: str = "train",
              bounds: bounds_lib.ReportBounds | None = None) -> BufferedPlan:
        """The plan of `train`, a local computation `(model_weights, dataset) -> report`,
        with the report bounds `bounds` declares (None: none).

        Raises:
          TypeError: if `train` is not such a computation.
          ValueError: if `data_name` is not a dataset name; `bounds.UnboundedLeaf`
            (a strict `bounds`) naming a report leaf with no derivable or declared bound.
        """
        if not (isinstance(data_name, str) and data_name.isidentifier()):
            raise ValueError(f"Expected a client data name such as 'train', found {data_name!r}.")
        t = _function_type(train)
        p = cast(types.StructType, t.parameter)
        weights_t, data_t = p.types
        names = p.names

        def client_task(data: Any, weights: Any) -> Any:
            parts = (ops.federated_broadcast(weights), data)
            if all(n is not None for n in names):
                zipped = ops.federated_zip(dict(zip(names, parts)))
            else:
                zipped = ops.federated_zip(parts)
            return ops.federated_map(train, zipped)

        task = tracing.trace(
            client_task,
            (types.FederatedType(data_t, types.CLIENTS),
             types.FederatedType(weights_t, types.SERVER)),
            name="buffered_client_task",
        )
        declared = None if bounds is None else bounds.for_buffered(t.result)
        return BufferedPlan(task, data_name, weights_t, t.result, declared)

    @property
    def max_report_bytes(self) -> int:
        """The most tensor bytes a report of `report_type` can hold (unknown dims: 2^20)."""
        return folding.max_bytes(self.report_type)

    @property
    def broadcast_type(self) -> types.Type:
        """The type of what a client downloads with its task: a model version's weights."""
        return self.weights_type

    @property
    def report_paths(self) -> list[str]:
        """The path of each leaf of a report (`.update_weight`): how `bounds` names them."""
        return bounds_lib.leaf_paths(self.report_type)

    def to_bytes(self) -> bytes:
        """The plan as bytes (JSON with the binary format embedded, base64)."""
        doc = {
            "kind": PLAN_KIND,
            "version": PLAN_VERSION,
            "task": plan.b64(self.task.to_bytes()),
            "data": self.data_name,
            "weights_type": plan.b64(serialization.serialize_type(self.weights_type)),
            "report_type": plan.b64(serialization.serialize_type(self.report_type)),
        }
        if self.bounds is not None:  # only then: plans without bounds are unchanged
            doc["bounds"] = self.bounds.to_json()
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> BufferedPlan:
        """Reads a plan written by `to_bytes` from a trusted source (its signature was
        checked, or this process wrote it).

        Raises:
          SerializationError: if the bytes are not a valid buffered plan.
        """
        with plan.reading("a buffered-session plan"):
            doc = plan.document(data, "a buffered-session plan", PLAN_VERSION, PLAN_KIND)
            task = serialization.deserialize_computation(plan.unb64(doc["task"]), trusted=True)
            name = doc["data"]
            if not (isinstance(name, str) and name.isidentifier()):
                raise serialization.malformed("a client data name", repr(name)[:60])
            weights_t = serialization.deserialize_type(plan.unb64(doc["weights_type"]))
            report_t = serialization.deserialize_type(plan.unb64(doc["report_type"]))
            declared = None
            if doc.get("bounds") is not None:
                declared = bounds_lib.Bounds.from_json(doc["bounds"],
                                                       bounds_lib.leaf_paths(report_t))
        want = types.FunctionType(
            types.StructType([types.FederatedType(_data_type(task), types.CLIENTS),
                              types.FederatedType(weights_t, types.SERVER)]),
            types.FederatedType(report_t, types.CLIENTS),
        )
        if not want.is_assignable_from(task.type_signature):
            raise serialization.malformed(f"a task of type {want}", task.type_signature)
        return BufferedPlan(task, name, weights_t, report_t, declared)

    def check(self, report: bytes) -> Any:
        """Decodes one client's uploaded report (untrusted bytes) with explicit limits.

        Returns:
          The report (Python containers of NumPy arrays, as `deserialize_value` gives).

        Raises:
          ReportError: if it is larger than the report type allows, of another type,
            malformed, or holds NaN or infinity.
        """
        value = folding.read_report(report, self.report_type)
        folding.check_finite(
            structure.to_internal(value, self.report_type), self.report_type, "the report"
        )
        return value

    def leaves(self, report: Any) -> dict[str, Any]:
        """A checked report's leaves (as `check` returns it) by path, for `bounds`."""
        value = structure.to_internal(report, self.report_type)
        return bounds_lib.leaves_of(value, self.report_type, self.report_paths)

    def run(
        self,
        weights: bytes,
        data: Mapping[str, Any],
        context: simulation.SimulationContext | None = None,
    ) -> bytes:
        """This client's report: `train` on its own dataset from the downloaded weights.

        Args:
          weights: the serialized model weights of the version the client trains.
          data: the client's own datasets by name.
          context: the runtime to run the task on (default: a simulation context).

        Raises:
          KeyError: if the client has no dataset named `data_name`.
          SerializationError: if `weights` are not of the plan's weights type.
        """
        if self.data_name not in data:
            raise KeyError(
                f"The task reads client data {self.data_name!r}, but this client has "
                f"{sorted(data)}. Start the client with --data {self.data_name}=PATH."
            )
        value = serialization.deserialize_value(weights, expected_type=self.weights_type)
        ctx = context or simulation.SimulationContext(chunk_size=1)
        with ctx:
            (report,) = ctx.invoke(self.task, ([data[self.data_name]], value))
        return serialization.serialize_value(report, self.report_type)


def _data_type(task: computation.Computation) -> types.Type:
    p = cast(types.StructType, task.type_signature.parameter)  # type: ignore[attr-defined]
    return cast(types.FederatedType, p.types[0]).member


def load(signed_plan: bytes, public_key: Any) -> BufferedPlan:
    """The plan in `signed_plan`, once its signature verifies against the pinned key.

    Raises:
      SignatureError: if it was not signed by `public_key`'s owner.
      SerializationError: if it is not a valid buffered plan.
    """
    return BufferedPlan.from_bytes(signing.verify(signed_plan, public_key))


# -- batches of reports (an edge aggregator forwards its clients' in one upload)


def encode_batch(items: Sequence[tuple[int, bytes]]) -> bytes:
    """The batch of `items`, each (version, report bytes), in order.

    Example:
      >>> decode_batch(encode_batch([(0, b"a"), (1, b"bc")]), 2, 2)
      [(0, b'a'), (1, b'bc')]
    """
    parts = [BATCH_MAGIC, _BATCH_COUNT.pack(len(items))]
    for version, report in items:
        parts += [_BATCH_ITEM.pack(int(version), len(report)), bytes(report)]
    return b"".join(parts)


def max_batch_bytes(max_reports: int, max_report_bytes: int) -> int:
    """The largest batch of at most `max_reports` reports of `max_report_bytes` each."""
    return len(BATCH_MAGIC) + _BATCH_COUNT.size + max_reports * (_BATCH_ITEM.size + max_report_bytes)


def decode_batch(body: bytes, max_reports: int, max_report_bytes: int) -> list[tuple[int, bytes]]:
    """The (version, report bytes) items of a batch.

    Raises:
      ReportError: `malformed` (not a batch, truncated, trailing bytes, no report, a
        negative version) or `too_large` (more than `max_reports` reports, or a report
        above `max_report_bytes`).
    """
    view = memoryview(body)
    head = len(BATCH_MAGIC) + _BATCH_COUNT.size
    if len(view) < head or bytes(view[:len(BATCH_MAGIC)]) != BATCH_MAGIC:
        raise folding.ReportError(
            f"Expected a batch of reports (starting {BATCH_MAGIC!r}), found {bytes(view[:8])!r}.",
            reason="malformed",
        )
    (n,) = _BATCH_COUNT.unpack_from(view, len(BATCH_MAGIC))
    if not 1 <= n <= max_reports:
        raise folding.ReportError(
            f"Expected 1 to {max_reports} reports in a batch (the session's buffer), found {n}.",
            reason="too_large" if n > max_reports else "malformed",
        )
    items, at = [], head
    for i in range(n):
        if at + _BATCH_ITEM.size > len(view):
            raise folding.ReportError(f"Expected {n} reports in the batch, found {i}.",
                                      reason="malformed")
        version, length = _BATCH_ITEM.unpack_from(view, at)
        at += _BATCH_ITEM.size
        if version < 0:
            raise folding.ReportError(
                f"Expected a model version >= 0 for report {i} of the batch, found {version}.",
                reason="malformed",
            )
        if length > max_report_bytes:
            raise folding.ReportError(
                f"Expected at most {max_report_bytes} bytes in report {i} of the batch (the "
                f"plan's report type), found {length}.", reason="too_large",
            )
        if at + length > len(view):
            raise folding.ReportError(f"Expected {length} bytes of report {i} of the batch, "
                                      f"found {len(view) - at}.", reason="malformed")
        items.append((int(version), bytes(view[at:at + length])))
        at += length
    if at != len(view):
        raise folding.ReportError(
            f"Expected the batch to end after its {n} reports, found {len(view) - at} more "
            "bytes.", reason="malformed",
        )
    return items
