"""The learning process and the four parts it is composed of.

A learning algorithm is `LearningProcess`: `initialize() -> state` and
`next(state, client_data) -> LearningProcessOutput(state, metrics)`, plus Python
helpers to read and write the model weights and hyperparameters in a state. It is
composed (see `composers.compose_learning_process`) of four `MeasuredProcess`es and
one federated computation, each replaceable:

* a distributor (`DistributionProcess`): server weights -> weights at the clients;
* client work (`ClientWorkProcess`): weights and client data -> `ClientResult`s;
* a model aggregator (`fedlang.aggregators`): client updates -> one server update;
* a finalizer (`FinalizerProcess`): server weights and the update -> new weights;
* a non-trainable update (`fedlang.learning.non_trainable`): the clients' reported
  non-trainable weights (BatchNorm statistics) -> the server's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

from fedlang.core import computation, processes, tracing
from fedlang.learning import metrics as metrics_lib
from fedlang.learning import optimizers
from fedlang.learning.models import model as model_lib

# Names for what the processes and their parts pass around, for the reader.

# The state of a process, or of one of its parts, at the server: a pytree of arrays.
ServerState = Any
# A client's own state, kept across rounds (SCAFFOLD's control variate, Ditto's
# personal model, FedPer's local layers).
ClientState = Any
# Values inside a federated computation being traced (`tracing.Value`s), placed at the
# server or at the clients: what the parts' federated computations take and return.
ServerValue = tracing.Value
ClientValue = tracing.Value
# What one client's JAX function returns: a dict with the `update`, `update_weight`,
# `non_trainable` of its `ClientResult`, its metric statistics and diagnostics
# (`client_works.client_output`), and whatever the client work adds.
ClientOutput = dict[str, Any]


class ClientResult(NamedTuple):
    """What one client's work produces for aggregation.

    Attributes:
      update: the model update (for model-delta algorithms, initial minus final
        trainable weights: it points like a gradient).
      update_weight: the client's weight in a weighted aggregation (a float32 scalar).
      non_trainable: the client's final floating non-trainable weights (such as
        BatchNorm statistics) as a list, averaged with the update weights by the
        composer; `[]` for models without them.
    """

    update: optimizers.Updates
    update_weight: Any
    non_trainable: model_lib.Params = ()


class StatefulClientResult(NamedTuple):
    """A `ClientResult` of client work whose clients keep state across rounds.

    Attributes:
      update, update_weight, non_trainable: as in `ClientResult`.
      client_state: the client's new state (SCAFFOLD's control variate, Ditto's
        personal model, FedPer's local layers); it stays with the client.
    """

    update: optimizers.Updates
    update_weight: Any
    non_trainable: model_lib.Params
    client_state: ClientState


class LearningAlgorithmState(NamedTuple):
    """The server state of a composed learning process: one pytree, one checkpoint."""

    global_model_weights: Any  # ModelWeights' values (k-means': the centroids)
    distributor: ServerState
    client_work: ServerState
    aggregator: ServerState
    finalizer: ServerState


class LearningProcessOutput(NamedTuple):
    """`process.next(...)` returns the new state and this round's metrics (a nested dict)."""

    state: ServerState
    metrics: metrics_lib.MetricValues


class StatefulLearningProcessOutput(NamedTuple):
    """What `next(state, client_data, client_states)` of a process with client state
    returns: the new state, this round's metrics, and the cohort's new client states
    (a list when `client_states` was a list; the binding, committed, when it was one)."""

    state: ServerState
    metrics: metrics_lib.MetricValues
    client_states: Any


def _no_hparams(state: ServerState) -> optimizers.Hparams:
    del state
    return {}


def _set_no_hparams(state: ServerState, hparams: optimizers.Hparams) -> ServerState:
    del hparams
    return state


class _PartProcess(processes.MeasuredProcess):
    """A measured process with optional `get_hparams(state)` / `set_hparams(state, h)`."""

    def __init__(
        self,
        initialize_fn: computation.Computation,
        next_fn: computation.Computation,
        get_hparams_fn: Callable[[ServerState], optimizers.Hparams] | None = None,
        set_hparams_fn: Callable[[ServerState, optimizers.Hparams], ServerState] | None = None,
    ):
        super().__init__(initialize_fn, next_fn)
        self.get_hparams = get_hparams_fn or _no_hparams
        self.set_hparams = set_hparams_fn or _set_no_hparams


