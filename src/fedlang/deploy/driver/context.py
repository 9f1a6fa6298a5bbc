"""The deployment runtime: the user's ordinary driver loop, run against real clients.

`DeploymentContext` evaluates a federated computation exactly like the simulation
runtime (lazily, aggregations in waves) with one difference: a wave is not computed over
chunks of clients held in memory, it becomes a round on real clients. The wave's plan
(`plans.compiler.build`) and broadcast value go to a `RoundRunner` — the task store's server over
HTTP in production (`rounds.ServerRounds`), or `LocalRounds` to run clients in this
process — which returns the round's aggregate; the evaluation goes on with it. Server
work between waves (e.g. applying the server optimizer) runs here, in the driver.

Arguments placed at CLIENTS are references to the clients' own data by name
(`client_data("train")`); each client resolves the name to its local dataset.

Client state (a computation declared with `fl.with_client_state`) is bound the same
way, by name: `client_state("c_i")` in place of the cohort's states. The binding names
the state and holds none of it: the state parameter becomes an input of the client
task that each device reads from its own storage, and the new-state result an output
of the task that the device keeps (`plans.round.StatePlan`), so the server never sees a
state. The invocation returns the binding in place of the new states, as the other
runtimes return theirs.
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol, cast, runtime_checkable

from fedlang.core import client_state as client_state_lib
from fedlang.core import context as core_context
from fedlang.core import intrinsic_defs, intrinsics, serialization, signing, structure, types
from fedlang.deploy import secagg
from fedlang.deploy.client import connection as connection_lib
from fedlang.deploy.plans import bounds as bounds_lib
from fedlang.deploy.plans import compiler, execution, folding
from fedlang.deploy.plans import round as plan_lib
from fedlang.runtime import accumulate, lazy, reference, simulation

CLIENTS = types.CLIENTS


@dataclasses.dataclass(frozen=True)
class ClientDataRef:
    """The clients' own dataset called `name` (see `client_data`)."""

    name: str


def client_data(name: str) -> ClientDataRef:
    """A CLIENTS-placed argument meaning "each client's own dataset `name`".

    Example:
      >>> client_data("train")
      ClientDataRef(name='train')
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Expected a client data name such as 'train', found {name!r}.")
    return ClientDataRef(name)


@dataclasses.dataclass(frozen=True)
class ClientStateRef:
    """The clients' own client state called `name` (see `client_state`)."""

    name: str


def client_state(name: str) -> ClientStateRef:
    """A `{S}@CLIENTS` argument meaning "each client's own state `name`, kept on it".

    Pass it for the client-state parameter of a computation declared with
    `fl.with_client_state` (e.g. `process.next(state, client_data("train"),
    client_state("scaffold"))`). Each device keeps its state under this name (one per
    population), starts from the computation's initial state the first time, and keeps
    the new state after each task; the driver and the server never hold it.

    Example:
      >>> client_state("scaffold")
      ClientStateRef(name='scaffold')
    """
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"Expected a client state name such as 'scaffold', found {name!r}.")
    return ClientStateRef(name)


@dataclasses.dataclass(frozen=True)
class RoundResult:
    """What a round returned: the aggregate (bytes, see `folding.Folder`) and counts.

    `results`, when not None, are the round's results (each aggregation's, internal form:
    what `folding.results_sliced` makes of the aggregate) that the runner made as the
    aggregate streamed in (`driver.results`); `aggregate` is then `b""`.
    """

    aggregate: bytes
    reports: int
    seconds: float
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    results: Sequence[Any] | None = None


class RoundRunner(Protocol):
    """Runs one round on clients and returns its aggregate."""

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> RoundResult: ...


@runtime_checkable
class StreamingRoundRunner(Protocol):
    """A `RoundRunner` that also takes a round without either value held twice (a large
    model's): the broadcast as the parts of its frame, read from the arrays' own memory
    (`FrameParts`, sent as it is read), and the round's results made as its aggregate
    streamed in (`RoundResult.results`), or its aggregate returned as a `bytearray` of
    its own that the caller may overwrite (the round's results are made in its memory:
    `folding.results_sliced`)."""

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> RoundResult: ...

    def run_round_parts(self, plan: plan_lib.RoundPlan, broadcast: FrameParts) -> RoundResult: ...


