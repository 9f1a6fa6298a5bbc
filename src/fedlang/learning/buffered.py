"""Buffered asynchronous learning (FedBuff): the server steps whenever K reports arrived.

Nguyen et al., "Federated Learning with Buffered Asynchronous Aggregation" (AISTATS
2022). Clients train whenever they can, on the model version they downloaded; each
report is tagged with that version. The server folds reports one at a time into a
buffer of `K` (`buffer_size`) slots, down-weighting a stale one: its staleness is
`tau = server version - report version`, and its update is multiplied by
`staleness_weight(tau)` (default `1 / sqrt(1 + tau)`). A report staler than
`max_staleness` is refused and counted, leaving the buffer as it was. When the
buffer is full, `apply` aggregates its `K` reports with the model aggregator exactly
as it would aggregate a cohort of `K` clients (so DP and robust aggregators apply per
buffer), steps the server optimizer (the finalizer), bumps the version and empties
the buffer.

    client:  (weights, version) = client_model(state);  report = train(weights, data)
    server:  state = fold(state, report, version)
             if is_full(state): state, metrics = apply(state)

`train` is a local computation (no placements), so a deployment can ship it to a
client on its own; `fold`, `is_full`, `status` are plain Python on the state (a
pytree of NumPy arrays that checkpoints as one), and `apply` runs one federated
computation in the current context.

With no staleness (every report's version is the server's) and the same `K`
clients, one `apply` is one round of the synchronous process composed of the same
parts: FedBuff with concurrency `K` and no latency variance is FedAvg.

Secure aggregation cannot hide a report that the server holds on its own, and the
buffer is held by the server, so a secure aggregator is refused (see
`check_not_secure`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.aggregators import tools
from fedlang.backends.jax import computation as jax_backend
from fedlang.core import computation, intrinsics, ir, operators, tracing, types
from fedlang.core import processes as core_processes
from fedlang.learning import (
    composers,
    distributors,
    model_update_aggregator,
    non_trainable,
    templates,
)
from fedlang.learning import metrics as metrics_lib
from fedlang.learning.models import model as model_lib

StalenessWeight = Callable[[int], float]

# The largest max_staleness: the state holds a histogram of max_staleness + 1 counts.
MAX_STALENESS_LIMIT = 10_000


def polynomial_staleness(exponent: float = 0.5) -> StalenessWeight:
    """`tau -> (1 + tau) ** -exponent`; the default (0.5) is FedBuff's `1/sqrt(1+tau)`.

    Args:
      exponent: >= 0; 0 gives every report weight 1 (no down-weighting).

    Raises:
      ValueError: for a negative exponent.
    """
    if not exponent >= 0:
        raise ValueError(f"Expected a staleness exponent >= 0, found {exponent}.")

    def weight(tau: int) -> float:
        return float((1.0 + tau) ** -exponent)

    weight.__name__ = f"polynomial_staleness({exponent})"
    return weight


def default_staleness_weight(tau: int) -> float:
    """FedBuff's default staleness weight, `1 / sqrt(1 + tau)`."""
    return 1.0 / math.sqrt(1.0 + tau)


class BufferedState(NamedTuple):
    """The server state of a buffered process: one pytree of NumPy values.

    Attributes:
      model_weights: the server's `ModelWeights`.
      version: int64 scalar: the model version (server steps so far).
      aggregator, finalizer: those parts' states.
      buffer: a tuple of `K` reports (`report_type`); slots at and after
        `buffer_fill` hold zeros.
      buffer_staleness: int32[K], the staleness of each buffered report.
      buffer_weight: float32[K], the staleness weight applied to each report.
      buffer_fill: int32 scalar, how many slots hold reports.
      accepted: int64 scalar, reports folded into a buffer so far.
      refused_stale: int64 scalar, reports refused as staler than `max_staleness`.
      staleness_histogram: int64[max_staleness + 1], accepted reports by staleness.
    """

    model_weights: model_lib.ModelWeights
    version: Any
    aggregator: templates.ServerState
    finalizer: templates.ServerState
    buffer: tuple[templates.ClientOutput, ...]
    buffer_staleness: np.ndarray
    buffer_weight: np.ndarray
    buffer_fill: Any
    accepted: Any
    refused_stale: Any
    staleness_histogram: np.ndarray