class DistributionProcess(_PartProcess):
    """`next(state, weights@SERVER) -> MeasuredProcessOutput(state, weights@CLIENTS, m)`."""


class ClientWorkProcess(_PartProcess):
    """`next(state, weights@CLIENTS, data@CLIENTS) -> MeasuredProcessOutput(state,
    {ClientResult}@CLIENTS, metrics@SERVER)`.

    Client work whose clients keep state across rounds takes the cohort's states too,
    `next(state, weights@CLIENTS, data@CLIENTS, {S}@CLIENTS)`, returns
    `{StatefulClientResult}@CLIENTS` (whose `client_state` is each client's new state),
    and gives `initial_client_state`, a local computation `( -> S)`: the state of a
    client seen for the first time. A process composed with it keeps client state.

    Client work built by `client_works.build_client_work_process` also carries its
    client side on its own, which buffered (asynchronous) processes run one client at
    a time (`fedlang.learning.buffered`):

    * `client_fn(weights, client_state, dataset) -> output`: the JAX function each
      client runs (an `output` dict holds `update`, `update_weight`,
      `non_trainable`, and the client's metric statistics);
    * `measure(outputs@CLIENTS) -> metrics@SERVER`: traced inside a federated
      computation, the metrics of a group of clients' outputs.

    Both are None for client work that does not provide them.
    """

    def __init__(
        self,
        initialize_fn: computation.Computation,
        next_fn: computation.Computation,
        get_hparams_fn: Callable[[ServerState], optimizers.Hparams] | None = None,
        set_hparams_fn: Callable[[ServerState, optimizers.Hparams], ServerState] | None = None,
        *,
        client_fn: Callable[[model_lib.ModelWeights, ServerState, Any], ClientOutput] | None = None,
        measure: Callable[[ClientValue], ServerValue] | None = None,
        initial_client_state: computation.Computation | None = None,
    ):
        super().__init__(initialize_fn, next_fn, get_hparams_fn, set_hparams_fn)
        self.client_fn = client_fn
        self.measure = measure
        self.initial_client_state = initial_client_state


class FinalizerProcess(_PartProcess):
    """`next(state, weights@SERVER, update@SERVER) -> MeasuredProcessOutput(state,
    new_weights@SERVER, m)`."""


class LearningProcess(processes.IterativeProcess):
    """An iterative process that trains (or evaluates) a model.

    `initialize()` returns the state (a pytree); `next(state, client_data)` takes one
    entry per client (any iterable of batches) and returns
    `LearningProcessOutput(state, metrics)`. A process whose clients keep state
    (`client_state` is not None) takes their states too, `next(state, client_data,
    client_states)`, and returns `StatefulLearningProcessOutput(state, metrics,
    client_states)` (see `fedlang.with_client_state`). The helpers run in Python on a
    state:

    * `get_model_weights(state) -> ModelWeights`,
    * `set_model_weights(state, weights) -> state`,
    * `get_hparams(state) -> dict`, `set_hparams(state, hparams) -> state`.
    """

    def __init__(
        self,
        initialize_fn: computation.Computation,
        next_fn: computation.Computation,
        get_model_weights: Callable[[ServerState], model_lib.ModelWeights],
        set_model_weights: Callable[[ServerState, Any], ServerState],
        get_hparams: Callable[[ServerState], optimizers.Hparams] = _no_hparams,
        set_hparams: Callable[[ServerState, optimizers.Hparams], ServerState] = _set_no_hparams,
    ):
        super().__init__(initialize_fn, next_fn)
        self.get_model_weights = get_model_weights
        self.set_model_weights = set_model_weights
        self.get_hparams = get_hparams
        self.set_hparams = set_hparams

    def __repr__(self) -> str:
        return (
            f"LearningProcess(initialize: {self.initialize.type_signature}, "
            f"next: {self.next.type_signature})"
        )
