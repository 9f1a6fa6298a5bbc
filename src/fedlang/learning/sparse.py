"""FedAvg over a large table where each client downloads and uploads only its rows.

A model with a large embedding or linear table (`table[num_rows, row_dim]`, e.g. a
bag-of-words classifier over a 1,000,000-word vocabulary) plus small dense parameters
(e.g. a bias). Each client brings the ids of the rows it uses (`keys int32[K]`) and
its dataset, whose features refer to *local* row positions `0..K-1` (position `j`
is row `keys[j]`). A round:

1. distributor: `federated_select` sends each client the rows of its keys, gathered
   into a local `float32[K, row_dim]` block; the dense parameters are broadcast;
2. client work: SGD on the local rows and dense parameters over the client's dataset
   (`ds.reduce(..., masked=True)`); the rows' update is a `SparseTensor` with global
   indices: only the client's rows are uploaded;
3. aggregation: the row updates are averaged per row (see `row_mean` below), the dense
   updates with `federated_mean`;
4. server update: `table[rows] += server_lr * mean_update` (a scatter-add).

Client memory and upload are O(K * row_dim), independent of `num_rows`.

`row_mean` chooses the semantics of the table's mean:

* `"touched"` (`federated_sparse_mean`): each row's update is averaged over the
  clients that touched it; a rare word seen by one client moves as much as a common
  one. Rows no client touched stay unchanged.
* `"all"` (`federated_sparse_sum(keep_sparse=True)` divided by the number of clients):
  averaged over all clients of the round (untouched counts as a zero update), exactly
  the unweighted dense FedAvg of the same model.

Keys must be exactly `K` per client (all clients the same length, so the simulation
runtime can vectorize); `pad_keys` pads a shorter list by repeating its last key,
which the client never references, so those rows receive a zero update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedlang.backends.jax import computation as jc
from fedlang.core import computation, processes, sparse, tracing, types
from fedlang.core import operators as ops
from fedlang.learning.models import model as model_lib

_ROW_MEANS = ("touched", "all")

# `loss_fn(rows[K, D], dense, batch) -> float32[b]`: per-example losses of a batch whose
# features refer to local row positions.
RowsLoss = Callable[[jax.Array, model_lib.Params, model_lib.Batch], jax.Array]


class SparseModelWeights(NamedTuple):
    """The server state: the large `table[num_rows, row_dim]` and small `dense` params."""

    table: Any  # float32[num_rows, row_dim] (or, in a type spec, its type)
    dense: model_lib.Params


def pad_keys(keys: Any, rows_per_client: int) -> np.ndarray:
    """A client's distinct row ids as `int32[rows_per_client]`, padded with its last key.

    Args:
      keys: the distinct ids (at least one, at most `rows_per_client`).
      rows_per_client: `K`, the number of rows every client downloads and uploads.

    Raises:
      ValueError: when there are no keys or more than `rows_per_client`.
    """
    keys = np.asarray(keys, np.int32).reshape(-1)
    if not 0 < len(keys) <= rows_per_client:
        raise ValueError(
            f"Expected between 1 and rows_per_client={rows_per_client} keys, found {len(keys)}. "
            "Raise rows_per_client or split the client's vocabulary."
        )
    return np.concatenate([keys, np.full(rows_per_client - len(keys), keys[-1], np.int32)])


def bag_of_words_loss(
    rows: jax.Array, dense: model_lib.Params, batch: model_lib.Batch
) -> jax.Array:
    """Per-example softmax cross-entropy of a linear bag-of-words classifier.

    `batch` holds `ids int32[b, L]` (local row positions), `counts float32[b, L]` (0 for
    padding) and `y int32[b]`; logits are `sum_l counts[:, l] * rows[ids[:, l]] + dense`.
    """
    logits = bag_of_words_logits(rows, dense, batch)
    logp = jax.nn.log_softmax(logits)
    return -jnp.take_along_axis(logp, batch["y"][:, None], axis=1)[:, 0]


def bag_of_words_logits(
    rows: jax.Array, dense: model_lib.Params, batch: model_lib.Batch
) -> jax.Array:
    """`sum_l counts[:, l] * rows[ids[:, l]] + dense`: logits[b, row_dim]."""
    return jnp.einsum("bl,bld->bd", batch["counts"], rows[batch["ids"]]) + dense


def build_row_distributor(num_rows: int, row_dim: int, rows_per_client: int) -> Callable:
    """Returns `distribute(table@SERVER, keys@CLIENTS) -> {float32[K, row_dim]}@CLIENTS`.

    Use inside a `federated_computation`: each client receives only the rows of its
    keys (through `federated_select`), gathered in key order.
    """
    table_t = types.TensorType(np.float32, [num_rows, row_dim])
    row_t = types.TensorType(np.float32, [row_dim])

    @jc.jax_computation(table_t, np.int32)
    def select_row(table: jax.Array, key: jax.Array) -> jax.Array:
        return table[key]

    @jc.jax_computation(types.SequenceType(row_t))
    def gather(rows: Any) -> Any:
        def step(state: tuple[jax.Array, jax.Array], row: jax.Array) -> tuple[jax.Array, jax.Array]:
            block, pos = state
            return block.at[pos].set(row), pos + 1

        init = (jnp.zeros((rows_per_client, row_dim), jnp.float32), jnp.int32(0))
        return rows.reduce(init, step)[0]

    def distribute(table: tracing.Value, keys: tracing.Value) -> tracing.Value:
        max_key = ops.federated_value(np.int32(num_rows), types.SERVER)
        return ops.federated_map(gather, ops.federated_select(keys, max_key, table, select_row))

    return distribute


def build_sparse_client_work(
    num_rows: int,
    row_dim: int,
    rows_per_client: int,
    dense_type: Any,
    element_type: Any,
    loss_fn: RowsLoss,
    client_lr: float,
) -> computation.Computation:
    """Local SGD on a client's rows: a `jax_computation` returning its sparse update.

    Type: `(<rows=float32[K,D],dense=Dd,keys=int32[K],data=sequence<E>> ->
    <rows=sparse<float32[N,D]>,dense=Dd,loss_sum=float32,num_examples=float32>)`.
    The rows' update (`new - old`) carries global indices `(keys[j], d)`.
    """
    rows_t = types.TensorType(np.float32, [rows_per_client, row_dim])
    keys_t = types.TensorType(np.int32, [rows_per_client])
    lr = np.float32(client_lr)

    def masked_loss(params: tuple[jax.Array, model_lib.Params], batch: model_lib.Batch,
                    mask: model_lib.Mask) -> tuple[jax.Array, jax.Array]:
        losses = loss_fn(params[0], params[1], batch)
        return jnp.sum(losses * mask) / jnp.maximum(jnp.sum(mask), 1.0), jnp.sum(losses * mask)

    @jc.jax_computation(rows_t, dense_type, keys_t, types.SequenceType(element_type))
    def client_update(rows: jax.Array, dense: model_lib.Params, keys: jax.Array,
                      data: Any) -> dict[str, Any]:
        def step(state: tuple[Any, jax.Array, jax.Array], batch: model_lib.Batch,
                 mask: model_lib.Mask) -> tuple[Any, jax.Array, jax.Array]:
            params, loss_sum, n = state
            grads, batch_loss = jax.grad(masked_loss, has_aux=True)(params, batch, mask)
            params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
            return params, loss_sum + batch_loss, n + jnp.sum(mask)

        init = ((rows, dense), jnp.float32(0), jnp.float32(0))
        (new_rows, new_dense), loss_sum, n = data.reduce(init, step, masked=True)
        k = rows_per_client
        indices = jnp.stack(
            [jnp.repeat(keys, row_dim), jnp.tile(jnp.arange(row_dim, dtype=keys.dtype), k)], 1
        )
        update = sparse.SparseTensor(indices, (new_rows - rows).reshape(-1), (num_rows, row_dim))
        dense_delta = jax.tree.map(lambda a, b: a - b, new_dense, dense)
        return {"rows": update, "dense": dense_delta, "loss_sum": loss_sum, "num_examples": n}

    return client_update


def build_sparse_fed_avg(
    num_rows: int,
    row_dim: int,
    rows_per_client: int,
    element_type: Any,
    *,
    loss_fn: RowsLoss = bag_of_words_loss,
    dense_init: model_lib.Params = None,
    table_init: Callable[[], Any] | None = None,
    client_lr: float = 0.1,
    server_lr: float = 1.0,
    row_mean: str = "touched",
) -> processes.IterativeProcess:
    """FedAvg of a `[num_rows, row_dim]` table where clients move only their rows.

    Args:
      num_rows: rows of the table (e.g. the vocabulary size).
      row_dim: columns of the table (e.g. the number of classes, or embedding size).
      rows_per_client: `K`, the fixed number of keys per client (see `pad_keys`).
      element_type: the type of one batch of a client's dataset.
      loss_fn: `loss_fn(rows[K, D], dense, batch) -> float32[b]` per-example
        losses, with batch features referring to local row positions.
      dense_init: the initial small dense parameters (default `zeros(row_dim)`, a bias).
      table_init: `() -> float32[num_rows, row_dim]` (default zeros), run at the server.
      client_lr: the clients' SGD learning rate.
      server_lr: the server's step on the averaged update.
      row_mean: `"touched"` (per-row mean over the clients that touched the row) or
        `"all"` (mean over all clients: the dense FedAvg); see the module docstring.

    Returns:
      An `IterativeProcess`: `initialize() -> SparseModelWeights@SERVER` and
      `next(state, client_keys {int32[K]}@CLIENTS, client_data {sequence<E>}@CLIENTS)
      -> <state, <loss, num_examples>@SERVER>`.

    Raises:
      ValueError: for an unknown `row_mean` or non-positive sizes.
    """
    if row_mean not in _ROW_MEANS:
        raise ValueError(f"Expected row_mean in {_ROW_MEANS}, found {row_mean!r}.")
    if min(num_rows, row_dim, rows_per_client) <= 0:
        raise ValueError(
            "Expected positive num_rows, row_dim and rows_per_client, found "
            f"{num_rows}, {row_dim}, {rows_per_client}."
        )
    dense0 = np.zeros(row_dim, np.float32) if dense_init is None else dense_init
    dense0 = jax.tree.map(lambda x: np.asarray(x, np.float32), dense0)
    dense_t = types.to_type(dense0)
    table_t = types.TensorType(np.float32, [num_rows, row_dim])
    state_t = types.to_type(SparseModelWeights(table_t, dense_t))
    rows_sparse_t = types.SparseTensorType(np.float32, [num_rows, row_dim])
    s_lr = np.float32(server_lr)

    @jc.jax_computation()
    def init_state() -> SparseModelWeights:
        table = jnp.zeros((num_rows, row_dim), jnp.float32) if table_init is None else table_init()
        return SparseModelWeights(jnp.asarray(table, jnp.float32), dense0)

    @jc.jax_computation(state_t, rows_sparse_t, dense_t, np.float32)
    def server_update(state: SparseModelWeights, rows: sparse.SparseTensor, dense: model_lib.Params,
                      scale: jax.Array) -> SparseModelWeights:
        idx = rows.indices
        table = state.table.at[idx[:, 0], idx[:, 1]].add(s_lr * scale * rows.values)
        new_dense = jax.tree.map(lambda p, d: p + s_lr * d, state.dense, dense)
        return SparseModelWeights(table, new_dense)

    @jc.jax_computation(np.float32, np.float32)
    def finish_metrics(loss_sum: jax.Array, n: jax.Array) -> dict[str, jax.Array]:
        return {"loss": loss_sum / jnp.maximum(n, 1.0), "num_examples": n}

    @jc.jax_computation(np.float32)
    def one(unused: jax.Array) -> jax.Array:
        del unused
        return jnp.float32(1)

    distribute = build_row_distributor(num_rows, row_dim, rows_per_client)
    client_update = build_sparse_client_work(
        num_rows, row_dim, rows_per_client, dense_t, element_type, loss_fn, client_lr
    )

    @tracing.federated_computation()
    def initialize() -> tracing.Value:
        return ops.federated_eval(init_state, types.SERVER)

    @tracing.federated_computation(
        types.FederatedType(state_t, types.SERVER),
        types.FederatedType(types.TensorType(np.int32, [rows_per_client]), types.CLIENTS),
        types.FederatedType(types.SequenceType(element_type), types.CLIENTS),
    )
    def next_fn(state: tracing.Value, client_keys: tracing.Value,
                client_data: tracing.Value) -> tuple[tracing.Value, tracing.Value]:
        rows = distribute(state.table, client_keys)
        dense = ops.federated_broadcast(state.dense)
        out = ops.federated_map(client_update, (rows, dense, client_keys, client_data))
        dense_mean = ops.federated_mean(out.dense)
        if row_mean == "touched":
            rows_mean = ops.federated_sparse_mean(out.rows)
            scale = ops.federated_value(np.float32(1), types.SERVER)
        else:
            rows_mean = ops.federated_sparse_sum(out.rows, keep_sparse=True)
            count = ops.federated_sum(ops.federated_map(one, out.loss_sum))
            scale = ops.federated_map(_reciprocal, count)
        new_state = ops.federated_map(server_update, (state, rows_mean, dense_mean, scale))
        metrics = ops.federated_map(
            finish_metrics, (ops.federated_sum(out.loss_sum), ops.federated_sum(out.num_examples))
        )
        return new_state, metrics

    return processes.IterativeProcess(initialize, next_fn)


@jc.jax_computation(np.float32)
def _reciprocal(x: jax.Array) -> jax.Array:
    return 1.0 / x
