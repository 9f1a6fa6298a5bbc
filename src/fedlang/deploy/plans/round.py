"""A round's plan, the format real clients run: one round's client task and aggregations.

The deployment runtime evaluates a federated computation the way the simulation runtime
does (lazily, aggregations in waves); each wave becomes a round on real clients
(`compiler.build` makes its plan). A `RoundPlan` holds what the round needs:

* `task`: a federated computation over one client,
  `(<data={D}@CLIENTS,broadcast=B@SERVER> -> {<x_0,...,x_k>}@CLIENTS)`, where `D` is a
  struct of the client datasets it reads (by name, e.g. `train`), `B` the values the
  server broadcasts, and `x_i` what the client feeds aggregation `i`. It is built from
  the wave's dataflow graph, so client work shared by two aggregations runs once.
* `aggregations`: per aggregation, the intrinsic, its parameter type and its concrete
  server arguments (`federated_aggregate`'s zero and functions, a secure sum's bounds).
* `browser` (optional): what browser clients run instead of the StableHLO task (ONNX
  programs and a JSON description, `fedlang.deploy.browser`), signed with the plan.
* `state` (optional, `StatePlan`): the client state the task reads and writes, for a
  computation declared with `with_client_state` and given `client_state(name)`. The
  task then takes `<data,broadcast,state=S>` and, when it writes the state, returns the
  new state `S'` as the last field after the aggregation inputs. The plan carries the
  state's name, type and the computation `( -> S)` of a client seen for the first
  time; the device reads its state before the task and keeps `S'` itself: the state
  is never in a report (docs/learning.md, "Client state").
* `bounds` (optional, `plans.bounds.Bounds`): what one client's plain report may hold
  (per leaf a range, a sum's scaled by its count; L2 norms of groups of leaves),
  declared by the driver (`bounds.ReportBounds`) and checked by the server for every report.

A client runs the task on its own data, folds each `x_i` into its aggregation's
accumulator (`runtime.accumulate`) and reports the partials, each tensor in its values'
dtype (`report_type`: a float32 model's update travels as float32); the server merges
the partials of every report into its wider aggregate (`aggregate_type`, totals in
float64 or int64; `folding.Folder`).

Plans serialize to JSON with the project's binary format embedded (base64), and are
signed by the server before clients see them.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import math
from collections.abc import Iterator
from typing import Any, cast

from fedlang.core import computation, intrinsics, serialization, structure, types
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.runtime import accumulate, reference

PLAN_VERSION = 1


@dataclasses.dataclass(frozen=True)
class StatePlan:
    """The client state a round's task reads (and writes, when `writes`).

    Attributes:
      name: the state's key on each device (one per population and name).
      state_type: `S`, one client's state.
      initialize: a local computation `( -> S)`: the state of a first-seen client.
      writes: whether the task returns the new state (as its last output).
    """

    name: str
    state_type: types.Type
    initialize: computation.Computation
    writes: bool

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "type": b64(serialization.serialize_type(self.state_type)),
            "initialize": b64(self.initialize.to_bytes()),
            "writes": self.writes,
        }

    @staticmethod
    def from_json(doc: Any) -> StatePlan:
        name, writes = doc["name"], doc["writes"]
        if not (isinstance(name, str) and name.isidentifier() and isinstance(writes, bool)):
            raise serialization.malformed("a state section (name, writes)", repr(doc)[:60])
        state_t = serialization.deserialize_type(unb64(doc["type"]))
        init = serialization.deserialize_computation(unb64(doc["initialize"]), trusted=True)
        init_t = init.type_signature
        if init_t.parameter is not None or not state_t.is_assignable_from(init_t.result):
            raise serialization.malformed(f"an initial state computation ( -> {state_t})", init_t)
        return StatePlan(name, state_t, init, writes)


@dataclasses.dataclass(frozen=True)
class AggregationPlan:
    """One aggregation of a round: intrinsic, parameter type and concrete server arguments.

    Server arguments are internal values, or computations for function-typed ones.
    """

    uri: str
    parameter_type: types.Type
    server_args: tuple[Any, ...]

    @property
    def definition(self) -> intrinsics.IntrinsicDef:
        return intrinsics.lookup(self.uri)

    @property
    def accumulation(self) -> accumulate.Aggregation:
        return accumulate.AGGREGATIONS[self.uri]

    def server_arg_types(self) -> tuple[types.Type, ...]:
        if self.accumulation.clients != accumulate.FIRST:
            return ()
        return cast(types.StructType, self.parameter_type).types[1:]

    def make(self) -> accumulate.Accumulator:
        """A fresh accumulator for this aggregation."""
        args = tuple(
            reference.to_internal(a, t, None) if isinstance(t, types.FunctionType) else a
            for a, t in zip(self.server_args, self.server_arg_types())
        )
        return self.accumulation.make(self.definition, self.parameter_type, args, _call)

    @property
    def client_type(self) -> types.Type:
        return self.accumulation.client_type(self.parameter_type)

    @property
    def is_secure(self) -> bool:
        return self.definition.kind is intrinsics.Kind.SECURE_AGGREGATE


def _call(fn: Any, arg: Any) -> Any:
    # federated_aggregate's functions are local: a closure over no environment, or a
    # local computation.
    return reference.Interpreter(None).call(fn, arg)


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What a round runs (see the module docstring)."""

    task: computation.Computation
    data_names: tuple[str, ...]
    broadcast_type: types.Type
    aggregations: tuple[AggregationPlan, ...]
    browser: dict[str, Any] | None = dataclasses.field(default=None, compare=False)
    state: StatePlan | None = None
    bounds: bounds_lib.Bounds | None = None

    @property
    def aggregate_type(self) -> types.StructType:
        """The type of a round's aggregate: the partial of each aggregation."""
        return types.StructType([a.make().partial_type for a in self.aggregations])

    @property
    def secure(self) -> tuple[int, ...]:
        """The indices of the secure aggregations: their inputs go through SecAgg+."""
        return tuple(i for i, a in enumerate(self.aggregations) if a.is_secure)

    @property
    def report_type(self) -> types.StructType:
        """The type of one client's plain report: the partial of its one value for each
        aggregation that is not secure (a secure one's input travels masked, see
        `secure_segments`), in the narrow form (`Accumulator.report_type`): each tensor
        in the model's dtype, the wide totals living only in the server's aggregate."""
        secure = set(self.secure)
        return types.StructType(
            [a.make().report_type for i, a in enumerate(self.aggregations) if i not in secure]
        )

    @property
    def report_paths(self) -> list[str]:
        """The path of each leaf of a plain report, its aggregation's index first
        (`[0].b`, `[4]`): how `bounds` names them."""
        plain = [i for i in range(len(self.aggregations)) if i not in set(self.secure)]
        return bounds_lib.leaf_paths(self.report_type, [f"[{i}]" for i in plain])

    def secure_segments(self, num_clients: int) -> list[tuple[int, int]]:
        """`(length, modulus)` per tensor of every secure aggregation, for a cohort of
        `num_clients`: a bit width `b` sums in the group `2^(b + ceil(log2 n))` (exact, as
        in simulation), a modulus `m` in the group of `m`."""
        out = []
        for i in self.secure:
            a = self.aggregations[i]
            acc = a.make()
            moduli = acc.modulus(num_clients)  # type: ignore[attr-defined]
            for lt, modulus in zip(structure.leaf_types(a.client_type), moduli):
                out.append((math.prod(d or 0 for d in lt.shape), int(modulus)))
        return out

    def to_bytes(self) -> bytes:
        """The plan as bytes (JSON with the binary format embedded)."""
        doc = {
            "version": PLAN_VERSION,
            "task": b64(self.task.to_bytes()),
            "data": list(self.data_names),
            "broadcast_type": b64(serialization.serialize_type(self.broadcast_type)),
            "aggregations": [_aggregation_json(a) for a in self.aggregations],
        }
        if self.browser is not None:  # only then: plans for Python clients are unchanged
            doc["browser"] = self.browser
        if self.state is not None:  # likewise: plans without client state are unchanged
            doc["state"] = self.state.to_json()
        if self.bounds is not None:  # likewise: plans without bounds are unchanged
            doc["bounds"] = self.bounds.to_json()
        return json.dumps(doc, separators=(",", ":")).encode()

    @staticmethod
    def from_bytes(data: bytes) -> RoundPlan:
        """Reads a plan written by `to_bytes` from a trusted source (a signature was
        checked, or this process wrote it).

        Raises:
          SerializationError: if the bytes are not a valid plan.
        """
        with reading("a round plan"):
            doc = document(data, "a round plan")
            task = serialization.deserialize_computation(unb64(doc["task"]), trusted=True)
            names = doc["data"]
            if not (isinstance(names, list) and all(isinstance(n, str) for n in names)):
                raise serialization.malformed("a list of client data names", repr(names)[:60])
            broadcast_t = serialization.deserialize_type(unb64(doc["broadcast_type"]))
            aggregations = tuple(_aggregation_from_json(a) for a in doc["aggregations"])
            browser = doc.get("browser")
            if browser is not None and not isinstance(browser, dict):
                raise serialization.malformed("a browser section (an object)", repr(browser)[:60])
            state = None if doc.get("state") is None else StatePlan.from_json(doc["state"])
            plan = RoundPlan(task, tuple(names), broadcast_t, aggregations, browser, state)
            if doc.get("bounds") is not None:
                plan = dataclasses.replace(
                    plan, bounds=bounds_lib.Bounds.from_json(doc["bounds"], plan.report_paths))
        return plan


