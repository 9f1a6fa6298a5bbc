"""The deployment runtime: the user's ordinary driver loop, run against real clients.

`DeploymentContext` evaluates a federated computation exactly like the simulation
runtime (lazily, aggregations in waves) with one difference: a wave is not computed over
chunks of clients held in memory, it becomes a round on real clients. The wave's plan
(`plans.round.build`) and broadcast value go to a `RoundRunner` — the task store's server over
HTTP in production (`rounds.ServerRounds`), or `LocalRounds` to run clients in this
process — which returns the round's aggregate; the evaluation goes on with it. Server
work between waves (e.g. applying the server optimizer) runs here, in the driver.

Arguments placed at CLIENTS are references to the clients' own data by name
(`client_data("train")`); each client resolves the name to its local dataset.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Mapping
from typing import Any, Protocol

from fedlang.core import context as core_context
from fedlang.core import intrinsic_defs, intrinsics, serialization, signing, structure, types
from fedlang.deploy import secagg
from fedlang.deploy.plans import execution, folding
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
class RoundResult:
    """What a round returned: the aggregate (bytes, see `folding.Folder`) and counts."""

    aggregate: bytes
    reports: int
    seconds: float
    details: Mapping[str, Any] = dataclasses.field(default_factory=dict)


class RoundRunner(Protocol):
    """Runs one round on clients and returns its aggregate."""

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> RoundResult: ...


class LocalRounds:
    """Runs every round on clients simulated in this process, through the real task path.

    Each client's contribution is built by `execution.run_plan_parts` from a plan that was
    signed and verified, then checked and folded by `folding.Folder`, exactly as the
    server would; the inputs of secure aggregations go through the SecAgg+ protocol
    (`fedlang.deploy.secagg`), so only their sum is ever unmasked. It is the deployment
    path without the network: for trying a deployment on one machine and for checking it
    against the simulation runtime.

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

    def run_round(self, plan: plan_lib.RoundPlan, broadcast: bytes) -> RoundResult:
        start = time.perf_counter()
        signed = signing.sign(plan.to_bytes(), self._key)
        # Verified and loaded once per round (as each real client does once), so the
        # clients simulated here share its compiled programs.
        verified = execution.load_plan(signed, self._key.public_key())
        folder = folding.Folder(plan)
        aggregate = folder.empty()
        parts = {
            cid: execution.run_plan_parts(verified, broadcast, data)
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
            aggregate = folder.fold(aggregate, folder.check(parts[cid].report))
        return RoundResult(aggregate, len(contributors), time.perf_counter() - start, details)


class _DeploymentRun(simulation.Run):
    """The simulation runtime's evaluation, with each wave run as a round on clients."""

    def __init__(self, ctx: DeploymentContext):
        super().__init__(ctx, None)  # type: ignore[arg-type]
        self.deployment = ctx

    def compute_wave(self, wave: list[simulation.AggThunk]) -> list[Any]:
        round_plan, broadcast = plan_lib.build(wave)
        broadcast_bytes = serialization.serialize_value(
            structure.to_python(broadcast, round_plan.broadcast_type), round_plan.broadcast_type
        )
        if self.deployment.browser is not None:
            round_plan = self.deployment.browser(round_plan, broadcast_bytes)
        result = self.deployment.runner.run_round(round_plan, broadcast_bytes)
        self.deployment.rounds.append(result)
        return folding.Folder(round_plan).results(result.aggregate)


class DeploymentContext:
    """Runs computations with their client work on real clients (see the module docstring).

    Args:
      runner: how rounds run (`rounds.ServerRounds` against a server, or `LocalRounds`).
      browser: for populations with browser clients, `(plan, broadcast) -> plan` adding
        what browsers run to each round's plan (`fedlang.deploy.browser.BrowserTasks`,
        which also runs the preflight); None for Python clients only.
    """

    name = "deployment"

    def __init__(self, runner: RoundRunner,
                 browser: Callable[[plan_lib.RoundPlan, bytes], plan_lib.RoundPlan] | None = None):
        self.runner = runner
        self.browser = browser
        self.rounds: list[RoundResult] = []
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
        t = comp.type_signature
        if types.contains_federated(t.result) and _places_at_clients(t.result):
            raise plan_lib.DeploymentError(
                f"{comp.name} returns {t.result}; a value placed at CLIENTS cannot be returned "
                "from real clients. Aggregate it before returning it."
            )
        run = _DeploymentRun(self)
        internal = _to_lazy(arg, t.parameter, "")
        node = comp.to_ir()
        fn = run.eval(node, {}) if hasattr(node, "parameter_name") else node.computation
        result = run.call(fn, internal)
        return reference.to_python(_force(result), t.result)


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


def _to_lazy(value: Any, t: types.Type | None, path: str) -> Any:
    """The driver's argument in the lazy form: CLIENTS data become `DataSource`s."""
    if t is None:
        return None
    if isinstance(t, types.FederatedType) and t.placement is CLIENTS:
        if t.all_equal:
            return lazy.Replicated(structure.to_internal(value, t.member, path), t.member)
        if not isinstance(value, ClientDataRef):
            raise plan_lib.DeploymentError(
                f"Expected {path or 'the argument'} of type {t} to be "
                "fedlang.deploy.client_data(name), a reference to each client's own data, found "
                f"{types.describe(value)}. Real clients hold their data; the driver cannot pass it."
            )
        return plan_lib.DataSource(value.name, t.member)
    if isinstance(t, types.StructType) and types.contains_federated(t):
        return tuple(
            _to_lazy(v, et, f"{path}{structure.field_path(n, i)}")
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
