"""Compiling a wave of the lazy evaluation into a round's plan (`round.RoundPlan`).

The deployment runtime (`driver.context`) evaluates a federated computation the way the
simulation runtime does (lazily, aggregations in waves); `build` turns a wave's
aggregations into the plan real clients run, and the value the server broadcasts. The
client task is built from the wave's dataflow graph, so client work shared by two
aggregations runs once. The clients' inputs are `DataSource`s (a `client_data(name)`
argument) and `StateSource`s (a client state kept on the devices). What real clients
cannot do is refused while the plan is built, before the round starts (`DeploymentError`):
returning a CLIENTS value (clients would have to send it raw), or an intrinsic without a
client-side strategy.
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import jax
from jax.extend import core as jcore

from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, intrinsics, ir, structure, tracing, types
from fedlang.core import operators as ops
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import round as plan_lib
from fedlang.runtime import lazy, reference


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
) -> tuple[plan_lib.RoundPlan, Any]:
    """The plan of a wave, and the broadcast value (a tuple, internal form).

    Args:
      aggregations: the wave's `simulation.AggThunk`s, whose server inputs are computed.
      state_write: `(thunk, source)` when the invocation writes client state: the
        `AggThunk` whose input is the new state (it becomes the task's last output, kept
        on the device, when it is in this wave) and the state it writes.
      report_bounds: what reports may hold (None: the plan declares no bounds).

    Raises:
      DeploymentError: naming what cannot run on real clients.
      UnboundedLeaf: (`plans.bounds`, a strict `report_bounds`) naming a report leaf
        with no derivable or declared bound, and how to declare one.
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
        plans.append(plan_lib.AggregationPlan(d.uri, parameter_t, tuple(lazy.force(server_args))))
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
        state = plan_lib.StatePlan(source.name, source.member, source.initialize, writes is not None)
    broadcast_t = cast(types.StructType, arg_t.types[1])
    plan = plan_lib.RoundPlan(task, tuple(builder.data), broadcast_t, tuple(plans), state=state)
    if report_bounds is not None:
        summed = [a for a in aggregations if a is not writes]
        plain = [i for i in range(len(plans)) if i not in set(plan.secure)]
        names, constants = _inputs(summed, plans)
        declared = report_bounds.for_round(plan.aggregations, plan.report_type, plain,
                                           _weighted_by(summed, plans), names, constants)
        plan = dataclasses.replace(plan, bounds=declared)
    return plan, tuple(v for v, _ in builder.broadcasts)


def _weighted_by(thunks: list[Any], plans: list[plan_lib.AggregationPlan]) -> dict[int, int]:
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


def _inputs(thunks: list[Any], plans: list[plan_lib.AggregationPlan]
            ) -> tuple[dict[int, tuple[str, tuple[str, ...]]], dict[int, list[float]]]:
    """What the bounds can tell of each aggregation's client input: the field of the
    clients' value it takes and the names of that value's fields, when it is a
    selection (`outputs.update_norm`), and its leaves' values, when a `federated_sum`'s
    input is the same constant at every client (how the aggregators count clients: a
    function of the value that returns 1)."""
    sum_uri = intrinsics.lookup("federated_sum").uri
    names, constants = {}, {}
    for i, (a, p) in enumerate(zip(thunks, plans)):
        cv = a.input
        if not isinstance(cv, lazy.Mapped):
            continue
        fn = cv.fn
        if isinstance(fn, reference.Closure):
            body = fn.fn
            if isinstance(body, ir.Lambda) and isinstance(body.result, ir.Selection) \
                    and isinstance(body.result.source, ir.Reference) \
                    and body.result.source.name == body.parameter_name \
                    and body.result.name is not None:
                source = cast(types.StructType, body.result.source.type_signature)
                names[i] = (body.result.name, tuple(n for n in source.names if n is not None))
        elif p.uri == sum_uri:
            value = _constant(fn)
            if value is not None:
                constants[i] = value
    return names, constants


def _constant(fn: Any) -> list[float] | None:
    """The leaves of a JAX function's result when they are constants (its program
    returns literals whatever its argument), else None. Only functions of no dataset
    with a small result are looked at: tracing one takes a millisecond."""
    if not isinstance(fn, jax_backend.JaxComputation) or fn.seq_index is not None:
        return None
    result = fn.type_signature.result
    if not all(isinstance(t, types.TensorType) and not t.shape
               for t in structure.leaf_types(result)):
        return None
    args = [jax.ShapeDtypeStruct(t.shape, t.dtype) for t in fn.arg_leaf_types]
    try:
        program = jax.make_jaxpr(fn.part("fn"))(*args)
    except Exception:  # a function JAX cannot trace abstractly: not a constant we can read
        return None
    out = program.jaxpr.outvars
    if not out or not all(isinstance(v, jcore.Literal) for v in out):
        return None
    return [float(v.val) for v in out]


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
