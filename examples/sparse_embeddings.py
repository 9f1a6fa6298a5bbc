"""Sparse FedAvg of a bag-of-words classifier over a 1,000,000-word vocabulary.

Each client uses at most 1,000 distinct words, so it downloads those rows of the
`[vocab, classes]` table (`federated_select`) and uploads a `SparseTensor` update of
those rows only; the server averages each row over the clients that touched it
(`federated_sparse_mean`). The data are synthetic and deterministic: documents mix
words drawn from a Zipf distribution over the whole vocabulary with words of their
class's topic, so the classes are learnable.

Run: `python examples/sparse_embeddings.py` (about 20 seconds on a laptop CPU).
"""

from __future__ import annotations

import time

import numpy as np

import fedlang as fl
from fedlang.learning import sparse


def make_client(rng, vocab, classes, topics, rows, docs, words):
    """One client: its padded keys and batches whose ids are local row positions."""
    pool_topic = [rng.choice(t, rows // (2 * classes), replace=False) for t in topics]
    pool_common = np.unique(np.minimum(rng.zipf(1.3, rows // 2), vocab) - 1)
    local = np.unique(np.concatenate([pool_common, *pool_topic]))[:rows]
    position = {int(w): i for i, w in enumerate(local)}
    y = rng.integers(0, classes, docs).astype(np.int32)
    ids = np.empty((docs, words), np.int32)
    for d in range(docs):
        half = words // 4
        topic = rng.choice(pool_topic[y[d]], half)
        common = rng.choice(pool_common, words - half)
        ids[d] = [position[int(w)] for w in np.concatenate([topic, common])]
    keys = sparse.pad_keys(local, rows)
    return keys, ids, y


def batches(ids, y, batch_size):
    counts = np.ones(ids.shape, np.float32)
    return [
        {
            "ids": ids[i : i + batch_size],
            "counts": counts[i : i + batch_size],
            "y": y[i : i + batch_size],
        }
        for i in range(0, len(y), batch_size)
    ]


def main(
    vocab: int = 1_000_000,
    classes: int = 4,
    num_clients: int = 50,
    rows_per_client: int = 1000,
    docs_per_client: int = 64,
    words_per_doc: int = 32,
    rounds: int = 5,
    seed: int = 0,
    verbose: bool = True,
) -> dict:
    """Trains for `rounds` rounds; returns accuracies, losses and upload sizes."""
    rng = np.random.default_rng(seed)
    topics = [rng.choice(vocab, rows_per_client // 2, replace=False) for _ in range(classes)]
    clients = [
        make_client(rng, vocab, classes, topics, rows_per_client, docs_per_client, words_per_doc)
        for _ in range(num_clients + 10)
    ]
    train, test = clients[:num_clients], clients[num_clients:]
    element = fl.to_type(
        {
            "ids": fl.TensorType(np.int32, [None, words_per_doc]),
            "counts": fl.TensorType(np.float32, [None, words_per_doc]),
            "y": fl.TensorType(np.int32, [None]),
        }
    )
    process = sparse.build_sparse_fed_avg(
        vocab, classes, rows_per_client, element, client_lr=0.5, server_lr=1.0
    )
    keys = [k for k, _, _ in train]
    data = [batches(ids, y, 16) for _, ids, y in train]

    def accuracy(state):
        table, bias = np.asarray(state.table), np.asarray(state.dense)
        correct = total = 0
        for k, ids, y in test:
            logits = table[k[ids]].sum(axis=1) + bias
            correct += int((logits.argmax(-1) == y).sum())
            total += len(y)
        return correct / total

    # One client's upload: K*classes entries, int64 indices [nnz, 2] + float32 values.
    nnz = rows_per_client * classes
    sparse_bytes = nnz * (2 * 8 + 4) + classes * 4
    dense_bytes = vocab * classes * 4 + classes * 4
    state = process.initialize()
    accuracies, losses = [accuracy(state)], []
    if verbose:
        print(f"round 0: test accuracy {accuracies[0]:.3f}")
    for r in range(rounds):
        start = time.perf_counter()
        state, metrics = process.next(state, keys, data)
        accuracies.append(accuracy(state))
        losses.append(float(metrics["loss"]))
        if verbose:
            print(
                f"round {r + 1}: loss {losses[-1]:.3f}  test accuracy {accuracies[-1]:.3f}  "
                f"uploaded {num_clients * sparse_bytes / 1e6:.1f} MB "
                f"(dense: {num_clients * dense_bytes / 1e6:.0f} MB)  {time.perf_counter() - start:.1f}s"
            )
    if verbose:
        print(
            f"bytes uploaded per client: sparse {sparse_bytes}, dense {dense_bytes} "
            f"({dense_bytes / sparse_bytes:.0f}x fewer)"
        )
    return {
        "accuracies": accuracies,
        "losses": losses,
        "sparse_bytes_per_client": sparse_bytes,
        "dense_bytes_per_client": dense_bytes,
    }


if __name__ == "__main__":
    main()