class FrameParts:
    """A value's frame (the bytes `serialization.serialize_value` writes) as the pieces
    that make it: its tensors' own memory, in pieces of at most `connection.PIECE`
    bytes (`connection.Body`), framed by `serialization.DenseLayout.parts`. A large model's broadcast is sent from these,
    never joined into bytes (and an HTTP client that copies what it sends copies one
    piece at a time). Each iteration makes the frame anew (a retried upload sends it
    again); `release` lets the arrays go once it is sent.

    Args:
      value: the value, in internal form.
      t: its type.

    Raises:
      TypeError: `t` is not all dense tensors of known shape (`dense_layout`), or
        `value` is not of type `t`.
    """

    def __init__(self, value: Any, t: types.Type):
        self.layout = serialization.dense_layout(t)
        self.size = self.layout.size
        # checked and cast as `serialize_value` checks and casts it (an array of the
        # type's dtype is taken as it is)
        internal = structure.to_internal(structure.to_python(value, t), t)
        self._leaves = [serialization.tensor_bytes(x) for x in structure.flatten(internal, t)]

    def __iter__(self) -> Iterator[Any]:
        return self.layout.parts(connection_lib.Body(raw) for raw in self._leaves)

    def release(self) -> None:
        """Drops the views of the value (an HTTP response may keep its request a while)."""
        self._leaves = []


class LocalRounds:
    """Runs every round on clients simulated in this process, through the real task path.

    Each client's contribution is built by `execution.run_plan_parts` from a plan that was
    signed and verified, then checked and folded by `folding.Folder`, exactly as the
    server would; the inputs of secure aggregations go through the SecAgg+ protocol
    (`fedlang.deploy.secagg`), so only their sum is ever unmasked. It is the deployment
    path without the network: for trying a deployment on one machine and for checking it
    against the simulation runtime.

    A round with client state gives each client its own state (kept here per client
    id, as each device keeps its own) and keeps a contributor's new state once its
    report is folded; a client that did not contribute keeps its old state. `clients`
    may be replaced between rounds (a cohort per round): states stay with the ids.

    Args:
      clients: client id -> that client's datasets by name.
      secagg_threshold, secagg_degree: the secure aggregation's threshold and neighbour
        degree (default: the protocol's defaults for the cohort).
    """

    def __init__(
        self,
        clients: Mapping[str, Mapping[str, Any]],
        secagg_threshold: int | None = None,
        secagg_degree: int | None = None,
    ):
        self.clients = dict(clients)
        self.secagg_threshold, self.secagg_degree = secagg_threshold, secagg_degree
        self._key = signing.generate_key()
        self.states: dict[str, dict[str, Any]] = {}

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> RoundResult:
        start = time.perf_counter()
        signed = signing.sign(plan.to_bytes(), self._key)
        # Verified and loaded once per round (as each real client does once), so the
        # clients simulated here share its compiled programs.
        verified = execution.load_plan(signed, self._key.public_key())
        folder = folding.Folder(plan)
        aggregate = folder.empty()
        sp = plan.state
        parts = {
            cid: execution.run_plan_parts(
                verified, broadcast, data,
                state=None if sp is None else self.states.get(cid, {}).get(sp.name))
            for cid, data in self.clients.items()
        }
        contributors = list(parts)
        details: dict[str, Any] = {}
        if plan.secure:
            secure = secagg.run_round(
                {cid: p.secure for cid, p in parts.items()},
                plan.secure_segments(len(parts)),
                threshold=self.secagg_threshold,
                degree=self.secagg_degree,
            )
            contributors = list(secure.survivors)  # their masked inputs are in the sum
            details = {"secagg_degree": secure.degree, "secagg_threshold": secure.threshold}
            aggregate = folder.fold_secure(aggregate, secure.sum, len(contributors))
        for cid in contributors:
            report = folder.check(parts[cid].report)
            folder.check_bounds(report)
            aggregate = folder.fold(aggregate, report)
            if sp is not None and sp.writes:
                self.states.setdefault(cid, {})[sp.name] = parts[cid].state
        return RoundResult(aggregate, len(contributors), time.perf_counter() - start, details)


