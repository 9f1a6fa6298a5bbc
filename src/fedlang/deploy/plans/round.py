"""Splitting a computation for real clients: one round's client task and aggregations.

The deployment runtime evaluates a federated computation the way the simulation runtime
does (lazily, aggregations in waves); each wave becomes a round on real clients. A
`RoundPlan` holds what the round needs:

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
  (per leaf a range, L2 norms of groups of leaves), declared by the driver
  (`bounds.ReportBounds`) and checked by the server for every report.

A client runs the task on its own data, folds each `x_i` into its aggregation's
accumulator (`runtime.accumulate`) and reports the partials; the server merges the
partials of every report (`folding.Folder`). What real clients cannot do is refused
while the plan is built, before the round starts: returning a CLIENTS value (clients
would have to send it raw), or an intrinsic without a client-side strategy.

Plans serialize to JSON with the project's binary format embedded (base64), and are
signed by the server before clients see them.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import math
from typing import Any, cast

from fedlang.core import computation, intrinsics, ir, serialization, structure, tracing, types
from fedlang.core import operators as ops
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.runtime import accumulate, lazy, reference

PLAN_VERSION = 1


class DeploymentError(TypeError):
    """A computation, or part of one, cannot run on real clients."""


class DataSource(lazy.ClientsValue):
    """The clients' own data named `name` (a `client_data(name)` argument)."""

    def __init__(self, name: str, member: types.Type):
        self.name = name
        self.member = member

    def _chunk(self, start: int, stop: int, cache: dict[int, Any]) -> Any:
        raise DeploymentError(
            f"Client data {self.name!r} lives on the clients; the server cannot read it."
        )