def document(data: bytes, what: str, version: int = PLAN_VERSION,
             kind: str | None = None) -> dict[str, Any]:
    """The JSON object of a plan's bytes, of `version` (and of `kind`, when the plan
    names its kind: a buffered session's).

    Raises:
      SerializationError: anything else, naming `what` was expected.
    """
    doc = json.loads(bytes(data).decode())
    if not (isinstance(doc, dict) and doc.get("version") == version
            and (kind is None or doc.get("kind") == kind)):
        raise serialization.malformed(f"{what} of version {version}", repr(doc)[:60])
    return doc


@contextlib.contextmanager
def reading(what: str) -> Iterator[None]:
    """What reading a plan's JSON raises, as a `SerializationError` naming `what`."""
    try:
        yield
    except serialization.SerializationError:
        raise
    except (ValueError, TypeError, KeyError, AttributeError) as e:
        raise serialization.malformed(what, f"{type(e).__name__}: {e}") from e


def b64(data: bytes) -> str:
    """Bytes as base64 text (how plans carry programs and types in JSON)."""
    return base64.b64encode(data).decode()


def unb64(text: Any) -> bytes:
    """The bytes of base64 text; anything else is a `SerializationError`."""
    if not isinstance(text, str):
        raise serialization.malformed("base64 text", type(text).__name__)
    return base64.b64decode(text, validate=True)