COLLECT_BYTES = 64 << 20  # round values let go of before a collection is worth its ~50 ms


class _DeploymentRun(simulation.Run):
    """The simulation runtime's evaluation, with each wave run as a round on clients."""

    def __init__(self, ctx: DeploymentContext):
        super().__init__(ctx, None)  # type: ignore[arg-type]
        self.deployment = ctx
        # (the aggregation "writing" the new client states, the state it writes)
        self.state_write: tuple[simulation.AggThunk, compiler.StateSource] | None = None

    def compute_wave(self, wave: list[simulation.AggThunk]) -> list[Any]:
        self.deployment._collect_garbage()
        round_plan, broadcast = compiler.build(wave, self.state_write, self.deployment.bounds)
        write = self.state_write[0] if self.state_write is not None else None
        if write is not None and write not in wave and not write.done and round_plan.state:
            raise compiler.DeploymentError(
                "A round reads the client state but another round would write its new "
                "values (they depend on a value the server computes after this round), and "
                "each round runs on its own clients. Compute the new states in the client "
                "work whose results this round aggregates."
            )
        result, reuse = self.deployment._run_round(round_plan, broadcast)
        del broadcast
        # The aggregate (or the results made as it streamed in) is read once, here; kept
        # in `rounds` it would hold a model-sized value for each round run.
        aggregate, made = result.aggregate, result.results
        self.deployment.rounds.append(dataclasses.replace(result, aggregate=b"", results=None))
        reports = result.reports
        del result
        if made is not None:
            results = list(made)
            self.deployment._garbage += _nbytes(results)
        else:
            self.deployment._garbage += len(aggregate)
            results = folding.results_sliced(folding.Folder(round_plan), aggregate, reuse=reuse)
        del aggregate, made  # (reused: the results' memory now)
        for i, a in enumerate(wave):
            if self.state_write is not None and a is self.state_write[0]:
                results.insert(i, reports)  # the states stayed on the clients
        return results


