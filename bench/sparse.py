"""Sparse vs dense client cost for a bag-of-words classifier (`fedlang.learning.sparse`).

    .venv/bin/python bench/sparse.py           # the table in bench/README.md

For vocabularies of 10^4, 10^5 and 10^6 words (4 classes, a client using 1,000
distinct words, 64 documents of 32 words, batches of 16):

* bytes uploaded per client: the sparse client's `SparseTensor` update (nbytes of its
  indices and values, measured on the computation's output) vs the dense update
  (`float32[vocab, 4]`), and per round for 100 clients;
* peak client memory: XLA's memory analysis (arguments + outputs + temporaries) of the
  compiled training step, and the size of what the client holds (its rows and update).
  The dense client is the same client work over the whole table (`K = vocab`).
"""

from __future__ import annotations

import platform

import jax
import numpy as np

import fedlang as fl
from fedlang.learning import sparse

CLASSES, ROWS, DOCS, WORDS, BATCH, CLIENTS = 4, 1000, 64, 32, 16, 100
ELEMENT = fl.to_type(
    {
        "ids": fl.TensorType(np.int32, [None, WORDS]),
        "counts": fl.TensorType(np.float32, [None, WORDS]),
        "y": fl.TensorType(np.int32, [None]),
    }
)


def client(vocab, rows, rng):
    keys = np.sort(rng.choice(vocab, rows, replace=False)).astype(np.int32)
    ids = rng.integers(0, rows, (DOCS, WORDS)).astype(np.int32)
    y = rng.integers(0, CLASSES, DOCS).astype(np.int32)
    counts = np.ones((DOCS, WORDS), np.float32)
    data = [
        {"ids": ids[i : i + BATCH], "counts": counts[i : i + BATCH], "y": y[i : i + BATCH]}
        for i in range(0, DOCS, BATCH)
    ]
    return keys, data


def measure(vocab, rows, dense_upload):
    """(upload bytes, step memory bytes, held bytes) of one client with `rows` rows."""
    bias = np.zeros(CLASSES, np.float32)
    work = sparse.build_sparse_client_work(
        vocab, CLASSES, rows, fl.to_type(bias), ELEMENT, sparse.bag_of_words_loss, 0.1
    )
    keys, data = client(vocab, rows, np.random.default_rng(0))
    table = np.zeros((rows, CLASSES), np.float32)
    out = work(table, bias, keys, data)
    update = out["rows"]
    upload = (table.nbytes if dense_upload else update.indices.nbytes + update.values.nbytes) + (
        bias.nbytes
    )
    batch = data[0]
    step_args = [table, bias, keys, table, bias, np.float32(0), np.float32(0)]
    step_args += [batch["ids"], batch["counts"], batch["y"], np.ones(BATCH, np.float32)]
    compiled = jax.jit(work.part("step")).lower(*step_args).compile()
    m = compiled.memory_analysis()
    step_bytes = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
    held = table.nbytes + keys.nbytes + update.indices.nbytes + update.values.nbytes
    return upload, step_bytes, held


def main():
    rows_out = []
    for vocab in (10**4, 10**5, 10**6):
        s_up, s_mem, s_held = measure(vocab, ROWS, dense_upload=False)
        d_up, d_mem, d_held = measure(vocab, vocab, dense_upload=True)
        rows_out.append((vocab, s_up, d_up, s_mem, d_mem, s_held, d_held))
    print(
        f"machine: {platform.machine()}, {platform.processor() or platform.system()}, "
        f"JAX {jax.__version__} on {jax.devices()[0].platform}"
    )
    print(
        "| vocabulary | upload / client, sparse | dense | ratio | upload / round (100 clients), "
        "sparse | dense | step memory, sparse | dense | client holds, sparse | dense |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for vocab, s_up, d_up, s_mem, d_mem, s_held, d_held in rows_out:
        print(
            f"| {vocab:,} | {s_up / 1e3:,.1f} kB | {d_up / 1e6:,.2f} MB | {d_up / s_up:,.0f}x | "
            f"{CLIENTS * s_up / 1e6:,.1f} MB | {CLIENTS * d_up / 1e6:,.0f} MB | "
            f"{s_mem / 1e3:,.0f} kB | {d_mem / 1e6:,.1f} MB | {s_held / 1e3:,.0f} kB | "
            f"{d_held / 1e6:,.1f} MB |"
        )
    return rows_out


if __name__ == "__main__":
    main()
