"""Deployment: real clients pull their work from a task store; secure aggregation.

The package is grouped by role (see docs/architecture.md): `protocol` (the wire
contract), `plans/` (what a client runs), `store/` (durable state), `server/` (HTTP),
`client/` (a device), `driver/` (the training side), `secagg/` and `browser/`.

The same computations that run in simulation run on real clients: the deployment
runtime (`DeploymentContext`) turns each wave of aggregations into a round, clients run
the round's task on their own data (`client_data("train")`) and report pre-aggregated
partials that the server folds. Client state (`fl.with_client_state`) is bound by name
(`client_state("c_i")`) and stays on each device. See docs/deploy.md.

Buffered asynchronous sessions (FedBuff) run a buffered learning process on the same
clients: `BufferedDriver` publishes model versions and folds the reports clients send
for them (`BufferedPlan` is the task they run).

The task store's server (`Server`), its clients (`Client`) and the driver's transport
(`ServerRounds`, `deployment_context`, `BufferedDriver`) need the `deploy` extra (FastAPI, uvicorn,
httpx); they are imported on first use, so the rest works without it.

Operators watch a deployment through the server (docs/deploy.md, "Watching a
deployment"); a driver releases each round's metrics there (`release_metrics`,
`ServerMetricsWriter` for the experiment driver, `ServerRounds.release_metrics`).
"""

import importlib as _importlib
from typing import Any as _Any

from fedlang.deploy import secagg as secagg
from fedlang.deploy.driver.context import ClientDataRef as ClientDataRef
from fedlang.deploy.driver.context import ClientStateRef as ClientStateRef
from fedlang.deploy.driver.context import DeploymentContext as DeploymentContext
from fedlang.deploy.driver.context import LocalRounds as LocalRounds
from fedlang.deploy.driver.context import RoundResult as RoundResult
from fedlang.deploy.driver.context import client_data as client_data
from fedlang.deploy.driver.context import client_state as client_state
from fedlang.deploy.plans.bounds import ReportBounds as ReportBounds
from fedlang.deploy.plans.bounds import UnboundedLeaf as UnboundedLeaf
from fedlang.deploy.plans.compiler import DeploymentError as DeploymentError
from fedlang.deploy.plans.folding import Folder as Folder
from fedlang.deploy.plans.folding import ReportError as ReportError
from fedlang.deploy.plans.round import RoundPlan as RoundPlan
from fedlang.deploy.secagg import SecAggClient as SecAggClient
from fedlang.deploy.secagg import SecAggError as SecAggError
from fedlang.deploy.secagg import SecAggServer as SecAggServer

_LAZY = {
    "Server": "server.serve",
    "Limits": "server.serve",
    "Client": "client.client",
    "ServerRounds": "driver.rounds",
    "Admin": "driver.admin",
    "RoundFailedError": "driver.rounds",
    "ServerUnavailable": "client.connection",
    "deployment_context": "driver.rounds",
    "CohortOptions": "store.rounds",
    "Pace": "store.store",
    "BufferedDriver": "driver.buffered",
    "BufferedPlan": "plans.buffered",
    "release_metrics": "driver.metrics",
    "ServerMetricsWriter": "driver.metrics",
}


def __getattr__(name: str) -> _Any:
    if name in _LAZY:
        value = getattr(_importlib.import_module(f"fedlang.deploy.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'fedlang.deploy' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