def _aggregation_json(a: AggregationPlan) -> dict[str, Any]:
    args = []
    for value, t in zip(a.server_args, a.server_arg_types()):
        if isinstance(t, types.FunctionType):
            args.append({"computation": b64(value.to_bytes())})
        else:
            python = structure.to_python(value, t)
            args.append({"value": b64(serialization.serialize_value(python, t))})
    return {
        "uri": a.uri,
        "parameter_type": b64(serialization.serialize_type(a.parameter_type)),
        "server_args": args,
    }


def _aggregation_from_json(doc: Any) -> AggregationPlan:
    uri = doc["uri"]
    if uri not in accumulate.AGGREGATIONS:
        raise serialization.malformed("an aggregation intrinsic", repr(uri))
    parameter_t = serialization.deserialize_type(unb64(doc["parameter_type"]))
    shell = AggregationPlan(uri, parameter_t, ())
    arg_types = shell.server_arg_types()
    raw = doc["server_args"]
    if not isinstance(raw, list) or len(raw) != len(arg_types):
        raise serialization.malformed(f"{len(arg_types)} server arguments for {uri}", repr(raw)[:60])
    args = []
    for entry, t in zip(raw, arg_types):
        if isinstance(t, types.FunctionType):
            comp = serialization.deserialize_computation(unb64(entry["computation"]), trusted=True)
            if not t.is_assignable_from(comp.type_signature):
                raise serialization.malformed(f"a function of type {t}", comp.type_signature)
            args.append(comp)
        else:
            value = serialization.deserialize_value(unb64(entry["value"]), expected_type=t)
            args.append(structure.to_internal(value, t))
    return AggregationPlan(uri, parameter_t, tuple(args))
