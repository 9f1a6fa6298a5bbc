"""A small keyboard-style data set shared by the heavy-hitters tests."""

import collections

import numpy as np


def zipf_clients(num_clients=15, vocab_size=60, seed=0, max_words=25):
    rng = np.random.default_rng(seed)
    vocab = [f"w{i}é" for i in range(vocab_size)]
    vocab[2:2] = ["exactly8", "longer than eight bytes"]  # frequent: in every run
    p = 1.0 / np.arange(1, len(vocab) + 1)
    p /= p.sum()
    clients = [list(rng.choice(vocab, size=rng.integers(0, max_words), p=p)) for _ in range(num_clients)]
    clients[0] = []
    return [[str(w) for w in c] for c in clients]


def true_counts(clients, max_len):
    """Counts of the strings as the analytics see them (cut to max_len bytes)."""
    from fedlang.backends.jax import strings

    out = collections.Counter()
    for c in clients:
        for w in c:
            e = strings.encode([w], max_len)
            out[str(strings.decode(e.bytes, e.lengths)[0])] += 1
    return out
