"""Sparse FedAvg (`fedlang.learning.sparse`) against a dense reference, on the runtime
sample (tests/conftest.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fedlang as fl
from fedlang.learning import sparse

pytestmark = pytest.mark.usefixtures("runtime")

V, D, K, L, B = 40, 3, 6, 4, 5
ELEMENT = fl.to_type(
    {
        "ids": fl.TensorType(np.int32, [None, L]),
        "counts": fl.TensorType(np.float32, [None, L]),
        "y": fl.TensorType(np.int32, [None]),
    }
)


def _problem(num_clients=4, seed=0):
    rng = np.random.default_rng(seed)
    keys, data = [], []
    for c in range(num_clients):
        n = int(rng.integers(2, K + 1))
        ks = np.sort(rng.choice(V // 2, n, replace=False))  # rows >= V/2: never touched
        keys.append(sparse.pad_keys(ks, K))
        data.append(
            [
                {
                    "ids": rng.integers(0, n, (B, L)).astype(np.int32),
                    "counts": rng.integers(0, 3, (B, L)).astype(np.float32),
                    "y": rng.integers(0, D, B).astype(np.int32),
                }
                for _ in range(1 + c % 2)
            ]
        )
    return keys, data


def _dense_reference(table, bias, keys, data, client_lr, row_mean):
    """FedAvg on the full table: each client trains all of it; rows averaged as specified."""

    def loss(params, batch):
        table, bias = params
        return jnp.mean(sparse.bag_of_words_loss(table, bias, batch))

    deltas, bias_deltas, touched = [], [], []
    for ks, batches in zip(keys, data):
        params = (jnp.asarray(table), jnp.asarray(bias))
        for b in batches:
            gb = dict(b, ids=np.asarray(ks)[b["ids"]])  # local positions -> global rows
            g = jax.grad(loss)(params, gb)
            params = jax.tree.map(lambda p, q: p - np.float32(client_lr) * q, params, g)
        deltas.append(np.asarray(params[0]) - table)
        bias_deltas.append(np.asarray(params[1]) - bias)
        mark = np.zeros(V, np.float32)
        mark[np.unique(ks)] = 1
        touched.append(mark)
    total = np.sum(deltas, axis=0)
    if row_mean == "touched":
        count = np.sum(touched, axis=0)[:, None]
        mean = np.where(count > 0, total / np.maximum(count, 1), 0)
    else:
        mean = total / len(keys)
    return table + mean, bias + np.mean(bias_deltas, axis=0)


@pytest.mark.parametrize("row_mean", ["touched", "all"])
def test_sparse_fed_avg_equals_dense_fed_avg(row_mean, request):
    if row_mean == "all" and request.node.callspec.params["runtime"] not in (
        "reference",
        "simulation",
    ):
        pytest.skip(
            "the 'all' mean differs from 'touched' only on the server: two runtimes suffice"
        )
    keys, data = _problem()
    process = sparse.build_sparse_fed_avg(
        V,
        D,
        K,
        ELEMENT,
        client_lr=0.3,
        row_mean=row_mean,
        table_init=lambda: jnp.arange(V * D, dtype=jnp.float32).reshape(V, D) / 100,
    )
    state = process.initialize()
    table0 = np.asarray(state.table)
    state, metrics = process.next(state, keys, data)
    want_table, want_bias = _dense_reference(
        table0, np.zeros(D, np.float32), keys, data, 0.3, row_mean
    )
    np.testing.assert_allclose(np.asarray(state.table), want_table, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.asarray(state.dense), want_bias, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(state.table)[V // 2 :], table0[V // 2 :])
    assert float(metrics["num_examples"]) == sum(B * len(d) for d in data)


def test_client_uploads_only_its_rows():
    keys, data = _problem(num_clients=1)
    work = sparse.build_sparse_client_work(
        V, D, K, fl.to_type(np.zeros(D, np.float32)), ELEMENT, sparse.bag_of_words_loss, 0.3
    )
    assert str(work.type_signature.result) == (
        f"<rows=sparse<float32[{V},{D}]>,dense=float32[{D}],loss_sum=float32,num_examples=float32>"
    )
    rows = np.ones((K, D), np.float32)
    out = work(rows, np.zeros(D, np.float32), keys[0], data[0])
    update = out["rows"]
    assert update.nnz == K * D
    assert set(np.asarray(update.indices)[:, 0].tolist()) == set(keys[0].tolist())


def test_pad_keys_and_bad_arguments():
    np.testing.assert_array_equal(sparse.pad_keys([3, 7], 4), [3, 7, 7, 7])
    with pytest.raises(ValueError, match="Expected between 1 and rows_per_client=2 keys, found 3"):
        sparse.pad_keys([1, 2, 3], 2)
    with pytest.raises(ValueError, match="Expected row_mean in"):
        sparse.build_sparse_fed_avg(V, D, K, ELEMENT, row_mean="some")


def test_sparse_batches_flow_through_a_reduce_without_densifying():
    vocab = 1_000_000
    element = fl.to_type(
        {"x": fl.SparseTensorType(np.float32, [4, vocab]), "y": fl.TensorType(np.int32, [4])}
    )

    @fl.jax_computation(fl.TensorType(np.float32, [8]), fl.SequenceType(element))
    def score(w, ds):
        def step(total, batch):
            x = batch["x"]  # hashed into 8 buckets: never a [vocab] array
            per_example = jax.ops.segment_sum(
                x.values * w[x.indices[:, 1] % 8], x.indices[:, 0], num_segments=4
            )
            return total + jnp.sum(per_example)

        return ds.reduce(jnp.float32(0), step)

    @fl.federated_computation(
        fl.type_at_server(fl.TensorType(np.float32, [8])),
        fl.type_at_clients(fl.SequenceType(element)),
    )
    def run(w, data):
        return fl.federated_map(score, (fl.federated_broadcast(w), data))

    rng = np.random.default_rng(0)

    def batch():
        idx = np.stack([np.repeat(np.arange(4), 3), rng.integers(0, vocab, 12)], 1)
        return {"x": fl.SparseTensor(idx, rng.random(12), (4, vocab)), "y": np.zeros(4, np.int32)}

    data = [[batch(), batch()] for _ in range(3)]
    w = np.arange(8, dtype=np.float32)
    got = [float(v) for v in run(w, data)]
    want = [
        sum(float(np.sum(b["x"].values * w[b["x"].indices[:, 1] % 8])) for b in client)
        for client in data
    ]
    np.testing.assert_allclose(got, want, rtol=1e-5)
    # The step sees the COO leaves only: no intermediate has a vocabulary-sized dimension.
    leaves = [jnp.zeros((12, 2), jnp.int32), jnp.zeros(12, jnp.float32), jnp.zeros(4, jnp.int32)]
    jaxpr = jax.make_jaxpr(score.part("step"))(
        jnp.zeros(8, jnp.float32), jnp.float32(0), *leaves, jnp.ones(4, jnp.float32)
    )
    assert vocab not in {d for v in jaxpr.jaxpr.eqns for o in v.outvars for d in o.aval.shape}