class BufferedLearningProcess:
    """A buffered asynchronous learning process (FedBuff); see the module docstring.

    Attributes:
      buffer_size: K, the reports per server step.
      max_staleness: the largest staleness accepted.
      staleness_weight: `tau -> weight`.
      train: the local computation `(model_weights, dataset) -> report`.
      report_type: the type of a report (`train`'s result).
      model_weights_type: the type of the model weights (`train`'s first parameter).
      apply_fn: the federated computation behind `apply`: `(model_weights@SERVER,
        aggregator@SERVER, finalizer@SERVER, {report}@CLIENTS) -> <model_weights,
        aggregator, finalizer, metrics>@SERVER`.
    """

    def __init__(
        self,
        initialize_fn: Callable[[], BufferedState],
        train: computation.Computation,
        apply_fn: computation.Computation,
        *,
        buffer_size: int,
        max_staleness: int,
        staleness_weight: StalenessWeight,
    ):
        self._initialize_fn = initialize_fn
        self.train = train
        self.apply_fn = apply_fn
        self.buffer_size = buffer_size
        self.max_staleness = max_staleness
        self.staleness_weight = staleness_weight
        param = cast(types.StructType, train.type_signature.parameter)
        self.model_weights_type = param[0]
        self.report_type = train.type_signature.result
        self._empty_report = tools.zeros(self.report_type)
        self._report_leaves, self._report_tree = jax.tree.flatten(self._empty_report)

    def __repr__(self) -> str:
        return (
            f"BufferedLearningProcess(buffer_size={self.buffer_size}, "
            f"max_staleness={self.max_staleness}, train: {self.train.type_signature})"
        )

    # -- the server state ------------------------------------------------------------

    def initialize(self) -> BufferedState:
        """The initial server state: version 0, an empty buffer, zero counters."""
        return self._initialize_fn()

    def client_model(self, state: BufferedState) -> tuple[model_lib.ModelWeights, int]:
        """What a client downloads: the model weights and their version."""
        return model_lib.ModelWeights(*state.model_weights), int(state.version)

    def get_model_weights(self, state: BufferedState) -> model_lib.ModelWeights:
        """The server's model weights."""
        return model_lib.ModelWeights(*state.model_weights)

    def is_full(self, state: BufferedState) -> bool:
        """Whether the buffer holds K reports (time to `apply`)."""
        return int(state.buffer_fill) >= self.buffer_size

    def status(self, state: BufferedState) -> dict[str, Any]:
        """Plain Python: version, buffer fill, K, staleness histogram and counts."""
        hist = np.asarray(state.staleness_histogram)
        return {
            "version": int(state.version),
            "buffer_fill": int(state.buffer_fill),
            "buffer_size": self.buffer_size,
            "max_staleness": self.max_staleness,
            "accepted": int(state.accepted),
            "refused_stale": int(state.refused_stale),
            "staleness_histogram": {int(t): int(c) for t, c in enumerate(hist) if c},
        }

    # -- folding reports ---------------------------------------------------------------

    def check_report(self, report: Any) -> templates.ClientOutput:
        """`report` as NumPy leaves in `report_type`'s containers.

        Raises:
          TypeError: when its structure, a shape or a dtype differs from `report_type`.
        """
        leaves, tree = jax.tree.flatten(report)
        if tree != self._report_tree:  # type: ignore[operator]
            raise TypeError(
                f"Expected a report of type {self.report_type} (what `train` returns), found "
                f"a value of structure {tree}."
            )
        out = []
        for i, (x, want) in enumerate(zip(leaves, self._report_leaves, strict=True)):
            a = np.asarray(x)
            if a.shape != want.shape or a.dtype != want.dtype:
                raise TypeError(
                    f"Expected report leaf {i} to be {want.dtype}{list(want.shape)} (as in "
                    f"{self.report_type}), found {a.dtype}{list(a.shape)}."
                )
            out.append(a)
        return jax.tree.unflatten(tree, out)

    def fold(self, state: BufferedState, report: Any, version: int) -> BufferedState:
        """Folds one client's report, trained from model `version`, into the buffer.

        Pure: returns a new state and leaves `state` as it was. A report staler than
        `max_staleness` is refused: the new state differs only in `refused_stale`.

        Args:
          state: the server state.
          report: what `train` returned on the client.
          version: the version of the model the client trained from.

        Returns:
          The new state.

        Raises:
          ValueError: when the buffer is full (call `apply` first), when `version` is
            not an integer in [0, state version], or the staleness weight is not a
            finite number >= 0.
          TypeError: when `report` is not of `report_type`.
        """
        current = int(state.version)
        if isinstance(version, bool) or not isinstance(version, (int, np.integer)):
            raise ValueError(f"Expected the report's version to be an int, found {version!r}.")
        if not 0 <= int(version) <= current:
            raise ValueError(
                f"Expected the report's version in [0, {current}] (the server's version), "
                f"found {int(version)}: a report can only come from a model the server made."
            )
        if self.is_full(state):
            raise ValueError(
                f"The buffer is full ({self.buffer_size} reports): call apply(state) before "
                "folding another report."
            )
        report = self.check_report(report)
        tau = current - int(version)
        if tau > self.max_staleness:
            return state._replace(refused_stale=np.int64(int(state.refused_stale) + 1))
        weight = self.staleness_weight(tau)
        if not isinstance(weight, (int, float, np.number)) or not (
            math.isfinite(float(weight)) and float(weight) >= 0
        ):
            raise ValueError(
                f"Expected staleness_weight({tau}) to be a finite number >= 0, found {weight!r}."
            )
        w = np.float32(weight)
        if w != 1:  # bit for bit the report when the weight is 1 (no staleness)
            report = {**report, "update": jax.tree.map(lambda u: (u * w).astype(u.dtype),
                                                       report["update"])}
        slot = int(state.buffer_fill)
        buffer = tuple(report if i == slot else r for i, r in enumerate(state.buffer))
        staleness = np.array(state.buffer_staleness, copy=True)
        staleness[slot] = tau
        weights = np.array(state.buffer_weight, copy=True)
        weights[slot] = w
        hist = np.array(state.staleness_histogram, copy=True)
        hist[tau] += 1
        return state._replace(
            buffer=buffer, buffer_staleness=staleness, buffer_weight=weights,
            buffer_fill=np.int32(slot + 1), accepted=np.int64(int(state.accepted) + 1),
            staleness_histogram=hist,
        )

    # -- the server step ---------------------------------------------------------------

    def apply(self, state: BufferedState) -> tuple[BufferedState, metrics_lib.MetricValues]:
        """Aggregates the K buffered reports, steps the server model, empties the buffer.

        Returns:
          `(state, metrics)`: metrics hold the parts' measurements (`client_work`:
          the buffered clients' training metrics, `aggregator`, `finalizer`),
          `staleness` (mean, max of the buffer) and `counts` (version, accepted,
          refused_stale).

        Raises:
          ValueError: when the buffer is not full.
        """
        fill = int(state.buffer_fill)
        if fill < self.buffer_size:
            raise ValueError(
                f"Expected a full buffer ({self.buffer_size} reports) to apply, found {fill}; "
                "fold more reports first (is_full(state) says when)."
            )
        out = self.apply_fn(state.model_weights, state.aggregator, state.finalizer,
                            list(state.buffer))
        new_weights, agg_state, fin_state, metrics = out
        staleness = np.asarray(state.buffer_staleness)
        version = int(state.version) + 1
        metrics = dict(metrics)
        metrics["staleness"] = {
            "mean": float(staleness.mean()), "max": int(staleness.max()),
            "mean_weight": float(np.asarray(state.buffer_weight).mean()),
        }
        metrics["counts"] = {
            "version": version, "accepted": int(state.accepted),
            "refused_stale": int(state.refused_stale),
        }
        empty = self._empty_buffer()
        new_state = state._replace(
            model_weights=model_lib.ModelWeights(*new_weights), version=np.int64(version),
            aggregator=agg_state, finalizer=fin_state, buffer=empty[0],
            buffer_staleness=empty[1], buffer_weight=empty[2], buffer_fill=np.int32(0),
        )
        return new_state, metrics

    def _empty_buffer(self) -> tuple[tuple[templates.ClientOutput, ...], np.ndarray, np.ndarray]:
        k = self.buffer_size
        return ((self._empty_report,) * k, np.zeros(k, np.int32), np.zeros(k, np.float32))