class StateSource(lazy.ClientsValue):
    """The clients' own state `name` (a `client_state(name)` argument), of type `member`;
    `initialize` (`( -> member)`) gives a client seen for the first time its state."""

    def __init__(self, name: str, member: types.Type, initialize: computation.Computation):
        self.name = name
        self.member = member
        self.initialize = initialize

    def _chunk(self, start: int, stop: int, cache: dict[int, Any]) -> Any:
        raise DeploymentError(
            f"Client state {self.name!r} lives on the clients; the server cannot read it."
        )


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
        """The type of one client's plain report: the partials of the aggregations that
        are not secure (a secure one's input travels masked, see `secure_segments`)."""
        secure = set(self.secure)
        return types.StructType(
            [t for i, t in enumerate(self.aggregate_type.types) if i not in secure]
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
        try:
            doc = json.loads(bytes(data).decode())
            if not isinstance(doc, dict) or doc.get("version") != PLAN_VERSION:
                raise serialization.malformed(
                    f"a round plan of version {PLAN_VERSION}", repr(doc)[:60]
                )
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
        except serialization.SerializationError:
            raise
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            raise serialization.malformed("a round plan", f"{type(e).__name__}: {e}") from e
        return plan


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


# ----------------------------------------------------------------------------
# Building a plan from a wave of the lazy evaluation


class _TaskBuilder:
    """Turns the dataflow graphs feeding a wave's aggregations into one client's IR.

    `collect` first walks the graphs for the client data and broadcast values they use
    (which make the task's parameter type); `node` then builds the IR, binding each
    graph node once, so client work shared by two aggregations runs once.
    """

    def __init__(self) -> None:
        self.data: dict[str, types.Type] = {}
        self.state: StateSource | None = None
        self.broadcasts: list[tuple[Any, types.Type]] = []  # (server value, type)
        self._broadcast_index: dict[int, int] = {}
        self.locals: list[tuple[str, ir.Node]] = []
        self._memo: dict[int, ir.Node] = {}
        self._keep: list[Any] = []  # keeps the ids in the tables above unique
        self._arg: ir.Reference | None = None

    def collect(self, cv: Any) -> None:
        self._keep.append(cv)
        if isinstance(cv, DataSource):
            previous = self.data.setdefault(cv.name, cv.member)
            if previous != cv.member:
                raise DeploymentError(
                    f"Client data {cv.name!r} is used with two types, {previous} and {cv.member}."
                )
        elif isinstance(cv, StateSource):
            if self.state is not None and self.state.name != cv.name:
                raise DeploymentError(
                    f"A round reads two client states, {self.state.name!r} and {cv.name!r}; "
                    "keep one state per computation (a struct of both)."
                )
            self.state = cv
        elif isinstance(cv, lazy.Replicated):
            if id(cv) not in self._broadcast_index:
                self._broadcast_index[id(cv)] = len(self.broadcasts)
                self.broadcasts.append((lazy.force(cv.value), cv.member))
        elif isinstance(cv, lazy.Mapped | lazy.Counted | lazy.Zipped):
            for child in cv.children():
                self.collect(child)
        else:
            raise DeploymentError(
                "A value computed at the clients by an intrinsic without a client-side strategy "
                f"({type(cv).__name__}) cannot run on real clients; compute it with "
                "federated_map of a local computation instead."
            )

    @property
    def arg(self) -> ir.Reference:
        if self._arg is None:
            fields: list[tuple[str, types.Type]] = [
                ("data", types.StructType(list(self.data.items()))),
                ("broadcast", types.StructType([t for _, t in self.broadcasts])),
            ]
            if self.state is not None:
                fields.append(("state", self.state.member))
            self._arg = ir.Reference("arg", types.StructType(fields))
        return self._arg

    def node(self, cv: Any) -> ir.Node:
        key = id(cv)
        if key not in self._memo:
            built = self._build(cv)
            if not isinstance(built, ir.Selection):  # selections of the argument are free
                name = f"c{len(self.locals)}"
                self.locals.append((name, built))
                built = ir.Reference(name, built.type_signature)
            self._memo[key] = built
        return self._memo[key]

    def _build(self, cv: Any) -> ir.Node:
        if isinstance(cv, DataSource):
            return ir.Selection(ir.Selection(self.arg, "data"), cv.name)
        if isinstance(cv, StateSource):
            return ir.Selection(self.arg, "state")
        if isinstance(cv, lazy.Replicated):
            index = self._broadcast_index[id(cv)]
            return ir.Selection(ir.Selection(self.arg, "broadcast"), index)
        if isinstance(cv, lazy.Mapped):
            return ir.Call(_function_node(cv.fn), self.node(cv.input))
        if isinstance(cv, lazy.Counted):
            return ir.Call(_function_node(cv.fn))
        assert isinstance(cv, lazy.Zipped)  # `collect` refused everything else
        return self._zipped(cv.parts, cv.arg_type)

    def _zipped(self, parts: Any, t: types.Type) -> ir.Node:
        if isinstance(t, types.FederatedType):
            return self.node(parts)
        st = cast(types.StructType, t)
        return ir.Struct(
            [(n, self._zipped(p, et)) for (n, et), p in zip(st.elements, parts)],
            container=st.container,
        )


def _function_node(fn: Any) -> ir.Node:
    """The IR of a function value mapped at the clients; it must be self-contained."""
    if isinstance(fn, reference.Closure):
        free = ir.free_references(fn.fn)
        if free:
            raise DeploymentError(
                f"A function mapped at the clients refers to {sorted(free)} of its enclosing "
                "computation; real clients receive only the function. Pass those values as "
                "arguments (e.g. broadcast them and zip them with the client values)."
            )
        return fn.fn
    return ir.Local(fn)


def build(
    aggregations: list[Any],
    state_write: tuple[Any, StateSource] | None = None,
    report_bounds: bounds_lib.ReportBounds | None = None,
) -> tuple[RoundPlan, Any]:
    """The plan of a wave, and the broadcast value (a tuple, internal form).

    Args:
      aggregations: the wave's `simulation.AggThunk`s, whose server inputs are computed.
      state_write: `(thunk, source)` when the invocation writes client state: the
        `AggThunk` whose input is the new state (it becomes the task's last output, kept
        on the device, when it is in this wave) and the state it writes.
      report_bounds: what reports may hold (None: the plan declares no bounds).

    Raises:
      DeploymentError: naming what cannot run on real clients.
    """
    builder = _TaskBuilder()
    plans = []
    writes = None
    for a in aggregations:
        if state_write is not None and a is state_write[0]:
            writes = a
            builder.collect(state_write[1])
            builder.collect(a.input)
            continue
        if a.spec is None:
            raise DeploymentError(
                "A result placed at CLIENTS cannot be returned from real clients (they would "
                "have to send their values raw); aggregate it (federated_sum, federated_mean, "
                "...) before returning it."
            )
        d, parameter_t, server_args = a.spec
        plans.append(AggregationPlan(d.uri, parameter_t, tuple(lazy.force(server_args))))
        builder.collect(a.input)
    outputs = [builder.node(a.input) for a in aggregations if a is not writes]
    if writes is not None:
        outputs.append(builder.node(writes.input))
    arg_t = cast(types.StructType, builder.arg.type_signature)
    body = ir.Block(builder.locals, ir.Struct([(None, o) for o in outputs]))
    local_task = computation.IRComputation(ir.Lambda("arg", arg_t, body), "client_task")
    task = _federated_task(local_task, arg_t)
    state = None
    if builder.state is not None:
        source = builder.state
        state = StatePlan(source.name, source.member, source.initialize, writes is not None)
    broadcast_t = cast(types.StructType, arg_t.types[1])
    plan = RoundPlan(task, tuple(builder.data), broadcast_t, tuple(plans), state=state)
    if report_bounds is not None:
        summed = [a for a in aggregations if a is not writes]
        plain = [i for i in range(len(plans)) if i not in set(plan.secure)]
        declared = report_bounds.for_round(plan.aggregations, plan.report_type, plain,
                                           _weighted_by(summed, plans))
        plan = dataclasses.replace(plan, bounds=declared)
    return plan, tuple(v for v, _ in builder.broadcasts)


def _weighted_by(thunks: list[Any], plans: list[AggregationPlan]) -> dict[int, int]:
    """Which `federated_sum` sums values weighted by which other one's scalar float
    weight: `i -> j` when aggregation `i`'s client input is a `federated_map` over a zip
    that holds aggregation `j`'s input itself (how `MeanFactory`, and so FedAvg, sums
    `w * u` and `w`)."""
    sum_uri = intrinsics.lookup("federated_sum").uri
    weights = {}
    for j, (a, p) in enumerate(zip(thunks, plans)):
        member = p.client_type
        if p.uri == sum_uri and isinstance(member, types.TensorType) and not member.shape \
                and member.dtype.kind == "f":
            weights[id(a.input)] = j
    out = {}
    for i, (a, p) in enumerate(zip(thunks, plans)):
        cv = a.input
        if p.uri != sum_uri or not isinstance(cv, lazy.Mapped) \
                or not isinstance(cv.input, lazy.Zipped):
            continue
        for part in cv.input.children():
            w = weights.get(id(part))
            if w is not None and w != i:
                out[i] = w
                break
    return out


def _federated_task(
    local_task: computation.Computation, arg_t: types.StructType
) -> computation.Computation:
    data_t, broadcast_t = arg_t.types[:2]
    if len(arg_t) == 2:
        def client_task(data: Any, broadcast: Any) -> Any:
            both = ops.federated_zip(
                {"data": data, "broadcast": ops.federated_broadcast(broadcast)})
            return ops.federated_map(local_task, both)

        return tracing.trace(
            client_task,
            (types.FederatedType(data_t, types.CLIENTS),
             types.FederatedType(broadcast_t, types.SERVER)),
            name="client_task",
        )

    def stateful_task(data: Any, broadcast: Any, state: Any) -> Any:
        every = ops.federated_zip(
            {"data": data, "broadcast": ops.federated_broadcast(broadcast), "state": state})
        return ops.federated_map(local_task, every)

    return tracing.trace(
        stateful_task,
        (types.FederatedType(data_t, types.CLIENTS),
         types.FederatedType(broadcast_t, types.SERVER),
         types.FederatedType(arg_t.types[2], types.CLIENTS)),
        name="client_task",
    )