class DeploymentContext:
    """Runs computations with their client work on real clients (see the module docstring).

    `rounds` holds what each round returned (`RoundResult`: reports, seconds, details),
    its aggregate released once the round's results were made from it.

    Args:
      runner: how rounds run (`rounds.ServerRounds` against a server, or `LocalRounds`).
      browser: for populations with browser clients, `(plan, broadcast) -> plan` adding
        what browsers run to each round's plan (`fedlang.deploy.browser.BrowserTasks`,
        which also runs the preflight); None for Python clients only.
      bounds: what one client's report may hold, declared in each round's plan and
        checked by the server for every report (`plans.bounds.ReportBounds`: weights
        and counts within `max_examples_per_client`, the model update's L2 norm within
        `clip` per unit of weight, explicit ranges and norms; the default declares the
        defaults for the learning algorithms; None declares no bounds).
    """

    name = "deployment"

    def __init__(self, runner: RoundRunner,
                 browser: Callable[[plan_lib.RoundPlan, bytes], plan_lib.RoundPlan] | None = None,
                 bounds: bounds_lib.ReportBounds | None = bounds_lib.DEFAULT):
        self.runner = runner
        self.browser = browser
        self.bounds = bounds
        self.rounds: list[RoundResult] = []
        self._garbage = 0  # bytes of round values let go since the last collection
        self._entered: list[Any] = []

    def __enter__(self) -> DeploymentContext:
        """`with ctx:` runs computations called in the body on the clients."""
        entered = core_context.with_context(self)
        entered.__enter__()
        self._entered.append(entered)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._entered.pop().__exit__(*exc)
        self.close()

    def close(self) -> None:
        """Releases the runner's connections (a server's clients keep their tasks)."""
        close = getattr(self.runner, "close", None)
        if close is not None:
            close()

    def _run_round(self, plan: plan_lib.RoundPlan, broadcast: Any) -> tuple[RoundResult, bool]:
        """Runs a round of `plan` with `broadcast` (internal form) on the runner; returns
        its result and whether its aggregate is the caller's to overwrite. A runner that
        streams (`StreamingRoundRunner`) is sent the broadcast from the arrays' memory,
        unless browsers need its bytes or its type is not dense tensors."""
        t = plan.broadcast_type
        if self.browser is None and isinstance(self.runner, StreamingRoundRunner):
            try:
                parts = FrameParts(broadcast, t)
            except TypeError:
                pass  # not a model's tensors: small enough to send as bytes
            else:
                try:
                    result = self.runner.run_round_parts(plan, parts)
                    return result, isinstance(result.aggregate, bytearray)
                finally:
                    parts.release()
                    self._garbage += parts.size
        broadcast_bytes = serialization.serialize_value(structure.to_python(broadcast, t), t)
        if self.browser is not None:
            plan = self.browser(plan, broadcast_bytes)
        self._garbage += len(broadcast_bytes)
        return self.runner.run_round(plan, broadcast_bytes), False

    def _collect_garbage(self) -> None:
        """Collects cyclic garbage once rounds let go of `COLLECT_BYTES` or more: the
        last invocation's lazy graph (whose aggregation thunks refer to themselves) holds
        its arguments and results, a model's old weights and update among them, and an
        HTTP response refers to its request. The collector counts objects, not bytes: a
        few model-sized arrays would wait for it until rounds later."""
        if self._garbage >= COLLECT_BYTES:
            self._garbage = 0
            gc.collect()

    @staticmethod
    def refuse(d: intrinsics.IntrinsicDef, fn_type: types.FunctionType) -> str | None:
        """Why the deployment runtime cannot run an intrinsic (None when it can)."""
        if d.uri in accumulate.AGGREGATIONS or d.uri in _RUNS_AS_IN_SIMULATION:
            return None
        if d.kind is intrinsics.Kind.SEQUENCE:
            if _at_clients(fn_type):
                return None  # inside client work: it runs on the client
            return "the server holds no datasets; reduce client datasets in client work."
        if _at_clients(fn_type):
            return "it has no client-side implementation in a deployment."
        return None

    def invoke(self, comp: Any, arg: Any) -> Any:
        reference.check_runtime_supports(self, comp)
        self._collect_garbage()  # the last invocation's, before this one's values are made
        t = comp.type_signature
        spec = client_state_lib.spec_of(comp)
        ref = _state_ref(comp, arg, spec)
        returned = t.result
        if ref is not None:
            assert spec is not None
            returned = types.StructType(
                [e for i, e in enumerate(cast(types.StructType, t.result).elements)
                 if i != spec.result])
        if types.contains_federated(returned) and _places_at_clients(returned):
            raise compiler.DeploymentError(
                f"{comp.name} returns {t.result}; a value placed at CLIENTS cannot be returned "
                "from real clients. Aggregate it before returning it"
                + (" (or declare client state with fl.with_client_state and pass "
                   "fedlang.deploy.client_state(name) for it)." if ref is None else ".")
            )
        run = _DeploymentRun(self)
        sources: list[compiler.StateSource] = []
        internal = _to_lazy(arg, t.parameter, "", spec, sources)
        node = comp.to_ir()
        fn = run.eval(node, {}) if hasattr(node, "parameter_name") else node.computation
        result = run.call(fn, internal)
        if ref is None:
            return reference.to_python(_force(result), t.result)
        assert spec is not None
        result_t = cast(types.StructType, t.result)
        # Shallow: forcing the other fields now would run their rounds without the write.
        fields = list(result.get() if isinstance(result, lazy.Thunk) else result)
        write = simulation.AggThunk(run, fields[spec.result], _no_accumulator)
        run.state_write = (write, sources[0])
        fields[spec.result] = write
        forced = list(_force(tuple(fields)))
        forced[spec.result] = []  # the new states stayed on the devices
        out = reference.to_python(tuple(forced), result_t)
        return client_state_lib.replace_result(out, result_t, spec.result, ref)


def _nbytes(value: Any) -> int:
    """The bytes of the arrays in a value (internal form: nested tuples of arrays)."""
    if isinstance(value, tuple | list):
        return sum(_nbytes(v) for v in value)
    return int(getattr(value, "nbytes", 0))