def is_secure(aggregator: core_processes.AggregationProcess) -> bool:
    """Whether `aggregator.next` sums anything with a secure aggregation intrinsic."""
    return any(
        isinstance(node, ir.Intrinsic)
        and intrinsics.lookup(node.uri).kind is intrinsics.Kind.SECURE_AGGREGATE
        for node in ir.walk(aggregator.next.to_ir())
    )


def check_not_secure(aggregator: core_processes.AggregationProcess) -> None:
    """Refuses a secure aggregator for a buffered process.

    Raises:
      ValueError: saying why, and what to use instead.
    """
    if is_secure(aggregator):
        raise ValueError(
            "A buffered (FedBuff) process cannot use a secure aggregator: clients report one "
            "at a time, at different times, and the server holds each report in its buffer "
            "on its own, so there is no group of simultaneous clients for secure aggregation "
            "to hide a report in. Use a non-secure aggregator (the default mean, "
            "robust_aggregator(), or dp_aggregator(): DP noise is added per buffer of K "
            "reports), or a synchronous process (build_weighted_fed_avg) with "
            "secure_aggregator()."
        )


def _check_int(name: str, value: Any, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < lowest:
        raise ValueError(f"Expected {name} to be an int >= {lowest}, found {value!r}.")
    return int(value)


def compose_buffered_learning_process(
    initial_model_weights_fn: computation.Computation,
    client_work: templates.ClientWorkProcess,
    aggregator_factory: model_update_aggregator.AggregationFactory,
    finalizer: templates.FinalizerProcess,
    *,
    buffer_size: int,
    max_staleness: int,
    staleness_weight: StalenessWeight | None = None,
) -> BufferedLearningProcess:
    """Composes a `BufferedLearningProcess` (FedBuff) from a learning process's parts.

    Args:
      initial_model_weights_fn: a computation `( -> ModelWeights)` (local).
      client_work: a `ClientWorkProcess` carrying its client side (`client_fn` and
        `measure`, as `client_works.build_model_delta_client_work` makes). Its
        server state (client optimizer hyperparameters) is read once, here: every
        client trains with the initial client state.
      aggregator_factory: a weighted or unweighted aggregation factory for the updates
        (created for the update type, and the float32 weight); not a secure one.
      finalizer: a `FinalizerProcess` (the server optimizer).
      buffer_size: K >= 1, reports per server step.
      max_staleness: >= 0, the largest staleness accepted.
      staleness_weight: `tau -> weight >= 0`; default `1 / sqrt(1 + tau)`.

    Returns:
      A `BufferedLearningProcess`.

    Raises:
      TypeError: when a part has the wrong kind or its types do not fit.
      ValueError: for bad sizes, a non-callable staleness weight, or a secure
        aggregator.
    """
    k = _check_int("buffer_size", buffer_size, 1)
    max_tau = _check_int("max_staleness", max_staleness, 0)
    if max_tau > MAX_STALENESS_LIMIT:
        raise ValueError(
            f"Expected max_staleness <= {MAX_STALENESS_LIMIT} (the state keeps a histogram "
            f"with one count per staleness), found {max_tau}; {MAX_STALENESS_LIMIT} versions "
            "is as good as unbounded."
        )
    weight_fn = default_staleness_weight if staleness_weight is None else staleness_weight
    if not callable(weight_fn):
        raise ValueError(
            "Expected staleness_weight to be a function of the staleness (tau -> weight), "
            f"found {type(weight_fn).__name__}."
        )
    if not isinstance(client_work, templates.ClientWorkProcess):
        raise TypeError(
            f"Expected client_work to be a ClientWorkProcess, found {type(client_work).__name__}."
        )
    if client_work.client_fn is None or client_work.measure is None:
        raise TypeError(
            "Expected client_work to carry its client side (client_fn and measure), as "
            "client_works.build_client_work_process makes; this one does not, so a single "
            "client cannot run it on its own."
        )
    if not isinstance(finalizer, templates.FinalizerProcess):
        raise TypeError(
            f"Expected finalizer to be a FinalizerProcess, found {type(finalizer).__name__}."
        )
    weights_t = initial_model_weights_fn.type_signature.result
    update_t = cast(types.StructType, weights_t)["trainable"]
    aggregator = model_update_aggregator.create_aggregator(
        aggregator_factory, update_t, "aggregator_factory")
    check_not_secure(aggregator)
    distributor = distributors.build_broadcast_process(weights_t)
    result_t = composers.check_parts(weights_t, distributor, client_work, aggregator, finalizer)
    nt_t = result_t["non_trainable"] if "non_trainable" in result_t.names else types.StructType([])
    nt_update = non_trainable.build_weighted_mean_update(weights_t, nt_t)

    data_t = cast(types.StructType, client_work.next.type_signature.parameter)[2]
    data_t = data_t.member if isinstance(data_t, types.FederatedType) else data_t
    client_state = client_work.initialize()
    client_fn = client_work.client_fn
    measure = client_work.measure

    @jax_backend.jax_computation(weights_t, data_t)
    def train(model_weights, dataset):
        fixed = jax.tree.map(jnp.asarray, client_state)
        return client_fn(model_weights, fixed, dataset)

    report_t = train.type_signature.result
    agg_state_t = aggregator.initialize.type_signature.result
    fin_state_t = finalizer.initialize.type_signature.result

    @tracing.federated_computation(
        types.type_at_server(weights_t), agg_state_t, fin_state_t, types.type_at_clients(report_t)
    )
    def apply_fn(weights, agg_state, fin_state, reports):
        if aggregator.is_weighted:
            agg = aggregator.next(agg_state, reports.update, reports.update_weight)
        else:
            agg = aggregator.next(agg_state, reports.update)
        fin = finalizer.next(fin_state, weights, agg.result)
        new_weights = nt_update(fin.result, reports.non_trainable, reports.update_weight)
        metrics = operators.federated_zip({
            "client_work": measure(reports),
            "aggregator": agg.measurements,
            "finalizer": fin.measurements,
        })
        return new_weights, agg.state, fin.state, metrics

    @tracing.federated_computation()
    def initial_parts():
        return (operators.federated_eval(initial_model_weights_fn, types.SERVER),
                aggregator.initialize(), finalizer.initialize())

    empty = tools.zeros(report_t)

    def initialize() -> BufferedState:
        weights, agg_state, fin_state = initial_parts()
        return BufferedState(
            model_weights=model_lib.ModelWeights(*weights), version=np.int64(0),
            aggregator=agg_state, finalizer=fin_state, buffer=(empty,) * k,
            buffer_staleness=np.zeros(k, np.int32), buffer_weight=np.zeros(k, np.float32),
            buffer_fill=np.int32(0), accepted=np.int64(0), refused_stale=np.int64(0),
            staleness_histogram=np.zeros(max_tau + 1, np.int64),
        )

    return BufferedLearningProcess(
        initialize, train, apply_fn, buffer_size=k, max_staleness=max_tau,
        staleness_weight=weight_fn,
    )