def _no_accumulator() -> Any:
    raise AssertionError("a deployment's state write runs on the devices, never here")


def _state_ref(
    comp: Any, arg: Any, spec: client_state_lib.ClientStateSpec | None
) -> ClientStateRef | None:
    """The `client_state(name)` passed for `comp`'s declared state parameter, or None."""
    if spec is None:
        return None
    value = arg if len(comp.parameter_names) <= 1 else (
        arg[spec.parameter] if isinstance(arg, tuple | list) else None)
    return value if isinstance(value, ClientStateRef) else None


# Intrinsics the simulation runtime's strategies already run as the deployment needs:
# they only build the client task's dataflow (or run at the server).
_RUNS_AS_IN_SIMULATION = {
    intrinsic_defs.FEDERATED_BROADCAST.uri,
    intrinsic_defs.FEDERATED_VALUE_AT_CLIENTS.uri,
    intrinsic_defs.FEDERATED_VALUE_AT_SERVER.uri,
    intrinsic_defs.FEDERATED_MAP.uri,
    intrinsic_defs.FEDERATED_ZIP.uri,
    intrinsic_defs.FEDERATED_EVAL_AT_CLIENTS.uri,
    intrinsic_defs.FEDERATED_EVAL_AT_SERVER.uri,
}


def _at_clients(fn_type: types.FunctionType) -> bool:
    return _places_at_clients(fn_type.result) or (
        fn_type.parameter is not None and _places_at_clients(fn_type.parameter)
    )


def _places_at_clients(t: types.Type) -> bool:
    if isinstance(t, types.FederatedType):
        return t.placement is CLIENTS
    if isinstance(t, types.StructType):
        return any(_places_at_clients(x) for x in t.types)
    return False


def _to_lazy(
    value: Any,
    t: types.Type | None,
    path: str,
    spec: client_state_lib.ClientStateSpec | None = None,
    sources: list[compiler.StateSource] | None = None,
) -> Any:
    """The driver's argument in the lazy form: CLIENTS data become `DataSource`s, a
    `client_state(name)` a `StateSource` (recorded in `sources`)."""
    if t is None:
        return None
    if isinstance(t, types.FederatedType) and t.placement is CLIENTS:
        if t.all_equal:
            return lazy.Replicated(structure.to_internal(value, t.member, path), t.member)
        if isinstance(value, ClientStateRef):
            if spec is None or not (spec.state_type.is_assignable_from(t.member)
                                    and t.member.is_assignable_from(spec.state_type)):
                raise compiler.DeploymentError(
                    f"{path or 'The argument'} of type {t} was given client_state("
                    f"{value.name!r}); client state is passed for the state parameter of a "
                    "computation declared with fl.with_client_state (which gives the initial "
                    "state of a client seen for the first time)."
                )
            source = compiler.StateSource(value.name, t.member, spec.initialize)
            if sources is not None:
                sources.append(source)
            return source
        if not isinstance(value, ClientDataRef):
            raise compiler.DeploymentError(
                f"Expected {path or 'the argument'} of type {t} to be "
                "fedlang.deploy.client_data(name), a reference to each client's own data "
                "(or fedlang.deploy.client_state(name) for client state), found "
                f"{types.describe(value)}. Real clients hold their data and state; the "
                "driver cannot pass them."
            )
        return compiler.DataSource(value.name, t.member)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(
            _to_lazy(v, et, f"{path}{structure.field_path(n, i)}", spec, sources)
            for i, (n, et, v) in enumerate(structure.match_fields(value, t, path))
        )
    return reference.to_internal(value, t, None, path)


def _force(value: Any) -> Any:
    value = lazy.force(value)
    if isinstance(value, tuple):
        return tuple(_force(v) for v in value)
    return value


def local_deployment(clients: Mapping[str, Mapping[str, Any]]) -> Callable[[], DeploymentContext]:
    """A factory of deployment contexts whose rounds run `clients` in this process."""
    return lambda: DeploymentContext(LocalRounds(clients))
